"""Datasets of many shards: the node-shared index, batches across shards, limits.

The dataset index (:mod:`torchgrain.sources.node_index`) is written beside the shards by
torchgrain's writer and converter, or built once per machine into an index directory
for files from other tools and TFRecord files; every process maps it. Batches are read
across all shards at once through one address range (:mod:`torchgrain.io.region`).
An index file is untrusted input: damaged, stale or hostile ones end in a rebuild or an
error, never in other bytes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import torchgrain as tg
from torchgrain.errors import CorruptDataError
from torchgrain.formats.index_file import IndexFile, IndexFileWriter
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io import limits
from torchgrain.io.region import supported
from torchgrain.sources import node_index
from torchgrain.sources.node_index import COUNTERS, INDEX_NAME

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_region = pytest.mark.skipif(not supported(), reason="needs Linux x86-64/arm64")


def record(shard: int, i: int) -> bytes:
    return b"%d/%d:" % (shard, i) + bytes([i % 251]) * (i % 23)


def write_foreign(directory, counts, options="group_size:1") -> list[str]:
    """ArrayRecord files written by the C++ writer (no manifest, no index)."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for s, n in enumerate(counts):
        path = os.path.join(directory, f"part-{s:05d}.array_record")
        w = ArrayRecordWriter(path, options if isinstance(options, str) else options[s])
        for i in range(n):
            w.write(record(s, i))
        w.close()
        paths.append(path)
    return paths


def expected(counts) -> list[bytes]:
    return [record(s, i) for s, n in enumerate(counts) for i in range(n)]


def raw(src, idx) -> list[bytes]:
    return [r["bytes"] for r in src.__getitems__(idx)]


def run_python(code: str, *args: str) -> dict:
    """Run ``code`` in a new Python process (this checkout); its last stdout line is JSON."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------ written beside the shards
def test_the_writer_puts_a_checksummed_index_beside_the_shards(tmp_path):
    recs = [{"i": i} for i in range(50)]
    tg.write_array_record(recs, tmp_path / "ds", num_shards=4)
    with open(tmp_path / "ds" / "torchgrain.json") as f:
        entry = json.load(f)["index"]
    path = str(tmp_path / "ds" / INDEX_NAME)
    assert entry["path"] == INDEX_NAME and entry["num_bytes"] == os.path.getsize(path)
    assert entry["file_checksum"] == tg.formats.checksums.file_checksum(path)
    before = dict(COUNTERS)
    src = tg.ArrayRecordSource(tmp_path / "ds", index_dir=tmp_path / "idx")
    assert src._dindex.path == path  # mapped where it lies: nothing built
    assert COUNTERS["arrayrecord_builds"] == before["arrayrecord_builds"]
    assert [r["i"] for r in src.__getitems__([49, 0, 13, 37])] == [49, 0, 13, 37]
    # Verified once per machine: a second open finds the stamp.
    tg.ArrayRecordSource(tmp_path / "ds", index_dir=tmp_path / "idx")
    assert COUNTERS["verified"] == before["verified"] + 1


def test_the_converter_records_an_index_for_the_shards_it_writes(tmp_path):
    tg.write_array_record([{"i": i} for i in range(40)], tmp_path / "a", num_shards=3)
    m = tg.convert(tmp_path / "a", tmp_path / "b", num_shards=5)
    entry = m.extra["index"]
    assert entry["path"] == INDEX_NAME
    src = tg.ArrayRecordSource(tmp_path / "b", index_dir=tmp_path / "idx")
    assert src._dindex.path == str(tmp_path / "b" / INDEX_NAME)
    assert src._dindex.counts.tolist() == [s.num_records for s in m.shards]
    assert [r["i"] for r in src.__getitems__(list(range(39, -1, -3)))] == list(range(39, -1, -3))


# ------------------------------------------------------------ built once per machine
_OPEN_AND_COUNT = """
    import json, sys
    import torchgrain as tg
    from torchgrain.sources.node_index import COUNTERS
    kind, path, index_dir = sys.argv[1:4]
    cls = tg.ArrayRecordSource if kind == "ar" else tg.TFRecordSource
    src = cls(path, codec="raw", index_dir=index_dir)
    n = len(src)
    got = [r["bytes"].hex() for r in src.__getitems__(list(range(n - 1, -1, -7)))]
    print(json.dumps({"counters": COUNTERS, "records": got, "index": (src.__dict__.get(
        "_dindex") if kind == "ar" else src.format.shards.index).path}))
