"""TFRecord framing: round trips, checksums, truncation, compression, fuzzing."""

from __future__ import annotations

import contextlib
import gzip
import os
import struct
import tempfile
import zlib

import fsspec
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from torchgrain.errors import CorruptDataError
from torchgrain.formats.tfrecord import (
    crc32c,
    index_tfrecord,
    iter_tfrecord,
    masked_crc32c,
    read_tfrecord_at,
    resolve_compression,
    write_tfrecord,
)

records_st = st.lists(st.binary(max_size=300), max_size=20)
_DIR = tempfile.mkdtemp(prefix="tg-tfrecord-test-")


def frame(data: bytes, length: int | None = None) -> bytes:
    head = struct.pack("<Q", len(data) if length is None else length)
    return (
        head
        + struct.pack("<I", masked_crc32c(head))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


def test_crc32c_known_values():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4 test vector
    assert crc32c(bytes(range(32))) == 0x46DD794E
    assert crc32c(memoryview(b"123456789")) == 0xE3069283


def test_framing_by_hand(tmp_path):
    path = tmp_path / "a.tfrecord"
    write_tfrecord([b"abc", b""], path)
    assert path.read_bytes() == frame(b"abc") + frame(b"")
    assert path.read_bytes()[:8] == b"\x03" + b"\x00" * 7
    assert [p.name for p in tmp_path.iterdir()] == ["a.tfrecord"]  # no temp file left


@settings(max_examples=60, deadline=None)
@given(records_st, st.sampled_from(["", "gzip", "zlib"]))
def test_round_trip(records, compression):
    suffix = {"": ".tfrecord", "gzip": ".tfrecord.gz", "zlib": ".tfrecord.zz"}[compression]
    path = os.path.join(_DIR, "rt" + suffix)
    assert write_tfrecord(iter(records), path) == len(records)
    assert list(iter_tfrecord(path)) == records  # compression from the suffix
    assert list(iter_tfrecord(path, compression=compression, verify=False)) == records
    if compression == "":
        offsets = index_tfrecord(path)
        assert offsets.dtype == np.int64 and len(offsets) == len(records)
        with open(path, "rb") as f:
            assert [read_tfrecord_at(f, int(o)) for o in offsets] == records


def test_large_records_and_many_records(tmp_path):
    rng = np.random.default_rng(0)
    recs = [rng.bytes(n) for n in (0, 1, 5 << 20, 3, 9 << 20)] + [b"x" * 10] * 30000
    for name in ("big.tfrecord", "big.tfrecord.gz", "big.tfrecord.zlib"):
        p = tmp_path / name
        write_tfrecord(recs, p)
        assert list(iter_tfrecord(p)) == recs
    offsets = index_tfrecord(tmp_path / "big.tfrecord")
    lengths = np.diff(np.append(offsets, os.path.getsize(tmp_path / "big.tfrecord"))) - 16
    assert lengths.tolist() == [len(r) for r in recs]


def test_fsspec_memory_filesystem():
    path = "memory://tg-test/dir/x.tfrecord"
    write_tfrecord([b"a", b"bb"], path)
    assert list(iter_tfrecord(path)) == [b"a", b"bb"]
    assert index_tfrecord(path).tolist() == [0, 17]
    assert read_tfrecord_at(path, 17) == b"bb"
    fs = fsspec.filesystem("memory")
    assert fs.ls("/tg-test/dir", detail=False) == ["/tg-test/dir/x.tfrecord"]
    assert list(iter_tfrecord("/tg-test/dir/x.tfrecord", filesystem=fs)) == [b"a", b"bb"]


def test_failed_write_leaves_nothing(tmp_path):
    def gen():
        yield b"a"
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_tfrecord(gen(), tmp_path / "x.tfrecord")
    assert list(tmp_path.iterdir()) == []


def test_concatenated_compressed_streams(tmp_path):
    body1, body2 = frame(b"one"), frame(b"two")
    (tmp_path / "a.gz").write_bytes(gzip.compress(body1) + gzip.compress(body2))
    (tmp_path / "a.zz").write_bytes(zlib.compress(body1) + zlib.compress(body2))
    assert list(iter_tfrecord(tmp_path / "a.gz")) == [b"one", b"two"]
    assert list(iter_tfrecord(tmp_path / "a.zz")) == [b"one", b"two"]
    # Explicit compression overrides the suffix, TensorFlow spellings accepted.
    (tmp_path / "plain").write_bytes(gzip.compress(body1))
    assert list(iter_tfrecord(tmp_path / "plain", compression="GZIP")) == [b"one"]


def test_compression_option():
    assert resolve_compression("x.tfrecord.gz", None) == "gzip"
    assert resolve_compression("x.tfrecord.zlib", None) == "zlib"
    assert resolve_compression("x.tfrecord.gz", "") == ""
    with pytest.raises(ValueError):
        resolve_compression("x", "snappy")
    with pytest.raises(ValueError, match="cannot be indexed"):
        index_tfrecord("x.tfrecord.gz")


def _record_at(offsets: list[int], pos: int) -> int:
    return max(o for o in offsets if o <= pos)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=8), st.data())
