"""Every integrity check of the decoders, end to end through the public source API.

Each test corrupts a dataset the way a bad disk, a bad network or a hostile writer would
(a flipped byte, a size that lies, a stream that holds more than it says) and reads it
on every path that uses the check: one record (``src[i]``), a batch of one shard, a
joint batch of several shards, columns, in order, and from remote storage
(``memory://``) where that path differs. Each must end in a torchgrain error naming the
file, never in wrong bytes; and, where the check is about memory, within a bound. Each
test fails when its check is removed.
"""

from __future__ import annotations

import gzip
import os
import re
import struct
import tracemalloc
from pathlib import Path

import _riegeli as R
import fsspec
import msgpack
import numpy as np
import pytest
import torch
import zstandard

import torchgrain as tg
from torchgrain.errors import CorruptDataError, RecordDecodeError
from torchgrain.formats.arrayrecord_file import ArrayRecordFile
from torchgrain.formats.tfrecord import write_tfrecord

PATHS = ["item", "batch", "joint_batch", "columns", "in_order", "remote_item", "remote_batch"]


def read(src: tg.Source, path: str, k: int) -> None:
    """Read record ``k`` (of shard 0) of ``src`` the way ``path`` says."""
    n = len(src)
    if path in ("item", "remote_item"):
        src[k]
    elif path in ("batch", "remote_batch"):
        shard0 = int(src.shard_counts[0])
        src.__getitems__([k, *[i for i in range(shard0) if i != k]][:8])
    elif path == "joint_batch":  # several shards in one batch: the format's joint path
        src.__getitems__([k, *[i for i in range(n) if i != k]])
    elif path == "columns":
        src.read_columns([k, *[i for i in range(n) if i != k]])
    elif path == "in_order":
        list(src.iter_shard(0))
    else:
        raise AssertionError(path)


def to_memory(local_dir: str, name: str) -> str:
    """Copy a dataset directory to fsspec's memory filesystem; returns its URL."""
    fs = fsspec.filesystem("memory")
    root = f"/{name}"
    if fs.exists(root):
        fs.rm(root, recursive=True)
    for f in sorted(os.listdir(local_dir)):
        with open(os.path.join(local_dir, f), "rb") as src, fs.open(f"{root}/{f}", "wb") as dst:
            dst.write(src.read())
    return f"memory://{root}"


# ================================================================== TFRecord
def tfrecord_dir(tmp_path, sizes=(30, 40, 50, 60)) -> tuple[str, list[bytes]]:
    d = tmp_path / "tfr"
    d.mkdir()
    recs = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    half = len(recs) // 2
    write_tfrecord(recs[:half], str(d / "a.tfrecord"))
    write_tfrecord(recs[half:], str(d / "b.tfrecord"))
    return str(d), recs


def tf_source(d: str, path: str, **kw) -> tg.TFRecordSource:
    where = to_memory(d, f"tfr-{path}") if path.startswith("remote") else d
    return tg.TFRecordSource(where, codec="raw", index_dir=None, **kw)


@pytest.mark.parametrize("path", PATHS)
def test_a_flipped_byte_in_a_tfrecord_record_is_never_served(tmp_path, path):
    d, recs = tfrecord_dir(tmp_path)
    file = os.path.join(d, "a.tfrecord")
    data = bytearray(Path(file).read_bytes())
    at = (16 + len(recs[0])) + 12 + 5  # record 1, a data byte
    data[at] ^= 0x10
    Path(file).write_bytes(bytes(data))
    src = tf_source(d, path)
    with pytest.raises(CorruptDataError, match=r"a\.tfrecord.*data checksum mismatch"):
        read(src, path, 1)
    # Not checking is a choice the user makes, and then the flipped byte comes through.
    lax = tf_source(d, path, verify_checksums=False)
    assert lax[1]["bytes"] != recs[1]


@pytest.mark.parametrize("fmt", ["tfrecord", "array_record"])
@pytest.mark.parametrize("path", PATHS)
def test_a_corrupt_record_names_its_shard_and_index_on_every_path(tmp_path, fmt, path):
    if fmt == "tfrecord":
        d, recs = tfrecord_dir(tmp_path)
        file = os.path.join(d, "a.tfrecord")
        data = bytearray(Path(file).read_bytes())
        data[(16 + len(recs[0])) + 12 + 5] ^= 0x10  # record 1, a data byte
        Path(file).write_bytes(bytes(data))
        src = tf_source(d, path)
    else:
        src = ar_source(
            ar_dir(tmp_path, lying_chunk("brotli", b"abc" * 9, 7), compression="brotli"), path
        )
    with pytest.raises(CorruptDataError) as exc:
        read(src, path, 1)
    # Read in order, ArrayRecord reads blocks of records: the error names the block's
    # first (and the file's message the record).
    index = 0 if path == "in_order" and fmt == "array_record" else 1
    name = "ArrayRecord" if fmt == "array_record" else "TFRecord"
    where = rf"\({name} shard 0 of 2 '[^']*a\.{fmt}', record index {index}\)"
    assert re.search(where, str(exc.value)), str(exc.value)


