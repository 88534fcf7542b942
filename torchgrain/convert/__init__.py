"""Convert Parquet, TFRecord or ArrayRecord datasets to torchgrain ArrayRecord (or Parquet).

One call (or ``torchgrain convert SRC DST``) reads every record of the source, in order,
and writes sharded output plus a manifest with per-shard record counts and checksums.

Output shard ``i`` holds input shard ``i`` (``match_shards``) or a contiguous slice of the
global order (``num_shards``, TFRecord inputs counted first). Shards are written by a
``forkserver``/``spawn`` pool under a temporary name, read back, verified and renamed; a
rerun after a crash skips finished shards. ``ShardInfo.checksum`` is a
:mod:`torchgrain.formats.checksums` value.

Design notes: docs/design-notes.md#convert-module.

Example:
    >>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq, torchgrain as tg
    >>> src, dst = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> for i in range(3):
    ...     pq.write_table(pa.table({"id": [i * 10 + j for j in range(10)]}),
    ...                    os.path.join(src, f"part-{i}.parquet"))
    >>> m = tg.convert(src, dst, num_shards=2)
    >>> [s.num_records for s in m.shards]
    [15, 15]
    >>> tg.ArrayRecordSource(dst)[17]["id"]
    17
"""

from __future__ import annotations

import contextlib
import glob
import json
import multiprocessing
import os
import queue
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import asdict
from typing import Any

from torchgrain.convert.inputs import ConvertInput, open_input
from torchgrain.convert.journal import (
    JOURNAL_DIR,
    Journal,
    check_plan,
    fingerprint,
    finish,
    finished,
    locked,
    plan_tasks,
    remove_outputs,
    remove_temps,
)
from torchgrain.convert.tasks import Job, Task, run_task, set_progress_callback, worker_init
from torchgrain.errors import CorruptDataError
from torchgrain.formats.checksums import RecordHasher, verify_shard
from torchgrain.formats.codecs import Codec
from torchgrain.formats.manifest import MANIFEST_NAME, Manifest, read_manifest
from torchgrain.io.atomic import file_mode
from torchgrain.io.fs import get_filesystem, is_local
from torchgrain.io.retry import RetryPolicy, current_policy, using
from torchgrain.sources.registry import detect_format, get_output
from torchgrain.writers import records_to_table

__all__ = [
    "DEFAULT_OUTPUT",
    "JOURNAL_DIR",
    "ConvertInput",
    "RecordHasher",
    "check_output_dir",
    "convert",
    "detect_format",
    "records_to_table",
    "verify_shard",
]

_PARQUET_ROW_GROUP_BYTES = 32 << 20  # in-memory size of one output row group
#: The output format of ``convert`` unless told (``to=``, ``--to``).
DEFAULT_OUTPUT = "array_record"


