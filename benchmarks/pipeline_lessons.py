"""The tf.data performance guide's lessons, rerun with torchgrain and the torch DataLoader.

The guide measures its input-pipeline techniques on an artificial dataset whose costs are
sleeps, so the numbers depend on scheduling, not on the machine's speed:

* opening a shard (a file) takes 30 ms, reading each record 15 ms;
* a training step takes 10 ms, an expensive map function 30 ms;
* each shard holds 3 records; every pass over the data opens its shards again (the guide's
  generator is re-run each epoch); 2 epochs (5 for the cache lesson).

Here the dataset is a torchgrain :class:`~torchgrain.Dataset` over a source whose
``__getitem__`` sleeps the same way, fed through a stock ``DataLoader`` into a loop that
sleeps 10 ms per record. Every lesson of the guide is one configuration, all in one run:

==================  =================================================================
naive               ``num_workers=0``: open, read, step strictly one after another
prefetch (thread)   the same loader behind a background thread (``CudaPrefetcher``
                    with ``device="cpu"``), the closest match to ``Dataset.prefetch``
prefetch (worker)   one DataLoader worker process (``prefetch_factor=2``)
interleave, seq.    2 shards read alternately in the main process
interleave, par.    the same order, 2 workers: each reads its own shard concurrently
map, sequential     ``Dataset.map(fn)`` with ``num_workers=0``
map, parallel       ``Dataset.map(fn)`` with 3 workers (one per record in flight)
cache (5 epochs)    the mapped records kept in a per-process cache after epoch 1
cache + workers     the same with 3 persistent workers, each caching what it mapped
==================  =================================================================

For each, the script also computes the **ideal**: the finishing time of the same
schedule (same worker assignment, same prefetch depth, same per-worker shard opens) if
moving records between processes and waking threads cost nothing, from the simulated
costs alone. The ratio measured/ideal is the overhead torchgrain and the DataLoader add.
It prints the guide's tf.data time next to ours, and the guide's own ideal, so both
libraries are held to the same bound.

Worker start-up (forking, ~10-50 ms each here) is not part of the guide's pipelines
(tf.data runs in threads); the worker configurations use ``persistent_workers=True`` and
a warm-up pass that starts the workers and fetches one free record in each before the
clock starts, as a training job amortises start-up over its whole run.

The cache lessons use a small cache written in this script (``CachedMap`` below: mapped
records kept per process, bounded by a record budget), the equivalent of tf.data's
``.map(f).cache()``; torchgrain's own caches sit below the map (row groups, shards).

Vectorised map: 10,000 scalar records, batches of 256, 2 epochs, ``x + 1`` applied per
record (``Dataset.map``), once per batch on the list of records (``Dataset.map_batch``,
then the default collate), and once on the collated batch tensor (a ``collate_fn``: the
guide's ``.batch().map()`` order). There is no simulated cost there, hence no ideal: the
lesson is the ratio to the per-record map.

Run:   python benchmarks/pipeline_lessons.py              (~15 s)
       python benchmarks/pipeline_lessons.py --repeats 5 --no-plot
Writes benchmarks/results/pipeline_lessons.json and pipeline_lessons.png (timelines).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchgrain as tg
from benchmarks._common import RESULTS_DIR, describe_machine, print_table, write_json

OPEN_S = 0.030
READ_S = 0.015
STEP_S = 0.010
MAP_S = 0.030
RECORDS_PER_SHARD = 3

# The guide's measured times (tf.data, its machine) and the bound its own schedule allows.
GUIDE = {
    "naive": (0.235, 2 * (OPEN_S + 3 * (READ_S + STEP_S))),
    "prefetch (thread)": (0.190, 2 * (OPEN_S + 3 * READ_S + STEP_S)),
    "prefetch (worker)": (0.190, 2 * (OPEN_S + 3 * READ_S + STEP_S)),
    "map, sequential": (0.418, 2 * (OPEN_S + 3 * (READ_S + MAP_S + STEP_S))),
    # reads stay sequential in the guide; maps overlap: last map ends at 30+45+30 ms
    "map, parallel": (0.252, 2 * (OPEN_S + 3 * READ_S + MAP_S + STEP_S)),
    "cache (5 epochs)": (0.364, OPEN_S + 3 * (READ_S + MAP_S + STEP_S) + 4 * 3 * STEP_S),
}
GUIDE_VECTOR = {"scalar": 0.880, "vectorised": 0.027}
INTERLEAVE_NOTE = (
    "the guide's interleave lesson passes the elements of range(2) to ArtificialDataset as "
    "its record count, so its two datasets hold 0 and 1 records (2 opens, 1 record per "
    "epoch); its times (0.196 s sequential) measure a different workload and are not shown"
)

KINDS = ("open", "read", "map", "cached", "step")
_KIND = {k: i for i, k in enumerate(KINDS)}


# --------------------------------------------------------------------------- event log
class EventLog:
    """Start/end times of every simulated operation, from every process, in shared memory.

    Forked DataLoader workers inherit the arrays; ``time.perf_counter`` is the system-wide
    monotonic clock on Linux, so times from different processes line up.
    """

    FIELDS = 5  # lane, kind, start, end, record index

    def __init__(self, capacity: int = 20_000) -> None:
        self.capacity = capacity
        self._data = multiprocessing.RawArray("d", capacity * self.FIELDS)
        self._count = multiprocessing.RawValue("q", 0)
        self._lock = multiprocessing.Lock()

    def clear(self) -> None:
        with self._lock:
            self._count.value = 0

    def add(self, kind: str, start: float, end: float, index: int = -1) -> None:
        with self._lock:
            n = self._count.value
            if n >= self.capacity:
                return
            self._count.value = n + 1
        row = np.frombuffer(self._data, dtype=np.float64)[n * self.FIELDS : (n + 1) * self.FIELDS]
        row[:] = (_lane(), _KIND[kind], start, end, index)

    def events(self) -> np.ndarray:
        with self._lock:
            n = self._count.value
        return np.frombuffer(self._data, dtype=np.float64)[: n * self.FIELDS].reshape(
            n, self.FIELDS
        )


def _lane() -> int:
    """0: training loop, 1: a background thread of the main process, 2+k: worker k."""
    info = torch.utils.data.get_worker_info()
    if info is not None:
        return 2 + info.id
    return 0 if threading.current_thread() is threading.main_thread() else 1


def lane_name(lane: int) -> str:
    return {0: "train loop", 1: "prefetch thread"}.get(lane, f"worker {lane - 2}")


class Sim:
    """Shared switches: the current epoch (shards are reopened each epoch, as in the
    guide) and a warm-up flag under which every operation is free and unrecorded."""

    def __init__(self) -> None:
        self.log = EventLog()
        self._epoch = multiprocessing.RawValue("q", 0)
        self._warm = multiprocessing.RawValue("b", 0)

    @property
    def epoch(self) -> int:
        return int(self._epoch.value)

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch.value = value

    @property
    def warming(self) -> bool:
        return bool(self._warm.value)

    @warming.setter
    def warming(self, value: bool) -> None:
        self._warm.value = int(value)

    def sleep(self, kind: str, seconds: float, index: int = -1) -> None:
        if self.warming:
            return
        t0 = time.perf_counter()
        time.sleep(seconds)
        self.log.add(kind, t0, time.perf_counter(), index)


class SleepShards:
    """A source of ``num_shards * 3`` records; opening a shard and reading a record sleep.

    Each process opens a shard the first time it reads from it in an epoch (the guide's
    generator is re-run every epoch, so its file is opened again).
    """

    def __init__(self, sim: Sim, num_shards: int = 1) -> None:
        self.sim = sim
        self.num_shards = num_shards
        self._opened: dict[int, int] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.num_shards * RECORDS_PER_SHARD

    def __getitem__(self, index: int) -> dict[str, Any]:
        if os.getpid() != self._pid:  # a worker starts with no file open
            self._opened, self._pid = {}, os.getpid()
        shard = index // RECORDS_PER_SHARD
        if self._opened.get(shard) != self.sim.epoch and not self.sim.warming:
            self.sim.sleep("open", OPEN_S, index)
            self._opened[shard] = self.sim.epoch
        self.sim.sleep("read", READ_S, index)
        return {"index": index}


class SlowMap:
    """The guide's expensive preprocessing: 30 ms per record."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim

    def __call__(self, rec: dict[str, Any]) -> dict[str, Any]:
        self.sim.sleep("map", MAP_S, rec["index"])
        return rec


