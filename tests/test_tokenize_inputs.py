"""tokenize_batch and pad_collate never give a wrong token without an error: texts that
are not strings or UTF-8 bytes, padded tokenizer output, ids a padded dtype cannot hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchgrain.tokens.tokenize import tokenize_batch


def _codepoints(texts):
    return [[ord(c) for c in t] for t in texts]


@pytest.mark.parametrize(
    "text",
    [
        "hi",
        b"hi",
        bytearray(b"hi"),
        memoryview(b"hi"),
        np.array("hi"),
        np.str_("hi"),
        np.frombuffer(b"hi", np.uint8),
        np.frombuffer(b"hi", np.int8),
    ],
    ids=["str", "bytes", "bytearray", "memoryview", "0d-str", "np-str", "uint8", "int8"],
)
def test_texts_the_docstring_promises_are_read_as_text(text):
    assert [a.tolist() for a in tokenize_batch(_codepoints, ["yo", text])] == [
        [121, 111],
        [104, 105],
    ]


@pytest.mark.parametrize(
    "text",
    [
        np.array([104, 105]),
        np.array(["hi", "yo"]),
        np.zeros((2, 2), np.uint8),
        np.array([1.0, 2.0]),
        memoryview(np.array([104, 105], np.int64)),
        7,
        None,
    ],
    ids=["int64", "1d-str", "2d-uint8", "float", "memoryview-int64", "int", "none"],
)
def test_other_values_are_refused_naming_their_position_and_type(text):
    with pytest.raises(TypeError, match=r"text 1 of the batch is a .*not a string"):
        tokenize_batch(_codepoints, ["yo", text])


def _collate(batch, columns, **kw):
    import torchgrain as tg
    from torchgrain.columns import ColumnBatch

    return tg.pad_collate(ColumnBatch.from_records(batch) if columns else batch, **kw)


@pytest.mark.parametrize("columns", [False, True], ids=["records", "columns"])
def test_pad_collate_refuses_uint64_ids_int64_cannot_hold_naming_the_field(columns):
    big = 2**63 + 5
    batch = [{"ids": np.array([7], np.uint64)}, {"ids": np.array([1, big], np.uint64)}]
    with pytest.raises(ValueError, match=rf"field 'ids' of (record|row) 1 .*{big}.*2\*\*63"):
        _collate(batch, columns, pad_id=-1)
    fits = [{"ids": np.array([7], np.uint64)}, {"ids": np.array([1, 2**63 - 1], np.uint64)}]
    out = _collate(fits, columns, pad_id=-1)["ids"]
    assert out.tolist() == [[7, -1], [1, 2**63 - 1]]
    assert _collate(batch, columns)["ids"].tolist() == [[7, 0], [1, big]]  # pad 0: uint64


@pytest.mark.parametrize("columns", [False, True], ids=["records", "columns"])
def test_pad_collate_never_rounds_integer_ids_to_a_float_pad(columns):
    batch = [{"ids": np.array([2**24 + 1], np.int64)}, {"ids": np.array([1, 2], np.int64)}]
    with pytest.raises(ValueError, match=r"padding value 0.5 of field 'ids' is not an integer"):
        _collate(batch, columns, pad_id=0.5)
    out = _collate(batch, columns, pad_id=3.0)["ids"]  # an integer, as a float
    assert out.dtype == torch.int64 and out.tolist() == [[2**24 + 1, 3], [1, 2]]


def test_pad_collate_promotes_unsigned_and_signed_rows_to_a_dtype_holding_both():
    import torchgrain as tg

    batch = [{"ids": np.array([2**32 - 1], np.uint32)}, {"ids": np.array([-3, 4], np.int32)}]
    out = tg.pad_collate(batch)["ids"]
    assert out.dtype == torch.int64 and out.tolist() == [[2**32 - 1, 0], [-3, 4]]
    small = [{"ids": np.array([200], np.uint8)}, {"ids": np.array([-3, 4], np.int8)}]
    assert tg.pad_collate(small)["ids"].dtype == torch.int16
    mixed = [{"ids": np.array([2**63 + 1], np.uint64)}, {"ids": np.array([-3], np.int64)}]
    with pytest.raises(ValueError, match=r"field 'ids' of record 0"):
        tg.pad_collate(mixed)


@pytest.mark.parametrize("kind", ["numpy", "torch", "mapping"])
def test_a_padded_2d_tokenizer_output_is_refused_not_read_row_by_row(kind):
    def padded(texts):  # return_tensors="np": rows padded with 0 to the longest
        ids = np.zeros((len(texts), max(map(len, texts))), np.int64)
        for i, t in enumerate(texts):
            ids[i, : len(t)] = [ord(c) for c in t]
        if kind == "torch":
            return torch.from_numpy(ids)
        return {"input_ids": ids} if kind == "mapping" else ids

    with pytest.raises(TypeError, match=r"shape \[2, 3\], padded: return a list of unpadded"):
        tokenize_batch(padded, ["hi", "you"])


@pytest.mark.parametrize("columns", [False, True], ids=["records", "columns"])
def test_pad_collate_of_rows_all_empty_is_a_b_by_0_tensor_with_its_mask(columns):
    batch = [{"ids": [], "y": 1}, {"ids": [], "y": 2}]
    out = _collate(batch, columns)
    assert out["ids"].shape == (2, 0) and out["attention_mask"].shape == (2, 0)
    assert out["y"].tolist() == [1, 2]
    some = _collate([{"ids": [], "y": 1}, {"ids": [4], "y": 2}], columns)
    assert some["ids"].tolist() == [[0], [4]] and some["attention_mask"].tolist() == [[0], [1]]
