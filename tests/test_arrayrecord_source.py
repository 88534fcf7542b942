import glob
import os
import pickle
import re
import shutil

import numpy as np
import pytest

import torchgrain as tg
from tests.conftest import make_records
from torchgrain.errors import CorruptDataError, DatasetNotFoundError, RecordDecodeError


def same_record(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k])
            assert a[k].dtype == b[k].dtype
        else:
            assert a[k] == b[k]


def test_write_then_read_preserves_order_and_values(small_dataset):
    d, recs = small_dataset
    src = tg.ArrayRecordSource(d)
    assert len(src) == 100 and src.num_shards == 3
    assert sorted(src.index.counts.tolist()) == [33, 33, 34]
    for i in (0, 1, 33, 34, 66, 67, 99):
        same_record(src[i], recs[i])
    assert src.keys == ["image", "label", "id", "score"]
    assert src.schema == {"image": "uint8[4,4,3]", "label": "int", "id": "str", "score": "float"}
    assert src.codec.name == "msgpack"


def test_getitems_returns_request_order_with_duplicates(small_dataset):
    d, recs = small_dataset
    src = tg.ArrayRecordSource(d)
    req = [99, 0, 50, 0, 34, 33, 99]
    for i, rec in zip(req, src.__getitems__(req)):
        same_record(rec, recs[i])
    assert src.__getitems__([]) == []
    assert len(src.__getitems__(np.array([5, 6], dtype=np.uint32))) == 2


@pytest.mark.parametrize("bad", [-1, 100, 10**12, 2**64 + 3, -(2**70)])
def test_out_of_range_and_negative_indices_raise_index_error(small_dataset, bad):
    src = tg.ArrayRecordSource(small_dataset[0])
    with pytest.raises(IndexError, match=str(bad)):
        src[bad]
    with pytest.raises(IndexError, match=str(bad)):
        src.__getitems__([0, bad])


def test_huge_unsigned_index_named_as_given(small_dataset):
    src = tg.ArrayRecordSource(small_dataset[0])
    bad = 2**63 + 5  # would wrap to a negative int64
    with pytest.raises(IndexError, match=str(bad)):
        src.__getitems__(np.array([1, bad], dtype=np.uint64))


@pytest.mark.parametrize("bad", [1.0, "3", None, True])
def test_non_integer_indices_raise_type_error(small_dataset, bad):
    src = tg.ArrayRecordSource(small_dataset[0])
    with pytest.raises(TypeError):
        src[bad]
    with pytest.raises(TypeError):
        src.__getitems__([0, bad])


def test_iterator_input_is_dealt_round_robin(tmp_path):
    recs = make_records(10)
    tg.write_array_record(iter(recs), tmp_path, num_shards=3)
    src = tg.ArrayRecordSource(tmp_path)
    assert src.index.counts.tolist() == [4, 3, 3]
    # shard 0 holds records 0, 3, 6, 9
    assert [src[i]["id"] for i in range(4)] == ["r0", "r3", "r6", "r9"]


def test_more_shards_than_records(tmp_path):
    tg.write_array_record(make_records(2), tmp_path, num_shards=5)
    src = tg.ArrayRecordSource(tmp_path)
    assert len(src) == 2 and src.num_shards == 5
    assert [src[i]["id"] for i in range(2)] == ["r0", "r1"]


def test_no_temporary_files_left_and_refuses_overwrite(small_dataset):
    d, _ = small_dataset
    names = sorted(os.listdir(d))
    assert names == [
        "data-00000-of-00003.array_record",
        "data-00001-of-00003.array_record",
        "data-00002-of-00003.array_record",
        "torchgrain.json",
        "torchgrain.tgindex",
    ]
    with pytest.raises(FileExistsError):
        tg.write_array_record(make_records(3), d)
    tg.write_array_record(make_records(3), d, overwrite=True, num_shards=1)
    assert len(tg.ArrayRecordSource(d)) == 3
    assert len(glob.glob(os.path.join(d, "*.array_record"))) == 1


def test_failed_write_leaves_no_dataset(tmp_path):
    def records():
        yield {"x": 1}
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError):
        tg.write_array_record(records(), tmp_path / "out", num_shards=2)
    assert os.listdir(tmp_path / "out") == []


def test_unencodable_value_names_the_record(tmp_path):
    with pytest.raises(TypeError, match="record 1"):
        tg.write_array_record([{"x": 1}, {"x": object()}], tmp_path)


