"""The native ArrayRecord reader against files written (and read) by array_record's C++ code."""

from __future__ import annotations

import contextlib
import http.server
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import threading

import fsspec
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
from hypothesis import given
from hypothesis import strategies as st

from torchgrain.errors import CorruptDataError
from torchgrain.formats._highwayhash import riegeli_hash
from torchgrain.formats.arrayrecord.footer import parse_entries
from torchgrain.formats.arrayrecord_file import (
    ArrayRecordFile,
    TransposedChunkError,
    read_many,
    read_num_records,
)

BLOCK = 1 << 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_records(n: int, seed: int = 0, big_every: int = 97) -> list[bytes]:
    """Records of 0 bytes to > 64 KiB, partly compressible, so chunks and records
    straddle block boundaries in every compression."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if i % big_every == 5:
            size = int(rng.integers(BLOCK, BLOCK + 40_000))
        elif i % 13 == 0:
            size = 0
        else:
            size = int(rng.integers(1, 400))
        # Half random, half repeated: compresses, but not to nothing.
        half = rng.integers(0, 256, size // 2 + 1, dtype=np.uint8).tobytes()
        out.append((half + half[: size // 4] * 2)[:size].ljust(size, b"\x07"))
    return out


def write_cpp(path: str, records: list[bytes], options: str) -> str:
    w = ArrayRecordWriter(path, options)
    for r in records:
        w.write(r)
    w.close()
    return path


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def read_cpp(path: str) -> list[bytes]:
    r = ArrayRecordReader(path, "readahead_buffer_size:0,max_parallelism:0")
    try:
        return list(r.read_all())
    finally:
        r.close()


OPTIONS = [
    "group_size:1",
    "group_size:1,snappy",
    "group_size:1,brotli",
    "group_size:1,uncompressed",
    "group_size:100",
    "group_size:100,snappy",
    "group_size:64,brotli",
    "group_size:100,uncompressed",
    "group_size:1,pad_to_block_boundary:true",
    "group_size:7,zstd:1,pad_to_block_boundary:true",
]


RECORDS = make_records(400)


@pytest.fixture(scope="module")
def records() -> list[bytes]:
    return RECORDS


@pytest.fixture(scope="module")
def files(tmp_path_factory, records) -> dict[str, str]:
    d = tmp_path_factory.mktemp("ar")
    return {
        opt: write_cpp(str(d / f"f{i}.array_record"), records, opt) for i, opt in enumerate(OPTIONS)
    }


def straddles(f: ArrayRecordFile) -> tuple[int, int]:
    """(chunks whose 40-byte header crosses a block boundary, chunks starting on one)."""
    offs = f.chunk_offsets
    m = offs % BLOCK
    return int(np.sum((m > 0) & (m + 40 > BLOCK))), int(np.sum(m == 0))


@pytest.mark.parametrize("opt", OPTIONS)
def test_every_record_matches_cpp(files, records, opt):
    path = files[opt]
    expected = read_cpp(path)
    assert expected == records
    f = ArrayRecordFile(path)
    assert f.num_records == len(records)
    assert f.record_offsets[-1] == len(records)
    assert f.writer_options.startswith(opt.split(",")[0])
    assert f.read(np.arange(len(records))) == expected
    assert f.read_range(0, len(records)) == expected
    # One record at a time, in reverse.
    assert [f.read([i])[0] for i in range(len(records) - 1, -1, -1)] == expected[::-1]
    # Random order with duplicates.
    rng = np.random.default_rng(1)
    rows = rng.integers(0, len(records), 700)
    assert f.read(rows) == [expected[i] for i in rows]
    f.close()


@pytest.mark.parametrize("opt,raw", [("group_size:1", False), ("group_size:1,uncompressed", True)])
def test_one_record_chunks_take_the_batch_path(files, records, opt, raw):
    # zstd chunks are decompressed together, uncompressed ones sliced out of the map;
    # the few that straddle a block boundary go one by one. All agree with the C++ reader.
    f = ArrayRecordFile(files[opt])
    rows = np.random.default_rng(2).permutation(len(records))
    assert f.read(rows) == [records[i] for i in rows]
    assert f._raw_chunks is raw
    f.close()


@pytest.mark.filterwarnings("ignore:read_many.*deprecated:DeprecationWarning")
@given(
    picks=st.lists(
        st.tuples(st.sampled_from(OPTIONS), st.lists(st.integers(0, 399), max_size=40)),
        min_size=1,
        max_size=6,
    )
)
def test_read_many_matches_the_records(files, picks):
    """Files of every layout, grouping and compression in one call (a file twice too)."""
    readers = {opt: ArrayRecordFile(files[opt]) for opt in OPTIONS}
    out = read_many([readers[opt] for opt, _ in picks], [np.array(r, np.int64) for _, r in picks])
    assert out == [[RECORDS[i] for i in rows] for _, rows in picks]


def test_read_many_reads_each_file_and_is_deprecated(files, records, tmp_path):
    """read_many is each file's read, with a DeprecationWarning: zstd and uncompressed
    one-record files (each by its batch plan), a file with unusual chunks (empty records,
    records over 64 KiB, headers split by a block boundary) and a grouped file."""
    opts = ["group_size:1", "group_size:1", "group_size:1,uncompressed",
            "group_size:1,uncompressed", "group_size:1,uncompressed", "group_size:100"]  # fmt: skip
    readers = [ArrayRecordFile(files[o]) for o in opts]
    rng = np.random.default_rng(5)
    small = [i for i, r in enumerate(records) if 0 < len(r) < 1000]
    rows = [rng.choice(small, 30) for _ in opts]
    rows[1] = np.array([5, 102, 7, 199])  # records > 64 KiB
    rows[3] = np.array([1, 13, 2, 26])  # empty records
    # Small records: many 40-byte headers split by a block boundary, which nothing
    # in the batch plan may read.
    tiny = [bytes([i % 256]) * (i % 50) for i in range(6000)]
    path = write_cpp(str(tmp_path / "s.array_record"), tiny, "group_size:1,uncompressed")
    readers.append(ArrayRecordFile(path))
    low = readers[-1].chunk_offsets % BLOCK
    split = np.flatnonzero(low + 40 > BLOCK)
    assert len(split) >= 2
    rows.append(np.concatenate([split, np.arange(1, 40)]))
    want = [[records[i] for i in r] for r in rows[:-1]] + [[tiny[i] for i in rows[-1]]]
    with pytest.warns(DeprecationWarning, match="read_many"):
        assert read_many(readers, rows) == want
    assert [r.read(rows_) for r, rows_ in zip(readers, rows)] == want
    assert (readers[0]._raw_chunks, readers[2]._raw_chunks, readers[-1]._raw_chunks) == (
        False,
        True,
        True,
    )


def careful_chunks(f: ArrayRecordFile, cs: np.ndarray) -> int:
    """How many of chunks ``cs`` the batch path must leave to the careful path: a header
    that starts a block or is split by a boundary."""
    low = f.chunk_offsets[cs] % BLOCK
    return int(np.sum((low < 24) | (low + 40 >= BLOCK)))


@pytest.mark.filterwarnings("ignore:read_many.*deprecated:DeprecationWarning")
@pytest.mark.parametrize("opt", ["group_size:1", "group_size:1,uncompressed"])
def test_frames_cut_by_block_headers(tmp_path, opt, monkeypatch):
    """Records of 12 KiB (one in five runs into the next block), 20 KiB (a 3-byte size)
    and 70-200 KiB (two to four block headers inside): the batch path cuts the headers
    out, as the C++ reader does, and leaves only split headers to the careful path."""
    rng = np.random.default_rng(3)
    sizes = [12288] * 100 + [20_000] * 20 + [70_000, 140_000, 200_000] * 4
    recs = [rng.integers(0, 64, n, dtype=np.uint8).tobytes() for n in sizes]
    path = write_cpp(str(tmp_path / "c.array_record"), recs, opt)
    f = ArrayRecordFile(path)
    cs = np.arange(len(recs))
    _, ok, _, _, _, cut = f._chunk_plan(cs, f._ensure_footer(), raw="uncompressed" in opt)
    assert np.sum(ok & (cut > 0)) >= 30
    careful = []
    local_chunk = ArrayRecordFile._local_chunk

    def spy(self, c, *a):
        careful.append(c)
        return local_chunk(self, c, *a)

    monkeypatch.setattr(ArrayRecordFile, "_local_chunk", spy)
    order = rng.permutation(len(recs))
    want = read_cpp(path)
    assert f.read(order) == [recs[i] for i in order] == [want[i] for i in order]
    assert f._raw_chunks is ("uncompressed" in opt)
    assert len(careful) == careful_chunks(f, order)
    careful.clear()
    g = ArrayRecordFile(path)
    assert read_many([f, g], [order[:50], order[50:]]) == [
        [recs[i] for i in order[:50]],
        [recs[i] for i in order[50:]],
    ]
    assert len(careful) == careful_chunks(f, order)


@pytest.mark.filterwarnings("ignore:read_many.*deprecated:DeprecationWarning")
def test_read_many_checks_rows(files):
    """Rows out of range raise read()'s IndexError naming the file, known layout or not."""
    opt = "group_size:1"
    for known in (False, True):
        f, g = ArrayRecordFile(files[opt]), ArrayRecordFile(files[opt])
        if known:
            read_many([f, g], [np.arange(8), np.arange(8)])
        for bad in ([-1, 0], [0, 400], np.array([3, 400], np.int32)):
            with pytest.raises(IndexError, match="row out of range") as info:
                read_many([f, g], [np.array([1, 2]), np.asarray(bad)])
            assert "f0.array_record" in str(info.value)


