"""Read-ahead against a real HTTP server: once a pass has filled the shard cache, the next
pass asks the server nothing; and a shard read-ahead could not fetch is fetched, or its
error raised naming the file, by the read that needs it, never ending a pass by itself."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import torchgrain as tg
from docs.snippets.fixed_format import FixedSource, write_fixed
from tests.servers import FaultProxy, RangeHTTPServer
from tests.test_remote_audit_review import QUICK
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord

SHARDS, PER = 6, 20


def _write(kind: str, root) -> None:
    recs = [{"label": i} for i in range(SHARDS * PER)]
    if kind == "arrayrecord":
        tg.write_array_record(recs, str(root), num_shards=SHARDS)
    elif kind == "parquet":
        os.makedirs(root)
        for s in range(SHARDS):
            labels = list(range(s * PER, (s + 1) * PER))
            pq.write_table(pa.table({"label": labels}), root / f"p{s}.parquet")
    elif kind == "tfrecord":
        os.makedirs(root)
        for s in range(SHARDS):
            labels = range(s * PER, (s + 1) * PER)
            write_tfrecord(
                [encode_tf_example({"label": [i]}) for i in labels], root / f"t{s}.tfrecord"
            )
    else:
        write_fixed([{"v": str(r["label"])} for r in recs], str(root), num_shards=SHARDS)


def _open(kind: str, url: str, cache, **kw):
    if kind == "arrayrecord":
        return tg.ArrayRecordSource(url, cache_dir=cache, **kw)
    if kind == "parquet":
        return tg.ParquetSource(url, cache_dir=cache, **kw)
    if kind == "tfrecord":
        return tg.TFRecordSource(url, cache_dir=cache, index_dir=None, **kw)
    return FixedSource(url, cache_dir=cache, **kw)


def _labels(batch) -> list[int]:
    got = batch["label"] if "label" in batch else batch["v"]
    return [int(np.asarray(v).reshape(-1)[0]) for v in got]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["arrayrecord", "parquet", "fixed", "tfrecord"])
def test_a_pass_over_a_filled_shard_cache_asks_the_server_nothing(tmp_path, kind, workers):
    _write(kind, tmp_path / "www" / "ds")
    with RangeHTTPServer(tmp_path / "www") as srv:
        src = _open(kind, f"{srv.url}/ds", tmp_path / "cache")
        assert src.read_ahead_bytes > 0
        ds = tg.Dataset(src)
        sampler = tg.GlobalShuffleSampler(ds, seed=3)
        loader = torch.utils.data.DataLoader(
            ds, batch_size=16, sampler=sampler, num_workers=workers
        )
        passes = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            passes.append(sorted(v for b in loader for v in _labels(b)))
            if src._proc().read_ahead is not None:
                assert src._proc().read_ahead.join(timeout=30)
            if epoch == 0:
                srv.reset_counts()
        assert passes == [list(range(SHARDS * PER))] * 2
        assert dict(srv.requests) == {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["arrayrecord", "parquet", "fixed", "tfrecord"])
def test_a_shard_read_ahead_could_not_fetch_is_fetched_by_its_read(tmp_path, kind):
    _write(kind, tmp_path / "www" / "ds")
    names = sorted(os.listdir(tmp_path / "www" / "ds"))
    shards = [n for n in names if not n.startswith((".", "_")) and "manifest" not in n]
    with RangeHTTPServer(tmp_path / "www") as srv, FaultProxy(srv.url) as proxy:
        src = _open(kind, f"{proxy.url}/ds", tmp_path / "cache", retry=QUICK)
        assert src.num_shards == SHARDS
        third = sorted(shards)[2]
        assert third in src.paths[2], (third, src.paths[2])
        # Every request for the third shard fails while read-ahead walks the pass.
        proxy.inject("status", times=None, match=f"/ds/{third}", code=503)
        src.read_ahead(lambda a, b: np.arange(a, b), 0, len(src), lambda: 0)
        ra = src._proc().read_ahead
        assert ra.join(timeout=60)
        assert ra.fetched == SHARDS - 1  # the walk went past the shard it could not fetch
        # A read of it while the server still fails names the file; the others read.
        with pytest.raises(Exception) as e:
            src.__getitems__([2 * PER + 1])
        assert third in str(e.value)
        assert _labels(_batch(src.__getitems__([0, 5 * PER]))) == [0, 5 * PER]
        # Once the server answers again, its read fetches it: nothing lost or skipped.
        proxy.clear()
        assert _labels(_batch(src.__getitems__(list(range(SHARDS * PER))))) == list(
            range(SHARDS * PER)
        )


def _batch(records: list[dict]) -> dict[str, list]:
    return {k: [r[k] for r in records] for k in records[0]}


@pytest.mark.timeout(120)
def test_a_pass_starts_whose_shard_size_the_server_will_not_tell(tmp_path):
    """Shards named one by one (no manifest: sizes asked of the server at a pass's start,
    to check it fits the cache): a shard whose size lookup fails is the error of its read,
    not of the pass's start."""
    _write("arrayrecord", tmp_path / "www" / "ds")
    names = sorted(n for n in os.listdir(tmp_path / "www" / "ds") if "array_record" in n)
    with RangeHTTPServer(tmp_path / "www") as srv, FaultProxy(srv.url) as proxy:
        urls = [f"{proxy.url}/ds/{n}" for n in names]
        src = tg.ArrayRecordSource(urls, cache_dir=tmp_path / "cache", retry=QUICK)
        proxy.inject("status", times=None, match=f"/ds/{names[2]}", code=503)
        src.read_ahead(lambda a, b: np.arange(a, b), 0, len(src), lambda: 0)
        assert src._proc().read_ahead.join(timeout=60)
        with pytest.raises(Exception) as e:
            src.__getitems__([2 * PER + 1])
        assert names[2] in str(e.value)
        proxy.clear()
        assert _labels(_batch(src.__getitems__(list(range(SHARDS * PER))))) == list(
            range(SHARDS * PER)
        )
