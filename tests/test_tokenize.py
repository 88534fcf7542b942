"""Tokenizer hooks: tokenize_batch over a real `tokenizers` tokenizer built here (nothing
downloaded), tokenize() as a map_batch function in DataLoader workers, and
`torchgrain convert --tokenize`."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import torchgrain as tg
from torchgrain.cli import main
from torchgrain.columns import Ragged
from torchgrain.tokens.tokenize import tokenize, tokenize_batch

TEXTS = ["the cat sat", "on the mat", "", "a cat on a mat sat", "the end"] * 3


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS[:5], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    return tok


def _expected(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text).ids


def test_tokenize_batch_kinds_of_tokenizer():
    tok = _tokenizer()
    out = tokenize_batch(tok, [*TEXTS[:4], b"zebra cat"])
    assert all(a.dtype == np.int32 for a in out)
    assert [a.tolist() for a in out[:4]] == [_expected(tok, t) for t in TEXTS[:4]]
    assert out[4].tolist() == [0, _expected(tok, "cat")[0]]  # unknown word: [UNK]
    # a transformers-like tokenizer: a callable returning a mapping with input_ids
    out = tokenize_batch(lambda ts: {"input_ids": [[7] * len(t) for t in ts]}, ["ab", ""])
    assert [a.tolist() for a in out] == [[7, 7], []]
    # errors name the text and the tokenizer
    with pytest.raises(TypeError, match="text 1 of the batch is a NoneType"):
        tokenize_batch(tok, ["a", None])
    with pytest.raises(ValueError, match="returned 1 sequences for 2 texts"):
        tokenize_batch(lambda ts: [[1]], ["a", "b"])
    with pytest.raises(ValueError, match=r"text 0 token id -1, outside \[0, 2\*\*31\)"):
        tokenize_batch(lambda ts: [[-1]], ["a"])
    with pytest.raises(ValueError, match="text 0 of the batch is not UTF-8"):
        tokenize_batch(tok, [b"\xff"])


def test_tokenize_in_workers_records_and_columns():
    tok = _tokenizer()
    fn = tokenize("text", tok, "tokens", lengths="num_tokens")
    ds = tg.Dataset([{"text": t, "i": i} for i, t in enumerate(TEXTS)]).map_batch(fn)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, num_workers=1, collate_fn=tg.pad_collate(keys=["tokens"], pad_id=-1)
    )
    for batch in loader:
        for row, i, n in zip(batch["tokens"], batch["i"].tolist(), batch["num_tokens"].tolist()):
            want = _expected(tok, TEXTS[i])
            assert n == len(want) and row[: len(want)].tolist() == want
            assert (row[len(want) :] == -1).all()
    # columns: the tokens are a Ragged column, the counts an int32 column
    from torchgrain.columns import ColumnBatch

    batch = fn(ColumnBatch.from_records([{"text": t} for t in TEXTS[:4]]))
    assert isinstance(batch["tokens"], Ragged) and batch["tokens"].values.dtype == np.int32
    assert [r.tolist() for r in batch["tokens"]] == [_expected(tok, t) for t in TEXTS[:4]]
    assert batch["num_tokens"].dtype == np.int32
    with pytest.raises(KeyError, match="record 0 of the batch has no field 'body'"):
        tokenize("body", tok)([{"text": "a"}])


@pytest.mark.parametrize("to", ["parquet", "array_record"])
def test_convert_tokenize(tmp_path, to):
    tok = _tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"text": TEXTS, "id": list(range(len(TEXTS)))}), src / "a.parquet")
    dst = tmp_path / "out"
    args = ["convert", str(src), str(dst), "--to", to, "-q", "--tokenize"]
    assert main([*args, str(tmp_path / "tokenizer.json"), "--tokens-column", "ids"]) == 0
    if to == "parquet":
        (path,) = dst.glob("*.parquet")
        table = pq.read_table(path)
        assert table.schema.field("ids").type == pa.list_(pa.int32())
        assert table.schema.field("num_ids").type == pa.int32()
        assert table.column("ids").to_pylist() == [_expected(tok, t) for t in TEXTS]
        assert table.column("num_ids").to_pylist() == [len(_expected(tok, t)) for t in TEXTS]
        # padded straight from the Parquet columns (Ragged), with no warning
        ds = tg.Dataset(tg.ParquetSource(str(path)), batch_format="columns")
        collate = tg.pad_collate(keys=["ids"], pad_id=-1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=collate)))
        for row, text in zip(batch["ids"].tolist(), TEXTS):
            want = _expected(tok, text)
            assert row == want + [-1] * (batch["ids"].shape[1] - len(want))
    else:
        src_out = tg.ArrayRecordSource(str(dst))
        recs = src_out.__getitems__(list(range(len(TEXTS))))
        assert [r["ids"].tolist() for r in recs] == [_expected(tok, t) for t in TEXTS]
        assert all(r["ids"].dtype == np.int32 for r in recs)
        assert [int(r["num_ids"]) for r in recs] == [len(_expected(tok, t)) for t in TEXTS]
        assert [r["text"] for r in recs] == TEXTS


def test_convert_tokenize_errors(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"body": ["x"]}), src / "a.parquet")
    _tokenizer().save(str(tmp_path / "tok.json"))
    args = ["convert", str(src), str(tmp_path / "out"), "-q", "--tokenize"]
    assert main([*args, str(tmp_path / "tok.json")]) != 0
    err = capsys.readouterr().err
    assert "no field 'text'" in err and "records 0..0 of input shard 0" in err
    (tmp_path / "bad.json").write_text("{")
    assert main([*args, str(tmp_path / "bad.json")]) != 0
    assert "cannot load" in capsys.readouterr().err
