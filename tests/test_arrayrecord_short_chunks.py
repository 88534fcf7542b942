"""Hostile ArrayRecord footers whose chunks are too short for a chunk header."""

from __future__ import annotations

import _riegeli as R
import pytest

from torchgrain.errors import CorruptDataError
from torchgrain.formats.arrayrecord_file import ArrayRecordFile
from torchgrain.sources.block_cache import BlockCache


def test_a_chunk_shorter_than_its_header_read_through_the_chunk_cache_is_corrupt(tmp_path):
    """The footer puts chunk 1 20 bytes after chunk 0: the chunk cache's pread of chunk 0
    holds 20 bytes, fewer than a chunk header's 40."""
    file = str(tmp_path / "a.array_record")
    chunks = [R.Chunk([b"ab", b"cd"], "none") for _ in range(3)]
    R.write(file, chunks, writer_options="")
    offs = ArrayRecordFile(file).chunk_offsets.tolist()
    R.write(file, chunks, footer_offsets=[offs[0], offs[0] + 20, offs[2]], writer_options="")
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*chunk 0, record 0.*truncated"):
        ArrayRecordFile(file).read([0, 1], chunk_cache=BlockCache(1 << 20), cache_key="k")
    assert ArrayRecordFile(file).read([4, 5]) == [b"ab", b"cd"]
