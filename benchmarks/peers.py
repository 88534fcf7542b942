"""torchgrain against the loaders people use for large sharded data, on local disk.

Every loader gets the same records (default 200,000 of them: an ``id``, an int ``label``
derived from the id, and a ~1 KiB ``payload`` whose length varies a little and which ends
in zero bytes for every fifth record), each written by the loader's own writer (write time
and size on disk reported), and each read the way its documentation recommends, for one
shuffled epoch with batch 256, ``num_workers`` 0 and 2, in a fresh process per
measurement, rounds interleaved:

* torchgrain: ArrayRecord + ``GlobalShuffleSampler`` (records, and
  ``batch_format="columns"``); Parquet + ``GlobalShuffleSampler`` and +
  ``BlockShuffleSampler(window=8)``.
* LitData: ``optimize`` then ``StreamingDataset(shuffle=True)`` + ``StreamingDataLoader``.
* Mosaic Streaming: ``MDSWriter`` then ``StreamingDataset(shuffle=True)`` (default
  ``py1e`` shuffle) + DataLoader.
* Lance: ``lance.write_dataset`` then ``take()`` of each batch of a random permutation,
  through a torch map-style Dataset (the dataset opened inside each worker).
* WebDataset: ``ShardWriter`` then ``WebDataset(shardshuffle=...)``, a 1,000-sample
  shuffle buffer, ``batched(256)``, ``WebLoader``.
* Hugging Face datasets: ``Dataset.from_generator().save_to_disk()``, then
  ``load_from_disk`` + DataLoader(shuffle=True), in the default python format and in the
  numpy format.
* Grain: ``ArrayRecordWriter`` (pickled records), then
  ``MapDataset.source(ArrayRecordDataSource).shuffle().map().batch()``, with
  ``mp_prefetch`` for workers.

Reported per loader: samples/s (the consumer computes a CRC of every payload, the same
cost for all), time to first batch (from opening the dataset), peak RSS of the process
plus its workers (sum of RSS, so shared pages count once per process), and the shuffle
quality, measured the same way for all: the mean number of distinct source chunks per
batch, where a chunk is a run of 2,048 consecutive ids in write order (a uniform shuffle
of 200,000 records gives about 92), and the lag-1 correlation of the ids. Every epoch is
checked: each id exactly once, label and payload (length and CRC) as written; a loader
that fails the check is reported, not dropped. Ratios are against torchgrain ArrayRecord
with the global shuffle at the same ``num_workers``, as the median of per-round ratios.

``--remote`` runs the object-storage comparison instead (see ``peers_remote.py``).

Run with the peers' environment (``bash scripts/setup_peers.sh`` creates it):
      .venv-peers/bin/python benchmarks/peers.py            (about 40 minutes on 2 cores)
      .venv-peers/bin/python benchmarks/peers.py --quick    (small, one round)
      .venv-peers/bin/python benchmarks/peers.py --only tg_ar_global lance --workers 2
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHUNK = 2048  # ids per "source chunk" for the shuffle-quality metric
SEED = 0


# ----------------------------------------------------------------------------- records


def _blob(payload: int) -> bytes:
    return np.random.default_rng(1234).integers(0, 256, (1 << 20) + 4 * payload, np.uint8).tobytes()


def payload_of(i: int, blob: bytes, payload: int) -> bytes:
    """Record ``i``'s payload: ``payload - 8 .. payload + 8`` bytes, the last 4 zero for
    every fifth record (fixed-width string columns drop trailing zeros)."""
    n = payload - 8 + (i * 7) % 17
    start = (i * 4099) % (1 << 20)
    b = blob[start : start + n]
    return b[:-4] + b"\0\0\0\0" if i % 5 == 0 else b


def label_of(i: int) -> int:
    return (i * 7919) % 1000


def records(n: int, payload: int) -> Iterator[dict[str, Any]]:
    blob = _blob(payload)
    for i in range(n):
        yield {"id": i, "label": label_of(i), "payload": payload_of(i, blob, payload)}


def expected(n: int, payload: int) -> tuple[np.ndarray, np.ndarray]:
    """(crc32, length) of every record's payload, by id."""
    blob = _blob(payload)
    crc = np.empty(n, np.uint32)
    ln = np.empty(n, np.int64)
    for i in range(n):
        p = payload_of(i, blob, payload)
        crc[i] = zlib.crc32(p)
        ln[i] = len(p)
    return crc, ln


