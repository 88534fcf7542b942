"""Hostile index directories and files under composition (filter, select, token
windows): a forged or stale derived index ends in a rebuild or a torchgrain error,
never in a builtin exception or wrong records."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import torchgrain as tg
from torchgrain.formats.index_file import IndexFile, IndexFileWriter


def _forge(path: str, kind: str, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """Replace the index file at ``path`` by one holding ``arrays`` (a valid checksum:
    anyone who can write the directory can compute it)."""
    tmp = path + ".forge"
    w = IndexFileWriter(tmp, kind, {k: (v.dtype.str, v.shape[1:]) for k, v in arrays.items()})
    for k, v in arrays.items():
        w.append(k, v)
    w.publish(meta)
    os.replace(tmp, path)


def _docs(tmp_path):
    data = str(tmp_path / "data")
    lens = (3, 5, 2, 7, 1, 4)
    tg.write_array_record([{"tokens": np.arange(k, dtype=np.int64)} for k in lens], data)
    return data


def _windows(data, ixd):
    ds = tg.Dataset(tg.ArrayRecordSource(data))
    return ds.windows("tokens", 4, eos=99, index_dir=ixd, progress=False)


def test_window_offsets_of_another_shape_rebuilt(tmp_path):
    data, ixd = _docs(tmp_path), str(tmp_path / "ix")
    w = _windows(data, ixd)
    want = [w[i]["input_ids"].tolist() for i in range(len(w))]
    del w
    (path,) = glob.glob(os.path.join(ixd, "*.tgindex"))
    f = IndexFile.open(path, "windows")
    meta, off = dict(f.meta), np.array(f["offsets"])
    del f
    # Same key, same checksum rules: offsets given a trailing dimension.
    _forge(path, "windows", {"offsets": np.stack([off, off], 1)}, meta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = _windows(data, ixd)  # rebuilt (a misfit), not a numpy ValueError
    assert [w[i]["input_ids"].tolist() for i in range(len(w))] == want


def test_filter_of_a_shard_rewritten_in_place_with_its_mtime_restored(tmp_path):
    # rsync --inplace -t, or any tool that keeps the modification time: same inode,
    # same size, same mtime; only the change time (which no user can set) moves.
    data, other, ixd = str(tmp_path / "data"), str(tmp_path / "other"), str(tmp_path / "ix")
    tg.write_array_record([{"x": np.int64(i)} for i in range(8)], data)
    tg.write_array_record([{"x": np.int64(min(i + 1, 7))} for i in range(8)], other)

    def evens():
        ds = tg.Dataset(tg.ArrayRecordSource(data))
        return ds.filter(lambda r: r["x"] % 2 == 0, index_dir=ixd, progress=False)

    assert [int(r["x"]) for r in evens()] == [0, 2, 4, 6]
    (shard,) = glob.glob(os.path.join(data, "*.array_record"))
    (source,) = glob.glob(os.path.join(other, "*.array_record"))
    with open(source, "rb") as f:
        new = f.read()
    st = os.stat(shard)
    assert len(new) == st.st_size
    with open(shard, "r+b") as f:
        f.write(new)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert [int(r["x"]) for r in evens()] == [2, 4, 6]  # not 1, 3, 5, 7


def _aliases(depth: int) -> str:
    """A YAML list of ``depth`` anchors, each two references to the one before: a few
    hundred bytes that load as shared lists of 2**depth leaves."""
    refs = ", ".join(f"&a{i} [*a{i - 1}, *a{i - 1}]" for i in range(1, depth))
    return f"[&a0 [x, x], {refs}]"


@pytest.mark.parametrize(
    "entry", ["{aliases}", "{{path: a, columns: {aliases}}}", "{{path: {aliases}}}"]
)
def test_spec_of_yaml_aliases_is_a_short_error(tmp_path, entry):
    pytest.importorskip("yaml")
    from torchgrain.compose.spec import SpecError, load_spec

    tg.write_array_record([{"x": 1}], str(tmp_path / "a"))
    spec = tmp_path / "mix.yaml"
    # (2**20 leaves here; at depth 40 the same file held the process for minutes)
    spec.write_text(f"concat: [{entry.format(aliases=_aliases(20))}]\n")
    with pytest.raises(SpecError) as e:
        load_spec(str(spec))
    assert len(str(e.value)) < 10_000


@pytest.mark.parametrize(
    ("weight", "extra"), [("1", ', "length": 100000000000000000000'), ("9" * 400, "")]
)
def test_spec_of_huge_numbers_is_a_spec_error(tmp_path, weight, extra):
    from torchgrain.compose.spec import SpecError, load_spec

    tg.write_array_record([{"x": 1}], str(tmp_path / "a"))
    tg.write_array_record([{"x": 2}], str(tmp_path / "b"))
    spec = tmp_path / "mix.json"
    entries = f'{{"path": "a", "weight": {weight}}}, {{"path": "b", "weight": 1}}'
    spec.write_text(f'{{"mix": [{entries}]{extra}}}')
    with pytest.raises(SpecError, match=r"mix\.json"):
        load_spec(str(spec))


_TRUNCATED = """
import os, sys, warnings
import numpy as np, torchgrain as tg
data, ixd, mode = sys.argv[1:]
w = tg.Dataset(tg.ArrayRecordSource(data)).windows(
    "tokens", 4, eos=99, mode=mode, index_dir=ixd, progress=False
)
for path in w.source.index_paths:
    os.truncate(path, 4096)  # (pages past the end: SIGBUS when touched)
try:
    w.source.__getitems__([len(w) - 1])
except tg.CorruptDataError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("mode", ["concat", "pack"])
def test_window_index_truncated_while_mapped_is_refused(tmp_path, mode):
    data, ixd = str(tmp_path / "data"), str(tmp_path / "ix")
    tg.write_array_record([{"tokens": np.arange(1 + i % 3)} for i in range(20_000)], data)
    out = subprocess.run(
        [sys.executable, "-c", _TRUNCATED, data, ixd, mode],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and ".tgindex" in out.stdout
