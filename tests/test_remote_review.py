"""Review of the remote read path (multi-range bodies, decode as ranges arrive,
coalescing): faults found by reproduction against real 127.0.0.1 servers."""

from __future__ import annotations

import os

import pytest

import torchgrain as tg
from tests.servers import FaultProxy, RangeHTTPServer


def _fail_shard_2(tmp_path, fault: str, indices: list[int], error: type, **kw) -> tuple:
    """Read ``indices`` of 4 remote shards while shard 2 answers with ``fault``; the
    error raised (of type ``error``) and shard 2's file name."""
    recs = [{"i": i, "blob": bytes([i]) * 3000} for i in range(64)]
    d = tmp_path / "www" / "ds"
    tg.write_array_record(recs, d, num_shards=4)
    failing = sorted(n for n in os.listdir(d) if n.endswith(".array_record"))[2]
    with RangeHTTPServer(tmp_path / "www") as srv, FaultProxy(srv.url) as proxy:
        src = tg.ArrayRecordSource(f"{proxy.url}/ds", max_inflight=16)
        try:
            _ = [src[i] for i in (0, 16, 32, 48)]  # footers read before the fault
            proxy.inject(fault, times=None, match=failing, method="GET", **kw)
            with pytest.raises(error) as info:
                src.__getitems__(indices)
        finally:
            src.close()
    return info, failing


def test_a_batch_failing_on_one_shard_names_that_shard(tmp_path):
    info, failing = _fail_shard_2(
        tmp_path, "truncate", [5, 21, 37, 53, 6, 22, 38, 54], tg.RemoteIOError
    )
    assert failing in str(info.value), str(info.value)


def test_a_shard_answered_416_raises_a_torchgrain_error_naming_the_record(tmp_path):
    info, failing = _fail_shard_2(tmp_path, "status", [5, 21, 37, 53], tg.TorchgrainError, code=416)
    assert failing in str(info.value) and "37" in str(info.value), str(info.value)