def test_any_flipped_byte_is_detected(records, data):
    clean = b"".join(frame(r) for r in records)
    offsets = np.cumsum([0] + [len(r) + 16 for r in records[:-1]]).tolist()
    pos = data.draw(st.integers(0, len(clean) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = bytearray(clean)
    bad[pos] ^= flip
    path = os.path.join(_DIR, "flip.tfrecord")
    with open(path, "wb") as f:
        f.write(bad)
    with pytest.raises(CorruptDataError) as exc:
        list(iter_tfrecord(path))
    msg = str(exc.value)
    assert path in msg
    assert f"byte offset {_record_at(offsets, pos)}" in msg
    # Random access finds the same damage (the index sees only a damaged header).
    with pytest.raises(CorruptDataError):
        for o in index_tfrecord(path):
            read_tfrecord_at(path, int(o))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=8), st.data())
def test_truncation(records, data):
    clean = b"".join(frame(r) for r in records)
    ends = np.cumsum([len(r) + 16 for r in records]).tolist()
    cut = data.draw(st.integers(0, len(clean) - 1))
    path = os.path.join(_DIR, "cut.tfrecord")
    for name, blob in ((path, clean[:cut]), (path + ".gz", gzip.compress(clean[:cut]))):
        with open(name, "wb") as f:
            f.write(blob)
        if cut == 0 or cut in ends:  # cut on a record boundary: a shorter valid file
            assert list(iter_tfrecord(name)) == records[: ends.index(cut) + 1 if cut else 0]
            continue
        with pytest.raises(CorruptDataError, match="truncated") as exc:
            list(iter_tfrecord(name))
        assert name in str(exc.value)
    if cut and cut not in ends:
        with pytest.raises(CorruptDataError, match="truncated"):
            index_tfrecord(path)
    # A truncated gzip stream (cut inside the compressed bytes) is reported too.
    gz = gzip.compress(clean)
    with open(path + ".gz", "wb") as f:
        f.write(gz[: max(len(gz) - 9, 0)])
    with pytest.raises(CorruptDataError):
        list(iter_tfrecord(path + ".gz"))


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("suffix", [".tfrecord", ".tfrecord.gz", ".tfrecord.zz"])
@pytest.mark.parametrize("length", [2**60, 2**64 - 1, 1 << 31])
def test_absurd_length_rejected_without_allocating(tmp_path, verify, suffix, length):
    blob = frame(b"ok") + frame(b"payload", length=length)
    path = tmp_path / f"huge{suffix}"
    comp = {".tfrecord": bytes, ".tfrecord.gz": gzip.compress, ".tfrecord.zz": zlib.compress}
    path.write_bytes(comp[suffix](blob))
    got = []
    with pytest.raises(CorruptDataError, match=r"byte offset 18") as exc:
        got.extend(iter_tfrecord(path, verify=verify))
    assert got == [b"ok"]
    # A compressed stream has no file size to bound a length: the ceiling refuses it.
    assert ("truncated" if suffix == ".tfrecord" else "max_record_bytes") in str(exc.value)
    if suffix == ".tfrecord":
        with pytest.raises(CorruptDataError, match="corrupt length"):
            index_tfrecord(path, verify=verify)
        with pytest.raises(CorruptDataError, match="corrupt length"):
            read_tfrecord_at(path, 18, verify=verify)


