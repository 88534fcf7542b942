"""A process's reader of a Parquet shard opens it with the footer the dataset's opening
read and checked: a file replaced since, whose footer claims any length, costs no more
than MAX_FOOTER_BYTES, and one whose footer differs is refused naming the file and the
record index, never read by its new footer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_remote_audit_review import QUICK, _parquet

_HOLE = 300 << 20  # a sparse gap before the footer: files longer than the claim below
_CLAIM = 256 << 20  # a footer length past MAX_FOOTER_BYTES (64 MiB)


def _with_hole(path) -> None:
    """Rewrite the Parquet file ``path`` with a sparse gap between its column chunks and
    its footer (still a valid file: chunks are found by their offsets, the footer from
    the end)."""
    data = path.read_bytes()
    n = int.from_bytes(data[-8:-4], "little")
    with open(path, "wb") as f:
        f.write(data[: -8 - n])
        f.seek(_HOLE, os.SEEK_CUR)
        f.write(data[-8 - n :])


def _claim_in_place(path) -> None:
    """Make ``path``'s last 8 bytes claim a footer of _CLAIM bytes, keeping its size,
    modification time and inode (the zeros before it: the gap)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(st.st_size - 8)
        f.write(_CLAIM.to_bytes(4, "little") + b"PAR1")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


_CHILD = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torchgrain as tg
    from tests.test_remote_audit_review import QUICK

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])

    src = tg.ParquetSource(sys.argv[1], decoded_cache=False, cache_bytes=0, retry=QUICK)
    assert src[0] == {"x": 0}
    src = tg.ParquetSource(sys.argv[1], decoded_cache=False, cache_bytes=0, retry=QUICK)
    print("opened", flush=True)
    sys.stdin.readline()  # the file is changed meanwhile
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    try:
        src[60]
        outcome = "read"
    except Exception as e:
        outcome = type(e).__name__ + ": " + str(e)
    print(json.dumps({"outcome": outcome, "grew_kib": status("VmHWM") - before}))
    """
)


def _read_after(url: str, change) -> dict:
    """Open a source of ``url`` in a child, ``change()`` its file, then read record 60
    there: its outcome and how much its peak memory grew."""
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline() == "opened\n", child.stderr.read()[-3000:]
        change()
        out, err = child.communicate("\n", timeout=120)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["local", "http"])
def test_a_shard_rewritten_to_claim_a_huge_footer_is_refused_in_bounded_memory(tmp_path, where):
    # Same size, modification time and inode (an in-place write, the time set back):
    # nothing but its footer tells it changed. Arrow read the 256 MiB the footer claims
    # before parsing it (RSS grew by 256 MiB).
    (tmp_path / "www").mkdir()
    path = tmp_path / "www" / "a.parquet"
    _parquet(path, 0)
    _with_hole(path)
    assert pq.ParquetFile(path).read().column("x").to_pylist() == list(range(100))
    with RangeHTTPServer(tmp_path / "www") as srv:
        srv.etags = False  # (nothing but its footer tells this version from the last)
        url = str(path) if where == "local" else f"{srv.url}/a.parquet"
        got = _read_after(url, lambda: _claim_in_place(path))
    assert got["outcome"].startswith("CorruptDataError"), got
    assert "a.parquet" in got["outcome"] and "record index 60" in got["outcome"], got
    assert "MAX_FOOTER_BYTES" in got["outcome"], got
    assert got["grew_kib"] < 64 * 1024, got


@pytest.mark.timeout(300)
def test_a_local_shard_replaced_by_a_huge_footer_claim_is_refused_before_any_read(tmp_path):
    path = tmp_path / "a.parquet"
    _parquet(path, 0)

    def replace() -> None:
        with open(f"{path}.new", "wb") as f:  # sparse: 256 MiB claimed, 4 KiB on disk
            f.write(b"PAR1")
            f.seek(_CLAIM + 4096)
            f.write(_CLAIM.to_bytes(4, "little") + b"PAR1")
        os.replace(f"{path}.new", path)

    got = _read_after(str(path), replace)
    assert got["outcome"].startswith("CorruptDataError"), got
    assert "a.parquet" in got["outcome"] and "record index 60" in got["outcome"], got
    assert "changed since the dataset was opened" in got["outcome"], got
    assert got["grew_kib"] < 64 * 1024, got


@pytest.mark.timeout(60)
def test_a_remote_shard_without_a_version_replaced_by_one_of_its_size_is_refused(tmp_path):
    # Same size, other values (their statistics: another footer); the server sends no
    # ETag or Last-Modified. The reader read the new footer and served the new values
    # under the dataset's index (1060 for record 60).
    (tmp_path / "www").mkdir()
    path = tmp_path / "www" / "a.parquet"
    _parquet(path, 0)
    with RangeHTTPServer(tmp_path / "www") as srv:
        srv.etags = False
        src = tg.ParquetSource(f"{srv.url}/a.parquet", retry=QUICK, decoded_cache=False)
        _parquet(path, 1000)
        with pytest.raises(tg.CorruptDataError) as info:
            src[60]
    message = str(info.value)
    assert "a.parquet" in message and "record index 60" in message, message
    assert "changed since the dataset was opened (its footer differs)" in message, message


def test_a_remote_shard_s_first_read_fetches_its_footer_once(tmp_path):
    # The reader's open reads the footer's tail (all of a small file) once; the page
    # headers' check read it twice more (its length, then the footer): 4 requests for a
    # shard's first read, 2 now.
    for k in range(4):
        t = pa.table({"x": np.arange(k * 4000, (k + 1) * 4000), "s": [str(i) for i in range(4000)]})
        pq.write_table(t, tmp_path / f"p{k}.parquet", row_group_size=500)
    with RangeHTTPServer(tmp_path) as srv:
        urls = [f"{srv.url}/p{k}.parquet" for k in range(4)]
        src = tg.ParquetSource(urls, retry=QUICK, decoded_cache=False, cache_bytes=0)
        srv.reset_counts()
        rows = src.__getitems__([0, 4000, 8000, 12000])
        assert [r["x"] for r in rows] == [0, 4000, 8000, 12000]
        assert srv.gets() == 2 * 4, srv.range_log
        srv.reset_counts()
        assert [r["x"] for r in src.__getitems__([600, 4600])] == [600, 4600]
        assert srv.gets() == 0, srv.range_log
