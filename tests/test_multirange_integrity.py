"""The multi-range reader's bookkeeping and strictness at their edges: a part that ends
past the file size it declares is malformed, a range is sliced from whichever part
holds it, and what is learnt of a server (whether it answers several ranges at once)
is kept per origin (scheme, host and port) and only turned off by what says so."""

from __future__ import annotations

import random

import fsspec
import pytest

from tests.servers import RangeHTTPServer
from torchgrain.io import inflight
from torchgrain.io.byteranges import MultipartError, parse_byteranges, slice_parts
from torchgrain.io.remote import storage_options_with_deadlines

DATA = random.Random(3).randbytes(20_000)
RANGES = [(100, 200), (5000, 5100), (12_000, 12_500)]


def _http() -> fsspec.AbstractFileSystem:
    opts = storage_options_with_deadlines("http", {})
    opts["skip_instance_cache"] = True  # each test asks its own servers afresh
    return fsspec.filesystem("http", **opts)


def _read(fs, url, ranges=RANGES):
    return inflight.cat_many(
        fs, [url] * len(ranges), [s for s, _ in ranges], [e for _, e in ranges]
    )


def test_a_part_that_ends_past_the_file_size_it_declares_is_malformed():
    # 21 bytes for "bytes 0-20/20": the body is consistent with its Content-Range, but
    # the range names a byte the file does not have.
    body = b"--x\r\nContent-Range: bytes 0-20/20\r\n\r\n" + bytes(21) + b"\r\n--x--"
    with pytest.raises(MultipartError, match="bytes 0-20 of 20"):
        parse_byteranges(body, "x")
    ok = b"--x\r\nContent-Range: bytes 0-19/20\r\n\r\n" + bytes(20) + b"\r\n--x--"
    assert parse_byteranges(ok, "x")[1] == 20


def test_a_range_is_sliced_from_a_longer_part_that_starts_before_a_shorter_one():
    # A server may send overlapping parts (RFC 9110 lets it coalesce some ranges and not
    # others): the part starting last before a range may be too short to hold it.
    parts = [(0, DATA[0:1000]), (500, DATA[500:510])]
    assert slice_parts(parts, [(505, 700), (502, 508)]) == [DATA[505:700], DATA[502:508]]


def test_what_is_learnt_of_one_server_is_not_applied_to_another_port_of_its_host(tmp_path):
    (tmp_path / "f.bin").write_bytes(DATA)
    with (
        RangeHTTPServer(tmp_path, multirange="ignore") as plain,
        RangeHTTPServer(tmp_path, multirange="parts") as nginx_like,
    ):
        fs = _http()
        want = [DATA[s:e] for s, e in RANGES]
        assert _read(fs, f"{plain.url}/f.bin") == want
        nginx_like.reset_counts()
        assert _read(fs, f"{nginx_like.url}/f.bin") == want
        assert [r for r in nginx_like.range_log if "," in (r or "")] != []
        assert nginx_like.gets() == 1
        known = inflight.multirange_servers(fs)
        assert known[plain.url.lower()] is False and known[nginx_like.url.lower()] is True


def test_ranges_that_are_refused_alone_too_do_not_turn_multi_range_off(tmp_path):
    # A 403 for a file that is refused whatever is asked says nothing of multi-range
    # support: the server's other files are still asked several ranges at once.
    (tmp_path / "forbidden.bin").write_bytes(DATA)
    (tmp_path / "f.bin").write_bytes(DATA)
    with RangeHTTPServer(tmp_path) as srv:
        fs = _http()
        got = _read(fs, f"{srv.url}/forbidden.bin")
        assert all(isinstance(g, BaseException) for g in got)
        assert inflight.multirange_servers(fs).get(srv.url.lower()) is not False
        srv.reset_counts()
        assert _read(fs, f"{srv.url}/f.bin") == [DATA[s:e] for s, e in RANGES]
        assert srv.gets() == 1 and "," in (srv.range_log[0] or "")
        assert inflight.multirange_servers(fs)[srv.url.lower()] is True
