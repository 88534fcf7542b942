"""The gzip and zlib streams of a compressed TFRecord file are readable file objects."""

from __future__ import annotations

import gzip
import io
import zlib

import pytest

from torchgrain.formats.tfrecord import _GzipStream, _ZlibStream


@pytest.mark.parametrize(
    ("stream", "compress"), [(_ZlibStream, zlib.compress), (_GzipStream, gzip.compress)]
)
def test_a_decompressed_stream_is_readable_through_io_wrappers(stream, compress):
    raw = stream(io.BytesIO(compress(b"ab\ncd\n" * 100)), "x.tfrecord")
    assert raw.readable()
    assert io.TextIOWrapper(raw, encoding="ascii").readlines()[-1] == "cd\n"