def test_opening_without_manifest_glob_file_and_list(small_dataset):
    d, recs = small_dataset
    files = sorted(glob.glob(os.path.join(d, "*.array_record")))
    by_glob = tg.ArrayRecordSource(os.path.join(d, "*.array_record"))
    by_list = tg.ArrayRecordSource(files)
    by_file = tg.ArrayRecordSource(files[1])
    assert len(by_glob) == len(by_list) == 100
    assert len(by_file) == 33
    same_record(by_glob[77], recs[77])
    same_record(by_file[0], recs[33])
    assert by_glob.codec.name == "msgpack"  # sniffed
    os.unlink(os.path.join(d, "torchgrain.json"))
    no_manifest = tg.ArrayRecordSource(d)
    assert len(no_manifest) == 100
    same_record(no_manifest[50], recs[50])
    assert no_manifest.schema["image"] == "uint8[4,4,3]"


def test_raw_codec_and_foreign_files(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "foreign.array_record")
    w = ArrayRecordWriter(path, "group_size:1")
    for i in range(5):
        w.write(b"\x0a" + bytes([i]) * 3)
    w.close()
    src = tg.ArrayRecordSource(path)
    assert src.codec.name == "raw"
    assert src[2] == {"bytes": b"\x0a\x02\x02\x02"}
    assert src.keys == ["bytes"]
    with pytest.raises(RecordDecodeError, match=r"record 2 .*foreign.array_record.*row 2"):
        tg.ArrayRecordSource(path, codec="msgpack")[2]


def test_source_pickles_small_and_works_after_unpickling(small_dataset):
    d, recs = small_dataset
    src = tg.ArrayRecordSource(d)
    src[0]
    blob = pickle.dumps(src)
    assert len(blob) < 4096
    same_record(pickle.loads(blob)[42], recs[42])