# ----------------------------------------------------------------------------- writers


def _du(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(d, f))
    return total


def _stub_torchvision() -> None:
    """Mosaic Streaming imports torchvision for its image datasets (unused here); the
    CPU torch of this environment has no matching torchvision on PyPI, and the PyPI one
    pulls a CUDA torch. A stub module is enough for ``import streaming``."""
    try:
        import torchvision  # noqa: F401

        return
    except ImportError:
        pass
    import torch

    def stub(name: str, **attrs: Any) -> None:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = m

    stub("torchvision")
    stub("torchvision.datasets", VisionDataset=torch.utils.data.Dataset)
    stub("torchvision.transforms")
    stub("torchvision.transforms.functional", to_tensor=None)


SHARDS = 8


def write_tg_arrayrecord(d: str, n: int, payload: int) -> None:
    import torchgrain as tg

    tg.write_array_record(list(records(n, payload)), d, num_shards=SHARDS)


def write_tg_arrayrecord_raw(d: str, n: int, payload: int) -> None:
    import torchgrain as tg

    tg.write_array_record(
        list(records(n, payload)), d, num_shards=SHARDS, compression="uncompressed"
    )


def write_tg_parquet(d: str, n: int, payload: int) -> None:
    import torchgrain as tg

    tg.write_parquet(list(records(n, payload)), d, num_shards=SHARDS)


def _litdata_fn(i: int, payload: int = 1024) -> dict[str, Any]:
    blob = _LITDATA_BLOB.get(payload)
    if blob is None:
        blob = _LITDATA_BLOB[payload] = _blob(payload)
    return {"id": i, "label": label_of(i), "payload": payload_of(i, blob, payload)}


_LITDATA_BLOB: dict[int, bytes] = {}


def write_litdata(d: str, n: int, payload: int) -> None:
    import functools

    from litdata import optimize

    optimize(
        fn=functools.partial(_litdata_fn, payload=payload),
        inputs=list(range(n)),
        output_dir=d,
        chunk_bytes="64MB",
        num_workers=1,
    )


def write_mosaic(d: str, n: int, payload: int) -> None:
    _stub_torchvision()
    from streaming import MDSWriter

    cols = {"id": "int64", "label": "int64", "payload": "bytes"}
    with MDSWriter(out=d, columns=cols) as w:
        for r in records(n, payload):
            w.write(r)


def write_lance(d: str, n: int, payload: int) -> None:
    import lance
    import pyarrow as pa

    schema = pa.schema([("id", pa.int64()), ("label", pa.int64()), ("payload", pa.binary())])

    def batches() -> Iterator[pa.RecordBatch]:
        buf: list[dict[str, Any]] = []
        for r in records(n, payload):
            buf.append(r)
            if len(buf) == 10_000:
                yield pa.RecordBatch.from_pylist(buf, schema=schema)
                buf = []
        if buf:
            yield pa.RecordBatch.from_pylist(buf, schema=schema)

    lance.write_dataset(pa.RecordBatchReader.from_batches(schema, batches()), d)