@settings(max_examples=1200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=300), st.sampled_from([".tfrecord", ".tfrecord.gz", ".tfrecord.zz"]))
@example(b"\x1f\x8b\x08\x00", ".tfrecord.gz")
@example(b"x\x9c\x03\x00", ".tfrecord.zz")
def test_arbitrary_bytes_only_raise_corrupt_data(blob, suffix):
    path = os.path.join(_DIR, "fuzz" + suffix)
    with open(path, "wb") as f:
        f.write(blob)
    try:
        out = list(iter_tfrecord(path))
    except CorruptDataError as e:
        assert path in str(e)
    else:
        # Whatever is accepted must re-encode to the same bytes (uncompressed case).
        if suffix == ".tfrecord":
            assert b"".join(frame(r) for r in out) == blob
    if suffix == ".tfrecord":
        try:
            offsets = index_tfrecord(path)
        except CorruptDataError:
            pass
        else:
            for o in offsets:
                with contextlib.suppress(CorruptDataError):
                    read_tfrecord_at(path, int(o))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(records_st.filter(bool), st.integers(0, 10**6), st.integers(0, 255))
def test_fuzz_near_valid_gzip(records, pos, val):
    gz = bytearray(gzip.compress(b"".join(frame(r) for r in records)))
    gz[pos % len(gz)] = val
    path = os.path.join(_DIR, "near.tfrecord.gz")
    with open(path, "wb") as f:
        f.write(gz)
    try:
        out = list(iter_tfrecord(path))
    except CorruptDataError:
        return
    assert out == records  # a change gzip's own CRC did not catch must still be harmless


def test_remote_walk_reads_headers_not_large_records(tmp_path, monkeypatch):
    # A remote file is walked as a local one (same offsets); after a record larger than
    # a block only the next header is fetched, not a block that would be skipped.
    from tests.servers import RangeHTTPServer
    from torchgrain.formats import tfrecord

    monkeypatch.setattr(tfrecord, "_READ_SIZE", 16 << 10)  # small blocks: small data
    rng = np.random.default_rng(0)
    small = [bytes(int(n)) for n in rng.integers(0, 300, 2000)] + [b"s" * 40] * 500
    write_tfrecord(small, tmp_path / "small.tfrecord")
    write_tfrecord([b"L" * (100 << 10)] * 3, tmp_path / "large.tfrecord")
    with RangeHTTPServer(tmp_path) as srv:
        for name in ("small.tfrecord", "large.tfrecord"):
            local = np.concatenate(list(tfrecord.iter_tfrecord_offsets(tmp_path / name)))
            srv.reset_counts()
            url = f"{srv.url}/{name}"
            remote = np.concatenate(list(tfrecord.iter_tfrecord_offsets(url, chunk=700)))
            np.testing.assert_array_equal(remote, local)
            assert len(local) == (2500 if name == "small.tfrecord" else 3)
        spans = [r.split("=")[1].split("-") for r in srv.range_log if r]
        fetched = sum(int(e) - int(s) + 1 for s, e in spans)
        # One block, then the two headers after it: not a block after each large record.
        assert fetched < 2 * tfrecord._READ_SIZE, srv.range_log