def test_a_tfrecord_length_with_a_bad_checksum_is_refused_at_open(tmp_path):
    d, _ = tfrecord_dir(tmp_path)
    file = os.path.join(d, "b.tfrecord")
    data = bytearray(Path(file).read_bytes())
    data[8] ^= 1  # the first record's length CRC
    Path(file).write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match=r"b\.tfrecord.*length checksum mismatch"):
        tg.TFRecordSource(d, codec="raw", index_dir=None)


def test_a_tfrecord_changed_after_its_index_was_cached_is_refused(tmp_path, monkeypatch):
    """The offset index is cached: a record that later claims another length (with a
    right length CRC: a rewrite, not bit rot) must not be read past its frame."""
    d, recs = tfrecord_dir(tmp_path)
    index = str(tmp_path / "index")
    src = tg.TFRecordSource(d, codec="raw", index_dir=index)
    assert src[0]["bytes"] == recs[0]
    file = os.path.join(d, "a.tfrecord")
    data = bytearray(Path(file).read_bytes())
    stat = os.stat(file)
    from torchgrain.formats.tfrecord import masked_crc32c

    n = struct.pack("<Q", len(recs[0]) - 4)
    data[0:12] = n + struct.pack("<I", masked_crc32c(n))
    Path(file).write_bytes(bytes(data))
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # Its change time keys the index: the file is walked again, and the frame refused.
    with pytest.raises(CorruptDataError, match=r"a\.tfrecord.*checksum mismatch"):
        tg.TFRecordSource(d, codec="raw", index_dir=index)
    # Where the cached index is used all the same (a filesystem whose change times and
    # inodes say nothing, simulated here), the read is refused.
    from torchgrain.sources import tfrecord

    stamp = tfrecord._size_and_stamp

    def old_stamp(*args):
        size, _, ctime, etag = stamp(*args)
        return size, f"{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_ino}", ctime, etag

    monkeypatch.setattr(tfrecord, "_size_and_stamp", old_stamp)
    src = tg.TFRecordSource(d, codec="raw", index_dir=index)
    with pytest.raises(CorruptDataError, match=r"a\.tfrecord.*says it holds"):
        src[0]


@pytest.mark.parametrize("bad", [[46], [0, 5], [0.0, 46.0], [[0, 46]]])
def test_a_cached_tfrecord_index_that_cannot_be_the_files_is_built_again(tmp_path, bad):
    """A cached index is trusted for the record count: one that cannot index this file
    (not starting at 0, frames shorter than 16 bytes, not int64 offsets) is rebuilt,
    not used to skip records."""
    d, recs = tfrecord_dir(tmp_path)
    index = tmp_path / "index"
    tg.TFRecordSource(d, codec="raw", index_dir=str(index))
    for f in index.iterdir():
        np.save(f, np.array(bad))
    src = tg.TFRecordSource(d, codec="raw", index_dir=str(index))
    assert [r["bytes"] for r in src.__getitems__(range(len(src)))] == recs


@pytest.mark.parametrize("path", PATHS)
def test_a_tfrecord_record_over_max_record_bytes_is_refused(tmp_path, path):
    d, _ = tfrecord_dir(tmp_path, sizes=(30, 4000, 50, 60))
    src = tf_source(d, path, max_record_bytes=1000)
    with pytest.raises(CorruptDataError, match=r"a\.tfrecord.*max_record_bytes=1000"):
        read(src, path, 1)
    assert src[0]["bytes"] == b"\x01" * 30  # records under the ceiling read as usual


def test_read_tfrecord_at_refuses_a_record_over_max_record_bytes(tmp_path):
    from torchgrain.formats.tfrecord import index_tfrecord, read_tfrecord_at

    path = str(tmp_path / "x.tfrecord")
    write_tfrecord([b"a" * 10, b"b" * 4000], path)
    offsets = index_tfrecord(path).tolist()
    assert read_tfrecord_at(path, offsets[0], max_record_bytes=1000) == b"a" * 10
    with pytest.raises(
        CorruptDataError, match=r"x\.tfrecord.*byte offset 26.*max_record_bytes=1000"
    ):
        read_tfrecord_at(path, offsets[1], max_record_bytes=1000)


def test_a_compressed_tfrecord_of_many_records_keeps_no_memory_per_record(tmp_path):
    """200,000 empty records in 6 KiB of gzip (a stream holds about 1000 times its size):
    they are counted, and nothing per record is kept (no offsets: there is no random
    access into a compressed stream), in the source or in its cached index."""
    import pickle

    from torchgrain.formats.tfrecord import masked_crc32c

    n = struct.pack("<Q", 0)
    empty = n + struct.pack("<I", masked_crc32c(n)) + struct.pack("<I", masked_crc32c(b""))
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.tfrecord.gz").write_bytes(gzip.compress(empty * 200_000, mtime=0))
    write_tfrecord([b"x" * 10], str(d / "b.tfrecord"))
    index = tmp_path / "index"
    for _ in range(2):  # building the index, then from the cached one
        src = tg.TFRecordSource(str(d), codec="raw", index_dir=str(index))
        assert len(src) == 200_001 and src.shard_counts.tolist() == [200_000, 1]
        assert len(pickle.dumps(src)) < 100_000
        assert src[200_000]["bytes"] == b"x" * 10
        assert src.block_offsets().tolist() == [0, 200_000, 200_001]
        assert sum(f.stat().st_size for f in index.iterdir()) < 10_000
    assert next(src.iter_shard(0, 199_999))["bytes"] == b""


