"""ResumableLoader: exact, O(1) mid-epoch resume for any loader over a torchgrain sampler.

A DataLoader draws indices ahead of use (its workers prefetch, and wrappers such as
Accelerate's prepared loaders hold one more batch back), so a sampler's own count runs
ahead of the training loop. :class:`ResumableLoader` sits where the loop takes its
batches: it counts them, and its :meth:`~ResumableLoader.state_dict` is the sampler's
position at exactly that point. :meth:`~ResumableLoader.load_state_dict` puts the
sampler there directly, without drawing the skipped indices again, so a resume at
position 10^8 costs what a resume at position 10 does.

:func:`bind` is how a loader tells its torchgrain sampler how it uses it (batch size,
workers, and whether the loader itself splits batches between processes).
:class:`ResumableLoader` binds the loader it wraps; call :func:`bind` yourself for a
loader you iterate directly.
"""

from __future__ import annotations

import numbers
import reprlib
from collections.abc import Iterator
from typing import Any, TypeVar

from torchgrain.frameworks import accelerate as _accelerate
from torchgrain.protocols import SetsEpoch
from torchgrain.sampling.base import LoaderBinding, ResumableSampler

__all__ = ["ResumableLoader", "bind"]

L = TypeVar("L")

_STATE_VERSION = 1


def find_sampler(loader: Any, sampler: ResumableSampler | None = None) -> ResumableSampler:
    """The torchgrain sampler that orders ``loader``'s batches: ``sampler`` when given
    (checked to be one), else found on the loader.

    Looks where torch's DataLoader and Accelerate's prepared loaders keep it: the
    ``sampler``, the ``batch_sampler``'s ``sampler``, and one level of batch-sampler
    wrapping (Accelerate's ``BatchSamplerShard``).
    """
    if sampler is not None:
        if not isinstance(sampler, ResumableSampler):
            raise TypeError(f"sampler must be a torchgrain sampler, got {type(sampler).__name__}")
        return sampler
    seen: list[Any] = []
    for attr in ("sampler", "batch_sampler"):
        obj = getattr(loader, attr, None)
        for _ in range(4):
            if obj is None:
                break
            seen.append(obj)
            if isinstance(obj, ResumableSampler):
                return obj
            obj = getattr(obj, "sampler", None) or getattr(obj, "batch_sampler", None)
    names = ", ".join(type(o).__name__ for o in seen) or "none"
    raise TypeError(
        f"{type(loader).__name__} is not ordered by a torchgrain sampler (found: {names}); "
        "build its DataLoader with sampler=tg.GlobalShuffleSampler(...) or "
        "tg.BlockShuffleSampler(...), or pass sampler= to ResumableLoader"
    )


def _binding_of(loader: Any) -> LoaderBinding:
    """What ``loader`` says about how it uses its sampler (public attributes, and
    :mod:`torchgrain.frameworks.accelerate` for Accelerate's prepared loaders).

    A loader that hands out batches in the order its workers finish them (``in_order=False``
    with workers) is refused: neither the batches a loop took nor the sampler's own count
    tell which of the drawn positions are done.
    """
    if getattr(loader, "in_order", True) is False and getattr(loader, "num_workers", 0):
        raise ValueError(
            f"{type(loader).__name__}(in_order=False, num_workers={loader.num_workers}) hands "
            "out batches as its workers finish them, so no position in the sampler's order "
            "says which were read: a resume would repeat some and lose others. Build it with "
            "in_order=True (the default)"
        )
    described = _accelerate.describe(loader)
    if described is not None:
        return LoaderBinding(**described)
    batch_size = getattr(loader, "batch_size", None)
    if not isinstance(batch_size, int):
        batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if not isinstance(batch_size, int) or batch_size < 1:
        batch_size = None
    num_workers = getattr(loader, "num_workers", 0)
    num_workers = num_workers if isinstance(num_workers, int) and num_workers > 0 else 0
    return LoaderBinding(batch_size=batch_size, num_workers=num_workers)