"""


def test_foreign_files_are_indexed_once_per_machine_and_reused_by_other_processes(tmp_path):
    counts = [5, 0, 17, 3]
    write_foreign(tmp_path / "ds", counts)
    idx = str(tmp_path / "idx")
    want = [b.hex() for b in expected(counts)]
    first = run_python(_OPEN_AND_COUNT, "ar", str(tmp_path / "ds"), idx)
    second = run_python(_OPEN_AND_COUNT, "ar", str(tmp_path / "ds"), idx)
    assert first["counters"]["arrayrecord_builds"] == 1
    assert second["counters"]["arrayrecord_builds"] == 0
    assert second["counters"]["verified"] == 0  # the builder's stamp says it is whole
    assert first["index"] == second["index"] and first["index"].startswith(idx)
    assert first["records"] == second["records"] == want[::-1][::7]


def test_tfrecord_offsets_are_indexed_once_per_machine_and_reused_by_other_processes(tmp_path):
    d = tmp_path / "tf"
    d.mkdir()
    for s in range(3):
        write_tfrecord([record(s, i) for i in range(4 + 3 * s)], d / f"x-{s}.tfrecord")
    want = [b.hex() for b in expected([4, 7, 10])]
    idx = str(tmp_path / "idx")
    first = run_python(_OPEN_AND_COUNT, "tf", str(d), idx)
    second = run_python(_OPEN_AND_COUNT, "tf", str(d), idx)
    assert (first["counters"]["tfrecord_builds"], second["counters"]["tfrecord_builds"]) == (1, 0)
    assert first["index"] == second["index"] and first["index"].startswith(idx)
    assert first["records"] == second["records"] == want[::-1][::7]
    src = tg.TFRecordSource(d, codec="raw", index_dir=idx)
    assert len(pickle.dumps(src)) < 4096  # the index file's name, not its offsets


def _open_concurrently(path, index_dir, kind, queue):
    from torchgrain.sources.node_index import COUNTERS

    cls = tg.ArrayRecordSource if kind == "ar" else tg.TFRecordSource
    key = f"{'arrayrecord' if kind == 'ar' else 'tfrecord'}_builds"
    before = COUNTERS[key]  # what the parent counted before forking
    src = cls(path, codec="raw", index_dir=index_dir)
    queue.put(
        (COUNTERS[key] - before, [r["bytes"] for r in src.__getitems__(list(range(len(src))))])
    )


@pytest.mark.parametrize("kind", ["ar", "tf"])
def test_concurrent_builders_publish_one_whole_index(tmp_path, kind):
    counts = [30] * 12
    if kind == "ar":
        write_foreign(tmp_path / "ds", counts)
    else:
        (tmp_path / "ds").mkdir()
        for s, n in enumerate(counts):
            write_tfrecord(
                [record(s, i) for i in range(n)], tmp_path / "ds" / f"x-{s:02d}.tfrecord"
            )
    idx = str(tmp_path / "idx")
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    ps = [
        ctx.Process(target=_open_concurrently, args=(str(tmp_path / "ds"), idx, kind, q))
        for _ in range(4)
    ]
    for p in ps:
        p.start()
    results = [q.get(timeout=300) for _ in ps]
    for p in ps:
        p.join(60)
        assert p.exitcode == 0
    assert sum(builds for builds, _ in results) == 1
    assert all(recs == expected(counts) for _, recs in results)
    left = [n for n in os.listdir(idx) if ".tmp-" in n]
    assert left == []


def test_an_unwritable_index_dir_keeps_the_index_in_memory(tmp_path):
    counts = [4, 6]
    write_foreign(tmp_path / "ds", counts)
    (tmp_path / "afile").write_bytes(b"")
    with pytest.warns(UserWarning, match="memory"):
        src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=tmp_path / "afile" / "x")
    assert src._dindex.path is None
    assert raw(src, [9, 0]) == [expected(counts)[9], expected(counts)[0]]


# ------------------------------------------------------------ stale, damaged, hostile
def test_a_rewritten_foreign_shard_gets_a_fresh_index(tmp_path):
    write_foreign(tmp_path / "ds", [5, 5])
    idx = tmp_path / "idx"
    src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=idx)
    assert raw(src, [7]) == [record(1, 2)]
    tmp = tmp_path / "new"
    write_foreign(tmp, [8])
    os.replace(tmp / "part-00000.array_record", tmp_path / "ds" / "part-00001.array_record")
    before = COUNTERS["arrayrecord_builds"]
    src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=idx)
    assert COUNTERS["arrayrecord_builds"] == before + 1
    assert len(src) == 13 and raw(src, [12, 5]) == [record(0, 7), record(0, 0)]


def _read_in_child(blob, queue):
    src = pickle.loads(blob)
    try:
        queue.put(("ok", src.__getitems__([7])[0]["bytes"]))
    except CorruptDataError as e:
        queue.put(("error", str(e)))


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_shard_replaced_after_the_dataset_was_opened_is_refused_not_misread(tmp_path, start):
    write_foreign(tmp_path / "ds", [5, 5])
    src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=tmp_path / "idx")
    blob = pickle.dumps(src)
    # Another file of the same records but another layout (group size 2) in its place.
    other = write_foreign(tmp_path / "other", [0, 5], options="group_size:2")[1]
    os.replace(other, tmp_path / "ds" / "part-00001.array_record")
    ctx = multiprocessing.get_context(start)
    q = ctx.Queue()
    p = ctx.Process(target=_read_in_child, args=(blob, q))
    p.start()
    status, what = q.get(timeout=300)
    p.join(60)
    assert status == "error", what
    assert "part-00001.array_record" in what and "changed after the dataset was opened" in what


def test_a_shard_replaced_after_the_manifest_with_as_many_records_is_refused(tmp_path):
    # As many records, laid out differently: the index does not describe the file.
    tg.write_array_record([{"i": i} for i in range(20)], tmp_path / "ds", num_shards=2)
    tg.write_array_record(
        [{"i": -i, "pad": "x" * i} for i in range(10)], tmp_path / "other", num_shards=1
    )
    shutil.copy(
        tmp_path / "other" / "data-00000-of-00001.array_record",
        tmp_path / "ds" / "data-00001-of-00002.array_record",
    )
    src = tg.ArrayRecordSource(tmp_path / "ds", index_dir=tmp_path / "idx")
    assert src[3]["i"] == 3
    with pytest.raises(CorruptDataError, match=r"data-00001-of-00002.*replaced after"):
        src[13]
    with pytest.raises(CorruptDataError, match=r"data-00001-of-00002.*replaced after"):
        src.__getitems__([0, 13])


def test_a_manifest_that_names_its_shards_differently_does_not_get_the_index_beside_them(
    tmp_path,
):
    """The manifest is edited to list the two shards the other way round (as many records
    each, so the counts agree): the index beside them describes the old names and is not
    used; the records come back in the manifest's order."""
    tg.write_array_record([{"i": i} for i in range(20)], tmp_path / "ds", num_shards=2)
    m = json.loads((tmp_path / "ds" / "torchgrain.json").read_text())
    m["shards"].reverse()
    (tmp_path / "ds" / "torchgrain.json").write_text(json.dumps(m))
    with pytest.warns(UserWarning, match="shards of other names"):
        src = tg.ArrayRecordSource(tmp_path / "ds", index_dir=tmp_path / "idx")
    want = list(range(10, 20)) + list(range(10))
    assert [r["i"] for r in src.__getitems__(list(range(20)))] == want
    assert [src[k]["i"] for k in range(20)] == want


