"""Token windows (Dataset.windows): every token once per epoch, boundaries, packing,
resume, Parquet and ArrayRecord, hostile index files."""

from __future__ import annotations

import itertools
import os
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

import torchgrain as tg
from torchgrain.errors import CorruptDataError
from torchgrain.sources.node_index.derived import derived_index
from torchgrain.tokens.windows import IGNORE, _best_fit, collate_windows

# Odd sizes: empty documents, one-token ones, and documents longer than several windows.
SIZES = [5, 0, 1, 37, 0, 3, 100, 2, 0, 0, 11, 64, 1, 9]


def documents(sizes=SIZES, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 2000, n).astype(np.int64) for n in sizes]


def stream_of(docs, bos=None, eos=None):
    """The concatenated stream, each token's position in its document and document."""
    toks, pos, ids = [], [], []
    for d, t in enumerate(docs):
        aug = ([bos] if bos is not None else []) + t.tolist() + ([eos] if eos is not None else [])
        toks += aug
        pos += range(len(aug))
        ids += [d] * len(aug)
    return np.array(toks, np.int64), np.array(pos, np.int64), np.array(ids, np.int64)


def check_concat(windows, docs, seq_len, bos=None, eos=None):
    """Window i is the stream's tokens [i L, (i + 1) L + 1): every token once as an input,
    once as a label; positions, document ids and boundaries agree with the documents."""
    toks, pos, ids = stream_of(docs, bos, eos)
    n = (len(toks) - 1) // seq_len
    assert len(windows) == n
    got = windows.__getitems__(list(range(n)))
    for i, w in enumerate(got):
        s = i * seq_len
        assert w["input_ids"].tolist() == toks[s : s + seq_len].tolist()
        assert w["labels"].tolist() == toks[s + 1 : s + seq_len + 1].tolist()
        assert w["position_ids"].tolist() == pos[s : s + seq_len].tolist()
        assert w["document_ids"].tolist() == ids[s : s + seq_len].tolist()
        starts = [k for k in range(seq_len) if k == 0 or pos[s + k] == 0]
        assert w["cu_seqlens"].dtype == np.int32
        assert w["cu_seqlens"].tolist() == [*starts, seq_len]
    # Every token of every document: inputs cover the stream but its last partial window.
    inputs = np.concatenate([w["input_ids"] for w in got]) if got else np.zeros(0)
    assert len(toks) - len(inputs) <= seq_len
    return got


@pytest.mark.parametrize(("seq_len", "bos", "eos"), [(7, None, None), (16, 1, 2), (1, None, 3)])
def test_concat_windows_hold_every_token_once(tmp_path, seq_len, bos, eos):
    docs = documents()
    ds = tg.Dataset([{"tokens": t, "other": 1} for t in docs])
    w = ds.windows("tokens", seq_len, bos=bos, eos=eos, index_dir=tmp_path)
    check_concat(w, docs, seq_len, bos, eos)
    assert w.num_tokens == sum(map(len, docs)) + len(docs) * ((bos is not None) + (eos is not None))
    assert w.packing_efficiency == 1.0
    # Opened again: the same index file, mapped.
    again = ds.windows("tokens", seq_len, bos=bos, eos=eos, index_dir=tmp_path)
    assert again.source.index_paths == w.source.index_paths
    assert w.source.index_paths[0].startswith(str(tmp_path))


def test_too_few_tokens_give_no_windows():
    assert len(tg.Dataset([{"t": [1, 2]}, {"t": []}]).windows("t", 2, index_dir=None)) == 0
    assert len(tg.Dataset([]).windows("t", 2, index_dir=None)) == 0


def write_parquet_docs(path, docs, row_group_size=4, num_tokens=None):
    os.makedirs(path, exist_ok=True)
    columns = {
        "text": [f"doc {i}" for i in range(len(docs))],
        "tokens": pa.array([t.astype(np.int32) for t in docs], pa.list_(pa.int32())),
    }
    if num_tokens is not None:
        columns["num_tokens"] = pa.array(num_tokens, pa.int32())
    table = pa.table(columns)
    half = len(docs) // 2
    pq.write_table(table.slice(0, half), f"{path}/a.parquet", row_group_size=row_group_size)
    pq.write_table(table.slice(half), f"{path}/b.parquet", row_group_size=row_group_size)


