"""Filters (torchgrain/compose/filter.py): a selection index built once by a parallel pass,
mapped by every process, keyed by the data and the predicate; checked as untrusted input;
pyarrow expressions pushed down to Parquet row groups (torchgrain/sources/parquet/pushdown.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import torchgrain as tg
from torchgrain.compose.filter import FilterView, columns, filter_dataset
from torchgrain.errors import CorruptDataError, TorchgrainError
from torchgrain.sources.node_index.derived import derived_index


@pytest.fixture(autouse=True, scope="module")
def _own_cache(tmp_path_factory):
    # ParquetSource(filter=...) keeps its selection in the default index directory
    before = os.environ.get("TORCHGRAIN_CACHE")
    os.environ["TORCHGRAIN_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        del os.environ["TORCHGRAIN_CACHE"]
    else:
        os.environ["TORCHGRAIN_CACHE"] = before


def _parquet(d, n=100, row_group_size=10, files=1):
    os.makedirs(d, exist_ok=True)
    per = n // files
    for k in range(files):
        x = np.arange(k * per, (k + 1) * per)
        table = pa.table({"x": x, "s": [str(i) for i in x], "v": (x * 0.5).astype(np.float64)})
        pq.write_table(table, os.path.join(d, f"part{k}.parquet"), row_group_size=row_group_size)
    return str(d)


def _is_odd(r):
    return r["x"] % 2 == 1


class _CountingList:
    """A list of records that counts its batched reads."""

    def __init__(self, n):
        self.items = [{"x": i} for i in range(n)]
        self.batches = 0

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def __getitems__(self, indices):
        self.batches += 1
        return [self.items[i] for i in indices]

    def read_ahead(self, order, start, count, position):
        self.order = order(start, start + count).tolist()

    def set_epoch(self, epoch):
        self.epoch = epoch


def test_kept_records_in_order_through_transforms_batched_and_blocks(tmp_path):
    src = tg.ParquetSource(_parquet(tmp_path / "d"))
    ds = tg.Dataset(src).map(lambda r: {**r, "y": r["x"] * 3})
    kept = ds.filter(lambda r: r["y"] % 4 == 0, index_dir=str(tmp_path / "ix"), progress=False)
    want = [i for i in range(100) if (i * 3) % 4 == 0]
    assert len(kept) == len(want)
    assert [r["x"] for r in kept.__getitems__(list(range(len(kept))))] == want
    assert kept.source.selection.dtype == np.uint32  # 4 bytes per kept record
    # a filtered Parquet source keeps its row groups as blocks
    f = tg.Dataset(src).filter(_is_odd, index_dir=str(tmp_path / "ix"), progress=False)
    assert f.block_offsets().tolist() == list(range(0, 51, 5))
    # batched reads stay batched: one read of the parent per batch
    counting = _CountingList(40)
    g = filter_dataset(counting, _is_odd, index_dir=None, progress=False, num_workers=0)
    counting.batches = 0
    assert [r["x"] for r in g.__getitems__([0, 5, 19])] == [1, 11, 39]
    assert counting.batches == 1
    # a sampler's pass reaches the parent as its own indices; so does the epoch
    g.read_ahead(lambda a, b: np.arange(a, b)[::-1], 0, 3, lambda: 0)
    g.set_epoch(4)
    assert counting.order == [5, 3, 1] and counting.epoch == 4
    with pytest.raises(IndexError):
        g[20]


def test_vectorised_predicate_matches_the_record_one(tmp_path):
    ds = tg.Dataset(tg.ParquetSource(_parquet(tmp_path / "d")))
    by_columns = ds.filter(
        columns(lambda b: np.asarray(b["x"]) % 3 == 0),
        index_dir=None,
        progress=False,
        batch_size=16,
    )
    by_records = ds.filter(lambda r: r["x"] % 3 == 0, index_dir=None, progress=False)
    assert by_columns.source.selection.tolist() == by_records.source.selection.tolist()
    assert by_columns.source.selection.tolist() == list(range(0, 100, 3))
    seen = []

    def only_x(b):
        seen.append(sorted(b))
        return np.asarray(b["x"]) % 3 == 0

    narrow = ds.filter(columns(only_x, keys=["x"]), index_dir=None, progress=False)
    assert narrow.source.selection.tolist() == list(range(0, 100, 3))
    assert seen and all(keys == ["x"] for keys in seen)  # only that column was read
    same = ds.filter(
        lambda b: np.asarray(b["x"]) % 3 == 0, batched=True, index_dir=None, progress=False
    )
    assert len(same) == 34
    with pytest.raises(TypeError, match="one bool per row"):
        ds.filter(columns(lambda b: [1, 2]), index_dir=None, progress=False)


def test_predicate_error_names_predicate_record_and_dataset():
    ds = tg.Dataset([{"x": i} for i in range(10)])

    def picky(r):
        if r["x"] == 7:
            raise KeyError("nope")
        return True

    with pytest.raises(
        TorchgrainError,
        match=r"filter predicate .*picky.* failed on record 7 of "
        r"Dataset\(.*KeyError",
    ) as info:
        ds.filter(picky, index_dir=None, progress=False, num_workers=0)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(TorchgrainError, match="filter predicate seven failed on record 7"):
        ds.filter(picky, name="seven", index_dir=None, progress=False, num_workers=0)


def _noise(r, rng):
    return {"x": r["x"], "u": float(rng.random())}


def test_records_that_change_with_the_epoch_are_refused():
    """A selection is found once: over random_map's output, or a mixture's positions, the
    predicate would not hold at another epoch (half the kept records failed it at epoch 3,
    and a process at another epoch mapped a file built at epoch 0)."""
    ds = tg.Dataset([{"x": i} for i in range(20)])
    big = lambda r: r["u"] > 0.5  # noqa: E731
    for changing in (
        ds.random_map(_noise, seed=0),
        tg.concat([ds.random_map(_noise, seed=0)]),
        tg.mix([ds, ds], [0.5, 0.5]).select([0, 1]),
    ):
        with pytest.raises(TypeError, match="change with the epoch"):
            changing.filter(big, index_dir=None, progress=False, num_workers=0)
    kept = ds.filter(lambda r: r["x"] > 9, index_dir=None, progress=False, num_workers=0)
    assert len(kept.random_map(_noise, seed=0)) == 10  # filtering first is fine


def test_records_in_memory_are_not_filtered_through_the_shared_cache(tmp_path, monkeypatch):
    """A list is fingerprinted by its length only: another list of that length in a later
    run mapped the first one's selection (and got the records where the predicate fails)."""
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    big = lambda r: r["x"] > 5  # noqa: E731
    for values, kept in (([1, 9, 2, 8], [9, 8]), ([9, 1, 8, 2], [9, 8])):
        got = tg.Dataset([{"x": v} for v in values]).filter(big, progress=False, num_workers=0)
        assert [r["x"] for r in got] == kept
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("filter-*"))


