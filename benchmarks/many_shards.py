"""ArrayRecord with many shards: batch rate and index memory, 8 vs 2,048 vs 10,000 shards.

The same tiny records (16 bytes, so that the loader's own costs show) are written as
torchgrain datasets of 8, 2,048 and 10,000 shards (group_size 1, zstd, with the
``torchgrain.tgindex`` the writer puts beside them). Every measurement runs in a fresh
process, rounds interleaved, and reads with ``ArrayRecordSource(codec="raw")``'s
``__getitems__`` in batches of 256 in a global-shuffle order, as a DataLoader with
``num_workers=0`` would:

* **rate**: records per second over a window of the order (1M records by default),
  after a warm-up pass over it (wall and CPU seconds of the process);
  ratios of the many-shard datasets to the 8-shard one, per round, medians and ranges;
* **variants**: ``mapped`` (the dataset's index file, mapped), ``memory`` (the same index
  built into the process's heap: ``index_dir=None`` over the shard files without their
  manifest), and ``base`` (another checkout of torchgrain, e.g. ``--base /path/to/main``);
* **memory** after one whole warm epoch, from ``/proc/self/smaps``: the growth of the
  process's anonymous private memory (its heap: what every worker of every rank would
  hold privately), and the index file's and shards' mapped pages (page cache, shared);
* **node**: ``--node 8`` processes read a whole epoch each, all alive when measured: the
  sum of their proportional set sizes of index and heap, extrapolated to 64 processes;
* **a/b**: ``--ab`` compares this checkout with ``--base`` on the small-data fast paths
  (one shard of 1 KiB and of 100 KiB records, and the 8-shard tiny records, msgpack
  codec), a whole shuffled pass per fresh process, rounds interleaved.

Numbers from a shared machine are indicative: look at the ratios and their ranges.

    python benchmarks/many_shards.py --records 6400000 --base /path/to/main
    python benchmarks/many_shards.py --records 400000 --shards 8 2048 --rounds 1  # quick
    python benchmarks/many_shards.py --ab --base /path/to/main --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = 256


# ------------------------------------------------------------------ data
def build(directory: str, n: int, shards: int) -> str:
    """A torchgrain dataset of ``n`` 16-byte records in ``shards`` shards (C++ writer)."""
    sys.path.insert(0, ROOT)
    from array_record.python.array_record_module import ArrayRecordWriter

    from torchgrain.formats.manifest import MANIFEST_NAME, Manifest, ShardInfo, atomic_write_text
    from torchgrain.sources.node_index import write_dataset_index
    from torchgrain.writers import shard_name

    if os.path.exists(os.path.join(directory, MANIFEST_NAME)):
        return directory
    os.makedirs(directory, exist_ok=True)
    pack = struct.Struct("<QQ").pack
    infos = []
    for s in range(shards):
        a, b = n * s // shards, n * (s + 1) // shards
        name = shard_name(s, shards)
        path = os.path.join(directory, name)
        w = ArrayRecordWriter(path, "group_size:1,zstd:3")
        for i in range(a, b):
            w.write(pack(i, i * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF))
        w.close()
        infos.append(ShardInfo(path=name, num_records=b - a, num_bytes=os.path.getsize(path)))
    m = Manifest(codec="raw", shards=infos)
    m.extra["index"] = write_dataset_index(directory, [i.path for i in infos])
    atomic_write_text(os.path.join(directory, MANIFEST_NAME), m.to_json())
    return directory


def build_small(directory: str, n: int, size: int) -> str:
    """One shard of ``n`` msgpack records holding ``size`` random bytes (random_access.py's)."""
    sys.path.insert(0, ROOT)
    import numpy as np

    import torchgrain as tg

    if os.path.exists(os.path.join(directory, "torchgrain.json")):
        return directory
    rng = np.random.default_rng(0)
    tg.write_array_record(
        ({"data": rng.bytes(size), "i": i} for i in range(n)), directory, num_shards=1
    )
    return directory


def order_file(root: str, n: int) -> str:
    """A global-shuffle order of ``n`` records, saved once under ``root``."""
    path = os.path.join(root, f"order-{n}.npy")
    if not os.path.exists(path):
        import numpy as np

        sys.path.insert(0, ROOT)
        import torchgrain as tg

        os.makedirs(root, exist_ok=True)
        perm = tg.GlobalShuffleSampler(n, seed=0, num_replicas=1, rank=0).indices(0, n)
        np.save(path + ".tmp.npy", np.asarray(perm, np.int64))
        os.replace(path + ".tmp.npy", path)
    return path


# ------------------------------------------------------------------ in a child
def smaps() -> dict[str, int]:
    """Bytes by kind of mapping: the index file, the shards, everything else (heap)."""
    out = {k: 0 for k in ("index_pss", "index_rss", "data_pss", "anon_private", "uss", "pss")}
    kind = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)
            if "-" in head[0] and not head[0].endswith(":"):
                parts = line.split()
                path = parts[5] if len(parts) > 5 else ""
                kind = (
                    "index"
                    if path.endswith(".tgindex")
                    else "data"
                    if ".array_record" in path
                    else "other"
                )
                continue
            key = head[0].rstrip(":")
            if key not in ("Pss", "Rss", "Private_Dirty", "Private_Clean", "Anonymous"):
                continue
            kb = int(head[1].split()[0]) * 1024
            if key == "Pss":
                out["pss"] += kb
                if kind in ("index", "data"):
                    out[f"{kind}_pss"] += kb
            elif key == "Rss" and kind == "index":
                out["index_rss"] += kb
            elif key in ("Private_Dirty", "Private_Clean"):
                out["uss"] += kb
            elif key == "Anonymous":
                out["anon_private"] += kb  # heap and anonymous maps (dirty, private)
    return out


