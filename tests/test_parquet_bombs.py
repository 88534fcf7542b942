"""Parquet pages that inflate past ``max_row_group_bytes`` are refused before they are
inflated, from their page headers (which bound what Arrow's decompressors may write), in
bounded memory; the error names the file, row group and column. Honest files of every
codec still read."""

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
from torchgrain.errors import CorruptDataError
from torchgrain.formats.parquet_pages import page_header

MiB = 1 << 20
BOMB = 128 * MiB  # what the bombs inflate to (a few KiB in the file)
CODECS = ["zstd", "gzip", "snappy", "lz4", "brotli"]


def _varint(value: int, width: int) -> bytes:
    """``value`` as a varint of exactly ``width`` bytes (padded: Thrift reads those)."""
    out = bytearray()
    for i in range(width):
        out.append((value & 0x7F) | (0x80 if i < width - 1 else 0))
        value >>= 7
    assert value == 0
    return bytes(out)


def _replace_varint(data: bytearray, lo: int, hi: int, old: int, new: int) -> None:
    """Replace the one Thrift varint of the zigzag of ``old`` in ``data[lo:hi]`` by that
    of ``new``, keeping its length (no offset in the file moves)."""
    enc = bytearray()
    v = old * 2
    while True:
        enc.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            break
    at = data.find(bytes(enc), lo, hi)
    assert at >= 0 and data.find(bytes(enc), at + 1, hi) < 0, "not found once"
    data[at : at + len(enc)] = _varint(new * 2, len(enc))