def test_an_index_beside_the_shards_that_fails_its_checksum_is_not_used(tmp_path):
    tg.write_array_record([{"i": i} for i in range(30)], tmp_path / "ds", num_shards=3)
    path = tmp_path / "ds" / INDEX_NAME
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40  # inside the arrays
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="not using the dataset's index file"):
        src = tg.ArrayRecordSource(tmp_path / "ds", index_dir=tmp_path / "idx")
    assert src._dindex.path.startswith(str(tmp_path / "idx"))
    assert [r["i"] for r in src.__getitems__(list(range(29, -1, -1)))] == list(range(29, -1, -1))


@needs_region
def test_a_region_refuses_a_file_of_another_size(tmp_path):
    from torchgrain.io.region import ShardRegion

    paths = write_foreign(tmp_path / "ds", [3, 4000])
    sizes = np.array([os.path.getsize(p) for p in paths])
    region = ShardRegion(paths, sizes[::-1].copy())  # each size recorded for the other file
    with pytest.raises(CorruptDataError, match=r"part-00000.*its index says"):
        region.acquire(np.array([0]))
    assert region.mapped == 0


def test_a_reader_given_an_index_refuses_a_file_it_does_not_describe(tmp_path):
    from torchgrain.formats.arrayrecord_file import ArrayRecordFile

    a, b = write_foreign(tmp_path / "ds", [5, 5])
    write_foreign(tmp_path / "other", [7])
    ix = node_index.build_arrayrecord_index([a, b])
    assert ArrayRecordFile(b, footer=ix.footer(1)).read([4]) == [record(1, 4)]
    other = str(tmp_path / "other" / "part-00000.array_record")
    with pytest.raises(CorruptDataError, match="changed after the dataset's index was made"):
        ArrayRecordFile(other, footer=ix.footer(1)).read([4])


