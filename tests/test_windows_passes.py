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
