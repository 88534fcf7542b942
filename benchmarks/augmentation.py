"""One augmentation pipeline on one image, CPU: albumentations, kornia, torchvision, torchgrain.

Reproduces the shape of a published comparison (mean time of 1,000 runs of one
transform pipeline on one image, CPU: torchvision 30.5 ms, albumentations 2.55 ms,
kornia 79.2 ms) on this machine, in one run, and adds torchgrain's seeded adapter.

The pipeline, the same in every library: RandomResizedCrop to 224x224 (scale 0.08-1),
horizontal flip (p=0.5), ColorJitter (brightness 0.2, contrast 0.2), Normalize
(ImageNet mean/std) to float32. Each library gets the image in its own input format,
converted once before timing: HWC uint8 numpy (albumentations), CHW uint8 tensor
(torchvision v2), 1x3xHxW float32 tensor in [0, 1] (kornia, which needs floats).

Rows:
* albumentations: ``Compose(image=...)`` called directly. Before each call its random
  state is pointed at the generator torchgrain derives for the same record (built
  untimed; pointing costs ~2 us, timed), so both rows see identical crops: their ratio is torchgrain's overhead, not
  the luck of the crop sizes.
* torchgrain: the same pipeline through ``Dataset.random_map(tg.Albumentations(...))``,
  read as a DataLoader reads it (``__getitems__`` on a group of indices): per-record
  generator derivation, seeding, record dict handling, per-batch statistics.
* kornia: ``nn.Sequential`` of ``kornia.augmentation`` modules on CPU, one image per
  call (faster than ``AugmentationSequential`` here).
* torchvision: ``transforms.v2`` on a uint8 tensor, in its own virtualenv
  (``.venv-torchvision``, made by ``scripts/setup_torchvision.sh``: torchvision's compiled
  ops need the torch release they were built for, which is not the main environment's).
  Each round starts a fresh torchvision process there and a fresh albumentations process
  here (same script, image, pipeline parameters and seed, though the two libraries draw
  different crops from it, so each round averages ~100 images); the two time their
  groups in turn. The row's ratio is the median of the per-round ratios to those
  albumentations processes. Without the virtualenv (or if it fails) the row says why
  it is missing and the rest runs.

In one process, images are processed in groups of ``--group`` (16), the libraries taking
turns group by group, so noise on the machine hits all of them alike; times are per
image. The fixed cost per record is also measured on a no-op pipeline, where it is not
hidden.

Run: ``python benchmarks/augmentation.py [--runs 1000] [--group 16] [--size 512] [--threads 1]
[--rounds 12] [--torchvision-python .venv-torchvision/bin/python]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _augmentation_round import (
    albumentations_pipeline,
    one_image_runner,
    test_image,
    versions,
)
from _common import RESULTS_DIR, describe_machine, print_table, write_json

import torchgrain as tg
from torchgrain.transforms import _GeneratorRandom

PUBLISHED_MS = {"torchvision": 30.5, "albumentations": 2.55, "kornia": 79.2}
HERE = os.path.dirname(os.path.abspath(__file__))
ROUND_SCRIPT = os.path.join(HERE, "_augmentation_round.py")
TORCHVISION_PYTHON = os.environ.get(
    "TORCHGRAIN_TORCHVISION_PYTHON",
    os.path.join(os.path.dirname(HERE), ".venv-torchvision", "bin", "python"),
)


Runner = Callable[[range], object]  # runs the pipeline once per index in the range


def candidates(image: np.ndarray) -> tuple[dict[str, Runner], dict[str, str]]:
    """name -> runner, and name -> why a library was skipped."""
    runners: dict[str, Runner] = {}
    skipped: dict[str, str] = {}
    try:
        comp = albumentations_pipeline()
    except ImportError as e:
        sys.exit(f"albumentations is needed for this benchmark ({e})")
    runners["albumentations"] = _SameDraws(comp, image)

    # Through torchgrain: a map-style Dataset over copies of one record, read the way
    # the DataLoader reads it (one __getitems__ call per group), seed 0, epoch 0.
    ds = tg.Dataset(_Repeat({"image": image}, 1 << 20)).random_map(
        tg.Albumentations(albumentations_pipeline()), seed=0
    )
    runners["torchgrain"] = lambda indices: ds.__getitems__(indices)

    try:
        runners["kornia"] = _each(one_image_runner("kornia", image))
    except ImportError as e:
        skipped["kornia"] = f"not installed ({e})"
    return runners, skipped


def _each(run: Callable[[], object]) -> Runner:
    return lambda indices: [run() for _ in indices]


class _SameDraws:
    """Call an albumentations Compose directly, with the draws torchgrain makes.

    ``prepare`` (untimed) builds the generators torchgrain derives for the records;
    the timed call only points the pipeline at each (~2 us) and runs it.
    """

    def __init__(self, comp, image: np.ndarray) -> None:
        self.comp, self.image = comp, image
        self.py_random = _GeneratorRandom()
        self.gens: list[np.random.Generator] = []

    def prepare(self, indices: range) -> None:
        self.gens = [tg.record_rng(0, 0, i) for i in indices]

    def __call__(self, indices: range) -> list:
        comp, py_random, out = self.comp, self.py_random, []
        for gen in self.gens:
            py_random.gen = gen
            comp.set_random_state(gen, py_random)
            out.append(comp(image=self.image))
        return out  # a whole batch stays alive until collate, as in a DataLoader


class _Repeat:
    """n copies of one record, as a source (``__len__``/``__getitem__``)."""

    def __init__(self, record: dict, n: int) -> None:
        self.record, self.n = record, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return self.record


def interleaved_times(
    runners: dict[str, Runner], runs: int, group: int, warmup: int = 20
) -> dict[str, np.ndarray]:
    """Seconds per image for each group of ``group`` images, libraries taking turns.

    Every library processes images ``[k * group, (k + 1) * group)`` in turn k, so noise
    on the machine hits all of them alike and paired groups used the same draws.
    """
    for runner in runners.values():
        if hasattr(runner, "prepare"):
            runner.prepare(range(runs, runs + warmup))
        runner(range(runs, runs + warmup))
    n_groups = max(1, runs // group)
    times = {name: np.empty(n_groups) for name in runners}
    names = list(runners)
    clock = time.perf_counter
    with torch.inference_mode():
        for k in range(n_groups):
            indices = range(k * group, (k + 1) * group)
            for name in names[k % len(names) :] + names[: k % len(names)]:
                if hasattr(runners[name], "prepare"):
                    runners[name].prepare(indices)
                t0 = clock()
                runners[name](indices)
                times[name][k] = (clock() - t0) / group
    return times


def adapter_overhead_us(image: np.ndarray, runs: int) -> dict[str, float]:
    """Fixed cost per record of the torchgrain path, on a no-op pipeline."""
    import albumentations as A

    noop = A.Compose([A.NoOp()])
    ds = tg.Dataset(_Repeat({"image": image}, 1 << 20)).random_map(
        tg.Albumentations(A.Compose([A.NoOp()])), seed=0
    )
    aug = tg.Albumentations(A.Compose([A.NoOp()]))
    rec = {"image": image}
    rng = tg.record_rng(0, 0, 0)
    runners = {
        "direct": lambda idx: [noop(image=image) for _ in idx],
        "adapter": lambda idx: [aug(rec, rng) for _ in idx],
        "getitems": lambda idx: ds.__getitems__(idx),
        "getitem": lambda idx: [ds[i] for i in idx],
    }
    t = interleaved_times(runners, runs, group=32)
    med = {k: float(np.median(v)) * 1e6 for k, v in t.items()}
    return {
        "noop_direct_us": med["direct"],
        "adapter_overhead_us": med["adapter"] - med["direct"],
        "getitems_overhead_us": med["getitems"] - med["direct"],
        "getitem_overhead_us": med["getitem"] - med["direct"],
    }


class RoundFailed(RuntimeError):
    pass


class _Worker:
    """A fresh process of ``python`` timing ``library``, one group per request."""

    def __init__(self, python: str, library: str, args, seed: int, log_dir: str) -> None:
        self.python, self.library = python, library
        cmd = [python, ROUND_SCRIPT, f"--library={library}", f"--group={args.group}"]
        cmd += [f"--size={args.size}", f"--threads={args.threads}", f"--seed={seed}", "--serve"]
        env = dict(os.environ)
        if python != sys.executable:
            env.pop("PYTHONPATH", None)  # another environment: nothing of this one leaks in
        # Closed by close(); read back when the process dies.
        self.stderr = open(os.path.join(log_dir, f"{library}-{seed}.err"), "w+")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                text=True,
            )  # fmt: skip
        except OSError as e:
            self.stderr.close()
            raise RoundFailed(f"{python}: {type(e).__name__}: {e}") from e

    def hello(self) -> dict:
        return json.loads(self._reply())

    def timed_group(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._reply())

    def _reply(self) -> str:
        line = self.proc.stdout.readline()
        if line:
            return line
        rc = self.proc.wait()
        self.stderr.seek(0)
        last = (self.stderr.read().strip().splitlines() or ["no output"])[-1]
        raise RoundFailed(f"{self.python} exited {rc} in a {self.library} round: {last[:160]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def fresh_process_rounds(
    python: str, args, reference: str = "albumentations", library: str = "torchvision"
) -> dict:
    """``library`` under ``python`` beside ``reference`` under this interpreter.

    Each round starts a fresh process of each (same seed, image and parameters), warms
    both up, then has them time their groups of ``args.group`` images in turn, which one
    goes first alternating group by group, so load on the machine falls on both alike.
    The ratio of a round is its mean time per image over the reference's; the result's
    ``median_ratio`` is the median of the rounds'.
    """
    groups = math.ceil(args.runs / (args.rounds * args.group))
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tg-augment-") as log_dir:
        for r in range(args.rounds):
            workers: list[_Worker] = []
            try:
                workers.append(_Worker(sys.executable, reference, args, r, log_dir))
                workers.append(_Worker(python, library, args, r, log_dir))
                hello = [w.hello() for w in workers]
                times: dict[str, list[float]] = {reference: [], library: []}
                for k in range(groups):
                    for w in workers if (r + k) % 2 == 0 else workers[::-1]:
                        times[w.library].append(w.timed_group())
            finally:
                for w in workers:
                    w.close()
            rounds.append(times)
            versions = hello[1]["versions"]
    ref_means = np.array([np.mean(t[reference]) for t in rounds])
    lib_means = np.array([np.mean(t[library]) for t in rounds])
    return {
        "python": python,
        "rounds": args.rounds,
        "images_per_round": groups * args.group,
        "per_round_ratio": (lib_means / ref_means).tolist(),
        "median_ratio": float(np.median(lib_means / ref_means)),
        reference: np.concatenate([t[reference] for t in rounds]),
        library: np.concatenate([t[library] for t in rounds]),
        "versions": versions,
        "round_times": rounds,
    }


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["library"] for r in rows]
    measured = [r["mean_ms"] for r in rows]
    published = [r["published_ms"] or 0.0 for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.bar(x - 0.2, measured, 0.4, label="this run")
    ax.bar(x + 0.2, published, 0.4, label="published", color="#bbbbbb")
    for xi, m in zip(x, measured):
        ax.text(xi - 0.2, m, f"{m:.2f}", ha="center", va="bottom", fontsize=8)
    for xi, p in zip(x, published):
        if p:
            ax.text(xi + 0.2, p, f"{p:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_yscale("log")
    ax.set_ylabel("mean ms per image (log)")
    ax.set_title("RandomResizedCrop+Flip+ColorJitter+Normalize, one image, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1000, help="timed runs per library")
    ap.add_argument("--size", type=int, default=512, help="input image side in pixels")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch and OpenCV threads (DataLoader workers use 1)"
    )
    ap.add_argument(
        "--group", type=int, default=16, help="images per timed call (a DataLoader batch)"
    )
    ap.add_argument(
        "--rounds", type=int, default=12, help="fresh-process rounds for the torchvision row"
    )
    ap.add_argument(
        "--torchvision-python",
        default=TORCHVISION_PYTHON,
        help="interpreter of an environment with torchvision (default: .venv-torchvision, "
        "or $TORCHGRAIN_TORCHVISION_PYTHON)",
    )
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()

    import cv2

    torch.set_num_threads(args.threads)
    cv2.setNumThreads(args.threads)
    image = test_image(args.size)
    print(f"machine: {describe_machine()}")
    print(
        f"image {image.shape}, {args.runs} runs each in groups of {args.group}, "
        f"{args.threads} thread(s)"
    )

    runners, skipped = candidates(image)
    times = interleaved_times(runners, args.runs, args.group)
    ref = float(np.mean(times["albumentations"]))
    fresh = None
    if not os.path.exists(args.torchvision_python):
        skipped["torchvision"] = (
            f"no {args.torchvision_python} (scripts/setup_torchvision.sh makes it)"
        )
    else:
        print(f"torchvision: {args.rounds} fresh-process rounds under {args.torchvision_python}")
        try:
            fresh = fresh_process_rounds(args.torchvision_python, args)
            times["torchvision"] = fresh["torchvision"]
        except RoundFailed as e:
            skipped["torchvision"] = str(e)
    rows = []
    for name in ("albumentations", "torchgrain", "kornia", "torchvision"):
        if name not in times:
            rows.append({"library": name, "note": skipped.get(name, "")})
            print(f"{name}: absent: {skipped.get(name, '')}")
            continue
        t = times[name]
        pub = PUBLISHED_MS.get(name)
        rows.append(
            {
                "library": name,
                "mean_ms": float(np.mean(t)) * 1e3,
                "median_ms": float(np.median(t)) * 1e3,
                "x_albumentations": float(np.mean(t)) / ref,
                "published_ms": pub,
                "published_x_albumentations": pub / PUBLISHED_MS["albumentations"] if pub else None,
            }
        )
    if fresh is not None:
        # Against albumentations run the same way (fresh processes, groups alternating),
        # not against the in-process row above.
        tv_row = next(r for r in rows if r["library"] == "torchvision")
        v = fresh["versions"]
        tv_row["x_albumentations"] = fresh["median_ratio"]
        tv_row["torch"], tv_row["torchvision"] = v["torch"], v["torchvision"]
        tv_row["note"] = (
            f"torch {v['torch']}, torchvision {v['torchvision']}; {fresh['rounds']} rounds of "
            f"{fresh['images_per_round']} images in a fresh process, groups alternating with "
            f"albumentations in its own ({np.mean(fresh['albumentations']) * 1e3:.2f} ms "
            f"there); x = median of per-round ratios"
        )
    over = adapter_overhead_us(image, 3200)
    # torchgrain vs direct once more on 4x the images: the same images and draws group
    # by group, so the median of the paired ratios shrugs off noise spikes.
    pair = interleaved_times(
        {k: runners[k] for k in ("albumentations", "torchgrain")}, 4 * args.runs, args.group
    )
    paired = float(np.median(pair["torchgrain"] / pair["albumentations"]))
    over["paired_median_ratio"] = paired
    over["paired_mean_ratio"] = float(pair["torchgrain"].mean() / pair["albumentations"].mean())
    tg_row = next(r for r in rows if r["library"] == "torchgrain")
    tg_row["paired_median_x_albumentations"] = paired
    tg_row["note"] = (
        f"paired median ratio {paired:.3f} ({4 * args.runs} images); fixed cost {over['getitems_overhead_us']:.1f} "
        f"us/record = {over['getitems_overhead_us'] / (ref * 1e6) * 100:.2f}% of the pipeline"
    )
    print()
    print_table(
        rows,
        [
            "library",
            "mean_ms",
            "median_ms",
            "x_albumentations",
            "published_ms",
            "published_x_albumentations",
            "note",
        ],
    )
    print(
        f"\ntorchgrain fixed cost per record (no-op pipeline, vs calling it directly): "
        f"adapter call {over['adapter_overhead_us']:.1f} us, Dataset.__getitems__ "
        f"{over['getitems_overhead_us']:.1f} us, Dataset.__getitem__ "
        f"{over['getitem_overhead_us']:.1f} us (direct no-op call {over['noop_direct_us']:.1f} us)"
    )
    write_json(
        "augmentation",
        {
            "settings": {
                "runs": args.runs,
                "group": args.group,
                "size": args.size,
                "threads": args.threads,
            },
            "published_ms": PUBLISHED_MS,
            "rows": rows,
            "overhead": over,
            "versions": versions(),
            "torchvision_fresh_processes": None
            if fresh is None
            else {
                **{k: v for k, v in fresh.items() if k not in ("albumentations", "torchvision")},
                "albumentations_mean_ms": float(np.mean(fresh["albumentations"])) * 1e3,
                "torchvision_mean_ms": float(np.mean(fresh["torchvision"])) * 1e3,
            },
        },
    )
    if not args.no_plot:
        plot([r for r in rows if "mean_ms" in r], os.path.join(RESULTS_DIR, "augmentation.png"))


if __name__ == "__main__":
    main()