def test_the_index_tells_a_replaced_shard_from_the_one_it_describes(tmp_path):
    a, b = write_foreign(tmp_path / "ds", [5, 4000])
    ix = node_index.build_arrayrecord_index([a, b], mtimes=[os.stat(a).st_mtime_ns, 0])
    with open(a, "rb") as f:
        view = memoryview(f.read())
    assert ix.mismatch(0, os.stat(a), view) is None
    assert "bytes" in ix.mismatch(1, os.stat(a), view)  # another size than shard 1's
    (c,) = write_foreign(tmp_path / "c", [6])  # as long a file, another footer
    with open(c, "rb") as f:
        other = f.read()
    assert len(other) == len(view)
    assert "footer" in ix.mismatch(0, os.stat(a), memoryview(other))
    os.utime(a, ns=(1, 1))
    assert "modification time" in ix.mismatch(0, os.stat(a), view)


def test_a_cached_index_of_other_files_under_the_right_name_is_rebuilt(tmp_path):
    write_foreign(tmp_path / "a", [5, 5])
    write_foreign(tmp_path / "b", [6, 6])
    tg.ArrayRecordSource(tmp_path / "a", codec="raw", index_dir=tmp_path / "ia")
    tg.ArrayRecordSource(tmp_path / "b", codec="raw", index_dir=tmp_path / "ib")
    shutil.copy(_cached_index(tmp_path / "ia"), _cached_index(tmp_path / "ib"))
    with pytest.warns(UserWarning, match="made for other files"):
        src = tg.ArrayRecordSource(tmp_path / "b", codec="raw", index_dir=tmp_path / "ib")
    assert raw(src, list(range(12))) == expected([6, 6])


def test_an_index_file_replaced_after_the_dataset_was_opened_is_refused(tmp_path):
    write_foreign(tmp_path / "ds", [5, 5])
    src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=tmp_path / "i")
    blob = pickle.dumps(src)
    path = src._dindex.path
    shutil.copy(path, path + ".copy")
    os.replace(path + ".copy", path)  # the same bytes, another file
    with pytest.raises(CorruptDataError, match="replaced after the dataset was opened"):
        pickle.loads(blob)