class CachedMap:
    """``source`` with ``fn`` applied, results kept per process (the guide's ``.map(f).cache()``).

    The cache is bounded (``max_records``, least recently used evicted first) and lives in
    each process: a DataLoader worker keeps what it mapped, which with persistent workers
    and an unshuffled order is the same records every epoch.
    """

    def __init__(self, source: Any, fn: Callable[[Any], Any], sim: Sim, max_records: int) -> None:
        self.source, self.fn, self.sim, self.max_records = source, fn, sim, max_records
        self._cache: OrderedDict[int, Any] = OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        if os.getpid() != self._pid:
            self._cache, self._pid = OrderedDict(), os.getpid()
        hit = self._cache.get(index)
        if hit is not None:
            self._cache.move_to_end(index)
            if not self.sim.warming:
                t = time.perf_counter()
                self.sim.log.add("cached", t, t, index)
            return hit
        rec = self.fn(self.source[index])
        if not self.sim.warming:
            self._cache[index] = rec
            while len(self._cache) > self.max_records:
                self._cache.popitem(last=False)
        return rec


class Order(torch.utils.data.Sampler[int]):
    """A fixed, replaceable index order (replaced by the warm-up's order, then restored)."""

    def __init__(self, indices: Sequence[int]) -> None:
        self.indices = list(indices)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def interleaved(num_shards: int) -> list[int]:
    """Alternate records of the shards: 0, 3, 1, 4, 2, 5 for two shards of 3."""
    return [s * RECORDS_PER_SHARD + r for r in range(RECORDS_PER_SHARD) for s in range(num_shards)]


