"""Token windows take part in a composition's pass plan: a source under token windows
and under another input (windows of it again, a filter of it, the source itself) is told
one read-ahead pass, holding every index the pass reads, in pass order."""

from __future__ import annotations

import torchgrain as tg
from tests.test_capabilities import Recorder, _pass

QUIET = {"index_dir": None, "progress": False, "num_workers": 0, "lengths": None}


class Logged(Recorder):
    """A :class:`Recorder` that also keeps the indices of every read."""

    def __init__(self, name: str, n: int) -> None:
        super().__init__(name, n)
        self.reads: list[int] = []

    def __getitems__(self, indices):
        self.reads += [int(j) for j in indices]
        return super().__getitems__(indices)


def _first_seen(xs: list[int]) -> list[int]:
    return list(dict.fromkeys(xs))


def test_a_source_under_windows_and_another_input_gets_one_pass():
    s = Logged("s", 40)
    long = tg.Dataset(s).filter(
        lambda r: r["j"] % 5 >= 3, index_dir=None, progress=False, num_workers=0
    )
    cases = {
        "windows and the source": tg.concat(
            [tg.Dataset(s).windows("tokens", 3, **QUIET), tg.Dataset(s).map(dict)]
        ),
        "windows and windows of a filter": tg.mix(
            [tg.Dataset(s).windows("tokens", 3, **QUIET), long.windows("tokens", 2, **QUIET)],
            seed=1,
        ),
        "windows twice": tg.concat(
            [
                tg.Dataset(s).windows("tokens", 3, **QUIET),
                tg.Dataset(s).windows("tokens", 5, mode="pack", **QUIET),
            ]
        ),
    }
    for name, ds in cases.items():
        s.passes.clear()
        order = _pass(ds)
        assert len(s.passes) == 1, name  # 2 before: one per input, each cancelling the other
        # The indices the pass reads, each where the pass first reads it (in any order
        # within one position: a packed window's documents are in its bin's order).
        got, at = _first_seen(s.passes[0]), 0
        for i in order:
            s.reads.clear()
            ds.__getitems__([i])
            new = set(s.reads).difference(got[:at])
            assert set(got[at : at + len(new)]) == new, (name, i)
            at += len(new)
        assert at == len(got), name


def test_a_composed_order_says_where_each_of_its_indices_is_read():
    """A source's read-ahead positions under a composition are where the pass first reads
    each index, also when there happen to be as many indices as positions (here 8 of
    each: windows read up to three documents each, empty ones too), not one per position
    in turn."""
    import numpy as np

    from torchgrain.io.readahead import _used_at

    s, other = Recorder("s", 8), Recorder("o", 4)
    orders = []
    s.read_ahead = lambda order, start, count, position: orders.append(order)
    ds = tg.concat(
        [
            tg.Dataset(other).windows("tokens", 2, **QUIET),
            tg.Dataset(s).windows("tokens", 2, **QUIET),
        ]
    )
    n = len(ds)
    ds.read_ahead(lambda a, b: np.arange(a, b), 0, n, lambda: 0)
    (order,) = orders
    indices, at = _used_at(order, 0, n)
    assert len(indices) == n  # the case where counting alone cannot tell
    read_at: dict[int, int] = {}
    got: list[int] = []
    s.__getitems__ = lambda idx, read=Recorder.__getitems__: (got.extend(idx), read(s, idx))[1]
    for p in range(n):
        got.clear()
        ds.__getitems__([p])
        for j in got:
            read_at.setdefault(int(j), p)
    first = dict(reversed(list(zip(indices.tolist(), at.tolist()))))
    assert first == read_at
