"""The padding collate, the default collate's error for ragged values, and the Ragged
helpers (to_nested, to_padded), checked against hand-built tensors."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain.columns import ColumnBatch, Ragged
from torchgrain.errors import RaggedBatchError, TorchgrainError
from torchgrain.tokens.windows import collate_windows


def _records():
    return [
        {"input_ids": np.array([5, 6, 7], np.int32), "labels": [5, 6, 7], "id": 0},
        {"input_ids": np.array([8], np.int32), "labels": [8], "id": 1},
        {"input_ids": np.array([], np.int32), "labels": [], "id": 2},
    ]


# ------------------------------------------------------------------ Ragged
def test_ragged_to_nested_pads_to_the_longest_row():
    r = Ragged.from_values([np.arange(3), np.arange(1), np.arange(0), np.arange(2)])
    nt = r.to_nested()
    padded = torch.nested.to_padded_tensor(nt, -1)
    assert padded.tolist() == [[0, 1, 2], [0, -1, -1], [-1, -1, -1], [0, 1, -1]]


def test_ragged_to_padded_against_hand_built():
    r = Ragged(np.array([9, 1, 2, 3, 4, 5], np.int64), np.array([1, 3, 3, 6]), "array")
    right, lengths = r.to_padded(-1, multiple_of=4)
    assert right.tolist() == [[1, 2, -1, -1], [-1, -1, -1, -1], [3, 4, 5, -1]]
    assert lengths.tolist() == [2, 0, 3]
    left, _ = r.to_padded(0, side="left")
    assert left.tolist() == [[0, 1, 2], [0, 0, 0], [3, 4, 5]]
    # collated (tensors), bytes rows come out as uint8
    b = Ragged.from_values([b"ab", b"c"]).map_arrays(torch.from_numpy)
    out, _ = b.to_padded()
    assert out.dtype == torch.uint8 and out.tolist() == [[97, 98], [99, 0]]
    read_only = np.frombuffer(b"\x01\x02\x03", np.uint8)  # e.g. a view of a mapped file
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns of a read-only array: only read here
        out, _ = Ragged(read_only, np.array([0, 1, 3]), "array").to_padded()
    assert out.tolist() == [[1, 0], [2, 3]]
    empty, lengths = Ragged.from_values([]).to_padded()
    assert empty.shape == (0, 0) and lengths.tolist() == []


def test_ragged_to_padded_refuses_bad_offsets():
    with pytest.raises(ValueError, match="ascend"):
        Ragged(np.arange(4), np.array([0, 3, 2]), "array").to_padded()
    with pytest.raises(ValueError, match="within its 4 values"):
        Ragged(np.arange(4), np.array([0, 2, 9]), "array").to_padded()


# ------------------------------------------------------------ pad_collate
def test_pad_collate_records_against_hand_built():
    out = tg.pad_collate(_records(), keys=["input_ids"], multiple_of=4)
    assert out["input_ids"].dtype == torch.int32
    assert out["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0], [0, 0, 0, 0]]
    assert out["labels"].tolist() == [[5, 6, 7, -100], [8, -100, -100, -100], [-100] * 4]
    assert out["attention_mask"].dtype == torch.int64
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert out["id"].tolist() == [0, 1, 2]
    assert list(out) == ["input_ids", "labels", "id", "attention_mask"]

    left = tg.pad_collate(
        keys=["input_ids"], side="left", pad_values={"input_ids": 2}, attention_mask=None
    )(_records())
    assert left["input_ids"].tolist() == [[5, 6, 7], [2, 2, 8], [2, 2, 2]]
    assert "attention_mask" not in left


def test_pad_collate_is_a_picklable_collate_for_a_dataloader(tmp_path):
    recs = [{"tokens": np.arange(n, dtype=np.uint16), "n": n} for n in (3, 1, 4, 1, 5)]
    _ = tg.write_array_record(recs, str(tmp_path))
    collate = pickle.loads(pickle.dumps(tg.pad_collate(keys=["tokens"], pad_values={"tokens": 7})))
    ds = tg.Dataset(tg.ArrayRecordSource(str(tmp_path)))
    batches = list(torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=collate))
    assert batches[0]["tokens"].tolist() == [[0, 1, 2], [0, 7, 7]]
    assert batches[0]["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batches[2]["tokens"].tolist() == [[0, 1, 2, 3, 4]]
    # the same through columns (Ragged tokens), labels padding promotes uint16 to int64
    cols = tg.Dataset(tg.ArrayRecordSource(str(tmp_path)), batch_format="columns")
    cols = cols.map_batch(lambda b: ColumnBatch({**b, "labels": b["tokens"]}, num_rows=len(b)))
    batch = next(iter(torch.utils.data.DataLoader(cols, batch_size=2, collate_fn=collate)))
    assert batch["tokens"].tolist() == [[0, 1, 2], [0, 7, 7]]
    assert batch["labels"].dtype == torch.int64
    assert batch["labels"].tolist() == [[0, 1, 2], [0, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["n"].tolist() == [3, 1]


def test_pad_collate_columns_batch_multiple_of_and_left():
    batch = ColumnBatch.from_records(_records())
    out = tg.pad_collate([batch], keys=["input_ids"], multiple_of=4, side="left")
    assert out["input_ids"].tolist() == [[0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    # labels are Python lists there: a list column, padded row by row
    assert out["labels"].tolist() == [[-100, 5, 6, 7], [-100, -100, -100, 8], [-100] * 4]


def test_pad_collate_errors_name_the_field_and_record():
    recs = _records()
    with pytest.raises(
        ValueError, match=r"'input_ids' of record 0 .* 3 values, more than max_length=2"
    ):
        tg.pad_collate(recs, keys=["input_ids"], max_length=2)
    assert tg.pad_collate(recs, keys=["input_ids"], max_length=3, multiple_of=4)[
        "input_ids"
    ].shape == (3, 3)
    recs[1]["input_ids"] = np.zeros((2, 2))
    with pytest.raises(TypeError, match=r"'input_ids' of record 1 .*shape \[2, 2\]"):
        tg.pad_collate(recs, keys=["input_ids"])
    with pytest.raises(KeyError, match="record 0 of the batch has no field 'tokens'"):
        tg.pad_collate(_records(), keys=["tokens"])
    with pytest.raises(ValueError, match="side"):
        tg.pad_collate(side="middle")


# --------------------------------------------- the default collate's message
def test_default_collate_names_the_ragged_key(tmp_path):
    ds = tg.Dataset([{"ids": np.arange(n), "y": n} for n in (948, 1294, 3)])
    loader = torch.utils.data.DataLoader(ds, batch_size=3)
    with pytest.raises(RaggedBatchError) as e:
        next(iter(loader))
    message = str(e.value)
    assert "'ids'" in message and "[948] at entry 0, [1294] at entry 1" in message
    assert "tg.pad_collate(keys=['ids'])" in message and "windows" in message
    assert isinstance(e.value, TorchgrainError) and isinstance(e.value, RuntimeError)
    # lists of different lengths, nested in a dict
    ragged_lists = tg.Dataset([{"a": {"b": [1, 2]}}, {"a": {"b": [1]}}])
    with pytest.raises(RaggedBatchError, match="'b'"):
        next(iter(torch.utils.data.DataLoader(ragged_lists, batch_size=2)))
    # equal lengths collate as torch does; dict subclasses keep their type
    from collections import OrderedDict

    equal = tg.Dataset([OrderedDict(x=np.zeros(2), s="a"), OrderedDict(x=np.ones(2), s="b")])
    batch = next(iter(torch.utils.data.DataLoader(equal, batch_size=2)))
    assert type(batch) is OrderedDict and batch["x"].shape == (2, 2) and batch["s"] == ["a", "b"]


def test_default_collate_message_from_a_worker():
    ds = tg.Dataset([{"ids": np.arange(n)} for n in (2, 3)])
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=1)
    with pytest.raises(RaggedBatchError, match=r"'ids'.*\[2\] at entry 0, \[3\] at entry 1"):
        next(iter(loader))


def test_ragged_to_padded_holds_a_pad_value_its_values_dtype_cannot():
    rows = Ragged.from_values([np.array([1, 2], np.uint16), np.array([3], np.uint16)])
    padded, lengths = rows.to_padded(-100, side="left")
    assert padded.dtype == torch.int64 and lengths.tolist() == [2, 1]
    assert padded.tolist() == [[1, 2], [-100, 3]]  # not 65436
    assert rows.to_padded(7)[0].dtype == torch.uint16  # fits: the values' dtype
    halves, _ = Ragged.from_values([np.array([1, 2], np.int8), np.array([3], np.int8)]).to_padded(
        0.5
    )
    assert halves.tolist() == [[1.0, 2.0], [3.0, 0.5]]


def test_window_boundaries_are_not_padded_but_pointed_to_collate_windows():
    w = tg.Dataset([{"t": np.arange(n)} for n in (3, 9, 2)]).windows("t", 4, index_dir=None)
    batch = [w[0], w[1]]  # cu_seqlens [0, 3, 4] and [0, 4]: padded, [0, 4, 0]
    for collate in (tg.pad_collate(), torch.utils.data.default_collate):
        with pytest.raises(RaggedBatchError, match=r"cu_seqlens.*collate_windows"):
            collate(batch)
    named = tg.pad_collate(batch, keys=["cu_seqlens"], attention_mask=None)
    assert named["cu_seqlens"].tolist() == [[0, 3, 4], [0, 4, 0]]  # asked for by name


def test_collate_windows_refuses_a_batch_past_int32_cu_seqlens():
    # Zero-stride windows: 2 x 2**30 tokens, nothing allocated before the check.
    big = np.broadcast_to(np.int64(0), (2**30,))
    window = {k: big for k in ("input_ids", "labels", "position_ids", "document_ids")}
    window["cu_seqlens"] = np.array([0, 2**30], np.int32)
    with pytest.raises(ValueError, match="2\\*\\*31 tokens"):
        collate_windows([window, window])
    with pytest.raises(ValueError, match="below 2\\*\\*31"):
        tg.Dataset([{"t": np.arange(5)}]).windows("t", 2**31, index_dir=None)