def child(args: argparse.Namespace) -> None:
    import numpy as np

    sys.path.insert(0, args.import_from)
    import torchgrain as tg

    # The order, made once by the parent, mapped (making it here would allocate far more
    # than the index the memory rows measure, and take seconds).
    perm = np.load(order_file(args.dir_root, args.n), mmap_mode="r")
    if args.mode == "epoch":
        # What every reading process has whatever the dataset (modules imported on
        # first use, a decompression context): read a small dataset before the baseline.
        small = os.path.join(args.dir_root, "warm")
        tiny = tg.ArrayRecordSource(small, codec=args.codec)
        tiny.__getitems__(list(range(len(tiny) - 1, -1, -1)))
        tiny.__getitems__(list(range(len(tiny))))
        del tiny
    mem0 = smaps()
    t0 = time.perf_counter()
    if args.from_pickle:  # a DataLoader worker's way: the source pickled by its parent
        with open(args.from_pickle, "rb") as f:
            src = pickle.load(f)
    elif args.variant == "memory":
        src = tg.ArrayRecordSource(
            sorted(
                os.path.join(args.dir, f)
                for f in os.listdir(args.dir)
                if f.endswith(".array_record")
            ),
            codec=args.codec,
            index_dir=None,
        )
    else:
        src = tg.ArrayRecordSource(args.dir, codec=args.codec)
    n = len(src)
    open_s = time.perf_counter() - t0
    assert n == args.n, (n, args.n)
    out = {"variant": args.variant, "dir": args.dir, "open_s": open_s, "records": n}
    pos = 0

    def step() -> int:
        nonlocal pos
        k = pos % max(n - BATCH, 1)
        src.__getitems__(perm[k : k + BATCH])
        pos += BATCH
        return BATCH

    if args.mode == "pass":  # one whole shuffled pass, timed (the a/b rows)
        c0, t0 = time.process_time(), time.perf_counter()
        for a in range(0, n, BATCH):
            src.__getitems__(perm[a : a + BATCH])
        out["pass_s"] = time.perf_counter() - t0
        out["pass_cpu_s"] = time.process_time() - c0
        print(json.dumps(out), flush=True)
        return
    if args.mode == "epoch":
        t0 = time.perf_counter()
        for a in range(0, n, BATCH):
            src.__getitems__(perm[a : a + BATCH])
        out["epoch_s"] = time.perf_counter() - t0
        mem1 = smaps()
        if args.hold:  # wait until every process of the node measurement is here
            print("READY", flush=True)
            sys.stdin.readline()
            mem1 = smaps()
        out["mem_before"], out["mem_after"] = mem0, mem1
        out["pickle_bytes"] = len(pickle.dumps(src))
        print(json.dumps(out), flush=True)
        return
    # Warm-up: one pass over a window of the order (every page it needs mapped, every
    # shard opened); then the window again and again, so that what is timed is the
    # loader's own work, not first touches of the page cache.
    window = min(n, args.window)
    n = window + BATCH
    for a in range(0, window, BATCH):
        src.__getitems__(perm[a : a + BATCH])
    done, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < args.seconds:
        done += step()
    out["rate"] = done / (time.perf_counter() - t0)
    out["rate_cpu"] = done / (time.process_time() - c0)
    print(json.dumps(out), flush=True)
    del np


