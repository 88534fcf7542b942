"""decode_image backends: OpenCV (cv2.imdecode) against Pillow on the same bytes.

Decodes the same photo-like 512x512 (and 256x256) RGB image, encoded as JPEG
(quality 90) and PNG, to an HWC uint8 RGB array with each backend, interleaved, with
OpenCV limited to one thread as in a DataLoader worker. ``decode_image(backend="auto")``
picks the faster backend of this table.

Run: ``python benchmarks/decode_image.py [--runs 300]``
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import describe_machine, print_table, write_json

import torchgrain as tg


def photo_like(size: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    base = np.stack([xx, yy, (xx + yy) / 2], -1) * (255.0 / size)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def encode(image: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=300)
    args = ap.parse_args()
    import cv2

    cv2.setNumThreads(1)
    print(f"machine: {describe_machine()}")
    backends = {b: tg.decode_image(backend=b) for b in ("cv2", "pillow")}
    rows = []
    for size in (512, 256):
        image = photo_like(size)
        for fmt in ("JPEG", "PNG"):
            data = encode(image, fmt)
            times = {b: np.empty(args.runs) for b in backends}
            a, b = (dec.decode(data) for dec in backends.values())  # warm up, compare
            assert a.shape == b.shape == image.shape and np.abs(a.astype(int) - b).mean() < 1
            for i in range(args.runs):
                for b, dec in backends.items():
                    t0 = time.perf_counter()
                    dec.decode(data)
                    times[b][i] = time.perf_counter() - t0
            cv_ms = float(np.median(times["cv2"])) * 1e3
            pil_ms = float(np.median(times["pillow"])) * 1e3
            rows.append(
                {
                    "image": f"{size}x{size} {fmt}",
                    "kib": len(data) / 1024,
                    "cv2_ms": cv_ms,
                    "pillow_ms": pil_ms,
                    "pillow_over_cv2": pil_ms / cv_ms,
                }
            )
    print(f"median of {args.runs} decodes each, OpenCV {cv2.__version__}, 1 thread\n")
    print_table(rows, ["image", "kib", "cv2_ms", "pillow_ms", "pillow_over_cv2"])
    write_json("decode_image", {"settings": {"runs": args.runs}, "rows": rows})


if __name__ == "__main__":
    main()
