"""``torchgrain demo``: the main job end to end on built-in synthetic data.

Builds a synthetic image dataset once (64x64x3 uint8 images + labels, in a cache
directory), streams it with :class:`GlobalShuffleSampler` through a multi-process
DataLoader into a small CNN's training steps, and prints samples/s and the fraction of
step time spent waiting for data.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


def build_demo_dataset(directory: str, num_records: int, num_shards: int = 8) -> str:
    """Write the synthetic dataset to ``directory`` unless a matching one is there."""
    from torchgrain.formats.manifest import read_manifest
    from torchgrain.io.fs import get_filesystem
    from torchgrain.writers import write_array_record

    fs, root = get_filesystem(directory)
    existing = read_manifest(fs, root) if fs.isdir(root) else None
    if existing is not None and existing.num_records == num_records:
        return directory
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


@dataclass
class DemoResult:
    steps: int
    samples: int
    seconds: float
    wait_seconds: float
    first_loss: float
    last_loss: float

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def wait_fraction(self) -> float:
        return self.wait_seconds / self.seconds if self.seconds else 0.0


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
) -> DemoResult:
    """Build (once), stream and train; return throughput and data-wait figures.

    Example:
        >>> import tempfile
        >>> r = run_demo(tempfile.mkdtemp(), num_records=64, batch_size=16, num_workers=0,
        ...              epochs=1, log=lambda *a: None)
        >>> r.steps, r.samples
        (4, 64)
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

    steps = samples = 0
    losses: list[float] = []
    feed = tg.timed(loader)  # records how long each step waits for its batch
    start = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in feed:
            x = batch["image"].to(device, non_blocking=True).float().div_(255.0)
            y = batch["label"].to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            steps += 1
            samples += len(y)
            if max_steps is not None and steps >= max_steps:
                break
        if max_steps is not None and steps >= max_steps:
            break
        log(f"epoch {epoch}: {steps} steps, loss {np.mean(losses[-20:]):.3f}")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    report = tg.stats(feed)
    wait = report.consumer["wait_seconds"]
    result = DemoResult(
        steps, samples, seconds, wait, losses[0] if losses else 0.0, losses[-1] if losses else 0.0
    )
    log(
        f"throughput {result.samples_per_second:,.0f} samples/s over {steps} steps "
        f"({samples} samples, {seconds:.1f}s)"
    )
    log(
        f"data wait  {100 * result.wait_fraction:.1f}% of step time "
        f"({wait:.2f}s waiting for the next batch)"
    )
    log("pipeline   per-worker time (tg.stats):")
    for line in str(report).splitlines():
        log(f"  {line}")
    return result
