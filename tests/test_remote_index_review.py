"""Remote index builds against files that change on the server while they are read.

An index build over HTTP reads a file's size, then byte ranges of it. A file truncated
on the server in between is answered ``416 Range Not Satisfiable`` (the range now
starts past its end): that must end in a torchgrain error naming the file (and, for a
build that tolerates unreadable shards, in the shard being recorded as unreadable),
never in the HTTP client's own exception.
"""

from __future__ import annotations

import os
import re
import textwrap
import warnings

import pytest

from tests.servers import RangeHTTPServer
from tests.test_remote_index_bounded import _MEASURE, measure, write_one_byte_records
from torchgrain.errors import CorruptDataError, TorchgrainError
from torchgrain.io.fs import get_filesystem
from torchgrain.sources.node_index import arrayrecord as nar


def _arrayrecord(path, n: int) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    w = ArrayRecordWriter(os.fspath(path), "group_size:1,uncompressed")
    for i in range(n):
        w.write(b"%d" % i)
    w.close()


def _truncate_on_first_get(srv: RangeHTTPServer, path, keep: int) -> None:
    """Truncate ``path`` to ``keep`` bytes when the server receives its first GET (its
    size was asked before, by a HEAD): the GET is answered for the file as it is then."""
    state = {"done": False}
    name = "/" + os.path.basename(path)

    def take() -> None:
        last = srv.log[-1] if srv.log else ("", "")
        if not state["done"] and last[0] == "GET" and last[1] == name:
            state["done"] = True
            with open(path, "r+b") as f:
                f.truncate(keep)
        return None

    srv._take_fault = take  # type: ignore[method-assign]


def test_a_shard_truncated_after_its_size_was_read_is_a_named_error(tmp_path):
    """The footer's tail (the last MiB) is asked from the size a HEAD gave; the file is
    truncated before the GET arrives, so the range starts past its end: 416."""
    _arrayrecord(tmp_path / "a.ar", 200_000)  # ~2 MiB: the tail starts at ~1 MiB
    with RangeHTTPServer(tmp_path) as srv:
        _truncate_on_first_get(srv, tmp_path / "a.ar", 1 << 16)
        fs, _ = get_filesystem(srv.url + "/x")
        url = srv.url + "/a.ar"
        with pytest.raises(TorchgrainError, match=r"a\.ar"):
            nar.build_arrayrecord_index([url], filesystem=fs)