# ------------------------------------------------------------------------ the lessons
@dataclass
class Lesson:
    name: str
    what: str
    num_shards: int = 1
    order: str = "sequential"  # or "interleaved"
    map: bool = False
    cache: bool = False
    workers: int = 0
    prefetch_factor: int = 2
    thread_prefetch: int = 0  # depth of a CudaPrefetcher(device="cpu") around the loader
    epochs: int = 2
    runs: list[float] = field(default_factory=list)

    def indices(self) -> list[int]:
        n = self.num_shards * RECORDS_PER_SHARD
        return interleaved(self.num_shards) if self.order == "interleaved" else list(range(n))


LESSONS = [
    Lesson("naive", "num_workers=0: open, read, step one after another"),
    Lesson("prefetch (thread)", "CudaPrefetcher(loader, device='cpu', depth=2)", thread_prefetch=2),
    Lesson("prefetch (worker)", "1 persistent worker, prefetch_factor=2", workers=1),
    Lesson("interleave, seq.", "2 shards alternately, num_workers=0", 2, "interleaved"),
    Lesson("interleave, par.", "2 shards alternately, 2 workers", 2, "interleaved", workers=2),
    Lesson("map, sequential", "Dataset.map(30 ms), num_workers=0", map=True),
    Lesson("map, parallel", "Dataset.map(30 ms), 3 workers", map=True, workers=3),
    Lesson(
        "cache (5 epochs)",
        "map then per-process cache, num_workers=0",
        map=True,
        cache=True,
        epochs=5,
    ),
    Lesson(
        "cache + workers",
        "map then per-worker cache, 3 workers, 5 epochs",
        map=True,
        cache=True,
        epochs=5,
        workers=3,
    ),
]


def build(lesson: Lesson, sim: Sim) -> tuple[Any, Order, tg.Dataset]:
    source: Any = SleepShards(sim, lesson.num_shards)
    if lesson.cache:
        source = CachedMap(source, SlowMap(sim), sim, max_records=1024)
        ds = tg.Dataset(source)
    else:
        ds = tg.Dataset(source)
        if lesson.map:
            ds = ds.map(SlowMap(sim))
    order = Order(lesson.indices())
    kwargs: dict[str, Any] = {"batch_size": None, "sampler": order}
    if lesson.workers:
        kwargs.update(
            num_workers=lesson.workers,
            prefetch_factor=lesson.prefetch_factor,
            persistent_workers=True,
        )
    loader = torch.utils.data.DataLoader(ds, **kwargs)
    return loader, order, ds


def warm_up(loader: Any, order: Order, sim: Sim, workers: int) -> None:
    """Start the workers and pass one free record through each (nothing is recorded)."""
    if not workers:
        return
    saved = order.indices
    order.indices = [0] * workers
    sim.warming = True
    for _ in loader:
        pass
    sim.warming = False
    order.indices = saved


