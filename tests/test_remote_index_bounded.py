"""The node index of remote ArrayRecord shards is built in bounded memory (issue 38).

A remote shard's footer is decoded a slice of chunks at a time, as a local one's is,
from two ranged requests (its last MiB and its footer chunk), whatever its chunk count;
measured in a fresh child process against ``tests.servers.RangeHTTPServer``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import torchgrain
from tests.servers import RangeHTTPServer

TG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torchgrain.__file__)))

# A child's set-up: argv is URL OUT MiB [URL...]; the remote file's session opened,
# BUILD_BYTES set to MiB, and the peak resident size reset (status("VmHWM") - base: the
# peak beyond the imports).
_MEASURE = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torchgrain as tg
    from torchgrain.io.fs import get_filesystem
    from torchgrain.sources.node_index import arrayrecord, store

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024

    fs, path = get_filesystem(sys.argv[1])
    urls = [sys.argv[1], *sys.argv[4:]]
    fs.info(path)  # the HTTP session is set up before the baseline
    store.BUILD_BYTES = int(sys.argv[3]) << 20
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident size, to the current size
    base = status("VmRSS")
""")


def write_one_byte_records(path, n: int, options: str = "group_size:1") -> None:
    """An ArrayRecord file of ``n`` records ``b"x"``, written in a child process (the
    array_record module is not imported by the test process: it does not survive fork)."""
    code = textwrap.dedent(f"""
        from array_record.python.array_record_module import ArrayRecordWriter
        w = ArrayRecordWriter({str(path)!r}, {options!r})
        for i in range({n}):
            w.write(b"x")
        w.close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def measure(script: str, *args: object, cwd) -> dict:
    """Run ``script`` (``_MEASURE`` and a build) in a fresh child with ``args``; its last
    line of output, parsed."""
    p = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=TG_ROOT),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


_BUILD = _MEASURE + textwrap.dedent("""
    ix = arrayrecord.build_arrayrecord_index([path], filesystem=fs, out=sys.argv[2])
    print(json.dumps({"peak": status("VmHWM") - base, "counts": ix.counts.tolist(),
                      "group_size": ix.group_size.tolist()}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_a_remote_footer_of_many_chunks_is_built_in_bounded_memory(tmp_path):
    """One shard of 4*10^5 one-byte records (as many chunks) over HTTP: its footer was
    decoded whole, ~200 bytes a chunk (a peak of ~85 MiB here; 197 MiB for 10^6); it is
    now decoded and written a slice of chunks at a time under an 8 MiB budget (~10 MiB
    measured for 10^6), from 2 GETs: the last MiB and the footer chunk (~1.4 bytes a
    chunk compressed), not a request per slice (one retry allowed: a loaded machine)."""
    n = 400_000
    root = tmp_path / "srv"
    root.mkdir()
    write_one_byte_records(root / "a.array_record", n)
    size = (root / "a.array_record").stat().st_size
    with RangeHTTPServer(root) as srv:
        got = measure(_BUILD, srv.url + "/a.array_record", tmp_path / "ix", 8, cwd=tmp_path)
        gets = srv.gets()
        ranges = [r for r in srv.range_log if r is not None]
    assert got["counts"] == [n] and got["group_size"] == [1]
    assert got["peak"] < 40 << 20, f"peak {got['peak'] / 2**20:.0f} MiB beyond the imports"
    fetched = 0
    for r in ranges:
        a, b = r.removeprefix("bytes=").split("-")
        fetched += int(b) - int(a) + 1
    assert gets <= 3 and fetched <= 2 * ((1 << 20) + 2 * n), (gets, ranges)
    assert fetched < size // 8


_TF_BUILD = _MEASURE + textwrap.dedent("""
    src = tg.TFRecordSource(sys.argv[1], codec="raw", index_dir=sys.argv[2])
    print(json.dumps({"peak": status("VmHWM") - base, "records": len(src),
                      "last": src[len(src) - 1]["bytes"].hex()}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_a_remote_tfrecord_file_is_indexed_in_bounded_memory(tmp_path):
    """A remote file of 3*10^6 empty records (48 MB): its offsets were walked whole into
    one array (24 MB, and the list of chunks it was joined from: a peak of ~60 MiB here);
    they are now streamed into the index file a chunk at a time, as a local file's
    (~19 MiB measured for 2*10^6), 4 MiB a GET."""
    from tests.test_tfrecord_many_files import _frame

    n = 3_000_000
    root = tmp_path / "srv"
    root.mkdir()
    (root / "a.tfrecord").write_bytes(_frame(b"") * (n - 1) + _frame(b"end"))
    with RangeHTTPServer(root) as srv:
        got = measure(_TF_BUILD, srv.url + "/a.tfrecord", tmp_path / "ix", 4, cwd=tmp_path)
        gets = srv.gets()
    assert got["records"] == n and bytes.fromhex(got["last"]) == b"end"
    assert got["peak"] < 36 << 20, f"peak {got['peak'] / 2**20:.0f} MiB beyond the imports"
    assert gets <= 16 + 4, gets  # 12 blocks of 4 MiB, the reads of a record, a retry
