"""Layouts: the stream intervals a pass splits, and what is left of them after a resume.

A *layout* is a list of ``[start, stop)`` intervals of positions of the epoch's order
(an int64 array of shape ``(k, 2)``); their concatenation is the *virtual stream* the
ranks split. A fresh epoch's layout is ``[[0, N]]``; after an elastic resume it is the
part of the order not consumed yet.
"""

from __future__ import annotations

import numpy as np

__all__ = ["complement", "compose", "layout_length", "layout_positions"]


def complement(intervals: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The parts of ``[0, length)`` not covered by ``intervals`` of virtual positions.

    Positions past the end are padding and stand for ``v mod length`` (as in
    DistributedSampler, whose padding repeats the order's first indices), so a
    padding draw covers the position it repeats.

    Example:
        >>> complement([(2, 4), (10, 11)], 10)  # 10 pads position 0
        [(1, 2), (4, 10)]
    """
    covered: list[tuple[int, int]] = []
    for s, e in intervals:
        s = max(0, s)
        if e <= s:
            continue
        if s < length:
            covered.append((s, min(e, length)))
        s = max(s, length)
        if e <= s or length <= 0:
            continue
        if e - s >= length:
            return []
        a, b = s % length, s % length + (e - s)
        covered.extend([(a, b)] if b <= length else [(a, length), (0, b - length)])
    out: list[tuple[int, int]] = []
    pos = 0
    for s, e in sorted(covered):
        if s > pos:
            out.append((pos, s))
        pos = max(pos, e)
    if pos < length:
        out.append((pos, length))
    return out


def compose(layout: np.ndarray, virtual: list[tuple[int, int]]) -> np.ndarray:
    """Stream intervals of the given virtual intervals of ``layout`` (ascending and
    disjoint, as :func:`complement` gives them): one walk over both, O(k + m).

    Example:
        >>> compose(np.array([[0, 3], [5, 8]]), [(2, 4)]).tolist()
        [[2, 3], [5, 6]]
    """
    out: list[tuple[int, int]] = []
    segments = layout.tolist()
    i = base = 0  # segment i starts at virtual position base
    for vs, ve in virtual:
        while i < len(segments) and base + segments[i][1] - segments[i][0] <= vs:
            base += segments[i][1] - segments[i][0]
            i += 1
        j, b = i, base
        while j < len(segments) and b < ve:
            s, e = segments[j]
            lo, hi = max(vs, b), min(ve, b + e - s)
            if lo < hi:
                a, c = s + lo - b, s + hi - b
                if out and out[-1][1] == a:
                    out[-1] = (out[-1][0], c)
                else:
                    out.append((a, c))
            b += e - s
            j += 1
    if not out:
        out.append((0, 0))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def layout_length(layout: np.ndarray) -> int:
    """The number of positions ``layout`` holds (its virtual stream's length).

    Example:
        >>> layout_length(np.array([[0, 3], [5, 8]]))
        6
    """
    return int((layout[:, 1] - layout[:, 0]).sum())


def layout_positions(layout: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Stream positions of virtual positions ``v`` (in ``[0, length)``) of ``layout``
    (``v`` may be shifted in place).

    Example:
        >>> layout_positions(np.array([[0, 3], [5, 8]]), np.array([0, 3, 5])).tolist()
        [0, 5, 7]
    """
    if len(layout) == 1:
        if layout[0, 0]:
            v += layout[0, 0]
        return v
    lengths = layout[:, 1] - layout[:, 0]
    ends = np.cumsum(lengths)
    seg = np.searchsorted(ends, v, side="right")
    return layout[seg, 0] + (v - (ends[seg] - lengths[seg]))
