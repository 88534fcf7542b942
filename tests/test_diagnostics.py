import gc
import logging

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import torchgrain as tg


def slow_identity(rec):
    return rec


def plus_one(rec):
    return rec + 1


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

    ds = tg.Dataset(list(range(10))).map(plus_one)
    ds.set_epoch(2)
    for clone in (copy.deepcopy(ds), pickle.loads(pickle.dumps(ds))):
        # the clone keeps its .map(): a copy that dropped it would give 3 and [1, 2]
        assert clone[3] == 4 and clone.__getitems__([1, 2]) == [2, 3]
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


# ----------------------------------------------------------- several loaders, one Dataset


@pytest.fixture
def shared_dataset(tmp_path):
    """One Dataset over 64 ArrayRecord records, to be read by several loaders at once."""
    tg.write_array_record([{"x": np.full(2, i, np.float32)} for i in range(64)], tmp_path)
    return tg.Dataset(tg.ArrayRecordSource(tmp_path))


def read_interleaved(*feeds):
    """One batch of each feed in turn until all are done; how many batches each gave."""
    iters = [iter(f) for f in feeds]
    counts = [0] * len(feeds)
    live = list(range(len(feeds)))
    while live:
        for k in list(live):
            if next(iters[k], None) is None:
                live.remove(k)
            else:
                counts[k] += 1
    return counts


@pytest.mark.parametrize(
    ("num_workers", "context"),
    # Spawned workers take seconds to start (each imports torch): one per loader.
    [(0, None), (2, "fork"), pytest.param(1, "spawn", marks=pytest.mark.slow)],
    ids=["main", "fork", "spawn"],
)
def test_each_loader_reports_only_what_it_read(shared_dataset, num_workers, context):
    ds = shared_dataset
    kw = {"num_workers": num_workers, "multiprocessing_context": context}
    a = DataLoader(ds, batch_size=4, sampler=range(40), **kw)  # 10 batches
    b = DataLoader(ds, batch_size=4, sampler=range(24, 48), **kw)  # 6 batches
    ta, tb = tg.timed(a), tg.timed(b)
    assert read_interleaved(ta, tb) == [10, 6]
    # Worker 0 of each loader read for its loader alone.
    rows = {"main"} if num_workers == 0 else {f"worker {i}" for i in range(num_workers)}
    for feed, loader, records, batches in ((ta, a, 40, 10), (tb, b, 24, 6)):
        for obj in (loader, feed):
            rep = tg.stats(obj)
            assert rep.total["records"] == records and rep.total["batches"] == batches
            assert set(rep.workers) == rows
            assert rep.consumer["batches"] == batches
    total = tg.stats(ds)
    assert total.total["records"] == 64 and total.consumer["batches"] == 16
    assert set(total.workers) == rows


def test_persistent_workers_and_resumable_loaders_count_apart(shared_dataset):
    ds = shared_dataset

    def resumable(n, **kw):
        sampler = tg.GlobalShuffleSampler(range(n), num_replicas=1, rank=0, seed=n)
        return tg.ResumableLoader(DataLoader(ds, batch_size=4, sampler=sampler, **kw))

    a = resumable(32, num_workers=2, persistent_workers=True, multiprocessing_context="fork")
    b = resumable(12)  # read by the main process, between a's batches
    for _epoch in range(3):
        assert read_interleaved(tg.timed(a), tg.timed(b)) == [8, 3]
    rep_a, rep_b = tg.stats(a), tg.stats(b)
    assert rep_a.total["records"] == 96 and set(rep_a.workers) == {"worker 0", "worker 1"}
    assert rep_b.total["records"] == 36 and set(rep_b.workers) == {"main"}
    assert (rep_a.consumer["batches"], rep_b.consumer["batches"]) == (24, 9)
    assert tg.stats(a.loader).total["records"] == 96  # the loader itself, unwrapped
    assert tg.stats(ds).total["records"] == 132
    # Resetting one loader leaves the other's counts alone.
    tg.stats(a, reset=True)
    assert tg.stats(a).total["records"] == 0 and tg.stats(b).total["records"] == 36
    assert tg.stats(ds).total["records"] == 36


def test_a_loader_that_is_gone_frees_its_slot_and_stays_in_the_total(shared_dataset):
    ds = shared_dataset
    for n in (8, 4, 8):  # a new loader may get the id of one freed before it
        loader = DataLoader(ds, batch_size=4, sampler=range(n))
        assert tg.stats(loader).total["records"] == 0
        list(loader)
        assert tg.stats(loader).total["records"] == n
        del loader
        gc.collect()
    assert tg.stats(ds).total["records"] == 20
    # More loaders at once than slots: the last ones share one, nothing is lost.
    loaders = [DataLoader(ds, batch_size=1, sampler=range(k + 1)) for k in range(10)]
    for loader in loaders:
        list(loader)
    got = [tg.stats(loader).total["records"] for loader in loaders]
    assert got[:7] == [1, 2, 3, 4, 5, 6, 7] and got[7:] == [8 + 9 + 10] * 3
    assert tg.stats(ds).total["records"] == 20 + 55


def test_reads_outside_a_loader_count_for_the_dataset_only(shared_dataset):
    ds = shared_dataset
    loader = DataLoader(torch.utils.data.Subset(ds, range(6)), batch_size=3)
    list(loader)
    ds[0], ds.__getitems__([1, 2])
    assert tg.stats(loader).total["records"] == 6
    assert tg.stats(ds).total["records"] == 9


def test_stats_through_an_accelerate_prepared_loader(shared_dataset):
    data_loader = pytest.importorskip("accelerate.data_loader")
    ds = shared_dataset
    prepared = data_loader.DataLoaderShard(ds, batch_size=4, sampler=range(20))
    other = DataLoader(ds, batch_size=4, sampler=range(8))
    assert read_interleaved(tg.timed(prepared), other) == [5, 2]
    rep = tg.stats(prepared)
    assert rep.total["records"] == 20 and rep.consumer["batches"] == 5
    assert tg.stats(other).total["records"] == 8
