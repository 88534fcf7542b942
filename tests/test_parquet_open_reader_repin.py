"""A remote Parquet source's reader kept open (it read row group 0) while its file is
replaced on the server by one of the same size and another opening pins the new
version: its read of a row group it has not fetched yet must refuse the new bytes, not
decode them at the old footer's offsets."""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_remote_audit_review import QUICK

_ROWS = 600_000  # a row group of 4.8 MB, past one request's read-ahead (REMOTE_BUFFER)


def _write(path, first: int) -> None:
    # Uncompressed plain int64: another version of the file has the same size and layout.
    t = pa.table({"x": np.arange(first, first + 2 * _ROWS, dtype=np.int64)})
    pq.write_table(t, path, compression="none", use_dictionary=False, row_group_size=_ROWS)


@pytest.mark.timeout(60)
def test_an_open_parquet_reader_refuses_a_version_a_later_opening_pinned(tmp_path):
    (tmp_path / "www").mkdir()
    path = tmp_path / "www" / "a.parquet"
    _write(path, 0)
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/a.parquet"
        first = tg.ParquetSource(url, retry=QUICK, cache_bytes=0)
        assert first[1] == {"x": 1}  # row group 0 read, the reader kept open
        size = path.stat().st_size
        _write(path, 10_000_000)
        later = time.time() + 100
        os.utime(path, (later, later))
        assert path.stat().st_size == size
        assert tg.ParquetSource(url, retry=QUICK, cache_bytes=0)[1] == {"x": 10_000_001}
        with pytest.raises(tg.RemoteIOError, match="changed") as e:
            pytest.fail(f"read the new file at the old opening: {first[_ROWS + 1]}")
        assert "a.parquet" in str(e.value)
