"""Batches as columns: the structures, the vectorised msgpack decoder, and tg.Dataset's
``batch_format="columns"`` through real DataLoaders."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchgrain.columns import ColumnBatch, Ragged, gather_ranges
from torchgrain.formats.codecs import MsgpackCodec
from torchgrain.formats.msgpack_columns import decode_columns

CODEC = MsgpackCodec()


def pack(records):
    blobs = [CODEC.encode(r) for r in records]
    lengths = np.array([len(b) for b in blobs], dtype=np.int64)
    ends = np.cumsum(lengths)
    # Some slack between records, as a shared buffer of a batch may have.
    buf = np.frombuffer(b"".join(blobs), np.uint8)
    return buf, ends - lengths, ends


def same(a, b) -> bool:
    """Two columns hold the same values (arrays compare by dtype, shape and bytes)."""
    if isinstance(a, Ragged) or isinstance(b, Ragged):
        return isinstance(a, Ragged) and isinstance(b, Ragged) and a == b
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


int64s = st.integers(-(2**63), 2**63 - 1)
scalars = st.one_of(
    int64s.map(lambda v: ("int", v)),
    st.floats(allow_nan=False).map(lambda v: ("float", v)),
    st.booleans().map(lambda v: ("bool", v)),
    st.binary(max_size=300).map(lambda v: ("bytes", v)),
    st.text(max_size=40).map(lambda v: ("str", v)),
)
DTYPES = ["uint8", "int16", "int64", "float32", "float64", "bool", "<U3", "S2"]


@st.composite
def batches(draw):
    n = draw(st.integers(1, 12))
    keys = draw(
        st.lists(st.text("abcdefgh", min_size=1, max_size=6), min_size=1, max_size=5, unique=True)
    )
    records = [{} for _ in range(n)]
    for key in keys:
        kind = draw(
            st.sampled_from(["int", "float", "bool", "bytes", "str", "dense", "ragged", "mixed"])
        )
        for r in records:
            value: object
            if kind in ("dense", "ragged"):
                dt = np.dtype(DTYPES[len(key) % len(DTYPES)])
                shape = (2, 3) if kind == "dense" else (draw(st.integers(0, 5)),)
                value = np.zeros(shape, dt)
            elif kind == "mixed":
                value = draw(scalars)[1]
            else:
                value = draw(scalars.filter(lambda x, k=kind: x[0] == k))[1]
            r[key] = value
    return records


@settings(max_examples=300, deadline=None)
@given(records=batches())
def test_vectorised_decode_agrees_with_record_by_record(records):
    buf, starts, ends = pack(records)
    got = decode_columns(buf, starts, ends)
    decoded = [CODEC.decode(buf[s:e].tobytes()) for s, e in zip(starts, ends)]
    want = ColumnBatch.from_records(decoded)
    if got is None:
        return  # declined: the caller decodes record by record
    assert len(got) == len(want) and list(got) == list(want)
    for key in want:
        assert same(got[key], want[key]), key


def test_vectorised_decode_takes_the_common_records():
    rng = np.random.default_rng(0)
    records = [
        {
            "image": rng.integers(0, 256, (4, 4, 3), dtype=np.uint8),
            "label": int(rng.integers(-300, 70000)),
            "score": float(rng.random()),
            "ok": bool(i % 2),
            "payload": rng.bytes(int(rng.integers(0, 2000))) + b"\x00" * (i % 3),
            "name": f"img-{i}",
            "tokens": np.arange(i % 5, dtype=np.int32),
        }
        for i in range(40)
    ]
    buf, starts, ends = pack(records)
    cols = decode_columns(buf, starts, ends)
    assert cols is not None and len(cols) == 40
    assert cols["image"].shape == (40, 4, 4, 3) and cols["image"].dtype == np.uint8
    np.testing.assert_array_equal(cols["image"][7], records[7]["image"])
    assert cols["label"].tolist() == [r["label"] for r in records]
    assert cols["ok"].dtype == bool and cols["score"].dtype == np.float64
    assert cols["payload"].tolist() == [r["payload"] for r in records]  # trailing zeros kept
    assert cols["name"][3] == "img-3" and cols["tokens"][4].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "records",
    [
        [{"a": 1}, {"a": None}],  # a null
        [{"a": 1, "b": 2}, {"b": 2, "a": 1}],  # keys in another order
        [{"a": [1, 2]}, {"a": [3]}],  # nested lists
        [{"a": {"x": 1}}, {"a": {"x": 2}}],  # nested maps
        [{"a": 2**64 - 1}, {"a": 1}],  # beyond int64
        [{"a": 1}, {"a": "1"}],  # mixed families
    ],
)
def test_vectorised_decode_declines_what_it_cannot_represent(records):
    buf, starts, ends = pack(records)
    assert decode_columns(buf, starts, ends) is None


def test_vectorised_decode_never_reads_past_a_record():
    buf, starts, ends = pack([{"p": b"x" * 100}, {"p": b"y" * 100}])
    assert decode_columns(buf, starts, ends - 1) is None  # cut short: declined, no overrun
    assert decode_columns(buf, starts + 1, ends) is None


def test_ragged_and_batch_helpers():
    r = Ragged.from_values(["ä", "", "xyz"])
    assert r.tolist() == ["ä", "", "xyz"] and r.lengths().tolist() == [2, 0, 3]
    b = ColumnBatch.from_records([{"a": 1, "s": b"x"}, {"a": 2, "s": b"yz"}, {"a": 3}])
    assert b["a"].tolist() == [1, 2, 3] and b["s"] == [b"x", b"yz", None]
    assert [r["a"] for r in b.take([2, 0]).records()] == [3, 1]
    out = np.empty(6, np.uint8)
    buf = (np.arange(1000) % 256).astype(np.uint8)
    gather_ranges(buf, np.array([500, 0]), np.array([3, 3]), out)
    assert out.tolist() == [244, 245, 246, 0, 1, 2]


@settings(max_examples=200, deadline=None)
@given(
    ranges=st.lists(
        st.tuples(st.integers(0, 20_000), st.sampled_from([0, 1, 7, 60, 300, 5_000, 9_000])),
        min_size=1,
        max_size=40,
    )
)
def test_gather_ranges_copies_every_range_in_order(ranges):
    """Short, mid-sized and long ranges (fancy index, join, slice copies) all agree."""
    buf = np.random.default_rng(len(ranges)).integers(0, 256, 30_000, dtype=np.uint8)
    starts = np.array([s for s, _ in ranges], np.int64)
    lengths = np.array([n for _, n in ranges], np.int64)
    out = np.full(int(lengths.sum()) + 3, 7, np.uint8)
    gather_ranges(buf, starts, lengths, out)
    want = b"".join(buf[s : s + n].tobytes() for s, n in ranges)
    assert out[: len(want)].tobytes() == want and out[len(want) :].tolist() == [7, 7, 7]


# ------------------------------------------------------------------ sources and loaders
import datetime  # noqa: E402
import os  # noqa: E402

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

import torchgrain as tg  # noqa: E402


def _rows_equal(a, b) -> bool:
    """A row from a columns batch equals a per-record row (arrays by value)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_rows_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_rows_equal(a[k], b[k]) for k in a)
    return a == b


