"""A sampler state is checked against its dataset's compositions too: a mixture of the
same files with other weights or seed, a split with another seed, a filter or selection
keeping other records (of the same length) are refused, while the same composition of a
copy of the data, opened in a fresh process with its own index directory, resumes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import torchgrain as tg
from torchgrain.sources.node_index.derived import composition_fingerprint, derived_index


def _data(root) -> tuple[tg.Dataset, tg.Dataset]:
    tg.write_array_record([{"x": i, "t": np.arange(i % 7 + 1)} for i in range(60)], root / "a")
    tg.write_array_record([{"x": -i, "t": np.arange(i % 5 + 1)} for i in range(80)], root / "b")
    return tg.Dataset(tg.ArrayRecordSource(root / "a")), tg.Dataset(
        tg.ArrayRecordSource(root / "b")
    )


def _refused(saved_for, other) -> None:
    assert len(saved_for) == len(other)
    state = tg.GlobalShuffleSampler(saved_for, seed=3).state_dict()
    tg.GlobalShuffleSampler(saved_for, seed=3).load_state_dict(state)  # the same: loads
    with pytest.raises(ValueError, match=r"saved for other data.*compositions"):
        tg.GlobalShuffleSampler(other, seed=3).load_state_dict(state)


def test_a_mixture_with_other_weights_or_seed_is_refused(tmp_path):
    a, b = _data(tmp_path)
    mixed = tg.mix([a, b], [0.7, 0.3], seed=0)
    _refused(mixed, tg.mix([a, b], [0.7, 0.3], seed=1))
    other = tg.mix([a, b], [0.6, 0.4], seed=0)
    if len(other) == len(mixed):
        _refused(mixed, other)


def test_a_split_with_another_seed_or_a_selection_of_other_rows_is_refused(tmp_path):
    a, b = _data(tmp_path)
    both = tg.concat([a, b])
    _refused(
        tg.split(both, {"x": 0.5, "y": 0.5}, seed=0)["x"],
        tg.split(both, {"x": 0.5, "y": 0.5}, seed=1)["x"],
    )
    _refused(both.select(np.arange(20)), both.select(np.arange(1, 21)))


def test_a_filter_keeping_other_records_of_the_same_count_is_refused(tmp_path):
    a, _ = _data(tmp_path)
    ix = tmp_path / "ix"
    _refused(
        a.filter(lambda r: r["x"] % 2 == 0, index_dir=ix),
        a.filter(lambda r: r["x"] % 2 == 1, index_dir=ix),
    )


def test_a_state_of_an_earlier_release_without_the_digest_loads(tmp_path):
    a, b = _data(tmp_path)
    state = tg.GlobalShuffleSampler(tg.mix([a, b], [0.7, 0.3], seed=0), seed=3).state_dict()
    del state["dataset_compositions"]
    tg.GlobalShuffleSampler(tg.mix([a, b], [0.7, 0.3], seed=1), seed=3).load_state_dict(state)


_FRESH = textwrap.dedent(
    """
    import json, sys, numpy as np, torchgrain as tg
    root, ix = sys.argv[1], sys.argv[2]
    a = tg.Dataset(tg.ArrayRecordSource(root + "/a"))
    b = tg.Dataset(tg.ArrayRecordSource(root + "/b"))
    made = {
        "filter": a.filter(lambda r: r["x"] % 3 == 0, index_dir=ix),
        "windows": tg.concat([a, b]).windows("t", 4, index_dir=ix),
        "packed": b.windows("t", 4, mode="pack", index_dir=ix),
        "mix": tg.mix([a.filter(lambda r: r["x"] > 9, index_dir=ix), b], [0.5, 0.5], seed=2),
    }
    print(json.dumps({k: tg.GlobalShuffleSampler(d, seed=1).state_dict() for k, d in made.items()}))
    """
)


def test_the_same_compositions_of_a_copy_resume_in_a_fresh_process(tmp_path):
    # The digests name no path, time, inode or index key: a copy elsewhere, with another
    # index directory, gives the same states.
    _data(tmp_path / "one")
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    states = []
    for where in ("one", "two"):
        out = subprocess.run(
            [sys.executable, "-c", _FRESH, str(tmp_path / where), str(tmp_path / f"ix-{where}")],
            capture_output=True,
            text=True,
            check=True,
            env=env,
            timeout=300,
        ).stdout
        states.append(json.loads(out))
    assert states[0] == states[1]
    assert all("dataset_compositions" in s for s in states[0].values())
    assert len({s["dataset_compositions"] for s in states[0].values()}) == 4


def test_a_derived_index_digest_is_its_arrays_whether_built_mapped_or_in_memory(tmp_path):
    def fill(sink):
        sink.append("kept", np.array([1, 4], np.uint32))
        sink.append("kept", [5, 9])
        return {"n": 4}

    mapped = derived_index("demo", "k1", {"kept": ("<u4", ())}, fill, index_dir=tmp_path)
    memory = derived_index("demo", "k2", {"kept": ("<u4", ())}, fill, index_dir=None)
    assert mapped.meta["digest"] == memory.digest == mapped.digest
    del memory.meta["digest"]  # an index of an earlier release: read whole once
    del memory.__dict__["digest"]
    assert memory.digest == mapped.digest
    assert composition_fingerprint(tg.Dataset(list(range(3)))) is None


def test_where_each_dataset_sits_in_a_composition_is_in_the_digest():
    # Two filters of lists in memory (no files to tell them apart) in swapped places.
    a = tg.Dataset([{"x": i} for i in range(20)])
    c = tg.Dataset([{"x": 1000 + i} for i in range(5)])
    kept = a.filter(lambda r: r["x"] < 5, index_dir=None)
    _refused(tg.concat([kept, c]), tg.concat([c, kept]))


def test_mixture_weights_that_give_the_same_counts_resume():
    a = tg.Dataset([{"x": i} for i in range(70)])
    b = tg.Dataset([{"x": -i} for i in range(30)])
    one = tg.mix([a, b], [0.7, 0.3], length=100, seed=0)
    other = tg.mix([a, b], [0.701, 0.299], length=100, seed=0)
    assert one.source.counts.tolist() == other.source.counts.tolist()
    state = tg.GlobalShuffleSampler(one, seed=3).state_dict()
    tg.GlobalShuffleSampler(other, seed=3).load_state_dict(state)


def test_windows_of_another_column_of_the_same_lengths_are_refused():
    docs = tg.Dataset([{"t": np.arange(n), "u": np.arange(n) + 9} for n in (5, 3, 8, 2)])
    _refused(docs.windows("t", 4, index_dir=None), docs.windows("u", 4, index_dir=None))


def test_a_view_overriding_the_old_identity_hook_is_warned_and_honoured(tmp_path):
    from torchgrain.compose.view import View

    with pytest.warns(DeprecationWarning, match="_identity"):

        class Shifted(View):  # item i is item (i + k) % n of its one child
            def __init__(self, child, k):
                super().__init__([child])
                self.k = k

            def __len__(self):
                return len(self.children[0])

            def _locate(self, idx):
                return np.zeros(len(idx), np.int64), (idx + self.k) % len(self)

            def _identity(self):
                return self.k

    a, _ = _data(tmp_path)
    first, second = tg.Dataset(Shifted(a, 0)), tg.Dataset(Shifted(a, 5))
    kept = [first.filter(lambda r: r["x"] < 10, index_dir=tmp_path / "ix") for _ in range(2)]
    again = second.filter(lambda r: r["x"] < 10, index_dir=tmp_path / "ix")
    assert [r["x"] for r in again] == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    assert [r["x"] for r in kept[1]] == list(range(10))
    _refused(first, second)


# ---------------------------------------------------------------- token windows
@pytest.mark.parametrize("mode", ["concat", "pack"])
@pytest.mark.parametrize("where", ["arrayrecord", "memory"])
def test_a_document_without_the_token_column_is_an_error_not_an_empty_document(
    tmp_path, mode, where
):
    # Read as columns, the record lacking the column was None among the others' values,
    # which counts as an empty document: its windows came out without it, no error.
    recs = [{"tokens": np.array([1, 2, 3])}, {"text": "no tokens"}, {"tokens": np.array([4, 5, 6])}]
    if where == "arrayrecord":
        tg.write_array_record(recs, tmp_path / "d")
        ds = tg.Dataset(tg.ArrayRecordSource(tmp_path / "d", index_dir=None))
    else:
        ds = tg.Dataset(recs)
    with pytest.raises(tg.CorruptDataError, match=r"record 1 .*no column 'tokens'"):
        ds.windows("tokens", 3, mode=mode, eos=9, index_dir=None, progress=False)


def test_tf_example_token_counts_of_one_element_lists_are_read(tmp_path):
    from torchgrain.formats.tf_example import encode_tf_example
    from torchgrain.formats.tfrecord import write_tfrecord

    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    path = str(tmp_path / "a.tfrecord")
    write_tfrecord(
        [encode_tf_example({"tokens": np.array(t, np.int64), "num_tokens": len(t)}) for t in docs],
        path,
    )
    ds = tg.Dataset(tg.TFRecordSource(path, index_dir=None))
    counted = ds.windows("tokens", 3, eos=1, index_dir=None, progress=False)
    measured = ds.windows("tokens", 3, eos=1, index_dir=None, progress=False, lengths=None)
    assert len(counted) == len(measured) == 3  # 12 tokens with the eos
    for a, b in zip(counted, measured):
        assert a["input_ids"].tolist() == b["input_ids"].tolist()
    # A count that lies is still refused when its document is read.
    write_tfrecord(
        [encode_tf_example({"tokens": np.array(t, np.int64), "num_tokens": 2}) for t in docs],
        path,
    )
    lying = tg.Dataset(tg.TFRecordSource(path, index_dir=None)).windows(
        "tokens", 3, eos=1, index_dir=None, progress=False
    )
    with pytest.raises(tg.CorruptDataError, match="tokens"):
        lying.__getitems__(list(range(len(lying))))


@pytest.mark.parametrize("mode", ["concat", "pack"])
def test_collate_windows_takes_a_columns_batch(mode):
    import torch

    from torchgrain.tokens.windows import collate_windows

    docs = [{"t": np.arange(n) + 1} for n in (3, 2, 4, 1)]
    as_records = tg.Dataset(docs).windows("t", 3, mode=mode, eos=0, index_dir=None)
    as_columns = tg.Dataset(docs, batch_format="columns").windows(
        "t", 3, mode=mode, eos=0, index_dir=None
    )
    want = collate_windows([as_records[0], as_records[1]])
    got = next(
        iter(torch.utils.data.DataLoader(as_columns, batch_size=2, collate_fn=collate_windows))
    )
    assert got.keys() == want.keys()
    for k in want:
        assert (got[k] == want[k]).all() if isinstance(want[k], torch.Tensor) else got[k] == want[k]


# ------------------------------------------------- filters of a source whose files changed
def _rewrite(kind, d, offset):
    recs = [{"x": offset + i} for i in range(100)]
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"x": [r["x"] for r in recs]}), d / "a.parquet", row_group_size=50)
    elif kind == "arrayrecord":
        tg.write_array_record(recs, d, group_size=10, overwrite=True)
    else:
        from torchgrain.formats.tf_example import encode_tf_example
        from torchgrain.formats.tfrecord import write_tfrecord

        write_tfrecord([encode_tf_example(r) for r in recs], str(d / "a.tfrecord"))


def _open(kind, d, ix):
    if kind == "parquet":
        return tg.ParquetSource(d)
    if kind == "arrayrecord":
        return tg.ArrayRecordSource(d, index_dir=ix)
    return tg.TFRecordSource(d, index_dir=ix)


def _x(record) -> int:
    return int(np.asarray(record["x"]).reshape(-1)[0])


def _below_10(record) -> bool:
    return _x(record) < 10


@pytest.mark.parametrize("kind", ["parquet", "arrayrecord", "tfrecord"])
def test_a_filter_of_a_source_whose_files_changed_since_it_opened_is_refused(tmp_path, kind):
    # The source still reads the version it opened (row groups in its cache, a map of
    # the old file): a selection computed from those reads was keyed by the files'
    # version now, and a fresh process opening the new files was handed it: rows that
    # do not match the predicate, with no error.
    d, ix = tmp_path / "d", tmp_path / "ix"
    d.mkdir()
    _rewrite(kind, d, 0)
    stale = _open(kind, d, ix)
    stale.__getitems__(list(range(100)))
    _rewrite(kind, d, 1000)
    with pytest.raises(tg.CorruptDataError, match="changed since"):
        tg.Dataset(stale).filter(_below_10, index_dir=ix, num_workers=0)
    if kind == "parquet":
        import pyarrow.compute as pc

        with pytest.raises(tg.CorruptDataError, match="changed since"):
            tg.Dataset(stale).filter(pc.field("x") < 10, index_dir=ix)
        from torchgrain.sources.column import read_column

        with pytest.raises(tg.CorruptDataError, match="changed since"):
            read_column(stale, "x")  # (the files opened again for one column)
    fresh = tg.Dataset(_open(kind, d, ix)).filter(
        lambda r: _x(r) < 1010, index_dir=ix, num_workers=0
    )
    assert [_x(r) for r in fresh] == list(range(1000, 1010))


def test_files_whose_nested_fields_differ_only_in_nullability_are_read_as_one(tmp_path):
    # Spark writes list items non-nullable (containsNull=false); another writer does not.
    import pyarrow as pa
    import pyarrow.parquet as pq

    required = pa.list_(pa.field("element", pa.float32(), nullable=False))
    struct = pa.struct([pa.field("a", pa.int64(), nullable=False)])
    pq.write_table(
        pa.table({"c": pa.array([[1.0]], required), "s": pa.array([{"a": 1}], struct)}),
        tmp_path / "a.parquet",
    )
    pq.write_table(
        pa.table({"c": pa.array([[2.0], None], pa.list_(pa.float32())), "s": [{"a": 2}, None]}),
        tmp_path / "b.parquet",
    )
    src = tg.ParquetSource(tmp_path)
    got = src.__getitems__([0, 1, 2])
    assert [None if r["c"] is None else r["c"].tolist() for r in got] == [[1.0], [2.0], None]
    assert [r["s"] for r in got] == [{"a": 1}, {"a": 2}, None]
    assert src.read_columns([2, 0])["s"] == [None, {"a": 1}]


def test_a_nested_date_python_cannot_hold_is_an_error_naming_its_record(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    events = pa.list_(pa.struct([("t", pa.timestamp("us"))]))
    year_11476 = 300_000_000_000_000_000
    pq.write_table(
        pa.table({"ev": pa.array([[{"t": 1}], [], [{"t": year_11476}]], events), "n": [0, 1, 2]}),
        tmp_path / "a.parquet",
    )
    src = tg.ParquetSource(tmp_path)
    for read in (lambda: src[2], lambda: src.read_columns([0, 2]), lambda: list(src.iter_shard(0))):
        with pytest.raises(
            tg.RecordDecodeError, match=r"record index 2 \(row group 0 of .*a\.parquet"
        ):
            read()
    assert src.__getitems__([1, 0])[0] == {"ev": [], "n": 1}
    assert tg.ParquetSource(tmp_path, columns=["n"])[2] == {"n": 2}


def test_the_record_python_cannot_hold_is_found_in_a_few_reads(tmp_path):
    # Read one at a time, a row group larger than the cache was decoded again for each
    # row before the bad one: quadratic.
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 4000
    days = [[{"d": i}] for i in range(n - 1)] + [[{"d": -800_000}]]  # before year 1
    pq.write_table(
        pa.table({"e": pa.array(days, pa.list_(pa.struct([("d", pa.date32())])))}),
        tmp_path / "a.parquet",
    )
    src = tg.ParquetSource(tmp_path, cache_bytes=1 << 10)
    reads = []
    records = src._records
    src._records = lambda idx: reads.append(len(idx)) or records(idx)
    with pytest.raises(tg.RecordDecodeError, match=f"record index {n - 1} "):
        src.__getitems__(np.arange(n))
    assert len(reads) <= 2 + 2 * int(np.ceil(np.log2(n)))


def test_a_filter_of_a_remote_parquet_file_rewritten_since_it_opened_is_not_shared(tmp_path):
    # A store whose answers carry no ETag (memory://): the selection was keyed by the
    # version the store gives now, while the source still read its cached old rows.
    import io

    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs = fsspec.filesystem("memory")

    def put(values):
        b = io.BytesIO()
        pq.write_table(pa.table({"x": np.asarray(values, np.int64)}), b, row_group_size=50)
        fs.pipe("/s64/a.parquet", b.getvalue())

    put(np.arange(100))
    try:
        old = tg.ParquetSource("memory://s64/a.parquet")
        old.__getitems__(list(range(100)))  # its row groups in its cache
        put(np.arange(100) + 1000)
        kept = tg.Dataset(old).filter(_below_10, index_dir=tmp_path, num_workers=0)
        assert len(kept) == 10  # (its own version's records)
        fresh = tg.Dataset(tg.ParquetSource("memory://s64/a.parquet"))
        assert len(fresh.filter(_below_10, index_dir=tmp_path, num_workers=0)) == 0
    finally:
        fs.rm("/s64", recursive=True)
