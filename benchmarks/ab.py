"""Paired A/B of the small-data hot paths between two checkouts (e.g. a release and main).

Each case is timed in a fresh process importing torchgrain from checkout A or B, rounds
interleaved (A, B / B, A ...), one epoch after a warm-up epoch, the data in the page cache:

* ``ar-global``: 200k msgpack records (a 64-byte array and a label) in 8 ArrayRecord shards
  written by the C++ writer (no manifest: each checkout indexes them its own way), zstd,
  ``GlobalShuffleSampler``, batches of 256 through a ``DataLoader`` with 0 workers.
* ``ar-block``: the same, ``BlockShuffleSampler`` (window 8).
* ``ar-single``: the same data, 50k ``src[i]`` in a shuffled order (no DataLoader).
* ``tfrecord-global``: 200k ``tf.train.Example`` records (64 bytes and a label) in 8
  TFRecord files, ``GlobalShuffleSampler``, batches of 256, 0 workers.
* ``e2e-2workers``: ``ar-global`` through a ``DataLoader`` with 2 workers and a
  ``Dataset.map`` that turns each record into a float tensor (the collate included).

Prints each case's median B/A ratio of rates over rounds (the ratio within a round) with
its range, and writes ``results/ab.json``. A ratio >= ~0.95 on a busy 2-core machine reads
as "no slower". For the Parquet paths see ``parquet_ab.py``.

Run: ``python benchmarks/ab.py --a /path/to/baseline --b . [--rounds 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import describe_machine, print_table, write_json  # noqa: E402

BATCH = 256
RECORDS = 200_000
SHARDS = 8
SINGLES = 50_000
CASES = ("ar-global", "ar-block", "ar-single", "tfrecord-global", "e2e-2workers")


def _passthrough(batch: Any) -> Any:
    return batch


def _to_tensor(record: dict[str, Any]) -> Any:
    import numpy as np
    import torch

    return torch.from_numpy(np.frombuffer(record["x"], dtype=np.uint8).astype(np.float32))


def child(case: str, root: str, data: str) -> dict[str, float]:
    sys.path.insert(0, root)
    import numpy as np
    import torch

    import torchgrain as tg

    assert os.path.dirname(os.path.abspath(tg.__file__)) == os.path.join(
        os.path.abspath(root), "torchgrain"
    ), tg.__file__
    if case == "tfrecord-global":
        src = tg.TFRecordSource(os.path.join(data, "tfrecord"))
    else:
        src = tg.ArrayRecordSource(os.path.join(data, "ar"))
    if case == "ar-single":
        order = np.random.default_rng(0).permutation(len(src))[:SINGLES].tolist()
        for i in order[:1000]:  # warm-up
            src[i]
        t0 = time.perf_counter()
        for i in order:
            src[i]
        return {"epoch": len(order) / (time.perf_counter() - t0)}
    ds = tg.Dataset(src)
    workers, collate = 0, _passthrough
    if case == "e2e-2workers":
        ds = ds.map(_to_tensor)
        workers, collate = 2, None
    if case == "ar-block":
        sampler = tg.BlockShuffleSampler(ds, seed=0, window=8, num_replicas=1, rank=0)
    else:
        sampler = tg.GlobalShuffleSampler(ds, seed=0, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=BATCH,
        sampler=sampler,
        collate_fn=collate,
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    out = {}
    for name, epoch in (("warm-up", 0), ("epoch", 1)):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        n = 0
        for batch in loader:
            n += len(batch)
        if name != "warm-up":
            out[name] = n / (time.perf_counter() - t0)
        assert n == len(ds), (n, len(ds))
    return out


def run(case: str, root: str, data: str) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--root", root]
    env = dict(os.environ, PYTHONPATH="", TORCHGRAIN_CACHE=os.path.join(data, "cache"))
    out = subprocess.run([*cmd, "--data", data], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{case} in {root} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_data(data: str, records: int = RECORDS) -> None:
    """The shards, written with the formats' own writers (no torchgrain file beside them)."""
    import msgpack
    import numpy as np
    from array_record.python.array_record_module import ArrayRecordWriter

    sys.path.insert(0, os.path.dirname(HERE))
    from torchgrain.formats.tf_example import encode_tf_example
    from torchgrain.formats.tfrecord import write_tfrecord

    rng = np.random.default_rng(0)
    ar, tf = os.path.join(data, "ar"), os.path.join(data, "tfrecord")
    os.makedirs(ar)
    os.makedirs(tf)
    per = records // SHARDS
    for s in range(SHARDS):
        w = ArrayRecordWriter(os.path.join(ar, f"part-{s:05d}.array_record"), "group_size:1")
        examples = []
        for i in range(s * per, (s + 1) * per):
            x = rng.integers(0, 255, 64, dtype=np.uint8)
            w.write(msgpack.packb({"x": x.tobytes(), "label": i % 1000}))
            examples.append(encode_tf_example({"x": [x.tobytes()], "label": [i % 1000]}))
        w.close()
        write_tfrecord(examples, os.path.join(tf, f"part-{s:05d}.tfrecord"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", help="checkout A (the baseline; required)")
    p.add_argument("--b", default=os.path.dirname(HERE), help="checkout B")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--records", type=int, default=RECORDS)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--json-name", default="ab")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.root, args.data)))
        return
    if not args.a:
        p.error("--a (the baseline checkout) is required")
    print(f"machine: {describe_machine()}")
    print(f"A = {args.a}\nB = {args.b}")
    data = tempfile.mkdtemp(prefix="tg-ab-")
    cases = args.cases.split(",")
    rounds = []
    try:
        make_data(data, args.records)
        for c in cases:  # each checkout builds what it caches (indexes) before timing
            run(c, args.a, data)
            run(c, args.b, data)
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            for case in cases:
                first, second = ("a", "b") if r % 2 == 0 else ("b", "a")
                row[case] = {k: run(case, getattr(args, k), data) for k in (first, second)}
            rounds.append(row)
            print(f"round {r}: {json.dumps(row)}", flush=True)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    table = []
    summary: dict[str, Any] = {}
    for case in cases:
        ratios = [r[case]["b"]["epoch"] / r[case]["a"]["epoch"] for r in rounds]
        a = statistics.median(r[case]["a"]["epoch"] for r in rounds)
        b = statistics.median(r[case]["b"]["epoch"] for r in rounds)
        med = statistics.median(ratios)
        summary[case] = {"a": a, "b": b, "ratio": med, "min": min(ratios), "max": max(ratios)}
        table.append(
            {
                "case": case,
                "A rec/s": a,
                "B rec/s": b,
                "B/A median": med,
                "min": min(ratios),
                "max": max(ratios),
            }
        )
    print_table(table, ["case", "A rec/s", "B rec/s", "B/A median", "min", "max"])
    write_json(args.json_name, {"a": args.a, "b": args.b, "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    main()