def write_wds(d: str, n: int, payload: int) -> None:
    import webdataset as wds

    os.makedirs(d, exist_ok=True)
    per = -(-n // SHARDS)
    with wds.ShardWriter(os.path.join(d, "shard-%06d.tar"), maxcount=per, verbose=0) as sink:
        for r in records(n, payload):
            sink.write(
                {
                    "__key__": f"{r['id']:09d}",
                    "id.cls": r["id"],
                    "label.cls": r["label"],
                    "payload.bin": r["payload"],
                }
            )


def write_hf(d: str, n: int, payload: int) -> None:
    import datasets

    feats = datasets.Features(
        {
            "id": datasets.Value("int64"),
            "label": datasets.Value("int64"),
            "payload": datasets.Value("binary"),
        }
    )
    cache = d + ".build"
    ds = datasets.Dataset.from_generator(
        records, gen_kwargs={"n": n, "payload": payload}, features=feats, cache_dir=cache
    )
    ds.save_to_disk(d)
    del ds
    shutil.rmtree(cache, ignore_errors=True)


def write_grain(d: str, n: int, payload: int) -> None:
    import pickle

    from array_record.python.array_record_module import ArrayRecordWriter

    os.makedirs(d, exist_ok=True)
    per = -(-n // SHARDS)
    w = None
    for r in records(n, payload):
        if r["id"] % per == 0:
            if w is not None:
                w.close()
            w = ArrayRecordWriter(
                os.path.join(d, f"data-{r['id'] // per:05d}.array_record"), "group_size:1"
            )
        w.write(pickle.dumps(r, protocol=5))
    if w is not None:
        w.close()


# One on-disk dataset per format; several loader configurations may read the same one.
WRITERS: dict[str, Callable[[str, int, int], None]] = {
    "tg_arrayrecord": write_tg_arrayrecord,
    "tg_arrayrecord_raw": write_tg_arrayrecord_raw,
    "tg_parquet": write_tg_parquet,
    "litdata": write_litdata,
    "mosaic": write_mosaic,
    "lance": write_lance,
    "webdataset": write_wds,
    "hf": write_hf,
    "grain": write_grain,
}


# ----------------------------------------------------------------------------- readers
# Each returns an iterable of batches, each batch as (ids, labels, payloads).

Batch = tuple[np.ndarray, np.ndarray, list]


def _torch_loader(ds: Any, workers: int, **kw: Any) -> Any:
    import torch

    return torch.utils.data.DataLoader(
        ds,
        batch_size=256,
        num_workers=workers,
        persistent_workers=False,
        multiprocessing_context="fork" if workers else None,
        **kw,
    )


def _dict_batches(loader: Any) -> Iterator[Batch]:
    for b in loader:
        yield np.asarray(b["id"]), np.asarray(b["label"]), list(b["payload"])


def read_tg_ar_global(d: str, workers: int) -> Iterator[Batch]:
    import torchgrain as tg

    src = tg.ArrayRecordSource(os.path.join(d, "tg_arrayrecord"))
    ds = tg.Dataset(src)
    sampler = tg.GlobalShuffleSampler(ds, seed=SEED)
    return _dict_batches(_torch_loader(ds, workers, sampler=sampler))


def read_tg_ar_raw(d: str, workers: int) -> Iterator[Batch]:
    import torchgrain as tg

    src = tg.ArrayRecordSource(os.path.join(d, "tg_arrayrecord_raw"))
    ds = tg.Dataset(src)
    sampler = tg.GlobalShuffleSampler(ds, seed=SEED)
    return _dict_batches(_torch_loader(ds, workers, sampler=sampler))


def read_tg_ar_columns(d: str, workers: int) -> Iterator[Batch]:
    import torchgrain as tg

    ds = tg.Dataset(tg.ArrayRecordSource(os.path.join(d, "tg_arrayrecord")), batch_format="columns")
    sampler = tg.GlobalShuffleSampler(ds, seed=SEED)
    loader = _torch_loader(ds, workers, sampler=sampler)

    def gen() -> Iterator[Batch]:
        for b in loader:
            p = b["payload"]  # a Ragged column: one flat buffer + offsets
            buf = memoryview(p.values.numpy())
            offs = p.offsets.tolist()
            payloads = [buf[offs[i] : offs[i + 1]] for i in range(len(offs) - 1)]
            yield np.asarray(b["id"]), np.asarray(b["label"]), payloads

    return gen()


def read_tg_pq_global(d: str, workers: int) -> Iterator[Batch]:
    import torchgrain as tg

    ds = tg.Dataset(tg.ParquetSource(os.path.join(d, "tg_parquet")))
    sampler = tg.GlobalShuffleSampler(ds, seed=SEED)
    return _dict_batches(_torch_loader(ds, workers, sampler=sampler))


def read_tg_pq_block(d: str, workers: int) -> Iterator[Batch]:
    import torchgrain as tg

    ds = tg.Dataset(tg.ParquetSource(os.path.join(d, "tg_parquet")))
    sampler = tg.BlockShuffleSampler(ds, window=8, seed=SEED, deal_to_workers=True)
    return _dict_batches(tg.bind(_torch_loader(ds, workers, sampler=sampler)))


def read_litdata(d: str, workers: int) -> Iterator[Batch]:
    from litdata import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(os.path.join(d, "litdata"), shuffle=True, seed=SEED)
    return _dict_batches(StreamingDataLoader(ds, batch_size=256, num_workers=workers))


def read_mosaic(d: str, workers: int) -> Iterator[Batch]:
    _stub_torchvision()
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(
        local=os.path.join(d, "mosaic"), shuffle=True, shuffle_seed=SEED, batch_size=256
    )
    return _dict_batches(_torch_loader(ds, workers))


class LanceTake:
    """A map-style torch Dataset over a Lance dataset: each batch is one ``take()``.
    The Lance dataset is opened lazily in each process (a handle opened in the parent
    can crash a forked worker)."""

    def __init__(self, path: str, n: int) -> None:
        # The length is given: counting rows would open the dataset in this process,
        # and a Lance handle opened before the fork can crash a forked worker.
        self.path = path
        self._n = n
        self._ds: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return self._n

    def __getitems__(self, idx: list[int]) -> Any:
        if self._ds is None or self._pid != os.getpid():
            import lance

            self._ds, self._pid = lance.dataset(self.path), os.getpid()
        t = self._ds.take(idx, columns=["id", "label", "payload"])
        return {
            "id": t.column("id").to_numpy(),
            "label": t.column("label").to_numpy(),
            "payload": t.column("payload").to_pylist(),
        }

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])