# ------------------------------------------------------------------ the parent
def run_child(import_from: str, variant: str, directory: str, mode: str, **kw) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        variant,
        "--import-from",
        import_from,
        "--dir",
        directory,
        "--mode",
        mode,
    ]
    kw.setdefault("dir_root", os.path.dirname(directory))
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, PYTHONPATH=import_from)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode:
        raise RuntimeError(f"{cmd} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def node(import_from: str, directory: str, procs: int, n: int, main_heap: float | None) -> dict:
    """``procs`` worker-like processes (the source unpickled, as DataLoader workers get
    it) read a whole epoch each, all alive when measured. With ``main_heap``, the heap
    growth of a process that opens the dataset itself (a rank's main process), the node
    of 64 processes is 8 ranks of 1 main process and 7 workers."""
    sys.path.insert(0, import_from)
    import torchgrain as tg

    blob = os.path.join(os.path.dirname(directory), "node-source.pickle")
    with open(blob, "wb") as f:
        pickle.dump(tg.ArrayRecordSource(directory, codec="raw"), f)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "mapped",
        "--import-from",
        import_from,
        "--dir",
        directory,
        "--mode",
        "epoch",
        "--hold",
        "1",
        "--n",
        str(n),
        "--dir-root",
        os.path.dirname(directory),
        "--from-pickle",
        blob,
    ]
    env = dict(os.environ, PYTHONPATH=import_from)
    ps = [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(procs)
    ]
    for p in ps:
        assert p.stdout.readline().strip() == "READY"
    for p in ps:
        p.stdin.write("\n")
        p.stdin.flush()
    outs = [json.loads(p.stdout.read().strip().splitlines()[-1]) for p in ps]
    for p in ps:
        p.wait()
    index_pss = sum(o["mem_after"]["index_pss"] for o in outs)
    heap = [o["mem_after"]["anon_private"] - o["mem_before"]["anon_private"] for o in outs]
    one_index = max(o["mem_after"]["index_rss"] for o in outs)  # what one process maps
    worker = statistics.mean(heap)
    main = worker if main_heap is None else main_heap
    # The index file's pages are the page cache's: one copy per machine, whatever the
    # processes (the sum of their PSS, which this kernel estimates for large folios).
    shared = max(index_pss, one_index)
    total = {
        procs: shared + procs * worker,
        64: shared + 8 * main + 56 * worker,
    }
    one = one_index + main
    return {
        "processes": procs,
        "index_pss_sum_bytes": index_pss,
        "index_rss_one_process_bytes": one_index,
        "worker_heap_growth_bytes": summary(heap),
        "worker_heap_growth_per_record": worker / n,
        "rank_main_heap_growth_bytes": main,
        "node_total_vs_one_process": {p: t / one for p, t in total.items()},
        "model": "64 processes = 8 ranks x (1 main process that opens the dataset + 7 "
        "workers that unpickle it); the index counted once",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=6_400_000)
    p.add_argument("--shards", type=int, nargs="+", default=[8, 2048, 10_000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--window", type=int, default=1 << 20, help="records of the timed loop")
    p.add_argument("--dir", default="/tmp/scale-arrayrecord-bench")
    p.add_argument("--base", default=None, help="another torchgrain checkout to compare")
    p.add_argument("--node", type=int, default=8, help="processes of the node measurement")
    p.add_argument("--ab", action="store_true", help="small-data A/B against --base")
    p.add_argument("--keep", action="store_true", help="keep the generated data")
    p.add_argument("--name", default="many_shards", help="results/NAME.json")
    p.add_argument(
        "--parts", default="rates,memory,node", help="what to measure (rates, memory, node)"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--import-from", default=ROOT, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="rate", help=argparse.SUPPRESS)
    p.add_argument("--hold", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--codec", default="raw", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dir-root", default="", help=argparse.SUPPRESS)
    p.add_argument("--from-pickle", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.variant = args.child
        child(args)
        return
    sys.path.insert(0, ROOT)
    from benchmarks._common import describe_machine, write_json

    print(describe_machine(), flush=True)
    try:
        if args.ab:
            result = ab(args)
            write_json("many_shards_ab", result)
        else:
            result = scale(args)
            write_json(args.name, result)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


def scale(args: argparse.Namespace) -> dict:
    dirs = {}
    for s in args.shards:
        t0 = time.perf_counter()
        dirs[s] = build(os.path.join(args.dir, f"n{args.records}-s{s}"), args.records, s)
        print(f"data: {s} shards ready ({time.perf_counter() - t0:.0f} s)", flush=True)
    order_file(args.dir, args.records)
    build(os.path.join(args.dir, "warm"), 4096, 4)
    variants = {"mapped": ROOT, "memory": ROOT}
    if args.base:
        variants["base"] = args.base
    result: dict = {"records": args.records, "record_bytes": 16, "batch": BATCH}
    failed: dict[tuple[str, int], str] = {}
    if "rates" in args.parts:
        result.update(rate_rows(args, dirs, variants, failed))
    result["failed"] = {f"{v}/{s}": why for (v, s), why in failed.items()}
    if "memory" in args.parts:
        result.update(memory_rows(args, dirs, variants, failed))
    if "node" in args.parts:
        biggest = max(dirs)
        mem = result.get("memory", {}).get(f"mapped/{biggest}")
        main_heap = mem["heap_growth_per_record"] * args.records if mem else None
        result["node"] = node(ROOT, dirs[biggest], args.node, args.records, main_heap)
        result["node"]["shards"] = biggest
        print("node:", json.dumps(result["node"], indent=1), flush=True)
    if result.get("ratios"):
        print("\nratios (median [min, max] over rounds):")
        for k, v in result["ratios"].items():
            print(f"  {k:<52} {v['median']:.2f} [{v['min']:.2f}, {v['max']:.2f}]")
    return result


def rate_rows(
    args: argparse.Namespace,
    dirs: dict[int, str],
    variants: dict[str, str],
    failed: dict[tuple[str, int], str],
) -> dict:
    """Records per second, every (variant, dataset) once per round, rounds interleaved."""
    rates: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        for v, where in variants.items():
            for s, d in dirs.items():
                if (v, s) in failed:
                    continue
                try:
                    out = run_child(
                        where,
                        v,
                        d,
                        "rate",
                        seconds=args.seconds,
                        window=args.window,
                        n=args.records,
                    )
                except RuntimeError as e:  # the base checkout may not cope (open files)
                    failed[(v, s)] = str(e).strip().splitlines()[-1]
                    print(f"round {r} {v:<7} {s:>6} shards: failed: {failed[(v, s)]}", flush=True)
                    continue
                rates.setdefault((v, s), []).append(out)
                print(
                    f"round {r} {v:<7} {s:>6} shards: {out['rate']:>10,.0f} rec/s "
                    f"({out['rate_cpu']:,.0f}/CPU-s), open {out['open_s'] * 1e3:.0f} ms",
                    flush=True,
                )
    result: dict = {"rates": {}}
    for (v, s), outs in rates.items():
        result["rates"][f"{v}/{s}"] = {
            "rate": summary([o["rate"] for o in outs]),
            "rate_cpu": summary([o["rate_cpu"] for o in outs]),
            "open_s": summary([o["open_s"] for o in outs]),
        }
    ratios = {}
    smallest = min(dirs)
    for v in variants:
        for s in dirs:
            if s == smallest or (v, s) in failed or (v, smallest) in failed:
                continue
            for key in ("rate", "rate_cpu"):
                per = [
                    a[key] / b[key]
                    for a, b in zip(rates[(v, s)], rates[(v, smallest)], strict=True)
                ]
                ratios[f"{v}: {s} vs {smallest} shards ({key})"] = summary(per)
    for s in dirs:
        for key in ("rate", "rate_cpu"):
            per = [
                a[key] / b[key]
                for a, b in zip(rates[("mapped", s)], rates[("memory", s)], strict=True)
            ]
            ratios[f"{s} shards: mapped vs in-memory index ({key})"] = summary(per)
    result["ratios"] = ratios
    return result


def memory_rows(
    args: argparse.Namespace,
    dirs: dict[int, str],
    variants: dict[str, str],
    failed: dict[tuple[str, int], str],
) -> dict:
    """Memory after one whole epoch, one fresh process per (variant, dataset)."""
    memory = {}
    for v, where in variants.items():
        for s, d in dirs.items():
            if (v, s) in failed:
                continue
            try:
                out = run_child(where, v, d, "epoch", n=args.records)
            except RuntimeError as e:
                failed[(v, s)] = str(e).strip().splitlines()[-1]
                print(f"memory {v:<7} {s:>6} shards: failed: {failed[(v, s)]}", flush=True)
                continue
            b, a = out["mem_before"], out["mem_after"]
            n = out["records"]
            memory[f"{v}/{s}"] = {
                "heap_growth_per_record": (a["anon_private"] - b["anon_private"]) / n,
                "uss_growth_per_record": (a["uss"] - b["uss"]) / n,
                "index_mapped_per_record": a["index_rss"] / n,
                "pickle_bytes": out["pickle_bytes"],
                "epoch_s": out["epoch_s"],
            }
            print(f"memory {v:<7} {s:>6} shards: {memory[f'{v}/{s}']}", flush=True)
    return {
        "memory": memory,
        "memory_baseline": "after reading a 4-shard dataset in the same process",
    }


def ab(args: argparse.Namespace) -> dict:
    if not args.base:
        raise SystemExit("--ab needs --base (the checkout to compare with)")
    cases = {
        "1KiB x 100k, 1 shard": build_small(os.path.join(args.dir, "ab-1k"), 100_000, 1024),
        "100KiB x 2k, 1 shard": build_small(os.path.join(args.dir, "ab-100k"), 2_000, 100 << 10),
        "16B x 1.6M, 8 shards": build(os.path.join(args.dir, "ab-8"), 1_600_000, 8),
    }
    sizes = {"1KiB x 100k, 1 shard": 100_000, "100KiB x 2k, 1 shard": 2_000}
    for n in (*sizes.values(), 1_600_000):
        order_file(args.dir, n)
    times: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        order = [("this", ROOT), ("base", args.base)]
        if r % 2:
            order.reverse()
        for case, d in cases.items():
            for v, where in order:
                codec = "raw" if case.startswith("16B") else "msgpack"
                out = run_child(
                    where, "mapped", d, "pass", codec=codec, n=sizes.get(case, 1_600_000)
                )
                times.setdefault((case, v), []).append(out)
                print(
                    f"round {r} {case:<22} {v}: {out['pass_s']:.2f} s "
                    f"({out['pass_cpu_s']:.2f} CPU-s)",
                    flush=True,
                )
    result: dict = {"rounds": args.rounds, "cases": {}}
    for case in cases:
        this, base = times[(case, "this")], times[(case, "base")]
        result["cases"][case] = {
            "speed_this_vs_base_wall": summary(
                [b["pass_s"] / a["pass_s"] for a, b in zip(this, base, strict=True)]
            ),
            "speed_this_vs_base_cpu": summary(
                [b["pass_cpu_s"] / a["pass_cpu_s"] for a, b in zip(this, base, strict=True)]
            ),
        }
    print("\nspeed of this checkout / base (median [min, max]; > 1: faster):")
    for case, v in result["cases"].items():
        w, c = v["speed_this_vs_base_wall"], v["speed_this_vs_base_cpu"]
        print(
            f"  {case:<22} wall {w['median']:.2f} [{w['min']:.2f}, {w['max']:.2f}]  "
            f"CPU {c['median']:.2f} [{c['min']:.2f}, {c['max']:.2f}]"
        )
    return result


if __name__ == "__main__":
    main()
