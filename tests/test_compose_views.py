"""Concatenations, subsets and splits (torchgrain.compose: view, concat, subset)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import torchgrain as tg
from torchgrain.compose.subset import split_counts
from torchgrain.errors import CorruptDataError
from torchgrain.formats.codecs import get_codec
from torchgrain.formats.tfrecord import write_tfrecord


def _recs(lo: int, hi: int) -> list[dict]:
    return [{"i": i, "s": f"r{i}", "x": np.full(2, i, np.float32)} for i in range(lo, hi)]


def _three_formats(tmp_path) -> tuple[list, list[dict]]:
    """An ArrayRecord (2 shards), a Parquet (2 row groups) and a TFRecord source: records
    0-9, 10-16 and 17-21."""
    recs = _recs(0, 22)
    tg.write_array_record(recs[:10], tmp_path / "ar", num_shards=2)
    tg.write_parquet(recs[10:17], tmp_path / "pq", row_group_size=4)
    os.makedirs(tmp_path / "tf")
    codec = get_codec("msgpack")
    write_tfrecord([codec.encode(r) for r in recs[17:]], tmp_path / "tf" / "a.tfrecord")
    sources = [
        tg.ArrayRecordSource(tmp_path / "ar"),
        tg.ParquetSource(tmp_path / "pq"),
        tg.TFRecordSource(tmp_path / "tf", codec="msgpack"),
    ]
    return sources, recs


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


class Counting(tg.Source):
    """Records ``{"i": base + j}``; counts its batched reads and the epochs and
    read-ahead orders it is given."""

    def __init__(self, n: int, base: int = 0) -> None:
        self.n, self.base = n, base
        self.calls: list[list[int]] = []
        self.epochs: list[int] = []
        self.orders: list[list[int]] = []

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, indices):
        idx = tg.ShardIndex([self.n]).check(indices).tolist()
        self.calls.append(idx)
        return [{"i": self.base + j} for j in idx]

    keys = property(lambda self: ["i"])
    schema = property(lambda self: {"i": "int"})

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def read_ahead(self, order, start, count, position):
        if order is not None:
            self.orders.append(np.asarray(order(0, 6)).tolist())
        return [f"fit{self.base}"]


def keyed_noise(rec: dict, rng: np.random.Generator) -> dict:
    return {"i": rec["i"], "noise": rng.random()}


# ----------------------------------------------------------------------- concat
def test_concat_of_arrayrecord_parquet_and_tfrecord_is_the_list_concatenation(tmp_path):
    sources, recs = _three_formats(tmp_path)
    ds = tg.concat(sources)
    assert len(ds) == len(recs) and ds.keys == ["i", "s", "x"]
    assert ds.schema == {"i": "int", "s": "str", "x": "float32[?]"}
    assert all(_same(ds[i], recs[i]) for i in range(len(recs)))
    order = np.random.default_rng(0).permutation(len(recs)).tolist()
    assert all(_same(a, recs[i]) for a, i in zip(ds.__getitems__(order), order))
    cols = tg.Dataset(ds.source, batch_format="columns").__getitems__(order)[0]
    assert cols["i"].tolist() == order and cols["s"].tolist() == [f"r{i}" for i in order]
    for k in range(3):
        with pytest.raises(IndexError, match="record index"):
            ds.__getitems__([0, len(recs) + k])
    with pytest.raises(IndexError):
        ds[-1]
    with pytest.raises(TypeError):
        ds.__getitems__([1.0])


def test_concat_schema_mismatch_names_both_datasets_and_what_differs(tmp_path):
    tg.write_array_record([{"i": 1, "s": "a"}], tmp_path / "a")
    tg.write_parquet([{"i": "one", "t": "b"}], tmp_path / "b")
    with pytest.raises(tg.SchemaMismatchError) as e:
        tg.concat(
            {"web": tg.ArrayRecordSource(tmp_path / "a"), "books": tg.ParquetSource(tmp_path / "b")}
        )
    msg = str(e.value)
    for part in ("'web'", "'books'", "ArrayRecordSource", "ParquetSource", "['s']", "['t']"):
        assert part in msg
    assert "'i': int in" in msg and "str in" in msg
    # A Dataset whose transforms may change its records is not compared.
    fixed = tg.Dataset(tg.ParquetSource(tmp_path / "b")).map(lambda r: {"i": 1, "s": r["t"]})
    ds = tg.concat([tg.ArrayRecordSource(tmp_path / "a"), fixed])
    assert ds.__getitems__([1, 0]) == [{"i": 1, "s": "b"}, {"i": 1, "s": "a"}]


def test_concat_source_field_holds_position_or_name():
    a, b = Counting(2), Counting(3, base=100)
    ds = tg.concat([a, b], source_field="src")
    assert ds.__getitems__([4, 0]) == [{"i": 102, "src": 1}, {"i": 0, "src": 0}]
    assert ds.schema == {"i": "int", "src": "int"}
    named = tg.concat({"small": a, "big": b}, source_field="src")
    assert named[1] == {"i": 1, "src": "small"} and named.schema["src"] == "str"
    cols = tg.Dataset(named.source, batch_format="columns").__getitems__([3, 0, 2])[0]
    assert cols["src"].tolist() == ["big", "small", "big"] and cols["i"].tolist() == [101, 0, 100]
    with pytest.raises(ValueError, match="already a key"):
        tg.concat([a, b], source_field="i")


def test_concat_reads_each_child_once_per_batch_in_request_order():
    a, b, c = Counting(5), Counting(0, base=50), Counting(5, base=100)
    ds = tg.concat([a, b, c])
    got = ds.__getitems__([7, 1, 9, 0, 5, 3])
    assert [r["i"] for r in got] == [102, 1, 104, 0, 100, 3]
    assert a.calls == [[1, 0, 3]] and c.calls == [[2, 4, 0]] and b.calls == []
    # The columns path too: one read_columns (here: one __getitems__) per child.
    tg.Dataset(ds.source, batch_format="columns").__getitems__([6, 2, 8])
    assert a.calls[1:] == [[2]] and c.calls[1:] == [[1, 3]]


def test_concat_forwards_epoch_and_read_ahead_with_child_orders():
    a, c = Counting(5), Counting(5, base=100)
    ds = tg.concat([a, c])
    ds.set_epoch(3)
    assert a.epochs == [3] and c.epochs == [3]
    order = np.array([7, 1, 9, 0, 5, 3])
    fits = ds.read_ahead(lambda lo, hi: order[lo:hi], 0, 6, lambda: 0)
    assert a.orders == [[1, 0, 3]] and c.orders == [[2, 4, 0]]
    assert fits == ["fit0", "fit100"]


def test_block_shuffle_sampler_over_a_concat_stays_in_the_childrens_blocks(tmp_path):
    sources, recs = _three_formats(tmp_path)
    ds = tg.concat(sources)
    blocks = ds.block_offsets()
    expected = [sources[0].block_offsets(), sources[1].block_offsets() + 10]
    expected.append(sources[2].block_offsets() + 17)
    assert blocks.tolist() == np.unique(np.concatenate(expected)).tolist()
    assert blocks[0] == 0 and blocks[-1] == len(recs) and 14 in blocks  # a Parquet row group
    sampler = tg.BlockShuffleSampler(ds, window=2, seed=1)
    order = list(sampler)
    assert sorted(order) == list(range(len(recs)))
    with pytest.raises(TypeError, match="dataset '1'"):
        tg.concat([sources[0], tg.Dataset([{"i": 1}])]).block_offsets()


def test_global_shuffle_over_a_concat_in_two_spawned_workers(tmp_path, monkeypatch):
    """Each record exactly once, and random_map keyed by the concatenated index: the same
    values as in this process. The concat holds split parts and a mapped selection, so
    spawned workers unpickle every view."""
    from torchgrain.compose import subset

    monkeypatch.setattr(subset, "MAPPED_ABOVE", 4)
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    sources, recs = _three_formats(tmp_path)
    parts = tg.split(sources[0], {"a": 0.7, "b": 0.3}, seed=3)
    picked = tg.Dataset(sources[1]).select([6, 0, 5, 1, 4, 2, 3])
    assert picked.source.rows.index.path is not None
    ds = tg.concat([parts["b"], picked, parts["a"], sources[2]], source_field="part")
    ds = ds.random_map(keyed_noise, seed=5)
    assert len(pickle.dumps(ds)) < 64 << 10
    sampler = tg.GlobalShuffleSampler(ds, seed=2)
    sampler.set_epoch(1)
    loader = DataLoader(
        ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context="spawn"
    )
    batches = list(loader)
    same = tg.GlobalShuffleSampler(len(ds), seed=2)
    same.set_epoch(1)
    order = list(same)
    got_i = torch.cat([b["i"] for b in batches]).tolist()
    assert sorted(got_i) == list(range(len(recs)))
    assert got_i == [ds[k]["i"] for k in order]
    noise = torch.cat([b["noise"] for b in batches]).tolist()
    assert noise == [ds[k]["noise"] for k in order]
    ds.set_epoch(2)
    assert ds[0]["noise"] != noise[order.index(0)]


# ------------------------------------------------------------- subsets, splits
def test_select_reads_the_given_indices_and_checks_them_once():
    ds = tg.Dataset([{"i": i} for i in range(10)]).random_map(keyed_noise, seed=1)
    sub = ds.select(np.array([7, 2, 2, 9], dtype=np.uint8))
    assert [r["i"] for r in sub.__getitems__([3, 0, 1, 2])] == [9, 7, 2, 2]
    assert sub[0]["noise"] == ds[7]["noise"]  # the parent's transforms, keyed by its index
    assert len(sub) == 4 and sub.block_offsets().tolist() == [0, 4]
    with pytest.raises(IndexError, match=r"select: record index 10 out of range .*10 records"):
        ds.select([3, 10])
    with pytest.raises(IndexError, match="select: record index -1"):
        ds.select([-1])
    with pytest.raises(TypeError, match="select: record indices must be integers"):
        ds.select([1.5])
    with pytest.raises(ValueError, match="one-dimensional"):
        ds.select([[1, 2]])
    with pytest.raises(IndexError):
        sub[4]


def test_a_large_selection_is_a_mapped_file_that_pickles_small(tmp_path, monkeypatch):
    from torchgrain.compose import subset

    monkeypatch.setattr(subset, "MAPPED_ABOVE", 1000)
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    rows = np.random.default_rng(0).integers(0, 50, 5000)
    sub = tg.Dataset([{"i": i} for i in range(50)]).select(rows)
    index = sub.source.rows.index
    assert index is not None and index.path.startswith(str(tmp_path / "cache"))
    assert [r["i"] for r in sub.__getitems__(range(5000))] == rows.tolist()
    clone = pickle.loads(pickle.dumps(sub.source.rows))
    assert len(pickle.dumps(sub.source.rows)) < 1000
    assert clone.take(np.arange(5000)).tolist() == rows.tolist()
    again = tg.Dataset([{"i": i} for i in range(50)]).select(rows)
    assert again.source.rows.index.path == index.path  # the same file, not another


def test_a_large_selection_is_checked_and_stored_a_chunk_at_a_time(tmp_path, monkeypatch):
    import tracemalloc

    from torchgrain.compose import subset

    monkeypatch.setattr(subset, "MAPPED_ABOVE", 10)
    monkeypatch.setattr(subset, "_CHUNK", 1 << 16)
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    rows = np.lib.format.open_memmap(tmp_path / "rows.npy", "w+", np.uint32, (4_000_000,))
    rows[:] = np.arange(4_000_000) % 997
    ds = tg.Dataset([{"i": i} for i in range(1000)])
    tracemalloc.start()
    try:
        sub = ds.select(rows)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The index file writer's copy buffers (16 MiB whatever the size) and a chunk; the
    # whole array as int64 was 32 MB, then copies of it.
    assert peak < 24_000_000, peak
    last = len(rows) - 1
    assert [r["i"] for r in sub.__getitems__([0, 996, 997, last])] == [0, 996, 0, last % 997]
    rows[5] = 1000
    with pytest.raises(IndexError, match="select: record index 1000 out of range"):
        ds.select(rows)


def test_a_selection_file_truncated_while_mapped_is_refused(tmp_path, monkeypatch):
    from torchgrain.compose import subset

    monkeypatch.setattr(subset, "MAPPED_ABOVE", 10)
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    sub = tg.Dataset([{"i": i} for i in range(50)]).select(np.arange(49, -1, -1))
    assert sub[0] == {"i": 49}
    with open(sub.source.rows.index.path, "r+b") as fh:
        fh.truncate(100)  # the entries past it then read as zeros (SIGBUS past a page)
    with pytest.raises(CorruptDataError, match="select-"):
        sub[0]


@given(
    n=st.integers(0, 200),
    weights=st.lists(st.integers(0, 10), min_size=1, max_size=4).filter(any),
    scale=st.sampled_from([1.0, 0.5, None]),
    seed=st.integers(0, 2**64 - 1),
)
@settings(max_examples=25, deadline=None)
def test_split_parts_are_disjoint_exact_and_cover(n, weights, scale, seed):
    if scale is None:  # counts
        total = sum(weights)
        fractions = {f"p{k}": w * n // total for k, w in enumerate(weights)}
    else:
        fractions = {f"p{k}": w / sum(weights) * scale for k, w in enumerate(weights)}
    parts = tg.split(list(range(n)), fractions, seed=seed)
    assert list(parts) == list(fractions)
    got = {k: p.__getitems__(list(range(len(p)))) for k, p in parts.items()}
    everything = [i for rows in got.values() for i in rows]
    assert len(everything) == len(set(everything))  # disjoint
    counts = {k: len(rows) for k, rows in got.items()}
    assert counts == split_counts(n, fractions)
    if scale is None:
        assert counts == fractions
    else:
        assert all(abs(counts[k] - f * n) < 1 for k, f in fractions.items())
        if scale == 1.0:
            assert sorted(everything) == list(range(n))  # covers
        else:
            assert sum(counts.values()) == int(scale * n)
    assert (
        tg.split(list(range(n)), fractions, seed=seed)["p0"].__getitems__(list(range(counts["p0"])))
        == got["p0"]
    )  # the same parts from the seed alone


def test_split_counts_rounding_and_bad_fractions():
    assert split_counts(7, {"a": 0.5, "b": 0.5}) == {"a": 4, "b": 3}
    assert split_counts(100, {"train": 0.98, "val": 0.02}) == {"train": 98, "val": 2}
    for bad, err in [
        ({"a": 0.7, "b": 0.4}, ValueError),
        ({"a": -0.1}, ValueError),
        ({"a": 3, "b": 0.5}, TypeError),
        ({"a": 8, "b": 3}, ValueError),
        ({}, ValueError),
        ({"a": True}, TypeError),
    ]:
        with pytest.raises(err):
            split_counts(10, bad)
    a = tg.split(list(range(50)), {"x": 0.5, "y": 0.5}, seed=1)["x"]
    b = tg.split(list(range(50)), {"x": 0.5, "y": 0.5}, seed=2)["x"]
    assert sorted(a.__getitems__(range(25))) != sorted(b.__getitems__(range(25)))


def test_a_split_by_key_keeps_each_record_in_its_part_when_shards_are_added(tmp_path):
    recs = [{"id": f"doc{i}", "v": i} for i in range(90)]
    tg.write_array_record(recs[:60], tmp_path / "v1", num_shards=2)
    # Re-sharded, in another order, with 30 new records, and as Parquet.
    tg.write_parquet(recs[:60][::-1] + recs[60:], tmp_path / "v2", num_shards=3)
    opts = dict(seed=4, by="id", index_dir=tmp_path / "ix", num_workers=0, progress=False)
    fractions = {"train": 0.6, "val": 0.2, "test": 0.2}
    before = tg.split(tg.ArrayRecordSource(tmp_path / "v1"), fractions, **opts)
    after = tg.split(tg.ParquetSource(tmp_path / "v2"), fractions, **opts)

    def ids(part):
        return {r["id"] for r in part.__getitems__(list(range(len(part))))}

    old = {r["id"] for r in recs[:60]}
    seen = set()
    for name in fractions:
        assert ids(after[name]) & old == ids(before[name])
        assert not ids(after[name]) & seen
        seen |= ids(after[name])
    assert seen == {r["id"] for r in recs}
    assert all(len(p) > 0 for p in after.values())
    with pytest.raises(TypeError, match="fractions, not counts"):
        tg.split(recs, {"train": 50, "val": 10}, by="id")


def test_a_stored_selection_that_differs_is_rebuilt_never_read(tmp_path, monkeypatch):
    from torchgrain.compose import subset
    from torchgrain.sources.node_index.derived import derived_index

    monkeypatch.setattr(subset, "MAPPED_ABOVE", 10)
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    rows = np.arange(20) % 7
    path = tg.Dataset([{"i": i} for i in range(7)]).select(rows).source.rows.index.path
    # Another file under the same key: entries in range, but not the ones asked for.
    other = derived_index(
        "select",
        os.path.basename(path).rsplit(".", 1)[0],
        {"indices": ("<u4", ())},
        lambda sink: sink.append("indices", np.ones(20, np.uint32)) or {"count": 20, "length": 7},
        index_dir=tmp_path / "other",
    )
    os.replace(other.path, path)
    with pytest.warns(UserWarning, match="entry 0 is 1, not the index 0 asked for"):
        sub = tg.Dataset([{"i": i} for i in range(7)]).select(rows)
    assert [r["i"] for r in sub.__getitems__(range(20))] == rows.tolist()
