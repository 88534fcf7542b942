"""Overlap the last hop of the input pipeline, host to accelerator, with the training step.

:class:`CudaPrefetcher` wraps any iterable of batches (usually a
:class:`torch.utils.data.DataLoader`). A background thread pulls batches from the loader
ahead of the consumer, pins them, and issues their host-to-device copies on a dedicated
CUDA stream, so that when the training loop asks for the next batch it is already on the
device (or on its way there, with the consumer stream ordered after the copy by an event).

Without CUDA (or with ``device="cpu"``) the same class prefetches in a background thread
with no streams, so a training script runs unchanged on a laptop.

Example:
    >>> import torch
    >>> from torchgrain.prefetch import CudaPrefetcher
    >>> batches = [{"x": torch.full((2,), i), "name": f"b{i}"} for i in range(3)]
    >>> with CudaPrefetcher(batches, device="cpu", depth=2) as prefetcher:
    ...     for batch in prefetcher:
    ...         print(batch["name"], batch["x"].tolist())
    b0 [0, 0]
    b1 [1, 1]
    b2 [2, 2]
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from torchgrain.columns import Ragged

__all__ = ["CudaPrefetcher"]

# Queue item kinds sent from the producer thread to the consumer.
_BATCH = 0
_DONE = 1
_ERROR = 2
_FAILED = 3  # one batch failed (the loader or the transform raised): the pass goes on


def _map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor nested in dicts, lists, tuples and namedtuples.

    Containers are rebuilt with the same type where the type allows it; every other leaf
    is returned unchanged (strings, numbers, None, numpy arrays, user objects).
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Ragged):  # a variable-length column: its values and offsets
        return obj.map_arrays(lambda a: _map_tensors(fn, a))
    if isinstance(obj, Mapping):
        items = {k: _map_tensors(fn, v) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        with contextlib.suppress(TypeError):  # OrderedDict, Mappings built from a dict
            return type(obj)(items)
        # e.g. defaultdict (needs its factory first): copy it, then overwrite values.
        with contextlib.suppress(AttributeError, TypeError):
            clone = obj.copy()  # type: ignore[attr-defined]
            clone.update(items)
            return clone
        return items
    if isinstance(obj, (list, tuple)):
        mapped: Any = [_map_tensors(fn, v) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple: positional constructor
            return type(obj)(*mapped)
        if isinstance(obj, tuple):
            mapped = tuple(mapped)
        if type(obj) not in (list, tuple):  # a subclass: rebuilt when it can be
            with contextlib.suppress(TypeError):
                return type(obj)(mapped)
        return mapped
    return obj


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor nested in ``obj`` (same containers as :func:`_map_tensors`)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Ragged):
        yield from _iter_tensors([obj.values, obj.offsets])
    elif isinstance(obj, (Mapping, list, tuple)):
        for v in obj.values() if isinstance(obj, Mapping) else obj:
            yield from _iter_tensors(v)


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"CudaPrefetcher: device {device} was requested but CUDA is not available; "
            "pass device=None to use CUDA when present and the CPU otherwise"
        )
    return device


class _PassState:
    """What the producer thread and the consumer share during one pass.

    The producer thread holds a reference to this object only, never to the consumer's
    iterator, so dropping the iterator (``break``, ``del``, garbage collection) runs its
    finaliser, which stops and joins the thread.
    """

    def __init__(self, source: Iterator[Any], depth: int, start_event: Any) -> None:
        self.source: Iterator[Any] | None = source
        self.queue: queue.SimpleQueue[tuple[int, Any, Any]] = queue.SimpleQueue()
        # One slot per batch allowed in flight: the producer takes a slot before each
        # ``next(source)`` and the consumer returns it when it receives a batch, so the
        # producer never pulls more than ``depth`` batches ahead of the consumer.
        self.slots = threading.Semaphore(depth)
        self.stop = threading.Event()
        # (copy-done event, pinned host batch) pairs: the host buffers must stay alive
        # until the device has finished reading them.
        self.pending: collections.deque[tuple[Any, Any]] = collections.deque()
        self.produced = 0
        self.start_event = start_event


@dataclasses.dataclass
class _Transfer:
    """How one prefetcher moves a host batch to its device; runs in the producer thread."""

    device: torch.device
    stream: Any
    pin: bool
    non_blocking: bool
    transform: Callable[[Any], Any] | None

    def __call__(self, state: _PassState, host_batch: Any) -> tuple[Any, Any]:
        """Return ``(device_batch, ready_event)``; ``ready_event`` is None off CUDA."""
        if self.stream is None:
            batch = host_batch
            if self.device.type != "cpu":
                batch = _map_tensors(lambda t: t.to(self.device), batch)
            if self.transform is not None:
                batch = self.transform(batch)
            return batch, None

        device, non_blocking = self.device, self.non_blocking
        # The current device is per thread: enter the target's context before pinning so
        # this thread never creates a CUDA context on another GPU (cuda:0 by default).
        with torch.cuda.device(device), torch.cuda.stream(self.stream):
            if self.pin:
                host_batch = _map_tensors(_pin, host_batch)
            if state.start_event is not None:
                # Order the side stream after work the consumer queued before this pass
                # started (for example tensors a transform reads, made on the main stream).
                self.stream.wait_event(state.start_event)
                state.start_event = None
            batch = _map_tensors(lambda t: t.to(device, non_blocking=non_blocking), host_batch)
            copied = self.stream.record_event()
            # Keep the pinned source buffers referenced until the copy has completed (even
            # if the transform below fails); the producer drops them once
            # ``copied.query()`` is true (see ``_produce``), ``close`` waits.
            state.pending.append((copied, host_batch))
            if self.transform is None:
                return batch, copied
            batch = self.transform(batch)
            ready = self.stream.record_event()
        return batch, ready


def _pin(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type != "cpu" or t.is_pinned() else t.pin_memory()


def _produce(state: _PassState, transfer: _Transfer) -> None:
    """Body of the producer thread: pull, pin, copy, transform, hand over, repeat."""
    q = state.queue
    try:
        while True:
            state.slots.acquire()
            if state.stop.is_set():
                return
            # Copies on one stream complete in order: stop at the first unfinished one.
            while state.pending and state.pending[0][0].query():
                state.pending.popleft()
            source = state.source
            if source is None:
                return
            index = state.produced
            try:
                host_batch = next(source)
            except StopIteration:
                q.put((_DONE, None, None))
                return
            except Exception as exc:
                # One batch failed: the consumer gets its error there, and this thread
                # ends; a next() after it goes on with the pass in a new one, as a
                # DataLoader's pass goes on (a loop that skips a bad batch).
                state.produced += 1
                q.put((_FAILED, exc, f"while fetching batch {index} from the loader"))
                return
            finally:
                del source
            state.produced += 1
            if state.stop.is_set():
                return
            try:
                batch, ready = transfer(state, host_batch)
            except Exception as exc:
                if isinstance(exc, StopIteration):
                    # It must not end the consumer's loop silently (as in PEP 479).
                    error = RuntimeError("CudaPrefetcher: the transform raised StopIteration")
                    error.__cause__, exc = exc, error
                q.put((_FAILED, exc, f"while moving batch {index} to {transfer.device}"))
                return
            finally:
                del host_batch
            q.put((_BATCH, batch, ready))
            del batch, ready
    except BaseException as exc:
        q.put((_ERROR, exc, None))


class _PrefetchIterator(Iterator[Any]):
    """One pass over a :class:`CudaPrefetcher`; owns the producer thread of that pass."""

    def __init__(self, owner: CudaPrefetcher) -> None:
        self._state: _PassState | None = None
        self._thread: threading.Thread | None = None
        self._stream = owner._stream_for_pass()  # also binds a bare "cuda" to an index
        self._device = owner.device
        start_event = None
        if self._stream is not None:
            start_event = torch.cuda.current_stream(self._device).record_event()
        transfer = _Transfer(
            owner.device, self._stream, owner._pin_for_pass(), owner.non_blocking, owner.transform
        )
        # iter(loader) runs here, in the consumer's thread: a DataLoader starts its worker
        # processes and installs its signal handlers from the main thread, as it expects.
        source = iter(owner.loader)
        self._state = _PassState(source, owner.depth, start_event)
        self._transfer = transfer
        self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(
            target=_produce,
            args=(self._state, self._transfer),
            name="torchgrain-prefetch",
            daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> _PrefetchIterator:
        return self

    def __next__(self) -> Any:
        state = self._state
        if state is None:
            raise StopIteration
        if self._thread is None:  # the pass goes on after a batch that failed
            self._start()
        kind, payload, ready = state.queue.get()
        state.slots.release()
        if kind == _FAILED:
            # Its thread has ended (after it, nothing was fetched): gone before the error
            # reaches the loop, which may leave it, or call next() to go on.
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            if hasattr(payload, "add_note"):
                payload.add_note(f"(raised in the CudaPrefetcher thread {ready})")
            # Re-raise the loader's own exception object: its type is unchanged for callers'
            # ``except`` clauses and its traceback still holds the frames where it was
            # raised (in the loader, or the transform), below the consumer's frame.
            raise payload
        if kind == _BATCH:
            if ready is not None:
                consumer = torch.cuda.current_stream(self._device)
                consumer.wait_event(ready)
                # The device tensors were allocated on the side stream; tell the caching
                # allocator they are used on the consumer stream too, so their memory is
                # not handed to a later copy before the consumer's queued work is done.
                for t in _iter_tensors(payload):
                    if t.device.type == "cuda":
                        t.record_stream(consumer)
            return payload
        self.close()
        if kind == _DONE:
            raise StopIteration
        raise payload  # (the thread itself failed: the pass ends)

    def close(self) -> None:
        """Stop the producer thread, wait for it, and release every prefetched batch."""
        state, thread = self._state, self._thread
        if state is None:
            return
        state.stop.set()
        state.slots.release()  # wake the producer if it waits for a free slot
        if thread is not None:
            if thread is threading.current_thread():
                # Reached from garbage collection inside the producer itself: it will see
                # ``stop`` and exit on its own; the rest is freed with the state object.
                return
            thread.join()
        self._state = self._thread = None
        # Drop batches nobody will consume (the producer has stopped: nothing comes in),
        # and end the pass for a consumer waiting in another thread.
        while not state.queue.empty():
            state.queue.get_nowait()
        state.queue.put((_DONE, None, None))
        # Pinned buffers may still be read by in-flight copies: wait for them before freeing.
        for ready, _ in state.pending:
            ready.synchronize()
        state.pending.clear()
        source, state.source = state.source, None
        if isinstance(source, types.GeneratorType):
            source.close()  # run the generator's cleanup now, not at some later collection
        del source

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # (Bound here: at exit this module's globals, sys included, may be gone already.)
        if _finalizing():
            return  # daemon threads are already frozen; joining one could hang the exit
        # A finaliser must never raise.
        with contextlib.suppress(Exception):
            self.close()


class CudaPrefetcher(Iterable[Any]):
    """Prefetch batches to a device in a background thread, overlapping copies with compute.

    Iterating yields the loader's batches, in order, with every tensor (nested in dicts,
    lists, tuples and namedtuples; other leaves pass through unchanged) moved to
    ``device``. A background thread calls ``next()`` on the loader up to ``depth`` batches
    ahead of the consumer. On CUDA it pins each batch (unless the loader is a
    ``DataLoader(pin_memory=True)`` or the tensor is already pinned) and issues the copy on
    a side stream owned by this prefetcher; the consumer's current stream waits on an event
    recorded after the copy, and the device tensors are marked with ``record_stream`` so the
    caching allocator does not reuse their memory while the consumer's work is queued.
    Pinned host buffers are kept referenced until their copy has completed.

    Args:
        loader: any iterable of batches; ``iter(loader)`` is called once per pass.
        device: target device. ``None`` means ``"cuda"`` when available, else ``"cpu"``.
        depth: the most batches in flight ahead of the consumer (pulled from the loader
            but not yet handed to the consumer). Device memory holds up to ``depth + 1``
            batches: the one in use and ``depth`` prefetched.
        non_blocking: issue asynchronous copies (only meaningful for pinned sources).
        transform: optional callable applied to the whole batch after it reaches the
            device, on the side stream (for example ``uint8`` to normalised ``float``).
            Off CUDA it runs in the background thread.
        pin_memory: pin host tensors before a CUDA copy. ``None`` (default) pins unless
            the loader is a ``DataLoader`` with ``pin_memory=True``.

    ``len(prefetcher)`` is ``len(loader)``, and the loader's other attributes are the
    prefetcher's: to resume, wrap it in :class:`~torchgrain.ResumableLoader` (which counts
    the batches the loop took), not the other way round (a ``TypeError``). An exception
    raised by the loader (or the transform) is re-raised in the consumer at the position
    of the failed batch, with its original type and traceback; the pass goes on after it,
    as a ``DataLoader``'s does (a loop that catches it and calls ``next`` again gets the
    following batches). Leaving the loop early, closing the iterator,
    deleting it or letting it be garbage collected stops and joins the thread and frees
    the prefetched batches. Each ``for`` loop starts a fresh pass over the loader (and
    closes a pass still open on this prefetcher), so one prefetcher serves every epoch.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from torchgrain.prefetch import CudaPrefetcher
        >>> data = TensorDataset(torch.arange(8, dtype=torch.uint8).view(8, 1))
        >>> loader = DataLoader(data, batch_size=4)
        >>> prefetcher = CudaPrefetcher(
        ...     loader, device="cpu", transform=lambda b: [b[0].float() / 255]
        ... )
        >>> len(prefetcher)
        2
        >>> for epoch in range(2):
        ...     sums = [round(batch[0].sum().item() * 255) for batch in prefetcher]
        >>> sums
        [6, 22]
        >>> prefetcher.close()
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: torch.device | str | int | None = None,
        *,
        depth: int = 2,
        non_blocking: bool = True,
        transform: Callable[[Any], Any] | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"CudaPrefetcher: depth must be a positive int, got {depth!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"CudaPrefetcher: transform must be callable, got {transform!r}")
        from torchgrain.loader import ResumableLoader

        if isinstance(loader, ResumableLoader):
            # It would count the batches pulled ahead as taken by the loop: its state_dict()
            # would skip them on resume.
            raise TypeError(
                "CudaPrefetcher over a ResumableLoader: its state would skip the batches "
                "prefetched ahead of the loop; wrap the other way round: "
                "tg.ResumableLoader(tg.CudaPrefetcher(loader, ...))"
            )
        self.loader = loader
        self.device = _resolve_device(device)
        self.depth = depth
        self.non_blocking = non_blocking
        self.transform = transform
        self.pin_memory = pin_memory
        self._stream: Any = None
        self._active: weakref.ref[_PrefetchIterator] | None = None

    @property
    def stream(self) -> Any:
        """The side ``torch.cuda.Stream`` copies run on (None off CUDA or before the first pass)."""
        return self._stream

    def _stream_for_pass(self) -> Any:
        if self.device.type != "cuda":
            return None
        if self.device.index is None:
            # Bind "cuda" to the device current when the first pass starts, so that
            # ``torch.cuda.set_device(local_rank)`` before the loop is honoured.
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _pin_for_pass(self) -> bool:
        if self.device.type != "cuda":
            return False
        if self.pin_memory is None:  # unless the loader yields pinned batches already
            loader = self.loader
            return not (isinstance(loader, torch.utils.data.DataLoader) and loader.pin_memory)
        return bool(self.pin_memory)

    def __iter__(self) -> Iterator[Any]:
        # One pass at a time: a DataLoader with persistent workers reuses a single
        # iterator object, so two live passes would race on it.
        self.close()
        it = _PrefetchIterator(self)
        self._active = weakref.ref(it)
        return it

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # The loader's public attributes (sampler, batch_size, num_workers, ...), so that a
        # tg.ResumableLoader around the prefetcher finds and binds its sampler.
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def close(self) -> None:
        """Stop the pass in progress, if any, and release its thread and batches."""
        active = self._active() if self._active is not None else None
        self._active = None
        if active is not None:
            active.close()

    def __enter__(self) -> CudaPrefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CudaPrefetcher(loader={type(self.loader).__name__}, device={self.device}, "
            f"depth={self.depth}, non_blocking={self.non_blocking}, "
            f"transform={self.transform!r})"
        )