def _cached_index(idx_dir) -> str:
    # (a TFRecord file's own offsets are entries beside it: *.offsets.tgindex)
    (name,) = [n for n in os.listdir(idx_dir) if n.endswith(".tgindex") and ".offsets." not in n]
    return os.path.join(idx_dir, name)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_damage_to_a_cached_index_never_yields_other_bytes(tmp_path_factory, data):
    base = tmp_path_factory.mktemp("damage")
    counts = [9, 14, 1]
    write_foreign(base / "ds", counts)
    idx = base / "idx"
    tg.ArrayRecordSource(base / "ds", codec="raw", index_dir=idx)
    path = _cached_index(idx)
    with open(path, "rb") as f:
        blob = bytearray(f.read())
    if data.draw(st.booleans(), label="truncate"):
        blob = blob[: data.draw(st.integers(0, len(blob) - 1), label="keep")]
    else:
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            at = data.draw(st.integers(0, len(blob) - 1), label="at")
            blob[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    with open(path, "r+b") as f:  # in place, as a damaged disk or a stray write would
        f.truncate(0)
        f.write(blob)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = tg.ArrayRecordSource(base / "ds", codec="raw", index_dir=idx)
    assert raw(src, list(range(len(src)))) == expected(counts)


def _swap_two_offsets(arrays, shard=0, a=10, b=33):
    """Records a and b of ``shard`` are as long (see :func:`record`): swapping their
    chunks' offsets gives an index every per-read check accepts, and other bytes."""
    at = int(arrays["chunk_base"][shard]) + shard
    off = arrays["offsets"]
    off[at + a], off[at + b] = int(off[at + b]), int(off[at + a])


def test_swapped_offsets_in_a_cached_index_are_caught_by_its_checksum(tmp_path):
    assert len(record(0, 10)) == len(record(0, 33))
    counts = [40, 3]
    write_foreign(tmp_path / "ds", counts)
    idx = tmp_path / "idx"
    tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=idx)
    path = _cached_index(idx)
    f = IndexFile.open(path, "array_record")
    arrays = {"offsets": np.array(f["offsets"]), "chunk_base": f["chunk_base"]}
    _swap_two_offsets(arrays)
    with open(path, "rb") as fh:
        header = json.loads(fh.read(f._body)[16:])
    (where,) = [e[3] for e in header["arrays"] if e[0] == "offsets"]
    with open(path, "r+b") as out:  # the bytes changed in place, the header left as it was
        out.seek(where)
        out.write(arrays["offsets"].astype("<i8").tobytes())
    with pytest.warns(UserWarning, match="do not match its checksum"):
        src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=idx)
    assert raw(src, [10, 33]) == [record(0, 10), record(0, 33)]


def test_a_forged_index_beside_the_shards_is_caught_by_the_manifest_checksum(tmp_path):
    recs = [{"i": i, "pad": b"x" * (i % 23)} for i in range(40)]
    tg.write_array_record(recs, tmp_path / "ds", num_shards=1)
    path = str(tmp_path / "ds" / INDEX_NAME)
    _forge_index(path, _swap_two_offsets)  # well formed, its own checksum valid
    assert IndexFile.open(path, "array_record").verify()
    with pytest.warns(UserWarning, match="not using the dataset's index file"):
        src = tg.ArrayRecordSource(tmp_path / "ds", index_dir=tmp_path / "idx")
    assert [r["i"] for r in src.__getitems__([10, 33])] == [10, 33]


def _forge_index(path, change) -> None:
    """Rewrite index file ``path`` with ``change(arrays)`` applied, as a well-formed file
    with a valid checksum (what a hostile writer would make)."""
    f = IndexFile.open(path, "array_record")
    arrays = {k: np.array(v) for k, v in f.arrays.items()}
    change(arrays)
    columns = {k: (v.dtype.str.replace("=", "<"), v.shape[1:]) for k, v in arrays.items()}
    columns = {k: ("|u1" if d.endswith("u1") else "<i8", t) for k, (d, t) in columns.items()}
    w = IndexFileWriter(path, "array_record", columns)
    for k, v in arrays.items():
        w.append(k, v)
    meta = dict(f.meta)
    os.unlink(path)
    w.publish(meta)