def _identity(x: Any) -> Any:
    return x


def read_lance(d: str, workers: int) -> Iterator[Batch]:
    ds = LanceTake(os.path.join(d, "lance"), int(Path(d, ".lance.written").read_text().split()[0]))
    return _dict_batches(_torch_loader(ds, workers, shuffle=True, collate_fn=_identity))


def read_wds(d: str, workers: int) -> Iterator[Batch]:
    import webdataset as wds

    shards = sorted(
        os.path.join(d, "webdataset", f) for f in os.listdir(os.path.join(d, "webdataset"))
    )
    ds = (
        wds.WebDataset(shards, shardshuffle=len(shards), seed=SEED, empty_check=False)
        .shuffle(1000)
        .decode()
        .to_tuple("id.cls", "label.cls", "payload.bin")
        .batched(256, partial=True)
    )
    loader = wds.WebLoader(ds, batch_size=None, num_workers=workers)

    def gen() -> Iterator[Batch]:
        for ids, labels, payloads in loader:
            yield np.asarray(ids), np.asarray(labels), list(payloads)

    return gen()


def _read_hf(d: str, workers: int, fmt: str | None) -> Iterator[Batch]:
    import datasets
    import torch

    ds = datasets.load_from_disk(os.path.join(d, "hf"))
    if fmt:
        ds = ds.with_format(fmt)
    g = torch.Generator()
    g.manual_seed(SEED)
    return _dict_batches(_torch_loader(ds, workers, shuffle=True, generator=g))


def read_hf_python(d: str, workers: int) -> Iterator[Batch]:
    return _read_hf(d, workers, None)


def read_hf_numpy(d: str, workers: int) -> Iterator[Batch]:
    return _read_hf(d, workers, "numpy")


def _unpickle(b: bytes) -> Any:
    import pickle

    return pickle.loads(b)


def read_grain(d: str, workers: int) -> Iterator[Batch]:
    import grain

    paths = sorted(os.path.join(d, "grain", f) for f in os.listdir(os.path.join(d, "grain")))
    ds = (
        grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))
        .shuffle(seed=SEED)
        .map(_unpickle)
        .batch(256)
    )
    if workers:
        ds = ds.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return _dict_batches(ds)


