"""Large data: thousands of shards, data bigger than the cache, a billion records (issue 28).

The same tiny records (an int64 ``id`` and a 16-byte ``payload`` computed from it, so
that the loader's own costs show) in every format, generated once and kept on disk
(``--data-dir``, one folder per parameter set, reused by later runs):

* ArrayRecord: ``--records`` records in each of ``--ar-shards`` shard counts (8, 2,048
  and 10,000 by default: the issue's targets compare the rates), msgpack records
  (``{"id", "payload"}``, as ``tg.write_array_record`` stores them), ``group_size`` 1, a
  torchgrain manifest;
* Parquet: ``id`` + ``payload`` in ``--parquet-files`` files of ``--row-group-rows``-row
  groups, sized to ``--parquet-ratios`` times the row-group cache in decoded (Arrow)
  bytes: 4x and 40x the default 256 MiB cache (~1 GiB and ~10 GiB) at full scale;
  smaller scales shrink the cache with the data (``cache_bytes`` passed explicitly, and
  said so);
* TFRecord: ``--tfrecord-records`` records in ``--tfrecord-shards`` files, each record
  the 8-byte little-endian id followed by the payload (read with the ``raw`` codec);
* Hugging Face datasets: the ArrayRecord records, and each Parquet dataset of
  ``--hf-parquet-ratios``, converted by ``datasets`` (``from_parquet`` +
  ``save_to_disk``), read in the default python format with ``ds.__getitems__``;
* Grain: ``grain.python.ArrayRecordDataSource`` over the same ArrayRecord files
  (``__getitems__``, records unpacked with msgpack), on the fewest and the most shards.

Every measurement runs in a fresh process (rounds interleaved, the case order rotated
each round), through a stock ``torch.utils.data.DataLoader`` (batch 256, default
collate, ``persistent_workers`` with workers) with ``tg.GlobalShuffleSampler`` (every
loader the same order and sampler cost) or, for Parquet, ``tg.BlockShuffleSampler``
too, with 0 and 2 workers. Each child reports:

* ``open_s``: constructing the source (``tg.ArrayRecordSource(d)``, ``load_from_disk``,
  ``ArrayRecordDataSource(files)``...); a first open of every dataset (the one that may
  build an index) runs once when the data is made and is reported apart;
* ``first_batch_s``: from creating the DataLoader iterator to the first batch;
* ``rate``: records/s over ``--measure`` batches after the warm-up (``--warmup``
  batches; by default 20, or as many as each reading process needs to meet every shard
  about once, so that readers opened on first use are open), and ``warmup_s``;
* ``epoch0_s`` / ``epoch1_rate``: whole epochs, where one is projected to take at most
  ``--epoch-budget`` seconds (every id checked exactly once);
* memory at the end of the measured batches (workers alive), from
  ``/proc/PID/smaps_rollup``: private memory of the main process and of each worker,
  as USS (Private_Clean + Private_Dirty) and as Private_Dirty alone (the heap and other
  anonymous pages: what each process costs the machine; a page of a memory-mapped file
  touched by one process only is Private_Clean but lives in the page cache, shared by
  every process), and the PSS of the whole loader (main + workers). A ``bare`` case
  (records computed from the index, no file) gives the same figures for the
  interpreter, torch and the sampler; memory attributed to a loader is its figure
  minus the bare one at the same number of workers.

Every record read is checked against the one written (payload recomputed from the id).
The memory model fits, per loader, a reading process's Private_Dirty (the worst of the
main process and the workers, beyond the bare loader's) as fixed + per record + per
shard over the datasets measured (the shard counts, and an eighth of the records in the
fewest shards), and the rest of the loader's PSS (mapped files, shared memory: counted
once per machine) as fixed + per record, then extrapolates on paper to
``--model-records`` records in ``--model-shards`` shards read by ``--model-procs``
processes per node. The table of the issue's targets says met / missed for each.
Results go to ``benchmarks/results/scale.json`` (and ``scale.png``).

Scales (``--scale``; every size can be overridden one by one):

* ``full``: 10^8 records, ArrayRecord 8 / 2,048 / 10,000 shards, Parquet at 4x and 40x
  the default 256 MiB cache, TFRecord 10^8 records in 1,000 shards: ~51 GiB of data
  and most of an hour to make it on 2 cores (ArrayRecord at ~100k records/s), and more
  memory than a small machine has for today's per-process index (a measurement over
  ``--max-mem-gib`` is stopped and reported): a big machine's job.
* ``medium``: 10^7 records (1,000 per shard at 10^4 shards), Parquet against a 16 MiB
  cache: ~5 GiB, 8 minutes to make, ~20 minutes of measurements per round here.
* ``small``: 10^6 records in 8 / 1,000 shards, a 4 MiB cache: ~1 minute to make, ~10
  of measurements per round.
* ``tiny``: 20,000 records in 8 / 64 shards (the test's size: seconds).

Options of the sources that only some versions of torchgrain have are passed with
``--source-options '{"arrayrecord": {...}, "parquet": {...}, "tfrecord": {...}}'``
(keyword arguments of the constructors, as given; the value ``"FRESH_DIR"`` becomes a
new empty directory for each measurement, for a disk cache that must start cold).
Torchgrain's own cache directory (``TORCHGRAIN_CACHE``: indexes built on first open)
is ``DATA_DIR/tg-cache``, kept between measurements as a machine keeps it.

Run:  python benchmarks/scale.py --scale small
      python benchmarks/scale.py --scale medium --rounds 1 --workers 0
      python benchmarks/scale.py --records 1e6 --ar-shards 8,1000 --no-peers
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks._common import (  # noqa: E402
    RESULTS_DIR,
    describe_machine,
    machine,
    print_table,
    write_json,
)
from benchmarks.memory import children  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
BATCH = 256
SEED = 0
DEFAULT_CACHE_MIB = 256  # ParquetSource's default cache_bytes
FULL_ROW_GROUP_ROWS = 50_000  # the row groups of the issue's measurement
AR_OPTIONS = (
    "group_size:1,zstd:1"  # group_size 1: torchgrain's default (zstd level 1: faster to write)
)
PAYLOAD = 16

SCALES: dict[str, dict[str, Any]] = {
    "full": {
        "records": 10**8,
        "ar_shards": [8, 2048, 10_000],
        "parquet_cache_mib": None,
        "tfrecord_records": 10**8,
        "tfrecord_shards": 1000,
    },
    "medium": {
        "records": 10**7,
        "ar_shards": [8, 2048, 10_000],
        "parquet_cache_mib": 16,
        "tfrecord_records": 10**7,
        "tfrecord_shards": 1000,
    },
    "small": {
        "records": 10**6,
        "ar_shards": [8, 1000],
        "parquet_cache_mib": 4,
        "tfrecord_records": 10**6,
        "tfrecord_shards": 1000,
    },
    "tiny": {
        "records": 20_000,
        "ar_shards": [8, 64],
        "parquet_cache_mib": 0.25,
        "tfrecord_records": 20_000,
        "tfrecord_shards": 16,
    },
}


# ---------------------------------------------------------------------- records
_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xD1B54A32D192ED03)


def payloads(ids: np.ndarray) -> np.ndarray:
    """The 16-byte payload of each id, as an ``(n, 16)`` uint8 array."""
    u = np.asarray(ids, dtype=np.int64).astype(np.uint64)
    out = np.empty((len(u), 2), "<u8")
    with np.errstate(over="ignore"):
        out[:, 0] = u * _K1
        out[:, 1] = (u ^ _K2) * _K1
    return out.view(np.uint8).reshape(len(u), PAYLOAD)


# msgpack of {"id": <uint64>, "payload": <bin 16>}: a fixed-width form of what
# torchgrain's msgpack codec writes (it picks the shortest int encoding; both decode
# to the same dict).
_MSGPACK_HEAD = bytes([0x82, 0xA2]) + b"id" + bytes([0xCF])
_MSGPACK_MID = bytes([0xA7]) + b"payload" + bytes([0xC4, PAYLOAD])
MSGPACK_BYTES = len(_MSGPACK_HEAD) + 8 + len(_MSGPACK_MID) + PAYLOAD


def msgpack_records(ids: np.ndarray) -> np.ndarray:
    """Each id's record as msgpack, an ``(n, MSGPACK_BYTES)`` uint8 array."""
    n = len(ids)
    out = np.empty((n, MSGPACK_BYTES), np.uint8)
    a = len(_MSGPACK_HEAD)
    out[:, :a] = np.frombuffer(_MSGPACK_HEAD, np.uint8)
    out[:, a : a + 8] = np.asarray(ids, np.int64).astype(">u8").view(np.uint8).reshape(n, 8)
    b = a + 8 + len(_MSGPACK_MID)
    out[:, a + 8 : b] = np.frombuffer(_MSGPACK_MID, np.uint8)
    out[:, b:] = payloads(ids)
    return out


