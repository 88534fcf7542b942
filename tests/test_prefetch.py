"""Tests for torchgrain.prefetch.CudaPrefetcher.

The CPU path runs everywhere; the CUDA tests run only where a CUDA device exists.
"""

from __future__ import annotations

import collections
import gc
import multiprocessing
import threading
import time
import traceback
import weakref
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from torchgrain.prefetch import CudaPrefetcher, _map_tensors

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torchgrain-prefetch"]


def wait_until(cond, timeout: float = 10.0) -> bool:
    """Poll ``cond`` until true or ``timeout``; for waiting on the producer, not timing it."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.fixture(autouse=True)
def no_leaked_threads():
    yield
    gc.collect()
    assert wait_until(lambda: not prefetch_threads(), timeout=5.0), prefetch_threads()


class Pair(NamedTuple):
    image: torch.Tensor
    label: int


class Recording:
    """An iterable that counts passes and records, per pass, which items were pulled."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n = n
        self.fail_at = fail_at
        self.passes = 0
        self.pulled: list[int] = []
        self.closed = 0
        self.made: list[weakref.ref] = []

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.passes += 1
        self.pulled = []
        return self._gen()

    def _gen(self):
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise_from_loader(i)
                self.pulled.append(i)
                t = torch.full((4,), i)
                self.made.append(weakref.ref(t))
                yield {"x": t, "i": i}
        finally:
            self.closed += 1


def raise_from_loader(i: int) -> None:
    raise ValueError(f"bad record {i}")


# --- ordering, nesting, leaves -------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_order_preserved(depth):
    loader = [torch.tensor([i]) for i in range(40)]
    out = [b.item() for b in CudaPrefetcher(loader, device="cpu", depth=depth)]
    assert out == list(range(40))


def test_empty_loader():
    assert list(CudaPrefetcher([], device="cpu")) == []


def test_cpu_yields_loader_objects_unchanged():
    batch = {"x": torch.ones(2), "meta": ["a", 1]}
    (out,) = list(CudaPrefetcher([batch], device="cpu"))
    assert out is batch


def nested_batch(i: int):
    dd = collections.defaultdict(list)
    dd["t"] = torch.full((2,), i)
    return {
        "pair": Pair(torch.full((2, 2), i), i),
        "list": [torch.tensor(i), "name", None, 3.5],
        "tuple": (torch.tensor([i, i]), np.arange(3)),
        "ordered": collections.OrderedDict(a=torch.tensor(i), b="b"),
        "default": dd,
        "str": f"s{i}",
    }


def test_nesting_rebuilt_with_types_and_leaves_kept():
    # "meta" exercises the generic move path (tensor.to(device)) without any hardware.
    batches = [nested_batch(i) for i in range(3)]
    out = list(CudaPrefetcher(batches, device="meta"))
    assert len(out) == 3
    for src, got in zip(batches, out):
        assert type(got) is dict
        assert isinstance(got["pair"], Pair)
        assert got["pair"].image.device.type == "meta"
        assert got["pair"].image.shape == (2, 2)
        assert got["pair"].label == src["pair"].label
        assert type(got["list"]) is list
        assert got["list"][0].device.type == "meta"
        assert got["list"][1:] == ["name", None, 3.5]
        assert type(got["tuple"]) is tuple
        assert got["tuple"][1] is src["tuple"][1]  # numpy leaf passes through
        assert type(got["ordered"]) is collections.OrderedDict
        assert list(got["ordered"]) == ["a", "b"]
        assert got["ordered"]["b"] == "b"
        assert type(got["default"]) is collections.defaultdict
        assert got["default"].default_factory is list
        assert got["default"]["t"].device.type == "meta"
        assert got["str"] == src["str"]
        # the loader's own batch is not modified in place
        assert src["pair"].image.device.type == "cpu"


def test_map_tensors_values():
    batch = nested_batch(7)
    doubled = _map_tensors(lambda t: t * 2, batch)
    assert doubled["pair"].image.tolist() == [[14, 14], [14, 14]]
    assert doubled["default"]["t"].tolist() == [14, 14]
    assert doubled["list"][0].item() == 14
    assert doubled["pair"].label == 7  # ints are leaves, not tensors