class _Progress:
    """tqdm bar on a terminal (records and MB/s), silent otherwise."""

    def __init__(self, total: int | None, enabled: bool | None) -> None:
        self._bar = None
        if enabled or (enabled is None and sys.stderr.isatty()):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, unit="rec", unit_scale=True, desc="convert")
        self._t0 = time.monotonic()
        self._bytes = 0

    def update(self, records: int, nbytes: int) -> None:
        """Called in the thread that runs the conversion (``_execute``) only."""
        if self._bar is None:
            return
        self._bytes += nbytes
        self._bar.update(records)
        mbps = self._bytes / max(time.monotonic() - self._t0, 1e-9) / 1e6
        self._bar.set_postfix_str(f"{mbps:.1f} MB/s", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _mp_context() -> Any:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # The fork server imports torchgrain (and torch) once; each worker then starts by a
    # fork of it in milliseconds instead of re-importing everything.
    ctx.set_forkserver_preload(["torchgrain.convert"])
    return ctx


def convert(
    src: str | os.PathLike | Sequence[str | os.PathLike],
    dst: str | os.PathLike,
    *,
    to: str = DEFAULT_OUTPUT,
    num_shards: int | None = None,
    match_shards: bool = False,
    group_size: int = 1,
    workers: int = 1,
    codec: str | Codec = "auto",
    compression: str | None = None,
    src_format: str = "auto",
    row_group_bytes: int = _PARQUET_ROW_GROUP_BYTES,
    verify: bool = True,
    overwrite: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    tokenize: Any = None,
    columns: Sequence[str] | None = None,
    retry: RetryPolicy | None = None,
) -> Manifest:
    """Convert a Parquet, TFRecord or ArrayRecord dataset; resumable, verified, parallel.

    Args:
        src: directory, glob, file, list of these, or fsspec URLs.
        dst: output directory (local).
        to: ``"array_record"`` (the default: msgpack records plus a ``torchgrain.json``
            manifest) or ``"parquet"`` (one file per output shard): the registry's
            :func:`~torchgrain.sources.registry.output_formats`.
        num_shards: cut the global record order into this many contiguous output shards.
        match_shards: one output shard per input shard (the default without ``num_shards``).
        group_size: records per ArrayRecord chunk (1: fastest random access).
        workers: processes converting shards in parallel (1: in this process).
        codec: how TFRecord/ArrayRecord records are decoded: ``"auto"`` (sniffed, or the
            manifest's or ``features.json``'s), ``"tf_example"``, ``"raw"``, ``"msgpack"``,
            or a codec object.
        compression: ArrayRecord ``zstd[:LEVEL]`` (default ``zstd:3``), ``snappy``,
            ``brotli``, ``uncompressed``; Parquet ``zstd`` (default), ``snappy``, ``gzip``,
            ``lz4``, ``none``.
        src_format: ``"auto"`` (from file names) or a registered format name.
        row_group_bytes: Parquet row groups of about this many bytes (at most 65,536 rows).
        verify: read every written shard back and check its count and checksum.
        overwrite: replace whatever ``dst`` holds instead of raising.
        progress: show a progress bar (default: when stderr is a terminal).
        storage_options: fsspec options for remote sources.
        tokenize: a :func:`torchgrain.tokens.tokenize.tokenize` function run over each
            batch of 256 records before they are written (token ids as an int32 list column).
        columns: the columns to convert (default: all); a missing one is a ValueError.
        retry: attempts and deadlines of the input's remote reads, in every worker
            (default: the source's, :class:`~torchgrain.io.retry.RetryPolicy()`).

    Returns:
        The manifest (written to ``dst/torchgrain.json`` for ArrayRecord output; kept in
        ``dst/.torchgrain-convert/`` for Parquet output).

    Raises:
        CorruptDataError: a corrupt input record (the message names file and offset or
            record); shards finished before stay, the failing one leaves no file.
        FileExistsError: ``dst`` holds something else and ``overwrite`` is False.

    Design notes (the options in full): docs/design-notes.md#convert-module.

    Example:
        >>> import os, tempfile, torchgrain as tg
        >>> from torchgrain.formats.tfrecord import write_tfrecord
        >>> from torchgrain.formats.tf_example import encode_tf_example
        >>> d = tempfile.mkdtemp()
        >>> _ = write_tfrecord([encode_tf_example({"label": i}) for i in range(4)],
        ...                    os.path.join(d, "train.tfrecord"))
        >>> m = tg.convert(os.path.join(d, "train.tfrecord"), os.path.join(d, "out"))
        >>> m.num_records, tg.ArrayRecordSource(os.path.join(d, "out"))[3]["label"].tolist()
        (4, [3])
    """
    output = get_output(to)
    if num_shards is not None and match_shards:
        raise ValueError("pass either num_shards or match_shards, not both")
    if num_shards is not None and (not isinstance(num_shards, int) or num_shards < 1):
        raise ValueError(f"num_shards must be a positive integer, got {num_shards!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    compression, writer_options = output.options(group_size, compression)
    fs, root = get_filesystem(dst)
    if not is_local(fs):
        raise NotImplementedError(
            f"convert writes local directories; convert locally and upload, or use "
            f"torchgrain.beam for {os.fspath(dst)!r}"
        )
    root = os.path.abspath(root)
    check_output_dir(src, root)
    inp = open_input(src, src_format, codec, storage_options, columns, retry)
    options = {
        "to": to,
        "num_shards": num_shards,
        "group_size": group_size,
        "compression": compression,
        "codec": inp.codec.name if inp.codec is not None else None,
        "row_group_bytes": row_group_bytes if "row_group_bytes" in output.settings else None,
    }
    if columns:
        options["columns"] = list(columns)  # another selection: another conversion
    if tokenize is not None:
        from torchgrain.sources.node_index.derived import callable_fingerprint

        options["tokenize"] = callable_fingerprint(tokenize)  # the tokenizer's state included
    if is_local(inp.filesystem()) and any(
        os.path.dirname(os.path.abspath(p)) == root for p in inp.paths
    ):
        raise ValueError(f"{root} holds input files: write the conversion to another directory")
    # Only now, with the input open and the paths checked, is anything created.
    created = _make_dirs(root)
    journal = Journal(root)
    if not os.path.isdir(journal.dir):
        created.append(journal.dir)
    # Locked first: a run refused the lock must not remove the journal of the run that
    # holds it (both may have found the directory missing).
    policy = using(retry or current_policy())  # (the input's lookups: its fingerprint)
    with policy, locked(journal), _removed_if_nothing_done(root, created, journal):
        stamp = fingerprint(inp, options)
        tasks = plan_tasks(inp.counts, len(inp.paths), num_shards, to)
        # As stored (tuples as lists): a plan found in the journal is compared with it.
        fresh = json.loads(
            json.dumps(
                {"fingerprint": stamp, "counts": inp.counts, "tasks": list(map(asdict, tasks))}
            )
        )
        plan = journal.load_plan()
        # Files its source would read with the conversion's shards (Parquet: every other
        # Parquet file) and not written by a conversion into it: never removed.
        ours = {t.name for t in tasks} | {t["name"] for t in (plan or {}).get("tasks", [])}
        others = output.read_with(root, ours)
        if others:
            more = f" and {len(others) - 1} more" if len(others) > 1 else ""
            raise FileExistsError(
                f"{root} already holds {others[0]!r}{more}, not written by a conversion into "
                "it, which would be read with the conversion's shards: remove it, or write "
                "to another directory"
            )
        if plan is not None and plan["fingerprint"] == stamp and not overwrite:
            check_plan(journal, plan, fresh)
        elif plan is not None and plan != fresh:
            if not overwrite:
                raise FileExistsError(
                    f"{root} holds a conversion of other inputs or options; pass "
                    "overwrite=True to start over"
                )
            remove_outputs(root, plan)
            journal.clear()
            plan = None
        if plan is None:
            try:
                old = read_manifest(fs, root)
            except CorruptDataError:
                if not overwrite:
                    raise
                old = None  # it is replaced; the files it names are not known
            # A shard of this plan's name not written by it (a dataset without a manifest
            # in DST: Parquet output keeps its own in the journal) would be replaced.
            taken = [t.name for t in tasks if os.path.lexists(os.path.join(root, t.name))]
            if (old is not None or taken) and not overwrite:
                what = repr(taken[0]) if old is None else f"a torchgrain dataset ({MANIFEST_NAME})"
                raise FileExistsError(f"{root} already holds {what}; pass overwrite=True")
            if old is not None:
                remove_outputs(root, {"tasks": [{"name": s.path} for s in old.shards]})
        remove_temps(root)
        ctx = _mp_context()
        pool: futures.ProcessPoolExecutor | None = None
        progress_q: Any = None
        try:
            if workers > 1:
                progress_q = ctx.Queue()
                pool = futures.ProcessPoolExecutor(
                    workers,
                    mp_context=ctx,
                    initializer=worker_init,
                    initargs=(progress_q, os.getpid()),
                )
            if plan is None:
                journal.save_plan(fresh)
            plan = fresh
            records = journal.done()
            done = {
                t.index: records[t.index]
                for t in tasks
                if t.index in records and finished(root, t, records[t.index])
            }
            todo = [t for t in tasks if t.index not in done]
            job = Job(
                inp,
                root,
                to,
                writer_options,
                compression,
                row_group_bytes,
                verify,
                file_mode(),
                output,
                tokenize,
            )
            counts = plan["counts"]
            total = int(sum(counts)) if counts is not None else None
            bar = _Progress(total, progress)
            bar.update(sum(r["num_records"] for r in done.values()), 0)  # (resumed)
            try:
                for result in _execute(job, todo, pool, progress_q, bar):
                    journal.record(result)
                    done[result["index"]] = result
            finally:
                bar.close()
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        results = [done[t.index] for t in tasks]
        return finish(root, inp, output, group_size, compression, plan, results)


def check_output_dir(
    src: str | os.PathLike | Sequence[str | os.PathLike], dst: str | os.PathLike
) -> None:
    """Refuse an output directory inside an input directory, or holding an input.

    Converting ``data`` into ``data/out`` would make the output part of the input: the
    next ``torchgrain inspect data`` or conversion would read both. Converting
    ``data/part-0.parquet`` (or ``data/*.parquet``) into ``data``, or into a folder above
    it, would leave the input inside the output dataset's directory. Paths are compared
    after resolving symbolic links and ``..``.

    Raises:
        ValueError: naming both.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> check_output_dir(d, os.path.join(d, "out"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: the output directory ... is inside the input directory ...
        >>> check_output_dir(os.path.join(d, "a"), os.path.join(d, "b"))  # apart: fine
    """
    out = os.path.realpath(os.fspath(dst))
    for item in [src] if isinstance(src, (str, os.PathLike)) else src:
        fs, p = get_filesystem(item)
        if not is_local(fs):
            continue
        if glob.has_magic(p) or not os.path.isdir(p):
            # Files (those a glob names, too): none may lie inside the output. fsspec's
            # glob, as the sources list: glob.glob walks into linked directories.
            for f in fs.glob(p) if glob.has_magic(p) else [p]:
                if _within(os.path.realpath(f), out):
                    raise ValueError(
                        f"the input file {f!r} is inside the output directory "
                        f"{os.fspath(dst)!r}: write the output elsewhere"
                    )
            continue
        d = os.path.realpath(p)
        if out == d:
            raise ValueError(
                f"the output directory {os.fspath(dst)!r} is the input directory (it holds "
                "input files): write the conversion to another directory"
            )
        if _within(out, d):
            raise ValueError(
                f"the output directory {os.fspath(dst)!r} is inside the input directory "
                f"{os.fspath(item)!r}: the output would become part of the input; write it "
                "elsewhere"
            )
        if _within(d, out):
            raise ValueError(
                f"the input directory {os.fspath(item)!r} is inside the output directory "
                f"{os.fspath(dst)!r}: write the output elsewhere"
            )


def _within(path: str, directory: str) -> bool:
    """Whether resolved ``path`` lies below resolved ``directory``."""
    return path.startswith(directory.rstrip(os.sep) + os.sep)


def _make_dirs(root: str) -> list[str]:
    """``os.makedirs(root)``; returns the directories it created, outermost first."""
    missing = []
    d = root
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        missing.insert(0, d)
        d = os.path.dirname(d)
    os.makedirs(root, exist_ok=True)
    return missing


@contextlib.contextmanager
def _removed_if_nothing_done(root: str, created: list[str], journal: Journal) -> Iterator[None]:
    """On a failure before any output shard was finished, remove the directories this
    conversion created (the journal's files included): a failed first run leaves no
    empty output folder behind. Directories that existed before, and anything a
    rerun could resume from, stay."""
    try:
        yield
    except BaseException:
        if created and not _shards_finished(root, journal):
            if journal.dir in created:
                shutil.rmtree(journal.dir, ignore_errors=True)
            for d in reversed(created):
                with contextlib.suppress(OSError):  # not empty: someone else's files
                    os.rmdir(d)
        raise


def _shards_finished(root: str, journal: Journal) -> bool:
    """Whether ``root`` holds a finished output shard of the planned conversion: one the
    journal records, or one a pool worker finished after the run had failed (its result
    never reached the journal, and its shard must not be left without one)."""
    if journal.done():
        return True
    try:
        plan = journal.load_plan()
    except (OSError, ValueError):  # unreadable: keep everything
        return True
    tasks = plan["tasks"] if plan is not None else []
    return any(os.path.exists(os.path.join(root, t["name"])) for t in tasks)


def _execute(
    job: Job,
    tasks: list[Task],
    pool: futures.ProcessPoolExecutor | None,
    progress_q: Any,
    bar: _Progress,
) -> Iterator[dict[str, Any]]:
    if pool is None:
        set_progress_callback(bar.update)
        try:
            for t in tasks:
                yield run_task(job, t)
        finally:
            set_progress_callback(None)
        return
    pending = {pool.submit(run_task, job, t) for t in tasks}
    try:
        while pending:
            finished, pending = futures.wait(
                pending, timeout=0.2, return_when=futures.FIRST_COMPLETED
            )
            _drain(progress_q, bar)
            for f in finished:
                yield f.result()  # re-raises a worker's error here
    finally:
        for f in pending:
            f.cancel()
        _drain(progress_q, bar)


def _drain(q: Any, bar: _Progress) -> None:
    while True:
        try:
            records, nbytes = q.get_nowait()
        except (queue.Empty, OSError, ValueError):
            return
        bar.update(records, nbytes)
