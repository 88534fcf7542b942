"""``torchgrain demo``: the main job end to end on built-in synthetic data.

Builds a synthetic image dataset once (64x64x3 uint8 images + labels, in a cache
directory), streams it with :class:`GlobalShuffleSampler` through a multi-process
DataLoader into a small CNN's training steps, and prints progress within each epoch,
then samples/s and the fraction of step time spent waiting for data per epoch, and
what made the first epoch slower than the later ones (worker start-up, the first
step's set-up, first reads of the shards, a busier CPU), measured part by part.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

NUM_CLASSES = 10
IMAGE_SHAPE = (64, 64, 3)


def synthetic_records(num_records: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Deterministic image-like records: a class-coloured square on smooth noise.

    Example:
        >>> r = next(synthetic_records(1))
        >>> r["image"].shape, r["image"].dtype, r["label"]
        ((64, 64, 3), dtype('uint8'), 0)
    """
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0 : IMAGE_SHAPE[0], 0 : IMAGE_SHAPE[1]]
    for i in range(num_records):
        label = i % NUM_CLASSES
        base = (np.sin(xx / (4 + label)) + np.cos(yy / (5 + label))) * 40 + 100
        img = np.repeat(base[..., None], 3, axis=2) + rng.integers(0, 16, IMAGE_SHAPE)
        y0, x0 = rng.integers(0, 40, size=2)
        img[y0 : y0 + 24, x0 : x0 + 24, label % 3] = 40 + 20 * label
        yield {"image": img.clip(0, 255).astype(np.uint8), "label": label, "id": f"img-{i:07d}"}


#: The file the demo writes beside its dataset: it replaces no dataset without it.
_MARKER = ".torchgrain-demo"


def build_demo_dataset(directory: str, num_records: int, num_shards: int = 8) -> str:
    """Write the synthetic dataset to ``directory`` unless a matching one is there.

    It writes only into a missing or empty directory, or over a dataset of its own
    (marked by a ``.torchgrain-demo`` file); a directory holding anything else is a
    FileExistsError naming it, never replaced.

    Example:
        >>> import tempfile, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = build_demo_dataset(d, 4, num_shards=1)
        >>> _ = build_demo_dataset(d, 6, num_shards=1)  # its own: rebuilt
        >>> len(tg.ArrayRecordSource(d))
        6
        >>> _ = tg.write_array_record([{"text": "mine"}], os.path.join(d, "mine"))
        >>> build_demo_dataset(os.path.join(d, "mine"), 4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileExistsError: '.../mine' holds files the demo did not write: ...
    """
    from torchgrain.formats.manifest import read_manifest
    from torchgrain.io.fs import get_filesystem
    from torchgrain.writers import write_array_record

    fs, root = get_filesystem(directory)
    existing = read_manifest(fs, root) if fs.isdir(root) else None
    if existing is not None and existing.num_records == num_records:
        return directory
    marker = os.path.join(root, _MARKER)
    if os.path.isdir(root) and os.listdir(root) and not os.path.exists(marker):
        raise FileExistsError(
            f"{directory!r} holds files the demo did not write: it writes only into an "
            "empty directory or over its own dataset; pass another --data-dir"
        )
    os.makedirs(root, exist_ok=True)
    # O_NONBLOCK: a FIFO in the marker's place is an error (ENXIO), not waited on.
    os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o666))
    write_array_record(
        _Sized(synthetic_records(num_records), num_records),
        directory,
        num_shards=num_shards,
        overwrite=True,
    )
    return directory


class _Sized:
    """An iterator with a known length (so the writer keeps the input order)."""

    def __init__(self, it: Iterator[Any], n: int) -> None:
        self._it, self._n = it, n

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Any]:
        return self._it


def to_tensors(rec: dict[str, Any]) -> dict[str, Any]:
    """uint8 HWC image -> uint8 CHW tensor; label -> int64."""
    return {
        "image": torch.from_numpy(rec["image"]).permute(2, 0, 1),
        "label": torch.tensor(rec["label"], dtype=torch.int64),
    }