def test_parquet_lengths_from_list_offsets_and_narrow_reads(tmp_path):
    docs = documents()
    write_parquet_docs(tmp_path / "pq", docs)
    src = tg.ParquetSource(tmp_path / "pq")
    w = tg.Dataset(src).windows("tokens", 10, eos=0, index_dir=tmp_path / "ix")
    reader = w.source._docs
    assert reader.parquet is not None and reader.parquet.keys == ["tokens"]  # no text read
    check_concat(w, docs, 10, eos=0)
    # BlockShuffleSampler keeps to the row groups' windows.
    blocks = w.block_offsets()
    assert blocks[0] == 0 and blocks[-1] == len(w) and (np.diff(blocks) > 0).all()
    sampler = tg.BlockShuffleSampler(w, window=2, seed=0, num_replicas=1, rank=0)
    assert sorted(sampler) == list(range(len(w)))


def test_token_counts_written_beside_the_tokens_are_read_instead(tmp_path):
    docs = documents()
    counts = [len(t) for t in docs]
    write_parquet_docs(tmp_path / "pq", docs, num_tokens=counts)
    w = tg.Dataset(tg.ParquetSource(tmp_path / "pq")).windows("tokens", 9, index_dir=tmp_path)
    assert w.source._docs.length_parquet.keys == ["num_tokens"]
    check_concat(w, docs, 9)
    tg.write_array_record(
        [{"tokens": t, "num_tokens": n} for t, n in zip(docs, counts)], tmp_path / "ar"
    )
    w = tg.Dataset(tg.ArrayRecordSource(tmp_path / "ar")).windows("tokens", 9, index_dir=None)
    assert w.source._docs.length_column == "num_tokens"
    check_concat(w, docs, 9)
    # Counts that disagree with the tokens: found when the document is read.
    write_parquet_docs(tmp_path / "bad", docs, num_tokens=[c + 1 for c in counts])
    w = tg.Dataset(tg.ParquetSource(tmp_path / "bad")).windows("tokens", 9, index_dir=None)
    with pytest.raises(CorruptDataError, match="its window index"):
        w[0]
    write_parquet_docs(tmp_path / "neg", docs, num_tokens=[-1] * len(docs))
    with pytest.raises(CorruptDataError, match="negative"):
        tg.Dataset(tg.ParquetSource(tmp_path / "neg")).windows("tokens", 9, index_dir=None)


def test_arrayrecord_source_two_ranks_two_workers_each_window_once(tmp_path):
    docs = documents()
    tg.write_array_record([{"tokens": t} for t in docs], tmp_path / "ar", num_shards=2)
    src = tg.ArrayRecordSource(tmp_path / "ar")
    seq_len = 8
    w = tg.Dataset(src).windows("tokens", seq_len, eos=7, index_dir=tmp_path / "ix")
    toks, _, _ = stream_of(docs, eos=7)
    seen = []
    for rank in range(2):  # a DistributedSampler-style split, 2 DataLoader workers each
        sampler = tg.GlobalShuffleSampler(w, seed=3, num_replicas=2, rank=rank, drop_last=True)
        loader = DataLoader(w, batch_size=3, sampler=sampler, num_workers=2, collate_fn=list)
        for batch in loader:
            for rec in batch:
                start = int(w.source.offsets[rec["document_ids"][0]] + rec["position_ids"][0])
                assert start % seq_len == 0
                i = start // seq_len
                assert rec["input_ids"].tolist() == toks[start : start + seq_len].tolist()
                seen.append(i)
    n = len(w)
    assert len(seen) == len(set(seen)) == n - n % 2  # drop_last: at most one left out


def window_number(w, rec):
    return (
        int(w.source.offsets[rec["document_ids"][0]] + rec["position_ids"][0]) // w.source.seq_len
    )