@pytest.mark.parametrize("suffix", [".tfrecord.gz", ".tfrecord.zz"])
def test_a_compressed_tfrecord_length_over_the_ceiling_is_refused_before_reading(tmp_path, suffix):
    """A compressed stream has no file size to bound a length: 64 MiB of zeros (64 KiB
    compressed) behind a length that claims a TiB must not be read into memory."""
    import zlib

    from torchgrain.formats.tfrecord import masked_crc32c

    n = struct.pack("<Q", 1 << 40)
    blob = n + struct.pack("<I", masked_crc32c(n)) + bytes(64 << 20)
    comp = gzip.compress(blob, compresslevel=1) if suffix.endswith("gz") else zlib.compress(blob, 1)
    (tmp_path / f"x{suffix}").write_bytes(comp)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError, match=r"x\.tfrecord.*max_record_bytes="):
            tg.TFRecordSource(str(tmp_path), codec="raw", index_dir=None, max_record_bytes=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20


# ================================================================== ArrayRecord
def ar_dir(tmp_path, bad: R.Chunk, *, compression: str = "zstd", name: str = "ar") -> str:
    """Two shards of one-record chunks; shard 0's record 1 is ``bad``."""
    d = tmp_path / name
    d.mkdir()
    good = [bytes([i]) * (20 + i) for i in range(6)]
    R.write(
        str(d / "a.array_record"),
        [R.Chunk([good[0]], compression), bad, R.Chunk([good[2]], compression)],
    )
    R.write(str(d / "b.array_record"), [R.Chunk([r], compression) for r in good[3:]])
    return str(d)


def ar_source(d: str, path: str, **kw) -> tg.ArrayRecordSource:
    where = to_memory(d, f"ar-{path}-{os.path.basename(d)}") if path.startswith("remote") else d
    return tg.ArrayRecordSource(where, codec="raw", **kw)


def lying_chunk(compression: str, record: bytes, extra: int) -> R.Chunk:
    """A one-record chunk whose every size field says ``extra`` bytes more than its
    stream holds (its hashes right)."""
    declared = len(record) + extra
    if compression == "none":
        values = record
    elif compression == "zstd":  # a frame that names no size, so zstd cannot tell
        frame = zstandard.ZstdCompressor(write_content_size=False).compress(record)
        values = R.varint(declared) + frame
    else:
        values = R.varint(declared) + R.stream(compression, record)
    return R.Chunk(
        [record],
        compression,
        values_buffer=values,
        sizes=[declared],
        decoded_size=declared,
        footer_decoded=declared,
    )


@pytest.mark.parametrize("compression", ["brotli", "snappy", "zstd", "none"])
@pytest.mark.parametrize("path", PATHS)
def test_a_chunk_that_declares_more_bytes_than_it_holds_is_never_served(
    tmp_path, compression, path
):
    d = ar_dir(tmp_path, lying_chunk(compression, b"abcdef" * 5, 7), compression=compression)
    src = ar_source(d, path)
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*chunk 1"):
        read(src, path, 1)
    assert src[0]["bytes"] == b"\x00" * 20


@pytest.mark.parametrize("lie", ["footer_says_more", "header_says_more"])
@pytest.mark.parametrize("path", PATHS)
def test_a_footer_count_that_disagrees_with_its_chunk_is_refused_where_the_chunk_is_read(
    tmp_path, path, lie
):
    """The footer's record counts number the records (the metadata's total agrees with
    them): a chunk whose header holds another count must never be read as the footer
    says. (Chunks after it are numbered as the footer says; only reading every chunk
    header could tell, and a writer able to lie there could as well write other records.)"""
    if lie == "footer_says_more":  # footer counts 1, 2, 1: records 1 and 2 in chunk 1
        bad = R.Chunk([b"x" * 21], "zstd", footer_records=2)
    else:  # footer counts 1, 1, 1 (group_size 1), the chunk holds two records
        bad = R.Chunk([b"x" * 21, b"y" * 21], "zstd", footer_records=1)
    src = ar_source(ar_dir(tmp_path, bad), path)
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*chunk 1.*the footer says"):
        read(src, path, 1)
    assert src[0]["bytes"] == b"\x00" * 20


@pytest.mark.parametrize("compression", ["brotli", "snappy", "zstd"])
@pytest.mark.parametrize("path", PATHS)
def test_a_values_stream_that_holds_less_than_its_chunk_is_refused(tmp_path, compression, path):
    """Record sizes 10 + 20 and the chunk's 30 decoded bytes agree, but the values stream
    says (and holds) 25: the last record would come back 5 bytes short."""
    recs = [b"a" * 10, b"b" * 20]
    short = b"".join(recs)[:25]
    values = R.varint(25) + R.stream(compression, short)
    bad = R.Chunk(recs, compression, values_buffer=values)
    src = ar_source(ar_dir(tmp_path, bad, compression=compression), path)
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*chunk 1.*declares 25"):
        read(src, path, 2)  # the chunk's second record


@pytest.mark.parametrize("path", PATHS)
def test_record_sizes_that_do_not_add_up_are_refused(tmp_path, path):
    recs = [b"x" * 10, b"y" * 20]
    bad = R.Chunk(recs, "brotli", sizes=[10, 21])
    d = ar_dir(tmp_path, bad, compression="brotli")
    src = ar_source(d, path)
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*add up to 31"):
        read(src, path, 1)


def test_record_sizes_are_checked_before_the_values_are_decompressed(tmp_path):
    """A chunk of two records whose sizes do not add up and whose values stream really
    holds 256 MiB: refused without inflating it."""
    big = 256 << 20
    frame = zstandard.ZstdCompressor(level=1).compress(bytes(big))
    bad = R.Chunk(
        [b"a", b"b"],
        "zstd",
        sizes=[1, big],  # adds up to big + 1
        values_buffer=R.varint(big) + frame,
        decoded_size=big,
        footer_decoded=big,
    )
    d = ar_dir(tmp_path, bad)
    src = tg.ArrayRecordSource(d, codec="raw", max_chunk_bytes=1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError, match="add up to"):
            src[1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def brotli_claim(size: int) -> R.Chunk:
    values = R.varint(size) + R.stream("brotli", b"abc")
    return R.Chunk(
        [b"abc"],
        "brotli",
        values_buffer=values,
        sizes=[size],
        decoded_size=size,
        footer_decoded=size,
    )


@pytest.mark.parametrize("path", PATHS)
def test_a_chunk_claiming_16_gib_is_refused_before_anything_is_allocated(tmp_path, path):
    d = ar_dir(tmp_path, brotli_claim(16 << 30), compression="brotli")
    src = ar_source(d, path)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError, match=r"a\.array_record.*max_chunk_bytes=1073741824"):
            read(src, path, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def resident_growth(fn) -> int:
    """Bytes by which ``fn()`` raises this process's peak resident memory (Linux's
    VmHWM, reset first): what a claim costs, which tracemalloc cannot tell (it counts
    memory allocated but never touched)."""
    import fuzz

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
    except OSError:
        pytest.skip("cannot reset the peak resident size here")
    base = fuzz.status_mib("VmRSS")
    fn()
    return int((fuzz.status_mib("VmHWM") - base) * (1 << 20))


@pytest.mark.parametrize("path", ["item", "columns", "remote_item"])
def test_a_brotli_chunk_claiming_just_under_the_ceiling_costs_no_memory(tmp_path, path):
    """A few bytes of brotli that claim 512 MiB (under the 1 GiB ceiling): refused when
    the stream ends short, without touching the 512 MiB it claims."""
    d = ar_dir(tmp_path, brotli_claim(512 << 20), compression="brotli")
    src = ar_source(d, path)

    def fails() -> None:
        with pytest.raises(CorruptDataError, match=r"a\.array_record.*chunk 1.*536870912"):
            read(src, path, 1)

    assert resident_growth(fails) < 64 << 20


@pytest.mark.parametrize("path", PATHS)
def test_a_zstd_chunk_over_max_chunk_bytes_is_refused_on_every_path(tmp_path, path):
    """Honest chunks, one of them larger than the ceiling the reader was given."""
    record = os.urandom(3000)
    d = ar_dir(tmp_path, R.Chunk([record], "zstd"))
    src = ar_source(d, path, max_chunk_bytes=2000)
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*max_chunk_bytes=2000"):
        read(src, path, 1)
    assert src[0]["bytes"] == b"\x00" * 20
    assert ar_source(d, path)[1]["bytes"] == record  # a larger ceiling reads it


@pytest.mark.parametrize("path", ["item", "batch", "joint_batch", "columns", "remote_item"])
def test_a_zstd_frame_that_claims_a_tib_ends_in_a_named_error(tmp_path, path):
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"y" * 25)
    claim = b"\x28\xb5\x2f\xfd\xe0" + struct.pack("<Q", 1 << 40) + frame[6:]
    bad = R.Chunk([b"y" * 25], "zstd", values_buffer=R.varint(25) + claim)
    src = ar_source(ar_dir(tmp_path, bad), path)
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*chunk 1.*1099511627776"):
        read(src, path, 1)


@pytest.mark.parametrize("path", ["batch", "joint_batch", "columns", "large_records"])
def test_a_zstd_frame_that_holds_a_gib_in_a_small_chunk_is_never_inflated(tmp_path, path):
    """A 32 KiB frame that really holds 1 GiB, in a chunk that declares 25 bytes: the
    batch path must not decompress it to find out (also among records large enough that
    the batch's frames are made one at a time)."""
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 30))
    bad = R.Chunk([b"y" * 25], "zstd", values_buffer=R.varint(25) + bomb)
    if path == "large_records":
        d = tmp_path / "large"
        d.mkdir()
        big = [R.Chunk([os.urandom(100_000)], "zstd") for _ in range(24)]
        R.write(str(d / "a.array_record"), [*big[:12], bad, *big[12:]])
        src = tg.ArrayRecordSource(str(d), codec="raw")
        path = "batch"
        k = 12
    else:
        src = ar_source(ar_dir(tmp_path, bad), path)
        k = 1
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError, match=r"a\.array_record.*chunk"):
            read(src, path, k)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


