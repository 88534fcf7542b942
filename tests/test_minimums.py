"""torchgrain's fallbacks for the oldest allowed fsspec and pyarrow behave as the newer
libraries' own functions."""

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
        "del fsspec.utils.glob_translate\n"
        "from torchgrain.io import fs\n"
        "assert fs.glob_translate is None\n"
        "listing = fs._Listing(fsspec.filesystem('http'), 'http://h/d', ('.parquet',), False)\n"
        "listing.find = lambda base, max_depth=None: ['http://h/d/a/x.parquet', "
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