@needs_region
@pytest.mark.parametrize("where", ["past the footer", "before the file", "backwards"])
def test_index_offsets_out_of_range_raise_naming_the_index_and_record(tmp_path, where):
    counts = [6, 6]
    write_foreign(tmp_path / "ds", counts)
    idx = tmp_path / "idx"
    src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=idx)
    path = _cached_index(idx)
    entry = int(src._dindex.starts(1)) + 2  # record 2 of shard 1: index 8

    def change(a):
        a["offsets"][entry] = {
            "past the footer": int(a["file_size"][1]) + 4096,
            "before the file": -(1 << 40),
            "backwards": int(a["offsets"][entry + 1]) + 1,
        }[where]

    _forge_index(path, change)
    src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=idx)
    # (the chunk before ends where the forged one begins: record 7 is not read here)
    assert raw(src, [0, 9]) == [record(0, 0), record(1, 3)]
    with pytest.raises(CorruptDataError, match=r"index file .*shard 1.*record index 8"):
        raw(src, [0, 8])
    with pytest.raises(CorruptDataError, match=r"record index 8"):
        src[8]


def test_an_index_that_places_a_record_in_the_wrong_chunk_is_refused(tmp_path):
    counts = [9, 9]
    write_foreign(tmp_path / "ds", counts, options="group_size:3")
    idx = tmp_path / "idx"
    src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=idx)
    assert raw(src, [16, 1]) == [record(1, 7), record(0, 1)]

    def change(a):
        a["group_size"][1] = 2  # chunks of 3 records said to hold 2

    _forge_index(_cached_index(idx), change)
    src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=idx)
    assert raw(src, [1]) == [record(0, 1)]
    with pytest.raises(CorruptDataError, match=r"shard 1: places record 7 in no chunk"):
        raw(src, [16])


def test_an_index_whose_counts_disagree_with_its_entries_is_rebuilt(tmp_path):
    counts = [6, 6]
    write_foreign(tmp_path / "ds", counts)
    idx = tmp_path / "idx"
    tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=idx)
    path = _cached_index(idx)

    def change(a):
        a["record_offsets"][int(a["chunk_base"][1]) + 1 + 6] = 9  # shard 1's sentinel

    _forge_index(path, change)
    with pytest.warns(UserWarning, match="rebuilding a damaged dataset index"):
        src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=idx)
    assert raw(src, list(range(12))) == expected(counts)


def test_tfrecord_index_offsets_are_bounded_before_use(tmp_path):
    d = tmp_path / "tf"
    d.mkdir()
    write_tfrecord([record(0, i) for i in range(5)], d / "a.tfrecord")
    idx = tmp_path / "idx"
    src = tg.TFRecordSource(d, codec="raw", index_dir=idx)
    path = _cached_index(idx)
    f = IndexFile.open(path, "tfrecord")
    arrays = {k: np.array(v) for k, v in f.arrays.items()}
    arrays["offsets"][3] = -40
    w = IndexFileWriter(path + ".new", "tfrecord", {k: ("<i8", ()) for k in arrays})
    for k, v in arrays.items():
        w.append(k, v)
    w.publish(dict(f.meta))
    os.replace(path + ".new", path)
    src = tg.TFRecordSource(d, codec="raw", index_dir=idx)
    assert src[1] == {"bytes": record(0, 1)}
    with pytest.raises(CorruptDataError, match=r"row 3 .*record index 3"):
        src[3]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 200))
def test_arbitrary_index_files_only_raise_corrupt_data(blob, cut):
    import tempfile

    good = os.path.join(tempfile.mkdtemp(), "g.tgindex")
    w = IndexFileWriter(good, "demo", {"a": ("<i8", ()), "b": ("|u1", (3,))})
    w.append("a", np.arange(7))
    w.append("b", np.ones((2, 3), np.uint8))
    w.publish({"x": 1})
    with open(good, "rb") as f:
        whole = f.read()
    for payload in (blob, whole[: -cut or None] + blob[:8]):
        path = good + ".bad"
        with open(path, "wb") as f:
            f.write(payload)
        try:
            got = IndexFile.open(path, "demo")
        except CorruptDataError:
            continue
        for name, arr in got.arrays.items():  # whatever opened lies inside the file
            assert arr.nbytes <= os.path.getsize(path), name