# name -> (format directory it reads, reader, description)
LOADERS: dict[str, tuple[str, Callable[[str, int], Iterator[Batch]], str]] = {
    "tg_ar_global": (
        "tg_arrayrecord",
        read_tg_ar_global,
        "torchgrain ArrayRecord + GlobalShuffleSampler",
    ),
    "tg_ar_raw": (
        "tg_arrayrecord_raw",
        read_tg_ar_raw,
        "torchgrain ArrayRecord written uncompressed + GlobalShuffleSampler",
    ),
    "tg_ar_columns": (
        "tg_arrayrecord",
        read_tg_ar_columns,
        'torchgrain ArrayRecord + GlobalShuffleSampler, batch_format="columns"',
    ),
    "tg_pq_global": ("tg_parquet", read_tg_pq_global, "torchgrain Parquet + GlobalShuffleSampler"),
    "tg_pq_block": (
        "tg_parquet",
        read_tg_pq_block,
        "torchgrain Parquet + BlockShuffleSampler(window=8)",
    ),
    "litdata": (
        "litdata",
        read_litdata,
        "LitData StreamingDataset(shuffle=True) + StreamingDataLoader",
    ),
    "mosaic": ("mosaic", read_mosaic, "Mosaic StreamingDataset(shuffle=True), py1e"),
    "lance": ("lance", read_lance, "Lance take() per batch of a random permutation"),
    "webdataset": ("webdataset", read_wds, "WebDataset shard shuffle + 1,000-sample buffer"),
    "hf_python": ("hf", read_hf_python, "HF datasets, python format, DataLoader(shuffle=True)"),
    "hf_numpy": ("hf", read_hf_numpy, "HF datasets, numpy format, DataLoader(shuffle=True)"),
    "grain": ("grain", read_grain, "Grain MapDataset.shuffle().batch() (+ mp_prefetch)"),
}
BASELINE = "tg_ar_global"
# Imported before the clock starts (an import is paid once per job, not per epoch).
IMPORTS = {
    "tg": ["torchgrain"],
    "litdata": ["litdata"],
    "mosaic": ["streaming"],
    "lance": ["lance", "pyarrow"],
    "webdataset": ["webdataset"],
    "hf": ["datasets"],
    "grain": ["grain", "array_record.python.array_record_module"],
}


# ----------------------------------------------------------------------------- one run


class PeakRSS:
    """Samples the RSS of this process plus all its descendants every 20 ms."""

    def __init__(self) -> None:
        import psutil

        self._p = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _sample(self) -> None:
        import psutil

        total = 0
        try:
            procs = [self._p, *self._p.children(recursive=True)]
        except psutil.Error:
            return
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        self.peak = max(self.peak, total)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        self._sample()
        return self.peak


def shuffle_quality(ids: np.ndarray, batch: int = 256) -> tuple[float, float]:
    """(mean distinct chunks of ``CHUNK`` ids per batch, lag-1 correlation of ids)."""
    if len(ids) < 2:
        return float("nan"), float("nan")
    chunks = ids // CHUNK
    nb = len(ids) // batch
    distinct = [len(np.unique(chunks[i * batch : (i + 1) * batch])) for i in range(max(nb, 1))]
    x = ids.astype(np.float64)
    corr = float(np.corrcoef(x[:-1], x[1:])[0, 1])
    return float(np.mean(distinct)), corr


