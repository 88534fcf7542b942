"""What the documentation promises a user, held: a missing path is DatasetNotFoundError,
relative paths with ``..`` open, ``--allow-external-paths`` on the command line, notices
seen once (files skipped, columns missing, no records), and a sampler that repeats an
epoch because nobody called ``set_epoch`` says so."""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import torchgrain as tg
from tests.servers import RangeHTTPServer
from torchgrain import cli
from torchgrain.errors import DatasetWarning, EpochNotSetWarning
from torchgrain.sampling import ContiguousSplit, ResumableSampler


def _caught(fn, category=Warning):
    """``fn()``'s result and the messages of the warnings of ``category`` it issued."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in seen if issubclass(w.category, category)]


# ------------------------------------------------------------------- missing paths
@pytest.mark.parametrize("kind", ["file", "directory", "empty directory", "glob", "memory"])
def test_opening_a_path_that_names_nothing_is_dataset_not_found(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    path = {
        "file": "typo",
        "directory": "typo/",
        "empty directory": "empty",
        "glob": "typo*",
        "memory": "memory://nowhere/typo",
    }[kind]
    with pytest.raises(tg.DatasetNotFoundError, match=path.rstrip("/*")) as e:
        tg.open(path)
    if kind == "empty directory":
        assert "notes.txt" in str(e.value)


def test_opening_a_url_that_answers_404_is_dataset_not_found(tmp_path):
    with RangeHTTPServer(tmp_path) as srv, pytest.raises(tg.DatasetNotFoundError, match="typo"):
        tg.open(f"{srv.url}/typo")


# ---------------------------------------------------------------- relative paths
def _relative_layout(tmp_path, monkeypatch):
    tg.write_parquet([{"id": i} for i in range(6)], tmp_path / "data" / "pq", num_shards=2)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")


@pytest.mark.parametrize("path", ["../data/pq", "../data/./pq/", "../data/pq/*.parquet"])
def test_a_relative_parquet_path_with_dot_dot_opens_at_its_canonical_root(
    tmp_path, monkeypatch, path
):
    _relative_layout(tmp_path, monkeypatch)
    for src in (tg.ParquetSource(path), tg.open(path)):
        assert [r["id"] for r in src.__getitems__(range(6))] == list(range(6))
        assert all(p.startswith(str(tmp_path / "data" / "pq") + "/") for p in src.paths)


def test_the_command_line_reads_a_relative_path_with_dot_dot_and_trusts_only_on_request(
    tmp_path, monkeypatch, capsys
):
    _relative_layout(tmp_path, monkeypatch)
    assert cli.main(["inspect", "../data/pq", "--samples", "0"]) == 0
    # A manifest naming a shard outside its directory: refused, the message names the flag,
    # and the flag opens it.
    tg.write_array_record([{"x": i} for i in range(3)], tmp_path / "src")
    (tmp_path / "ds").mkdir()
    manifest = json.loads((tmp_path / "src" / "torchgrain.json").read_text())
    shard = manifest["shards"][0]["path"]
    shutil.move(tmp_path / "src" / shard, tmp_path / shard)
    manifest["shards"][0]["path"] = f"../{shard}"
    (tmp_path / "ds" / "torchgrain.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert cli.main(["inspect", "../ds", "--json"]) == 2
    assert "--allow-external-paths" in capsys.readouterr().err
    with pytest.raises(tg.UnsafePathError):
        tg.open("../ds")
    assert cli.main(["inspect", "../ds", "--json", "--allow-external-paths"]) == 0
    assert json.loads(capsys.readouterr().out)["num_records"] == 3
    with pytest.raises(tg.UnsafePathError):  # the trust ended with the command
        tg.open("../ds")


# ------------------------------------------------------------------------ notices
def test_files_that_are_not_data_are_named_once_and_listed_by_inspect(tmp_path, capsys):
    d = tmp_path / "ds"
    tg.write_parquet([{"id": i} for i in range(4)], d)
    (d / "stats.csv").write_text("a,b\n")
    for quiet in ("_SUCCESS", ".hidden", "README.md"):
        (d / quiet).write_text("")
    src, said = _caught(lambda: tg.open(str(d)), DatasetWarning)
    assert len(src) == 4 and len(said) == 1
    assert "stats.csv" in said[0] and "README" not in said[0] and "_SUCCESS" not in said[0]
    assert _caught(lambda: tg.ParquetSource(str(d)), DatasetWarning)[1] == []  # once
    assert cli.main(["inspect", str(d), "--json", "--samples", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == [str(d / "stats.csv")]


def test_a_file_missing_a_column_is_named_with_the_column(tmp_path):
    pq.write_table(pa.table({"id": [0, 1], "text": ["a", "b"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [2, 3]}), tmp_path / "b.parquet")
    src, said = _caught(lambda: tg.open(str(tmp_path)), DatasetWarning)
    assert src[2] == {"id": 2, "text": None}
    assert len(said) == 1 and "'text'" in said[0] and "b.parquet" in said[0]
    assert _caught(lambda: tg.open(str(tmp_path)), DatasetWarning)[1] == []


def test_an_empty_dataset_says_so_when_opened_and_when_a_loader_iterates_it(tmp_path):
    pq.write_table(pa.table({"id": pa.array([], pa.int64())}), tmp_path / "empty.parquet")
    src, said = _caught(lambda: tg.open(str(tmp_path / "empty.parquet")), DatasetWarning)
    assert len(src) == 0 and len(said) == 1 and "no records" in said[0]
    ds = tg.Dataset(src)
    loader = torch.utils.data.DataLoader(ds, sampler=tg.GlobalShuffleSampler(ds), batch_size=2)
    batches, said = _caught(lambda: [list(loader) for _ in range(2)], DatasetWarning)
    assert batches == [[], []] and len(said) == 1 and "no records" in said[0]


# ------------------------------------------------------------- the epoch warning
class _Reversed(ResumableSampler):
    """A sampler of the public contract: the records backwards."""

    def epoch_order(self, seed, epoch):
        n = self.dataset_len
        return lambda q: n - 1 - q

    def split(self):
        return ContiguousSplit()


def _samplers(shuffle=True):
    blocks = np.arange(0, 41, 4)
    return [
        tg.GlobalShuffleSampler(40, num_replicas=1, rank=0, shuffle=shuffle),
        tg.BlockShuffleSampler(
            range(40), num_replicas=1, rank=0, shuffle=shuffle, block_offsets=blocks
        ),
        _Reversed(40, num_replicas=1, rank=0, shuffle=shuffle),
    ]


@pytest.mark.parametrize("k", range(3))
def test_a_pass_repeating_an_epoch_without_set_epoch_warns_once_and_only_then(k):
    sampler = _samplers()[k]

    def said_epochs():  # every pass's epoch is said or loaded: no warning
        iter(sampler)  # made and dropped unused (torchdata does): not a pass
        for epoch in (0, 1, 1):  # the same epoch again, on purpose: said with set_epoch
            sampler.set_epoch(epoch)
            list(sampler)
        sampler.load_state_dict(sampler.state_dict())
        list(sampler)
        plain = _samplers(shuffle=False)[k]
        list(plain), list(plain)

    with warnings.catch_warnings():
        warnings.simplefilter("error", EpochNotSetWarning)
        said_epochs()

    sampler = _samplers()[k]
    loader = torch.utils.data.DataLoader(range(40), sampler=sampler, batch_size=8)
    first, said = _caught(lambda: [torch.cat(list(loader)).tolist() for _ in range(3)])
    assert first[0] == first[1] == first[2]  # what the warning is about
    assert len(said) == 1 and "set_epoch(epoch)" in said[0]
    assert _caught(lambda: list(sampler), EpochNotSetWarning)[1] == []  # once per sampler
