"""Findings of this stop's reviews (Parquet reads, writers, the worker-to-loop path): each
test fails on the code before its fix."""

from __future__ import annotations

import contextlib
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

import torchgrain as tg


# ------------------------------------------------------------------ Parquet reads
def test_directory_discovery_skips_underscore_folders(tmp_path):
    # Spark's uncommitted attempts and a Delta log are not the dataset (pyarrow skips them).
    t = pa.table({"id": [1, 2, 3]})
    pq.write_table(t, tmp_path / "part-00000.parquet")
    attempt = tmp_path / "_temporary" / "0" / "_temporary" / "attempt_0001_m_000000_0"
    attempt.mkdir(parents=True)
    pq.write_table(t, attempt / "part-00000.parquet")
    (tmp_path / "_delta_log").mkdir()
    pq.write_table(pa.table({"add": ["x"]}), tmp_path / "_delta_log" / "10.checkpoint.parquet")
    src = tg.ParquetSource(tmp_path)
    assert [r["id"] for r in src.__getitems__(range(len(src)))] == [1, 2, 3]
    assert pq.read_table(tmp_path).num_rows == 3


@pytest.mark.parametrize(
    "values, expression",
    [
        (
            pa.array([0.1, 0.2, 0.3], pa.float64()),
            pc.field("x").cast(pa.float32()) == pa.scalar(0.3, pa.float32()),
        ),
        (
            pa.array([2**63, 2**64 - 1, 5, None], pa.uint64()),
            pc.field("x").cast(pa.int64(), safe=False) < 0,
        ),
    ],
)
def test_pushdown_with_a_cast_keeps_the_rows_that_match(tmp_path, values, expression):
    # Arrow's simplification under the statistics' range pruned the row group.
    pq.write_table(pa.table({"x": values}), tmp_path / "a.parquet")
    want = pq.read_table(tmp_path).filter(expression).column("x").to_pylist()
    assert want  # (rows match)
    ds = tg.Dataset(tg.ParquetSource(tmp_path)).filter(expression, progress=False, index_dir=None)
    assert [r["x"] for r in ds] == want


def test_a_filter_selection_is_not_shared_across_partitioning(tmp_path):
    # The files' column p (5, 6, 7) and the folder's p=1: other rows match p == 1.
    data, index = tmp_path / "data", tmp_path / "index"
    (data / "p=1").mkdir(parents=True)
    pq.write_table(pa.table({"x": [10, 20, 30], "p": [5, 6, 7]}), data / "p=1" / "f.parquet")

    def kept(partitioning: str | None) -> list[int]:
        src = tg.ParquetSource(data, columns=["x"], partitioning=partitioning)
        ds = tg.Dataset(src).filter(pc.field("p") == 1, progress=False, index_dir=index)
        return [r["x"] for r in ds]

    assert kept("hive") == [10, 20, 30]
    assert kept(None) == []


def test_a_filter_selection_is_not_shared_across_int96_units(tmp_path):
    data, index = tmp_path / "data", tmp_path / "index"
    data.mkdir()
    t = pa.table({"x": [1, 2], "t": pa.array([1500, 500], pa.timestamp("ns"))})
    pq.write_table(t, data / "a.parquet", use_deprecated_int96_timestamps=True)
    expression = pc.field("t") > pa.scalar(1000, pa.timestamp("ns"))

    def kept(unit: str, index_dir=index) -> list[int]:
        src = tg.ParquetSource(data, columns=["x"], int96_timestamp_unit=unit)
        ds = tg.Dataset(src).filter(expression, progress=False, index_dir=index_dir)
        return [r["x"] for r in ds]

    alone = kept("us", None)
    assert kept("ns") == [1]
    assert kept("us") == alone


# ------------------------------------------------------------------ writers
def test_write_parquet_refuses_a_directory_with_parquet_files(tmp_path):
    tg.write_parquet([{"id": i, "v": "old"} for i in range(6)], tmp_path, num_shards=3)
    with pytest.raises(FileExistsError, match="already holds Parquet files"):
        tg.write_parquet([{"id": i, "v": "new"} for i in range(4)], tmp_path, num_shards=2)
    assert len(tg.ParquetSource(tmp_path)) == 6  # (untouched)
    new = [{"id": i, "v": "new"} for i in range(4)]
    tg.write_parquet(new, tmp_path, num_shards=2, overwrite=True)
    src = tg.ParquetSource(tmp_path)
    assert [r["v"] for r in src.__getitems__(range(len(src)))] == ["new"] * 4