def run_lesson(lesson: Lesson, sim: Sim) -> tuple[float, np.ndarray, float]:
    loader, order, _ = build(lesson, sim)
    warm_up(loader, order, sim, lesson.workers)
    sim.log.clear()
    sim.epoch = 0
    start = time.perf_counter()
    for epoch in range(lesson.epochs):
        sim.epoch = epoch
        batches = (
            tg.CudaPrefetcher(loader, device="cpu", depth=lesson.thread_prefetch)
            if lesson.thread_prefetch
            else loader
        )
        for _ in batches:
            sim.sleep("step", STEP_S)
    elapsed = time.perf_counter() - start
    events = sim.log.events().copy()
    del loader  # persistent workers exit
    return elapsed, events, start


# ---------------------------------------------------------------- the ideal schedule
def ideal_seconds(lesson: Lesson, costs: dict[str, float] | None = None) -> float:
    """Finishing time of ``lesson``'s schedule if handing records over cost nothing.

    Models the DataLoader's dispatch: at the start of each epoch, ``workers *
    prefetch_factor`` indices go out round-robin; each consumed record releases the next
    index to the next worker; a worker processes its indices in order; the loop consumes
    records in order, one 10 ms step each. ``num_workers=0`` is strictly sequential; the
    background-thread prefetcher is one producer with a buffer of its depth.

    ``costs`` replaces the nominal durations (keys ``open``, ``read``, ``map``,
    ``step``), e.g. with the durations the sleeps really took on this machine.
    """
    c_open, c_read, c_map, c_step = (
        (costs or {}).get(k, v)
        for k, v in (("open", OPEN_S), ("read", READ_S), ("map", MAP_S), ("step", STEP_S))
    )
    indices = lesson.indices()
    n = len(indices)
    workers = lesson.workers or (1 if lesson.thread_prefetch else 0)
    depth = lesson.prefetch_factor if lesson.workers else lesson.thread_prefetch
    lanes = max(workers, 1)
    opened: list[dict[int, int]] = [{} for _ in range(lanes)]
    cached: list[set[int]] = [set() for _ in range(lanes)]

    def cost(lane: int, index: int, epoch: int) -> float:
        if lesson.cache and index in cached[lane]:
            return 0.0
        c = 0.0
        shard = index // RECORDS_PER_SHARD
        if opened[lane].get(shard) != epoch:
            opened[lane][shard] = epoch
            c += c_open
        c += c_read + (c_map if lesson.map else 0.0)
        if lesson.cache:
            cached[lane].add(index)
        return c

    t = 0.0
    for epoch in range(lesson.epochs):
        if workers == 0:
            for index in indices:
                t += cost(0, index, epoch) + c_step
            continue
        inflight = workers * depth
        free = [t] * workers
        ready = [0.0] * n
        dispatched = [t if k < inflight else None for k in range(n)]
        consumer = t
        for k in range(n):
            # produce every dispatched record up to k (in dispatch order)
            w = k % workers
            start = max(dispatched[k], free[w])  # type: ignore[type-var]
            free[w] = ready[k] = start + cost(w, indices[k], epoch)
            got = max(ready[k], consumer)
            consumer = got + c_step
            if k + inflight < n:
                dispatched[k + inflight] = got
        t = consumer
    return t


