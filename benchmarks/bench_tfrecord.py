"""TFRecord scan speed and tf.train.Example parse speed, against baselines in the same run.

* Parse: torchgrain's pure-Python ``decode_tf_example`` vs the protobuf library's C
  parser (upb) on the same bytes, both with and without building the same
  ``{name: list/ndarray}`` dict, for a typical 5-feature image record (12 KiB JPEG-sized
  bytes) and a record of 100 small features.
* Scan: ``iter_tfrecord`` (CRCs verified / not) vs reading the same file in 4 MiB
  blocks (the disk/page-cache ceiling), plus gzip and ``index_tfrecord``.

Run: ``python benchmarks/bench_tfrecord.py [--mb 64] [--seconds 1.0]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import describe_machine, print_table, write_json

from torchgrain.formats.tf_example import decode_tf_example, encode_tf_example
from torchgrain.formats.tfrecord import (
    index_tfrecord,
    iter_tfrecord,
    write_tfrecord,
)

try:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tests"))
    from _example_proto import Example, to_python
except ImportError:  # protobuf not installed: torchgrain numbers only
    Example = to_python = None


def rate(fn, n_items: int, seconds: float) -> float:
    """Items per second of ``fn`` (which processes ``n_items``), best of 3 timed runs."""
    fn()  # warm up
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        reps = 0
        while True:
            fn()
            reps += 1
            dt = time.perf_counter() - t0
            if dt >= seconds / 3:
                break
        best = max(best, reps * n_items / dt)
    return best


def typical_record(rng: np.random.Generator, i: int) -> dict:
    return {
        "image/encoded": rng.bytes(12 * 1024),
        "image/format": b"jpeg",
        "image/class/label": i % 1000,
        "image/object/bbox": rng.random(4).astype(np.float32),
        "image/id": np.array([i * 7919], dtype=np.int64),
    }


def small_record(rng: np.random.Generator, i: int) -> dict:
    out: dict = {}
    for j in range(100):
        k = j % 3
        if k == 0:
            out[f"int_{j}"] = int(rng.integers(-(10**6), 10**6))
        elif k == 1:
            out[f"float_{j}"] = float(rng.random())
        else:
            out[f"str_{j}"] = f"token{i}_{j}".encode()
    return out


def bench_parse(seconds: float) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for label, make, keys in (
        ("5 features, 12 KiB image", typical_record, None),
        ("100 small features", small_record, None),
        ("100 small features, keys=3", small_record, {"int_0", "float_1", "str_2"}),
    ):
        recs = [encode_tf_example(make(rng, i)) for i in range(200)]
        ours = rate(
            lambda recs=recs, keys=keys: [decode_tf_example(r, keys=keys) for r in recs],
            len(recs),
            seconds,
        )
        row = {"case": label, "torchgrain rec/s": ours}
        if Example is not None:
            pb_parse = rate(
                lambda recs=recs: [Example.FromString(r) for r in recs], len(recs), seconds
            )
            pb_dict = rate(
                lambda recs=recs: [to_python(Example.FromString(r)) for r in recs],
                len(recs),
                seconds,
            )
            row.update(
                {
                    "protobuf parse rec/s": pb_parse,
                    "protobuf parse+dict rec/s": pb_dict,
                    "ratio vs parse+dict": ours / pb_dict,
                    "ratio vs parse only": ours / pb_parse,
                }
            )
        rows.append(row)
    return rows


def bench_scan(mb: int, seconds: float) -> list[dict]:
    rng = np.random.default_rng(1)
    d = tempfile.mkdtemp(prefix="tg-bench-tfrecord-")
    n = max(1, mb * 1024 * 1024 // (12 * 1024))
    recs = [rng.bytes(12 * 1024) for _ in range(min(n, 512))]
    recs = (recs * (n // len(recs) + 1))[:n]
    plain = os.path.join(d, "data.tfrecord")
    gz = os.path.join(d, "data.tfrecord.gz")
    write_tfrecord(recs, plain)
    write_tfrecord(recs[: max(1, n // 8)], gz)
    size = os.path.getsize(plain)
    gz_raw = sum(len(r) + 16 for r in recs[: max(1, n // 8)])

    def raw_read() -> None:
        with open(plain, "rb") as f:
            while f.read(4 << 20):
                pass

    def scan(path: str, verify: bool) -> None:
        for _ in iter_tfrecord(path, verify=verify):
            pass

    mbs = size / 1e6
    base = rate(raw_read, 1, seconds) * mbs
    rows = [{"case": "plain read, 4 MiB blocks (ceiling)", "MB/s": base, "rec/s": base / mbs * n}]
    for label, fn, vol, count in (
        ("iter_tfrecord, CRCs verified", lambda: scan(plain, True), mbs, n),
        ("iter_tfrecord, verify=False", lambda: scan(plain, False), mbs, n),
        ("iter_tfrecord, gzip, verified", lambda: scan(gz, True), gz_raw / 1e6, max(1, n // 8)),
        ("index_tfrecord (offsets)", lambda: index_tfrecord(plain), mbs, n),
    ):
        r = rate(fn, 1, seconds)
        rows.append(
            {"case": label, "MB/s": r * vol, "rec/s": r * count, "ratio vs read": r * vol / base}
        )
    for p in (plain, gz):
        os.remove(p)
    os.rmdir(d)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=64, help="size of the scanned file")
    ap.add_argument("--seconds", type=float, default=1.5, help="time per measurement")
    args = ap.parse_args()
    print(describe_machine())
    parse_rows = bench_parse(args.seconds)
    print("\ntf.train.Example parsing (200 distinct records, single thread)")
    print_table(
        parse_rows,
        [
            "case",
            "torchgrain rec/s",
            "protobuf parse rec/s",
            "protobuf parse+dict rec/s",
            "ratio vs parse+dict",
            "ratio vs parse only",
        ],
    )
    scan_rows = bench_scan(args.mb, args.seconds)
    print(f"\nTFRecord scan ({args.mb} MB of 12 KiB records, page cache warm)")
    print_table(scan_rows, ["case", "MB/s", "rec/s", "ratio vs read"])
    write_json("tfrecord", {"parse": parse_rows, "scan": scan_rows, "args": vars(args)})


if __name__ == "__main__":
    main()
