"""Hostile bytes against the record decoders and their decompression (tf.Example,
TFRecord streams, msgpack, ArrayRecord chunks): each test reproduces one fault found by
building inputs an attacker controls, and is a strict xfail until the fault is fixed.
"""

from __future__ import annotations

import tracemalloc
import zlib

import _riegeli
import numpy as np
import pytest

from tests.test_tf_example import _ld
from torchgrain.errors import CorruptDataError, RecordDecodeError
from torchgrain.formats.arrayrecord.file import ArrayRecordFile
from torchgrain.formats.arrayrecord.footer import FooterReader
from torchgrain.formats.tf_example import decode_tf_example, encode_tf_example
from torchgrain.formats.tfds import TFDSCodec
from torchgrain.formats.tfrecord import _frame, iter_tfrecord


def test_empty_packed_int64_list_decodes_as_protobuf_does():
    # Feature{int64_list{value: packed []}}: protobuf reads an empty int64 list; a
    # second packed run after it is concatenated (a writer that flushes per run).
    data = _ld(1, _ld(1, _ld(1, b"a") + _ld(2, _ld(3, _ld(1, b"")))))
    assert decode_tf_example(data)["a"].tolist() == []
    assert decode_tf_example(data)["a"].dtype == np.int64
    data = _ld(1, _ld(1, _ld(1, b"a") + _ld(2, _ld(3, _ld(1, b"") + _ld(1, b"\x05")))))
    assert decode_tf_example(data)["a"].tolist() == [5]


def test_concatenated_zlib_streams_give_each_record_once(tmp_path):
    # Two zlib streams one after the other (``cat a.zz b.zz``), the first holding a
    # record larger than a 1 MiB decompression step: the second stream's records were
    # yielded twice (its bytes were fed to the decompressor from both unused_data and
    # the stale unconsumed_tail), each copy with valid CRCs.
    first = [np.random.default_rng(0).bytes(64) * (3 << 14)]  # 3 MiB
    second = [b"second-%d" % i for i in range(3)]
    path = tmp_path / "x.tfrecord.zlib"
    path.write_bytes(
        zlib.compress(b"".join(map(_frame, first))) + zlib.compress(b"".join(map(_frame, second)))
    )
    assert list(iter_tfrecord(path)) == first + second