def bind(loader: L, *, sampler: ResumableSampler | None = None) -> L:
    """Tell the torchgrain sampler of ``loader`` how the loader uses it; returns ``loader``.

    The sampler learns the loader's ``batch_size`` and ``num_workers`` (which
    :class:`~torchgrain.BlockShuffleSampler` deals batches to workers by, with
    ``deal_to_workers=True``) and whether the loader splits batches between processes
    itself, as the loaders HF Accelerate's ``accelerator.prepare`` returns do (the
    sampler then hands out the one global order and lets the loader split it).
    :class:`ResumableLoader` calls this for the loader it wraps. Bind the loader you
    actually iterate: the one ``accelerator.prepare`` returned, not the one you gave it.

    Works with torch's ``DataLoader``, torchdata's ``StatefulDataLoader``, Accelerate's
    prepared loaders, Ray Train's ``prepare_data_loader`` result, and any loader with
    ``batch_size``/``num_workers`` attributes and a ``sampler`` (or
    ``batch_sampler.sampler``); pass ``sampler=`` when it is kept elsewhere. A loader with
    ``in_order=False`` and workers raises ``ValueError`` (its batches come in no order a
    position can describe). For a loader
    that splits batches in a way torchgrain does not know, call
    :meth:`~torchgrain.sampling.ResumableSampler.bind_loader` with a
    :class:`~torchgrain.LoaderBinding` instead.

    Example:
        >>> import torch, torchgrain as tg
        >>> sampler = tg.BlockShuffleSampler(None, block_offsets=[0, 10, 20, 30, 40],
        ...                                  window=2, seed=0, deal_to_workers=True,
        ...                                  num_replicas=1, rank=0)
        >>> loader = tg.bind(torch.utils.data.DataLoader(
        ...     list(range(40)), batch_size=5, sampler=sampler, num_workers=2))
        >>> sampler.state_dict()["batch_size"], sampler.state_dict()["num_workers"]
        (5, 2)
    """
    target = loader.loader if isinstance(loader, ResumableLoader) else loader
    if sampler is None and isinstance(loader, ResumableLoader):
        sampler = loader.sampler
    find_sampler(target, sampler).bind_loader(_binding_of(target))
    return loader