def test_a_file_learns_its_layout_from_chunks_that_fit(files, records):
    """A first batch of chunks that fit neither plan (empty records) teaches nothing;
    the next one does."""
    empty = ([i for i, r in enumerate(records) if not r][:3] * 3)[:8]
    small = [i for i, r in enumerate(records) if 0 < len(r) < 1000][:8]
    f = ArrayRecordFile(files["group_size:1,uncompressed"])
    assert f.read(empty) == [b""] * 8
    assert f._raw_chunks is None
    assert f.read(small) == [records[i] for i in small]
    assert f._raw_chunks is True


def test_block_boundary_cases_are_covered(files):
    """The files above do contain chunks on and across block boundaries."""
    spans = on = 0
    for path in files.values():
        f = ArrayRecordFile(path)
        on += straddles(f)[1]
        spans += int(np.sum(f.chunk_offsets // BLOCK != (f._footer.chunk_ends - 1) // BLOCK))
    assert spans >= 10  # chunks (data, and records > 64 KiB) interrupted by block headers
    assert on >= 10  # pad_to_block_boundary puts every chunk on a boundary


def test_header_straddles_block_boundary(tmp_path):
    """Small uncompressed one-record chunks: many 40-byte headers cross boundaries."""
    recs = [bytes([i % 256]) * (i % 50) for i in range(6000)]
    path = write_cpp(str(tmp_path / "s.array_record"), recs, "group_size:1,uncompressed")
    f = ArrayRecordFile(path, verify_checksums=True)
    assert straddles(f)[0] >= 2
    assert f.read(range(len(recs))) == recs
    assert read_cpp(path) == recs


@given(rows=st.lists(st.integers(0, 399), max_size=60), opt=st.sampled_from(OPTIONS))
def test_read_any_rows(files, rows, opt):
    f = ArrayRecordFile(files[opt])
    expected = [RECORDS[i] for i in rows]
    assert f.read(rows) == expected
    assert f.read(np.asarray(rows, dtype=np.int32)) == expected


@given(start=st.integers(-5, 410), length=st.integers(0, 150))
def test_read_range(files, start, length):
    f = ArrayRecordFile(files["group_size:100,snappy"])
    assert f.read_range(start, start + length) == RECORDS[max(start, 0) : max(start + length, 0)]


def test_out_of_range_rows(files):
    f = ArrayRecordFile(files["group_size:1"])
    with pytest.raises(IndexError, match=r"f0\.array_record.*record 400"):
        f.read([400])
    with pytest.raises(IndexError):
        f.read([0, -1])
    with pytest.raises(TypeError):
        f.read(3)
    assert f.read([]) == []


def test_lazy_and_small_pickle(files, records):
    f = ArrayRecordFile(files["group_size:1"])
    assert f._footer is None and f._view is None  # nothing opened yet
    blob = pickle.dumps(f)
    assert len(blob) < 1000
    f.read([3])
    blob = pickle.dumps(f)
    # Index arrays travel, handles do not: a few bytes per chunk.
    assert len(blob) < 4 * 8 * 401 + 2000
    g = pickle.loads(blob)
    assert g._view is None
    assert g.read([5, 3]) == [records[5], records[3]]
    f.close()
    assert f.read([7]) == [records[7]]  # reopens after close


@pytest.mark.parametrize("opt", ["group_size:1", "group_size:100,snappy"])
def test_vectorised_footer_parse_matches_general_parser(files, opt):
    f = ArrayRecordFile(files[opt])
    offsets = f.chunk_offsets
    fo = f._footer
    view = f._local_view()
    _, n, decoded, data = f._chunk_payload(
        view[fo.footer_offset : fo.file_size - BLOCK], fo.footer_offset
    )
    values, bounds = f._decode_simple(data, n, decoded)
    fast = parse_entries(f, values, np.asarray(bounds), vectorised=True)
    slow = parse_entries(f, values, np.asarray(bounds), vectorised=False)
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(fast[0], offsets)
    assert int(fast[2].sum()) == f.num_records


def test_empty_file(tmp_path):
    path = write_cpp(str(tmp_path / "e.array_record"), [], "group_size:1")
    f = ArrayRecordFile(path)
    assert f.num_records == 0
    assert f.read([]) == [] and f.read_range(0, 10) == []
    assert len(f.record_offsets) == 1


def test_read_num_records(tmp_path):
    paths = [
        write_cpp(str(tmp_path / f"{k}.array_record"), [b"x"] * k, "group_size:2")
        for k in (0, 1, 5, 9)
    ]
    assert read_num_records(paths).tolist() == [0, 1, 5, 9]
    assert read_num_records(paths, max_workers=1).tolist() == [0, 1, 5, 9]


def test_verify_checksums_on_good_files(files, records):
    for opt in (
        "group_size:100",
        "group_size:1,pad_to_block_boundary:true",
        "group_size:64,brotli",
    ):
        f = ArrayRecordFile(files[opt], verify_checksums=True)
        rows = [*range(0, 400, 37), 5, 102]
        assert f.read(rows) == [records[i] for i in rows]


def test_highwayhash_known_values():
    # The fixed 64-byte start of every Riegeli/records file holds three of these hashes.
    assert riegeli_hash(b"") == 0x72C3B1E9C0139FE1
    assert riegeli_hash(bytes(8) + (64).to_bytes(8, "little")) == 0x3F4A880DD170AF83
    chunk_rest = bytes(8) + (0x72C3B1E9C0139FE1).to_bytes(8, "little") + b"s" + bytes(15)
    assert riegeli_hash(chunk_rest) == 0xA9E187923CC2BA91


def test_transposed_file_is_refused_clearly(tmp_path):
    path = write_cpp(str(tmp_path / "t.array_record"), [b"a", b"b", b"c"], "group_size:2,transpose")
    f = ArrayRecordFile(path)
    assert f.num_records == 3  # the footer is readable
    with pytest.raises(
        TransposedChunkError, match=r"t\.array_record.*chunk 0.*without 'transpose'"
    ):
        f.read([1])
    assert issubclass(TransposedChunkError, CorruptDataError)
    assert issubclass(TransposedChunkError, NotImplementedError)


# ---------------------------------------------------------------------------- corruption
def test_not_an_array_record_file(tmp_path):
    cases = {
        "empty": b"",
        "small": b"hello",
        "random": np.random.default_rng(0).integers(0, 256, 3 * BLOCK, dtype=np.uint8).tobytes(),
        "zeros": bytes(2 * BLOCK),
    }
    for name, data in cases.items():
        p = tmp_path / f"{name}.array_record"
        p.write_bytes(data)
        with pytest.raises(CorruptDataError, match=f"{name}.array_record"):
            _ = ArrayRecordFile(str(p)).num_records


def test_riegeli_file_without_array_record_footer(tmp_path):
    """A plain Riegeli file: the 64-byte signature then padding up to 128 KiB."""
    with open(write_cpp(str(tmp_path / "x.array_record"), [b"1"], "group_size:1"), "rb") as fh:
        head = fh.read(64)
    p = tmp_path / "plain.riegeli"
    p.write_bytes(head + bytes(2 * BLOCK - 64))
    with pytest.raises(CorruptDataError, match=r"plain\.riegeli"):
        _ = ArrayRecordFile(str(p)).num_records


@pytest.mark.parametrize("opt", ["group_size:1", "group_size:100,snappy"])
def test_truncated_files(files, tmp_path, opt):
    data = read_bytes(files[opt])
    for cut in (len(data) - 1, len(data) - BLOCK, len(data) - BLOCK - 1000, 3 * BLOCK + 17, 100):
        p = tmp_path / f"cut{cut}.array_record"
        p.write_bytes(data[:cut])
        with pytest.raises(CorruptDataError, match=f"cut{cut}"):
            f = ArrayRecordFile(str(p))
            f.read(range(f.num_records))


def chunk_header_pos(data: bytes, offset: int) -> int:
    """Physical position of field bytes of the header of the chunk at ``offset``
    (assumes the header does not straddle a block boundary)."""
    return offset + 24 if offset % BLOCK == 0 else offset


@pytest.mark.parametrize(
    "field,value",
    [
        ("data_size", 1 << 60),
        ("decoded", 1 << 60),
        ("num_records", (1 << 52)),
        ("data_size", 3),
        ("type", 0x6D),
    ],
)
def test_corrupt_chunk_header_fields(files, tmp_path, field, value):
    path = files["group_size:100,uncompressed"]
    f = ArrayRecordFile(path)
    c = 2
    pos = chunk_header_pos(b"", int(f.chunk_offsets[c]))
    assert pos % BLOCK + 40 <= BLOCK
    data = bytearray(read_bytes(path))
    if field == "data_size":
        struct.pack_into("<Q", data, pos + 8, value)
    elif field == "decoded":
        struct.pack_into("<Q", data, pos + 32, value)
    elif field == "num_records":
        struct.pack_into("<Q", data, pos + 24, (value << 8) | 0x72)
    else:
        data[pos + 24] = value
    p = tmp_path / "bad.array_record"
    p.write_bytes(bytes(data))
    bad = ArrayRecordFile(str(p))
    with pytest.raises(CorruptDataError, match=r"bad\.array_record.*chunk 2.*record 200"):
        bad.read([205])
    assert bad.read([5, 399]) == [f.read([5])[0], f.read([399])[0]]  # other chunks still read


@pytest.mark.parametrize(
    "opt", ["group_size:1", "group_size:100", "group_size:64,brotli", "group_size:100,snappy"]
)
def test_flipped_bytes_detected_with_checksums(files, tmp_path, opt):
    path = files[opt]
    f = ArrayRecordFile(path)
    data = read_bytes(path)
    rng = np.random.default_rng(3)
    for k in range(6):
        c = int(rng.integers(0, len(f.chunk_offsets)))
        start = int(f.chunk_offsets[c])
        end = int(f._footer.chunk_ends[c])
        pos = int(rng.integers(start, min(end, start + 200)))
        if pos % BLOCK < 24 and pos >= BLOCK and start // BLOCK == pos // BLOCK:
            continue
        bad = bytearray(data)
        bad[pos] ^= 0x40
        p = tmp_path / f"flip{k}.array_record"
        p.write_bytes(bytes(bad))
        rows = list(range(int(f.record_offsets[c]), int(f.record_offsets[c + 1])))
        if not rows:
            continue
        g = ArrayRecordFile(str(p), verify_checksums=True)
        with pytest.raises(CorruptDataError, match=f"flip{k}.*chunk {c}"):
            g.read(rows[:1])
        # Without checksums: a clean error or (for payload bits the codec cannot
        # check) some bytes, never another exception or a crash.
        with contextlib.suppress(CorruptDataError):
            ArrayRecordFile(str(p)).read(rows)


@given(pos=st.integers(0, 10 * BLOCK), bit=st.integers(0, 7), opt=st.sampled_from(OPTIONS[:5]))
def test_random_bit_flips_never_crash(files, pos, bit, opt, tmp_path_factory):
    data = bytearray(read_bytes(files[opt]))
    pos %= len(data)
    data[pos] ^= 1 << bit
    p = tmp_path_factory.mktemp("flip") / "x.array_record"
    p.write_bytes(bytes(data))
    try:
        f = ArrayRecordFile(str(p))
        f.read(range(f.num_records))
    except CorruptDataError as e:
        assert "x.array_record" in str(e)


# ---------------------------------------------------------------------------- remote
def test_memory_filesystem(files, records):
    mem = fsspec.filesystem("memory")
    for i, opt in enumerate(OPTIONS[:6]):
        with open(files[opt], "rb") as fh:
            mem.pipe(f"/nr/{i}.array_record", fh.read())
        f = ArrayRecordFile(f"memory://nr/{i}.array_record")
        assert f.num_records == len(records)
        rows = np.random.default_rng(i).integers(0, len(records), 300)
        assert f.read(rows) == [records[r] for r in rows]
        assert f.read_range(90, 130) == records[90:130]
        g = pickle.loads(pickle.dumps(f))
        assert g.read([399]) == [records[399]]
    assert (
        read_num_records([f"memory://nr/{i}.array_record" for i in range(6)]).tolist() == [400] * 6
    )
    with pytest.raises(FileNotFoundError):
        _ = ArrayRecordFile("memory://nr/missing.array_record").num_records


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves files from a directory with HEAD and single-range GET, and counts GETs."""

    root = ""
    gets: list[str] = []

    def log_message(self, *args):  # keep test output quiet
        pass

    def _file(self):
        path = os.path.join(self.root, self.path.lstrip("/"))
        if not os.path.isfile(path):
            self.send_error(404)
            return None
        return path

    def do_HEAD(self):
        path = self._file()
        if path:
            self.send_response(200)
            self.send_header("Content-Length", str(os.path.getsize(path)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

    def do_GET(self):
        path = self._file()
        if not path:
            return
        size = os.path.getsize(path)
        rng = self.headers.get("Range")
        self.gets.append(rng or "all")
        start, end = 0, size - 1
        if rng:
            a, b = rng.split("=")[1].split("-")
            start = int(a)
            end = min(int(b), size - 1) if b else size - 1
        with open(path, "rb") as fh:
            fh.seek(start)
            body = fh.read(end - start + 1)
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(body)


def test_http_range_reads(files, records, tmp_path):
    pytest.importorskip("aiohttp")
    for i, opt in enumerate(["group_size:1", "group_size:100,snappy"]):
        os.link(files[opt], tmp_path / f"h{i}.array_record")
    handler = type("H", (_RangeHandler,), {"root": str(tmp_path), "gets": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        f = ArrayRecordFile(f"{base}/h0.array_record")
        assert f.num_records == len(records)
        assert len(handler.gets) == 1  # postscript and footer in one ranged GET
        rows = [399, 3, 3, 250, 17]
        before = len(handler.gets)
        assert f.read(rows) == [records[r] for r in rows]
        assert len(handler.gets) - before <= len(set(rows))  # coalesced, never per record
        g = ArrayRecordFile(f"{base}/h1.array_record")
        assert g.read_range(0, 400) == records
        assert read_num_records(
            [f"{base}/h0.array_record", f"{base}/h1.array_record"]
        ).tolist() == [
            400,
            400,
        ]
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------- processes
FORK_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils.data import DataLoader, Dataset
    from torchgrain.formats.arrayrecord_file import ArrayRecordFile

    class DS(Dataset):
        def __init__(self, f):
            self.f = f
        def __len__(self):
            return self.f.num_records
        def __getitem__(self, i):
            return self.f.read([i])[0]
        def __getitems__(self, idx):
            return self.f.read(idx)

    def as_list(batch):
        return batch

    def run(path, expected_path, ctx):
        expected = open(expected_path, "rb").read().split(b"\\n--\\n")
        f = ArrayRecordFile(path)
        assert f.read([0, len(expected) - 1]) == [expected[0], expected[-1]]  # parent reads first
        rounds = 3 if ctx == "fork" else 1
        for _ in range(rounds):
            dl = DataLoader(DS(f), batch_size=16, num_workers=2, multiprocessing_context=ctx,
                            collate_fn=as_list)
            got = [r for batch in dl for r in batch]
            assert got == expected, ctx
        assert f.read([1]) == [expected[1]]  # parent still reads after its workers
        print("ok", ctx)

    if __name__ == "__main__":
        run(sys.argv[1], sys.argv[2], sys.argv[3])
    """
)


@pytest.mark.parametrize("ctx", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_after_parent_read(tmp_path, ctx):
    recs = [b"rec-%d-" % i * (i % 40) for i in range(300)]
    path = write_cpp(str(tmp_path / "w.array_record"), recs, "group_size:1")  # zstd
    exp = tmp_path / "expected.bin"
    exp.write_bytes(b"\n--\n".join(recs))
    script = tmp_path / "fork_job.py"
    script.write_text(FORK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, str(script), path, str(exp), ctx],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"ok {ctx}" in out.stdout


def test_threads_share_one_object(files, records):
    from concurrent.futures import ThreadPoolExecutor

    f = ArrayRecordFile(files["group_size:1"])
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, 400, 50) for _ in range(40)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(f.read, batches))
    for rows, got in zip(batches, results):
        assert got == [records[i] for i in rows]


@pytest.mark.parametrize("opt", ["group_size:1", "group_size:1,zstd:1", "group_size:1,snappy"])
def test_one_record_chunks_batched_in_request_order(tmp_path, opt):
    # Batches of one-record chunks decode in request order without sorting: repeated
    # rows, empty records, records that straddle a 64 KiB block and ones larger than a
    # block all come back as the C++ reader gives them, as bytes.
    rng = np.random.default_rng(3)
    recs = [
        rng.integers(0, 4 if i % 2 else 256, int(n), dtype=np.uint8).tobytes()
        for i, n in enumerate(rng.choice([0, 1, 300, 1024, 5000, 70000], 600))
    ]
    path = str(tmp_path / "one.array_record")
    w = ArrayRecordWriter(path, opt)
    for r in recs:
        w.write(r)
    w.close()
    f = ArrayRecordFile(path)
    cpp = ArrayRecordReader(path, "readahead_buffer_size:0")
    for k in range(10):
        rows = rng.integers(0, len(recs), 200).tolist()
        rows += rows[:15]
        got = f.read(np.asarray(rows) if k % 2 else rows)
        assert got == [recs[i] for i in rows] == cpp.read(rows)
        assert {type(x) for x in got} == {bytes}
    cpp.close()