@pytest.mark.parametrize("path", PATHS)
def test_a_flipped_byte_in_a_chunk_fails_verify_checksums(tmp_path, path):
    d = ar_dir(tmp_path, R.Chunk([b"z" * 40], "none"), compression="none")
    file = os.path.join(d, "a.array_record")
    data = bytearray(Path(file).read_bytes())
    at = data.index(b"z" * 40) + 7
    data[at] ^= 0x01
    Path(file).write_bytes(bytes(data))
    src = ar_source(d, path, verify_checksums=True)
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*chunk 1.*fails its checksum"):
        read(src, path, 1)
    # Unverified, the flipped byte comes through: the check is what stops it.
    assert ar_source(d, path)[1]["bytes"] != b"z" * 40


def test_a_flipped_byte_in_a_chunk_header_fails_verify_checksums(tmp_path):
    d = ar_dir(tmp_path, R.Chunk([b"z" * 40], "none"), compression="none")
    file = os.path.join(d, "a.array_record")
    data = bytearray(Path(file).read_bytes())
    at = data.index(b"z" * 40) - 2 - 1 - 40 + 30  # a padding-free byte of the header's type field
    data[at] ^= 0x01
    Path(file).write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*checksum"):
        tg.ArrayRecordSource(d, codec="raw", verify_checksums=True)[1]