def test_map_tensors_reaches_ragged_columns():
    from torchgrain.columns import Ragged

    r = Ragged(torch.arange(5, dtype=torch.uint8), torch.tensor([0, 2, 5]))
    out = _map_tensors(lambda t: t + 1, {"r": r})
    assert isinstance(out["r"], Ragged) and out["r"].kind == "bytes"
    assert out["r"].values.tolist() == [1, 2, 3, 4, 5] and out["r"].offsets.tolist() == [1, 3, 6]


@settings(max_examples=25, deadline=None)
@given(
    items=st.lists(st.integers(-(2**31), 2**31), max_size=30),
    depth=st.integers(1, 6),
)
def test_any_sequence_round_trips(items, depth):
    batches = [(torch.tensor([v]), v) for v in items]
    out = list(CudaPrefetcher(batches, device="cpu", depth=depth))
    assert [(t.item(), v) for t, v in out] == [(v, v) for v in items]


# --- depth bound -----------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_producer_never_more_than_depth_ahead(depth):
    n = 12
    loader = Recording(n)
    for position, batch in enumerate(CudaPrefetcher(loader, device="cpu", depth=depth)):
        assert batch["i"] == position
        received = position + 1
        # Before the next ``next()``, at most ``depth`` items beyond those received
        # may have been pulled from the loader...
        assert len(loader.pulled) <= received + depth
        # ...and the producer does run ahead up to that bound (prefetching happens).
        bound = min(n, received + depth)
        assert wait_until(lambda b=bound: len(loader.pulled) >= b)
        time.sleep(0.002)  # give an over-eager producer the chance to overshoot
        assert len(loader.pulled) == bound


# --- early exit, close, garbage collection --------------------------------------------


def test_break_stops_thread_and_frees_batches():
    loader = Recording(100)
    before = set(threading.enumerate())
    for batch in CudaPrefetcher(loader, device="cpu", depth=4):
        if batch["i"] == 3:
            break
    # The for loop dropped its iterator: thread joined synchronously, loader closed.
    assert not prefetch_threads()
    assert set(threading.enumerate()) <= before
    assert loader.closed == 1
    assert len(loader.pulled) <= 4 + 4
    del batch
    gc.collect()
    assert all(ref() is None for ref in loader.made)


def test_iterator_close_and_del():
    loader = Recording(50)
    pf = CudaPrefetcher(loader, device="cpu")
    it = iter(pf)
    assert next(it)["i"] == 0
    assert len(prefetch_threads()) == 1
    it.close()
    assert not prefetch_threads()
    assert loader.closed == 1
    with pytest.raises(StopIteration):
        next(it)
    it = iter(pf)
    next(it)
    del it
    assert not prefetch_threads()
    assert loader.closed == 2


def test_garbage_collected_in_a_cycle():
    loader = Recording(50)
    it = iter(CudaPrefetcher(loader, device="cpu"))
    next(it)
    cycle = {"it": it}
    cycle["self"] = cycle
    del it, cycle
    gc.collect()
    assert not prefetch_threads()
    assert loader.closed == 1


def test_prefetcher_close_and_context_manager():
    loader = Recording(50)
    with CudaPrefetcher(loader, device="cpu") as pf:
        it = iter(pf)
        next(it)
        assert len(prefetch_threads()) == 1
    assert not prefetch_threads()
    assert loader.closed == 1
    pf.close()  # idempotent
    pf.close()


def test_new_pass_closes_the_previous_one():
    loader = Recording(50)
    pf = CudaPrefetcher(loader, device="cpu")
    first = iter(pf)
    next(first)
    second = iter(pf)
    assert len(prefetch_threads()) == 1
    assert loader.closed == 1
    assert [b["i"] for b in second] == list(range(50))
    with pytest.raises(StopIteration):
        next(first)


def test_thread_ends_after_full_pass():
    pf = CudaPrefetcher(Recording(5), device="cpu")
    assert len(list(pf)) == 5
    assert not prefetch_threads()


# --- errors ----------------------------------------------------------------------------


