"""Honest capabilities (torchgrain.protocols): a Dataset, an adapter, a view or token
windows has block_offsets / read_ahead only where they work, and a pass's read-ahead
reaches every source under a composition with the source's own indices, in pass order."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import torchgrain as tg
from torchgrain.protocols import HasBlockOffsets, ReadsAhead


class Recorder(tg.Source):
    """Records ``{"src": name, "j": j, "tokens": ...}``; keeps the order of each pass it
    is told to read ahead."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n
        self.passes: list[list[int]] = []

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, indices):
        idx = tg.ShardIndex([self.n]).check(indices).tolist()
        return [{"src": self.name, "j": j, "tokens": np.arange(j % 5)} for j in idx]

    keys = property(lambda self: ["src", "j", "tokens"])
    schema = property(lambda self: {"src": "str", "j": "int", "tokens": "int64[?]"})

    def read_ahead(self, order, start, count, position):
        if order is not None:
            self.passes.append(np.asarray(order(start, start + count)).tolist())


def _pass(ds) -> list[int]:
    """One pass of a shuffling sampler over ``ds`` (which tells ``ds`` to read ahead)."""
    return list(tg.GlobalShuffleSampler(ds, num_replicas=1, rank=0, seed=3))


def test_each_source_under_a_composition_reads_ahead_its_own_indices_in_pass_order():
    s = {k: Recorder(k, n) for k, n in zip("abcde", (12, 15, 10, 9, 8))}
    quiet = {"index_dir": None, "progress": False, "num_workers": 0}
    kept = tg.Dataset(s["b"]).filter(lambda r: r["j"] % 3 != 0, **quiet)
    parts = tg.split(s["c"], {"x": 0.6, "y": 0.4}, seed=2)
    ds = tg.concat(
        [
            tg.mix({"a": s["a"], "b": kept}, [0.5, 0.5], seed=1),
            parts["x"],
            tg.Dataset(s["d"]).select([8, 0, 3, 3]),
            tg.Dataset(tg.Dataset(s["e"])),  # a Dataset over a Dataset
            parts["y"],  # c again, through another view
            s["a"],  # a again, directly
        ]
    )
    order = _pass(ds)
    read = ds.__getitems__(order)
    for name, src in s.items():
        # One pass each (a source under two views is not told twice), with the indices
        # of its records that the pass reads, in the pass's order.
        assert src.passes == [[r["j"] for r in read if r["src"] == name]], name

    # Token windows: the documents each window reads (its tokens and the next one's
    # label), each once, in pass order, reach the sources under the documents' concat.
    f, g = Recorder("f", 9), Recorder("g", 7)
    docs = tg.concat([f, g])
    wins = docs.windows("tokens", 3, lengths=None, **quiet)
    order = _pass(wins)
    lengths = np.array([len(r["tokens"]) for r in docs.__getitems__(range(len(docs)))])
    off = np.r_[0, np.cumsum(lengths)]
    touched = [  # (an empty document by the window its place lies in, to check it)
        d
        for i in order
        for d in range(len(docs))
        if (off[d + 1] > off[d] and off[d] < (i + 1) * 3 + 1 and off[d + 1] > i * 3)
        or (off[d + 1] == off[d] and (i * 3 < off[d] <= i * 3 + 3 or i == off[d] == 0))
        or (i == len(wins) - 1 and off[d] >= i * 3)  # the last one: every document after it
    ]
    first = list(dict.fromkeys(touched))
    for src in (f, g):
        assert src.passes == [[r["j"] for r in docs.__getitems__(first) if r["src"] == src.name]]


def test_a_capability_exists_only_where_it_works(tmp_path):
    plain, rec = [{"j": i} for i in range(6)], Recorder("r", 6)
    quiet = {"index_dir": None, "progress": False, "num_workers": 0}
    cases = {
        # (dataset, has block_offsets, reads ahead)
        "list": (tg.Dataset(plain), False, False),
        "source": (tg.Dataset(rec), True, True),
        "dataset over a dataset": (tg.Dataset(tg.Dataset(rec).map(dict)), True, True),
        "dataset over a list dataset": (tg.Dataset(tg.Dataset(plain)), False, False),
        "concat with a list": (tg.concat([rec, plain]), False, True),
        "concat of sources": (tg.concat([rec, Recorder("q", 3)]), True, True),
        "mix of lists": (tg.mix([plain, plain]), True, False),
        "filter of a list": (tg.Dataset(plain).filter(lambda r: r["j"] > 2, **quiet), True, False),
        "select of a source": (tg.Dataset(rec).select([1, 0]), True, True),
        "windows, pack": (tg.Dataset(rec).windows("tokens", 4, mode="pack", **quiet), False, True),
        "windows, concat": (tg.Dataset(rec).windows("tokens", 4, **quiet), True, True),
    }
    for name, (ds, blocks, ahead) in cases.items():
        for x in (ds, ds.source, pickle.loads(pickle.dumps(ds))):
            assert isinstance(x, HasBlockOffsets) == blocks, (name, x)
            assert isinstance(x, ReadsAhead) == ahead, (name, x)
        if blocks:
            assert ds.block_offsets()[-1] == len(ds), name
        else:
            with pytest.raises(TypeError, match="block boundaries"):
                ds.block_offsets()
            with pytest.raises(TypeError, match="needs a dataset with block_offsets"):
                tg.BlockShuffleSampler(ds)


def test_a_method_a_subclass_defines_is_its_capability():
    # The wrapper's word (offers) covers the methods its own class defines; a subclass
    # that says where the blocks of a plain list are has them.
    class Halves(tg.Dataset):
        def block_offsets(self) -> np.ndarray:
            return np.array([0, 3, 6], np.int64)

    ds = Halves([{"j": i} for i in range(6)])
    assert isinstance(ds, HasBlockOffsets) and not isinstance(ds, ReadsAhead)
    assert not isinstance(tg.Dataset([{"j": 0}]), HasBlockOffsets)
    order = list(tg.BlockShuffleSampler(ds, num_replicas=1, rank=0, window=1))
    assert sorted(order[:3]) in ([0, 1, 2], [3, 4, 5])
