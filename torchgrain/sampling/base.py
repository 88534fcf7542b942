"""ResumableSampler: the public base of every torchgrain sampler.

A sampler is an *order* (:meth:`ResumableSampler.epoch_order`: for a seed and an epoch, a
permutation of ``[0, N)`` evaluated on demand in O(1) memory) and a *split*
(:meth:`ResumableSampler.split`: how ranks and loader workers share it out). The base does
the rest for every sampler (world discovery, padding, ``set_epoch``, iteration, exact and
elastic resume, binding, read-ahead); a new sampler is a small module of public names.

Design notes: docs/design-notes.md#sampling-base.

Example:
    >>> from torchgrain.sampling import ContiguousSplit, ResumableSampler
    >>> class Rotated(ResumableSampler):
    ...     '''The records backwards, from a point that depends on seed and epoch.'''
    ...     def epoch_order(self, seed, epoch):
    ...         n, shift = self.dataset_len, (seed + 7 * epoch) % self.dataset_len
    ...         return lambda q: (n - 1 - q + shift) % n
    ...     def split(self):
    ...         return ContiguousSplit()
    >>> s = Rotated(10, num_replicas=2, rank=0, seed=3)
    >>> list(s), list(Rotated(10, num_replicas=2, rank=1, seed=3))
    ([2, 1, 0, 9, 8], [7, 6, 5, 4, 3])
    >>> it = iter(s); _ = next(it); t = Rotated(10, num_replicas=2, rank=0)
    >>> t.load_state_dict(s.state_dict()); list(t)
    [1, 0, 9, 8]
"""

from __future__ import annotations

import itertools
import operator
import reprlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
from torch.utils.data import DistributedSampler

from torchgrain.errors import DatasetWarning, EpochNotSetWarning, warn_once
from torchgrain.frameworks import accelerate as _accelerate
from torchgrain.frameworks import dataloader as _dataloader
from torchgrain.io import process
from torchgrain.protocols import ReadsAhead, SetsEpoch
from torchgrain.sampling.binding import LoaderBinding
from torchgrain.sampling.layout import complement, compose, layout_length, layout_positions
from torchgrain.sampling.permutation import to_u64
from torchgrain.sampling.split import InterleavedSplit, Shares, Split
from torchgrain.sampling.world import check_world, resolve_world

__all__ = ["LoaderBinding", "OrderFn", "ResumableSampler", "identity_order"]

#: An epoch's order: dataset indices of positions ``q`` (int64 arrays of one shape).
OrderFn = Callable[[np.ndarray], np.ndarray]

# Python iteration converts this many indices to ints at a time.
_ITER_CHUNK = 65536

# Ranks a loaded state may name: far above any job, and the re-split of a contiguous
# order after a resume walks them one by one (2**20 ranks: about 2 s).
_MAX_WORLD = 1 << 20


def identity_order(q: np.ndarray) -> np.ndarray:
    """The unshuffled order: position ``q`` is index ``q`` (what ``shuffle=False`` uses).

    Example:
        >>> import numpy as np
        >>> identity_order(np.arange(3)).tolist()
        [0, 1, 2]
    """
    return q


_UNSET = object()

#: The digests of its dataset a state holds, compared when it is loaded (see
#: :meth:`ResumableSampler._fingerprints`).
_DIGESTS = ("dataset_files", "dataset_checksums", "dataset_compositions")


