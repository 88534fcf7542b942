"""Planning a conversion, and its journal: what is done survives a crash or a kill.

The plan (which input pieces make each output shard) and every finished shard are
recorded under ``DST/.torchgrain-convert/``; a rerun with the same inputs and options
skips finished shards. The manifest is written last.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchgrain.convert.inputs import ConvertInput
from torchgrain.convert.tasks import Task
from torchgrain.errors import CorruptDataError, TorchgrainError
from torchgrain.formats.codecs import union_type
from torchgrain.formats.manifest import MANIFEST_NAME, Manifest, ShardInfo
from torchgrain.io import remote
from torchgrain.io.atomic import atomic_write_text
from torchgrain.io.changes import open_regular
from torchgrain.io.paths import local_file_in
from torchgrain.sources.node_index import INDEX_NAME
from torchgrain.sources.registry import formats, get_output
from torchgrain.writers import OutputFormat, shard_name

__all__ = [
    "JOURNAL_DIR",
    "MAX_PLAN_BYTES",
    "MAX_RECORD_BYTES",
    "Journal",
    "check_plan",
    "fingerprint",
    "finish",
    "finished",
    "locked",
    "manifest_path",
    "merge_schemas",
    "plan_tasks",
    "remove_outputs",
    "remove_temps",
]

JOURNAL_DIR = ".torchgrain-convert"

#: The most bytes of the journal's plan read: it holds about 350 bytes per input file
#: (its path, size, times; its count; its output shard's task), so this is a plan of some
#: 700,000 files, and the manifest's own ceiling.
MAX_PLAN_BYTES = 256 << 20
#: The most bytes of a shard's record read: a few hundred, and its schema's tens of bytes
#: a column. A longer one is not ours: its shard is converted again (nothing is lost).
MAX_RECORD_BYTES = 16 << 20


def plan_tasks(
    counts: list[int] | None, num_inputs: int, num_shards: int | None, to: str
) -> list[Task]:
    suffix = get_output(to).suffix
    if counts is not None and len(counts) != num_inputs:  # a format's counts, not one per file
        raise ValueError(
            f"the input lists {num_inputs} files but {len(counts)} record counts: "
            "its format's shard_counts must hold one count per file"
        )
    if num_shards is None:
        sizes = counts if counts is not None else [None] * num_inputs
        return [
            Task(i, shard_name(i, num_inputs, suffix=suffix), [(i, 0, None)], n)
            for i, n in enumerate(sizes)
        ]
    assert counts is not None
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    total = int(offsets[-1])
    tasks = []
    for j in range(num_shards):
        a, b = total * j // num_shards, total * (j + 1) // num_shards
        pieces = []
        first = int(np.searchsorted(offsets, a, side="right")) - 1
        for s in range(max(first, 0), num_inputs):
            lo, hi = int(offsets[s]), int(offsets[s + 1])
            if lo >= b:
                break
            if hi <= a or hi == lo:
                continue
            pieces.append((s, max(a, lo) - lo, min(b, hi) - lo))
        tasks.append(Task(j, shard_name(j, num_shards, suffix=suffix), pieces, b - a))
    return tasks


def merge_schemas(a: dict[str, str], b: dict[str, str]) -> dict[str, str]:
    out = dict(a)
    for k, t in b.items():
        out[k] = union_type(out[k], t) if k in out else (t if not a else union_type("null", t))
    if b:
        for k in a:
            if k not in b:
                out[k] = union_type(out[k], "null")
    return out


def fingerprint(inp: ConvertInput, options: dict[str, Any]) -> dict[str, Any]:
    fs = inp.filesystem()
    files = []
    for p in inp.paths:
        info = remote.call(fs, "info", inp.strip(p), url=p, what="lookup")
        file = {"path": p, "size": int(info.get("size") or 0), "mtime": str(info.get("mtime", ""))}
        # A local file's change time and inode too: bytes rewritten with the size and
        # modification time kept (cp -p, rsync -t) must not resume beside the old shards.
        file.update({k: str(info[k]) for k in ("created", "ino") if k in info})
        files.append(file)
    return {"format": inp.format, "files": files, "options": options}


@dataclass
class Journal:
    """The ``.torchgrain-convert`` directory: the plan and every finished shard."""

    root: str
    dir: str = field(init=False)

    def __post_init__(self) -> None:
        self.dir = os.path.join(self.root, JOURNAL_DIR)

    def load_plan(self) -> dict[str, Any] | None:
        """The plan the journal holds (None if none), read no further than
        :data:`MAX_PLAN_BYTES`.

        Raises:
            CorruptDataError: it is longer, not JSON, or not a plan.

        Example:
            >>> import tempfile
            >>> j = Journal(tempfile.mkdtemp())
            >>> j.save_plan({"fingerprint": {}, "counts": None, "tasks": []})
            >>> j.load_plan()["tasks"], Journal(tempfile.mkdtemp()).load_plan()
            ([], None)
        """
        p = os.path.join(self.dir, "plan.json")
        if not os.path.isfile(p):
            return None
        data = _read_at_most(p, MAX_PLAN_BYTES)
        if data is None:
            raise CorruptDataError(
                f"the conversion plan {p} holds more than MAX_PLAN_BYTES={MAX_PLAN_BYTES} "
                f"bytes: it is not ours; remove {self.dir} or pass overwrite=True"
            )
        try:
            plan = json.loads(data)
        except ValueError as e:
            raise CorruptDataError(f"the conversion plan {p} is not JSON: {e}") from None
        if not isinstance(plan, dict) or not {"fingerprint", "counts", "tasks"} <= plan.keys():
            raise CorruptDataError(f"the conversion plan {p} is not a plan")
        return plan

    def make(self) -> None:
        """Make the journal's directory; a link in its place is refused (its plan, records
        and lock would be written, and cleared, wherever it points).

        Raises:
            TorchgrainError: ``DST/.torchgrain-convert`` is a link.

        Example:
            >>> import tempfile
            >>> j = Journal(tempfile.mkdtemp())
            >>> j.make(); os.path.isdir(j.dir)
            True
        """
        if os.path.islink(self.dir):
            raise TorchgrainError(f"{self.dir} is a link: remove it to convert into {self.root}")
        os.makedirs(self.dir, exist_ok=True)

    def save_plan(self, plan: dict[str, Any]) -> None:
        self.make()
        atomic_write_text(os.path.join(self.dir, "plan.json"), json.dumps(plan))

    def done(self) -> dict[int, dict[str, Any]]:
        out = {}
        if os.path.isdir(self.dir):
            for n in os.listdir(self.dir):
                if n.startswith("shard-") and n.endswith(".json"):
                    # A record is written whole (atomically): one that is not (nor a
                    # regular file: a FIFO's open would wait) is not ours, and its shard
                    # is converted again (finished() checks the rest).
                    # Nor one longer than any we write (MAX_RECORD_BYTES).
                    with contextlib.suppress(ValueError, TypeError, KeyError, IsADirectoryError):
                        data = _read_at_most(os.path.join(self.dir, n), MAX_RECORD_BYTES)
                        if data is not None:
                            r = json.loads(data)
                            out[int(r["index"])] = r
        return out

    def record(self, result: dict[str, Any]) -> None:
        atomic_write_text(
            os.path.join(self.dir, f"shard-{result['index']:05d}.json"), json.dumps(result)
        )

    def clear(self) -> None:
        if os.path.isdir(self.dir):
            for n in os.listdir(self.dir):
                if n != "lock":
                    os.unlink(os.path.join(self.dir, n))


def _read_at_most(path: str, limit: int) -> bytes | None:
    """The bytes of the regular file ``path``, or None if it holds more than ``limit``
    (no more than ``limit + 1`` are read, whatever its size)."""
    with open(open_regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            return None
        data = f.read(size + 1)  # (a read allocates what it asks for first)
        if len(data) > size:  # it grew meanwhile
            data += f.read(limit + 1 - len(data))
    return data if len(data) <= limit else None


@contextlib.contextmanager
def locked(journal: Journal) -> Iterator[None]:
    journal.make()
    # 0o666 less the umask, as for every file torchgrain writes. A link in the lock's place
    # is not followed (its target would be made outside DST), nor a FIFO waited on.
    path = os.path.join(journal.dir, "lock")
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        raise TorchgrainError(f"cannot take the conversion's lock {path}: {e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TorchgrainError(f"the conversion's lock {path} is not a regular file: remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            why = ""
            if multiprocessing.parent_process() is not None:  # (this is a started process)
                why = (
                    "; this process was started by another: a script that calls convert "
                    'with workers outside `if __name__ == "__main__":` runs again in each '
                    "worker, which then converts too"
                )
            raise TorchgrainError(
                f"another conversion is writing to {journal.root} (lock held on "
                f"{journal.dir}/lock){why}"
            ) from None
        yield
    finally:
        os.close(fd)  # closing releases the lock (so does the process dying)


def finished(root: str, task: Task, record: dict[str, Any]) -> bool:
    """Whether the journal's ``record`` says ``task`` is done and its shard is still
    there: the task's own file (not a link), the very file written (inode and mtime), of
    the size and count recorded. The record is data: one naming another file or count
    is not taken, and the shard is redone."""
    if record.get("path") != task.name or (
        task.expected is not None and record.get("num_records") != task.expected
    ):
        return False
    try:
        st = os.lstat(os.path.join(root, task.name))
    except OSError:
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_size == record.get("num_bytes")
        and [st.st_ino, st.st_mtime_ns] == record.get("file_id")
    )


def check_plan(journal: Journal, plan: dict[str, Any], fresh: dict[str, Any]) -> None:
    """Raise CorruptDataError unless the journal's ``plan``, whose fingerprint matches
    this conversion's, is the plan ``fresh`` made now from the same inputs: its names
    and pieces are data, and one naming a file outside or other records is not used."""
    if plan == fresh:
        return
    where = "its record counts"
    old, new = plan["tasks"], fresh["tasks"]
    if not isinstance(old, list) or len(old) != len(new):
        where = "its number of tasks"
    elif plan["counts"] == fresh["counts"]:
        i = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
        where = f"task {i} ({new[i]['name']!r})"
    raise CorruptDataError(
        f"the conversion plan {os.path.join(journal.dir, 'plan.json')} is not the plan of "
        f"these inputs ({where} differ); remove {journal.dir} or pass overwrite=True"
    )


def remove_outputs(root: str, plan: dict[str, Any]) -> None:
    # The plan is data: a name it gives that is not a file in the output directory
    # (outside it, a directory, not a file name at all) is not ours.
    for t in plan.get("tasks", []):
        with contextlib.suppress(OSError, ValueError):
            path = local_file_in(root, str(t["name"]))
            if path is not None:
                os.unlink(path)
    for name in (MANIFEST_NAME, INDEX_NAME):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(root, name))


def remove_temps(root: str) -> None:
    # Temporary shards of an interrupted run (the lock guarantees no run is active), in
    # any output format: an earlier run may have written another.
    suffixes = [f.output.suffix for f in formats().values() if f.output is not None]
    for n in os.listdir(root):
        if n.startswith(".") and ".tmp-" in n and any(s in n for s in suffixes):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):  # not ours
                os.unlink(os.path.join(root, n))


def finish(
    root: str,
    inp: ConvertInput,
    output: OutputFormat,
    group_size: int,
    compression: str,
    plan: dict[str, Any],
    results: list[dict[str, Any]],
) -> Manifest:
    counts = plan["counts"]
    total = sum(r["num_records"] for r in results)
    if counts is not None and total != sum(counts):
        raise CorruptDataError(
            f"wrote {total} records but the input holds {sum(counts)}; nothing was published"
        )
    schema: dict[str, str] = {}
    for r in results:
        if r["num_records"]:
            schema = merge_schemas(schema, r["schema"])
    fields = ("path", "num_records", "num_bytes", "checksum")
    shards = [
        ShardInfo(**{k: r[k] for k in fields}, file_checksum=r.get("file_checksum"))
        for r in results
    ]
    manifest = Manifest(codec=output.codec, shards=shards, schema=schema)
    manifest.extra["compression"] = compression
    manifest.extra["converted_from"] = {"format": inp.format, "num_files": len(inp.paths)}
    output.finish(root, manifest, group_size)
    # A shard the format's last step rewrote (Parquet: a column typed as the other
    # shards') is recorded as it now is, so that a rerun finds it done.
    journal = Journal(root)
    for r, info in zip(results, manifest.shards):
        if (info.num_bytes, info.checksum) != (r["num_bytes"], r["checksum"]):
            st = os.stat(os.path.join(root, info.path))
            journal.record(
                {
                    **r,
                    "num_bytes": st.st_size,
                    "checksum": info.checksum,
                    "file_checksum": info.file_checksum,
                    "file_id": [st.st_ino, st.st_mtime_ns],
                }
            )
    atomic_write_text(manifest_path(root, output), manifest.to_json())
    return manifest


def manifest_path(root: str, output: OutputFormat) -> str:
    """Where a conversion into ``root`` writes its manifest: the dataset's
    ``torchgrain.json`` for a format whose sources read it, else the journal's
    ``result.json``."""
    name = MANIFEST_NAME if output.manifest_in_dataset else os.path.join(JOURNAL_DIR, "result.json")
    return os.path.join(root, name)