def test_unpacked_floats_take_memory_in_proportion_to_their_bytes():
    # A float_list written unpacked (tag, 4 bytes per value: valid protobuf) held a
    # (start, end) tuple per value while parsing: ~50 bytes of memory per byte of
    # input, so a 20 MB record took 1 GB. Packed floats take 2x; ints and bytes ~15x.
    n = 50_000
    data = _ld(1, _ld(1, _ld(1, b"a") + _ld(2, _ld(2, (b"\x0d" + b"\x00\x00\xc0\x3f") * n))))
    tracemalloc.start()
    try:
        got = decode_tf_example(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got["a"].dtype == np.float32 and got["a"].tolist() == [1.5] * n
    assert peak < 8 * len(data), f"{peak / len(data):.1f} bytes of memory per byte of input"


def _array_record_of_footer(
    footer_data: bytes, num_records: int, decoded: int, pad: bool = False
) -> bytes:
    """An ArrayRecord file of no data chunks whose footer chunk holds ``footer_data``
    (a simple chunk's data) and declares ``num_records`` records of ``decoded`` bytes;
    ``pad``: padded to as many bytes as records, as Riegeli pads a chunk."""
    r = _riegeli
    w = r._Writer()
    w.chunk(r._header(b"", 0x73, 0, 0, 0))  # file signature
    head = r._header(footer_data, 0x72, num_records, decoded, len(footer_data))
    footer_offset = w.chunk(head + footer_data, end_logical=num_records if pad else None)
    target = -(-(w.pos + 41) // r.BLOCK) * r.BLOCK  # padding to the postscript's block
    n = target - w.pos - 40
    while r._phys_end(w.pos, 40 + n) > target:
        n -= 1
    w.chunk(r._header(bytes(n), 0x70, 0, 0, n) + bytes(n))
    post = r._proto_varint_field(1, footer_offset) + r._proto_varint_field(2, r.MAGIC)
    pdata = r.Chunk([post] * 3, "none").data()
    w.chunk(r._header(pdata, 0x72, 3, 3 * len(post), len(pdata)) + pdata)
    return bytes(w.out + bytes(-w.pos % r.BLOCK))


def test_sliced_footer_refuses_an_overlong_size_varint_at_once(tmp_path):
    # A footer read a slice at a time (a node index build of a footer over its
    # budget): a record-size buffer of 8 MiB of 0x80 bytes (300 bytes of zstd) was
    # gathered whole, 64 KiB at a time, each time copied again: 16 MiB of memory and
    # quadratic time (1 GiB, the max_chunk_bytes default, 33 KB of zstd: an hour and
    # 2 GiB) before the first size was found to be over 10 bytes.
    sizes = _riegeli.compress("zstd", b"\x80" * (8 << 20) + b"\x00")
    values = _riegeli.compress("zstd", b"x" * 10)
    data = bytes([0x7A]) + _riegeli.varint(len(sizes)) + sizes + values
    path = tmp_path / "x.array_record"
    path.write_bytes(_array_record_of_footer(data, 1 << 20, 10, pad=True))
    f = ArrayRecordFile(str(path))
    try:
        reader = FooterReader(f, *f._tail(), f._fetch)
        tracemalloc.start()
        try:
            with pytest.raises(CorruptDataError, match=r"x\.array_record.*footer.*varint"):
                list(reader.slices(step=1000))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        f.close()
    assert peak < 4 << 20, f"{peak >> 20} MiB"


@pytest.mark.parametrize(
    ("features", "key"),
    [
        # A text sequence stored as int64s: bytes(n) made a string of n NULs (a 20-byte
        # record gave 64 MiB; 2**33 gave 8 GiB, 4 * 10**12 a bare MemoryError).
        ({"t": [5, 1 << 26]}, "t"),
        ({"label": [3.9]}, "label"),  # a float label was truncated to 3
        ({"x": [b"1e5", b"inf"]}, "x"),  # bytes were parsed as numbers
        ({"n": [7.5]}, "n"),  # an int64 tensor given floats: 7
        ({"e": [1, 2]}, "e"),  # an encoded tensor given int64s: their bits as float32
    ],
)
def test_tfds_feature_stored_as_another_kind_than_its_spec_is_an_error(features, key):
    # tfds.load refuses a record whose feature has another kind than its spec says
    # (tf.io.parse_example: "data types don't match"); casting gave wrong values.
    spec = {
        "featuresDict": {
            "features": {
                "t": {"sequence": {"feature": {"text": {}}}},
                "label": {"classLabel": {"numClasses": "10"}},
                "x": {"tensor": {"shape": {"dimensions": ["2"]}, "dtype": "float32"}},
                "n": {"tensor": {"shape": {}, "dtype": "int64"}},
                "e": {
                    "tensor": {
                        "shape": {"dimensions": ["-1"]},
                        "dtype": "float32",
                        "encoding": "bytes",
                    }
                },
            }
        }
    }
    with pytest.raises(RecordDecodeError, match=f"TFDS feature {key!r}"):
        TFDSCodec(spec).decode(encode_tf_example(features))


def _peak_of(call) -> int:
    """The peak memory (tracemalloc) of ``call()``, which must raise CorruptDataError."""
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError, match=r"x\.array_record"):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_chunk_claiming_more_records_than_its_bytes_is_refused_in_bounded_memory(tmp_path):
    # Riegeli pads a chunk to at least as many bytes as it has records (a record's
    # position is its chunk's offset plus its index; array_record's writer does so).
    # A 128 KiB file whose chunk (and footer) claims 2**20 records of 2-byte sizes
    # (2 MiB of varints in 206 bytes of zstd) decoded them all first: ~44 bytes of memory
    # per byte of sizes (2**25 records: 1.5 GiB and 7 s, then a bare MemoryError
    # under a 2 GiB address-space limit; 2**29, within max_chunk_bytes: ~44 GiB).
    n = 1 << 20
    sizes = _riegeli.compress("zstd", b"\xff\x7f" * n)
    chunk = _riegeli.Chunk([b"x" * 10], sizes_buffer=sizes, num_records=n, footer_records=n)
    path = tmp_path / "x.array_record"
    _riegeli.write(str(path), [chunk])
    f = ArrayRecordFile(str(path))
    try:
        assert _peak_of(lambda: f.read_range(0, 1)) < 16 << 20
    finally:
        f.close()


def test_footer_claiming_more_records_than_its_bytes_is_refused_in_bounded_memory(tmp_path):
    # The same for the footer chunk, read when a file is opened.
    n = 1 << 20
    sizes = _riegeli.compress("zstd", b"\xff\x7f" * n)
    values = _riegeli.compress("zstd", b"x" * 10)
    data = bytes([0x7A]) + _riegeli.varint(len(sizes)) + sizes + values
    path = tmp_path / "x.array_record"
    path.write_bytes(_array_record_of_footer(data, n, 10))
    f = ArrayRecordFile(str(path))
    try:
        assert _peak_of(lambda: f.read_range(0, 1)) < 16 << 20
    finally:
        f.close()