def _check_source(src, indices):
    batch = src.read_columns(indices)
    assert isinstance(batch, ColumnBatch) and len(batch) == len(indices)
    expected = src.__getitems__(indices)
    got = batch.records()
    assert list(batch) == list(expected[0]) if expected else True
    for g, e, i in zip(got, expected, indices):
        assert set(g) == set(e), i
        for k in e:
            assert _rows_equal(g[k], e[k]), (i, k, g[k], e[k])
    return batch


@pytest.fixture(scope="module")
def image_records():
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.integers(0, 255, (8, 8, 3), dtype=np.uint8),
            "label": i,
            "name": f"r{i}",
            "blob": bytes(rng.integers(0, 255, i % 7, dtype=np.uint8)) + b"\0" * (i % 3),
            "score": float(i) / 3,
        }
        for i in range(300)
    ]


@pytest.fixture(scope="module")
def arrayrecord_dir(tmp_path_factory, image_records):
    d = str(tmp_path_factory.mktemp("ar"))
    tg.write_array_record(image_records, d, num_shards=3)
    return d


def test_arrayrecord_read_columns_builds_arrays_straight_from_bytes(arrayrecord_dir):
    src = tg.ArrayRecordSource(arrayrecord_dir)
    idx = [299, 0, 5, 5, 150, 42]
    b = _check_source(src, idx)
    assert b["image"].shape == (6, 8, 8, 3) and b["image"].dtype == np.uint8
    assert b["label"].tolist() == idx
    assert isinstance(b["blob"], Ragged) and isinstance(b["name"], Ragged)
    assert b["name"].kind == "str" and b["name"][0] == "r299"
    assert _check_source(src, []).num_rows == 0