# ================================================================== column batches
def ndarray_ext(dtype: str, shape: tuple[int, ...], payload: bytes) -> msgpack.ExtType:
    dt = dtype.encode()
    head = struct.pack(f"<B{len(dt)}sB{len(shape)}Q", len(dt), dt, len(shape), *shape)
    return msgpack.ExtType(1, head + payload)


def msgpack_shard(tmp_path, values: list) -> str:
    from array_record.python.array_record_module import ArrayRecordWriter

    d = tmp_path / "mp"
    d.mkdir()
    w = ArrayRecordWriter(str(d / "a.array_record"), "group_size:1")
    for v in values:
        w.write(msgpack.packb({"x": v, "i": 1}, use_bin_type=True))
    w.close()
    return str(d)


def columns_through_a_dataloader(d: str) -> list:
    ds = tg.Dataset(tg.ArrayRecordSource(d, codec="msgpack"), batch_format="columns")
    return list(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=0))


def test_array_shapes_that_overflow_int64_never_reach_a_column_batch(tmp_path):
    """8-byte items, 2**61 + 1 of them, in 8 bytes: the count times the item size wraps
    to 8 in int64. The record path refuses it; so must the columns path."""
    d = msgpack_shard(
        tmp_path,
        [ndarray_ext("<i8", (2**61 + 1,), bytes(8)), ndarray_ext("<i8", (1,), bytes(8))] * 2,
    )
    with pytest.raises(RecordDecodeError, match=r"a\.array_record.*does not match shape"):
        tg.ArrayRecordSource(d, codec="msgpack").read_columns([0, 1, 2, 3])
    with pytest.raises(RecordDecodeError, match=r"a\.array_record"):
        columns_through_a_dataloader(d)


def test_arrays_numpy_cannot_stack_become_a_list_column(tmp_path):
    """Empty arrays of shape (0, 2**62) are valid records, but four of them do not
    stack (numpy's size limit): a list column, as from the records."""
    d = msgpack_shard(tmp_path, [ndarray_ext("|u1", (0, 2**62), b"")] * 4)
    src = tg.ArrayRecordSource(d, codec="msgpack")
    col = src.read_columns([0, 1, 2, 3])["x"]
    assert isinstance(col, list) and [a.shape for a in col] == [(0, 2**62)] * 4


