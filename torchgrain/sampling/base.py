"""ResumableSampler: rank split, padding, iteration, state and (elastic) resume.

The machinery every torchgrain sampler shares; a new sampler subclasses
:class:`ResumableSampler` and describes its epoch's order (``_stream_fn``) and how it
splits that order between ranks (``_virtual`` / ``_rank_positions`` /
``_consumed_virtual``).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

from torchgrain.frameworks import accelerate as _accelerate
from torchgrain.frameworks import dataloader as _dataloader
from torchgrain.sampling.permutation import _to_u64

__all__ = ["LoaderBinding", "ResumableSampler"]

# Python iteration converts this many indices to ints at a time.
_ITER_CHUNK = 65536


def _check_world(num_replicas: int, rank: int) -> tuple[int, int]:
    num_replicas, rank = operator.index(num_replicas), operator.index(rank)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(
            f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
        )
    return num_replicas, rank


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _dist_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """World size and rank, decided now: explicit values, else the initialised process
    group, else torchrun's ``WORLD_SIZE``/``RANK`` environment, else (1, 0).

    A process started by a launcher (``WORLD_SIZE > 1``) without ``RANK`` and without
    a process group cannot know its part of the data: that raises instead of silently
    reading everything, as :class:`~torch.utils.data.DistributedSampler` does.
    """
    import torch.distributed as dist

    if num_replicas is None or rank is None:
        if dist.is_available() and dist.is_initialized():
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        else:
            env_world = _env_int("WORLD_SIZE")
            if env_world is not None and env_world > 1 and num_replicas is None:
                env_rank = _env_int("RANK")
                if env_rank is None and rank is None:
                    raise RuntimeError(
                        f"WORLD_SIZE={env_world} is set but RANK is not, and no torch.distributed "
                        "process group is initialised, so this process cannot tell which part "
                        "of the data is its own. Call torch.distributed.init_process_group() "
                        "before iterating the sampler, or pass num_replicas= and rank="
                    )
                num_replicas = env_world
                rank = env_rank if rank is None else rank
            num_replicas = 1 if num_replicas is None else num_replicas
            rank = 0 if rank is None else rank
    return _check_world(num_replicas, rank)


@dataclasses.dataclass(frozen=True)
class LoaderBinding:
    """How the loader that iterates a sampler uses it: what :func:`torchgrain.bind`
    tells the sampler (:meth:`ResumableSampler.bind_loader`).

    Attributes:
        batch_size: indices the DataLoader takes from the sampler per batch (None
            without automatic batching).
        num_workers: the DataLoader's worker processes.
        sharder: what splits the loader's batches between processes, when the loader
            does that itself (e.g. ``"accelerate.data_loader.BatchSamplerShard"``).
            The sampler then hands out the one global order (``num_replicas`` 1)
            instead of its rank's part. None for a loader that does not.
        step: positions of the sampler's order one step of the training loop takes
            (all processes together, under a sharder); default ``batch_size``.
        reads_for_all: one process reads every batch and sends each process its part
            (Accelerate's ``dispatch_batches``): the other processes' samplers draw
            nothing, and only the steps taken tell where they are.
        pad_to: under a ``sharder``, the sampler pads its order to a multiple of this
            by repeating the order's first positions (as ``DistributedSampler`` pads),
            the way the loader would fill its last step itself. The loader then never
            fills from the first batches of the current pass, which after a resume are
            other samples, so a resume stays exact at the end of the epoch too. 1 (no
            padding) for a loader that drops or does not even out its last step, and
            for a sampler built with ``pad=False`` or ``drop_last=True``.

    Example:
        >>> from torchgrain.sampling import GlobalShuffleSampler
        >>> s = GlobalShuffleSampler(40, seed=1)
        >>> s.bind_loader(LoaderBinding(batch_size=5, sharder="my.Sharder", step=10))
        >>> (s.num_replicas, len(s))  # the sharder splits: the sampler keeps the whole order
        (1, 40)
    """

    batch_size: int | None = None
    num_workers: int = 0
    sharder: str | None = None
    step: int | None = None
    reads_for_all: bool = False
    pad_to: int = 1

    def __post_init__(self) -> None:
        if operator.index(self.pad_to) < 1:
            raise ValueError(f"pad_to must be >= 1, got {self.pad_to}")
        for name in ("batch_size", "step"):
            value = getattr(self, name)
            if value is not None and (operator.index(value) < 1):
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if operator.index(self.num_workers) < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")

    @property
    def positions_per_step(self) -> int | None:
        """Positions of the sampler's order one step of the training loop takes."""
        return self.step if self.step is not None else self.batch_size


def _identity(q: np.ndarray) -> np.ndarray:
    return q


def _complement(intervals: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The parts of ``[0, length)`` not covered by ``intervals`` of virtual positions.

    Positions past the end are padding and stand for ``v mod length`` (as in
    DistributedSampler, whose padding repeats the order's first indices), so a
    padding draw covers the position it repeats.
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


class ResumableSampler(DistributedSampler):
    """Shared machinery: rank split, padding, iteration, state and (elastic) resume.

    A subclass of :class:`torch.utils.data.distributed.DistributedSampler` (without
    its constructor), so frameworks that check for one (PyTorch Lightning keeps a
    ``DistributedSampler`` in place instead of wrapping it) see what it is.

    World size and rank are decided when the sampler is used (an iteration starts,
    ``len``, ``indices``, ``state_dict``), not when it is built: from explicit
    ``num_replicas``/``rank``, else the process group, else torchrun's environment.
    Bound to a loader that splits batches between processes itself
    (:meth:`bind_loader`, which :func:`torchgrain.bind` calls for Accelerate's
    prepared loaders), the sampler hands out the one global order and lets the loader
    split it; it remembers that from then on. A sampler nobody bound finds Accelerate's
    loaders by itself (:mod:`torchgrain.frameworks.accelerate`).

    Vocabulary. The *epoch stream* is the sampler's order of all ``N`` indices for
    the epoch (``stream(q)`` for ``q`` in ``[0, N)``). A *layout* is a list of
    ``[start, stop)`` intervals of stream positions whose concatenation (the
    *virtual stream*, length ``L``) is what the ranks split: ``[[0, N]]`` for a fresh
    epoch, the not-yet-consumed rest after an elastic resume. Rank ``r`` draws
    ``count(L, r)`` virtual positions (``ceil(L / W)`` padded, ``floor`` with
    drop_last, and ``L // W`` plus one for the first ``L % W`` ranks with
    ``pad=False``); virtual positions past ``L`` are padding and wrap around
    (``v mod L``), exactly like DistributedSampler's ``indices += indices[:padding]``.
    """

    _kind = "base"

    def __init__(
        self,
        n: int,
        dataset: Any,
        num_replicas: int | None,
        rank: int | None,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        pad: bool = True,
    ) -> None:
        self.dataset = dataset
        # Explicit values are checked now; missing ones are looked up at each use.
        if num_replicas is not None and rank is not None:
            _check_world(num_replicas, rank)
        elif num_replicas is not None:
            _check_world(num_replicas, 0)
        elif rank is not None and operator.index(rank) < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be >= 0")
        self._num_replicas_arg = None if num_replicas is None else operator.index(num_replicas)
        self._rank_arg = None if rank is None else operator.index(rank)
        self._external: str | None = None
        self.shuffle = bool(shuffle)
        _to_u64(seed, "seed")
        self.seed = operator.index(seed)
        self.drop_last = bool(drop_last)
        self.pad = bool(pad)
        self.epoch = 0
        self._n = n
        # A loaded state, made into a layout and start position when the next pass starts
        # (when its world size and the loader that drives it are known).
        self._loaded: dict[str, Any] | None = None
        # What the loader that iterates the sampler said about itself (tg.bind), and
        # (deprecated) the DataLoader shape an unbound sampler found on the call stack.
        self._binding: LoaderBinding | None = None
        self._found_shape: tuple[int | None, int] | None = None
        # The latest iteration: its world, layout, first position, and a probe for how
        # far it got (list iterator of the current chunk and that chunk's first position).
        self._it_world: tuple[int, int] | None = None
        self._it_layout = self._fresh_layout()
        self._it_start = 0
        self._it_chunk_start = 0
        self._it_chunk_len = 0
        self._it_chunk: Any = None

    # -- world ----------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` this sampler splits by, decided now."""
        if self._external is not None:
            return 1, 0
        return _dist_world(self._num_replicas_arg, self._rank_arg)

    def bind_loader(self, binding: LoaderBinding) -> None:
        """Be told how the loader that iterates this sampler uses it.

        :func:`torchgrain.bind` (and :class:`~torchgrain.ResumableLoader`) call this with
        what the loader says about itself; call it yourself for a loader torchgrain does
        not know. Under a ``sharder`` the sampler hands out the one global order from
        then on (it raises if it was built with ``num_replicas > 1``).
        """
        if not isinstance(binding, LoaderBinding):
            raise TypeError(f"binding must be a LoaderBinding, got {type(binding).__name__}")
        if binding.sharder is not None:
            self._adopt_sharder(binding.sharder)
        self._binding = binding

    def _adopt_sharder(self, sharder: str) -> None:
        if self._external is not None:
            return
        if self._num_replicas_arg is not None and self._num_replicas_arg > 1:
            raise ValueError(
                f"{type(self).__name__}(num_replicas={self._num_replicas_arg}) splits the data "
                f"between processes itself, but it is driven by {sharder}, which splits batches "
                "between processes too: each process would see 1/num_replicas of its part. "
                "Build the sampler without num_replicas and rank."
            )
        self._external = sharder
        self._it_world = None

    def _note_driver(self, pass_start: bool) -> None:
        """At any use: an Accelerate loader that splits the batches drawn from this
        sampler, found on the call stack even when nobody bound the sampler (the
        sampler then switches to the global order). At the start of a pass, for a
        sampler that deals batches to workers and was not bound: the DataLoader's
        shape, found on the call stack (deprecated)."""
        if self._external is None:
            sharder = _accelerate.sharder_driving(self, skip=3)
            if sharder is not None:
                self._adopt_sharder(sharder)
        if pass_start and self._binding is None and self._wants_loader_shape():
            shape = _dataloader.driving_loader_shape(self, skip=3)
            if shape is not None and shape != self._found_shape:
                warnings.warn(
                    f"{type(self).__name__} learned its DataLoader's batch_size and "
                    "num_workers by inspecting the call stack; that is deprecated and will be "
                    "removed. Bind the loader with tg.bind(loader) (tg.ResumableLoader does "
                    "it for you), or pass batch_size= and num_workers= to the sampler.",
                    DeprecationWarning,
                    stacklevel=4,
                )
            self._found_shape = shape

    def _wants_loader_shape(self) -> bool:
        """Whether this sampler's order depends on its DataLoader's shape."""
        return False

    def _loader_shape(self) -> tuple[int | None, int | None]:
        """``(batch_size, num_workers)`` of the loader, as bound (or found); Nones if
        unknown."""
        if self._binding is not None:
            return self._binding.batch_size, self._binding.num_workers
        if self._found_shape is not None:
            return self._found_shape
        return None, None

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        """World size the sampler splits by (1 when an outer wrapper splits batches)."""
        return self._world()[0]

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._num_replicas_arg = operator.index(value)

    @property
    def rank(self) -> int:  # type: ignore[override]
        """This process's rank in the split (0 when an outer wrapper splits batches)."""
        return self._world()[1]

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank_arg = operator.index(value)

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        """Indices this rank draws in a full epoch (``len(self)``)."""
        return self._count(self._n, self._world())

    @property
    def total_size(self) -> int:  # type: ignore[override]
        """Draws of all ranks together in a full epoch, padding included."""
        w, _ = self._world()
        if self.pad or self.drop_last:
            return self._count(self._n, (w, 0)) * w
        return self._n

    # -- geometry -----------------------------------------------------------------
    def _fresh_layout(self) -> np.ndarray:
        return np.array([[0, self._n]], dtype=np.int64)

    def _count(self, length: int, world: tuple[int, int]) -> int:
        """Draws of rank ``world[1]`` from a virtual stream of ``length``."""
        if world[0] == 1:
            return _padded_count(length, self._pad_to())
        return _rank_count(length, world[0], world[1], self.drop_last, self.pad)

    def _pad_to(self) -> int:
        """What the order is padded to a multiple of, under a batch-sharding loader that
        fills its last step (:attr:`LoaderBinding.pad_to`); else 1."""
        binding = self._binding
        if binding is None or self._external is None or not self.pad or self.drop_last:
            return 1
        return binding.pad_to

    def _virtual(self, j: int, count: int, length: int, world: tuple[int, int]) -> tuple[int, int]:
        """Virtual position of this rank's position ``j`` and the step to ``j + 1``.

        Positions past the virtual stream's end (padding) are wrapped by the caller.
        """
        raise NotImplementedError

    def _rank_positions(
        self, start: int, stop: int, count: int, length: int, world: tuple[int, int]
    ) -> np.ndarray | None:
        """Virtual positions of this rank's positions ``[start, stop)``, when they are
        not the arithmetic progression that :meth:`_virtual` describes (else None)."""
        return None

    def _consumed_virtual(
        self, length: int, replicas: int, pos: int, state: dict[str, Any]
    ) -> list[tuple[int, int]]:
        """Virtual intervals consumed when every one of ``replicas`` ranks drew ``pos``
        (or all it had) in the order that ``state`` (the saved state) describes."""
        raise NotImplementedError

    def _same_order(self, state: dict[str, Any]) -> bool:
        """Whether this sampler's per-rank order equals the one ``state`` was saved in,
        given the same world size and drop_last."""
        return bool(state.get("pad", True)) == self.pad and state.get("pad_to", 1) == (
            self._pad_to() if operator.index(state["num_replicas"]) == 1 else 1
        )

    def _stream_fn(self) -> Callable[[np.ndarray], np.ndarray]:
        """The current epoch's stream: maps positions ``q`` (int64 in ``[0, N)``) to indices.

        The function is bound to the current seed, epoch and shuffle, so an iterator
        that holds it keeps its order if the sampler changes epoch meanwhile.
        """
        raise NotImplementedError

    def _layout_positions(self, layout: np.ndarray, v: np.ndarray) -> np.ndarray:
        if len(layout) == 1:
            return v + layout[0, 0]
        lengths = layout[:, 1] - layout[:, 0]
        ends = np.cumsum(lengths)
        seg = np.searchsorted(ends, v, side="right")
        return layout[seg, 0] + (v - (ends[seg] - lengths[seg]))

    def _indices_in(
        self,
        layout: np.ndarray,
        start: int,
        stop: int,
        world: tuple[int, int],
        stream: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> np.ndarray:
        length = _layout_length(layout)
        count = self._count(length, world)
        start, stop = max(0, start), min(stop, count)
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        stream = stream or self._stream_fn()
        v = self._rank_positions(start, stop, count, length, world)
        if v is not None:  # an order that is not an arithmetic progression
            if int(v.max()) >= length:  # padding: wrap around the virtual stream
                v %= length
            return stream(self._layout_positions(layout, v))
        first, step = self._virtual(start, count, length, world)
        last = first + step * (stop - start - 1)
        if last < length and len(layout) == 1:  # common case: one arange, no padding
            base = first + int(layout[0, 0])
            return stream(np.arange(base, base + step * (stop - start), step, dtype=np.int64))
        v = np.arange(first, last + 1, step, dtype=np.int64)
        if last >= length:  # padding: wrap around the virtual stream
            v %= length
        return stream(self._layout_positions(layout, v))

    def _current(self) -> tuple[np.ndarray, tuple[int, int]]:
        """Layout and world of the pass that :meth:`indices` and :meth:`state_dict`
        describe: a loaded resume, else the latest iteration, else a fresh epoch."""
        if self._loaded is not None:
            world = self._world()
            return self._resume_layout(self._loaded, world)[0], world
        return self._it_layout, self._it_world or self._world()

    # -- public API -----------------------------------------------------------------
    def __len__(self) -> int:
        """Indices per rank in a full epoch (as DistributedSampler's ``num_samples``)."""
        self._note_driver(pass_start=False)
        return self.num_samples

    def indices(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """This rank's dataset indices at its positions ``[start, stop)``, as int64.

        The range is clipped to ``[0, len(self)]`` like a slice.

        Positions count this rank's draws in the current epoch, ``0 .. len(self)``
        (after a resume onto a different world size, the resumed pass's own
        positions). ``list(sampler) == sampler.indices(0, len(sampler)).tolist()``
        on a fresh epoch.
        """
        layout, world = self._current()
        stop = self._count(_layout_length(layout), world) if stop is None else stop
        return self._indices_in(layout, operator.index(start), operator.index(stop), world)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; also calls ``dataset.set_epoch(epoch)`` if present.

        Setting the epoch already in effect keeps a loaded resume position, so the
        usual ``for epoch in range(start, n): sampler.set_epoch(epoch)`` loop works
        unchanged after ``load_state_dict``. A different epoch starts from its
        beginning.
        """
        epoch = operator.index(epoch)
        _to_u64(epoch, "epoch")
        if epoch != self.epoch:
            self._read_ahead(None, 0, 0)  # the old order's read-ahead stops
            self.epoch = epoch
            self._loaded = None
            self._on_epoch_change()
            self._it_world = None
            self._it_layout = self._fresh_layout()
            self._it_start = self._it_chunk_start = self._it_chunk_len = 0
            self._it_chunk = None
        self._propagate_epoch()

    def _on_epoch_change(self) -> None:
        pass

    def _propagate_epoch(self) -> None:
        hook = getattr(self.dataset, "set_epoch", None)
        if callable(hook):
            hook(self.epoch)

    def __iter__(self) -> Iterator[int]:
        # chain() hands out the ints of each chunk's list iterator at C speed; the
        # Python generator below only runs once per chunk.
        return itertools.chain.from_iterable(self._chunks())

    def _chunks(self) -> Iterator[Iterator[int]]:
        # A generator body runs at the first next(), so iterators created and dropped
        # without being advanced (torchdata's StatefulDataLoader makes one before
        # loading state) do not consume a pending resume position.
        self._note_driver(pass_start=True)
        world = self._world()
        if self._loaded is not None:
            layout, start = self._resume_layout(self._loaded, world)
            self._loaded = None
        else:
            layout, start = self._fresh_layout(), 0
        self._it_world, self._it_layout, self._it_start = world, layout, start
        self._it_chunk_start, self._it_chunk_len, self._it_chunk = start, 0, None
        count = self._count(_layout_length(layout), world)
        # Bind the epoch's order now: a set_epoch or load_state_dict while this
        # iterator is alive must not change the order of its later chunks.
        stream = self._stream_fn()
        self._read_ahead(lambda a, b: self._indices_in(layout, a, b, world, stream), start, count)
        for s in range(start, count, _ITER_CHUNK):
            stop = min(s + _ITER_CHUNK, count)
            chunk = self._indices_in(layout, s, stop, world, stream).tolist()
            it = iter(chunk)
            # Keep the list iterator: its __length_hint__ says how far the consumer got.
            self._it_chunk_start, self._it_chunk_len, self._it_chunk = s, len(chunk), it
            yield it

    def _read_ahead(self, order: Any, start: int, count: int) -> None:
        """Hand this pass's order to the dataset's read-ahead (remote sources with a
        shard cache download the shards it will need; see :mod:`torchgrain.io.readahead`);
        an empty range cancels it."""
        hook = getattr(self.dataset, "read_ahead", None)
        if callable(hook):
            hook(order, start, count, self._drawn)

    def _drawn(self) -> int:
        """Position reached by the latest iteration (draws made, incl. the resume offset)."""
        if self._it_chunk is None:
            return self._it_chunk_start + self._it_chunk_len
        return self._it_chunk_start + self._it_chunk_len - self._it_chunk.__length_hint__()

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The sampler's position, to continue exactly where it stopped.

        Args:
            consumed: how many of this rank's indices the training loop has used
                since the current pass over the loader began (``iter(loader)``).
                A DataLoader draws indices ahead of use (``prefetch_factor *
                num_workers`` batches), so the sampler's own count runs ahead;
                pass ``consumed=batches_done * batch_size`` to record what the loop
                has really used. Omit it when the sampler's own count is right:
                iterating the sampler directly, ``num_workers=0``, or torchdata's
                ``StatefulDataLoader`` (it snapshots ``state_dict()`` at the moment
                each batch's indices are drawn, so its saved state is exact).
                :class:`~torchgrain.ResumableLoader` passes it for you.
                Values past the end of the epoch mean "epoch finished".

        Returns a plain dict (ints and lists) safe for ``torch.save`` or JSON. All
        ranks run in lockstep, so rank 0's state describes the whole job: the
        samples consumed globally are every rank's first ``position`` draws of the
        layout (or all of its draws, for a rank that has fewer with ``pad=False``).

        Resume recipe with a plain DataLoader::

            # save, after `step` batches of this epoch's pass over `loader`
            ckpt = {"sampler": sampler.state_dict(consumed=step * batch_size), ...}
            # restore, in a new process (any world size)
            sampler.load_state_dict(ckpt["sampler"])
            for epoch in range(sampler.epoch, epochs):
                sampler.set_epoch(epoch)        # same epoch: keeps the position
                for batch in loader: ...        # continues with the next batch

        With ``num_workers > 0`` use ``step * batch_size`` counted by the loop, not
        ``state_dict()`` alone. With ``drop_last=True`` on the DataLoader the count
        is still ``step * batch_size``; a final partial batch may be counted in full
        (values past the end of the epoch mean "finished").

        Resume recipe with ``torchdata.stateful_dataloader.StatefulDataLoader``
        (it stores this sampler's state inside its own)::

            ckpt = {"loader": loader.state_dict(), "epoch": epoch, ...}
            # restore: same sampler arguments (any world size), then
            loader.load_state_dict(ckpt["loader"])
            for epoch in range(ckpt["epoch"], epochs):
                sampler.set_epoch(epoch)
                for batch in loader: ...

        Example:
            >>> from torchgrain import GlobalShuffleSampler
            >>> s = GlobalShuffleSampler(100, num_replicas=1, rank=0, seed=1)
            >>> it = iter(s); head = [next(it) for _ in range(30)]
            >>> t = GlobalShuffleSampler(100, num_replicas=1, rank=0)
            >>> t.load_state_dict(s.state_dict())
            >>> head + list(t) == list(s)
            True
        """
        return self._state(consumed, drawn_only=True)

    def _state(self, consumed: int | None, drawn_only: bool) -> dict[str, Any]:
        """:meth:`state_dict`; with ``drawn_only=False`` the position may lie past what
        this process's sampler has drawn: for a process whose sampler is not iterated
        because another process reads for it (Accelerate's ``dispatch_batches``: the
        loop still counts the steps it takes)."""
        if consumed is not None:
            consumed = operator.index(consumed)
            if consumed < 0:
                raise ValueError(f"consumed must be >= 0, got {consumed}")
        if self._loaded is not None:
            if consumed in (None, 0):
                return dict(self._loaded)  # not resumed yet: the position is the one loaded
            if drawn_only:
                raise ValueError(
                    "consumed must be 0 or None before iteration of a loaded state starts"
                )
            world = self._world()
            layout, start = self._resume_layout(self._loaded, world)
            drawn = start
        else:
            layout, world = self._current()
            start, drawn = self._it_start, self._drawn()
        if consumed is None:
            pos = drawn
        else:
            count = self._count(_layout_length(layout), world)
            pos = min(start + consumed, count)
            if drawn_only and pos > drawn:
                raise ValueError(
                    f"consumed={consumed} exceeds the {drawn - start} indices this "
                    "sampler has produced in the current pass"
                )
        state = {
            "sampler": self._kind,
            "version": 1,
            "seed": self.seed,
            "epoch": self.epoch,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "pad": self.pad,
            "num_replicas": world[0],
            "dataset_len": self._n,
            "layout": [[int(s), int(e)] for s, e in layout],
            "position": int(pos),
        }
        if world[0] == 1 and self._pad_to() > 1:
            state["pad_to"] = self._pad_to()
        state.update(self._extra_state())
        return state

    def _finished(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` (saved by this sampler) is at the end of its pass."""
        layout = np.asarray(state["layout"], dtype=np.int64).reshape(-1, 2)
        world = (operator.index(state["num_replicas"]), self._current()[1][1])
        length = _layout_length(layout)
        if world[0] == 1:
            count = _padded_count(length, operator.index(state.get("pad_to", 1)))
        else:
            count = self._count(length, world)
        return operator.index(state["position"]) >= count

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _check_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`) at the next iteration.

        The state fixes seed, epoch, shuffle and the position. With the same
        ``num_replicas``, ``drop_last`` and ``pad`` the continuation is exact: each
        rank yields what it would have yielded next without the interruption. With a
        different world size, the samples of the epoch not yet consumed globally
        are re-split over the new ranks, each exactly once (plus padding, or minus
        a tail shorter than ``num_replicas`` with drop_last). Also calls
        ``dataset.set_epoch(epoch)`` when the dataset has that method.
        """
        self._read_ahead(None, 0, 0)  # a resume starts a new pass: the walk stops
        if state.get("sampler") != self._kind:
            raise ValueError(f"state is for {state.get('sampler')!r}, not {self._kind!r}")
        if state.get("version") != 1:
            raise ValueError(f"unsupported sampler state version {state.get('version')!r}")
        if state["dataset_len"] != self._n:
            raise ValueError(
                f"state was saved for a dataset of {state['dataset_len']} records; "
                f"this sampler's dataset has {self._n}"
            )
        self._check_extra_state(state)
        layout = np.asarray(state["layout"], dtype=np.int64).reshape(-1, 2)
        if (
            (layout[:, 0] < 0).any()
            or (layout[:, 1] > self._n).any()
            or (layout[:, 1] < layout[:, 0]).any()
        ):
            raise ValueError(f"invalid layout in sampler state: {state['layout']!r}")
        old_w = operator.index(state["num_replicas"])
        old_drop = bool(state["drop_last"])
        old_pad = bool(state.get("pad", True))
        pos = operator.index(state["position"])
        length = _layout_length(layout)
        old_count = _rank_count(length, old_w, 0, old_drop, old_pad)
        if old_w == 1:
            old_count = _padded_count(length, operator.index(state.get("pad_to", 1)))
        if not 0 <= pos <= old_count:
            raise ValueError(f"position {pos} outside [0, {old_count}] in sampler state")

        self.seed = state["seed"]
        self.shuffle = bool(state["shuffle"])
        epoch_changed = state["epoch"] != self.epoch
        self.epoch = state["epoch"]
        self._load_extra_state(state, epoch_changed)

        self._loaded = {**state, "layout": layout.tolist(), "position": pos}
        self._it_world = None
        self._it_layout, self._it_start = layout, pos
        self._it_chunk_start, self._it_chunk_len, self._it_chunk = pos, 0, None
        self._propagate_epoch()

    def _resume_layout(
        self, state: dict[str, Any], world: tuple[int, int]
    ) -> tuple[np.ndarray, int]:
        """``(layout, start position)`` that continues ``state`` in ``world``.

        With the same world size, drop_last, padding and per-rank order the position
        carries over (each rank yields what it would have yielded next); otherwise the
        samples not consumed globally are re-split over the new ranks, from position 0.
        """
        layout = np.asarray(state["layout"], dtype=np.int64).reshape(-1, 2)
        old_w = operator.index(state["num_replicas"])
        pos = operator.index(state["position"])
        if (
            old_w == world[0]
            and bool(state["drop_last"]) == self.drop_last
            and self._same_order(state)
        ):
            return layout, pos
        consumed = self._consumed_virtual(_layout_length(layout), old_w, pos, state)
        # Padding draws were trained on too: they consume the positions they repeat, so
        # nothing is handed out twice.
        rest = _complement(consumed, _layout_length(layout))
        return self._compose(layout, rest), 0

    def _load_extra_state(self, state: dict[str, Any], epoch_changed: bool) -> None:
        if epoch_changed:
            self._on_epoch_change()

    @staticmethod
    def _compose(layout: np.ndarray, virtual: list[tuple[int, int]]) -> np.ndarray:
        """Stream intervals of the given virtual intervals of ``layout``."""
        out: list[tuple[int, int]] = []
        base = 0
        for s, e in layout.tolist():
            seg_len = e - s
            for vs, ve in virtual:
                lo, hi = max(vs, base), min(ve, base + seg_len)
                if lo < hi:
                    a, b = s + lo - base, s + hi - base
                    if out and out[-1][1] == a:
                        out[-1] = (out[-1][0], b)
                    else:
                        out.append((a, b))
            base += seg_len
        if not out:
            out.append((0, 0))
        return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def _layout_length(layout: np.ndarray) -> int:
    return int((layout[:, 1] - layout[:, 0]).sum())


def _padded_count(length: int, pad_to: int) -> int:
    """Draws of a single replica from a stream of ``length`` padded to a multiple of
    ``pad_to``."""
    if pad_to <= 1 or length <= 0:
        return length
    return -(-length // pad_to) * pad_to


def _rank_count(length: int, w: int, r: int, drop_last: bool, pad: bool) -> int:
    """Draws of rank ``r`` of ``w`` from a virtual stream of ``length``."""
    if drop_last:
        return length // w
    if pad:
        return -(-length // w)
    return length // w + (r < length % w)


def _run_start(length: int, w: int, r: int, drop_last: bool, pad: bool) -> int:
    """First virtual position of rank ``r``'s contiguous run (BlockShuffleSampler)."""
    if pad and not drop_last:
        return r * -(-length // w)
    return r * (length // w) + (0 if drop_last else min(r, length % w))


def _length_of(dataset_or_length: Any) -> int:
    if isinstance(dataset_or_length, (int, np.integer)):
        n = int(dataset_or_length)
    else:
        n = len(dataset_or_length)
    if n < 0:
        raise ValueError(f"dataset length must be >= 0, got {n}")
    return n