def test_resume_mid_epoch_onto_another_world_size(tmp_path):
    docs = documents(sizes=[13, 0, 40, 7, 29, 3, 55, 1, 21, 17])
    w = tg.Dataset([{"tokens": t} for t in docs]).windows("tokens", 4, index_dir=tmp_path)
    n = len(w)

    def loader(world, rank):
        sampler = tg.GlobalShuffleSampler(w, seed=5, num_replicas=world, rank=rank)
        return tg.ResumableLoader(DataLoader(w, batch_size=2, sampler=sampler, collate_fn=list))

    ranks = [loader(2, r) for r in range(2)]
    taken = []
    for lo in ranks:
        it = iter(lo)
        for _ in range(3):
            taken += [window_number(w, r) for r in next(it)]
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()
    resumed = loader(1, 0)
    resumed.load_state_dict(state)
    rest = [window_number(w, r) for batch in resumed for r in batch]
    assert sorted(taken + rest) == list(range(n))
    # Exact: the rest is what the sampler's order holds after the consumed positions.
    order = tg.GlobalShuffleSampler(w, seed=5, num_replicas=1, rank=0)
    order.load_state_dict(state["sampler"])
    assert rest == list(order)


def test_pack_mode_whole_documents_padding_and_efficiency(tmp_path):
    rng = np.random.default_rng(1)
    sizes = np.minimum(rng.lognormal(np.log(60), 1.0, 1200).astype(np.int64), 1000)
    sizes[:3] = [0, 300, 255]  # an empty one, ones longer than a window
    docs = documents(sizes.tolist(), seed=2)
    seq_len = 256
    with pytest.warns(UserWarning, match="longer than seq_len=256"):
        w = tg.Dataset([{"tokens": t} for t in docs]).windows(
            "tokens", seq_len, mode="pack", eos=2, pad_id=9, index_dir=tmp_path
        )
    assert w.truncated_documents == int((sizes + 1 > seq_len).sum()) >= 1
    assert w.packing_efficiency >= 0.98
    placed = {}
    for i, rec in enumerate(w.__getitems__(list(range(len(w))))):
        cu = rec["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == seq_len
        for a, b in itertools.pairwise(cu):
            d = int(rec["document_ids"][a])
            assert rec["position_ids"][a:b].tolist() == list(range(b - a))
            if d < 0:  # padding
                assert (rec["input_ids"][a:b] == 9).all() and (rec["labels"][a:b] == IGNORE).all()
                assert b == seq_len
                continue
            assert d not in placed  # each document in one window, never split
            placed[d] = i
            aug = np.append(docs[d], 2)[:seq_len]
            assert rec["input_ids"][a:b].tolist() == aug.tolist()
            assert rec["labels"][a : b - 1].tolist() == aug[1:].tolist()
            assert rec["labels"][b - 1] == IGNORE
            assert (rec["document_ids"][a:b] == d).all()
    assert sorted(placed) == list(range(len(docs)))  # every document (eos: none empty)


def test_best_fit_is_a_valid_packing():
    rng = np.random.default_rng(4)
    lens = rng.integers(0, 65, 500)
    order, bins = _best_fit(lens, 64)
    assert sorted(order.tolist()) == np.flatnonzero(lens).tolist()
    assert (np.add.reduceat(lens[order], bins[:-1]) <= 64).all()
    assert len(bins) - 1 <= -(-lens.sum() // 64) * 1.1 + 1


def test_text_column_with_a_tokenizer(tmp_path):
    texts = ["hello", "", "a much longer text here", "xy"]

    def tokenizer(batch):
        return [[ord(c) for c in t] for t in batch]

    w = tg.Dataset([{"text": t} for t in texts]).windows(
        "text", 5, eos=0, tokenizer=tokenizer, index_dir=tmp_path
    )
    check_concat(w, [np.array(tokenizer([t])[0], np.int64) for t in texts], 5, eos=0)


def test_bad_columns_and_arguments():
    ds = tg.Dataset([{"t": "text", "u": np.zeros((2, 2), np.int64)}])
    with pytest.raises(CorruptDataError, match=r"record 0 of a list .*'t' holds str"):
        ds.windows("t", 4, index_dir=None)
    with pytest.raises(CorruptDataError, match="shape"):
        ds.windows("u", 4, index_dir=None)
    with pytest.raises(ValueError, match="seq_len"):
        ds.windows("t", 0)
    huge = tg.Dataset([{"t": np.array([1, 2**64 - 1], np.uint64)}])
    with pytest.raises(CorruptDataError, match=r"above 2\*\*63"):
        huge.windows("t", 1, index_dir=None)
    with pytest.raises(ValueError, match="mode"):
        ds.windows("t", 4, mode="nope")
    with pytest.raises(TypeError, match="eos"):
        ds.windows("t", 4, eos="</s>")


def test_data_changed_since_the_index_was_built_is_an_error(tmp_path):
    records = [{"t": np.arange(n)} for n in (6, 4, 9)]
    ds = tg.Dataset(records)
    ds.windows("t", 4, index_dir=tmp_path)
    records[1] = {"t": np.arange(5)}  # same count of documents: the same index key
    w = ds.windows("t", 4, index_dir=tmp_path)
    with pytest.raises(CorruptDataError, match=r"document 1 .* has 5 tokens, its window index"):
        w.__getitems__(list(range(len(w))))


def test_hostile_index_files_are_rebuilt_never_served(tmp_path):
    docs = documents()
    ds = tg.Dataset([{"t": t} for t in docs])
    path = ds.windows("t", 6, index_dir=tmp_path).source.index_paths[0]
    key = os.path.basename(path).split(".")[0]
    size = os.path.getsize(path)

    # Truncated: rebuilt, with a warning naming the file.
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.warns(UserWarning, match="rebuilding"):
        check_concat(ds.windows("t", 6, index_dir=tmp_path), docs, 6)

    # A well-formed file (sound checksum) whose offsets go backwards or past the end.
    for bad in ([0, 10**12] + [5] * len(docs), list(range(0, -len(docs) - 1, -1))):
        os.remove(path)
        derived_index(
            "windows",
            key,
            {"offsets": ("<i8", ())},
            lambda sink, bad=bad: (sink.append("offsets", np.array(bad)), {"tokens": bad[-1]})[1],
            index_dir=tmp_path,
        )
        with pytest.warns(UserWarning, match=f"rebuilding dataset index '{path}'"):
            check_concat(ds.windows("t", 6, index_dir=tmp_path), docs, 6)

    # Bins naming documents out of range, or a window over seq_len: rebuilt too.
    with pytest.warns(UserWarning, match="2 documents .* longer than seq_len=50"):
        w = ds.windows("t", 50, mode="pack", index_dir=tmp_path)
    bins_path = w.source.index_paths[1]
    bins_key = os.path.basename(bins_path).split(".")[0]
    good = [r["input_ids"].tolist() for r in w.__getitems__(list(range(len(w))))]
    for docs_, starts in (([0, 99], [0, 1, 2]), ([6, 10, 11], [0, 3])):
        os.remove(bins_path)
        derived_index(
            "windows",
            bins_key,
            {"docs": ("<i8", ()), "bins": ("<i8", ())},
            lambda sink, d=docs_, s=starts: (
                sink.append("docs", np.array(d)),
                sink.append("bins", np.array(s)),
                {"tokens": 1, "truncated": 0},
            )[2],
            index_dir=tmp_path,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again = ds.windows("t", 50, mode="pack", index_dir=tmp_path)
        assert any("rebuilding" in str(c.message) for c in caught)
        assert [
            r["input_ids"].tolist() for r in again.__getitems__(list(range(len(again))))
        ] == good


def test_columns_format_and_default_collate_of_fixed_fields(tmp_path):
    docs = documents()
    ds = tg.Dataset([{"t": t} for t in docs], batch_format="columns")
    w = ds.windows("t", 8, index_dir=tmp_path)
    batch = next(iter(DataLoader(w, batch_size=4)))
    assert batch["input_ids"].shape == (4, 8) and batch["input_ids"].dtype == torch.int64
    toks, _, _ = stream_of(docs)
    assert batch["input_ids"].flatten().tolist() == toks[:32].tolist()


def test_collate_windows_flattens_the_boundaries(tmp_path):
    docs = documents()
    w = tg.Dataset([{"t": t} for t in docs]).windows("t", 16, bos=1, index_dir=tmp_path)
    records = w.__getitems__([3, 0, 5])
    batch = collate_windows(records)
    assert batch["labels"].shape == (3, 16) and batch["labels"].dtype == torch.int64
    flat = np.concatenate(
        [r["cu_seqlens"][:-1].astype(np.int64) + 16 * k for k, r in enumerate(records)]
    )
    assert batch["cu_seqlens"].tolist() == [*flat.tolist(), 48]
    assert batch["max_seqlen"] == int(np.diff(batch["cu_seqlens"].numpy()).max())
    # Each flattened segment is one document (or its continuation) in one window.
    ids = batch["document_ids"].flatten()
    cu = batch["cu_seqlens"].tolist()
    for a, b in itertools.pairwise(cu):
        assert (ids[a:b] == ids[a]).all()


class Recording:
    """Documents that record the epoch and read-ahead orders they are given."""

    def __init__(self, docs):
        self.docs, self.epochs, self.orders = docs, [], []

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return {"t": self.docs[i]}

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def read_ahead(self, order, start, count, position):
        self.orders.append(None if order is None else order(start, start + count).tolist())


def test_epoch_and_read_ahead_reach_the_documents_and_pickles_small(tmp_path):
    import pickle

    docs = documents()
    inner = Recording(docs)
    w = tg.Dataset(inner).windows("t", 8, index_dir=tmp_path)
    sampler = tg.GlobalShuffleSampler(w, seed=0, num_replicas=1, rank=0)
    sampler.set_epoch(3)
    assert inner.epochs[-1] == 3
    order = sampler.indices(0, 4)
    w.read_ahead(lambda a, b: order[a:b], 0, 4, lambda: 0)
    _, _, ids = stream_of(docs)
    starts = np.cumsum([0] + [len(t) for t in docs])
    expect = []
    for i in order.tolist():  # the documents of those windows' tokens, in order, each once
        touched = set(ids[i * 8 : i * 8 + 9].tolist())  # (the last label's document too)
        # and the empty documents between them (read, to check that they are empty)
        touched |= {d for d, t in enumerate(docs) if not len(t) and i * 8 < starts[d] <= i * 8 + 8}
        touched |= {d for d, t in enumerate(docs) if not len(t) and i == starts[d] == 0}
        expect += [d for d in sorted(touched) if d not in expect]
    assert inner.orders[-1] == expect
    # Pickled (as for a spawned worker): the index travels as its file's name.
    blob = pickle.dumps(w)
    assert len(blob) < 20_000
    again = pickle.loads(blob)
    assert again[5]["input_ids"].tolist() == w[5]["input_ids"].tolist()


def test_windows_compose_into_mixtures_and_concatenations():
    web = documents(seed=1)
    code = [t + 5000 for t in documents(sizes=[30, 0, 41, 9], seed=2)]
    a = tg.Dataset([{"t": t} for t in web]).windows("t", 8, index_dir=None)
    b = tg.Dataset([{"t": t} for t in code]).windows("t", 8, index_dir=None, eos=1)
    windows_of = {
        name: {tuple(r["input_ids"].tolist()) for r in w.__getitems__(list(range(len(w))))}
        for name, w in (("a", a), ("b", b))
    }
    mixed = tg.mix([a, b], [0.7, 0.3], seed=0)
    got = [tuple(r["input_ids"].tolist()) for r in mixed.__getitems__(list(range(len(mixed))))]
    assert all(g in windows_of["a"] or g in windows_of["b"] for g in got)
    assert {g for g in got if g in windows_of["b"]}  # both corpora are drawn from
    both = tg.concat([a, b])
    assert len(both) == len(a) + len(b)
    assert both[len(a)]["input_ids"].tolist() == b[0]["input_ids"].tolist()


def test_token_counts_past_int64_are_an_error_not_an_empty_dataset(tmp_path):
    # Two counts of 2**62 sum to 2**63: int64 wraps to a negative total (no windows).
    docs = [np.arange(3), np.arange(2)]
    write_parquet_docs(tmp_path / "pq", docs, num_tokens=None)
    table = pq.read_table(tmp_path / "pq" / "a.parquet")
    table = table.append_column("num_tokens", pa.array([2**62] * len(table), pa.int64()))
    pq.write_table(table, tmp_path / "pq" / "a.parquet")
    table = pq.read_table(tmp_path / "pq" / "b.parquet")
    table = table.append_column("num_tokens", pa.array([2**62] * len(table), pa.int64()))
    pq.write_table(table, tmp_path / "pq" / "b.parquet")
    with pytest.raises(CorruptDataError, match=r"add up past 2\*\*63"):
        tg.Dataset(tg.ParquetSource(tmp_path / "pq")).windows("tokens", 3, index_dir=None)
    ds = tg.Dataset([{"t": np.arange(3), "n": 2**62}, {"t": np.arange(2), "n": 2**62}])
    with pytest.raises(CorruptDataError, match=r"add up past 2\*\*63"):
        ds.windows("t", 3, lengths="n", index_dir=None)
    # An index file whose offsets wrap around: rebuilt, not served as no windows.
    ds = tg.Dataset([{"t": np.arange(3)}, {"t": np.arange(2)}])
    path = ds.windows("t", 2, index_dir=tmp_path).source.index_paths[0]
    os.remove(path)
    wrapped = np.array([0, 2**62, -(2**63)], np.int64)
    derived_index(
        "windows",
        os.path.basename(path).split(".")[0],
        {"offsets": ("<i8", ())},
        lambda sink: (sink.append("offsets", wrapped), {"tokens": int(wrapped[-1])})[1],
        index_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match="rebuilding"):
        w = ds.windows("t", 2, index_dir=tmp_path)
    assert len(w) == 2


def test_token_counts_beyond_int64_in_records_are_named():
    for count in (2**70, np.uint64(2**64 - 1)):
        ds = tg.Dataset([{"t": np.arange(3), "n": count}])
        with pytest.raises(CorruptDataError, match=r"record 0 .*token count 'n' is"):
            ds.windows("t", 2, lengths="n", index_dir=None)


def test_special_tokens_outside_int64_or_negative_are_refused_when_asked():
    ds = tg.Dataset([{"t": np.arange(5)}])
    for kwargs in ({"bos": 2**70}, {"eos": -7}, {"pad_id": 2**64, "mode": "pack"}):
        with pytest.raises(ValueError, match=r"must be a token id in \["):
            ds.windows("t", 2, index_dir=None, **kwargs)
    assert ds.windows("t", 8, mode="pack", pad_id=-1, index_dir=None)[0]["input_ids"][-1] == -1


def test_negative_token_ids_are_an_error_naming_the_records(tmp_path):
    docs = [np.array([1, 2, 3]), np.array([4, -100, 6])]
    write_parquet_docs(tmp_path / "pq", docs)
    # Lengths from the list offsets: found when the window is read.
    w = tg.Dataset(tg.ParquetSource(tmp_path / "pq")).windows("tokens", 2, index_dir=None)
    assert w[0]["input_ids"].tolist() == [1, 2]
    with pytest.raises(CorruptDataError, match=r"records \[0, 1\] .* negative token id \(-100\)"):
        w.__getitems__([0, 1])
    # Lengths measured by reading the records: found when the index is built.
    with pytest.raises(CorruptDataError, match=r"record.* negative token id \(-100\)"):
        tg.Dataset([{"t": t} for t in docs]).windows("t", 2, index_dir=None)


def test_parquet_lists_of_other_than_integers_are_refused_when_indexed(tmp_path):
    table = pa.table(
        {
            "nested": pa.array([[[1], [2]], [[4]]], pa.list_(pa.list_(pa.int64()))),
            "words": pa.array([["a", "b"], ["c"]]),
        }
    )
    pq.write_table(table, tmp_path / "a.parquet")
    ds = tg.Dataset(tg.ParquetSource(tmp_path / "a.parquet"))
    for column in ("nested", "words"):
        with pytest.raises(TypeError, match=f"column '{column}' .* not a list of token ids"):
            ds.windows(column, 1, index_dir=None)


def test_parquet_fixed_size_list_token_columns_are_read(tmp_path):
    # Pre-packed or fixed-length token rows (HF datasets' Sequence(length=n)) are stored as
    # fixed_size_list<int>; a null row is an empty document, as a null list is.
    rows = [np.arange(8) + 10 * i for i in range(7)]
    values = pa.array(np.concatenate(rows).astype(np.int32))
    column = pa.FixedSizeListArray.from_arrays(values, 8, mask=pa.array([i == 3 for i in range(7)]))
    pq.write_table(pa.table({"tokens": column}), tmp_path / "a.parquet", row_group_size=3)
    ds = tg.Dataset(tg.ParquetSource(tmp_path / "a.parquet"))
    docs = [np.zeros(0, np.int64) if i == 3 else r for i, r in enumerate(rows)]
    check_concat(ds.windows("tokens", 5, eos=999, index_dir=tmp_path / "ix"), docs, 5, eos=999)
    pack = ds.windows("tokens", 9, mode="pack", index_dir=tmp_path / "ix")
    got = sorted(
        t
        for w in pack.__getitems__(list(range(len(pack))))
        for t in w["input_ids"][w["document_ids"] >= 0].tolist()
    )
    assert got == sorted(np.concatenate(docs).tolist())


def test_text_stored_as_bytes_is_tokenized_as_utf8():
    def tokenizer(batch):
        return [[ord(c) for c in t] for t in batch]

    texts = ["héllo", "", "xy"]
    w = tg.Dataset([{"text": t.encode()} for t in texts]).windows(
        "text", 3, tokenizer=tokenizer, index_dir=None
    )
    check_concat(w, [np.array(tokenizer([t])[0], np.int64) for t in texts], 3)
    with pytest.raises(CorruptDataError, match=r"record 1 .* not UTF-8"):
        tg.Dataset([{"t": b"ok"}, {"t": b"\xff\xfe"}]).windows(
            "t", 3, tokenizer=tokenizer, index_dir=None
        )


def test_pack_bins_leaving_out_a_document_are_rebuilt(tmp_path):
    ds = tg.Dataset([{"t": np.arange(1, n + 1)} for n in (3, 2, 4, 5)])
    path = ds.windows("t", 6, mode="pack", index_dir=tmp_path).source.index_paths[1]
    os.remove(path)
    # Well-formed bins without document 3, their token count agreeing with them.
    derived_index(
        "windows",
        os.path.basename(path).split(".")[0],
        {"docs": ("<i8", ()), "bins": ("<i8", ())},
        lambda sink: (
            sink.append("docs", np.array([2, 1, 0])),
            sink.append("bins", np.array([0, 2, 3])),
            {"tokens": 9, "truncated": 0},
        )[2],
        index_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match="rebuilding"):
        w = ds.windows("t", 6, mode="pack", index_dir=tmp_path)
    placed = np.concatenate([w[i]["document_ids"] for i in range(len(w))])
    assert sorted(set(placed.tolist()) - {-1}) == [0, 1, 2, 3]


def test_token_counts_held_as_0d_arrays_build_the_index(tmp_path):
    # ArrayRecord (msgpack) gives a written np.int32 back as a 0-d array; through a
    # transform the counts are read from the records.
    docs = [np.arange(n, dtype=np.int32) for n in (3, 0, 5)]
    records = [{"tokens": t, "num_tokens": np.int32(len(t))} for t in docs]
    tg.write_array_record(records, tmp_path / "ar")
    ds = tg.Dataset(tg.ArrayRecordSource(tmp_path / "ar")).map(lambda r: r)
    check_concat(ds.windows("tokens", 2, lengths="num_tokens", index_dir=None), docs, 2)


def test_in_memory_documents_of_one_length_do_not_share_a_cached_index(tmp_path, monkeypatch):
    # A list is fingerprinted by its length: by default its index stays in memory.
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path))
    first = [np.arange(n) for n in (5, 3)]
    second = [np.arange(n) for n in (2, 9)]
    tg.Dataset([{"t": t} for t in first]).windows("t", 2)
    w = tg.Dataset([{"t": t} for t in second]).windows("t", 2)
    assert w.source.index_paths == [None]
    check_concat(w, second, 2)


def test_editing_a_windows_input_ids_leaves_its_labels(tmp_path):
    def mask_inputs(window):
        window["input_ids"][::2] = 0  # in place, as a masking or noising map does
        return window

    w = tg.Dataset([{"t": np.arange(1, 10)}]).windows("t", 4, index_dir=None).map(mask_inputs)
    assert w[0]["input_ids"].tolist() == [0, 2, 0, 4]
    assert w[0]["labels"].tolist() == [2, 3, 4, 5]


def test_auto_counts_are_those_of_the_windowed_column(tmp_path):
    # num_tokens counting another column (here the text's words) is not input_ids' count;
    # num_input_ids (what convert --tokens-column input_ids writes) is.
    docs = [np.arange(n) for n in (4, 7, 2)]
    table = pa.table(
        {
            "input_ids": pa.array(docs, pa.list_(pa.int64())),
            "num_tokens": pa.array([1, 1, 1], pa.int32()),
            "num_input_ids": pa.array([len(t) for t in docs], pa.int32()),
        }
    )
    pq.write_table(table, tmp_path / "a.parquet")
    w = tg.Dataset(tg.ParquetSource(tmp_path / "a.parquet")).windows("input_ids", 3, index_dir=None)
    assert w.source._docs.length_column == "num_input_ids"
    check_concat(w, docs, 3)
