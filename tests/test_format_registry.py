"""A new format is one module and one registry call: every command then reads it.

The format below (a directory of ``.npy`` files, one record per file) is written here,
in the test, with public names only; nothing in ``cli.py``, ``bench.py`` or
``convert/`` knows it. ``tg.open``, ``torchgrain inspect``, ``torchgrain bench`` and
``torchgrain convert`` (with it as the input) must all work on it.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import numpy as np
import pytest

import torchgrain as tg
from torchgrain.cli import main
from torchgrain.errors import CorruptDataError
from torchgrain.sources import registry
from torchgrain.writers import OutputFormat, ShardWriter

# ------------------------------------------------------------- the new format


class NpyFormat:
    """A directory of ``.npy`` files, one record ``{"array": ndarray}`` per file, in
    file-name order. ``allow_pickle`` stays off: object arrays are refused."""

    name, suffixes = "npy", (".npy",)

    def open(self, file: tg.sources.ShardFile) -> _NpyFile:
        return _NpyFile(file)


class _NpyFile:
    def __init__(self, file: tg.sources.ShardFile) -> None:
        self.file = file

    def __len__(self) -> int:
        return 1

    def read(self, rows: np.ndarray) -> list[dict[str, Any]]:
        try:
            array = np.load(io.BytesIO(self.file.read()), allow_pickle=False)
        except ValueError as e:
            raise CorruptDataError(f"npy file {self.file.path!r}: {e}") from e
        return [{"array": array} for _ in rows.tolist()]

    def close(self) -> None:
        pass


class NpySource(tg.FormatSource):
    format = NpyFormat()


def write_npy(records: Any, directory: str, *, num_shards: int = 1) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = []
    for i, rec in enumerate(records):
        paths.append(os.path.join(directory, f"rec-{i:05d}.npy"))
        np.save(paths[-1], rec["array"])
    return paths


NPY = registry.Format.for_source(
    NpySource, write=write_npy, description="a directory of .npy files, one record per file"
)


@pytest.fixture
def npy_format(monkeypatch):
    """The npy format registered for one test (the registry is restored after)."""
    monkeypatch.setattr(registry, "_FORMATS", dict(registry._FORMATS))
    registry.register_format(NPY)
    return NPY


@pytest.fixture
def npy_dir(tmp_path, npy_format):
    d = tmp_path / "arrays"
    write_npy(({"array": np.full((2, 3), i, np.int16)} for i in range(12)), str(d))
    return d


# ------------------------------------------------------------------- the tests


def test_a_registered_format_opens_with_tg_open_by_its_file_names(npy_dir):
    src = tg.open(str(npy_dir), options=tg.ReadOptions(cache_bytes=0))
    assert isinstance(src, NpySource) and len(src) == 12
    assert src.options.cache_bytes == 0 and src.schema == {"array": "int16[2,3]"}
    assert [int(r["array"][0, 0]) for r in src.__getitems__([11, 0, 5])] == [11, 0, 5]
    with pytest.raises(ValueError, match="codec= applies to array_record, tfrecord, not npy"):
        tg.open(str(npy_dir), codec="raw")


def test_torchgrain_inspect_reads_a_registered_format(npy_dir, capsys):
    assert main(["inspect", str(npy_dir), "--json", "--samples", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "npy" and out["num_records"] == 12 and out["num_shards"] == 12
    assert out["keys"] == {"array": "int16[2,3]"} and out["codec"] == "npy"
    assert main(["inspect", str(npy_dir), "--format", "npy", "--samples", "0"]) == 0
    assert "format      npy" in capsys.readouterr().out
    assert main(["inspect", str(npy_dir), "--codec", "raw"]) == 2
    assert "--codec applies to" in capsys.readouterr().err


def test_torchgrain_bench_reads_a_registered_format(npy_dir, capsys):
    args = ["bench", str(npy_dir), "--format", "npy", "--seconds", "0.3", "--repeats", "1"]
    assert main([*args, "--workers", "0", "--batch-size", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "npy" and report["num_records"] == 12
    assert [m["mode"] for m in report["modes"]] == ["sequential", "shuffled"]
    assert all(m["records_per_s"] > 0 for m in report["modes"])


@pytest.mark.parametrize("to", registry.output_formats())
def test_torchgrain_convert_reads_a_registered_format(npy_dir, tmp_path, to, capsys):
    out = tmp_path / f"out-{to}"
    assert main(["convert", str(npy_dir), str(out), "--to", to, "--num-shards", "2", "-q"]) == 0
    back = tg.open(str(out))
    assert len(back) == 12
    got = [np.asarray(back[i]["array"]).reshape(2, 3) for i in range(12)]
    assert all((g == i).all() and g.shape == (2, 3) for i, g in enumerate(got))


def test_the_command_line_offers_the_registered_formats(npy_format, capsys):
    from torchgrain.cli import build_parser

    p = build_parser()
    sub = p._subparsers._group_actions[0].choices  # argparse keeps no public handle
    for command in ("inspect", "bench", "convert"):
        fmt = next(a for a in sub[command]._actions if "--format" in a.option_strings)
        assert list(fmt.choices) == ["auto", *registry.formats()] and "npy" in fmt.choices
    to = next(a for a in sub["convert"]._actions if "--to" in a.option_strings)
    assert list(to.choices) == registry.output_formats()


# ------------------------------------------------- a new output format, likewise


class NpzShard(ShardWriter):
    """One output shard as one ``.npz`` file: record ``k``'s array is ``arr_k``."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.arrays: list[np.ndarray] = []

    def add(self, record: dict[str, Any] | bytes) -> None:
        assert isinstance(record, dict)  # msgpack_records is off: dicts only
        self.arrays.append(np.asarray(record["array"]))

    def close(self) -> None:
        with open(self.path, "wb") as f:  # a file object: np.savez adds no suffix
            np.savez(f, *self.arrays)


class NpzOutput(OutputFormat):
    suffix = ".npz"
    codec = "npz"

    def options(self, group_size: int, compression: str | None) -> tuple[str, str]:
        if compression is not None:
            raise ValueError("npz output takes no compression")
        return "none", ""

    def open(
        self, path: str, *, compression: str, writer_options: str, row_group_bytes: int
    ) -> ShardWriter:
        return NpzShard(path)


def test_torchgrain_convert_writes_a_registered_output_format(npy_dir, tmp_path, monkeypatch):
    # Read back with numpy: the point is the output side, which convert/ does not know.
    monkeypatch.setattr(registry, "_FORMATS", dict(registry._FORMATS))
    registry.register_format(registry.Format("npz", NpySource, (".npz",), output=NpzOutput()))
    assert "npz" in registry.output_formats()
    out = tmp_path / "out-npz"
    assert main(["convert", str(npy_dir), str(out), "--to", "npz", "--num-shards", "2", "-q"]) == 0
    names = sorted(n for n in os.listdir(out) if not n.startswith("."))
    assert names == ["data-00000-of-00002.npz", "data-00001-of-00002.npz"]
    got = []
    for name in names:
        with np.load(out / name) as z:
            got += [z[f"arr_{k}"] for k in range(len(z.files))]
    assert [int(g[0, 0]) for g in got] == list(range(12))
    manifest = json.loads((out / ".torchgrain-convert" / "result.json").read_text())
    assert manifest["codec"] == "npz" and manifest["num_records"] == 12
    # The shards were verified against the checksums the manifest records.
    (out / names[0]).write_bytes(b"x" + (out / names[0]).read_bytes()[1:])
    with pytest.raises(CorruptDataError):
        NpzOutput().verify(str(out / names[0]), 6, manifest["shards"][0]["checksum"])