def test_write_array_record_refuses_to_replace_a_shard_without_manifest(tmp_path):
    other = tmp_path / "other"
    tg.write_array_record([{"x": i} for i in range(3)], other)
    os.remove(other / "torchgrain.json")  # (as another writer leaves them)
    with pytest.raises(FileExistsError, match="a shard this write would replace"):
        tg.write_array_record([{"x": 100}], other)
    assert [r["x"] for r in tg.ArrayRecordSource(other).__getitems__([0, 1, 2])] == [0, 1, 2]
    tg.write_array_record([{"x": 100}], other, overwrite=True)
    assert [r["x"] for r in tg.ArrayRecordSource(other).__getitems__([0])] == [100]


# ------------------------------------------------------------------ worker to loop
@pytest.fixture(scope="module")
def batches_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("ar")
    tg.write_array_record(
        (
            {
                "x": np.full((3, 64, 64), i % 251, np.uint8),
                "label": i,
                "f": np.full(5, i, np.float32),
            }
            for i in range(256)
        ),
        d,
        num_shards=2,
    )
    return d


def _total(q_in, q_out):
    q_out.put(int(q_in.get().sum()))


def test_a_slot_column_sent_after_an_in_place_change_carries_the_change(batches_data):
    ds = tg.Dataset(tg.ArrayRecordSource(batches_data), batch_format="columns")
    loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=1)
    ctx = torch.multiprocessing.get_context("fork")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_total, args=(q_in, q_out))
    p.start()
    try:
        batches = iter(loader)
        next(batches)  # (the first batch sizes the worker's slots)
        batch = next(batches)
        ForkingPickler.dumps(batch["f"])  # (a first send of the batch's memory)
        batch["x"].mul_(0).add_(7)
        q_in.put(batch["x"])
        assert q_out.get(timeout=60) == 7 * batch["x"].numel()
    finally:
        p.join(60)


@pytest.mark.parametrize("worker_slots", [8, 0])
def test_kept_labels_hold_their_own_bytes_not_the_batches(batches_data, worker_slots):
    ds = tg.Dataset(
        tg.ArrayRecordSource(batches_data), batch_format="columns", worker_slots=worker_slots
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=2)
    labels = [b["label"] for b in loader]
    assert sorted(torch.cat(labels).tolist()) == list(range(256))
    # Each batch's x is 32 x 12 KiB (393 KiB): the labels keep their batches' segments of
    # small columns (labels and f: 768 bytes), the first batch's arena at most.
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in labels}
    assert sum(held.values()) < 256 << 10
    assert sum(len(pickle.dumps(label)) < 8192 for label in labels) >= len(labels) - 2


def test_large_columns_of_a_slot_pickle_their_own_bytes(batches_data):
    ds = tg.Dataset(tg.ArrayRecordSource(batches_data), batch_format="columns")
    loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=1)
    batches = iter(loader)
    next(batches)  # (the first batch sizes the worker's slots)
    x = next(batches)["x"]
    assert x.untyped_storage().nbytes() == x.numel()  # (not the slot's)
    assert torch.equal(pickle.loads(pickle.dumps(x)), x)


def _failing(record):
    if record["label"] == 100:
        raise ValueError("bad record 100")
    return record


def _skip_errors(iterator) -> tuple[list[int], int]:
    labels, errors = [], 0
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return labels, errors
        except ValueError:
            errors += 1
            continue
        labels += batch["label"].tolist()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_prefetcher_goes_on_after_a_batch_that_failed(batches_data, num_workers):
    ds = tg.Dataset(tg.ArrayRecordSource(batches_data), batch_format="columns").map(_failing)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=num_workers)
    want = _skip_errors(iter(loader))
    assert want[1] == 1 and len(want[0]) == 240
    assert _skip_errors(iter(tg.CudaPrefetcher(loader, device="cpu"))) == want