def check_epoch(
    ids: np.ndarray, labels: np.ndarray, crcs: np.ndarray, lens: np.ndarray, n: int, payload: int
) -> str:
    """'ok', or what is wrong with the epoch (counts of missing, duplicated, bad)."""
    exp_crc, exp_len = expected(n, payload)
    problems = []
    counts = np.bincount(ids[(ids >= 0) & (ids < n)], minlength=n)
    if (ids < 0).any() or (ids >= n).any():
        problems.append(f"{int(((ids < 0) | (ids >= n)).sum())} ids out of range")
    if (counts == 0).any():
        problems.append(f"{int((counts == 0).sum())} missing")
    if (counts > 1).any():
        problems.append(f"{int((counts - 1).clip(0).sum())} duplicated")
    ok = (ids >= 0) & (ids < n)
    lab = labels[ok] != (ids[ok] * 7919) % 1000
    if lab.any():
        problems.append(f"{int(lab.sum())} wrong labels")
    short = lens[ok] != exp_len[ids[ok]]
    if short.any():
        problems.append(f"{int(short.sum())} payloads of the wrong length")
    bad = (crcs[ok] != exp_crc[ids[ok]]) & ~short
    if bad.any():
        problems.append(f"{int(bad.sum())} payloads with wrong bytes")
    return "ok" if not problems else "; ".join(problems)


def child(name: str, data: str, workers: int, n: int, payload: int) -> dict[str, Any]:
    """One shuffled epoch of one loader, in this (fresh) process."""
    fmt, reader, _ = LOADERS[name]
    import importlib

    import torch  # noqa: F401

    if name == "mosaic":
        _stub_torchvision()
    for mod in IMPORTS.get(fmt, IMPORTS.get(fmt.split("_")[0], [])):
        importlib.import_module(mod)
    rss = PeakRSS()
    t0 = time.perf_counter()
    it = iter(reader(data, workers))
    ids_l, lab_l, crc_l, len_l = [], [], [], []
    first = None
    crc32 = zlib.crc32
    for ids, labels, payloads in it:
        if first is None:
            first = time.perf_counter() - t0
        ids_l.append(ids.astype(np.int64, copy=False).reshape(-1))
        lab_l.append(labels.astype(np.int64, copy=False).reshape(-1))
        crc_l.append(np.fromiter((crc32(bytes(p)) for p in payloads), np.uint32, len(payloads)))
        len_l.append(np.fromiter((len(bytes(p)) for p in payloads), np.int64, len(payloads)))
    wall = time.perf_counter() - t0
    peak = rss.stop()
    ids = np.concatenate(ids_l) if ids_l else np.zeros(0, np.int64)
    labels = np.concatenate(lab_l) if lab_l else np.zeros(0, np.int64)
    crcs = np.concatenate(crc_l) if crc_l else np.zeros(0, np.uint32)
    lens = np.concatenate(len_l) if len_l else np.zeros(0, np.int64)
    distinct, corr = shuffle_quality(ids)
    return {
        "loader": name,
        "workers": workers,
        "samples": len(ids),
        "seconds": wall,
        "rate": len(ids) / wall if wall else 0.0,
        "first_batch_s": first,
        "peak_rss_mib": peak / 2**20,
        "distinct_chunks": distinct,
        "lag1_corr": corr,
        "check": check_epoch(ids, labels, crcs, lens, n, payload),
    }