# ------------------------------------------------------------ batches across shards
@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Foreign files of every layout the batch path meets: one-record zstd chunks, large
    records cut by block headers, uncompressed and snappy files, group sizes > 1, empty
    records and empty shards."""
    d = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)
    options = [
        "group_size:1",
        "group_size:1,uncompressed",
        "group_size:1,snappy",
        "group_size:3",
        "group_size:1,zstd:1",
    ]
    paths, sizes = [], []
    for s in range(60):
        opt = options[s % len(options)]
        n = int(rng.integers(0, 40)) if s % 7 else 0
        path = str(d / f"part-{s:05d}.array_record")
        w = ArrayRecordWriter(path, opt)
        for i in range(n):
            size = int(rng.choice([0, 3, 16, 1000, 30_000, 70_000]))
            w.write(b"%d.%d|" % (s, i) + rng.bytes(size))
        w.close()
        paths.append(path)
        sizes.append(n)
    truth = []
    for path in paths:
        r = ArrayRecordReader(path)
        truth.extend(r.read_all() if r.num_records() else [])
        r.close()
    return str(d), truth


@needs_region
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_batches_across_many_shards_equal_the_cpp_reader_byte_for_byte(mixed, tmp_path, data):
    d, truth = mixed
    src = tg.ArrayRecordSource(d, codec="raw", index_dir=tmp_path / "idx")
    idx = data.draw(st.lists(st.integers(0, len(truth) - 1), min_size=1, max_size=300))
    assert raw(src, idx) == [truth[i] for i in idx]
    i = data.draw(st.integers(0, len(truth) - 1))
    assert src[i]["bytes"] == truth[i]


@needs_region
def test_few_map_slots_keep_batches_right(tmp_path):
    counts = [7] * 20
    write_foreign(tmp_path / "ds", counts)
    src = tg.ArrayRecordSource(
        tmp_path / "ds", codec="raw", index_dir=tmp_path / "i", max_mapped_shards=3
    )
    want = expected(counts)
    rng = np.random.default_rng(0)
    for _ in range(30):  # two shards a batch: mapped, the least recently used unmapped
        s = rng.choice(20, 2, replace=False)
        b = np.concatenate([rng.integers(0, 7, 4) + 7 * s[0], rng.integers(0, 7, 4) + 7 * s[1]])
        assert raw(src, b) == [want[i] for i in b]
        assert src._mapped[0].mapped <= 3
    everything = rng.permutation(140)  # more shards than slots: shard by shard
    assert raw(src, everything) == [want[i] for i in everything]
    assert src._mapped[0].maps_done > 3


# ------------------------------------------------------------ workers
def _child_maps(src, queue):
    region = src._mapped[0]
    done = region.maps_done
    recs = [r["bytes"] for r in src.__getitems__(list(range(len(src))))]
    queue.put((region.maps_done - done, recs))


@needs_region
def test_forked_children_use_the_parents_maps(tmp_path):
    counts = [3] * 16
    write_foreign(tmp_path / "ds", counts)
    src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=tmp_path / "i")
    assert raw(src, list(range(48))) == expected(counts)  # maps all 16 shards
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_maps, args=(src, q))
    p.start()
    new_maps, recs = q.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    assert new_maps == 0 and recs == expected(counts)


def _as_list(batch):
    return batch


@pytest.mark.parametrize("start", ["fork", "spawn"])
@pytest.mark.parametrize("written", ["torchgrain", "foreign"])
def test_dataloader_workers_read_many_shards_right(tmp_path, start, written):
    if written == "torchgrain":
        recs = [{"i": i, "b": b"x" * (i % 50)} for i in range(600)]
        tg.write_array_record(recs, tmp_path / "ds", num_shards=64)
        src = tg.ArrayRecordSource(tmp_path / "ds", index_dir=tmp_path / "i")
        want = list(range(600))
        key = "i"
    else:
        counts = [9] * 64
        write_foreign(tmp_path / "ds", counts)
        src = tg.ArrayRecordSource(tmp_path / "ds", codec="raw", index_dir=tmp_path / "i")
        want = expected(counts)
        key = "bytes"
    src.__getitems__([0, len(src) - 1])  # read in the parent before starting workers
    ds = tg.Dataset(src)
    sampler = tg.GlobalShuffleSampler(ds, seed=3)
    loader = DataLoader(
        ds,
        batch_size=32,
        sampler=sampler,
        num_workers=2,
        multiprocessing_context=start,
        collate_fn=_as_list,
    )
    got = [None] * len(src)
    order = sampler.indices(0, len(src)).tolist()
    k = 0
    for batch in loader:
        for r in batch:
            got[order[k]] = r[key]
            k += 1
    assert got == want


# ------------------------------------------------------------ limits and pickles
def test_max_open_files_follows_the_open_files_limit(tmp_path):
    write_foreign(tmp_path / "ds", [2] * 300)
    out = run_python(
        """
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))  # soft = hard: no room
        import torchgrain as tg
        src = tg.ArrayRecordSource(sys.argv[1], codec="raw", index_dir=sys.argv[2],
                                   max_mapped_shards=0)
        recs = [r["bytes"].hex() for r in src.__getitems__(list(range(600)))]
        print(json.dumps({"max": src.max_open_files, "open": len(src._proc().readers),
                          "records": recs}))
        """,
        str(tmp_path / "ds"),
        str(tmp_path / "idx"),
    )
    assert out["records"] == [b.hex() for b in expected([2] * 300)]
    assert out["max"] < 300 and out["open"] <= out["max"]


def test_the_soft_open_files_limit_is_raised_toward_the_hard_one():
    out = run_python(
        """
        import json, resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        from torchgrain.io import limits
        n = limits.default_max_open_files(2000)
        print(json.dumps({"soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                          "hard": hard, "n": n}))
        """
    )
    hard = out["hard"] if out["hard"] != -1 else 1 << 20
    assert out["soft"] == min(hard, 2000 * 2 * 4 + 256) and out["n"] >= 1
    assert limits.map_count_limit() >= 1


def test_a_pickled_source_of_ten_thousand_shards_carries_no_per_record_arrays(tmp_path):
    # 10,000 names of one file (hard links): the shards cost no disk.
    one = write_foreign(tmp_path / "one", [50])[0]
    d = tmp_path / "ds"
    d.mkdir()
    for s in range(10_000):
        os.link(one, d / f"part-{s:05d}.array_record")
    src = tg.ArrayRecordSource(d, codec="raw", index_dir=tmp_path / "idx")
    assert len(src) == 500_000
    blob = pickle.dumps(src)
    per_shard = len(src.paths[0]) + 16
    assert len(blob) < 10_000 * per_shard + 65536  # the paths, and nothing per record
    back = pickle.loads(blob)
    assert raw(back, [499_999, 7]) == [record(0, 49), record(0, 7)]
    assert back._dindex.path == src._dindex.path


def test_the_chunk_cache_check_reads_the_index_not_every_shard(tmp_path):
    """At a pass start the sampler's process checks whether the pass fits the chunk
    cache: from the mapped dataset index, opening no shard (with one-record chunks it
    used to build arrays of every record from every shard's footer: O(records) private
    memory and a reader per shard at every pass start)."""
    counts = [30, 50, 7]
    write_foreign(tmp_path / "g", counts, options="group_size:4")
    src = tg.ArrayRecordSource(tmp_path / "g", codec="raw", index_dir=tmp_path / "idx")
    [blocks] = [b for b in src.cache_blocks() if b.cache == "chunk cache"]
    ends, base = [], 0
    for n in counts:
        ends += [base + min(k + 4, n) for k in range(0, n, 4)]
        base += n
    assert blocks.offsets.tolist() == [0, *ends]
    sizes = [int(blocks.nbytes(c)) for c in range(len(ends))]
    records = np.diff([0, *ends])
    assert all((s > 0) == (r > 1) for s, r in zip(sizes, records)), (sizes, records)
    assert not src._proc().readers  # no shard was opened
    write_foreign(tmp_path / "one", [40, 40])
    single = tg.ArrayRecordSource(tmp_path / "one", codec="raw", index_dir=tmp_path / "idx")
    assert [b for b in single.cache_blocks() if b.cache == "chunk cache"] == []
    assert not single._proc().readers