def random_flip(rec: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """A cheap reproducible augmentation: horizontal flip with p=0.5."""
    if rng.random() < 0.5:
        rec = dict(rec, image=np.ascontiguousarray(rec["image"][:, ::-1]))
    return rec


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(4),
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 16, NUM_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _Rate:
    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0  # type: ignore[attr-defined]


@dataclass
class EpochResult(_Rate):
    """What one epoch of the demo measured.

    Example:
        >>> e = EpochResult(0, steps=2, samples=128, seconds=0.5, wait_seconds=0.1,
        ...                 step_seconds=[0.25, 0.125], first_batch_seconds=0.08)
        >>> e.samples_per_second, e.median_step_seconds
        (256.0, 0.1875)
    """

    epoch: int
    steps: int
    samples: int
    seconds: float  #: wall time of the epoch, its first batch included
    wait_seconds: float  #: waiting for batches (the first included)
    step_seconds: list[float]  #: compute time of each training step
    first_batch_seconds: float  #: the wait for the epoch's first batch

    @property
    def median_step_seconds(self) -> float:
        return float(np.median(self.step_seconds)) if self.step_seconds else 0.0


@dataclass
class DemoResult(_Rate):
    steps: int
    samples: int
    seconds: float
    wait_seconds: float
    first_loss: float
    last_loss: float
    epochs: list[EpochResult] = field(default_factory=list)

    @property
    def wait_fraction(self) -> float:
        return self.wait_seconds / self.seconds if self.seconds else 0.0


def explain_first_epoch(epochs: list[EpochResult], num_workers: int) -> str:
    """Why the first epoch took longer than the later ones' pace, part by part.

    The later epochs give the pace (seconds per step, computing and waiting); what the
    first spent beyond it is split into: starting the workers (until the first batch),
    the first step (setting up the model's kernels and memory), more waiting for data
    (first reads of the shards: disk and page cache, per-worker readers) and slower
    steps (the CPU was shared with more work).

    Example:
        >>> e = lambda i, s, w, f, steps: EpochResult(i, 10, 640, s, w, steps, f)
        >>> first = e(0, 2.94, 1.0, 0.8, [0.5] + [0.16] * 9)  # 1.0s waiting, 1.94s stepping
        >>> print(explain_first_epoch([first, e(1, 1.1, 0.1, 0.01, [0.1] * 10)], 2))
        epoch 0 took 1.8s more than the pace of the later epochs: 0.8s starting 2 workers until the first batch, 0.4s the first step (setting up the model's kernels and memory), 0.1s more waiting for data (first reads of the shards: disk, page cache, per-worker readers), 0.5s in the steps themselves (a busier CPU)
    """
    later = [e for e in epochs[1:] if e.steps]
    if not later or not epochs[0].steps:
        return ""
    first = epochs[0]
    per_step = sum(e.seconds for e in later) / sum(e.steps for e in later)
    wait_per_step = sum(e.wait_seconds for e in later) / sum(e.steps for e in later)
    # The mean step, as in per_step: a median would leave the later epochs' slow steps
    # out of their pace, and the parts would add up to more than the whole.
    step = sum(sum(e.step_seconds) for e in later) / sum(len(e.step_seconds) for e in later)
    extra = first.seconds - first.steps * per_step
    if extra <= 0.1 * first.seconds:
        return (
            f"epoch 0 ran at the pace of the later epochs ({first.seconds:.1f}s against "
            f"{first.steps * per_step:.1f}s for as many steps)"
        )
    later_first = float(np.mean([e.first_batch_seconds for e in later]))
    startup = max(first.first_batch_seconds - later_first, 0.0)
    first_step = max(first.step_seconds[0] - step, 0.0) if first.step_seconds else 0.0
    waiting = first.wait_seconds - first.first_batch_seconds
    more_wait = waiting - (first.steps - 1) * wait_per_step
    stepping = sum(first.step_seconds[1:]) - (first.steps - 1) * step
    who = f"{num_workers} workers" if num_workers else "the dataset's readers"
    parts = [
        (startup, f"starting {who} until the first batch"),
        (first_step, "the first step (setting up the model's kernels and memory)"),
        (
            more_wait,
            "more waiting for data (first reads of the shards: disk, page cache, "
            "per-worker readers)",
        ),
        (stepping, "in the steps themselves (a busier CPU)"),
    ]
    said = [f"{x:.1f}s {what}" for x, what in parts if x >= max(0.05, 0.05 * extra)]
    return f"epoch 0 took {extra:.1f}s more than the pace of the later epochs: " + ", ".join(
        said or ["spread over its steps"]
    )


class _Progress:
    """Progress within an epoch: rewritten in place on a terminal, a line every few
    seconds otherwise (a log file or a pipe)."""

    def __init__(self, log: Any, epoch: int, total: int, every: float | None) -> None:
        self.tty = log is print and sys.stdout.isatty()
        self.every = every if every is not None else (0.5 if self.tty else 5.0)
        self.log, self.epoch, self.total = log, epoch, total
        self.start = self.last = time.perf_counter()
        self.shown = False

    def update(self, steps: int, samples: int, wait: float) -> None:
        now = time.perf_counter()
        if now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.start
        line = (
            f"  epoch {self.epoch}  step {steps}/{self.total}  {steps / elapsed:.1f} steps/s  "
            f"{samples / elapsed:,.0f} samples/s  data wait {100 * wait / elapsed:.0f}%"
        )
        if self.tty:
            print("\r" + line + "\x1b[K", end="", flush=True)
            self.shown = True
        else:
            self.log(line)

    def close(self) -> None:
        if self.shown:
            print("\r\x1b[K", end="", flush=True)


def run_demo(
    data_dir: str | None = None,
    *,
    num_records: int = 10_000,
    batch_size: int = 64,
    num_workers: int = 2,
    epochs: int = 2,
    max_steps: int | None = None,
    seed: int = 0,
    device: str | None = None,
    log: Any = print,
    progress_every: float | None = None,
) -> DemoResult:
    """Build (once), stream and train; return throughput and data-wait figures.

    Prints progress during each epoch (steps/s, samples/s, data wait; every
    ``progress_every`` seconds, by default 0.5 on a terminal and 5 otherwise), a line
    per epoch, and what made the first epoch slower than the later ones.

    Example:
        >>> import tempfile
        >>> r = run_demo(tempfile.mkdtemp(), num_records=64, batch_size=16, num_workers=0,
        ...              epochs=1, log=lambda *a: None)
        >>> r.steps, r.samples, [e.steps for e in r.epochs]
        (4, 64, [4])
    """
    import torchgrain as tg
    from torchgrain.io.fs import default_cache_dir

    data_dir = data_dir or os.path.join(default_cache_dir(), f"demo-{num_records}")
    t0 = time.perf_counter()
    build_demo_dataset(data_dir, num_records)
    log(
        f"dataset   {data_dir}  ({num_records} records, built/checked in "
        f"{time.perf_counter() - t0:.1f}s)"
    )

    src = tg.ArrayRecordSource(data_dir)
    log(f"source    {src.num_shards} shards, keys {src.keys}, schema {src.schema}")
    ds = tg.Dataset(src).random_map(random_flip, seed=seed).map(to_tensors)
    sampler = tg.GlobalShuffleSampler(ds, seed=seed)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        prefetch_factor=4 if num_workers else None,
        persistent_workers=num_workers > 0,
        pin_memory=device.startswith("cuda"),
        drop_last=True,
    )
    torch.manual_seed(seed)
    model = SmallCNN().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    log(
        f"training  SmallCNN on {device}: batch {batch_size}, {num_workers} workers, "
        f"{epochs} epoch(s), {len(loader)} steps/epoch"
    )

    steps = 0
    losses: list[float] = []
    results: list[EpochResult] = []
    feed = tg.timed(loader)  # records how long each step waits for its batch (tg.stats)
    start = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        progress = _Progress(log, epoch, len(loader), progress_every)
        ep = EpochResult(epoch, 0, 0, 0.0, 0.0, [], 0.0)
        t_epoch = time.perf_counter()
        it = iter(feed)
        while max_steps is None or steps < max_steps:
            t_wait = time.perf_counter()
            batch = next(it, None)
            t_step = time.perf_counter()
            if batch is None:
                break
            ep.wait_seconds += t_step - t_wait
            if not ep.steps:
                ep.first_batch_seconds = t_step - t_wait
            x = batch["image"].to(device, non_blocking=True).float().div_(255.0)
            y = batch["label"].to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())  # waits for the device: the step's whole time
            ep.step_seconds.append(time.perf_counter() - t_step)
            ep.steps += 1
            ep.samples += len(y)
            steps += 1
            progress.update(ep.steps, ep.samples, ep.wait_seconds)
        del it  # a loop stopped early by max_steps lets go of its batches
        progress.close()
        ep.seconds = time.perf_counter() - t_epoch
        results.append(ep)
        log(
            f"epoch {epoch}: {ep.steps} steps in {ep.seconds:.1f}s, "
            f"{ep.samples_per_second:,.0f} samples/s, data wait "
            f"{100 * ep.wait_seconds / max(ep.seconds, 1e-9):.1f}% "
            f"(first batch after {ep.first_batch_seconds:.2f}s), step "
            f"{1000 * ep.median_step_seconds:.0f} ms (median), loss "
            f"{np.mean(losses[-20:]) if losses else float('nan'):.3f}"
        )
        if max_steps is not None and steps >= max_steps:
            break
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    report = tg.stats(feed)
    wait, samples = sum(e.wait_seconds for e in results), sum(e.samples for e in results)
    first, last = (losses[0], losses[-1]) if losses else (0.0, 0.0)
    result = DemoResult(steps, samples, seconds, wait, first, last, results)
    if why := explain_first_epoch(results, num_workers):
        log(why)
    later = sum(e.seconds for e in results[1:])
    rate = sum(e.samples for e in results[1:]) / later if later > 0 else 0.0
    steady = f"; {rate:,.0f} samples/s after the first epoch" if later > 0 else ""
    log(
        f"throughput {result.samples_per_second:,.0f} samples/s over {steps} steps "
        f"({samples} samples, {seconds:.1f}s){steady}"
    )
    log(
        f"data wait  {100 * result.wait_fraction:.1f}% of step time "
        f"({wait:.2f}s waiting for the next batch)"
    )
    log("pipeline   per-worker time (tg.stats):")
    for line in str(report).splitlines():
        log(f"  {line}")
    return result