class ResumableLoader:
    """Wraps a loader ordered by a torchgrain sampler; resumes exactly where the loop stopped.

    Iterate it instead of the loader. It counts the batches the training loop has
    taken in the current pass, so :meth:`state_dict` records the sampler's position
    at exactly that point (not where prefetching workers have got to), and
    :meth:`load_state_dict` continues from there in a new process, on the same or a
    different number of ranks: no batch repeated or skipped, in the same order, with
    the same ``random_map`` draws (they depend on (seed, epoch, index) only). Loading
    costs the same at any position; nothing skipped is drawn again. A batch the loader
    fails to make raises its error in the loop and counts as taken: the pass goes on
    after it, as a ``DataLoader``'s does, and a state saved later resumes after it.

    Each complete pass moves the sampler on to the next epoch (calling ``set_epoch``
    yourself with the same numbers is harmless), so epochs differ without it. Every
    other attribute (``dataset``, ``batch_size``, ``sampler``, ...) is the wrapped
    loader's.

    A dataset that :class:`~torchgrain.protocols.SetsEpoch` (a mixture, random maps)
    is told each pass's epoch as the pass starts when the sampler does not tell it
    (a sampler built from a length).

    It binds the loader to the sampler (:func:`bind`), which refuses a loader with
    ``in_order=False`` and workers. Works with a torch
    ``DataLoader``, with loaders prepared by HF Accelerate (``accelerator.prepare``, in
    every mode: ``split_batches``, ``dispatch_batches``, ``even_batches=False``), whose
    batches the sampler then orders globally (register it with
    ``accelerator.register_for_checkpointing(loader)`` and ``save_state``/``load_state``
    carry its position), and with Ray Train's ``prepare_data_loader``. Under PyTorch
    Lightning it works too (Lightning stores its state in the checkpoint by itself), as
    does torchdata's ``StatefulDataLoader``.

    Args:
        loader: a DataLoader (or a wrapper of one) whose sampler is a
            :class:`~torchgrain.GlobalShuffleSampler` or
            :class:`~torchgrain.BlockShuffleSampler`.
        sampler: that sampler, when it cannot be found on the loader.

    Example:
        >>> import torch, torchgrain as tg
        >>> data = list(range(20))
        >>> def make():
        ...     s = tg.GlobalShuffleSampler(data, seed=1, num_replicas=1, rank=0)
        ...     return tg.ResumableLoader(torch.utils.data.DataLoader(
        ...         data, batch_size=4, sampler=s, num_workers=0))
        >>> loader = make()
        >>> it = iter(loader)
        >>> seen = [next(it).tolist() for _ in range(2)]   # 2 batches, then save
        >>> state = loader.state_dict()
        >>> resumed = make()
        >>> resumed.load_state_dict(state)
        >>> rest = [b.tolist() for b in resumed]
        >>> sorted(sum(seen + rest, [])) == data
        True
        >>> resumed.epoch   # the pass completed: the next one is epoch 1
        1
    """

    def __init__(self, loader: Any, *, sampler: ResumableSampler | None = None) -> None:
        self.loader = loader
        self.sampler = sampler = find_sampler(loader, sampler)
        self._binding = _binding_of(loader)
        sampler.bind_loader(self._binding)
        # Batches the loop took in the current pass, until it completes: a loop that
        # breaks out (or fails) has still taken them, and state_dict() says so, not
        # where prefetching had got to. They count in the sampler's iteration _counts
        # only (a set_epoch or a load after a break starts another).
        self._taken = 0
        self._counts: int | None = None

    # -- iteration ------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return _Pass(self)

    def _ended(self, counts: int | None) -> None:
        """A complete pass (``counts``: its sampler iteration, None when no batch came)."""
        self._taken = 0
        # Also one with no batch (a resume saved at the last batch of an epoch whose
        # partial batch the DataLoader drops): the next one is the next epoch, unless a
        # load or another epoch came during the pass (where the next one starts). The
        # wrapped loader is told too: Accelerate's counts only passes that yield, and
        # adds one as a pass ends even after a load or a set_epoch during it (its next
        # pass would set that epoch, dropping the loaded position): it is told the epoch
        # in effect, which keeps the position.
        self.set_epoch(self.sampler.epoch + (counts is None or self.sampler._iteration == counts))

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "sampler", "_binding", "_taken", "_counts"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    # -- epoch ------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the current (or next) pass."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (the wrapped loader's ``set_epoch`` if it has one, else the
        sampler's); the epoch in effect keeps a loaded position."""
        if epoch != self.sampler.epoch:
            self._drop_unstarted_iterator()
        hook = getattr(self.loader, "set_epoch", None)
        if callable(hook):
            hook(epoch)
        self.sampler.set_epoch(epoch)
        self._tell_dataset()

    def _drop_unstarted_iterator(self) -> None:
        """Drop the iterator a torchdata ``StatefulDataLoader`` made for a ``state_dict()``
        before its first pass (Accelerate's prepare asks for one) and has not handed out:
        its workers drew the pass's first indices already, and the next pass would read
        those, not the position or epoch set since. Workers that do not persist are shut
        down; persistent ones are reset by the next pass, which drops what they read."""
        loader = getattr(self.loader, "base_dataloader", self.loader)  # Accelerate's
        if getattr(loader, "_initial_iter_for_state_dict", False) is not True:
            return
        loader._initial_iter_for_state_dict = False
        if loader.num_workers > 0 and loader.persistent_workers:
            return
        iterator, loader._iterator = loader._iterator, None
        if loader.num_workers > 0:
            iterator._shutdown_workers()

    def _tell_dataset(self, *, pass_start: bool = False) -> None:
        """The sampler's epoch to the loader's dataset, when the sampler does not tell it;
        as a pass starts, to the sampler's dataset too: the pass reads at the loader's
        epoch, not at one another sampler over the same data (or another loader's last
        pass, which moves it to the next epoch) left it at."""
        dataset = getattr(self.loader, "dataset", None)
        if dataset is not self.sampler.dataset and isinstance(dataset, SetsEpoch):
            dataset.set_epoch(self.sampler.epoch)
        if pass_start and isinstance(self.sampler.dataset, SetsEpoch):
            self.sampler.dataset.set_epoch(self.sampler.epoch)

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the training loop is: the sampler's state after the batches it took.

        A plain dict (ints and lists), safe for ``torch.save`` and JSON. Saved at the
        end of a pass, it points at the start of the next epoch; asked for while a pass
        reads its first batch, at the pass's start.
        """
        sampler = self.sampler
        taken = self._taken if self._counts == sampler._iteration else 0
        consumed = taken * self._positions_per_step() if taken else 0
        # Under a loader that reads in one process for all (Accelerate's
        # dispatch_batches), the other processes' samplers draw nothing: the steps
        # taken say where every process is.
        state = sampler._state(consumed, drawn_only=not self._binding.reads_for_all)
        epoch = state["epoch"] + int(sampler._finished(state))
        return {"version": _STATE_VERSION, "epoch": epoch, "sampler": state}

    def _at_end(self) -> bool:
        """Whether the batches taken reach the end of the sampler's pass (a loader that
        cannot say how many samples a batch takes: taken as there)."""
        try:
            state = self.state_dict()["sampler"]
        except TypeError:
            return True
        return bool(self.sampler._finished(state))

    def _positions_per_step(self) -> int:
        """Positions of the sampler's order one batch taken from the loader uses."""
        sampler, binding = self.sampler, self._binding
        if sampler._external is not None and binding.sharder is None:
            # A batch-sharding loader the binding did not recognise, found while iterating.
            raise TypeError(
                f"{type(self.loader).__name__} splits batches between processes "
                f"({sampler._external}) but torchgrain cannot tell how many samples one step "
                "takes over all of them; wrap the loader that accelerator.prepare returned, "
                "or bind the sampler with sampler.bind_loader(tg.LoaderBinding(..., step=))"
            )
        step = binding.positions_per_step
        if step is None:
            raise TypeError(
                f"cannot tell how many samples a batch of {type(self.loader).__name__} holds "
                "(no batch_size): use a DataLoader with batch_size="
            )
        return step

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next pass (same or different world size).

        A state that does not hold together raises ``ValueError`` and changes nothing.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"not a ResumableLoader state: {reprlib.repr(state)}")
        sampler = self.sampler
        inner = sampler._checked_state(state.get("sampler"))
        # The loader's epoch is the sampler state's, or the next one for a pass finished
        # (on the rank that drew the fewest): another would drop the saved position.
        epoch, saved = state.get("epoch"), inner["epoch"]
        finished = sampler._finished(inner, rank=inner["num_replicas"] - 1)
        if not isinstance(epoch, numbers.Integral) or epoch not in (saved, saved + finished):
            raise ValueError(
                f"ResumableLoader state of epoch {epoch!r} holds a sampler state of epoch "
                f"{saved} at position {inner['position']}"
                + ("" if finished else ", in the middle of its pass")
            )
        self._drop_unstarted_iterator()
        sampler.load_order_state(inner)
        sampler._apply_state(inner)
        # Loaders that count epochs themselves (Accelerate's set the epoch at every
        # pass) must count from the resumed one; the epoch in effect keeps the position.
        self.set_epoch(state["epoch"])
        self._taken = 0

    def __repr__(self) -> str:
        return f"ResumableLoader({self.loader!r}, epoch={self.epoch})"


