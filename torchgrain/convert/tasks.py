"""Converting one output shard (in a worker process or in the caller)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchgrain.convert.inputs import ConvertInput
from torchgrain.convert.outputs import ArrayRecordOut, ParquetOut
from torchgrain.errors import CorruptDataError, TorchgrainError
from torchgrain.formats.checksums import RecordHasher, file_checksum, verify_shard
from torchgrain.formats.codecs import merge_schema
from torchgrain.io.atomic import publish, temp_name

__all__ = ["Job", "Task", "run_task", "set_progress_callback", "worker_init"]

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


_progress_queue: Any = None  # set in pool workers
_progress_callback: Callable[[int, int], None] | None = None  # set in-process


def set_progress_callback(callback: Callable[[int, int], None] | None) -> None:
    """Report progress of tasks run in this process to ``callback(records, nbytes)``."""
    global _progress_callback
    _progress_callback = callback


def worker_init(q: Any, parent: int | None = None) -> None:
    """Set up a pool worker: progress goes to ``q``, Ctrl-C is the parent's to handle,
    and the worker ends when process ``parent`` (the conversion) ends, killed or not."""
    global _progress_queue
    _progress_queue = q
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    if parent is not None:
        threading.Thread(
            target=_exit_with, args=(parent,), name="torchgrain-convert-parent", daemon=True
        ).start()


def _exit_with(parent: int) -> None:
    """Wait for process ``parent`` to end, then end this one: an orphan must not keep
    writing, nor wait for work forever. (``PR_SET_PDEATHSIG`` would watch the fork
    server this worker was forked from, which outlives the conversion as long as its
    children do.)"""
    try:
        fd = os.pidfd_open(parent)  # Linux 5.3+: readable once the process has ended
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])
    else:
        while True:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass  # there, under another user: not ours, but not gone either
            time.sleep(1.0)
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


def run_task(job: Job, task: Task) -> dict[str, Any]:
    """Write one output shard; returns its ShardInfo fields plus its schema."""
    final = os.path.join(job.root, task.name)
    tmp = temp_name(final)  # a name journal.remove_temps recognises
    inp = job.input
    report = _Reporter()
    count = 0
    schema: dict[str, str] = {}
    where = ""
    try:
        if job.to == "array_record":
            out: Any = ArrayRecordOut(tmp, job.writer_options)
            hasher = RecordHasher()
        else:
            out = ParquetOut(tmp, job.compression, job.row_group_bytes)
            hasher = None
        from torchgrain.formats.codecs import MsgpackCodec

        msgpack = MsgpackCodec()
        try:
            for shard, start, stop in task.pieces:
                where = f"input shard {shard} ({inp.paths[shard]!r})"
                k = start
                for rec, size in inp.records(shard, start, stop, job.to == "array_record"):
                    if job.to == "array_record":
                        if isinstance(rec, dict):
                            try:
                                data = msgpack.encode(rec)
                            except (TypeError, ValueError) as e:
                                raise TypeError(f"cannot encode record {k} of {where}: {e}") from e
                        else:
                            data = rec
                        out.write(data)
                        hasher.update(data)  # type: ignore[union-attr]
                        size = len(data)
                    else:
                        out.add(rec)
                    if count < 64 or count % 1009 == 0:
                        if not isinstance(rec, dict):
                            rec = msgpack.decode(rec)
                        schema = merge_schema(schema, rec)
                    count += 1
                    k += 1
                    report.add(size)
            out.close()
        except BaseException:
            out.abort()
            raise
        report.flush()
        if task.expected is not None and count != task.expected:
            raise CorruptDataError(
                f"output shard {task.name}: read {count} records from its input, expected "
                f"{task.expected} (did an input file change during the conversion?)"
            )
        checksum = hasher.hexdigest() if hasher is not None else file_checksum(tmp)
        if job.verify:
            verify_shard(tmp, count, checksum)
        # ArrayRecord shards also get the file's own hash: what a downloaded copy is
        # checked against (cheaper than decoding every record).
        whole = file_checksum(tmp) if hasher is not None else None
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
        "num_bytes": os.path.getsize(final),
        "checksum": checksum,
        "file_checksum": whole,
        "schema": schema,
    }