_REUSE = """
import sys, torchgrain as tg
calls = []
def pred(r):
    calls.append(1)
    return r["x"] % 2 == 1
ds = tg.Dataset(tg.ParquetSource({d!r})).filter(pred, name="odd", index_dir={ix!r},
                                               progress=False, num_workers=0)
print(len(ds), len(calls), [r["x"] for r in ds.__getitems__([0, len(ds) - 1])])
"""


def test_another_process_reuses_the_selection_and_a_changed_shard_rebuilds_it(tmp_path):
    d = _parquet(tmp_path / "d", files=2)
    ix = str(tmp_path / "ix")
    # built here by 2 worker processes
    built = tg.Dataset(tg.ParquetSource(d)).filter(
        _is_odd, name="odd", index_dir=ix, progress=False, num_workers=2, batch_size=8
    )
    assert built.source.selection.tolist() == list(range(1, 100, 2))

    def run():
        code = _REUSE.format(d=d, ix=ix)
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.split(None, 2)

    assert run() == ["50", "0", "[1, 99]\n"]  # mapped: the predicate never ran
    # a shard rewritten: another key, a new pass
    pq.write_table(
        pa.table({"x": np.arange(50, 60), "s": ["a"] * 10, "v": np.zeros(10)}),
        os.path.join(d, "part1.parquet"),
    )
    assert run() == ["30", "60", "[1, 59]\n"]