# ------------------------------------------------------------------ vectorised map
class ArraySource:
    """10,000 scalar records with a batched read (one numpy ``take`` per batch)."""

    def __init__(self, n: int) -> None:
        self.data = np.arange(n, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> np.int64:
        return self.data[index]

    def __getitems__(self, indices: Sequence[int]) -> np.ndarray:
        return self.data[np.asarray(indices)]


def increment(x: Any) -> Any:
    return x + 1


def increment_batch(records: list[Any]) -> list[Any]:
    """``increment`` on the whole batch at once (one numpy add), one output per record."""
    return list(np.asarray(records) + 1)


def _collate_increment(batch: Any) -> torch.Tensor:
    return increment(torch.from_numpy(np.asarray(batch)))


VECTOR_MODES = ("scalar", "map_batch", "collate")


def vectorised_runs(n: int, batch_size: int, epochs: int) -> dict[str, float]:
    """The same ``x + 1`` over ``n`` records in batches, three ways (seconds for each).

    * ``scalar``: ``Dataset.map(increment)``, once per record (then the default collate);
    * ``map_batch``: ``Dataset.map_batch``, once per batch (then the default collate);
    * ``collate``: batch first, then the function once on the batch tensor (a
      ``collate_fn``), the guide's ``.batch().map()`` order.
    """
    src = ArraySource(n)
    loaders = {
        "scalar": torch.utils.data.DataLoader(
            tg.Dataset(src).map(increment), batch_size=batch_size
        ),
        "map_batch": torch.utils.data.DataLoader(
            tg.Dataset(src).map_batch(increment_batch), batch_size=batch_size
        ),
        "collate": torch.utils.data.DataLoader(
            tg.Dataset(src), batch_size=batch_size, collate_fn=_collate_increment
        ),
    }
    out = {}
    for name, loader in loaders.items():
        check = None
        t0 = time.perf_counter()
        for _ in range(epochs):
            for batch in loader:
                check = batch
        out[name] = time.perf_counter() - t0
        assert int(torch.as_tensor(check)[-1]) == n, name  # the function was applied
    return out


# ------------------------------------------------------------------------ reporting
COLOURS = {
    "open": "#d62728",
    "read": "#1f77b4",
    "map": "#ff7f0e",
    "cached": "#9467bd",
    "step": "#2ca02c",
}


def plot_timelines(traces: dict[str, tuple[np.ndarray, float]], path: str | None = None) -> Any:
    """Draw each lesson's timeline (one row per process); save to ``path`` if given."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 1.0 + 1.05 * len(traces)))
    axes = np.atleast_1d(axes)
    xmax = max((ev[:, 3].max() - t0) * 1e3 for ev, t0 in traces.values() if len(ev))
    for ax, (name, (ev, t0)) in zip(axes, traces.items()):
        lanes = sorted({int(x) for x in ev[:, 0]}) if len(ev) else [0]
        for row, lane in enumerate(lanes):
            sel = ev[ev[:, 0] == lane]
            for kind in KINDS:
                k = sel[sel[:, 1] == _KIND[kind]]
                if len(k):
                    ax.broken_barh(
                        # instantaneous events (cache hits) drawn 0.4 ms wide
                        [((s - t0) * 1e3, max((e - s) * 1e3, 0.4)) for s, e in k[:, 2:4]],
                        (row - 0.4, 0.8),
                        facecolors=COLOURS[kind],
                        edgecolor="white" if kind != "cached" else COLOURS[kind],
                        linewidth=0.4,
                    )
        ax.set_yticks(range(len(lanes)), [lane_name(x) for x in lanes], fontsize=7)
        ax.set_xlim(0, xmax * 1.02)
        ax.set_title(name, fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1].set_xlabel("ms since the first epoch started")
    fig.legend(
        handles=[Patch(color=c, label=k) for k, c in COLOURS.items()],
        loc="upper right",
        ncol=5,
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}")
    return fig


def measure_lessons(
    names: Sequence[str] | None = None, repeats: int = 3
) -> tuple[list[dict[str, Any]], dict[str, tuple[np.ndarray, float]], dict[str, float]]:
    """Run the lessons (all, or those named) ``repeats`` times each, interleaved.

    Returns one row per lesson (median time, ideal, ratios, the guide's figures), the
    event timeline of each lesson's last run (events array, start time) and the median
    duration each kind of sleep really took.
    """
    sim = Sim()
    lessons = [x for x in LESSONS if not names or x.name in names]
    traces: dict[str, tuple[np.ndarray, float]] = {}
    for lesson in lessons:
        lesson.runs = []
    durations: dict[str, list[float]] = {k: [] for k in KINDS}
    # Interleave repeats across lessons so slow moments of a shared machine spread out.
    for _ in range(repeats):
        for lesson in lessons:
            elapsed, events, t0 = run_lesson(lesson, sim)
            lesson.runs.append(elapsed)
            traces[lesson.name] = (events, t0)
            for kind in KINDS:
                sel = events[events[:, 1] == _KIND[kind]]
                durations[kind].extend((sel[:, 3] - sel[:, 2]).tolist())
    # What the sleeps really took here: time.sleep overshoots by ~0.1-1 ms on a busy
    # machine, and the guide's timings carry the same slack.
    slept = {k: statistics.median(v) for k, v in durations.items() if v and k != "cached"}

    rows = []
    for lesson in lessons:
        ideal = ideal_seconds(lesson)
        ideal_here = ideal_seconds(lesson, slept)
        med = statistics.median(lesson.runs)
        guide, guide_ideal = GUIDE.get(lesson.name, (None, None))
        rows.append(
            {
                "lesson": lesson.name,
                "setup": lesson.what,
                "epochs": lesson.epochs,
                "torchgrain_s": round(med, 4),
                "ideal_s": round(ideal, 4),
                "ratio": round(med / ideal, 3),
                "ideal_slept_s": round(ideal_here, 4),
                "ratio_slept": round(med / ideal_here, 3),
                "runs_s": [round(r, 4) for r in lesson.runs],
                "tf_data_s": guide,
                "tf_ideal_s": round(guide_ideal, 4) if guide_ideal else None,
                "tf_ratio": round(guide / guide_ideal, 3) if guide else None,
            }
        )
    return rows, traces, slept


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="runs per lesson (median reported)")
    p.add_argument("--records", type=int, default=10_000, help="vectorised-map lesson")
    p.add_argument("--batch-size", type=int, default=256, help="vectorised-map lesson")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--only", nargs="*", help="names of the lessons to run")
    p.add_argument("--json-name", default="pipeline_lessons")
    args = p.parse_args(argv)

    print(f"machine: {describe_machine()}")
    print(
        f"costs: open {OPEN_S * 1e3:.0f} ms, read {READ_S * 1e3:.0f} ms/record, map "
        f"{MAP_S * 1e3:.0f} ms, step {STEP_S * 1e3:.0f} ms; {RECORDS_PER_SHARD} records/shard"
    )
    rows, traces, slept = measure_lessons(args.only, args.repeats)
    print()
    print_table(
        rows,
        [
            "lesson",
            "epochs",
            "torchgrain_s",
            "ideal_s",
            "ratio",
            "ratio_slept",
            "tf_data_s",
            "tf_ideal_s",
            "tf_ratio",
        ],
    )
    print(
        "ratio_slept: against the ideal recomputed with the median time each sleep really "
        "took here (" + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in slept.items()) + ")"
    )

    vec_runs = [vectorised_runs(args.records, args.batch_size, 2) for _ in range(args.repeats)]
    vec = {k: statistics.median(r[k] for r in vec_runs) for k in VECTOR_MODES}
    tf_of = {"scalar": "scalar", "map_batch": "vectorised", "collate": "vectorised"}
    vec_rows = [
        {
            "map": k,
            "torchgrain_s": round(vec[k], 4),
            "speedup": round(vec["scalar"] / vec[k], 1),
            "tf_data_s": GUIDE_VECTOR[tf_of[k]],
            "tf_speedup": round(GUIDE_VECTOR["scalar"] / GUIDE_VECTOR[tf_of[k]], 1),
        }
        for k in VECTOR_MODES
    ]
    print()
    print(f"vectorised map: {args.records:,} records, batch {args.batch_size}, 2 epochs")
    print_table(vec_rows, ["map", "torchgrain_s", "speedup", "tf_data_s", "tf_speedup"])
    speedup = vec["scalar"] / vec["map_batch"]
    print(f"note: {INTERLEAVE_NOTE}")
    worst = max(r["ratio"] for r in rows)
    print(f"\nworst ratio to ideal: {worst:.3f} (target <= 1.15)")

    payload = {
        "costs_s": {"open": OPEN_S, "read": READ_S, "map": MAP_S, "step": STEP_S},
        "slept_median_s": {k: round(v, 6) for k, v in slept.items()},
        "records_per_shard": RECORDS_PER_SHARD,
        "repeats": args.repeats,
        "warm_up": "persistent workers, started and warmed with one free record each "
        "before the clock starts",
        "lessons": rows,
        "interleave_note": INTERLEAVE_NOTE,
        "vectorised": {
            "records": args.records,
            "batch_size": args.batch_size,
            "epochs": 2,
            "rows": vec_rows,
            "runs": vec_runs,
            "speedup_map_batch": round(speedup, 2),
            "tf_data": GUIDE_VECTOR,
        },
        "worst_ratio": worst,
        "timelines": {
            name: [
                {
                    "lane": lane_name(int(e[0])),
                    "kind": KINDS[int(e[1])],
                    "start_ms": round((e[2] - t0) * 1e3, 3),
                    "end_ms": round((e[3] - t0) * 1e3, 3),
                    "index": int(e[4]),
                }
                for e in ev
            ]
            for name, (ev, t0) in traces.items()
        },
    }
    write_json(args.json_name, payload)
    if not args.no_plot:
        import matplotlib

        matplotlib.use("Agg")
        plot_timelines(traces, os.path.join(RESULTS_DIR, f"{args.json_name}.png"))
    return payload


if __name__ == "__main__":
    main()