class ResumableSampler(DistributedSampler):
    """The base of every torchgrain sampler: world, split, padding, iteration, state
    and (elastic) resume. A subclass gives the order (:meth:`epoch_order`) and, when it
    is not round robin, the split (:meth:`split`); see :mod:`torchgrain.sampling.base`
    for an example.

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
    the epoch (``order(q)`` for ``q`` in ``[0, N)``). A *layout* is a list of
    ``[start, stop)`` intervals of stream positions whose concatenation (the
    *virtual stream*, length ``L``) is what the ranks split: ``[[0, N]]`` for a fresh
    epoch, the not-yet-consumed rest after an elastic resume. Rank ``r`` draws
    ``Shares.count(r)`` virtual positions (``ceil(L / W)`` padded, ``floor`` with
    drop_last, and ``L // W`` plus one for the first ``L % W`` ranks with
    ``pad=False``), which the :meth:`split` picks; virtual positions past ``L`` are
    padding and wrap around (``v mod L``), exactly like DistributedSampler's
    ``indices += indices[:padding]``.

    Args:
        dataset_or_length: a sized dataset, or its length as an int. A dataset that
            is :class:`~torchgrain.protocols.SetsEpoch` is told the epoch; one that
            :class:`~torchgrain.protocols.ReadsAhead` gets each pass's order.
        num_replicas, rank, shuffle, seed, drop_last, pad: as for
            :class:`~torchgrain.GlobalShuffleSampler`; ``shuffle=False`` replaces the
            order by :func:`identity_order` (the split still applies).
    """

    #: The name saved as ``state["sampler"]``; a state loads only into a sampler of the
    #: same name. Empty: the class's name.
    state_kind: ClassVar[str] = ""

    def __init__(
        self,
        dataset_or_length: Any,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
    ) -> None:
        is_length = isinstance(dataset_or_length, (int, np.integer))
        n = int(dataset_or_length) if is_length else len(dataset_or_length)
        if n < 0:
            raise ValueError(f"dataset length must be >= 0, got {n}")
        self.dataset = None if is_length else dataset_or_length
        # Explicit values are checked now; missing ones are looked up at each use.
        if num_replicas is not None:
            check_world(num_replicas, 0 if rank is None else rank)
        elif rank is not None and operator.index(rank) < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be >= 0")
        self._num_replicas_arg = None if num_replicas is None else operator.index(num_replicas)
        self._rank_arg = None if rank is None else operator.index(rank)
        self._external: str | None = None
        self.shuffle = bool(shuffle)
        to_u64(seed, "seed")
        self.seed = operator.index(seed)
        self.drop_last = bool(drop_last)
        self.pad = bool(pad)
        self.epoch = 0
        self._n = n
        self._files: object = _UNSET  # (_fingerprints: taken when first needed)
        # A loaded state, made into a layout and start position when the next pass starts
        # (when its world size and the loader that drives it are known).
        self._loaded: dict[str, Any] | None = None
        # What the loader that iterates the sampler said about itself (tg.bind), and
        # (deprecated) the DataLoader shape an unbound sampler found on the call stack.
        self._binding: LoaderBinding | None = None
        self._found_shape: tuple[int | None, int] | None = None
        # Counts _forget_iteration calls: which iteration the progress fields describe.
        self._iteration = 0
        self._forget_iteration()
        # (seed, epoch) of the latest pass started since the last set_epoch or
        # load_state_dict (None: none), and whether the sampler warned already of a pass
        # that repeated it (EpochNotSetWarning) or of an empty dataset.
        self._pass_key: tuple[int, int] | None = None
        self._repeat_warned = self._empty_warned = False

    # -- the contract a sampler fills ---------------------------------------------------
    def epoch_order(self, seed: int, epoch: int) -> OrderFn:
        """The order of epoch ``epoch`` under ``seed``: a function from positions ``q``
        (a fresh int64 array of values in ``[0, N)``) to dataset indices (an int64 array
        of the same shape).

        It must be a permutation of ``[0, N)`` that depends only on ``seed``, ``epoch``
        and what :meth:`order_state` saves. It should build nothing of size ``N`` per
        pass; a content-aware order may keep one value per record, read once (e.g. with
        :func:`torchgrain.sources.read_column`, mapped or shared by the workers).
        The sampler calls it when a pass starts and keeps the function for the pass, so
        a ``set_epoch`` during a pass does not change that pass. Not called with
        ``shuffle=False`` or ``N <= 1`` (the identity then).
        """
        raise NotImplementedError(f"{type(self).__name__} must define epoch_order(seed, epoch)")

    def split(self) -> Split:
        """How the order is split between ranks (and workers) now; by default
        :class:`~torchgrain.sampling.InterleavedSplit` (DistributedSampler's round
        robin). Its :meth:`~torchgrain.sampling.Split.state` is saved in
        :meth:`state_dict`."""
        return InterleavedSplit()

    def order_state(self) -> dict[str, Any]:
        """What besides seed and epoch fixes the order (plain ints and strings), saved in
        :meth:`state_dict` and handed back to :meth:`load_order_state`. Default none."""
        return {}

    def load_order_state(self, state: dict[str, Any]) -> None:
        """Check and restore what :meth:`order_state` saved in ``state``; raise
        ``ValueError`` for a state whose order this sampler cannot continue. Called by
        :meth:`load_state_dict` after its own checks, before anything changes."""

    @classmethod
    def _state_kind(cls) -> str:
        return cls.state_kind or cls.__name__

    def _order(self) -> OrderFn:
        """The current epoch's order (the identity without shuffling)."""
        if not self.shuffle or self._n <= 1:
            return identity_order
        return self.epoch_order(self.seed, self.epoch)

    # -- world ----------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` this sampler splits by, decided now."""
        if self._external is not None:
            return 1, 0
        return resolve_world(self._num_replicas_arg, self._rank_arg)

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
        if pass_start and self._binding is None and self.uses_loader_shape():
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

    def uses_loader_shape(self) -> bool:
        """Whether this sampler's split depends on its loader's batch size and workers.

        A sampler that says so and was not bound (:func:`torchgrain.bind`) looks them up
        on the call stack when a pass starts (deprecated, with a warning). Default False.
        """
        return False

    def loader_shape(self) -> tuple[int | None, int | None]:
        """``(batch_size, num_workers)`` of the loader this sampler is bound to (or, for
        an unbound sampler that :meth:`uses_loader_shape`, found iterating it); Nones if
        unknown."""
        if self._binding is not None:
            return self._binding.batch_size, self._binding.num_workers
        return self._found_shape or (None, None)

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

    @property
    def sharded_by(self) -> str | None:
        """The loader that splits this sampler's batches between processes itself
        (``module.Class``), once one is bound or found; None otherwise. The sampler then
        hands out the one global order."""
        return self._external

    @property
    def dataset_len(self) -> int:
        """``N``, the records the epoch's order covers."""
        return self._n

    # -- geometry -----------------------------------------------------------------
    def _fresh_layout(self) -> np.ndarray:
        return np.array([[0, self._n]], dtype=np.int64)

    def _forget_iteration(
        self, layout: np.ndarray | None = None, start: int = 0, world: tuple[int, int] | None = None
    ) -> None:
        # The latest iteration (none yet: a fresh epoch's): its world, layout, first
        # position, and a probe for how far it got (list iterator of the current chunk
        # and that chunk's first position).
        self._iteration += 1
        self._it_world = world
        self._it_layout = self._fresh_layout() if layout is None else layout
        self._it_start = self._it_chunk_start = start
        self._it_chunk_len = 0
        self._it_chunk: Any = None

    def _shares(self, length: int, replicas: int) -> Shares:
        """How ``replicas`` ranks of this sampler share a virtual stream of ``length``."""
        pad_to = self._pad_to() if replicas == 1 else 1
        return Shares(length, replicas, self.drop_last, self.pad, pad_to)

    def _count(self, length: int, world: tuple[int, int]) -> int:
        """Draws of rank ``world[1]`` from a virtual stream of ``length``."""
        return self._shares(length, world[0]).count(world[1])

    def _pad_to(self) -> int:
        """What the order is padded to a multiple of, under a batch-sharding loader that
        fills its last step (:attr:`LoaderBinding.pad_to`); else 1."""
        binding = self._binding
        if binding is None or self._external is None or not self.pad or self.drop_last:
            return 1
        return binding.pad_to

    def _saved_shares(self, state: dict[str, Any], length: int) -> Shares:
        """How the ranks of the world ``state`` was saved in shared ``length``."""
        replicas = operator.index(state["num_replicas"])
        pad_to = operator.index(state.get("pad_to", 1)) if replicas == 1 else 1
        drop, pad = bool(state["drop_last"]), bool(state.get("pad", True))
        return Shares(length, replicas, drop, pad, pad_to)

    def _same_order(self, state: dict[str, Any], replicas: int) -> bool:
        """Whether this sampler, over ``replicas`` ranks, continues each rank's order of
        ``state`` (the same world, drop_last, padding and split)."""
        split = self.split()
        return (
            self._saved_shares(state, 0) == self._shares(0, replicas)
            and split.from_state(state) == split
        )

    def _indices_in(
        self,
        layout: np.ndarray,
        start: int,
        stop: int,
        world: tuple[int, int],
        order: OrderFn | None = None,
    ) -> np.ndarray:
        length = layout_length(layout)
        shares = self._shares(length, world[0])
        start, stop = max(0, start), min(stop, shares.count(world[1]))
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        order = order or self._order()
        v = self.split().positions(shares, world[1], start, stop)
        if int(v.max()) >= length:  # padding: wrap around the virtual stream
            v %= length
        return order(layout_positions(layout, v))

    def _current(self) -> tuple[np.ndarray, tuple[int, int], int]:
        """Layout, world and first position of the pass that :meth:`indices` and
        :meth:`state_dict` describe: a loaded resume, else the latest iteration, else a
        fresh epoch."""
        if self._loaded is not None:
            world = self._world()
            layout, start = self._resume_layout(self._loaded, world)
            return layout, world, start
        return self._it_layout, self._it_world or self._world(), self._it_start

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
        layout, world, _ = self._current()
        stop = self._count(layout_length(layout), world) if stop is None else stop
        return self._indices_in(layout, operator.index(start), operator.index(stop), world)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; also calls ``dataset.set_epoch(epoch)`` if present.

        Setting the epoch already in effect keeps a loaded resume position, so the
        usual ``for epoch in range(start, n): sampler.set_epoch(epoch)`` loop works
        unchanged after ``load_state_dict``. A different epoch starts from its
        beginning.
        """
        epoch = operator.index(epoch)
        to_u64(epoch, "epoch")
        if epoch != self.epoch:
            self._read_ahead(None, 0, 0)  # the old order's read-ahead stops
            self.epoch = epoch
            self._loaded = None
            self._forget_iteration()
        self._propagate_epoch()

    def _propagate_epoch(self) -> None:
        """The epoch, said out loud (the same one again too: no warning of a repeated
        pass), reaches the dataset."""
        self._pass_key = None
        if isinstance(self.dataset, SetsEpoch):
            self.dataset.set_epoch(self.epoch)

    def __iter__(self) -> Iterator[int]:
        # chain() hands out the ints of each chunk's list iterator at C speed; the
        # Python generator below only runs once per chunk.
        return itertools.chain.from_iterable(self._chunks())

    def _chunks(self) -> Iterator[Iterator[int]]:
        # A generator body runs at the first next(), so iterators created and dropped
        # without being advanced (torchdata's StatefulDataLoader makes one before
        # loading state) do not consume a pending resume position.
        self._note_driver(pass_start=True)
        self._check_pass_start()
        world = self._world()
        if self._loaded is not None:
            layout, start = self._resume_layout(self._loaded, world)
            self._loaded = None
        else:
            layout, start = self._fresh_layout(), 0
        self._forget_iteration(layout, start, world)
        mine = self._iteration  # a set_epoch, a load or a newer pass ends this one's say
        count = self._count(layout_length(layout), world)
        # Bind the epoch's order now: a set_epoch or load_state_dict while this
        # iterator is alive must not change the order of its later chunks.
        order = self._order()
        self._read_ahead(lambda a, b: self._indices_in(layout, a, b, world, order), start, count)
        for s in range(start, count, _ITER_CHUNK):
            process.restart_stopped_threads()  # read-ahead stopped by a fork goes on
            stop = min(s + _ITER_CHUNK, count)
            chunk = self._indices_in(layout, s, stop, world, order).tolist()
            it = iter(chunk)
            # Keep the list iterator: its __length_hint__ says how far the consumer got.
            if self._iteration == mine:
                self._it_chunk_start, self._it_chunk_len, self._it_chunk = s, len(chunk), it
            yield it

    def _check_pass_start(self) -> None:
        """Warn once of a shuffled pass that starts at the (seed, epoch) of the previous
        one, with no ``set_epoch`` or ``load_state_dict`` in between (a loop that never
        calls ``set_epoch`` trains every epoch on one order and the same random
        transforms), and once of an empty dataset."""
        key = (self.seed, self.epoch)
        repeat = self._pass_key == key and self.shuffle and self._n > 1
        self._pass_key = key
        if repeat and not self._repeat_warned:
            self._repeat_warned = True
            warn_once(
                None,
                f"{type(self).__name__} started another pass at seed {self.seed}, epoch "
                f"{self.epoch}, with no set_epoch() since the last one: it repeats that "
                "pass's order and random transforms. Call sampler.set_epoch(epoch) before "
                "each epoch (Lightning and Accelerate do; an HF Trainer does only for the "
                "DataLoader Accelerate prepares: see torchgrain's docs/frameworks), or "
                "set_epoch() with the same epoch to repeat it on purpose.",
                EpochNotSetWarning,
            )
        if self._n == 0 and not self._empty_warned:
            self._empty_warned = True
            warn_once(
                None,
                f"{type(self).__name__} has a dataset of no records: this pass, and "
                "every pass over it, yields nothing",
                DatasetWarning,
            )

    def _read_ahead(self, order: Any, start: int, count: int) -> None:
        """Hand this pass's order to the dataset's read-ahead (remote sources with a
        shard cache download the shards it will need; see :mod:`torchgrain.io.readahead`);
        an empty range cancels it."""
        if isinstance(self.dataset, ReadsAhead):
            self.dataset.read_ahead(order, start, count, self._drawn)

    def _drawn(self) -> int:
        """Position reached by the latest iteration (draws made, incl. the resume offset)."""
        if self._it_chunk is None:
            return self._it_chunk_start + self._it_chunk_len
        return self._it_chunk_start + self._it_chunk_len - self._it_chunk.__length_hint__()

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The sampler's position, to continue exactly where it stopped.

        Args:
            consumed: how many of this rank's indices the training loop has used since the
                current pass over the loader began (``iter(loader)``): pass
                ``batches_done * batch_size``, since a DataLoader draws indices ahead of use.
                Omit it where the sampler's own count is right (iterating the sampler,
                ``num_workers=0``, torchdata's ``StatefulDataLoader``);
                :class:`~torchgrain.ResumableLoader` passes it for you. Values past the end of
                the epoch mean "epoch finished".

        Returns a plain dict (ints and lists) safe for ``torch.save`` or JSON; rank 0's state
        describes the whole job. The resume recipes (a plain DataLoader, ``StatefulDataLoader``,
        any world size): docs/samplers.md#exact-resume-also-onto-a-different-number-of-ranks.

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
        layout, world, start = self._current()
        drawn = start if self._loaded is not None else self._drawn()
        if consumed is None:
            pos = drawn
        else:
            count = self._count(layout_length(layout), world)
            pos = min(start + consumed, count)
            if drawn_only and pos > drawn:
                raise ValueError(
                    f"consumed={consumed} exceeds the {drawn - start} indices this "
                    "sampler has produced in the current pass"
                )
        state = {
            "sampler": self._state_kind(),
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
        for key, value in zip(_DIGESTS, self._fingerprints()):
            if value is not None:
                state[key] = value
        state.update(self.order_state())
        state.update(self.split().state())
        return state

    def _finished(self, state: dict[str, Any], rank: int | None = None) -> bool:
        """Whether ``state`` (saved by this sampler, or checked) is at the end of its
        pass for ``rank`` (default: this sampler's; the last rank draws the fewest)."""
        layout = np.asarray(state["layout"], dtype=np.int64).reshape(-1, 2)
        rank = self._current()[1][1] if rank is None else rank
        shares = self._saved_shares(state, layout_length(layout))
        return operator.index(state["position"]) >= shares.count(rank)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`) at the next iteration.

        The state fixes seed, epoch, shuffle and the position. With the same
        ``num_replicas``, ``drop_last`` and ``pad`` the continuation is exact: each
        rank yields what it would have yielded next without the interruption. With a
        different world size, the samples of the epoch not yet consumed globally
        are re-split over the new ranks, each exactly once (plus padding, or minus
        a tail shorter than ``num_replicas`` with drop_last). Also calls
        ``dataset.set_epoch(epoch)`` when the dataset has that method.

        The end of epoch ``e``'s pass is where epoch ``e + 1`` starts: its state loaded
        into a sampler already set to ``e + 1`` changes nothing (torchdata's
        ``StatefulDataLoader`` restores the state it saved after an epoch's loop when
        the next pass starts, after that loop's ``set_epoch(e + 1)``).
        """
        checked = self._checked_state(state)
        self.load_order_state(state)
        if checked["epoch"] + 1 == self.epoch and self._finished(checked, self._world()[1]):
            return
        self._apply_state(checked)

    def _fingerprints(self) -> tuple[str | None, ...]:
        """The dataset's digests (:data:`_DIGESTS`): its files'
        (:func:`~torchgrain.sources.node_index.derived.layout_fingerprint`), their
        checksums' and its compositions'
        (:func:`~torchgrain.sources.node_index.derived.composition_fingerprint`). Taken
        once: a state is saved at every batch under some loaders."""
        if self._files is _UNSET:
            from torchgrain.sources.node_index.derived import (
                composition_fingerprint,
                layout_fingerprint,
            )

            ds = self.dataset
            self._files = (
                (None, None, None)
                if ds is None
                else (
                    layout_fingerprint(ds),
                    layout_fingerprint(ds, checksums=True),
                    composition_fingerprint(ds),
                )
            )
        return self._files  # type: ignore[return-value]

    def _checked_state(self, state: Any) -> dict[str, Any]:
        """``state`` checked field by field (``ValueError`` for anything
        :meth:`state_dict` would not have saved), as :meth:`_apply_state` takes it;
        changes nothing."""
        if not isinstance(state, dict):
            raise ValueError(f"sampler state must be a dict, got {type(state).__name__}")
        if state.get("sampler") != self._state_kind():
            raise ValueError(f"state is for {state.get('sampler')!r}, not {self._state_kind()!r}")
        if state.get("version") != 1:
            raise ValueError(f"unsupported sampler state version {state.get('version')!r}")
        # A state may have been edited, converted or cut short: every field is checked
        # here, before anything changes, so none fails later as a builtin error.
        for key in ("seed", "epoch", "num_replicas", "dataset_len", "position", "pad_to"):
            value = state.get(key, 1 if key == "pad_to" else None)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"sampler state field {key!r} must be an int, got {value!r}")
        for key in ("shuffle", "drop_last", "pad"):
            default = True if key == "pad" else None  # states of earlier versions lack pad
            if not isinstance(state.get(key, default), (bool, np.bool_)):
                raise ValueError(f"sampler state field {key!r} must be a bool")
        to_u64(state["seed"], "seed")
        to_u64(state["epoch"], "epoch")
        if not 1 <= state["num_replicas"] <= _MAX_WORLD or state.get("pad_to", 1) < 1:
            raise ValueError(
                f"sampler state field 'num_replicas' or 'pad_to' out of range: "
                f"{state['num_replicas']}, {state.get('pad_to', 1)}"
            )
        if state["dataset_len"] != self._n:
            raise ValueError(
                f"state was saved for a dataset of {state['dataset_len']} records; "
                f"this sampler's dataset has {self._n}"
            )
        # (states of earlier releases lack some or all; a side that has no checksum of
        # every shard, its manifest not read, compares the files only)
        for key, now in zip(_DIGESTS, self._fingerprints()):
            saved = state.get(key)
            if saved is not None and not isinstance(saved, str):
                raise ValueError(f"sampler state field {key!r} must be a str, got {saved!r}")
            if saved is not None and now is not None and now != saved:
                raise ValueError(
                    "state was saved for other data: this dataset's files (their names, "
                    "record counts or checksums) or its compositions (a mixture's counts "
                    "or seed, a split, a filter's selection) are not those it was saved "
                    "with, so its indices name other records; resume with the data it was "
                    f"saved with (or delete the state's {key!r} to resume anyway)"
                )
        layout = _checked_layout(state.get("layout"), self._n)
        pos = operator.index(state["position"])
        old_count = self._saved_shares(state, layout_length(layout)).count(0)
        if not 0 <= pos <= old_count:
            raise ValueError(f"position {pos} outside [0, {old_count}] in sampler state")
        self.split().from_state(state)  # the split's own fields
        return {**state, "layout": layout.tolist(), "position": pos}

    def _apply_state(self, checked: dict[str, Any]) -> None:
        """Continue from ``checked`` (from :meth:`_checked_state`) at the next pass."""
        self._read_ahead(None, 0, 0)  # a resume starts a new pass: the walk stops
        self.seed = int(checked["seed"])
        self.shuffle = bool(checked["shuffle"])
        self.epoch = int(checked["epoch"])
        self._loaded = checked
        self._forget_iteration(np.asarray(checked["layout"], dtype=np.int64), checked["position"])
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
        pos = operator.index(state["position"])
        if self._same_order(state, world[0]):
            return layout, pos
        shares = self._saved_shares(state, layout_length(layout))
        consumed = self.split().from_state(state).consumed(shares, pos)
        # Padding draws were trained on too: they consume the positions they repeat, so
        # nothing is handed out twice.
        rest = complement(consumed, shares.length)
        return compose(layout, rest), 0


def _checked_layout(raw: Any, n: int) -> np.ndarray:
    """A saved layout as int64 ``(k, 2)``: ``k >= 1`` ascending, disjoint intervals
    inside ``[0, n]``, as :meth:`ResumableSampler.state_dict` saves them (anything else
    would repeat, reorder or drop records); else ``ValueError``."""
    try:
        layout = np.asarray(raw)
    except (TypeError, ValueError):
        layout = np.empty(0)
    if layout.dtype.kind in "iu" and layout.ndim == 2 and layout.shape[1] == 2 and len(layout):
        layout = layout.astype(np.int64)
        starts, stops = layout[:, 0], layout[:, 1]
        inside = starts[0] >= 0 and stops[-1] <= n and (stops >= starts).all()
        if inside and (starts[1:] >= stops[:-1]).all():
            return layout
    raise ValueError(f"invalid layout in sampler state: {reprlib.repr(raw)}")