def test_a_spawned_worker_maps_the_same_selection(tmp_path):
    ds = tg.Dataset(tg.ParquetSource(_parquet(tmp_path / "d", n=40))).filter(
        _is_odd, index_dir=str(tmp_path / "ix"), progress=False, num_workers=0
    )
    loader = torch.utils.data.DataLoader(
        ds, batch_size=8, num_workers=1, multiprocessing_context="spawn"
    )
    assert torch.cat([b["x"] for b in loader]).tolist() == list(range(1, 40, 2))


def test_a_damaged_selection_file_never_gives_records(tmp_path):
    data = [{"x": i} for i in range(50)]
    ix = str(tmp_path / "ix")
    f = filter_dataset(data, _is_odd, name="odd", index_dir=ix, progress=False)
    path = f.source.index.path
    key = f.source.index.meta["key"]
    # truncated: the index store finds it and builds it again, naming the file
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = filter_dataset(data, _is_odd, name="odd", index_dir=ix, progress=False)
    assert any(path in str(w.message) for w in caught)
    assert again.source.selection.tolist() == list(range(1, 50, 2))
    # truncated while a process has it mapped: refused at the next read, not SIGBUS
    with open(again.source.index.path, "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(CorruptDataError, match="filter-"):
        again[0]
    # a well-formed file (its checksum right) whose entries are out of range, or not
    # increasing: a CorruptDataError naming the file
    os.remove(path)
    for bad in ([1, 3, 50], [3, 1, 5]):
        if os.path.exists(path):
            os.remove(path)

        def fill(sink, bad=bad):
            sink.append("selection", np.array(bad, np.uint32))
            return {"count": 3, "length": 50}

        derived_index("filter", key, {"selection": ("<u4", ())}, fill, index_dir=ix)
        with pytest.raises(CorruptDataError, match=r"selection index .*filter.*tgindex.* damaged"):
            filter_dataset(data, _is_odd, name="odd", index_dir=ix, progress=False)


# ------------------------------------------------------------------ pushdown
def test_pushdown_reads_only_the_row_groups_that_can_match(tmp_path, monkeypatch):
    d = _parquet(tmp_path / "d", n=200, row_group_size=10, files=2)
    reads = []
    real = pq.ParquetFile.read_row_group

    def counted(self, i, *args, **kwargs):
        reads.append((i, tuple(kwargs.get("columns") or ())))
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    expr = (pc.field("x") >= 35) & (pc.field("x") < 52) | (pc.field("x") == 150)
    src = tg.ParquetSource(d, filter=expr)
    assert isinstance(src, FilterView) and src.keys == ["x", "s", "v"]
    want = [*range(35, 52), 150]
    assert len(src) == len(want)
    assert [r["x"] for r in src.__getitems__(list(range(len(src))))][:3] == [35, 36, 37]
    # the pass read row groups 30-39, 40-49, 50-59 and 150-159, column x only
    assert sorted(i for i, cols in reads if cols == ("x",)) == [3, 4, 5, 5]
    assert src.index.meta["row_groups_read"] == 4 and src.index.meta["row_groups"] == 20
    assert src.selection.tolist() == want
    same = tg.Dataset(tg.ParquetSource(d)).filter(expr, index_dir=None, progress=False)
    assert same.source.selection.tolist() == want
    with pytest.raises(TypeError, match="without transforms"):
        tg.Dataset(tg.ParquetSource(d)).map(dict).filter(expr, index_dir=None)


_EXPRESSIONS = [
    pc.field("i") > 3,
    ~(pc.field("i") < 5),
    pc.field("i").is_null(),
    pc.field("f") > 2.0,
    ~(pc.field("f") <= 2.0),
    pc.is_nan(pc.field("f")),
    pc.field("s") == "b",
    (pc.field("s") >= "c") | (pc.field("i") == 0),
    pc.field("i").isin([1, 6]),
]


@settings(max_examples=20, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(0, 7)),
            st.one_of(st.none(), st.sampled_from([0.5, 1.0, 2.5, 3.0, float("nan")])),
            st.one_of(st.none(), st.sampled_from(["a", "b", "c", "d"])),
        ),
        min_size=1,
        max_size=30,
    ),
    group=st.integers(1, 8),
    which=st.integers(0, len(_EXPRESSIONS) - 1),
)
# NaN lies outside a float column's statistics: this group's are [1.0, 1.0]
@example(rows=[(0, 1.0, "a"), (0, float("nan"), "a")], group=2, which=4)
def test_pushdown_keeps_exactly_what_arrow_keeps(tmp_path_factory, rows, group, which):
    # nulls, NaN and strings in row groups of any size: pruning never drops a match
    d = tmp_path_factory.mktemp("p")
    i, f, s = zip(*rows)
    table = pa.table(
        {
            "i": pa.array(i, pa.int32()),
            "f": pa.array(f, pa.float64()),
            "s": pa.array(s, pa.string()),
        }
    )
    pq.write_table(table, d / "t.parquet", row_group_size=group)
    expr = _EXPRESSIONS[which]
    got = tg.ParquetSource(str(d), filter=expr).selection.tolist()
    kept = table.append_column("_r", pa.array(np.arange(len(rows)))).filter(expr)
    assert got == kept.column("_r").to_pylist(), expr


