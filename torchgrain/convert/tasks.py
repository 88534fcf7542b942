"""Converting one output shard (in a worker process or in the caller)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from torchgrain.convert.inputs import ConvertInput
from torchgrain.errors import CorruptDataError, TorchgrainError
from torchgrain.formats.codecs import MsgpackCodec, merge_schema, schema_sampled
from torchgrain.io.atomic import publish, temp_name
from torchgrain.sources.registry import get_output
from torchgrain.writers import OutputFormat

__all__ = ["Job", "Task", "exit_with", "run_task", "set_progress_callback", "worker_init"]

_PROGRESS_INTERVAL = 0.25  # seconds between a worker's progress messages


@dataclass
class Task:
    """One output shard: its name and the input pieces it is made of."""

    index: int
    name: str  # output file name
    pieces: list[tuple[int, int, int | None]]  # (input shard, start, stop); None: to the end
    expected: int | None  # records this shard must hold, when known


@dataclass
class Job:
    """Everything a worker needs (pickled once per task)."""

    input: ConvertInput
    root: str
    to: str
    writer_options: str
    compression: str
    row_group_bytes: int
    verify: bool
    #: Mode of the files written: the converting process's ``0o666`` less its umask
    #: (pool workers come from a fork server that may predate a change of umask).
    mode: int | None = None
    #: How ``to`` is written, from the registry of the process that plans the work
    #: (carried to the workers: a format registered at run time is known there too).
    output: OutputFormat | None = None
    #: A ``map_batch`` function run on each batch of records before they are written
    #: (``convert(tokenize=...)``).
    transform: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None

    def __post_init__(self) -> None:
        if self.output is None:
            self.output = get_output(self.to)


_progress_queue: Any = None  # set in pool workers
_progress_callback: Callable[[int, int], None] | None = None  # set in-process


def set_progress_callback(callback: Callable[[int, int], None] | None) -> None:
    """Report progress of tasks run in this process to ``callback(records, nbytes)``."""
    global _progress_callback
    _progress_callback = callback


def worker_init(q: Any, owner: int | None = None) -> None:
    """Set up a pool worker: progress goes to ``q``; the worker exits as soon as the
    converting process ``owner`` (its pid) ends, killed with SIGKILL included."""
    global _progress_queue
    _progress_queue = q
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    if owner is not None:
        exit_with(owner)


def exit_with(owner: int) -> None:
    """End this process when process ``owner`` ends (an orphan must not keep writing,
    nor wait for work forever).

    A worker forked or spawned by ``owner`` gets ``PR_SET_PDEATHSIG`` (Linux). A
    ``forkserver`` worker is the fork server's child, not ``owner``'s, and the fork
    server outlives ``owner`` for as long as any worker lives (each holds the fork
    server's "alive" pipe open): a daemon thread watches ``owner`` itself, through a
    pidfd where the kernel has them (woken at its exit), else by polling its pid twice
    a second. Once the workers are gone, the fork server and multiprocessing's resource
    tracker see their pipes close, and exit.
    """
    if sys.platform.startswith("linux") and os.getppid() == owner:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != owner:  # the owner died before the call: nobody will tell us
            os._exit(1)
    threading.Thread(
        target=_watch_owner, args=(owner,), name="torchgrain-owner-watch", daemon=True
    ).start()


def _watch_owner(owner: int) -> None:
    try:
        fd = os.pidfd_open(owner)
    except ProcessLookupError:
        os._exit(1)  # already gone
    except (AttributeError, OSError):  # no pidfds here: poll
        while True:
            time.sleep(0.5)
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass  # alive, as another user
    select.select([fd], [], [])  # readable once the process has exited
    os._exit(1)


class _Reporter:
    def __init__(self) -> None:
        self.records = 0
        self.bytes = 0
        self._last = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.records += 1
        self.bytes += nbytes
        if self.records & 255 == 0 and time.monotonic() - self._last > _PROGRESS_INTERVAL:
            self.flush()

    def flush(self) -> None:
        self._last = time.monotonic()
        if self.records:
            if _progress_queue is not None:
                _progress_queue.put((self.records, self.bytes))
            elif _progress_callback is not None:
                _progress_callback(self.records, self.bytes)
        self.records = self.bytes = 0


_TRANSFORM_BATCH = 256  # records a Job.transform gets at a time


def _transformed(
    pairs: Iterator[tuple[Any, int]], fn: Callable[[list[Any]], list[Any]], start: int, where: str
) -> Iterator[tuple[Any, int]]:
    """``(record, size)`` pairs with ``fn`` applied to each batch of records."""
    # Every batch but the last holds _TRANSFORM_BATCH records.
    batches = iter(lambda: list(itertools.islice(pairs, _TRANSFORM_BATCH)), [])
    for first, chunk in zip(itertools.count(start, _TRANSFORM_BATCH), batches):
        records = [rec for rec, _ in chunk]
        try:
            out = fn(records)
        except (TypeError, ValueError, KeyError) as e:
            # The data does not fit the transform (a missing or non-text field): a
            # ValueError naming where, as the command line reports.
            message = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise ValueError(
                f"{message} (in the batch of records {first}..{first + len(chunk) - 1} of {where})"
            ) from e
        if not isinstance(out, list) or len(out) != len(records):
            raise TypeError(
                f"the conversion's transform returned {type(out).__name__} for a batch of "
                f"{len(records)} records (one record per record expected)"
            )
        yield from zip(out, (size for _, size in chunk))


def _untransformed(schema: Any, transform: Any) -> Any:
    """``schema`` less the columns a tokenize ``transform`` writes: typed from the
    records, not the source (token ids replace a ``tokens`` column of another type)."""
    from torchgrain.tokens.tokenize import Tokenize

    if schema is None or not isinstance(transform, Tokenize):
        return schema
    written = {transform.output, transform.lengths}
    return pa.schema([f for f in schema if f.name not in written], schema.metadata)


def run_task(job: Job, task: Task) -> dict[str, Any]:
    """Write one output shard; returns its ShardInfo fields plus its schema."""
    final = os.path.join(job.root, task.name)
    tmp = temp_name(final)  # a name journal.remove_temps recognises
    inp = job.input
    report = _Reporter()
    count = 0
    schema: dict[str, str] = {}
    where = ""
    output = job.output
    assert output is not None
    try:
        out = output.writer(
            tmp,
            compression=job.compression,
            writer_options=job.writer_options,
            row_group_bytes=job.row_group_bytes,
            arrow_schema=_untransformed(inp.arrow_schema, job.transform),
        )
        msgpack = MsgpackCodec()
        try:
            for shard, start, stop in task.pieces:
                where = f"input shard {shard} ({inp.paths[shard]!r})"
                records = inp.records(
                    shard, start, stop, output.msgpack_records and job.transform is None
                )
                if job.transform is not None:
                    records = _transformed(records, job.transform, start, where)
                for k, (rec, size) in enumerate(records, start):
                    try:
                        written = out.add(rec)
                    except (TypeError, ValueError) as e:
                        raise TypeError(
                            f"cannot write record {k} of {where} as {job.to}: {e}"
                        ) from e
                    if schema_sampled(count):
                        schema = merge_schema(
                            schema, rec if isinstance(rec, dict) else msgpack.decode(rec)
                        )
                    count += 1
                    report.add(size if written is None else written)
            try:
                out.close()  # a format that writes in batches meets their errors here
            except (TypeError, ValueError) as e:
                if isinstance(e, TorchgrainError):
                    raise
                names = [repr(inp.paths[shard]) for shard, _, _ in task.pieces[:3]]
                more = f" and {len(task.pieces) - 3} more" if len(task.pieces) > 3 else ""
                raise (TypeError if isinstance(e, TypeError) else ValueError)(
                    f"cannot write output shard {task.name} as {job.to} (from input "
                    f"{', '.join(names)}{more}): {e}"
                ) from e
        except BaseException:
            out.abort()
            raise
        report.flush()
        if task.expected is not None and count != task.expected:
            raise CorruptDataError(
                f"output shard {task.name}: read {count} records from its input, expected "
                f"{task.expected} (did an input file change during the conversion?)"
            )
        checksum = out.checksum()
        if job.verify:
            output.verify(tmp, count, checksum)
        whole = out.file_checksum()
        publish(tmp, final, mode=job.mode)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, TorchgrainError) and where and where not in str(e):
            raise type(e)(f"{e} (converting {where} into output shard {task.name})") from e
        raise
    return {
        "index": task.index,
        "path": task.name,
        "num_records": count,
        "num_bytes": (st := os.stat(final)).st_size,
        # Which file it is (journal.finished): a file of the same size under its name
        # (another shard renamed, a copy) is not it.
        "file_id": [st.st_ino, st.st_mtime_ns],
        "checksum": checksum,
        "file_checksum": whole,
        "schema": schema,
    }