def test_loader_exception_surfaces_with_traceback():
    loader = Recording(10, fail_at=4)
    got = []
    with pytest.raises(ValueError, match="bad record 4") as info:
        for batch in CudaPrefetcher(loader, device="cpu", depth=3):
            got.append(batch["i"])
    assert got == [0, 1, 2, 3]  # every good batch before the failure arrives first
    tb = "".join(traceback.format_exception(info.value))
    assert "raise_from_loader" in tb  # the frame that raised, in the producer thread
    assert "test_loader_exception_surfaces_with_traceback" in tb  # the consumer frame
    assert "batch 4" in tb  # the note says where
    assert not prefetch_threads()


def test_iter_exception_raised_at_iter():
    class Broken:
        def __iter__(self):
            raise OSError("cannot open shard")

    with pytest.raises(OSError, match="cannot open shard"):
        iter(CudaPrefetcher(Broken(), device="cpu"))


def test_transform_exception_and_stopiteration():
    def bad(batch):
        if batch["i"] == 2:
            raise KeyError("label")
        return batch

    with pytest.raises(KeyError, match="label"):
        for _ in CudaPrefetcher(Recording(5), device="cpu", transform=bad):
            pass

    def stops(batch):
        raise StopIteration

    with pytest.raises(RuntimeError, match="StopIteration"):
        list(CudaPrefetcher(Recording(5), device="cpu", transform=stops))


def test_after_error_iterator_is_exhausted():
    it = iter(CudaPrefetcher(Recording(5, fail_at=0), device="cpu"))
    with pytest.raises(ValueError):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_bad_arguments():
    with pytest.raises(ValueError, match="depth"):
        CudaPrefetcher([], device="cpu", depth=0)
    with pytest.raises(ValueError, match="depth"):
        CudaPrefetcher([], device="cpu", depth=True)
    with pytest.raises(TypeError, match="transform"):
        CudaPrefetcher([], device="cpu", transform=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_explicit_cuda_without_cuda_is_an_error():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        CudaPrefetcher([], device="cuda")


def test_default_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert CudaPrefetcher([]).device.type == expected


# --- len, passes, transform ----------------------------------------------------------


def test_len_forwards():
    assert len(CudaPrefetcher(Recording(17), device="cpu")) == 17
    with pytest.raises(TypeError):
        len(CudaPrefetcher(iter([1, 2]), device="cpu"))


def test_reiteration_starts_fresh_passes():
    loader = Recording(6)
    pf = CudaPrefetcher(loader, device="cpu")
    for epoch in range(3):
        assert [b["i"] for b in pf] == list(range(6))
        assert loader.passes == epoch + 1


def test_transform_runs_in_thread_on_cpu():
    seen_threads = set()

    def normalise(batch):
        seen_threads.add(threading.current_thread().name)
        return {"x": batch["x"].float() / 255.0, "y": batch["y"]}

    batches = [{"x": torch.full((3,), 255, dtype=torch.uint8), "y": i} for i in range(4)]
    out = list(CudaPrefetcher(batches, device="cpu", transform=normalise))
    assert [b["y"] for b in out] == [0, 1, 2, 3]
    assert all(b["x"].dtype == torch.float32 and b["x"].tolist() == [1.0] * 3 for b in out)
    assert seen_threads == {"torchgrain-prefetch"}


# --- real DataLoader with worker processes --------------------------------------------


class Squares(Dataset):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int):
        return {"x": torch.tensor([i, i * i]), "idx": i, "name": f"r{i}"}


def test_with_dataloader_workers():
    loader = DataLoader(Squares(), batch_size=4, num_workers=2)
    pf = CudaPrefetcher(loader, device="cpu", depth=2)
    assert len(pf) == len(loader) == 8
    for _ in range(2):  # two epochs through the same prefetcher
        idx = []
        for batch in pf:
            assert batch["x"][:, 1].tolist() == [i * i for i in batch["idx"].tolist()]
            assert batch["name"] == [f"r{i}" for i in batch["idx"].tolist()]
            idx.extend(batch["idx"].tolist())
        assert idx == list(range(30))

    # breaking out early also shuts the worker processes down
    for batch in pf:
        if batch["idx"][0] == 8:
            break
    del batch
    assert not prefetch_threads()
    assert wait_until(lambda: not multiprocessing.active_children())


# --- CUDA ------------------------------------------------------------------------------