def _bomb(path, kind: str) -> None:
    """A file whose one row group has few rows, an honest footer (or one that
    understates its sizes), and pages that inflate to BOMB bytes of zeros."""
    if kind == "list":  # one row holding BOMB / 8 int64 zeros, in 1 MiB pages
        table = pa.table({"n": [1], "b": pa.array([np.zeros(BOMB // 8)], pa.list_(pa.int64()))})
    else:  # one row holding one value of BOMB zero bytes: one page
        table = pa.table({"n": [1], "b": pa.array([bytes(BOMB)], pa.binary())})
    pq.write_table(table, path, compression="zstd", use_dictionary=False)
    assert os.path.getsize(path) < 64 << 10
    if kind == "footer_lies":  # the footer says the row group and its chunk are small
        data = bytearray(path.read_bytes())
        footer_len = int.from_bytes(data[-8:-4], "little")
        lo, hi = len(data) - 8 - footer_len, len(data) - 8
        meta = pq.ParquetFile(path).metadata.row_group(0)
        _replace_varint(data, lo, hi, meta.column(1).total_uncompressed_size, 10)
        _replace_varint(data, lo, hi, meta.total_byte_size, 20)
        path.write_bytes(bytes(data))
        assert pq.ParquetFile(path).metadata.row_group(0).total_byte_size == 20


# Runs in a child: the memory a read takes is its peak RSS beyond the RSS before (the
# kernel's peak, VmHWM, is reset first: imports peak higher than a small read).
_CHILD = textwrap.dedent(
    """
    import json, sys
    import torchgrain as tg

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])

    src = tg.ParquetSource(sys.argv[1], max_row_group_bytes=int(sys.argv[2]), decoded_cache=False)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    try:
        src[0]
        outcome = "read"
    except Exception as e:
        outcome = type(e).__name__ + ": " + str(e)
    print(json.dumps({"outcome": outcome, "grew_kib": status("VmHWM") - before}))
    """
)


def _read_in_child(path, ceiling: int) -> dict:
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(ceiling)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["one_page", "list", "footer_lies"])
def test_a_page_that_inflates_past_the_ceiling_is_refused_before_inflating(tmp_path, kind):
    path = tmp_path / "bomb.parquet"
    _bomb(path, kind)
    got = _read_in_child(path, MiB)
    assert got["outcome"].startswith("CorruptDataError"), got
    assert "bomb.parquet" in got["outcome"] and "row group 0" in got["outcome"], got
    assert "column 'b" in got["outcome"] and "max_row_group_bytes=1048576" in got["outcome"]
    assert got["grew_kib"] < 48 * 1024, got  # the bomb would take 128 MiB


def test_a_larger_ceiling_reads_the_same_file(tmp_path):
    path = tmp_path / "bomb.parquet"
    _bomb(path, "one_page")
    src = tg.ParquetSource(str(path), max_row_group_bytes=BOMB + MiB, decoded_cache=False)
    assert src[0]["b"] == bytes(BOMB)


def _understated(path, codec: str, version: str) -> None:
    """Two columns; the data page of ``b`` says it inflates to 1,000 bytes fewer than
    it does (the varint keeps its length)."""
    value = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    table = pa.table({"a": [1], "b": [value + bytes(300_000)]})
    pq.write_table(table, path, compression=codec, use_dictionary=False, data_page_version=version)
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(0).column(1).data_page_offset
    header = page_header(bytes(data[start : start + 256]))
    end = start + header.header_size
    _replace_varint(data, start, end, header.uncompressed_size, header.uncompressed_size - 1000)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("version", ["1.0", "2.0"])
@pytest.mark.parametrize("codec", CODECS)
def test_a_page_that_inflates_past_its_header_is_refused_by_arrow(tmp_path, codec, version):
    """Arrow inflates into a buffer of the declared size and refuses a page that needs
    more, for every codec: the headers bound what decoding allocates."""
    path = tmp_path / f"{codec}.parquet"
    _understated(path, codec, version)
    src = tg.ParquetSource(str(path), decoded_cache=False)
    with pytest.raises(CorruptDataError, match=rf"row group 0 of .*{codec}\.parquet.*column 'b'"):
        src[0]


def test_a_header_that_is_not_one_is_refused_naming_the_column(tmp_path):
    path = tmp_path / "h.parquet"
    pq.write_table(pa.table({"a": [1, 2], "b": ["x", "y"]}), path)
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(0).column(1).data_page_offset
    data[start] = 0x1D  # field 1 as type 13 (no such Thrift type)
    meta = pq.ParquetFile(path).metadata.row_group(0).column(1)
    if meta.has_dictionary_page:
        data[meta.dictionary_page_offset] = 0x1D
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match=r"row group 0 of .*h\.parquet.*column 'b'"):
        tg.ParquetSource(str(path), decoded_cache=False)[0]


@pytest.mark.parametrize("version", ["1.0", "2.0"])
@pytest.mark.parametrize("codec", [*CODECS, "none"])
def test_honest_files_of_every_codec_read_under_a_ceiling_they_fit(tmp_path, codec, version):
    rng = np.random.default_rng(1)
    n = 3000
    table = pa.table(
        {
            "i": np.arange(n),
            "s": [f"row {i}" * (i % 7) for i in range(n)],
            "l": pa.array([rng.random(i % 5) for i in range(n)], pa.list_(pa.float64())),
            "t": pa.array([{"x": i, "y": [i, None]} for i in range(n)]),
        }
    )
    pq.write_table(
        table,
        tmp_path / "a.parquet",
        compression=codec,
        data_page_version=version,
        row_group_size=1000,
        data_page_size=4096,  # several pages a chunk
    )
    # Each row group decodes to about 80 KB: a ceiling of 256 KiB reads them.
    src = tg.ParquetSource(str(tmp_path), max_row_group_bytes=256 << 10, decoded_cache=False)
    got = src.__getitems__(list(range(0, n, 7)))
    want = table.take(list(range(0, n, 7))).to_pylist()
    for g, w in zip(got, want):
        assert g["i"] == w["i"] and g["s"] == w["s"] and g["t"]["x"] == w["t"]["x"]
        assert list(g["l"]) == w["l"]


def test_a_remote_file_is_checked_from_the_bytes_arrow_decodes(tmp_path):
    """Over HTTP, the column chunks are fetched once for the check and the decode, with
    a read-ahead that serves the next row groups of a small file (as before)."""
    from tests.servers import RangeHTTPServer

    table = pa.table({"i": np.arange(4000), "s": [str(i) for i in range(4000)]})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=1000)
    _bomb(tmp_path / "bomb.parquet", "one_page")
    with RangeHTTPServer(str(tmp_path)) as srv:
        src = tg.ParquetSource(
            srv.url + "/a.parquet", max_row_group_bytes=1 << 20, decoded_cache=False
        )
        assert src[5]["i"] == 5
        srv.reset_counts()
        assert [r["i"] for r in src.__getitems__([1500, 3999])] == [1500, 3999]
        assert srv.gets() == 0
        # One column of three, in row groups bigger than the read-ahead.
        big = pa.table({"a": np.arange(600_000), "s": [str(i % 10) for i in range(600_000)]})
        big = big.append_column("b", pa.array(np.random.default_rng(0).random(600_000)))
        pq.write_table(big, tmp_path / "big.parquet", row_group_size=300_000, compression="none")
        src = tg.ParquetSource(srv.url + "/big.parquet", columns=["b"], decoded_cache=False)
        assert src.__getitems__([1, 299_999, 300_000, 599_999]) == [
            {"b": big["b"][i].as_py()} for i in (1, 299_999, 300_000, 599_999)
        ]
        bomb = tg.ParquetSource(
            srv.url + "/bomb.parquet", max_row_group_bytes=1 << 20, decoded_cache=False
        )
        with pytest.raises(CorruptDataError, match=r"row group 0 of .*bomb\.parquet.*column 'b'"):
            bomb[0]


def test_a_footer_that_aborts_pyarrows_column_metadata_is_refused_not_fatal(tmp_path):
    # A fuzzed file (tests/fuzz_corpus/parquet): its boolean column's size statistics
    # make pyarrow's RowGroupMetaData.column throw a C++ exception it does not catch,
    # which aborted the process opening it with columns=[...].
    import base64
    import zlib

    case = os.path.join(os.path.dirname(__file__), "fuzz_corpus", "parquet")
    with open(os.path.join(case, "a64bf79ba2cf1271.json")) as f:
        data = zlib.decompress(base64.b64decode(json.load(f)["data_z"]))
    path = tmp_path / "a.parquet"
    path.write_bytes(data)
    code = textwrap.dedent(
        f"""
        import torchgrain as tg
        try:
            src = tg.ParquetSource({str(path)!r}, columns=["s"])
            src[0]
        except tg.CorruptDataError as e:
            print("refused:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and "a.parquet" in out.stdout
