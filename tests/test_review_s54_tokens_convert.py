"""Token windows and conversions against what they promise: every document's tokens in
the windows, in order, or an error naming what is wrong with the data; never a valid
dataset refused because of an option the user did not give."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import torchgrain as tg
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord


def _stream(docs: list[list[int]], seq_len: int) -> list[list[int]]:
    """The concat-mode windows' input_ids of ``docs`` (no bos/eos)."""
    flat = [t for d in docs for t in d]
    n = max(0, (len(flat) - 1) // seq_len)
    return [flat[i * seq_len : (i + 1) * seq_len] for i in range(n)]


def test_auto_lengths_ignore_a_count_column_that_only_some_parquet_files_have(tmp_path):
    """``lengths="auto"`` (the default) uses ``num_<column>`` "when the records have it".
    In a directory where one Parquet file has the count column (written by ``convert
    --tokenize``) and another has only the tokens, the records of the second have no
    count: the windows must measure the tokens (as ``lengths=None`` does), not fail
    with "token count column 'num_t' holds nulls" on a dataset with nothing wrong."""
    pq.write_table(
        pa.table(
            {
                "t": pa.array([[1, 2, 3], [4]], pa.list_(pa.int32())),
                "num_t": pa.array([3, 1], pa.int32()),
            }
        ),
        tmp_path / "a.parquet",
    )
    pq.write_table(
        pa.table({"t": pa.array([[5, 6], [7, 8, 9]], pa.list_(pa.int32()))}),
        tmp_path / "b.parquet",
    )
    ds = tg.Dataset(tg.ParquetSource(str(tmp_path)))
    w = ds.windows("t", 2, index_dir=None, progress=False)
    got = [w[i]["input_ids"].tolist() for i in range(len(w))]
    assert got == _stream([[1, 2, 3], [4], [5, 6], [7, 8, 9]], 2)


def test_a_count_column_of_lists_is_not_taken_for_token_counts(tmp_path):
    """A tf.Example holds every int as a list, so a TFRecord corpus with ``tokens`` and
    ``num_tokens`` features converts to Parquet with ``num_tokens`` a ``list<int64>``
    column ([3], [1], [2]). The default ``lengths="auto"`` picks it, and the index build
    takes each list's length (1) as the document's token count, as it would for the
    token column itself: the first window read then fails saying the data "changed
    since the index was built" (and a wrong index is cached). A count column that is
    not integers must be refused when the index is built, naming it, or left aside by
    "auto" (the windows then measured from the tokens, as ``lengths=None`` does)."""
    docs = [[1, 2, 3], [4], [5, 6]]
    (tmp_path / "tf").mkdir()
    examples = [
        encode_tf_example({"tokens": np.array(t, np.int64), "num_tokens": np.array([len(t)])})
        for t in docs
    ]
    write_tfrecord(examples, str(tmp_path / "tf" / "a.tfrecord"))
    tg.convert(tmp_path / "tf", tmp_path / "pq", to="parquet")
    ds = tg.Dataset(tg.open(str(tmp_path / "pq")))
    try:
        w = ds.windows("tokens", 2, index_dir=None, progress=False)
    except (TypeError, ValueError, tg.CorruptDataError) as e:
        assert "num_tokens" in str(e)
        return
    got = [w[i]["input_ids"].tolist() for i in range(len(w))]
    assert got == _stream(docs, 2)


@pytest.mark.parametrize(
    ("dtype", "pad"),
    [(torch.float16, 2049), (torch.bfloat16, 257), (torch.float16, -1e9)],
    ids=["float16-2049", "bfloat16-257", "float16-minus-1e9"],
)
def test_pad_collate_float_rows_keep_the_padding_value(dtype, pad):
    """pad_collate promises each padded field "in its rows' dtype ... promoted to hold
    them all and the padding value". Float16 or bfloat16 rows padded with a value their
    dtype cannot hold exactly (a sentinel such as 2049, or -1e9 as attention biases use)
    must come out in a dtype that holds it (the values unchanged), or as a ValueError
    naming the field; today the padding is silently rounded (2049 reads 2048, 257 reads
    256) or fails with torch's "cannot be converted to type c10::Half without overflow",
    which names no field."""
    batch = [
        {"feats": torch.tensor([1.5], dtype=dtype)},
        {"feats": torch.tensor([2.0, 3.0], dtype=dtype)},
    ]
    try:
        out = tg.pad_collate(batch, keys=["feats"], pad_id=pad)["feats"]
    except ValueError as e:
        assert "feats" in str(e)
        return
    assert out[0, 1].item() == pad
    assert out[0, 0].item() == 1.5 and out[1].tolist() == [2.0, 3.0]


def test_collate_windows_keeps_the_fields_a_map_adds(tmp_path):
    """Windows are a dataset like any other, and a ``map`` or ``random_map`` on them may
    add fields (a loss mask, ``MaskTokens(labels_key="mlm_labels")``). The collate the
    windows are documented with must hand those to the model too (collated as torch's
    default collate does, as pad_collate does with the fields it does not pad), never
    drop them from the batch silently (``model(**batch)`` then runs without them)."""
    from torchgrain.tokens.windows import collate_windows

    docs = [{"t": np.arange(9)}]
    w = tg.Dataset(docs).windows("t", 4, index_dir=None, progress=False)
    masked = w.map(lambda r: {**r, "loss_mask": (r["input_ids"] % 2).astype(np.int64)})
    batch = collate_windows([masked[0], masked[1]])
    assert "loss_mask" in batch
    assert batch["loss_mask"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 1]]
    assert batch["input_ids"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _optional_key_input(tmp_path, fmt):
    """Three records, the second without ``b`` (an optional key or feature)."""
    src = tmp_path / "in"
    if fmt == "array_record":
        tg.write_array_record([{"a": 1, "b": b"x"}, {"a": 2}, {"a": 3, "b": b"z"}], src)
        return src
    src.mkdir()
    examples = [
        encode_tf_example({"a": np.array([1]), "b": [b"x"]}),
        encode_tf_example({"a": np.array([2])}),
        encode_tf_example({"a": np.array([3]), "b": [b"z"]}),
    ]
    write_tfrecord(examples, str(src / "a.tfrecord"))
    return src


@pytest.mark.parametrize("fmt", ["array_record", "tfrecord"])
@pytest.mark.parametrize("to", ["array_record", "parquet"])
def test_convert_columns_keeps_records_without_an_optional_key(tmp_path, fmt, to):
    """A key that some records lack (an optional tf.Example feature, a msgpack field
    written only where it has a value) converts without ``columns=``: the records read
    back without it (or with None in Parquet). Selecting that key with ``columns=`` must
    convert the same records the same way, not stop at the first record without it with
    "record 1 ... has no column 'b'" after the shards before it were written."""
    src = _optional_key_input(tmp_path, fmt)
    tg.convert(src, tmp_path / "all", to=to)
    tg.convert(src, tmp_path / "sel", to=to, columns=["b"])
    full, sel = tg.open(str(tmp_path / "all")), tg.open(str(tmp_path / "sel"))
    assert len(sel) == len(full) == 3
    for i in range(3):
        want = full[i].get("b")
        got = sel[i].get("b")
        assert (None if want is None else list(want)) == (None if got is None else list(got))


def test_inspect_measures_the_tokens_beside_a_count_column_of_lists(tmp_path, capsys):
    """``torchgrain inspect`` takes the count column that ``windows(lengths="auto")``
    takes: a ``num_tokens`` of one-element lists (a tf.Example's, converted to Parquet)
    counts no tokens, so the token lists are measured, not refused or counted as 1 each."""
    import json

    from torchgrain.cli import main

    sizes = [3, 0, 5, 2]
    tokens = [list(range(n)) for n in sizes]
    table = pa.table({"tokens": tokens, "num_tokens": [[n] for n in sizes]})
    path = tmp_path / "docs.parquet"
    pq.write_table(table, path)
    assert main(["inspect", str(path), "--json", "--samples", "0"]) == 0
    got = json.loads(capsys.readouterr().out)["tokens"]
    assert got["lengths_from"] == "tokens"
    assert (got["documents"], got["tokens"], got["max"]) == (4, 10, 5)