@cuda
def test_cuda_values_and_transform():
    batches = [
        {"img": torch.full((2, 3), i, dtype=torch.uint8), "label": torch.tensor(i), "id": i}
        for i in range(10)
    ]

    def normalise(b):
        return {**b, "img": b["img"].float() / 255.0}

    pf = CudaPrefetcher(batches, device="cuda", transform=normalise)
    for _epoch in range(2):
        out = list(pf)
        assert len(out) == 10
        for i, b in enumerate(out):
            assert b["img"].is_cuda and b["label"].is_cuda
            assert b["id"] == i
            torch.testing.assert_close(b["img"].cpu(), torch.full((2, 3), i / 255.0))
            assert b["label"].item() == i
    assert pf.device.index is not None


@cuda
def test_cuda_copies_run_on_a_side_stream():
    seen = []

    def spy(b):
        seen.append(torch.cuda.current_stream())
        return b

    batches = [torch.arange(1000) + i for i in range(5)]
    pf = CudaPrefetcher(batches, device="cuda", transform=spy)
    out = list(pf)
    assert pf.stream is not None
    assert pf.stream != torch.cuda.default_stream()
    assert pf.stream != torch.cuda.current_stream()
    assert all(s == pf.stream for s in seen)
    assert [int(b[0]) for b in out] == list(range(5))


@cuda
def test_cuda_pinning_decision():
    pf = CudaPrefetcher([torch.zeros(2)], device="cuda")
    assert pf._pin_for_pass()
    ds = torch.utils.data.TensorDataset(torch.arange(8))
    dl = DataLoader(ds, batch_size=4, pin_memory=True)
    pf = CudaPrefetcher(dl, device="cuda")
    assert not pf._pin_for_pass()
    assert [b[0].tolist() for b in pf] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not CudaPrefetcher(dl, device="cuda", pin_memory=False)._pin_for_pass()


@cuda
def test_cuda_record_stream_keeps_memory_until_consumer_is_done():
    # The consumer's stream is held back by a long sleep kernel before it reads each batch,
    # and drops its Python reference at once. Without record_stream the allocator would
    # hand that block to a later copy on the side stream, which would overwrite it before
    # the delayed read: the sums would come out wrong.
    n, size = 12, 1 << 20
    batches = [torch.full((size,), float(i)) for i in range(n)]
    sums = []
    for batch in CudaPrefetcher(batches, device="cuda", depth=2):
        torch.cuda._sleep(20_000_000)  # tens of milliseconds on current GPUs
        sums.append(batch.sum())
        del batch
    torch.cuda.synchronize()
    assert [s.item() for s in sums] == [float(i * size) for i in range(n)]


@cuda
def test_cuda_break_releases_device_memory():
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    batches = [torch.ones(1 << 20) for _ in range(20)]
    it = iter(CudaPrefetcher(batches, device="cuda", depth=3))
    first = next(it)
    state = it._state
    assert wait_until(lambda s=state: s.produced == 4)  # 1 consumed + depth in flight
    assert torch.cuda.memory_allocated() > base
    del it, first, state
    torch.cuda.synchronize()
    gc.collect()
    assert not prefetch_threads()
    assert torch.cuda.memory_allocated() == base


@cuda
def test_cuda_loader_exception():
    with pytest.raises(ValueError, match="bad record 2"):
        for _ in CudaPrefetcher(Recording(5, fail_at=2), device="cuda"):
            pass


@cuda
def test_cuda_columns_batches_from_workers(tmp_path):
    import numpy as np

    import torchgrain as tg
    from torchgrain.columns import Ragged

    records = [
        {"img": np.full((4, 4), i, np.uint8), "blob": b"x" * (i % 5), "y": i} for i in range(64)
    ]
    tg.write_array_record(records, str(tmp_path), num_shards=2)
    ds = tg.Dataset(tg.ArrayRecordSource(str(tmp_path)), batch_format="columns")
    loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=2, pin_memory=True)
    seen = []
    for b in CudaPrefetcher(loader, device="cuda"):
        assert b["img"].is_cuda and b["y"].is_cuda
        assert isinstance(b["blob"], Ragged) and b["blob"].values.is_cuda
        ys = b["y"].tolist()
        assert b["img"][:, 0, 0].tolist() == ys
        lengths = (b["blob"].offsets[1:] - b["blob"].offsets[:-1]).tolist()
        assert lengths == [y % 5 for y in ys]
        seen += ys
    assert sorted(seen) == list(range(64))