def test_strings_that_are_not_utf8_never_reach_a_column_batch(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    d = tmp_path / "u"
    d.mkdir()
    w = ArrayRecordWriter(str(d / "a.array_record"), "group_size:1")
    good = msgpack.packb({"s": "é", "i": 1})
    for _ in range(3):
        w.write(good)
    w.write(good.replace("é".encode(), b"\xc3\x28"))  # an invalid continuation byte
    w.close()
    with pytest.raises(RecordDecodeError, match=r"a\.array_record.*utf-8"):
        tg.ArrayRecordSource(str(d), codec="msgpack").read_columns([0, 1, 2, 3])


def test_a_character_split_between_two_strings_never_reaches_a_column_batch(tmp_path):
    """Records 1 and 2 hold the two halves of "é": each string is invalid UTF-8, though
    the column's bytes, end to end, are not."""
    from array_record.python.array_record_module import ArrayRecordWriter

    d = tmp_path / "u"
    d.mkdir()
    w = ArrayRecordWriter(str(d / "a.array_record"), "group_size:1")
    for s in (b"ab", b"\xc3", b"\xa9", b"cd"):
        w.write(b"\x81\xa1s" + bytes([0xA0 | len(s)]) + s)  # {"s": a str of these bytes}
    w.close()
    with pytest.raises(RecordDecodeError, match=r"record 1 .*a\.array_record.*utf-8"):
        tg.ArrayRecordSource(str(d), codec="msgpack").read_columns([0, 1, 2, 3])


# ================================================================== TFDS tensors
def test_a_zlib_tensor_that_inflates_past_its_shape_is_refused_in_bounded_memory():
    import zlib

    from torchgrain.formats.tf_example import encode_tf_example
    from torchgrain.formats.tfds import TFDSCodec

    spec = {
        "featuresDict": {
            "features": {
                "t": {
                    "tensor": {
                        "shape": {"dimensions": ["4"]},
                        "dtype": "float32",
                        "encoding": "zlib",
                    }
                }
            }
        }
    }
    bomb = zlib.compress(bytes(256 << 20), 1)
    codec = TFDSCodec(spec)
    ok = codec.decode(
        encode_tf_example({"t": [zlib.compress(np.arange(4, dtype=np.float32).tobytes())]})
    )
    assert ok["t"].tolist() == [0.0, 1.0, 2.0, 3.0]
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="inflates to more than its 16 bytes"):
            codec.decode(encode_tf_example({"t": [bomb]}))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20