class _Pass(Iterator[Any]):
    """One pass of a :class:`ResumableLoader`: the wrapped loader's batches, counted. A
    batch the loader fails to make (its error raised here) counts as taken, and the pass
    goes on after it, as a ``DataLoader``'s does: a loop that skips it and saves later
    resumes after it, as the run it saved went on."""

    def __init__(self, owner: ResumableLoader) -> None:
        self.owner = owner
        self.it: Iterator[Any] | None = None  # iter(loader) at the first next(), as a for loop
        self.counts: int | None = None  # the pass's sampler iteration, once it has started
        self.done = self.failed = False

    def __next__(self) -> Any:
        owner = self.owner
        if self.done:
            raise StopIteration
        if self.it is None:  # (the pass starts at its first next(), as a generator's)
            owner._taken = 0
            owner._tell_dataset(pass_start=True)
            self.it = iter(owner.loader)
        try:
            batch = next(self.it)
        except StopIteration:
            self.done = True
            if not self.failed or owner._at_end():
                owner._ended(self.counts)
            # (else a wrapper that cannot go on after an error ended the pass early: its
            # position stays where the loop got to, as a pass the loop left does)
            raise
        except Exception:
            self.failed = True
            self._took()
            raise
        self._took()
        return batch

    def _took(self) -> None:
        if self.counts is None:
            self.counts = self.owner._counts = self.owner.sampler._iteration
        self.owner._taken += 1
