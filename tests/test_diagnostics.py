import logging

import numpy as np
import torch
from torch.utils.data import DataLoader

import torchgrain as tg


def slow_identity(rec):
    return rec


def test_stats_per_worker_and_totals(small_dataset):
    d, _ = small_dataset
    ds = tg.Dataset(tg.ArrayRecordSource(d)).map(slow_identity)
    loader = DataLoader(ds, batch_size=10, num_workers=2, persistent_workers=True)
    for _ in range(2):
        for _ in tg.timed(loader):
            pass
    rep = tg.stats(loader)
    assert set(rep.workers) == {"worker 0", "worker 1"}
    assert rep.total["records"] == 200 and rep.total["batches"] == 20
    assert rep.total["bytes_read"] > 200 * 48
    assert rep.total["read_seconds"] > 0 and rep.total["decode_seconds"] > 0
    assert rep.consumer["batches"] == 20
    assert "worker 1" in str(rep) and "consumer waited" in str(rep)
    rep = tg.stats(loader, reset=True)
    assert tg.stats(loader).total["records"] == 0


def test_timed_reports_wait_fraction_and_logs(small_dataset, caplog):
    d, _ = small_dataset
    ds = tg.Dataset(tg.ArrayRecordSource(d))
    it = tg.timed(DataLoader(ds, batch_size=25), log_every=2)
    with caplog.at_level(logging.INFO, logger="torchgrain"):
        n = sum(1 for _ in it)
    assert n == len(it) == 4
    rep = tg.stats(it)
    assert rep.wait_fraction is not None and 0 < rep.wait_fraction <= 1
    assert any("consumer wait" in r.message for r in caplog.records)


def test_stats_for_foreign_sources_and_errors():
    ds = tg.Dataset([{"x": np.zeros(2)} for _ in range(6)])
    list(DataLoader(ds, batch_size=3))
    assert tg.stats(ds).total["records"] == 6
    try:
        tg.stats(torch.nn.Linear(1, 1))
    except TypeError as e:
        assert "not a torchgrain Dataset" in str(e)
    else:
        raise AssertionError("expected TypeError")


def test_pickled_or_copied_dataset_still_reads_and_counts():
    # Pickled outside a worker start-up (deepcopy, pickle), the stats table becomes
    # a private one: reads must still work and be counted there.
    import copy
    import pickle

    ds = tg.Dataset(list(range(10))).map(lambda r: r + 1)
    ds.set_epoch(2)
    for clone in (copy.deepcopy(ds), pickle.loads(pickle.dumps(tg.Dataset(list(range(10)))))):
        assert clone[3] in (3, 4) and clone.__getitems__([1, 2]) in ([1, 2], [2, 3])
        assert tg.stats(clone).total["records"] == 3
    assert tg.stats(ds).total["records"] == 0


def test_timed_loop_left_early_still_reports_its_wall_time():
    ds = tg.Dataset(list(range(40)))
    it = tg.timed(DataLoader(ds, batch_size=4))
    for step, _ in enumerate(it):
        if step == 2:
            break
    rep = tg.stats(it)
    assert rep.consumer["batches"] == 3
    assert it.wall_seconds > 0 and rep.wait_fraction is not None


def test_parquet_cache_hits_and_misses_reach_stats(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": list(range(100))}), tmp_path / "a.parquet", row_group_size=10)
    ds = tg.Dataset(tg.ParquetSource(tmp_path))
    for _batch in DataLoader(ds, batch_size=5, num_workers=0):
        pass
    total = tg.stats(ds).total
    assert total["cache_misses"] == 10 and total["cache_hits"] == 10  # 2 batches per group
    assert total["bytes_read"] > 0 and total["records"] == 100