def bad_records(ids: np.ndarray, payload_list: Sequence[bytes], n: int) -> int:
    """How many of a batch's records differ from the ones written (or are out of range)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    lens = np.fromiter((len(p) for p in payload_list), np.int64, len(payload_list))
    if len(lens) != len(ids):
        return max(len(ids), len(lens))
    bad = (ids < 0) | (ids >= n) | (lens != PAYLOAD)
    ok = np.flatnonzero(~bad)
    if len(ok):
        got = np.frombuffer(b"".join(bytes(payload_list[k]) for k in ok), np.uint8)
        bad[ok] = (got.reshape(len(ok), PAYLOAD) != payloads(ids[ok])).any(axis=1)
    return int(bad.sum())


# ------------------------------------------------------------------------- data
def _marker(d: str) -> str:
    return os.path.join(d, ".scale-bench.json")


def _cached(d: str, params: dict[str, Any]) -> dict[str, Any] | None:
    try:
        with open(_marker(d)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if doc.get("params") == params else None


def _publish(d: str, params: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    doc = {"params": params, **info, "bytes": _du(d)}
    with open(_marker(d), "w") as f:
        json.dump(doc, f)
    return doc


def _du(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(d, f))
    return total


def _pool(workers: int) -> Any:
    import multiprocessing

    # spawn: the children import only this module (no reader opened before a fork).
    return multiprocessing.get_context("spawn").Pool(workers)


def _write_ar_shard(args: tuple[str, int, int]) -> int:
    from array_record.python.array_record_module import ArrayRecordWriter

    path, start, stop = args
    data = msgpack_records(np.arange(start, stop, dtype=np.int64)).tobytes()
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    w = ArrayRecordWriter(tmp, AR_OPTIONS)
    write = w.write
    for k in range(0, len(data), MSGPACK_BYTES):
        write(data[k : k + MSGPACK_BYTES])
    w.close()
    os.replace(tmp, path)
    return os.path.getsize(path)


def make_arrayrecord(d: str, n: int, shards: int, workers: int) -> dict[str, Any]:
    """``n`` records in ``shards`` ArrayRecord files plus a torchgrain manifest.

    The fastest correct way measured here (indicative, 2 cores): the C++ writer fed
    pre-encoded records from numpy, whole shards per process of a pool (~100k
    records/s per process with group_size 1; ``tg.write_array_record`` ~70k in one
    process, ``tg.convert`` from Parquet ~45k per worker). The manifest is
    torchgrain's, so the source opens the dataset from one file.
    """
    from torchgrain.formats.codecs import merge_schema
    from torchgrain.formats.manifest import MANIFEST_NAME, Manifest, ShardInfo, atomic_write_text
    from torchgrain.writers import shard_name

    params = {"kind": "arrayrecord", "records": n, "shards": shards, "options": AR_OPTIONS}
    done = _cached(d, params)
    if done:
        return done
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    names = [shard_name(i, shards) for i in range(shards)]
    bounds = [n * i // shards for i in range(shards + 1)]
    jobs = [(os.path.join(d, names[i]), bounds[i], bounds[i + 1]) for i in range(shards)]
    t0 = time.perf_counter()
    with _pool(workers) as pool:
        sizes = pool.map(_write_ar_shard, jobs, chunksize=max(1, shards // (8 * workers)))
    rec = {"id": 0, "payload": b"\0" * PAYLOAD}
    manifest = Manifest(
        codec="msgpack",
        shards=[
            ShardInfo(path=names[i], num_records=bounds[i + 1] - bounds[i], num_bytes=sizes[i])
            for i in range(shards)
        ],
        schema=merge_schema({}, rec),
        group_size=1,
    )
    manifest.extra["compression"] = AR_OPTIONS.split(",", 1)[1]
    atomic_write_text(os.path.join(d, MANIFEST_NAME), manifest.to_json())
    return _publish(d, params, {"write_s": time.perf_counter() - t0})


def parquet_rows(ratio: float, cache_mib: float | None) -> int:
    """Rows whose decoded (Arrow) size is ``ratio`` times the cache."""
    sample = 10_000
    per_row = _parquet_table(0, sample).nbytes / sample
    return int(ratio * (cache_mib or DEFAULT_CACHE_MIB) * MIB / per_row)


def _parquet_table(start: int, stop: int) -> Any:
    import pyarrow as pa

    ids = np.arange(start, stop, dtype=np.int64)
    pay = payloads(ids)
    offsets = np.arange(0, (len(ids) + 1) * PAYLOAD, PAYLOAD, dtype=np.int32)
    col = pa.Array.from_buffers(
        pa.binary(), len(ids), [None, pa.py_buffer(offsets), pa.py_buffer(pay.tobytes())]
    )
    return pa.table({"id": ids, "payload": col})


def make_parquet(d: str, rows: int, files: int, row_group_rows: int) -> dict[str, Any]:
    """``rows`` rows in ``files`` Parquet files (zstd), row groups of ``row_group_rows``."""
    import pyarrow.parquet as pq

    params = {"kind": "parquet", "rows": rows, "files": files, "row_group_rows": row_group_rows}
    done = _cached(d, params)
    if done:
        return done
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    t0 = time.perf_counter()
    step = max(row_group_rows, 1_000_000 // row_group_rows * row_group_rows)
    for i in range(files):
        a, b = rows * i // files, rows * (i + 1) // files
        path = os.path.join(d, f"data-{i:05d}-of-{files:05d}.parquet")
        with pq.ParquetWriter(path + ".tmp", _parquet_table(0, 1).schema, compression="zstd") as w:
            for s in range(a, b, step):
                w.write_table(_parquet_table(s, min(s + step, b)), row_group_size=row_group_rows)
        os.replace(path + ".tmp", path)
    return _publish(d, params, {"write_s": time.perf_counter() - t0})


def _write_tfrecord_shard(args: tuple[str, int, int]) -> int:
    import struct

    from torchgrain.formats.tfrecord import masked_crc32c

    path, start, stop = args
    ids = np.arange(start, stop, dtype=np.int64)
    data = np.concatenate([ids.astype("<i8").view(np.uint8).reshape(-1, 8), payloads(ids)], 1)
    size = data.shape[1]
    head = struct.pack("<Q", size)
    head += struct.pack("<I", masked_crc32c(head))
    frames = np.empty((len(ids), len(head) + size + 4), np.uint8)
    frames[:, : len(head)] = np.frombuffer(head, np.uint8)
    frames[:, len(head) : len(head) + size] = data
    raw = data.tobytes()
    crcs = np.fromiter(
        (masked_crc32c(raw[k : k + size]) for k in range(0, len(raw), size)), "<u4", len(ids)
    )
    frames[:, len(head) + size :] = crcs.view(np.uint8).reshape(-1, 4)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "wb") as f:
        f.write(frames.tobytes())
    os.replace(tmp, path)
    return len(ids)


def make_tfrecord(d: str, n: int, shards: int, workers: int) -> dict[str, Any]:
    """``n`` raw records (id, payload) in ``shards`` uncompressed TFRecord files."""
    params = {"kind": "tfrecord", "records": n, "shards": shards}
    done = _cached(d, params)
    if done:
        return done
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    bounds = [n * i // shards for i in range(shards + 1)]
    jobs = [
        (os.path.join(d, f"data.tfrecord-{i:05d}-of-{shards:05d}"), bounds[i], bounds[i + 1])
        for i in range(shards)
    ]
    t0 = time.perf_counter()
    with _pool(workers) as pool:
        pool.map(_write_tfrecord_shard, jobs, chunksize=max(1, shards // (8 * workers)))
    return _publish(d, params, {"write_s": time.perf_counter() - t0})


def build_hf(parquet_dir: str, out: str) -> None:
    """Convert Parquet files to a Hugging Face dataset on disk (run with the peers' Python)."""
    import datasets

    files = sorted(
        os.path.join(parquet_dir, f) for f in os.listdir(parquet_dir) if f.endswith(".parquet")
    )
    cache = out + ".build"
    ds = datasets.Dataset.from_parquet(files, cache_dir=cache)
    ds.save_to_disk(out)
    del ds
    shutil.rmtree(cache, ignore_errors=True)


def make_hf(d: str, parquet_dir: str, python: str, rows: int) -> dict[str, Any]:
    params = {"kind": "hf", "rows": rows, "from": os.path.basename(parquet_dir)}
    done = _cached(d, params)
    if done:
        return done
    shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    code = (
        f"import sys; sys.path.insert(0, {ROOT!r}); from benchmarks.scale import build_hf; "
        f"build_hf({parquet_dir!r}, {d!r})"
    )
    p = subprocess.run([python, "-W", "ignore", "-c", code], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"building the HF dataset failed:\n{p.stderr[-2000:]}")
    return _publish(d, params, {"write_s": time.perf_counter() - t0})


# ------------------------------------------------------------------ one measurement
class Bare:
    """Records computed from the index (no file): the loader's and harness's own cost."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, idx: list[int]) -> list[dict[str, Any]]:
        ids = np.asarray(idx, np.int64)
        pay = payloads(ids)
        return [{"id": int(i), "payload": pay[k].tobytes()} for k, i in enumerate(idx)]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.__getitems__([i])[0]


class GrainRecords:
    """Grain's ``ArrayRecordDataSource`` as a map-style dataset of dicts (msgpack records).

    Grain reads with array_record's C++ reader, after which a process cannot safely
    fork (DESIGN.md, "Known hazard"): with DataLoader workers the parent never opens
    it, and each worker opens its own on first use (its open time is then part of the
    first batch).
    """

    def __init__(self, files: list[str], n: int, *, open_now: bool) -> None:
        self.files, self.n = files, n
        self._source: Any = None
        self._pid = -1
        if open_now:
            self._open()

    def _open(self) -> Any:
        if self._pid != os.getpid():
            from grain.python import ArrayRecordDataSource

            self._source, self._pid = ArrayRecordDataSource(self.files), os.getpid()
        return self._source

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, idx: list[int]) -> list[dict[str, Any]]:
        import msgpack

        return [msgpack.unpackb(r) for r in self._open().__getitems__(idx)]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.__getitems__([i])[0]


def open_case(spec: dict[str, Any]) -> Any:
    """The map-style dataset a case reads (this is what ``open_s`` times)."""
    loader, fmt, path = spec["loader"], spec["format"], spec["path"]
    opts = spec.get("source_options") or {}
    if loader == "bare":
        return Bare(spec["records"])
    if loader == "tg":
        import torchgrain as tg

        if fmt == "arrayrecord":
            src = tg.ArrayRecordSource(path, **opts)
        elif fmt == "parquet":
            src = tg.ParquetSource(path, **opts)
        elif fmt == "tfrecord":
            src = tg.TFRecordSource(path, codec="raw", **opts)
        else:
            raise ValueError(fmt)
        return tg.Dataset(src)
    if loader == "hf":
        import datasets

        return datasets.load_from_disk(path)
    if loader == "grain":
        files = sorted(
            os.path.join(path, f) for f in os.listdir(path) if f.endswith(".array_record")
        )
        return GrainRecords(files, spec["records"], open_now=spec["workers"] == 0)
    raise ValueError(loader)


def _batch_records(batch: dict[str, Any]) -> tuple[np.ndarray, list[bytes]]:
    if "bytes" in batch:  # TFRecord raw records: 8-byte id, then the payload
        raw = [bytes(b) for b in batch["bytes"]]
        ids = np.array([int.from_bytes(b[:8], "little", signed=True) for b in raw], np.int64)
        return ids, [b[8:] for b in raw]
    return np.asarray(batch["id"], np.int64), list(batch["payload"])


def rollup(pid: int) -> dict[str, int] | None:
    """Bytes of ``uss`` (Private_Clean + Private_Dirty), ``dirty`` (Private_Dirty: the
    heap and other anonymous pages only this process has) and ``pss`` of one process."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return None
    kb: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            kb[name] = int(parts[0]) * 1024
    dirty = kb.get("Private_Dirty", 0)
    return {"uss": kb.get("Private_Clean", 0) + dirty, "dirty": dirty, "pss": kb.get("Pss", 0)}


def memory(pid: int) -> dict[str, Any]:
    """USS and Private_Dirty of the process and of each of its children (the workers),
    and the PSS of them all.

    A page of a memory-mapped file that only one process has touched counts in its USS
    (Private_Clean) but lives in the page cache, which every process of the machine
    shares: the memory model counts Private_Dirty per process and the rest once.
    """
    me = rollup(pid) or {"uss": 0, "dirty": 0, "pss": 0}
    kids = [r for r in (rollup(c) for c in children(pid)) if r is not None]
    return {
        "uss_main": me["uss"],
        "uss_workers": [k["uss"] for k in kids],
        "dirty_main": me["dirty"],
        "dirty_workers": [k["dirty"] for k in kids],
        "pss_total": me["pss"] + sum(k["pss"] for k in kids),
    }


def _count(seen: np.ndarray, ids: np.ndarray) -> None:
    """Count each id read (ids out of range are counted as bad records already)."""
    np.add.at(seen, ids[(ids >= 0) & (ids < len(seen))], 1)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One case (loader, dataset, sampler, workers) in this fresh process."""
    import torch

    import torchgrain as tg

    if spec["loader"] == "hf":
        import datasets  # noqa: F401 - imported before timing, like torch
    if spec["loader"] == "grain":
        import grain.python  # noqa: F401
    pid = os.getpid()
    before = rollup(pid) or {"uss": 0}
    t0 = time.perf_counter()
    ds = open_case(spec)
    n = len(ds)
    open_s = time.perf_counter() - t0
    after_open = rollup(pid) or {"uss": 0}
    workers = spec["workers"]
    if spec["sampler"] == "block":
        sampler = tg.BlockShuffleSampler(ds, window=8, seed=SEED, deal_to_workers=True)
    else:
        sampler = tg.GlobalShuffleSampler(ds, seed=SEED)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context="fork" if workers else None,
        # A worker that cannot deliver (e.g. out of file descriptors) must end the
        # measurement with an error, not hang it.
        timeout=spec.get("batch_timeout", 300) if workers else 0,
    )
    total_batches = len(loader)
    warmup, measure = spec["warmup"], spec["measure"]
    out: dict[str, Any] = {"records": n, "open_s": open_s, "bad": 0}
    out["open_uss"] = after_open["uss"] - before["uss"]
    if spec["loader"] == "grain" and workers:
        out["open_s"] = None  # opened by each worker, in its first batch (GrainRecords)
    epochs_done = []
    seen_ids: list[np.ndarray] = []
    for epoch in range(spec["epochs"]):
        sampler.set_epoch(epoch)
        seen = None if epoch == 0 else np.zeros(n, np.uint8)
        t_start = time.perf_counter()
        done = 0
        t_win = None
        for b, batch in enumerate(loader):
            ids, pays = _batch_records(batch)
            out["bad"] += bad_records(ids, pays, n)
            done += len(ids)
            if seen is None:
                seen_ids.append(ids)
            else:
                _count(seen, ids)
            if epoch == 0 and b == 0:
                out["first_batch_s"] = time.perf_counter() - t_start
            if epoch == 0 and b + 1 == min(warmup, total_batches - 1):
                t_win, win_start = time.perf_counter(), done
                out["warmup_s"] = t_win - t_start
            if (
                epoch == 0
                and "rate_batches" not in out
                and (b + 1 == warmup + measure or b + 1 == total_batches)
            ):
                out["rate_batches"] = 0
                now = time.perf_counter()
                if t_win is not None and done > win_start:
                    out["rate"] = (done - win_start) / (now - t_win)
                    out["rate_batches"] = b + 1 - min(warmup, total_batches - 1)
                out.update(memory(pid))
                projected = (now - t_start) / done * n
                out["epoch0_projected_s"] = projected
                if projected > spec["epoch_budget"]:
                    break
                # The whole epoch: every id exactly once (counted from here on).
                seen = np.zeros(n, np.uint8)
                for old in seen_ids:
                    _count(seen, old)
                seen_ids = []
        else:
            secs = time.perf_counter() - t_start
            if seen is None:  # an epoch shorter than the window
                seen = np.zeros(n, np.uint8)
                for old in seen_ids:
                    _count(seen, old)
            seen_ids = []
            epochs_done.append(
                {
                    "epoch": epoch,
                    "seconds": secs,
                    "rate": done / secs,
                    "exact": bool((seen == 1).all()),
                }
            )
            continue
        break  # epoch 0 over budget: no later epoch
    out["epochs"] = epochs_done
    for e in epochs_done:
        out[f"epoch{e['epoch']}_s"] = e["seconds"]
        out[f"epoch{e['epoch']}_rate"] = e["rate"]
    out["exact_epochs"] = all(e["exact"] for e in epochs_done)
    del loader
    return out


def decode_once(path: str) -> dict[str, Any]:
    """Decode every row group of a Parquet dataset once, in this process (pyarrow)."""
    import pyarrow.parquet as pq

    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))
    t0 = time.perf_counter()
    rows = 0
    for f in files:
        pf = pq.ParquetFile(f)
        for g in range(pf.num_row_groups):
            rows += pf.read_row_group(g).num_rows
    return {"rows": rows, "decode_s": time.perf_counter() - t0}


FRESH_DIR = "FRESH_DIR"


@contextlib.contextmanager
def fresh_dirs(spec: dict[str, Any], root: str) -> Any:
    """``spec`` with each source option ``FRESH_DIR`` replaced by a new empty directory
    (removed afterwards): a disk cache that each measurement starts cold."""
    opts = spec.get("source_options") or {}
    made = []
    new = dict(opts)
    for k, v in opts.items():
        if v == FRESH_DIR:
            made.append(tempfile.mkdtemp(prefix="fresh-", dir=root))
            new[k] = made[-1]
    try:
        yield {**spec, "source_options": new} if made else spec
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


def run_child(
    args: dict[str, Any], python: str, timeout: float, max_mem: int, env: dict[str, str]
) -> dict[str, Any]:
    """Run ``--child`` in a new process (own session); kill it past ``timeout`` seconds
    or when it and its workers hold more than ``max_mem`` bytes of PSS (the pages of
    files every process maps, the shards and the index, counted once, not once per
    process as RSS would: 3 processes reading 10,000 mapped shards passed 60% of RAM in
    RSS while the machine had most of its memory free)."""
    import psutil

    cmd = [python, "-W", "ignore", os.path.abspath(__file__), "--child", json.dumps(args)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(
            cmd, stdout=out, stderr=err, text=True, env=env, cwd=ROOT, start_new_session=True
        )
        t0, why, peak = time.monotonic(), None, 0
        proc = psutil.Process(p.pid)
        try:
            while p.poll() is None:
                rss = 0
                with contextlib.suppress(psutil.Error):
                    for q in [proc, *proc.children(recursive=True)]:
                        with contextlib.suppress(psutil.Error):
                            rss += q.memory_full_info().pss
                peak = max(peak, rss)
                if rss > max_mem:
                    why = f"killed: PSS {rss / GIB:.1f} GiB over the {max_mem / GIB:.1f} GiB limit"
                elif time.monotonic() - t0 > timeout:
                    why = f"killed: over {timeout:.0f} s"
                if why:
                    break
                time.sleep(0.5)
        finally:  # the child and its workers go, whatever happened here
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return {**json.loads(line), "peak_rss_sampled": peak}
    tail = " | ".join((stderr or stdout).strip().splitlines()[-3:])
    return {"error": why or f"exit {p.returncode}: {tail[-600:]}"}


# ------------------------------------------------------------------------- driver
def _num(s: str) -> int:
    return int(float(s))


def _ints(s: str) -> list[int]:
    return [_num(x) for x in s.split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument("--records", type=_num, help="ArrayRecord records (and HF's copy)")
    p.add_argument("--ar-shards", type=_ints, help="ArrayRecord shard counts, e.g. 8,2048,10000")
    p.add_argument("--parquet-ratios", type=_floats, default=[4.0, 40.0], help="data / cache")
    p.add_argument(
        "--parquet-cache-mib",
        type=float,
        help="the cache the Parquet data is sized against and given to ParquetSource as "
        f"cache_bytes (default at full scale: the source's own default, {DEFAULT_CACHE_MIB} MiB, "
        "not passed)",
    )
    p.add_argument("--parquet-files", type=int, default=8)
    p.add_argument(
        "--row-group-rows",
        type=_num,
        help=f"Parquet rows per row group (default {FULL_ROW_GROUP_ROWS:,} x cache / "
        f"{DEFAULT_CACHE_MIB} MiB)",
    )
    p.add_argument("--tfrecord-records", type=_num, help="0: no TFRecord case")
    p.add_argument("--tfrecord-shards", type=_num)
    p.add_argument("--hf-parquet-ratios", type=_floats, default=[4.0], help="HF copies of these")
    p.add_argument("--workers", type=_ints, default=[0, 2], help="DataLoader workers")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--warmup",
        type=int,
        help="batches before the measured ones (default: 20, or as many as each reading "
        "process needs to meet every shard of the dataset once, about S ln S / 256)",
    )
    p.add_argument("--measure", type=int, default=200, help="measured batches")
    p.add_argument("--epochs", type=int, default=2, help="whole epochs, where within budget")
    p.add_argument(
        "--epoch-budget",
        type=float,
        default=120.0,
        help="seconds an epoch may be projected to take",
    )
    p.add_argument(
        "--source-options",
        default="{}",
        help="JSON: format -> constructor kwargs; a value FRESH_DIR becomes a new empty "
        "directory for each measurement (a disk cache that must start cold)",
    )
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "torchgrain-scale"))
    p.add_argument("--gen-workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--python", help="interpreter of the children (default: .venv-peers if made)")
    p.add_argument("--no-peers", action="store_true", help="torchgrain only (no HF, no Grain)")
    p.add_argument("--only", nargs="*", help="case names to run (see --list)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per measurement")
    p.add_argument(
        "--batch-timeout", type=float, default=300.0, help="DataLoader timeout (with workers)"
    )
    p.add_argument(
        "--max-mem-gib",
        type=float,
        help="PSS limit per measurement, the child and its workers (default 60%% of RAM)",
    )
    p.add_argument("--model-records", type=_num, default=10**9)
    p.add_argument("--model-shards", type=_num, default=10**5)
    p.add_argument("--model-procs", type=int, default=64)
    p.add_argument("--json", default="scale", help="results name (benchmarks/results/NAME.json)")
    p.add_argument("--out", help="write NAME.json (and the PNG) here instead of benchmarks/results")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--prepare-only", action="store_true", help="make the data, measure nothing")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--decode", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for k, v in SCALES[a.scale].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.row_group_rows is None:
        # 50,000-row groups against the default cache, and proportionally fewer rows
        # against a smaller one: the cache then holds as many row groups as at full
        # scale (~180), and the data as many times more.
        cache = a.parquet_cache_mib or DEFAULT_CACHE_MIB
        a.row_group_rows = max(100, round(FULL_ROW_GROUP_ROWS * cache / DEFAULT_CACHE_MIB))
    a.source_options = json.loads(a.source_options)
    if not isinstance(a.source_options, dict) or not all(
        k in ("arrayrecord", "parquet", "tfrecord") and isinstance(v, dict)
        for k, v in a.source_options.items()
    ):
        p.error(
            "--source-options: a JSON object {format: {option: value}}, formats "
            "arrayrecord, parquet, tfrecord"
        )
    return a


def plan_data(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Dataset name -> what to make (kind, sizes, folder)."""
    data: dict[str, dict[str, Any]] = {}
    for s in a.ar_shards:
        data[f"ar{s}"] = {"kind": "arrayrecord", "records": a.records, "shards": s}
    # An eighth of the records in the fewest shards: separates the memory per record
    # from the fixed costs of a reading process (the memory model's fit).
    s0 = min(a.ar_shards)
    data[f"ar{s0}-small"] = {"kind": "arrayrecord", "records": a.records // 8, "shards": s0}
    cache = a.parquet_cache_mib
    for r in a.parquet_ratios:
        rows = parquet_rows(r, cache)
        data[f"pq{r:g}x"] = {"kind": "parquet", "rows": rows, "ratio": r}
    if a.tfrecord_records:
        data[f"tfr{a.tfrecord_shards}"] = {
            "kind": "tfrecord",
            "records": a.tfrecord_records,
            "shards": a.tfrecord_shards,
        }
        data[f"tfr{a.tfrecord_shards}-small"] = {
            "kind": "tfrecord",
            "records": a.tfrecord_records // 8,
            "shards": a.tfrecord_shards,
        }
    if not a.no_peers:
        data["hf-ar"] = {"kind": "hf", "from": "records-pq", "rows": a.records}
        for r in a.hf_parquet_ratios:
            if f"pq{r:g}x" in data:
                data[f"hf-pq{r:g}x"] = {
                    "kind": "hf",
                    "from": f"pq{r:g}x",
                    "rows": data[f"pq{r:g}x"]["rows"],
                }
    for name, d in data.items():
        key = "-".join(f"{v}" for k, v in sorted(d.items()) if k != "kind")
        if d["kind"] == "parquet":
            key += f"-{a.parquet_files}-{a.row_group_rows}"
        d["path"] = os.path.join(a.data_dir, f"{name}-{key}")
    return data


def warmup(a: argparse.Namespace, data: dict[str, dict[str, Any]], case: str, workers: int) -> int:
    """Batches before the measured ones: ``--warmup``, else enough for every reading
    process to have met every shard about once (readers opened on first use are then
    open: the measured batches are the steady state)."""
    if a.warmup is not None:
        return a.warmup
    shards = data.get(case.split("/")[0], {}).get("shards", 1)
    meet_all = math.ceil(shards * math.log(max(shards, 2)) / BATCH) * max(1, workers)
    return max(20, meet_all)


def plan_cases(a: argparse.Namespace, data: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Case name -> child spec (without workers)."""
    opts = a.source_options
    cases: dict[str, dict[str, Any]] = {
        "bare": {"loader": "bare", "format": "none", "path": "", "records": a.records}
    }
    pq_opts = dict(opts.get("parquet", {}))
    if a.parquet_cache_mib is not None:
        pq_opts.setdefault("cache_bytes", int(a.parquet_cache_mib * MIB))
    for name, d in data.items():
        if d["kind"] == "arrayrecord":
            cases[f"{name}/tg"] = {"loader": "tg", "format": "arrayrecord", "path": d["path"],
                                   "source_options": opts.get("arrayrecord", {})}  # fmt: skip
            if not a.no_peers and d["shards"] in (min(a.ar_shards), max(a.ar_shards)):
                cases[f"{name}/grain"] = {
                    "loader": "grain",
                    "format": "arrayrecord",
                    "path": d["path"],
                    "records": d["records"],
                }
        elif d["kind"] == "parquet":
            for smp in ("global", "block"):
                cases[f"{name}/tg-{smp}"] = {"loader": "tg", "format": "parquet", "path": d["path"],
                                             "sampler": smp, "source_options": pq_opts}  # fmt: skip
        elif d["kind"] == "tfrecord":
            cases[f"{name}/tg"] = {"loader": "tg", "format": "tfrecord", "path": d["path"],
                                   "source_options": opts.get("tfrecord", {})}  # fmt: skip
        elif d["kind"] == "hf":
            cases[f"{name}/hf"] = {"loader": "hf", "format": "hf", "path": d["path"]}
    for c in cases.values():
        c.setdefault("sampler", "global")
    return cases


# Bytes on disk per record (and per shard), measured here: ArrayRecord with one
# 39-byte record per chunk, TFRecord frames of 40 bytes, zstd Parquet and HF's Arrow.
_DISK = {"arrayrecord": (110, 64 << 10), "tfrecord": (40, 0), "parquet": (26, 0), "hf": (30, 0)}


def disk_needed(data: dict[str, dict[str, Any]]) -> int:
    """About how many bytes the datasets not made yet will take."""
    total = 0
    for d in data.values():
        if os.path.exists(_marker(d["path"])):
            continue  # made by an earlier run (possibly with other sizes: then an underestimate)
        per_record, per_shard = _DISK[d["kind"]]
        total += per_record * d.get("records", d.get("rows", 0)) + per_shard * d.get("shards", 1)
    return total


def prepare(
    a: argparse.Namespace, data: dict[str, dict[str, Any]], python: str, env: dict[str, str]
) -> dict[str, Any]:
    """Make (or reuse) every dataset; a first open of each torchgrain one, timed."""
    os.makedirs(a.data_dir, exist_ok=True)
    need, free = disk_needed(data), shutil.disk_usage(a.data_dir).free
    if need > 0.9 * free:
        raise SystemExit(
            f"scale: the data needs about {need / GIB:.0f} GiB in {a.data_dir}, which has "
            f"{free / GIB:.0f} GiB free: pass --data-dir elsewhere or a smaller --scale"
        )
    made: dict[str, Any] = {}
    for name, d in data.items():
        t0 = time.perf_counter()
        if d["kind"] == "arrayrecord":
            info = make_arrayrecord(d["path"], d["records"], d["shards"], a.gen_workers)
        elif d["kind"] == "parquet":
            info = make_parquet(d["path"], d["rows"], a.parquet_files, a.row_group_rows)
        elif d["kind"] == "tfrecord":
            info = make_tfrecord(d["path"], d["records"], d["shards"], a.gen_workers)
        else:
            if d["from"] == "records-pq":
                src = os.path.join(a.data_dir, f"records-pq-{d['rows']}")
                make_parquet(src, d["rows"], max(1, d["rows"] // 10_000_000), 100_000)
            else:
                src = data[d["from"]]["path"]
            info = make_hf(d["path"], src, python, d["rows"])
        took = time.perf_counter() - t0
        made[name] = {**info, "seconds_this_run": took}
        print(f"  {name:<12} {info['bytes'] / GIB:7.2f} GiB  made in {info.get('write_s', 0):.1f} s "
              f"({'reused' if took < 0.5 * info.get('write_s', 0) else 'now'})", flush=True)  # fmt: skip
    return made


def summarize(
    runs: list[dict[str, Any]], cases: dict[str, dict[str, Any]], workers: list[int]
) -> list[dict[str, Any]]:
    def med(vals: list[Any]) -> Any:
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    rows = []
    for name in cases:
        for w in workers:
            mine = [r for r in runs if r["case"] == name and r["workers"] == w]
            good = [r for r in mine if "error" not in r]
            row: dict[str, Any] = {"case": name, "workers": w}
            if not good:
                row["check"] = mine[0]["error"][:200] if mine else "not run"
                rows.append(row)
                continue
            row.update(
                {
                    "records": good[0]["records"],
                    "open_s": med([r["open_s"] for r in good]),
                    "first_batch_s": med([r.get("first_batch_s") for r in good]),
                    "warmup_s": med([r.get("warmup_s") for r in good]),
                    "rate": med([r.get("rate") for r in good]),
                    "epoch0_s": med([r.get("epoch0_s") for r in good]),
                    "epoch0_projected_s": med([r.get("epoch0_projected_s") for r in good]),
                    "epoch1_rate": med([r.get("epoch1_rate") for r in good]),
                    "uss_main_mib": med([r["uss_main"] / MIB for r in good if "uss_main" in r]),
                    "uss_worker_mib": med(
                        [
                            statistics.mean(r["uss_workers"]) / MIB
                            for r in good
                            if r.get("uss_workers")
                        ]
                    ),
                    "dirty_main_mib": med(
                        [r["dirty_main"] / MIB for r in good if "dirty_main" in r]
                    ),
                    "dirty_worker_mib": med(
                        [
                            statistics.mean(r["dirty_workers"]) / MIB
                            for r in good
                            if r.get("dirty_workers")
                        ]
                    ),
                    "pss_total_mib": med([r["pss_total"] / MIB for r in good if "pss_total" in r]),
                    "open_uss_mib": med([r["open_uss"] / MIB for r in good]),
                    "rounds": len(good),
                    "check": "ok"
                    if all(r["bad"] == 0 and r["exact_epochs"] for r in good)
                    else f"{sum(r['bad'] for r in good)} bad records"
                    + ("" if all(r["exact_epochs"] for r in good) else "; an epoch not exact"),
                }
            )
            if len(good) < len(mine):
                row["check"] += (
                    f"; {len(mine) - len(good)} failed: {next(r['error'] for r in mine if 'error' in r)[:120]}"
                )
            rows.append(row)
    return rows


def paired_ratio(
    runs: list[dict[str, Any]], a: str, b: str, w: int, key: str = "rate"
) -> float | None:
    """Median over rounds of ``a``'s ``key`` over ``b``'s, paired by round."""
    got = {
        (r["case"], r["round"]): r.get(key) for r in runs if r["workers"] == w and "error" not in r
    }
    vals = [
        got[(a, k)] / got[(b, k)] for (c, k) in got if c == a and got.get((b, k)) and got[(a, k)]
    ]
    return statistics.median(vals) if vals else None


def source_memory(row: dict[str, Any], bare: dict[str, Any]) -> dict[str, float] | None:
    """A row's memory beyond the bare loader's (same workers): ``private_mib``, the
    Private_Dirty of its worst reading process, and ``shared_mib``, what the loader's
    processes hold besides their Private_Dirty (the page cache they map, shared
    memory), counted once through PSS."""
    keys = ("dirty_main_mib", "pss_total_mib") + (("dirty_worker_mib",) if row["workers"] else ())
    if any(row.get(k) is None or bare.get(k) is None for k in keys):
        return None
    w = row["workers"]
    private = row["dirty_main_mib"] - bare["dirty_main_mib"]
    if w:  # the workers read; the main process holds what it built before forking them
        private = max(private, row["dirty_worker_mib"] - bare["dirty_worker_mib"])

    def rest(r: dict[str, Any]) -> float:
        return r["pss_total_mib"] - r["dirty_main_mib"] - w * (r.get("dirty_worker_mib") or 0)

    return {"private_mib": max(0.0, private), "shared_mib": max(0.0, rest(row) - rest(bare))}


def _fit(points: list[tuple[int, int, float]]) -> tuple[float, float, float, str]:
    """``value ~ fixed + per_record * records + per_shard * shards``, least squares over
    the columns that vary among the points; ``(fixed, per_record, per_shard, note)``."""
    ns = np.array([p[0] for p in points], float)
    ss = np.array([p[1] for p in points], float)
    y = np.array([p[2] for p in points], float)
    cols, names = [np.ones_like(y)], ["fixed"]
    if len(set(ns)) > 1:
        cols.append(ns)
        names.append("n")
    if len(set(ss)) > 1:
        cols.append(ss)
        names.append("s")
    coef = dict(zip(names, np.linalg.lstsq(np.stack(cols, 1), y, rcond=None)[0]))
    note = ""
    if "n" not in coef:  # one record count: everything but the shards' part is per record
        coef["n"], coef["fixed"], note = (
            coef["fixed"] / ns.max(),
            0.0,
            "fixed costs counted per record",
        )
    return max(0.0, coef["fixed"]), max(0.0, coef["n"]), max(0.0, coef.get("s", 0.0)), note


def memory_model(
    a: argparse.Namespace, rows: list[dict[str, Any]], data: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per loader: a reading process's private memory and the loader's shared memory
    (each beyond the bare loader's) as fixed + per record + per shard, fitted over the
    datasets measured, then extrapolated on paper to ``--model-*``."""
    bare = {r["workers"]: r for r in rows if r["case"] == "bare"}
    private: dict[str, dict[str, tuple[int, int, float]]] = {}
    shared: dict[str, dict[str, tuple[int, int, float]]] = {}
    for r in rows:
        if r["case"] == "bare" or r.get("records") is None:
            continue
        dname, loader = r["case"].split("/")
        d = data[dname]
        if d["kind"] == "parquet":
            continue  # a cache, not an index: bounded by cache_bytes, not by records
        m = source_memory(r, bare.get(r["workers"], {}))
        if m is None:
            continue
        fam = f"{d['kind']}/{loader}"
        point = (r["records"], d.get("shards", 1))
        # the worst reading process over the worker counts measured
        old = private.setdefault(fam, {}).get(dname, (*point, 0.0))
        private[fam][dname] = (*point, max(old[2], m["private_mib"] * MIB))
        old = shared.setdefault(fam, {}).get(dname, (*point, 0.0))
        shared[fam][dname] = (*point, max(old[2], m["shared_mib"] * MIB))
    out = []
    N, P = a.model_records, a.model_procs
    for fam, pts in private.items():
        fixed, per_record, per_shard, note = _fit(list(pts.values()))
        sh = list(shared.get(fam, {}).values())
        s_fixed, s_per_record, _, _ = _fit([(n, 1, v) for n, _, v in sh]) if sh else (0, 0, 0, "")
        S = a.model_shards if fam.startswith(("arrayrecord", "tfrecord")) else 1
        one = fixed + per_record * N + per_shard * S
        both = s_fixed + s_per_record * N
        out.append(
            {
                "loader": fam,
                "points": sorted(pts.values()),
                "fixed_private_mib": fixed / MIB,
                "private_bytes_per_record": per_record,
                "private_bytes_per_shard": per_shard,
                "shared_bytes_per_record": s_per_record,
                "model_records": N,
                "model_shards": S,
                "model_procs": P,
                "private_gib_per_proc": one / GIB,
                "shared_gib": both / GIB,
                "node_gib": (P * one + both) / GIB,
                "node_vs_one_proc": (P * one + both) / (one + both) if one + both else 1.0,
                "note": note,
            }
        )
    return out


def targets(
    a: argparse.Namespace,
    rows: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    model: list[dict[str, Any]],
    decode: dict[str, Any],
    data: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """The issue's targets, met or missed, from this run's numbers."""
    out: list[dict[str, Any]] = []

    def add(
        target: str, value: float | None, goal: float, le: bool, w: int | None, note: str = ""
    ) -> None:
        if value is None:
            status = "not measured"
        else:
            status = "met" if (value <= goal if le else value >= goal) else "missed"
        out.append(
            {
                "target": target,
                "workers": w,
                "value": value,
                "goal": f"{'<=' if le else '>='} {goal:g}",
                "status": status,
                "note": note,
            }
        )

    ar = sorted(s for s in a.ar_shards)
    base = f"ar{ar[0]}/tg"
    for w in a.workers:
        for s, goal in ((2048, 0.8), (10_000, 0.7)):
            near = min((x for x in ar if x != ar[0]), key=lambda x: abs(x - s), default=None)
            if near is None:
                continue
            note = "" if near == s else f"measured at {near} shards"
            value = paired_ratio(runs, f"ar{near}/tg", base, w)
            if value is None:  # say why: the failure of either case
                failed = [
                    r
                    for r in runs
                    if r["case"] in (base, f"ar{near}/tg") and r["workers"] == w and "error" in r
                ]
                note = "; ".join([note] * bool(note) + [r["error"][-160:] for r in failed[:1]])
            add(
                f"ArrayRecord {s:,} shards / {ar[0]} shards rate",
                value,
                goal,
                False,
                w,
                note,
            )
    fam = next((m for m in model if m["loader"] == "arrayrecord/tg"), None)
    if fam:
        per = fam["private_bytes_per_record"] + fam["private_bytes_per_shard"] * max(ar) / a.records
        add("ArrayRecord private index bytes per record per process", per, 1.0, True, None,
            f"per record + per shard at {max(ar)} shards, {a.records:,} records")  # fmt: skip
        add(
            f"node total, {a.model_procs} processes / one process ({a.model_records:.0e} records)",
            fam["node_vs_one_proc"],
            1.1,
            True,
            None,
            "memory model",
        )
    r = 4.0
    name = f"pq{r:g}x"
    if name in data and f"hf-{name}" in data:
        for w in a.workers:
            tg_row = next(
                (x for x in rows if x["case"] == f"{name}/tg-global" and x["workers"] == w), {}
            )
            hf_row = next(
                (x for x in rows if x["case"] == f"hf-{name}/hf" and x["workers"] == w), {}
            )
            e1 = tg_row.get("epoch1_rate")
            hf = hf_row.get("epoch1_rate") or hf_row.get("rate")
            if e1 is not None and hf:
                add(
                    "Parquet 4x cache, global shuffle, second epoch rate / HF's",
                    e1 / hf,
                    1.0,
                    False,
                    w,
                )
            elif tg_row.get("rate") and hf:
                # The second epoch was not reached; the first epoch's steady rate is a
                # lower bound where a disk cache fills in epoch 1, an estimate otherwise.
                add("Parquet 4x cache, global shuffle, second epoch rate / HF's", tg_row["rate"] / hf, 1.0, False, w,
                    "second epoch not reached: the first one's steady rate")  # fmt: skip
            else:
                add(
                    "Parquet 4x cache, global shuffle, second epoch rate / HF's",
                    None,
                    1.0,
                    False,
                    w,
                )
            e0 = tg_row.get("epoch0_s") or tg_row.get("epoch0_projected_s")
            dec = decode.get(name, {}).get("decode_s")
            note = "" if tg_row.get("epoch0_s") else "first epoch projected from its steady rate"
            add(
                "Parquet 4x cache, first epoch time / one decode of the data",
                e0 / dec if e0 and dec else None,
                2.0,
                True,
                w,
                note,
            )
    return out


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ws = sorted({r["workers"] for r in rows})
    names = [n for n in dict.fromkeys(r["case"] for r in rows) if n != "bare"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.45 * len(names) + 2), sharey=True)
    y = np.arange(len(names))
    h = 0.8 / max(1, len(ws))
    for k, w in enumerate(ws):
        by = {r["case"]: r for r in rows if r["workers"] == w}
        rate = [by.get(n, {}).get("rate") or 0 for n in names]
        mem = [by.get(n, {}).get("loader_private_mib") or 0 for n in names]
        axes[0].barh(y + k * h, rate, h, label=f"{w} workers")
        for i, n in enumerate(names):
            if by.get(n, {}).get("rate") is None:
                axes[0].annotate(f"{w} workers: failed", (0, y[i] + k * h), xycoords=("axes fraction", "data"), fontsize=8, va="center", xytext=(4, 0), textcoords="offset points")  # fmt: skip
        axes[1].barh(y + k * h, mem, h, label=f"{w} workers")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("records/s after warm-up (log)")
    axes[1].set_xlabel("Private_Dirty MiB of a reading process, beyond the bare loader's")
    axes[0].set_yticks(y + h * (len(ws) - 1) / 2, names)
    axes[0].invert_yaxis()
    for ax in axes:
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    # A terminated run unwinds (run_child's ``finally`` ends the running measurement).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.child:
        print(json.dumps(child(json.loads(a.child))), flush=True)
        return 0
    if a.decode:
        print(json.dumps(decode_once(a.decode)), flush=True)
        return 0
    peers_py = os.path.join(ROOT, ".venv-peers", "bin", "python")
    python = a.python or (peers_py if os.path.exists(peers_py) else sys.executable)
    if not a.python and python == sys.executable and not a.no_peers:
        print(
            "no .venv-peers (bash scripts/setup_peers.sh makes it): HF datasets and Grain left out"
        )
        a.no_peers = True
    data = plan_data(a)
    cases = plan_cases(a, data)
    if a.only:
        unknown = set(a.only) - set(cases)
        if unknown:
            print(f"scale: no case named {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        keep = {"bare", *a.only}
        cases = {k: v for k, v in cases.items() if k in keep}
        need = {k.split("/")[0] for k in cases}
        data = {
            k: v
            for k, v in data.items()
            if k in need or any(data[n].get("from") == k for n in need if n in data)
        }
    if a.list:
        print("\n".join(cases))
        return 0
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["TORCHGRAIN_CACHE"] = os.path.join(a.data_dir, "tg-cache")  # indexes with the data
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["TORCHGRAIN_CACHE"] = env["TORCHGRAIN_CACHE"]
    import psutil

    max_mem = int((a.max_mem_gib or 0.6 * psutil.virtual_memory().total / GIB) * GIB)
    print(f"machine: {describe_machine()}")
    print(f"children: {python}")
    cache_note = (
        f"{a.parquet_cache_mib:g} MiB (passed as cache_bytes)"
        if a.parquet_cache_mib is not None
        else f"the default {DEFAULT_CACHE_MIB} MiB"
    )
    print(
        f"scale {a.scale}: {a.records:,} records, ArrayRecord shards {a.ar_shards}, Parquet "
        f"{a.parquet_ratios}x a cache of {cache_note}, TFRecord {a.tfrecord_records:,} in "
        f"{a.tfrecord_shards} shards; workers {a.workers}, {a.rounds} rounds, batch {BATCH}, "
        f"{a.warmup}+{a.measure} batches, whole epochs within {a.epoch_budget:.0f} s"
    )
    print("data (made once, kept in " + a.data_dir + "):")
    t_gen = time.perf_counter()
    made = prepare(a, data, python, env)
    gen_s = time.perf_counter() - t_gen
    if a.prepare_only:
        print(f"generation {gen_s:.0f} s")
        return 0
    # A first open of every torchgrain dataset: where an index is built, it is built now.
    first_open = {}
    for name, spec in cases.items():
        if spec["loader"] != "tg":
            continue
        dname = name.split("/")[0]
        if dname in first_open:
            continue
        once = {**spec, "workers": 0, "warmup": 1, "measure": 1, "epochs": 0, "epoch_budget": 0}
        with fresh_dirs(once, a.data_dir) as once:
            r = run_child(once, python, a.timeout, max_mem, env)
        first_open[dname] = r.get("open_s") if "error" not in r else r["error"]
    decode = {}
    for name, d in data.items():
        if d["kind"] == "parquet":
            cmd = [python, os.path.abspath(__file__), "--decode", d["path"]]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            decode[name] = (
                json.loads(p.stdout.strip().splitlines()[-1])
                if p.returncode == 0
                else {"error": p.stderr[-300:]}
            )
    print(
        f"first opens: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in first_open.items()})}"
    )
    print(f"one decode of the Parquet data: {json.dumps(decode)}")

    runs: list[dict[str, Any]] = []
    names = list(cases)
    t_run = time.perf_counter()
    for rnd in range(a.rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for w in a.workers:
            for name in order:
                spec = {**cases[name], "workers": w, "warmup": warmup(a, data, name, w), "measure": a.measure, "batch_timeout": a.batch_timeout,
                        "epochs": a.epochs, "epoch_budget": a.epoch_budget,
                        "records": cases[name].get("records", a.records)}  # fmt: skip
                with fresh_dirs(spec, a.data_dir) as spec:
                    r = run_child(spec, python, a.timeout, max_mem, env)
                r.update({"case": name, "workers": w, "round": rnd})
                runs.append(r)
                if "error" in r:
                    msg = r["error"][:200]
                else:
                    msg = (
                        f"open {r['open_s'] or 0:.3f}s first {r.get('first_batch_s', 0):.3f}s "
                        f"warm-up {spec['warmup']} batches {r.get('warmup_s', 0):.1f}s "
                        f"{r.get('rate', 0):>10,.0f} rec/s  uss main {r.get('uss_main', 0) / MIB:.0f} MiB"
                        + (
                            f" workers {[round(u / MIB) for u in r['uss_workers']]}"
                            if r.get("uss_workers")
                            else ""
                        )
                        + f"  pss {r.get('pss_total', 0) / MIB:.0f} MiB"
                        + "".join(f"  epoch{e['epoch']} {e['seconds']:.1f}s" for e in r["epochs"])
                        + ("" if r["bad"] == 0 else f"  {r['bad']} BAD RECORDS")
                    )
                print(f"  round {rnd} W={w} {name:<18} {msg}", flush=True)
    run_s = time.perf_counter() - t_run
    rows = summarize(runs, cases, a.workers)
    for row in rows:
        if row["case"] == "bare" or row.get("rate") is None:
            continue
        dname = row["case"].split("/")[0]
        ref = None
        if data[dname]["kind"] == "arrayrecord" and row["case"].endswith("/tg"):
            ref = f"{dname}/grain" if f"{dname}/grain" in cases else None
            row["x_grain"] = paired_ratio(runs, row["case"], ref, row["workers"]) if ref else None
            same = data[dname]["records"] == a.records and "hf-ar/hf" in cases
            row["x_hf"] = (
                paired_ratio(runs, row["case"], "hf-ar/hf", row["workers"]) if same else None
            )
        if data[dname]["kind"] == "parquet" and f"hf-{dname}/hf" in cases:
            row["x_hf"] = paired_ratio(runs, row["case"], f"hf-{dname}/hf", row["workers"])
    bare_rows = {r["workers"]: r for r in rows if r["case"] == "bare"}
    for row in rows:
        m = None if row["case"] == "bare" else source_memory(row, bare_rows.get(row["workers"], {}))
        if m is not None:
            row["loader_private_mib"], row["loader_shared_mib"] = m["private_mib"], m["shared_mib"]
    print()
    print_table(
        rows,
        ["case", "workers", "open_s", "first_batch_s", "warmup_s", "rate", "x_hf", "x_grain", "epoch0_s",
         "epoch1_rate", "uss_main_mib", "uss_worker_mib", "dirty_main_mib", "dirty_worker_mib",
         "pss_total_mib", "loader_private_mib", "loader_shared_mib", "check"],
    )  # fmt: skip
    model = memory_model(a, rows, data)
    print(
        f"\nmemory model: {a.model_records:.0e} records, {a.model_shards:.0e} shards, {a.model_procs} processes per node"
    )
    print_table(
        model,
        ["loader", "fixed_private_mib", "private_bytes_per_record", "private_bytes_per_shard",
         "shared_bytes_per_record", "private_gib_per_proc", "shared_gib", "node_gib",
         "node_vs_one_proc", "note"],
    )  # fmt: skip
    goals = targets(a, rows, runs, model, decode, data)
    print("\ntargets of issue 28:")
    print_table(goals, ["target", "workers", "value", "goal", "status", "note"])
    print(f"\ngeneration {gen_s:.0f} s (this run), measurements {run_s:.0f} s")
    payload = {
        "scale": a.scale,
        "config": {k: v for k, v in vars(a).items() if k not in ("child", "decode")},
        "batch_size": BATCH,
        "children_python": python,
        "data": {k: {**v, **made.get(k, {})} for k, v in data.items()},
        "first_open_s": first_open,
        "decode_once": decode,
        "generation_s": gen_s,
        "measure_s": run_s,
        "results": rows,
        "runs": runs,
        "memory_model": model,
        "targets": goals,
    }
    out_dir = a.out or RESULTS_DIR
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        doc = {"benchmark": a.json, "machine": machine(), "argv": sys.argv[1:], **payload}
        with open(os.path.join(a.out, f"{a.json}.json"), "w") as f:
            json.dump(doc, f, indent=1, default=str)
    else:
        write_json(a.json, payload)
    if not a.no_plot:
        plot(
            rows,
            os.path.join(out_dir, f"{a.json}.png"),
            f"scale {a.scale}: {a.records:,} tiny records, batch {BATCH}",
        )
    return 0 if all(r.get("check") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
