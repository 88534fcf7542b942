"""The stated minimum versions (pyproject.toml) in the suite: what `make test-minimums`
installs is derived from them, and torchgrain's fallbacks for the oldest allowed fsspec
and pyarrow behave as the newer libraries' own functions. `make test-minimums`
(scripts/test_minimums.sh) runs the readers, samplers, workers and convert with every
direct dependency at its minimum; this file is what of it fits in the suite's budget."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import fsspec.utils
import pyarrow as pa
import pytest

from torchgrain.io import fs as tg_fs
from torchgrain.sources.parquet import pool as tg_pool

ROOT = Path(__file__).resolve().parent.parent


def load_minimums():
    """scripts/minimums.py, which is not a package module (tomllib: Python >= 3.11)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return pytest.importorskip("minimums")
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_every_runtime_dependency_states_a_minimum_and_docs_list_them():
    stated = load_minimums().stated()
    assert {"torch", "numpy", "pyarrow", "fsspec"} <= set(stated)
    # docs/development.md's table of minimums says what `make test-minimums` installs
    page = (ROOT / "docs" / "development.md").read_text()
    for name, version in stated.items():
        assert re.search(rf"\| `{re.escape(name)}` \| {re.escape(version)} \|", page), name


def test_minimums_writes_one_pin_per_dependency(tmp_path):
    minimums = load_minimums()
    toml = tmp_path / "pyproject.toml"
    toml.write_text(
        '[project]\ndependencies = ["torch>=2.4", "pyarrow >=14,<99", '
        "\"fsspec[http]>=2023.6 ; python_version >= '3.10'\"]\n"
    )
    out = tmp_path / "c.txt"
    assert minimums.main(["--pyproject", str(toml), "--skip", "torch", "-o", str(out)]) == 0
    assert out.read_text() == "pyarrow==14\nfsspec==2023.6\n"
    toml.write_text('[project]\ndependencies = ["numpy<3"]\n')
    with pytest.raises(ValueError, match="numpy<3"):
        minimums.stated(toml)


PATTERNS = [
    "*.parquet",
    "*",
    "*/*.parquet",
    "**",
    "**/*.parquet",
    "a/**/x.parquet",
    "a/**",
    "part-?????.tfrecord",
    "shard-[0-9][!5]*.ar",
    "[]x].bin",
    "[!]x].bin",
    "weird[.bin",
    "dots.and+plus(1)/x.*",
    "d/*/e/*.parquet",
    "x-**-y.bin",
]
PATHS = [
    "a.parquet",
    "a/x.parquet",
    "a/b/c/x.parquet",
    "a",
    "",
    "b/.hidden.parquet",
    "part-00001.tfrecord",
    "part-0001.tfrecord",
    "part-00001/x.tfrecord",
    "shard-15x.ar",
    "shard-17x.ar",
    "shard-1/x.ar",
    "].bin",
    "x.bin",
    "y.bin",
    "/.bin",
    "weird[.bin",
    "dots.and+plus(1)/x.parquet",
    "dotsXand+plus(1)/x.parquet",
    "d/k/e/z.parquet",
    "d/k/l/e/z.parquet",
    "x.parquet\nz",
]


@pytest.mark.skipif(
    not hasattr(fsspec.utils, "glob_translate"), reason="this fsspec has no glob_translate"
)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_glob_fallback_matches_what_fsspec_matches(pattern):
    try:
        theirs = re.compile(fsspec.utils.glob_translate(pattern))
    except ValueError:
        with pytest.raises(ValueError, match=r"\*\*"):
            tg_fs._glob_translate(pattern)
        return
    ours = re.compile(tg_fs._glob_translate(pattern))
    for path in PATHS:
        assert bool(ours.match(path)) == bool(theirs.match(path)), (pattern, path)


def test_torchgrain_imports_and_globs_with_an_fsspec_without_glob_translate(tmp_path):
    # fsspec before 2023.12 (the stated minimum is 2023.6) has no glob_translate: importing
    # torchgrain failed
    code = (
        # fsspec's own modules take it first; torchgrain's import must not need it
        "import fsspec.spec, fsspec.implementations.local, fsspec.implementations.http\n"
        "vars(fsspec.utils).pop('glob_translate', None)\n"
        "from torchgrain.io import fs\n"
        "assert fs.glob_translate is None\n"
        "listing = fs._Listing(fsspec.filesystem('http'), 'http://h/d', ('.parquet',), False)\n"
        "listing.find = lambda base, max_depth=None, **kw: ['http://h/d/a/x.parquet', "
        "'http://h/d/b/y.tfrecord']\n"
        "print(listing.glob('http://h/d/*/*.parquet'))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "['http://h/d/a/x.parquet']"


class PoolBefore20:
    """pyarrow < 20's MemoryPool: no running total of allocations."""

    def __init__(self, pool: pa.MemoryPool) -> None:
        self.pool = pool
        self.released = 0

    def bytes_allocated(self) -> int:
        return self.pool.bytes_allocated()

    def release_unused(self) -> None:
        self.released += 1
        self.pool.release_unused()


def test_pool_trimmer_releases_without_total_bytes_allocated(monkeypatch):
    # pyarrow 14-19 (the stated minimum is 14) has no MemoryPool.total_bytes_allocated:
    # every Parquet read failed with AttributeError
    pool = PoolBefore20(pa.default_memory_pool())
    trimmer = tg_pool.PoolTrimmer(pool, threshold=1 << 20)
    sizes = iter([100 << 20, 150 << 20, 90 << 20])
    monkeypatch.setattr(tg_pool, "resident_bytes", lambda: next(sizes))
    monkeypatch.setattr(tg_pool, "held_bytes", lambda: 0)
    trimmer._floor = 100 << 20
    # a read that allocated and freed as much leaves bytes_allocated as it was: the
    # trimmer must still look at the process's size
    assert not trimmer.settle()  # no growth
    assert trimmer.settle()  # grew 50 MiB: released
    assert pool.released == 1 and trimmer.releases == 1