def test_pushdown_on_a_hive_partition_key_skips_the_other_files(tmp_path):
    for part in range(3):
        os.makedirs(tmp_path / f"split={part}")
        x = list(range(part * 10, part * 10 + 10))
        pq.write_table(pa.table({"x": x}), tmp_path / f"split={part}/a.parquet", row_group_size=5)
    ds = tg.Dataset(tg.ParquetSource(str(tmp_path)))
    f = ds.filter((pc.field("split") >= 1) & (pc.field("x") < 22), index_dir=None, progress=False)
    assert f.source.selection.tolist() == list(range(10, 22))
    assert f.source.index.meta["row_groups_read"] == 3  # of 6: file 0 and rows 25-29 not read
    assert [r["split"] for r in f.__getitems__([0, 11])] == [1, 2]


def test_pushdown_on_a_column_that_is_not_read(tmp_path, monkeypatch):
    # columns=["text"], filter on "lang" (as pq.read_table(columns=, filters=) allows)
    d = tmp_path / "d"
    for k in range(2):
        os.makedirs(d / f"split={k}")
        x = np.arange(k * 30, k * 30 + 30)
        lang = ["en" if 20 <= i < 35 else "de" for i in x]
        table = pa.table({"text": [f"t{i}" for i in x], "lang": lang})
        pq.write_table(table, d / f"split={k}/a.parquet", row_group_size=10)
    reads = []
    real = pq.ParquetFile.read_row_group

    def counted(self, i, *args, **kwargs):
        reads.append((i, tuple(kwargs.get("columns") or ())))
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    expr = pc.field("lang") == "en"
    src = tg.ParquetSource(str(d), columns=["text"], filter=expr)
    assert src.keys == ["text"] and src.selection.tolist() == list(range(20, 35))
    assert src[0] == {"text": "t20"} and src.__getitems__([14]) == [{"text": "t34"}]
    # the pass read rows 20-29 and 30-39 (of 6 row groups), column lang only
    assert sorted(i for i, cols in reads if cols == ("lang",)) == [0, 2]
    assert src.index.meta["row_groups_read"] == 2 and src.index.meta["row_groups"] == 6
    ds = tg.Dataset(tg.ParquetSource(str(d), columns=["text"]))
    f = ds.filter(expr & (pc.field("split") == 1), index_dir=None, progress=False)
    assert f.source.selection.tolist() == list(range(30, 35)) and f[0] == {"text": "t30"}
    with pytest.raises(ValueError, match="cannot filter"):
        tg.ParquetSource(str(d), columns=["text"], filter=pc.field("nope") == 1)
