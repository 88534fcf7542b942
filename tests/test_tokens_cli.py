"""The command line on token data: ``torchgrain inspect`` counts tokens and document
lengths, ``torchgrain bench`` reports tokens/s."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.cli import main

# Odd sizes: empty documents, one-token ones, a long one.
SIZES = [5, 0, 1, 37, 0, 3, 100, 2, 0, 11, 64, 1, 9]


def token_parquet(path, sizes, counts=None):
    """A Parquet file of a ``tokens`` list<int32> column and its ``num_tokens``
    (``counts``: written as given, to tell which of the two was read)."""
    offsets = np.zeros(len(sizes) + 1, np.int32)
    np.cumsum(sizes, out=offsets[1:])
    values = np.arange(int(offsets[-1]), dtype=np.int32) % 1000
    table = pa.table(
        {
            "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            "num_tokens": pa.array(np.asarray(sizes if counts is None else counts, np.int32)),
        }
    )
    pq.write_table(table, path, row_group_size=4)
    return str(path)


def inspect_json(capsys, *argv):
    assert main(["inspect", *argv, "--json", "--samples", "0"]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_counts_tokens_from_num_tokens_alone(tmp_path, capsys):
    # num_tokens disagrees with the lists: the counts shown are num_tokens', so the
    # token lists were not what inspect read.
    counts = [s + 1 for s in SIZES]
    path = token_parquet(tmp_path / "docs.parquet", SIZES, counts)
    t = inspect_json(capsys, path)["tokens"]
    p50, p90, p99 = np.percentile(counts, [50, 90, 99])
    assert t == {
        "column": "tokens",
        "lengths_from": "num_tokens",
        "documents": len(SIZES),
        "tokens": sum(counts),
        "mean": pytest.approx(np.mean(counts)),
        "min": 1,
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": 101,
    }
    assert main(["inspect", path, "--samples", "0"]) == 0
    out = capsys.readouterr().out
    assert f"tokens      {sum(counts):,} in 'tokens' ({len(SIZES)} documents" in out
    assert "p50 4, p90 60, p99 97" in out and "max 101" in out


def test_inspect_counts_tokens_of_arrays_without_a_count(tmp_path, capsys):
    d = str(tmp_path / "ar")
    recs = [{"input_ids": np.full(n, 7, np.int64), "text": "x" * n} for n in SIZES]
    tg.write_array_record(recs, d, num_shards=2)
    t = inspect_json(capsys, d)["tokens"]
    assert (t["column"], t["lengths_from"], t["tokens"]) == ("input_ids", "input_ids", sum(SIZES))
    assert (t["min"], t["max"], t["p50"]) == (0, 100, float(np.median(SIZES)))
    # No column of token ids (auto finds none; --tokens names one that is not there).
    plain = str(tmp_path / "plain")
    tg.write_array_record([{"x": np.zeros(3, np.int32)}], plain)
    assert "tokens" not in inspect_json(capsys, plain)
    assert main(["inspect", plain, "--tokens", "ids"]) == 2
    assert "--tokens: the records have no column 'ids'" in capsys.readouterr().err


def test_inspect_refuses_a_negative_token_count(tmp_path, capsys):
    path = token_parquet(tmp_path / "bad.parquet", [3, 2], [3, -2])
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err
    assert "token count column 'num_tokens' holds nulls or negative values" in err
    assert "bad.parquet" in err


def test_bench_reports_tokens_per_second(tmp_path, capsys):
    # Every document holds 7 tokens: tokens/s is 7x records/s in each round.
    path = token_parquet(tmp_path / "docs.parquet", [7] * 64)
    argv = ["bench", path, "--workers", "0", "--batch-size", "8", "--seconds", "0.2"]
    assert main([*argv, "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == "tokens"
    for m in report["modes"]:
        assert m["tokens_per_s"] == pytest.approx(7 * m["records_per_s"])
    assert main([*argv, "--tokens", "num_tokens"]) == 2
    err = capsys.readouterr().err
    assert "column 'num_tokens' of" in err and "is int, not a list of token ids" in err
    assert main([*argv, "--tokens", "ids"]) == 2
    assert "has no column 'ids' to count tokens of" in capsys.readouterr().err
