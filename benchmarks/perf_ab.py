"""Load-independent A/B of the hot paths between two checkouts: instructions and CPU time
per batch, not wall-clock rates (on a busy shared machine those are noise).

Each case runs in a fresh process importing torchgrain from checkout A or B (via
``sys.path``), on the same files (written once with checkout A's writers), each checkout
with its own ``TORCHGRAIN_CACHE`` (a first untimed process per checkout and case builds
what it caches). A process reads one untimed warm-up epoch (epoch 0), then:

* ``cpu``: the whole of epoch 1, counting user + system CPU time of the process
  (``resource.getrusage``, all its threads) per batch; ``--rounds`` processes per
  checkout, interleaved A, B, B, A, ...;
* ``instructions``: the first ``--batches`` batches of epoch 1 under
  ``valgrind --tool=callgrind --instr-atstart=no``: a small C helper built with
  ``callgrind.h`` starts the instrumentation after the warm-up and dumps the counts after
  the batches, so the count is of those batches only (all threads, user space);
  ``--ir-rounds`` processes per checkout. Needs valgrind, its headers and a C compiler;
  ``perf`` counters are not used because virtual machines often have none.

Cases (0 DataLoader workers, ``collate_fn`` passing records through, batches of 256
unless said; the shapes of ``ab.py`` and ``parquet_ab.py``, fewer records):

* ``ar-global`` / ``ar-block``: 100k msgpack records (64 bytes and a label), 8 zstd
  ArrayRecord shards from the C++ writer, ``GlobalShuffleSampler`` / ``BlockShuffleSampler``
  (window 8);
* ``ar-single``: the same records one at a time, ``src[i]`` in a shuffled order (a
  "batch": 256 calls);
* ``tfrecord-global``: the same records as ``tf.train.Example`` in 8 TFRecord files;
* ``pq-global`` / ``pq-block``: ``parquet_access.py``'s rows (~1 KiB each), 50k rows in 8
  files of 16 row groups, ``ParquetSource(cache_bytes=1 GiB)``, records;
* ``pq-columns``: ``columns.py``'s rows, 100k in one file of 10 row groups,
  ``batch_format="columns"`` and the default collate, global shuffle;
* ``tokens-concat`` / ``tokens-pack``: ``Dataset(parquet).windows("tokens", 512)`` in
  concat and pack mode over ~2M int32 tokens in lognormal documents (a few empty), 2
  Parquet files, batches of 32 windows, global shuffle;
* ``mix``: ``tg.mix`` of the ArrayRecord records (weight 0.7) and a 10k-record
  ArrayRecord dataset (weight 0.3, ``stopping="all_exhausted"``: read ~4 passes an epoch),
  global shuffle.

Writes ``results/<--json-name>.json``: per case, A and B instructions per batch and their
ratio B/A (median over processes), and CPU microseconds per batch (median, min, max).

Run: ``python benchmarks/perf_ab.py --a /path/to/baseline --b . [--rounds 3]
[--ir-rounds 1] [--batches 40] [--data DIR] [--cases ar-global,mix]``. To find where
a case's count moved, ``--keep-callgrind`` keeps the counts (``callgrind_annotate`` them),
and one process ``--child CASE --root CHECKOUT --data DIR --profile OUT`` writes cProfile
stats of its epoch 1 (call counts, for ``pstats``). The two measurements can run at once
(``--ir-rounds 0`` in one, ``--rounds 0`` in the other, another ``--json-name`` each:
instruction counts do not depend on the load) and be joined with ``--merge A.json B.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import describe_machine, print_table, write_json  # noqa: E402

CASES = (
    "ar-single",
    "ar-global",
    "ar-block",
    "tfrecord-global",
    "pq-global",
    "pq-block",
    "pq-columns",
    "tokens-concat",
    "tokens-pack",
    "mix",
)
RECORDS, SHARDS, SMALL = 100_000, 8, 10_000
HELPER_C = """#include <valgrind/callgrind.h>
void tg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void tg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT("measured"); }
"""


def _passthrough(batch: Any) -> Any:
    return batch


def _loader(case: str, data: str) -> tuple[Any, Any]:
    """The sampler and DataLoader of ``case``."""
    import torch

    import torchgrain as tg

    batch, collate, order = 256, _passthrough, case.rsplit("-", 1)[-1]
    if case == "ar-single":
        singles = _Singles(tg.ArrayRecordSource(os.path.join(data, "ar")), batch)
        return singles, singles
    if case.startswith("ar-"):
        ds = tg.Dataset(tg.ArrayRecordSource(os.path.join(data, "ar")))
    elif case == "tfrecord-global":
        ds = tg.Dataset(tg.TFRecordSource(os.path.join(data, "tfrecord")))
    elif case == "pq-columns":
        src = tg.ParquetSource(os.path.join(data, "columns"), cache_bytes=1 << 30)
        ds, collate = tg.Dataset(src, batch_format="columns"), None
    elif case.startswith("pq-"):
        ds = tg.Dataset(tg.ParquetSource(os.path.join(data, "access"), cache_bytes=1 << 30))
    elif case.startswith("tokens-"):
        docs = tg.Dataset(tg.ParquetSource(os.path.join(data, "tokens"), cache_bytes=1 << 30))
        ds, batch = docs.windows("tokens", 512, mode=order, progress=False), 32
    else:  # mix
        big = tg.Dataset(tg.ArrayRecordSource(os.path.join(data, "ar")))
        small = tg.Dataset(tg.ArrayRecordSource(os.path.join(data, "small")))
        ds = tg.mix([big, small], [0.7, 0.3], seed=0, stopping="all_exhausted")
    if order == "block":
        sampler = tg.BlockShuffleSampler(ds, seed=0, window=8, num_replicas=1, rank=0)
    else:
        sampler = tg.GlobalShuffleSampler(ds, seed=0, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=batch, sampler=sampler, collate_fn=collate, num_workers=0
    )
    return sampler, loader


class _Singles:
    """``src[i]`` for every record of ``src``, in an order shuffled per epoch, in lists of
    ``batch`` (the sampler and loader of ``ar-single``)."""

    def __init__(self, src: Any, batch: int) -> None:
        self.src, self.batch, self.order = src, batch, None

    def set_epoch(self, epoch: int) -> None:
        import numpy as np

        self.order = np.random.default_rng(epoch).permutation(len(self.src)).tolist()

    def __iter__(self) -> Any:
        src, order = self.src, self.order
        for s in range(0, len(order), self.batch):
            yield [src[i] for i in order[s : s + self.batch]]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(
    case: str, root: str, data: str, batches: int, helper: str | None, profile: str | None = None
) -> dict:
    sys.path.insert(0, root)
    import torchgrain as tg

    here = os.path.dirname(os.path.abspath(tg.__file__))
    assert here == os.path.join(os.path.abspath(root), "torchgrain"), tg.__file__
    sampler, loader = _loader(case, data)
    sampler.set_epoch(0)
    for _ in loader:  # warm-up: readers, indexes, caches, page cache
        pass
    sampler.set_epoch(1)
    if helper:  # instructions: the first `batches` batches only
        import ctypes

        lib = ctypes.CDLL(helper)
        it = iter(loader)
        lib.tg_start()
        for _ in range(batches):
            next(it)
        lib.tg_stop()
        return {"batches": batches}
    if profile:  # call counts of the epoch, to compare the checkouts' work function by function
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    n, t0 = 0, _cpu()
    for _ in loader:
        n += 1
    cpu = _cpu() - t0
    if profile:
        prof.disable()
        prof.dump_stats(profile)
    return {"batches": n, "cpu_us": cpu / n * 1e6}


def make_data(data: str) -> None:
    """The files, written with the formats' own writers and the checkout's (on sys.path)."""
    import msgpack
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter
    from parquet_ab import columns_table
    from parquet_access import make_files

    from torchgrain.formats.tf_example import encode_tf_example
    from torchgrain.formats.tfrecord import write_tfrecord

    rng = np.random.default_rng(0)
    for name, n, shards in (("ar", RECORDS, SHARDS), ("small", SMALL, 2)):
        os.makedirs(os.path.join(data, name))
        per = n // shards
        for s in range(shards):
            path = os.path.join(data, name, f"part-{s:05d}.array_record")
            w = ArrayRecordWriter(path, "group_size:1")
            examples = []
            for i in range(s * per, (s + 1) * per):
                x = rng.integers(0, 255, 64, dtype=np.uint8).tobytes()
                w.write(msgpack.packb({"x": x, "label": i % 1000}))
                examples.append(encode_tf_example({"x": [x], "label": [i % 1000]}))
            w.close()
            if name == "ar":
                os.makedirs(os.path.join(data, "tfrecord"), exist_ok=True)
                write_tfrecord(examples, os.path.join(data, "tfrecord", f"part-{s:05d}.tfrecord"))
    os.makedirs(os.path.join(data, "access"))
    make_files(os.path.join(data, "access"), 50_000, 8, 16, 1024)
    table = columns_table(100_000, rng)
    os.makedirs(os.path.join(data, "columns"))
    pq.write_table(table, os.path.join(data, "columns", "part-0.parquet"), row_group_size=10_000)
    doc_len = np.maximum(1, rng.lognormal(np.log(400), 1.0, 3_000).astype(np.int64))
    doc_len[rng.choice(len(doc_len), 20, replace=False)] = 0  # a few empty documents
    os.makedirs(os.path.join(data, "tokens"))
    for f, part in enumerate(np.array_split(doc_len, 2)):
        docs = [rng.integers(0, 50257, int(k), dtype=np.int32) for k in part]
        t = pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))})
        pq.write_table(t, os.path.join(data, "tokens", f"part-{f}.parquet"), row_group_size=500)


def build_helper(data: str) -> str:
    src, lib = os.path.join(data, "cg_helper.c"), os.path.join(data, "cg_helper.so")
    with open(src, "w") as f:
        f.write(HELPER_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
    return lib


def run(
    case: str, root: str, data: str, batches: int = 0, helper: str | None = None
) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--root", root]
    cmd += ["--data", data, "--batches", str(batches)]
    tag = "a" if os.path.abspath(root) == os.path.abspath(ARGS.a) else "b"
    env = dict(
        os.environ,
        PYTHONPATH="",
        PYTHONHASHSEED="0",
        TORCHGRAIN_CACHE=os.path.join(data, f"cache-{tag}"),
    )
    outdir = None
    if helper:
        outdir = tempfile.mkdtemp(dir=data)
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={outdir}/cg.%p",
            *cmd,
            "--helper",
            helper,
        ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{case} in {root} failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if outdir:
        parts = sorted(glob.glob(f"{outdir}/cg.*.1"))
        with open(parts[0]) as f:
            total = int(re.search(r"^totals: (\d+)", f.read(), re.M).group(1))
        res["ir_per_batch"] = total / batches
        if ARGS.keep_callgrind:
            res["callgrind"] = shutil.copy(parts[0], f"{data}/{case}-{tag}.callgrind")
        shutil.rmtree(outdir)
    return res


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", help="checkout A (the baseline; required)")
    p.add_argument("--b", default=os.path.dirname(HERE), help="checkout B")
    p.add_argument("--rounds", type=int, default=3, help="CPU-time processes per checkout")
    p.add_argument("--ir-rounds", type=int, default=1, help="callgrind processes per checkout")
    p.add_argument("--batches", type=int, default=40, help="batches counted under callgrind")
    p.add_argument("--data", help="a directory for the files (kept; default: a temporary one)")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--keep-callgrind", action="store_true", help="keep the counts' files")
    p.add_argument("--json-name", default="perf_ab")
    p.add_argument("--merge", nargs="+", help="summarise the runs of these results' JSON files")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--helper", help=argparse.SUPPRESS)
    p.add_argument("--profile", help=argparse.SUPPRESS)
    ARGS = args = p.parse_args()
    if args.merge:
        merge(args.merge, args.json_name)
        return
    if args.child:
        res = child(args.child, args.root, args.data, args.batches, args.helper, args.profile)
        print(json.dumps(res))
        return
    if not args.a:
        p.error("--a (the baseline checkout) is required")
    print(f"machine: {describe_machine()}\nA = {args.a}\nB = {args.b}", flush=True)
    data = args.data or tempfile.mkdtemp(prefix="tg-perf-ab-")
    if not os.path.exists(os.path.join(data, "ar")):
        os.makedirs(data, exist_ok=True)
        code = f"import sys; sys.path[:0] = [{args.a!r}, {HERE!r}]; "
        code += f"import perf_ab; perf_ab.make_data({data!r})"
        subprocess.run(
            [sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH="")
        )
    helper = build_helper(data) if args.ir_rounds else None
    cases = args.cases.split(",")
    results: dict[str, Any] = {}
    try:
        for case in cases:
            for k in ("a", "b"):  # each checkout builds what it caches before counting
                run(case, getattr(args, k), data)
            rows: dict[str, list] = {"a": [], "b": []}
            for r in range(max(args.rounds, args.ir_rounds)):
                for k in ("a", "b") if r % 2 == 0 else ("b", "a"):
                    root = getattr(args, k)
                    if r < args.rounds:
                        rows[k].append(run(case, root, data))
                    if r < args.ir_rounds:
                        rows[k].append(run(case, root, data, args.batches, helper))
            results[case] = {k: rows[k] for k in rows}
            print(f"{case}: {json.dumps(results[case])}", flush=True)
    finally:
        if not args.data:
            shutil.rmtree(data, ignore_errors=True)
    summarise(results, {"a": args.a, "b": args.b, "batches_counted": args.batches}, args.json_name)


def summarise(results: dict[str, Any], payload: dict[str, Any], json_name: str) -> None:
    """Print and write each case's instructions and CPU time per batch, A against B."""
    table, summary = [], {}
    for case, runs in results.items():
        s: dict[str, Any] = {}
        for k in ("a", "b"):
            cpu = [r["cpu_us"] for r in runs[k] if "cpu_us" in r]
            ir = [r["ir_per_batch"] for r in runs[k] if "ir_per_batch" in r]
            s[k] = {
                "cpu_us_per_batch": _summary(cpu) if cpu else None,
                "ir_per_batch": statistics.median(ir) if ir else None,
                "ir_processes": len(ir),
                "batches_per_epoch": next((r["batches"] for r in runs[k] if "cpu_us" in r), None),
            }
        if s["a"]["ir_per_batch"] and s["b"]["ir_per_batch"]:
            s["ir_ratio"] = s["b"]["ir_per_batch"] / s["a"]["ir_per_batch"]
        cpu_a, cpu_b = s["a"]["cpu_us_per_batch"] or {}, s["b"]["cpu_us_per_batch"] or {}
        if cpu_a and cpu_b:
            s["cpu_ratio"] = cpu_b["median"] / cpu_a["median"]
        summary[case] = s
        table.append(
            {
                "case": case,
                "A Ir/batch": s["a"]["ir_per_batch"],
                "B Ir/batch": s["b"]["ir_per_batch"],
                "Ir B/A": s.get("ir_ratio"),
                "A cpu us": cpu_a.get("median"),
                "B cpu us": cpu_b.get("median"),
                "cpu B/A": s.get("cpu_ratio"),
            }
        )
    cols = ["case", "A Ir/batch", "B Ir/batch", "Ir B/A", "A cpu us", "B cpu us", "cpu B/A"]
    print_table(table, cols)
    write_json(json_name, {**payload, "runs": results, "summary": summary})


def merge(paths: list[str], json_name: str) -> None:
    """Join the runs of earlier results (e.g. a CPU-time and a callgrind run made at once)."""
    results: dict[str, Any] = {}
    payload: dict[str, Any] = {"merged": paths}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        payload.update({k: doc[k] for k in ("a", "b")})
        payload["batches_counted"] = max(payload.get("batches_counted", 0), doc["batches_counted"])
        for case, runs in doc["runs"].items():
            for k in ("a", "b"):
                results.setdefault(case, {"a": [], "b": []})[k] += runs[k]
    summarise(results, payload, json_name)


ARGS: argparse.Namespace


if __name__ == "__main__":
    main()
