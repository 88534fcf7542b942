"""Review of honest capabilities (block_offsets / read_ahead set on the instance where
they work, and read-ahead as a pass plan of each source's indices): faults found by
reproduction. Each test shows one fault (each fixed since)."""

from __future__ import annotations

import gc
import os
import uuid
import weakref

import fsspec
import numpy as np
import pytest

import torchgrain as tg
from tests.test_capabilities import Recorder, _pass
from torchgrain.compose.view import View

QUIET = {"index_dir": None, "progress": False, "num_workers": 0}


def test_a_source_under_a_transformed_dataset_and_another_input_gets_one_pass():
    # The composition finds the objects that read ahead by identity, stopping at the
    # first non-view: a Dataset with transforms is one (its read_ahead forwards to its
    # source), so the source under it and under another input is told twice. A sharded
    # source keeps one walk per process: it reads ahead only for the last input told.
    s = Recorder("s", 10)
    for ds in (
        tg.concat([tg.Dataset(s).map(dict), tg.Dataset(s).map(dict)]),  # two augmentations
        tg.concat([s, tg.Dataset(s).map(dict)]),
    ):
        s.passes.clear()
        read = ds.__getitems__(_pass(ds))
        assert s.passes == [[r["j"] for r in read]]  # 2 passes of 10 indices each


def test_a_subclass_method_for_a_capability_is_used():
    # The capability is set in __init__ as an instance attribute, which wins over a
    # method of the class: a subclass that says where its blocks are, or prepares its
    # own pass, is silently ignored (both worked before).
    class Halves(tg.Dataset):
        def block_offsets(self) -> np.ndarray:
            return np.array([0, len(self) // 2, len(self)], np.int64)

    assert Halves(Recorder("s", 10)).block_offsets().tolist() == [0, 5, 10]  # got [0, 10]

    told: list[int] = []

    class Reversed(View):  # the view.py docstring's example, with its own read-ahead
        def __len__(self):
            return len(self.children[0])

        def _locate(self, indices):
            return np.zeros(len(indices), np.int64), len(self) - 1 - indices

        def read_ahead(self, order, start, count, position):
            told.append(count)

    _pass(Reversed([Recorder("s", 10)]))
    assert told == [10]  # never called


def test_a_dropped_view_is_freed_at_once(tmp_path):
    # self.read_ahead = self._read_ahead (and Concat's, TokenWindows' block_offsets) is a
    # reference cycle. Measured with /proc/self/maps and the fds under the index
    # directory: a dropped filter or token windows over an ArrayRecordSource kept its
    # index file mapped and open (1 fd, 1 map and an inotify watch each) until
    # gc.collect(); before, `del` released them.
    quiet = {**QUIET, "index_dir": str(tmp_path)}
    makers = {
        "filter": lambda s: tg.Dataset(s).filter(lambda r: r["j"] % 2 == 0, **quiet).source,
        "windows": lambda s: tg.Dataset(s).windows("tokens", 3, lengths=None, **quiet).source,
        "concat": lambda s: tg.concat([s, s]).source,
        "select": lambda s: tg.Dataset(s).select([1, 0]).source,
    }
    enabled = gc.isenabled()
    gc.disable()
    try:
        alive = []
        for name, make in makers.items():
            view = make(Recorder("s", 12))
            ref = weakref.ref(view)
            del view
            if ref() is not None:
                alive.append(name)
        assert alive == []
    finally:
        if enabled:
            gc.enable()
        gc.collect()


def test_shard_read_ahead_of_a_source_behind_another_input(tmp_path):
    # A composed order gives a source only its own indices (fewer than the positions
    # asked, or more for token windows), but ShardReadAhead counts the k-th index as
    # position scan + k. Behind a 40-record input, with the reader at position 40 (about
    # to start on the source), every shard of the source is still ahead, and the walk
    # finds them all "passed": 0 of 4 fetched (4 when the source is read ahead alone).
    local = tmp_path / "data"
    tg.write_array_record([{"x": i} for i in range(40)], str(local), num_shards=4)
    store, root = fsspec.filesystem("memory"), f"/caps-review-{uuid.uuid4().hex}"
    for f in os.listdir(local):
        store.pipe(f"{root}/{f}", (local / f).read_bytes())
    try:
        src = tg.ArrayRecordSource(f"memory://{root}", cache_dir=str(tmp_path / "cache"))
        ds = tg.concat([[{"x": -1}] * 40, src])
        ds.read_ahead(lambda a, b: np.arange(a, b), 0, 80, lambda: 40)
        walk = src._proc().read_ahead
        assert walk.join(timeout=60)
        assert walk.fetched == 4
    finally:
        store.rm(root, recursive=True)


def test_block_shuffle_says_which_input_has_no_blocks():
    # The view knows (its blocks_missing: "dataset '1' (SequenceSource([...])): list is
    # not a torchgrain Source: it has no block boundaries"), and the sampler's message
    # of before said so; now it is "BlockShuffleSampler needs a dataset with
    # block_offsets() or block_offsets=" whatever the dataset.
    ds = tg.concat([Recorder("a", 3), [{"j": 1}]])
    with pytest.raises(TypeError, match=r"dataset '1' .*list is not a torchgrain Source"):
        tg.BlockShuffleSampler(ds, num_replicas=1, rank=0)


def test_calling_a_missing_block_offsets_says_why():
    # A Dataset raises AttributeError with the reason; what it wraps (ds.source, public)
    # hides the Source default with a class attribute None, so hasattr() is still True
    # and a call fails with no word of blocks (each said why before). Python's own
    # __hash__ = None reads "unhashable type": the interpreter knows that one.
    from torchgrain.adapters import SequenceSource

    pack = tg.Dataset(Recorder("a", 6)).windows("tokens", 4, mode="pack", **QUIET)
    cases = {
        "adapter": SequenceSource([1, 2]),
        "concat with a list": tg.concat([Recorder("a", 3), [{"j": 1}]]).source,
        "windows, pack": pack.source,
    }
    for x in cases.values():
        with pytest.raises((TypeError, AttributeError), match="block boundaries"):
            x.block_offsets()


def test_bench_takes_a_mixture_for_a_dataset_without_blocks():
    # _records_per_block says "1 for a dataset without blocks (a mixture)", but a view
    # without blocks of its own has the Source default, one block: `torchgrain bench
    # mix.json` over 2 x 64 records printed "128 records per block" and measured a
    # "block-shuffled" order that is the global shuffle again (a third of its time).
    from torchgrain.bench import _records_per_block

    mixture = tg.mix([Recorder("a", 64), Recorder("b", 64)], seed=0).source
    assert _records_per_block(mixture) == 1
