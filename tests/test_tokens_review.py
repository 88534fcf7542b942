"""Token windows checked against an independent reference (every token of every document
where it belongs, under a shuffle and a mid-epoch resume), and hostile documents: a
token count that lies, a ragged nested list, a record without the token column."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import torchgrain as tg
from tests._forged import forge_window_offsets
from torchgrain.errors import CorruptDataError
from torchgrain.tokens.windows import IGNORE, collate_windows


def _augmented(t, bos, eos):
    return ([bos] if bos is not None else []) + list(t) + ([eos] if eos is not None else [])


def _concat_reference(docs, seq_len, bos, eos):
    """Window i: tokens [i L, (i + 1) L + 1) of the documents' stream, as lists."""
    toks, pos, ids = [], [], []
    for d, t in enumerate(docs):
        a = _augmented(t, bos, eos)
        toks += a
        pos += range(len(a))
        ids += [d] * len(a)
    out = []
    for s in range(0, max(0, (len(toks) - 1) // seq_len) * seq_len, seq_len):
        p = pos[s : s + seq_len]
        cu = [k for k in range(seq_len) if k == 0 or p[k] == 0] + [seq_len]
        out.append(
            (toks[s : s + seq_len], toks[s + 1 : s + seq_len + 1], p, ids[s : s + seq_len], cu)
        )
    return out


def _check_packed(got, docs, seq_len, bos, eos, pad):
    """Each non-empty document once, whole (its first seq_len tokens), in its own segment;
    the padding a last segment of pad_id predicting nothing."""
    seen = []
    for w in got:
        inp, lab, pos, ids, cu = (
            w[k].tolist()
            for k in ("input_ids", "labels", "position_ids", "document_ids", "cu_seqlens")
        )
        assert len(inp) == seq_len and cu[0] == 0 and cu[-1] == seq_len
        for a, b in itertools.pairwise(cu):
            d = ids[a]
            assert b > a and ids[a:b] == [d] * (b - a) and pos[a:b] == list(range(b - a))
            if d == -1:
                assert (
                    b == seq_len and inp[a:b] == [pad] * (b - a) and lab[a:b] == [IGNORE] * (b - a)
                )
                continue
            want = _augmented(docs[d], bos, eos)[:seq_len]
            assert inp[a:b] == want and lab[a:b] == [*want[1:], IGNORE]
            seen.append(d)
    assert sorted(seen) == [d for d, t in enumerate(docs) if _augmented(t, bos, eos)]


def _shuffled_then_resumed(w, resume_after):
    """Every window the loader gives under a global shuffle, stopped after
    ``resume_after`` batches of 3 and resumed from its state_dict in a new loader."""

    def loader():
        sampler = tg.GlobalShuffleSampler(w, seed=3)
        return tg.ResumableLoader(DataLoader(w, batch_size=3, sampler=sampler, collate_fn=list))

    first, got = loader(), []
    for k, batch in enumerate(first):
        got += batch
        if k + 1 == resume_after and 3 * (k + 1) < len(w):
            state = first.state_dict()
            again = loader()
            again.load_state_dict(state)
            for rest in again:
                got += rest
            break
    return got


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lengths=st.lists(st.sampled_from([0, 1, 2, 3, 7, 8, 9, 17]), max_size=10),
    seq_len=st.sampled_from([1, 3, 8]),
    bos=st.sampled_from([None, 1]),
    eos=st.sampled_from([None, 2]),
    mode=st.sampled_from(["concat", "pack"]),
    resume_after=st.integers(1, 3),
    seed=st.integers(0, 9),
)
def test_windows_match_an_independent_reference(
    lengths, seq_len, bos, eos, mode, resume_after, seed
):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(3, 10**6, n).tolist() for n in lengths]
    ds = tg.Dataset([{"t": np.array(t, np.int64)} for t in docs])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pack mode's truncation warning
        w = ds.windows("t", seq_len, bos=bos, eos=eos, mode=mode, pad_id=-7, index_dir=None)
    got = _shuffled_then_resumed(w, resume_after)
    assert len(got) == len(w)
    if mode == "pack":
        _check_packed(got, docs, seq_len, bos, eos, -7)
    else:
        ref = _concat_reference(docs, seq_len, bos, eos)
        keys = ("input_ids", "labels", "position_ids", "document_ids", "cu_seqlens")
        assert sorted(tuple(tuple(x[k].tolist()) for k in keys) for x in got) == sorted(
            tuple(map(tuple, r)) for r in ref
        )
    if got:
        collate_windows(got[:4])


def _windows_of(tmp_path, lengths, tokens, **kw):
    """Windows over a Parquet file of token lists whose ``num_t`` column says ``lengths``."""
    path = str(tmp_path / "docs.parquet")
    table = pa.table(
        {"t": pa.array(tokens, pa.list_(pa.int32())), "num_t": pa.array(lengths, pa.int32())}
    )
    pq.write_table(table, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tg.Dataset(tg.ParquetSource(path)).windows(
            "t", 4, index_dir=None, progress=False, **kw
        )


@pytest.mark.parametrize("mode", ["concat", "pack"])
def test_a_token_count_of_zero_beside_tokens_is_an_error_not_a_lost_document(tmp_path, mode):
    # The count column (what convert --tokenize writes) is taken for the index; a count
    # that disagrees with the tokens must be found (when the index is built: a count of
    # 0 with no bos/eos puts the document in no window).
    with pytest.raises(CorruptDataError, match="document 1 "):
        w = _windows_of(tmp_path, [4, 0, 4], [[1, 2, 3, 4], [7, 7, 7], [5, 6, 8, 9]], mode=mode)
        w.__getitems__(list(range(len(w))))


@pytest.mark.parametrize("mapped", [False, True])
def test_a_ragged_nested_token_list_is_a_named_error(mapped):
    ds = tg.Dataset([{"t": [1, 2, 3]}, {"t": [[1, 2], [3]]}, {"t": [4, 5]}])
    if mapped:  # read through the records rather than the columns
        ds = ds.map(dict)
    with pytest.raises(CorruptDataError, match=r"record 1 of .* column 't'"):
        ds.windows("t", 2, index_dir=None, lengths=None)


@pytest.mark.parametrize(
    ("records", "mapped", "message"),
    [
        ([{"t": [1, 2]}, {"u": [3]}], True, r"record 1 of .* has no column 't'"),
        ([{"u": [1]}, {"u": [2]}], True, r"record 0 of .* has no column 't'"),
        ([{"u": [1]}, {"u": [2]}], False, r"records \[0, 1\] of .* have no column 't'"),
    ],
)
def test_a_record_without_the_token_column_is_a_named_error(records, mapped, message):
    ds = tg.Dataset(records)
    if mapped:  # read through the records rather than the columns
        ds = ds.map(dict)
    with pytest.raises(CorruptDataError, match=message):
        ds.windows("t", 2, index_dir=None)


@pytest.mark.parametrize("mode", ["concat", "pack"])
def test_an_index_file_that_says_a_document_is_empty_loses_no_tokens_silently(tmp_path, mode):
    docs = [np.arange(1, 5), np.arange(10, 13), np.arange(20, 24)]
    ds = tg.Dataset([{"t": t} for t in docs])
    # A well-formed file (sound checksum, offsets rising from 0 to its token count) that
    # says document 1 is empty.
    forge_window_offsets(ds, tmp_path, [0, 4, 4, 8], 8)
    w = ds.windows("t", 4, mode=mode, index_dir=tmp_path)
    with pytest.raises(CorruptDataError, match="document 1 "):
        w.__getitems__(list(range(len(w))))