def test_a_tolerant_build_records_a_shard_truncated_meanwhile_as_unreadable(tmp_path):
    _arrayrecord(tmp_path / "a.ar", 3)
    _arrayrecord(tmp_path / "b.ar", 200_000)
    with RangeHTTPServer(tmp_path) as srv:
        _truncate_on_first_get(srv, tmp_path / "b.ar", 1 << 16)
        fs, _ = get_filesystem(srv.url + "/x")
        urls = [srv.url + "/a.ar", srv.url + "/b.ar"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ix = nar.build_arrayrecord_index(urls, filesystem=fs, tolerate=True)
    assert ix.counts.tolist() == [3, 0]
    assert ix.group_size.tolist()[1] == -1  # unreadable: its error is raised when read


def test_the_remote_index_equals_the_local_one_whatever_the_build_budget(tmp_path, monkeypatch):
    """Shards of every shape (1 record, group_size 3, no records, a footer that begins
    before the last MiB, one decoded a slice at a time under a small budget): the index
    built over HTTP has the local build's arrays, and every record read through it is
    the local file's."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from torchgrain.formats.arrayrecord.file import ArrayRecordFile
    from torchgrain.sources.node_index import store

    shapes = {
        "one.ar": (1, "group_size:1"),
        "g3.ar": (100, "group_size:3"),
        "none.ar": (0, "group_size:1"),
        "bigfoot.ar": (120_000, "group_size:1,uncompressed"),
    }
    for name, (n, opts) in shapes.items():
        w = ArrayRecordWriter(os.fspath(tmp_path / name), opts)
        for i in range(n):
            w.write(b"r%d" % i)
        w.close()
    names = list(shapes)
    cols = ("rec_base", "chunk_base", "file_size", "group_size", "footer_head", "offsets")
    cols += ("record_offsets", "decoded")
    with RangeHTTPServer(tmp_path) as srv:
        fs, _ = get_filesystem(srv.url + "/x")
        urls = [f"{srv.url}/{n}" for n in names]
        for budget in (256 << 20, 1 << 20):
            monkeypatch.setattr(store, "BUILD_BYTES", budget)
            for tolerate in (False, True):
                local = nar.build_arrayrecord_index(
                    [os.fspath(tmp_path / n) for n in names], tolerate=tolerate
                )
                remote = nar.build_arrayrecord_index(urls, filesystem=fs, tolerate=tolerate)
                for c in cols:
                    assert (getattr(local, c) == getattr(remote, c)).all(), (budget, c)
        for s, name in enumerate(names):
            n = shapes[name][0]
            if not n:
                continue
            want = ArrayRecordFile(os.fspath(tmp_path / name)).read(list(range(n)))
            got = ArrayRecordFile(urls[s], filesystem=fs, footer=remote.footer(s))
            assert got.read(list(range(n))) == want, name


def test_a_corrupt_remote_footer_is_named_in_a_tolerant_and_a_strict_build(tmp_path):
    """A postscript pointing past the file or into its first chunk, a footer whose
    metadata and entry count disagree: the same named error as the local build's,
    and the shard recorded as unreadable by a tolerant build."""
    from tests import _riegeli as R

    chunks = [R.Chunk([b"r%d" % i]) for i in range(5)]
    size = len(R.build(chunks))
    bad = {
        "past.ar": R.build(chunks, postscript_footer_offset=size),
        "first.ar": R.build(chunks, postscript_footer_offset=40),
        "more.ar": R.build(chunks, num_chunks=9),
        "records.ar": R.build(chunks, num_records=100),
    }
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
    with RangeHTTPServer(tmp_path) as srv:
        fs, _ = get_filesystem(srv.url + "/x")
        for name in bad:
            url = f"{srv.url}/{name}"
            with pytest.raises(CorruptDataError, match=re.escape(name)):
                nar.build_arrayrecord_index([url], filesystem=fs)
            ix = nar.build_arrayrecord_index([url], filesystem=fs, tolerate=True)
            assert ix.group_size.tolist() == [-1], name


def test_a_tfrecord_file_truncated_while_its_offsets_are_walked_is_a_named_error(tmp_path):
    """A server without validators (no ETag, If-Match ignored) answers the walk's
    second 4 MiB GET with 416: the file was truncated to 1 MiB after the first."""
    import torchgrain as tg
    from tests.test_tfrecord_many_files import _frame

    path = tmp_path / "srv" / "a.tfrecord"
    path.parent.mkdir()
    path.write_bytes(_frame(b"x" * 100) * 100_000)  # 11.2 MB: 3 GETs of 4 MiB
    with RangeHTTPServer(path.parent) as srv:
        srv.etags = False
        state = {"gets": 0}

        def take() -> None:
            if srv.log[-1][0] == "GET":
                state["gets"] += 1
                if state["gets"] == 2:
                    with open(path, "r+b") as f:
                        f.truncate(1 << 20)
            return None

        srv._take_fault = take  # type: ignore[method-assign]
        with pytest.raises(TorchgrainError, match=r"a\.tfrecord"):
            tg.TFRecordSource(srv.url + "/a.tfrecord", codec="raw", index_dir=tmp_path / "ix")


# The peak of the build up to its publish: copying the columns into the index file (8 MiB
# blocks) and mapping it (page-cache pages) come after the footers and hold none of them.
_MANY_BUILD = _MEASURE + textwrap.dedent("""
    from torchgrain.formats.index_file import IndexFileWriter
    publish, peak = IndexFileWriter.publish, []
    IndexFileWriter.publish = (
        lambda w, meta: peak.append(status("VmHWM") - base) or publish(w, meta)
    )
    ix = arrayrecord.build_arrayrecord_index(urls, filesystem=fs, out=sys.argv[2])
    print(json.dumps({"peak": peak[0], "counts": ix.counts.tolist()}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_remote_footers_fetched_ahead_are_held_within_the_build_budget(tmp_path):
    """8 remote shards of 3*10^5 chunks, footers stored uncompressed (3.3 MB each, before
    the last MiB), BUILD_BYTES 4 MiB: the peak should not grow by much more than the
    budget (and the 1 MiB tails read ahead) over the build of one of them, up to its
    publish. Measured: +37 MiB when the footer chunks of the 8 shards were fetched by
    the peeks, held at once; +6 MiB with only their headers peeked."""
    root = tmp_path / "srv"
    root.mkdir()
    write_one_byte_records(root / "s0.ar", 300_000, "group_size:1,uncompressed")
    for k in range(1, 8):
        os.link(root / "s0.ar", root / f"s{k}.ar")
    peaks = {}
    with RangeHTTPServer(root) as srv:
        for n in (1, 8):
            urls = [f"{srv.url}/s{k}.ar" for k in range(n)]
            got = measure(_MANY_BUILD, urls[0], tmp_path / f"ix{n}", 4, *urls[1:], cwd=tmp_path)
            assert got["counts"] == [300_000] * n
            peaks[n] = got["peak"]
    grown = peaks[8] - peaks[1]
    assert grown < 16 << 20, f"{grown / 2**20:.0f} MiB more for 8 shards than for 1"
