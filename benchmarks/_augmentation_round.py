"""The augmentation benchmark's pipelines, and one timed round of one library.

``benchmarks/augmentation.py`` builds its pipelines from here, and runs this file as a
script for the rows it measures in fresh processes: torchvision, whose build must match
its own torch and so lives in another virtualenv (``.venv-torchvision``, made by
``scripts/setup_torchvision.sh``), and albumentations measured the same way beside it.
Only numpy and torch are imported at the top, so the script runs in an environment
that has neither torchgrain nor albumentations.

With ``--serve`` the process warms the pipeline up, writes one JSON line (library,
versions), then times one group of ``--group`` images for each line it reads and writes
back the seconds per image: the benchmark drives two such processes group by group, so
load on the machine falls on both alike.

Run by hand: ``python benchmarks/_augmentation_round.py --library torchvision --images 128
--json-out round.json`` (writes ``{"library", "seconds_per_image": [...], "versions"}``,
one entry per group).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

import numpy as np
import torch

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
LIBRARIES = ("albumentations", "kornia", "torchvision")


def test_image(size: int) -> np.ndarray:
    """A smooth-plus-noise RGB image (photo-like statistics, nothing downloaded)."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    base = np.stack([xx, yy, (xx + yy) / 2], -1) * (255.0 / size)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def albumentations_pipeline(seed: int | None = None):
    import albumentations as A

    return A.Compose(
        [
            A.RandomResizedCrop((224, 224), scale=(0.08, 1.0)),
            A.HorizontalFlip(p=0.5),
            A.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.0, hue=0.0, p=1.0),
            A.Normalize(mean=MEAN, std=STD),
        ],
        seed=seed,
    )


def kornia_pipeline():
    import kornia.augmentation as K

    return torch.nn.Sequential(
        K.RandomResizedCrop((224, 224), scale=(0.08, 1.0)),
        K.RandomHorizontalFlip(p=0.5),
        K.ColorJitter(brightness=0.2, contrast=0.2, p=1.0),
        K.Normalize(mean=torch.tensor(MEAN), std=torch.tensor(STD)),
    )


def torchvision_pipeline():
    from torchvision.transforms import v2

    return v2.Compose(
        [
            v2.RandomResizedCrop(224, scale=(0.08, 1.0), antialias=True),
            v2.RandomHorizontalFlip(p=0.5),
            v2.ColorJitter(brightness=0.2, contrast=0.2),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=MEAN, std=STD),
        ]
    )


def one_image_runner(library: str, image: np.ndarray, seed: int = 0) -> Callable[[], object]:
    """A call that runs ``library``'s pipeline on ``image`` once.

    Each library gets the image in its own input format, converted here, before timing:
    HWC uint8 numpy (albumentations), CHW uint8 tensor (torchvision v2), 1x3xHxW
    float32 tensor in [0, 1] (kornia, which needs floats).
    """
    torch.manual_seed(seed)
    if library == "albumentations":
        comp = albumentations_pipeline(seed)
        return lambda: comp(image=image)
    if library == "kornia":
        seq = kornia_pipeline()
        x = torch.from_numpy(image).permute(2, 0, 1)[None].float().div(255).contiguous()
        return lambda: seq(x)
    if library == "torchvision":
        tv = torchvision_pipeline()
        x = torch.from_numpy(image).permute(2, 0, 1).contiguous()
        return lambda: tv(x)
    raise ValueError(f"unknown library {library!r}; expected one of {', '.join(LIBRARIES)}")


def group_timer(
    library: str, image: np.ndarray, group: int, seed: int = 0, warmup_groups: int = 2
) -> Callable[[], float]:
    """Warm ``library``'s pipeline up; return a call that times one group of ``group``
    images and gives the seconds per image."""
    run = one_image_runner(library, image, seed)
    clock = time.perf_counter

    def timed_group() -> float:
        with torch.inference_mode():
            t0 = clock()
            results = [run() for _ in range(group)]
            took = clock() - t0
        del results  # a whole group stays alive until the clock stops, as in a batch
        return took / group

    # Whole groups, so the first timed one finds the allocator as warm as the rest do.
    for _ in range(warmup_groups):
        timed_group()
    return timed_group


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for mod in ("albumentations", "kornia", "torchvision", "cv2", "torch", "numpy"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--library", required=True, choices=LIBRARIES)
    ap.add_argument("--images", type=int, default=128, help="timed images")
    ap.add_argument("--group", type=int, default=16, help="images per timed call")
    ap.add_argument("--size", type=int, default=512, help="input image side in pixels")
    ap.add_argument("--threads", type=int, default=1, help="torch and OpenCV threads")
    ap.add_argument("--seed", type=int, default=0, help="seeds the library's random draws")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--json-out", help="time --images images, write the times here")
    mode.add_argument(
        "--serve", action="store_true", help="time one group per line on stdin, reply on stdout"
    )
    args = ap.parse_args()

    reply = sys.stdout
    if args.serve:
        # Replies get stdout's pipe to themselves: whatever else writes to fd 1 goes to stderr.
        reply = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    torch.set_num_threads(args.threads)
    if args.library == "albumentations":
        import cv2

        cv2.setNumThreads(args.threads)
    timed_group = group_timer(args.library, test_image(args.size), args.group, args.seed)
    if args.serve:
        # One line of JSON when warm, then one group per line read from stdin, its
        # seconds per image written back; until stdin closes.
        print(json.dumps({"library": args.library, "versions": versions()}), file=reply, flush=True)
        while sys.stdin.readline():
            print(repr(timed_group()), file=reply, flush=True)
        return
    times = [timed_group() for _ in range(max(1, args.images // args.group))]
    with open(args.json_out, "w") as f:
        json.dump({"library": args.library, "seconds_per_image": times, "versions": versions()}, f)


if __name__ == "__main__":
    main()