def test_a_resumable_loader_goes_on_after_a_batch_that_failed_and_resumes_after_it(
    batches_data,
):
    ds = tg.Dataset(tg.ArrayRecordSource(batches_data), batch_format="columns").map(_failing)

    def loader() -> tg.ResumableLoader:
        sampler = tg.GlobalShuffleSampler(ds, seed=3, num_replicas=1, rank=0)
        return tg.ResumableLoader(
            torch.utils.data.DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2)
        )

    whole, errors = _skip_errors(iter(loader()))
    assert errors == 1 and len(whole) == 240
    first = loader()
    it, seen, failed = iter(first), [], False
    while not (failed and len(seen) % 64 == 0):  # past the failed batch (skipped), then saved
        try:
            seen += next(it)["label"].tolist()
        except ValueError:
            failed = True
    state = first.state_dict()
    del it
    second = loader()
    second.load_state_dict(state)
    rest, errors_after = _skip_errors(iter(second))
    assert errors_after == 0
    assert seen + rest == whole


class _FailsAt13(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        if i == 13:
            raise ValueError("bad 13")
        return i


def test_a_wrapper_that_cannot_go_on_after_an_error_does_not_end_the_epoch():
    # Accelerate's DataLoaderShard is a generator: an error ends its pass. The epoch must
    # not move on (a resume would skip the rest of it); the failed batch counts as taken.
    from accelerate import Accelerator

    ds = _FailsAt13()
    sampler = tg.GlobalShuffleSampler(ds, seed=0, num_replicas=1, rank=0, shuffle=False)
    dl = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler)
    loader = tg.ResumableLoader(Accelerator(cpu=True).prepare(dl))
    it, got, errors = iter(loader), [], 0
    while True:
        try:
            got += next(it).tolist()
        except StopIteration:
            break
        except ValueError:
            errors += 1
    assert (got, errors) == (list(range(8)), 1)
    state = loader.state_dict()
    assert (state["epoch"], state["sampler"]["position"]) == (0, 12)


def test_a_resumed_pass_with_a_failed_batch_still_ends_its_epoch():
    data = list(range(20))

    def failing(i):
        if i == 13:
            raise ValueError("bad 13")
        return i

    class Failing(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return failing(data[i])

    def loader() -> tg.ResumableLoader:
        sampler = tg.GlobalShuffleSampler(Failing(), seed=1, num_replicas=1, rank=0)
        return tg.ResumableLoader(
            torch.utils.data.DataLoader(Failing(), batch_size=2, sampler=sampler)
        )

    first = loader()
    it = iter(first)
    for _ in range(3):
        with contextlib.suppress(ValueError):
            next(it)
    state = first.state_dict()
    del it
    second = loader()
    second.load_state_dict(state)
    _skip_errors_plain(iter(second))
    assert second.epoch == 1  # (the resumed pass ended its epoch, error or not)


def _skip_errors_plain(iterator) -> int:
    n = 0
    while True:
        try:
            next(iterator)
        except StopIteration:
            return n
        except ValueError:
            pass
        n += 1


def test_small_columns_have_storages_of_their_own_and_sparse_tensors_still_pickle(
    batches_data,
):
    ds = tg.Dataset(tg.ArrayRecordSource(batches_data), batch_format="columns")
    loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=1)
    batches = iter(loader)
    next(batches)  # (the first batch sizes the worker's slots)
    batch = next(batches)
    for key in ("label", "f"):  # (small: copied out of the slot, each in its own buffer)
        t = batch[key]
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    sparse = torch.eye(3).to_sparse()
    assert torch.equal(pickle.loads(ForkingPickler.dumps(sparse)).to_dense(), torch.eye(3))


def test_a_transform_raising_stop_iteration_keeps_it_as_the_cause():
    def stop(batch):
        raise StopIteration("from the transform")

    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    with pytest.raises(RuntimeError, match="raised StopIteration") as info:
        next(iter(tg.CudaPrefetcher(loader, device="cpu", transform=stop)))
    assert isinstance(info.value.__cause__, StopIteration)


def _big_endian_ids(batch):
    batch["be"] = np.asarray(batch["label"]).astype(">i4")
    return batch


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_big_endian_column_arrives_with_its_values(batches_data, num_workers):
    # (the collate raised ValueError: torch takes native byte order only)
    ds = tg.Dataset(tg.ArrayRecordSource(batches_data), batch_format="columns")
    ds = ds.map_batch(_big_endian_ids)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=num_workers)
    batch = next(iter(loader))
    assert batch["be"].dtype == torch.int32
    assert batch["be"].tolist() == batch["label"].tolist()