def _parquet_table(n: int) -> pa.Table:
    rng = np.random.default_rng(1)
    img = rng.integers(0, 255, (n, 4, 3), dtype=np.uint8)
    return pa.table(
        {
            "label": pa.array(np.arange(n, dtype=np.int32)),
            "x": pa.array(rng.random(n)),
            "flag": pa.array(np.arange(n) % 2 == 0),
            "name": pa.array([f"n{i}" for i in range(n)]),
            "blob": pa.array([b"\0" * (i % 4) + b"x" for i in range(n)], pa.large_binary()),
            "vec": pa.array([rng.random(3) for _ in range(n)], pa.list_(pa.float32(), 3)),
            "ragged": pa.array([list(range(i % 5)) for i in range(n)], pa.list_(pa.int64())),
            "image": pa.array([row.tolist() for row in img], pa.list_(pa.list_(pa.uint8()))),
            "maybe": pa.array([None if i % 3 == 0 else i for i in range(n)], pa.int64()),
            "when": pa.array(
                [datetime.datetime(2020, 1, 1) + datetime.timedelta(seconds=i) for i in range(n)]
            ),
            "cat": pa.array([["a", "b", "c"][i % 3] for i in range(n)]).dictionary_encode(),
            "nested": pa.array([{"a": i, "b": [i, i]} for i in range(n)]),
        }
    )


def test_parquet_read_columns_agrees_with_records_for_every_type(tmp_path):
    n = 120
    table = _parquet_table(n)
    for part in range(3):
        d = tmp_path / f"part={part}"
        d.mkdir()
        pq.write_table(table.slice(part * 40, 40), d / "f.parquet", row_group_size=15)
    src = tg.ParquetSource(str(tmp_path), cache_bytes=0)
    idx = [119, 0, 3, 3, 60, 44, 17, 100, 101]
    b = _check_source(src, idx)
    assert b["label"].dtype == np.int32 and b["label"].tolist() == idx
    assert b["vec"].shape == (9, 3) and b["vec"].dtype == np.float32
    assert b["image"].shape == (9, 4, 3) and b["image"].dtype == np.uint8
    assert isinstance(b["ragged"], Ragged) and b["ragged"].kind == "array"
    assert isinstance(b["blob"], Ragged) and b["blob"][3] == b"\0\0\0x"
    assert isinstance(b["maybe"], list) and b["maybe"][1] is None
    assert b["part"].tolist() == [2, 0, 0, 0, 1, 1, 0, 2, 2]
    # The same with a warm cache, and a whole row group.
    src = tg.ParquetSource(str(tmp_path))
    src.__getitems__(list(range(15)))
    _check_source(src, list(range(14, -1, -1)))
    _check_source(src, idx)


@pytest.mark.parametrize("workers,context", [(0, None), (2, "fork"), (2, "spawn")])
def test_columns_through_the_dataloader(arrayrecord_dir, image_records, workers, context):
    src = tg.ArrayRecordSource(arrayrecord_dir)
    src[0]  # the parent has read a record before the workers start (the usual sequence)
    ds = tg.Dataset(src, batch_format="columns")
    sampler = tg.GlobalShuffleSampler(ds, seed=3)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=32,
        sampler=sampler,
        num_workers=workers,
        multiprocessing_context=context,
        persistent_workers=workers > 0,
    )
    one_segment = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = []
        for batch in loader:
            assert isinstance(batch, dict) and not isinstance(batch, ColumnBatch)
            assert isinstance(batch["image"], torch.Tensor)
            assert batch["image"].dtype == torch.uint8 and batch["image"].shape[1:] == (8, 8, 3)
            if workers:  # moved from the worker through shared memory, not pickled bytes
                assert in_shared_memory(batch["image"])
                # ... through one segment, each column a storage of its own bytes (the
                # small ones, label and blob, copied out of it: kept, they keep no slot;
                # the first batch sizes the slot)
                one_segment += all(
                    t.untyped_storage().nbytes() == t.numel() * t.element_size()
                    for t in (batch["image"], batch["label"], batch["blob"].values)
                )
            labels = batch["label"].tolist()
            for j, label in enumerate(labels):
                rec = image_records[label]
                assert torch.equal(batch["image"][j], torch.from_numpy(rec["image"]))
                assert batch["blob"][j] == rec["blob"]
                assert batch["name"][j] == rec["name"]
            seen += labels
        assert sorted(seen) == list(range(len(image_records)))
        assert seen == [int(i) for i in sampler_order(sampler, epoch)]
    if workers:
        assert one_segment >= 2 * len(loader) - 2 * workers