def run_child(
    name: str, data: str, workers: int, n: int, payload: int, timeout: float
) -> dict[str, Any]:
    cmd = [
        sys.executable, os.path.abspath(__file__), "--child", name,
        "--data", data, "--workers", str(workers), "--n", str(n), "--payload", str(payload),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    rc, stdout, stderr = run_captured(cmd, env, timeout)
    if rc is None:
        return {"loader": name, "workers": workers, "error": f"timed out after {timeout:.0f}s"}
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (stderr or stdout).strip().splitlines()[-3:]
    return {"loader": name, "workers": workers, "error": f"exit {rc}: {' | '.join(tail)}"}


def run_captured(
    cmd: list[str], env: dict[str, str], timeout: float
) -> tuple[int | None, str, str]:
    """Run ``cmd``; ``(exit code or None on timeout, stdout, stderr)``.

    Output goes to files, not pipes, and the command runs in a session of its own that
    is ended when it is done: a loader's worker left behind by a finished child would
    otherwise hold a pipe open and make the child look hung.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(
            cmd, stdout=out, stderr=err, text=True, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            rc: int | None = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        out.seek(0)
        err.seek(0)
        return rc, out.read(), err.read()


# ----------------------------------------------------------------------------- driver


def write_all(
    data: str, names: list[str], n: int, payload: int, reuse: bool = False
) -> list[dict[str, Any]]:
    rows = []
    fmts = sorted({LOADERS[k][0] for k in names}, key=list(WRITERS).index)
    for fmt in fmts:
        d = os.path.join(data, fmt)
        marker = os.path.join(data, f".{fmt}.written")
        stamp = f"{n} {payload}"
        if reuse and os.path.exists(marker) and Path(marker).read_text() == stamp:
            rows.append(json.loads(Path(marker + ".json").read_text()))
            print(f"  {fmt}: reusing {d}", flush=True)
            continue
        if os.path.exists(d):
            shutil.rmtree(d)
        code = (
            f"import sys; sys.path.insert(0, {ROOT!r}); from benchmarks.peers import WRITERS; "
            f"WRITERS[{fmt!r}]({d!r}, {n}, {payload})"
        )
        t0 = time.perf_counter()
        # Each writer in its own process too (some keep state or threads around).
        p = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, cwd=ROOT
        )
        secs = time.perf_counter() - t0
        if p.returncode:
            tail = p.stderr.strip().splitlines()[-3:]
            rows.append({"format": fmt, "error": " | ".join(tail)})
            print(f"  write {fmt}: FAILED {' | '.join(tail)}", flush=True)
            continue
        size = _du(d)
        rows.append({"format": fmt, "write_s": secs, "size_mib": size / 2**20})
        with open(marker + ".json", "w") as f:
            json.dump(rows[-1], f)
        with open(marker, "w") as f:
            f.write(stamp)
        print(f"  write {fmt}: {secs:.1f} s, {size / 2**20:.1f} MiB", flush=True)
    return rows


def summarize(
    runs: list[dict[str, Any]], names: list[str], workers: list[int]
) -> list[dict[str, Any]]:
    rows = []
    for w in workers:
        base = {
            r["round"]: r["rate"]
            for r in runs
            if r["loader"] == BASELINE and r["workers"] == w and "rate" in r
        }
        for name in names:
            mine = [r for r in runs if r["loader"] == name and r["workers"] == w]
            good = [r for r in mine if "rate" in r]
            row: dict[str, Any] = {"loader": name, "workers": w, "description": LOADERS[name][2]}
            if not good:
                row["check"] = mine[0].get("error", "no result")[-200:] if mine else "not run"
                rows.append(row)
                continue
            ratios = [r["rate"] / base[r["round"]] for r in good if base.get(r["round"])]
            checks = sorted({r["check"] for r in good})
            row.update(
                {
                    "rate": statistics.median(r["rate"] for r in good),
                    "rate_min": min(r["rate"] for r in good),
                    "rate_max": max(r["rate"] for r in good),
                    "x_tg": statistics.median(ratios) if ratios else None,
                    "first_batch_s": statistics.median(r["first_batch_s"] or 0 for r in good),
                    "peak_rss_mib": max(r["peak_rss_mib"] for r in good),
                    "distinct_chunks": statistics.median(r["distinct_chunks"] for r in good),
                    "lag1_corr": statistics.median(r["lag1_corr"] for r in good),
                    "check": " / ".join(checks),
                    "errors": len(mine) - len(good),
                }
            )
            rows.append(row)
    return rows


def plot(
    rows: list[dict[str, Any]],
    path: str,
    n: int,
    *,
    panel: str = "workers",
    panel_title: str = "num_workers={}",
    xlabel: str = f"distinct {CHUNK}-record chunks per batch of 256 (uniform ~92)",
    ylabel: str = "samples/s (one shuffled epoch)",
    title: str = "records of ~1 KiB: speed vs shuffle quality (red: torchgrain)",
    flagged: str = " (bad data)",
) -> None:
    """Speed against shuffle quality, one panel per value of ``rows[i][panel]``; a row
    whose check is not "ok" is drawn as an x, its label followed by ``flagged``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return
    keys = sorted({r[panel] for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 5.5), sharey=True)
    axes = list(axes) if len(keys) > 1 else [axes]
    for ax, key in zip(axes, keys):
        for r in rows:
            if r[panel] != key or not r.get("rate") or not r.get("distinct_chunks"):
                continue
            bad = r["check"] != "ok"
            ax.scatter(
                r["distinct_chunks"], r["rate"], s=60, marker="x" if bad else "o",
                color="tab:red" if r["loader"].startswith("tg_") else "tab:blue",
            )  # fmt: skip
            ax.annotate(
                r["loader"] + (flagged if bad else ""),
                (r["distinct_chunks"], r["rate"]), fontsize=8, xytext=(4, 3),
                textcoords="offset points",
            )  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks([1, 2, 5, 10, 20, 50, 100])
        ax.set_xlabel(xlabel)
        ax.set_title(panel_title.format(key))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(ylabel)
    fig.suptitle(f"{n:,} {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=200_000, help="records")
    p.add_argument("--payload", type=int, default=1024, help="payload bytes (about)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="*", default=[0, 2])
    p.add_argument("--only", nargs="*", help=f"loaders: {' '.join(LOADERS)}")
    p.add_argument("--skip", nargs="*", default=[])
    p.add_argument("--quick", action="store_true", help="20,000 records, one round")
    p.add_argument(
        "--data",
        help="directory for the datasets, kept and reused by later runs with the same sizes "
        "(default: a temporary one, removed at the end)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per measurement")
    p.add_argument("--json", default="peers", help="results name (benchmarks/results/NAME.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--remote", action="store_true", help="run benchmarks/peers_remote.py")
    args, rest = p.parse_known_args(argv)

    if args.child:
        out = child(args.child, args.data, args.workers[0], args.n, args.payload)
        print(json.dumps(out), flush=True)
        return 0
    if args.remote:
        from benchmarks import peers_remote

        raw = sys.argv[1:] if argv is None else list(argv)
        return peers_remote.main([a for a in raw if a != "--remote"])
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.quick:
        args.n, args.rounds = min(args.n, 20_000), 1

    from benchmarks._common import describe_machine, print_table, write_json

    names = [k for k in LOADERS if (not args.only or k in args.only) and k not in args.skip]
    if BASELINE not in names:
        names.insert(0, BASELINE)
    print(f"machine: {describe_machine()}")
    print(
        f"{args.n:,} records of ~{args.payload} B, batch 256, workers {args.workers}, {args.rounds} rounds"
    )
    tmp = None
    data = args.data
    if data is None:
        tmp = data = tempfile.mkdtemp(prefix="tg-peers-")
    try:
        writes = write_all(data, names, args.n, args.payload, reuse=args.data is not None)
        runs = []
        for rnd in range(args.rounds):
            # rotate the order each round so no loader always runs first or last
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for w in args.workers:
                for name in order:
                    r = run_child(name, data, w, args.n, args.payload, args.timeout)
                    r["round"] = rnd
                    runs.append(r)
                    msg = (
                        f"{r['rate']:>9,.0f}/s  first {r['first_batch_s'] or 0:.2f}s  "
                        f"rss {r['peak_rss_mib']:.0f} MiB  chunks {r['distinct_chunks']:.1f}  {r['check']}"
                        if "rate" in r
                        else r["error"]
                    )
                    print(f"  round {rnd} W={w} {name:<13} {msg}", flush=True)
        rows = summarize(runs, names, args.workers)
        print()
        print_table(writes, ["format", "write_s", "size_mib", "error"])
        print()
        print_table(
            rows,
            [
                "loader",
                "workers",
                "rate",
                "x_tg",
                "first_batch_s",
                "peak_rss_mib",
                "distinct_chunks",
                "lag1_corr",
                "check",
            ],
        )
        write_json(
            args.json,
            {
                "records": args.n,
                "payload_bytes": args.payload,
                "batch_size": 256,
                "chunk_ids": CHUNK,
                "rounds": args.rounds,
                "baseline": BASELINE,
                "writes": writes,
                "results": rows,
                "runs": runs,
            },
        )
        from benchmarks._common import RESULTS_DIR

        plot(rows, os.path.join(RESULTS_DIR, f"{args.json}.png"), args.n)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