def test_missing_paths_raise_dataset_not_found(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        tg.ArrayRecordSource(tmp_path / "nope")
    with pytest.raises(DatasetNotFoundError, match="holds no ArrayRecord"):
        tg.ArrayRecordSource(tmp_path)
    with pytest.raises(DatasetNotFoundError, match="matched no"):
        tg.ArrayRecordSource(str(tmp_path / "*.array_record"))


def test_manifest_pointing_to_missing_shard(small_dataset):
    d, _ = small_dataset
    os.unlink(os.path.join(d, "data-00002-of-00003.array_record"))
    with pytest.raises(DatasetNotFoundError, match="data-00002-of-00003"):
        tg.ArrayRecordSource(d)


def test_corrupt_manifest(small_dataset):
    d, _ = small_dataset
    with open(os.path.join(d, "torchgrain.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CorruptDataError, match=r"torchgrain\.json"):
        tg.ArrayRecordSource(d)


def test_not_an_array_record_file(tmp_path):
    p = tmp_path / "fake.array_record"
    p.write_bytes(b"hello world" * 100)
    with pytest.raises(CorruptDataError, match=r"fake\.array_record"):
        len(tg.ArrayRecordSource(p))


def test_group_size_and_compression_options(tmp_path):
    recs = make_records(50)
    for comp in ("zstd", "snappy", "brotli", "uncompressed"):
        d = tmp_path / comp
        tg.write_array_record(recs, d, num_shards=2, group_size=8, compression=comp)
        src = tg.ArrayRecordSource(d)
        for i, rec in zip(range(0, 50, 7), src.__getitems__(list(range(0, 50, 7)))):
            same_record(rec, recs[i])
    with pytest.raises(ValueError):
        tg.write_array_record(recs, tmp_path / "x", compression="lz4")


def test_overwrite_replaces_a_damaged_dataset(small_dataset):
    d, _ = small_dataset
    with open(os.path.join(d, "torchgrain.json"), "w") as f:
        f.write("{broken")
    tg.write_array_record(make_records(7), d, num_shards=2, overwrite=True)
    src = tg.ArrayRecordSource(d)
    assert len(src) == 7 and src.num_shards == 2
    assert sorted(os.listdir(d))[-2:] == ["torchgrain.json", "torchgrain.tgindex"]
    assert all(s.checksum.startswith("blake2b-records:") for s in src.manifest.shards)


def test_block_shuffle_over_arrayrecord_chunks_in_workers(tmp_path):
    # ArrayRecord chunks are the blocks: group_size records each (the last of a shard
    # shorter). Look at the data first, then start forked workers, as users do.
    import torch

    recs = [{"id": i, "x": np.full(3, i, np.int16)} for i in range(95)]
    d = str(tmp_path / "chunks")
    tg.write_array_record(recs, d, num_shards=2, group_size=10)
    src = tg.ArrayRecordSource(d)
    assert src[0]["id"] == 0
    offsets = src.block_offsets()
    counts = src.index.counts.tolist()  # 47 and 48 records: chunks of 10, then the rest
    expect = [0, 10, 20, 30, 40, 47, 57, 67, 77, 87, 95]
    assert counts == [47, 48] and offsets.tolist() == expect
    ds = tg.Dataset(src)
    sampler = tg.BlockShuffleSampler(ds, window=2, seed=1, batch_size=8, num_workers=2)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=8,
        sampler=sampler,
        num_workers=2,
        collate_fn=lambda b: b,
        multiprocessing_context="fork",
    )
    got = [r["id"] for batch in loader for r in batch]
    assert sorted(got) == list(range(95)) and got != sorted(got)
    assert got == sampler.indices().tolist()
    for rec in recs[:3]:
        same_record(src[rec["id"]], rec)


# ------------------------------------------------------------ untrusted manifests
def _point_manifest_at(root, name):
    import json

    path = os.path.join(root, "torchgrain.json")
    with open(path) as f:
        doc = json.load(f)
    doc["shards"][0]["path"] = name
    with open(path, "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize(
    "name",
    ["../secret/data.array_record", "sub/../../secret/data.array_record", "ABSOLUTE", "s3://b/x"],
)
def test_manifest_shard_paths_stay_inside_the_dataset(tmp_path, name):
    root = str(tmp_path / "ds")
    tg.write_array_record([{"i": i} for i in range(4)], root)
    secret = tmp_path / "secret"
    secret.mkdir()
    shutil.copy(
        os.path.join(root, tg.ArrayRecordSource(root).paths[0]), secret / "data.array_record"
    )
    if name == "ABSOLUTE":
        name = str(secret / "data.array_record")
    _point_manifest_at(root, name)
    with pytest.raises(tg.UnsafePathError, match=re.escape(name)) as e:
        tg.ArrayRecordSource(root)
    assert "allow_external_paths=True" in str(e.value)
    if not name.startswith("s3://"):
        # The user opts in: the manifest is trusted and read as written.
        src = tg.ArrayRecordSource(root, allow_external_paths=True)
        assert [r["i"] for r in src.__getitems__(range(4))] == [0, 1, 2, 3]


def test_a_symlink_inside_the_dataset_is_the_users_choice(tmp_path):
    root = str(tmp_path / "ds")
    tg.write_array_record([{"i": i} for i in range(4)], root)
    elsewhere = tmp_path / "bigdisk"
    elsewhere.mkdir()
    shard = os.path.basename(tg.ArrayRecordSource(root).paths[0])
    shutil.move(os.path.join(root, shard), elsewhere / shard)
    os.symlink(elsewhere, os.path.join(root, "shards"))
    _point_manifest_at(root, f"shards/{shard}")
    src = tg.ArrayRecordSource(root)
    assert [r["i"] for r in src.__getitems__([3, 0])] == [3, 0]


def _index_in_child(src, queue):
    # In the forked child: read, then report which index arrays the reader uses.
    recs = src.__getitems__([4, 0])
    reader = src._reader(0)
    queue.put((id(reader.record_offsets), [r["id"] for r in recs], reader.num_records))


def test_forked_child_reuses_the_parents_parsed_index(tmp_path):
    # The footer parsed in the parent is not parsed again in a forked child (it keeps
    # sharing the parent's pages), and the child's reader has its own handles.
    import multiprocessing

    recs = [{"id": i} for i in range(20)]
    d = str(tmp_path / "idx")
    tg.write_array_record(recs, d, num_shards=1)
    src = tg.ArrayRecordSource(d)
    assert src[3]["id"] == 3
    parent = src._reader(0)
    ctx = multiprocessing.get_context("fork")
    for _ in range(2):
        q = ctx.Queue()
        p = ctx.Process(target=_index_in_child, args=(src, q))
        p.start()
        got = q.get(timeout=60)
        p.join(60)
        assert p.exitcode == 0
        assert got == (id(parent.record_offsets), [4, 0], 20)
    assert src.__getitems__([19, 3]) == [{"id": 19}, {"id": 3}]


@pytest.mark.parametrize("max_open", [None, 3])
def test_batches_across_shards_respect_max_open_files(tmp_path, max_open):
    """Without the mapped batch path, a batch over 12 shards is read shard by shard:
    never more readers open than allowed."""
    recs = make_records(120)
    tg.write_array_record(recs, tmp_path / "ds", num_shards=12)
    src = tg.ArrayRecordSource(tmp_path / "ds", max_open_files=max_open, max_mapped_shards=0)
    batch = np.random.default_rng(0).permutation(120)
    assert [r["id"] for r in src.__getitems__(batch)] == [recs[i]["id"] for i in batch]
    assert src.read_columns(batch)["id"].tolist() == [recs[i]["id"] for i in batch]
    assert len(src._proc().readers) == (12 if max_open is None else max_open)