def in_shared_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s data lies in a mapping of shared memory (a /dev/shm segment as
    torch makes them, or a memfd as torchgrain's worker slots are), read from the
    kernel's list of this process's mappings."""
    if t.is_shared():
        return True
    ptr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return len(fields) == 6 and fields[5].startswith(("/dev/shm/", "/memfd:"))
    return False


def sampler_order(sampler, epoch):
    sampler.set_epoch(epoch)
    return list(iter(sampler))


def _add_one(rec):
    rec["label"] = rec["label"] + 1000
    return rec


def _flip(batch):
    batch["image"] = batch["image"][:, ::-1].copy()
    batch["double"] = batch["label"] * 2
    return batch


def _noisy(rec, rng):
    rec["noise"] = float(rng.random())
    return rec


@pytest.mark.parametrize("workers", [0, 2])
def test_columns_with_transforms(arrayrecord_dir, image_records, workers):
    src = tg.ArrayRecordSource(arrayrecord_dir)
    base = tg.Dataset(src, batch_format="columns")
    ds = base.map_batch(_flip).map(_add_one).random_map(_noisy, seed=5)
    loader = torch.utils.data.DataLoader(ds, batch_size=50, num_workers=workers)
    got = {}
    for batch in loader:
        for j, label in enumerate(batch["label"].tolist()):
            rec = image_records[label - 1000]
            assert torch.equal(batch["image"][j], torch.from_numpy(rec["image"][::-1].copy()))
            assert batch["double"][j].item() == 2 * (label - 1000)
            got[label - 1000] = batch["noise"][j].item()
    assert sorted(got) == list(range(len(image_records)))
    # random_map draws from the record's own stream: the same as in records mode.
    rec_ds = tg.Dataset(src).map_batch(lambda rs: rs).map(_add_one).random_map(_noisy, seed=5)
    for i in (0, 17, 299):
        assert rec_ds[i]["noise"] == got[i]


def test_columns_map_batch_must_keep_rows(arrayrecord_dir):
    ds = tg.Dataset(tg.ArrayRecordSource(arrayrecord_dir), batch_format="columns")
    with pytest.raises(TypeError, match="returned 2 rows"):
        ds.map_batch(lambda b: b.take([0, 1])).__getitems__([0, 1, 2])
    with pytest.raises(TypeError, match="must return"):
        ds.map_batch(lambda b: [1, 2, 3]).__getitems__([0, 1, 2])
    with pytest.raises(ValueError, match="batch_format"):
        tg.Dataset(tg.ArrayRecordSource(arrayrecord_dir), batch_format="arrow")


def test_parquet_columns_with_workers_and_block_shuffle(tmp_path):
    n = 400
    table = _parquet_table(n).select(["label", "x", "name", "image"])
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=50)
    src = tg.ParquetSource(str(tmp_path))
    ds = tg.Dataset(src, batch_format="columns")
    sampler = tg.BlockShuffleSampler(ds, seed=0, window=2)
    loader = torch.utils.data.DataLoader(ds, batch_size=64, sampler=sampler, num_workers=2)
    seen = []
    for batch in loader:
        assert batch["image"].shape[1:] == (4, 3)
        assert batch["label"].dtype == torch.int32
        seen += batch["label"].tolist()
    assert seen == list(iter(sampler))
    assert sorted(seen) == list(range(n))


def test_columns_from_a_source_without_read_columns():
    class Plain:
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"x": np.full(3, i, np.int16), "y": i}

    ds = tg.Dataset(Plain(), batch_format="columns")
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert batch["x"].shape == (4, 3) and batch["y"].tolist() == [0, 1, 2, 3]
    assert os.getpid()  # keeps the import used


def test_buffer_pool_recycles_only_unreferenced_buffers():
    import gc

    from torchgrain.columns import BufferPool

    pool = BufferPool(min_bytes=1024, max_bytes=1 << 20)
    assert pool.empty((10,), np.uint8) is None  # too small to pool
    a = pool.empty((32, 32), np.int32)
    a[...] = 7
    view = a[3:5]
    tensor = torch.from_numpy(a)[1:2]
    del a
    gc.collect()
    assert pool.idle_bytes == 0  # a view and a tensor still use it
    b = pool.empty((32, 32), np.int32)  # must not reuse the buffer in use
    b[...] = 1
    assert int(view.min()) == 7 and int(tensor.min()) == 7
    del view, b
    gc.collect()
    assert pool.idle_bytes == 4096  # b's buffer is back; a's still held by the tensor
    del tensor
    gc.collect()
    assert pool.idle_bytes == 8192
    c = pool.empty((4096,), np.uint8)
    assert pool.idle_bytes == 4096 and c.flags.writeable
    big = [pool.empty((1 << 19,), np.uint8) for _ in range(3)]
    del big
    gc.collect()
    assert pool.idle_bytes <= 1 << 20  # bounded