def test_several_zlib_blobs_of_one_tensor_share_its_bound():
    """Eight blobs, each inflating to the whole tensor's 16 MiB: their sum is bounded by
    the tensor, not each of them (which would inflate 128 MiB before the shape check)."""
    import zlib

    from torchgrain.formats.tf_example import encode_tf_example
    from torchgrain.formats.tfds import TFDSCodec

    size = 16 << 20
    spec = {
        "featuresDict": {
            "features": {
                "t": {
                    "tensor": {
                        "shape": {"dimensions": [str(size)]},
                        "dtype": "uint8",
                        "encoding": "zlib",
                    }
                }
            }
        }
    }
    codec = TFDSCodec(spec)
    blob = zlib.compress(bytes(size), 1)
    assert codec.decode(encode_tf_example({"t": [blob]}))["t"].shape == (size,)
    data = encode_tf_example({"t": [blob] * 8})
    tracemalloc.start()
    try:
        with pytest.raises(RecordDecodeError, match="inflates to more than its 16777216 bytes"):
            codec.decode(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * size


@pytest.mark.parametrize("compression", ["zstd", "snappy", "snappy_preamble"])
def test_a_stream_too_short_for_the_size_it_declares_is_refused_before_allocating(
    tmp_path, compression
):
    """512 MiB declared (under the ceiling) by a stream of a few bytes, which neither
    zstd (32768x at most) nor snappy (22x) can hold (a snappy stream's own preamble
    may say so too)."""
    big = 512 << 20
    if compression == "zstd":
        stream = zstandard.ZstdCompressor(write_content_size=False).compress(b"abc")
    elif compression == "snappy":
        stream = R.stream("snappy", b"abc")
    else:
        compression = "snappy"
        stream = R.varint(big) + R.stream("snappy", b"abc")[1:]  # its preamble: 3 bytes
    bad = R.Chunk(
        [b"abc"],
        compression,
        values_buffer=R.varint(big) + stream,
        sizes=[big],
        decoded_size=big,
        footer_decoded=big,
    )
    src = tg.ArrayRecordSource(ar_dir(tmp_path, bad, compression=compression), codec="raw")
    tracemalloc.start()
    try:
        with pytest.raises(
            CorruptDataError, match=r"a\.array_record.*(cannot hold|snappy stream declares)"
        ):
            src[1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_a_chunk_that_claims_a_trillion_records_cannot_make_the_reader_allocate(tmp_path):
    """Header and footer agree on 2**40 records, and the sizes buffer claims 2**40 bytes:
    the ceiling refuses the sizes buffer before a byte is allocated for it."""
    n = 1 << 40
    sizes = R.varint(n) + R.stream("brotli", b"\x03")
    bad = R.Chunk([b"abc"], "brotli", sizes_buffer=sizes, num_records=n, footer_records=n)
    src = tg.ArrayRecordSource(ar_dir(tmp_path, bad, compression="brotli"), codec="raw")
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*max_chunk_bytes"):
        src[1]


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_postscript_pointing_far_back_is_refused_before_the_footer_is_fetched(tmp_path, where):
    """The postscript says the footer starts at the first data chunk, 300 KB back: a
    remote open would fetch the whole file as its "footer" (all of a file of gigabytes)."""
    d = tmp_path / "far"
    d.mkdir()
    chunks = [R.Chunk([os.urandom(3000)], "none") for _ in range(100)]
    R.write(str(d / "a.array_record"), chunks, postscript_footer_offset=64)
    path = to_memory(str(d), "far") if where == "remote" else str(d)
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*footer.*max_chunk_bytes=4096"):
        len(tg.ArrayRecordSource(path, codec="raw", max_chunk_bytes=4096))


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_footer_chunk_spanning_far_more_than_a_chunk_is_refused_at_open(tmp_path, where):
    """The footer lists the first and the last of 100 chunks: the first then spans 300 KB,
    which a remote read of its one small record would fetch whole."""
    d = tmp_path / "span"
    d.mkdir()
    chunks = [R.Chunk([bytes([k]) * 3000], "none") for k in range(100)]
    file = str(d / "a.array_record")
    R.write(file, chunks)
    offsets = ArrayRecordFile(file).chunk_offsets[[0, 99]].tolist()
    R.write(file, chunks, footer_offsets=offsets, num_chunks=2, num_records=2)
    path = to_memory(str(d), "span") if where == "remote" else str(d)
    with pytest.raises(
        CorruptDataError, match=r"a\.array_record.*chunk 0: it spans.*max_chunk_bytes=4096"
    ):
        len(tg.ArrayRecordSource(path, codec="raw", max_chunk_bytes=4096))
    assert tg.ArrayRecordSource(path, codec="raw")[1]["bytes"] == bytes([99]) * 3000


def test_footer_counts_whose_sum_wraps_around_are_refused_at_open(tmp_path):
    """512 chunks each claiming 2**55 records add up to 2**64: 0 in int64. With the real
    count of the last chunk, the wrapped sum matches the metadata's 1 record."""
    chunks = [R.Chunk([b"a"], "none", footer_records=1 << 55) for _ in range(512)]
    chunks.append(R.Chunk([b"b"], "none"))
    d = tmp_path / "wrap"
    d.mkdir()
    R.write(str(d / "a.array_record"), chunks, num_records=1)
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*footer entries"):
        len(tg.ArrayRecordSource(str(d), codec="raw"))


def test_the_columns_decoder_leaves_unstackable_and_itemless_arrays_to_the_records():
    from torchgrain.formats.msgpack_columns import decode_columns

    def batch(values):
        recs = [msgpack.packb({"x": v}) for v in values]
        ends = np.cumsum([len(r) for r in recs])
        return np.frombuffer(b"".join(recs), np.uint8), ends - [len(r) for r in recs], ends

    assert decode_columns(*batch([ndarray_ext("|u1", (0, 2**62), b"")] * 4)) is None
    # 2**61 + 1 items of 8 bytes "in" 8 bytes: the product wraps around in int64.
    wrap = [ndarray_ext("<i8", (2**61 + 1,), bytes(8)), ndarray_ext("<i8", (1,), bytes(8))]
    assert decode_columns(*batch(wrap)) is None
    # Items of 0 bytes: any count matches an empty payload (the record path refuses them).
    assert decode_columns(*batch([ndarray_ext("|V0", (5,), b"")] * 2)) is None
    assert (
        decode_columns(*batch([ndarray_ext("|V0", (5,), b""), ndarray_ext("|V0", (7,), b"")]))
        is None
    )
    ok = decode_columns(*batch([ndarray_ext("|u1", (2,), b"ab"), ndarray_ext("|u1", (1,), b"c")]))
    assert ok["x"].offsets.tolist() == [0, 2, 3]


def test_subarray_dtypes_are_left_to_the_records(tmp_path):
    """A dtype string such as "(1,)<i4" (no writer stores one: an array's dtype is never
    a subarray dtype) adds a dimension to any array made of it: the columns must be what
    the records give, and a ragged batch of them must not make the decoder fail."""
    from torchgrain.formats.msgpack_columns import decode_columns

    d = msgpack_shard(tmp_path, [ndarray_ext("(1,)<i4", (3,), bytes(range(12)))] * 4)
    src = tg.ArrayRecordSource(d, codec="msgpack")
    assert src[0]["x"].shape == (3,)
    assert src.read_columns([0, 1, 2, 3])["x"].shape == (4, 3)
    recs = [msgpack.packb({"x": ndarray_ext("(2,)<i4", (k,), bytes(8 * k))}) for k in (3, 2, 3, 1)]
    ends = np.cumsum([len(r) for r in recs])
    buf = np.frombuffer(b"".join(recs), np.uint8)
    assert decode_columns(buf, ends - [len(r) for r in recs], ends) is None


def test_a_batch_decoder_that_fails_falls_back_to_the_records(tmp_path, monkeypatch):
    from torchgrain.formats.codecs import MsgpackCodec

    d = tmp_path / "fb"
    tg.write_array_record([{"x": i, "s": str(i)} for i in range(6)], d)
    src = tg.ArrayRecordSource(str(d))

    def broken(self, buf, starts, ends):
        raise ValueError("a bug in a batch decoder")

    monkeypatch.setattr(MsgpackCodec, "decode_columns", broken)
    cols = src.read_columns([5, 0, 3])
    assert cols["x"].tolist() == [5, 0, 3] and cols["s"].tolist() == ["5", "0", "3"]


def test_unpacked_int64_lists_decode_in_memory_proportional_to_the_record():
    from torchgrain.formats.tf_example import decode_tf_example

    n = 100_000
    # A feature "v" holding n unpacked int64 values (tag 0x08 each), as old writers did.
    values = b"".join(b"\x08" + bytes([i % 100 + 1]) for i in range(n))
    feature = b"\x1a" + R.varint(len(values)) + values
    entry = b"\x0a\x01v" + b"\x12" + R.varint(len(feature)) + feature
    features = b"\x0a" + R.varint(len(entry)) + entry
    data = b"\x0a" + R.varint(len(features)) + features
    tracemalloc.start()
    try:
        out = decode_tf_example(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out["v"][:3].tolist() == [1, 2, 3] and len(out["v"]) == n
    assert peak < 30 * len(data)


# ================================================================== Parquet
def parquet_claiming(path: Path, rows: int, claim: int) -> None:
    """A Parquet file of ``rows`` rows (int64, string) whose footer claims ``claim`` rows
    wherever it counts them (see :func:`fuzz.claim_rows`)."""
    import io

    import fuzz
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(pa.table({"i": np.arange(rows), "s": [str(i) for i in range(rows)]}), sink)
    path.write_bytes(fuzz.claim_rows(sink.getvalue(), rows, claim))


def test_a_parquet_footer_claiming_billions_of_rows_is_refused_in_bounded_memory(tmp_path):
    """2**31 rows of (int64, string) need 24 GiB decoded, over the 16 GiB default: refused
    before pyarrow reserves memory for them (it touched ~0.5 GiB for nothing before)."""
    parquet_claiming(tmp_path / "a.parquet", 100, 1 << 31)
    src = tg.ParquetSource(str(tmp_path))
    assert len(src) == 1 << 31

    def fails() -> None:
        with pytest.raises(CorruptDataError, match=r"a\.parquet.*max_row_group_bytes=17179869184"):
            src[5]

    assert resident_growth(fails) < 64 << 20


@pytest.mark.parametrize("path", ["item", "batch", "columns", "in_order"])
def test_a_parquet_row_group_over_max_row_group_bytes_is_refused_on_every_path(tmp_path, path):
    """An honest row group of 100 rows of 12 bytes at least (an int64, a string's offset)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"i": np.arange(100), "s": [str(i) for i in range(100)]})
    pq.write_table(table, tmp_path / "a.parquet")
    pq.write_table(table.slice(0, 10), tmp_path / "b.parquet")
    src = tg.ParquetSource(str(tmp_path), max_row_group_bytes=1000)
    with pytest.raises(
        CorruptDataError, match=r"a\.parquet.*shard 0 of 2.*1200 bytes.*max_row_group_bytes=1000"
    ):
        read(src, path, 1)
    assert src[100]["i"] == 0  # b.parquet: 120 bytes
    assert tg.ParquetSource(str(tmp_path), max_row_group_bytes=1200)[1]["i"] == 1


def test_a_parquet_footer_whose_row_counts_disagree_is_refused_at_open(tmp_path):
    """Three row groups of 5 rows, and a footer that says the file holds 16."""
    import io

    import fuzz
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(pa.table({"i": np.arange(15)}), sink, row_group_size=5)
    (tmp_path / "a.parquet").write_bytes(fuzz.claim_rows(sink.getvalue(), 15, 16))
    with pytest.raises(CorruptDataError, match=r"a\.parquet.*shard 0 of 1.*says 16 rows"):
        tg.ParquetSource(str(tmp_path))


@pytest.mark.parametrize(
    ("fmt", "option"),
    [
        ("array_record", "max_chunk_bytes"),
        ("tfrecord", "max_record_bytes"),
        ("parquet", "max_row_group_bytes"),
    ],
)
@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (True, TypeError), ("1G", TypeError)]
)
def test_a_ceiling_option_is_checked_when_the_source_is_made(tmp_path, fmt, option, value, error):
    """Not when a first read opens a file (a dataset with a manifest opens none before)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if fmt == "array_record":
        tg.write_array_record([{"x": 1}], tmp_path)  # with its manifest
        make = tg.ArrayRecordSource
    elif fmt == "tfrecord":
        write_tfrecord([b"x"], str(tmp_path / "a.tfrecord"))
        make = tg.TFRecordSource
    else:
        pq.write_table(pa.table({"x": [1]}), tmp_path / "a.parquet")
        make = tg.ParquetSource
    with pytest.raises(error, match=option):
        make(str(tmp_path), **{option: value})


# ================================================================== TFDS images
def test_an_image_too_large_to_decode_is_a_record_decode_error():
    """A 280-byte PNG whose header says 20000 x 20000 pixels: Pillow refuses it (its
    decompression-bomb limit, ~179 M pixels), and the codec says so as a torchgrain
    error, not Pillow's own."""
    import zlib

    from torchgrain.formats.tf_example import encode_tf_example
    from torchgrain.formats.tfds import TFDSCodec

    pytest.importorskip("PIL")

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 0, 0, 0, 0)  # 8-bit grey
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0"))
    png += chunk(b"IEND", b"")
    spec = {
        "featuresDict": {
            "features": {
                "image": {"image": {"shape": {"dimensions": ["-1", "-1", "1"]}, "dtype": "uint8"}}
            }
        }
    }
    with pytest.raises(RecordDecodeError, match=r"'image'.*400000000 pixels"):
        TFDSCodec(spec).decode(encode_tf_example({"image": [png]}))
