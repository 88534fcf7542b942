"""Building the node index of ArrayRecord files written by other tools: time and memory.

The first process on a machine that opens ArrayRecord files without torchgrain's
manifest (written by array_record's own writer, TFDS, Grain...) reads every shard's
footer and builds the node-shared index file (:mod:`torchgrain.sources.node_index`);
every other process of the machine waits for it, then maps the file. This measures that
build in a fresh process: seconds, the peak resident memory of the building process
beyond the interpreter's (Linux ``VmHWM``, reset after the imports), and what it keeps
after the index is published: its anonymous memory (private heap) and its mapped file
pages (the index file's pages it touched: page cache, shared with every other process).

The data: ``--records`` one-byte records (the most footer entries per byte) in
``--shards`` shards, ``group_size:1`` (zstd, array_record's default), written by the
C++ writer in fresh processes. ``--base`` measures another checkout (e.g. the code
before the streaming build) on the same files, rounds interleaved.

    python benchmarks/index_build.py --records 30000000 --shards 64 --base /path/to/old
    python benchmarks/index_build.py --records 2000000 --shards 16 --rounds 1  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPTIONS = "group_size:1"


def write_shards(directory: str, first: int, last: int, per: list[int]) -> None:
    """Shards ``first..last-1`` (their record counts ``per``), by array_record's writer.

    Runs in a process of its own, which never forks after importing array_record."""
    from array_record.python.array_record_module import ArrayRecordWriter

    for k in range(first, last):
        path = os.path.join(directory, f"part-{k:05d}.array_record")
        tmp = path + ".tmp"
        w = ArrayRecordWriter(tmp, OPTIONS)
        rec = bytes([k % 256])
        for _ in range(per[k]):
            w.write(rec)
        w.close()
        os.replace(tmp, path)


def prepare(directory: str, records: int, shards: int, workers: int) -> None:
    per = [records // shards + (k < records % shards) for k in range(shards)]
    stamp = os.path.join(directory, "records.json")
    want = {"records": records, "shards": shards, "options": OPTIONS}
    try:
        with open(stamp) as f:
            if json.load(f) == want:
                return
    except (OSError, ValueError):
        pass
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    step = -(-shards // workers)
    cut = json.dumps(per)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--write",
                directory,
                str(a),
                str(min(a + step, shards)),
                cut,
            ]
        )
        for a in range(0, shards, step)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("writing the shards failed")
    with open(stamp, "w") as f:
        json.dump(want, f)


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def child(directory: str, import_from: str) -> None:
    """Build the index in this fresh process; print one JSON line."""
    sys.path.insert(0, import_from)
    import glob
    import time
    import warnings

    import torchgrain  # noqa: F401 - imported before the baseline is taken
    from torchgrain.sources.node_index import arrayrecord_index

    warnings.simplefilter("ignore")
    paths = sorted(glob.glob(os.path.join(directory, "*.array_record")))
    index_dir = tempfile.mkdtemp(prefix="tg-index-build-")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak from here on
        rss, anon, mapped = _status("VmRSS"), _status("RssAnon"), _status("RssFile")
        t0 = time.perf_counter()
        ix = arrayrecord_index(paths, index_dir=index_dir)
        seconds = time.perf_counter() - t0
        n = int(ix.rec_base[-1])
        out = {
            "records": n,
            "shards": len(paths),
            "seconds": round(seconds, 2),
            "peak_rss_mib": round(_status("VmHWM") - rss, 1),
            "kept_anon_mib": round(_status("RssAnon") - anon, 1),
            "kept_file_mib": round(_status("RssFile") - mapped, 1),
            "index_file_mib": round(os.path.getsize(ix.path) / 2**20, 1),
        }
        out["peak_bytes_per_record"] = round(out["peak_rss_mib"] * 2**20 / max(n, 1), 1)
        out["kept_anon_bytes_per_record"] = round(out["kept_anon_mib"] * 2**20 / max(n, 1), 1)
        print(json.dumps(out))
    finally:
        shutil.rmtree(index_dir, ignore_errors=True)


def run(directory: str, import_from: str) -> dict:
    p = subprocess.run(
        [sys.executable, __file__, "--child", directory, import_from],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=import_from, NO_ALBUMENTATIONS_UPDATE="1"),
    )
    if p.returncode:
        raise SystemExit(f"the build failed ({import_from}):\n{p.stderr[-3000:]}")
    row = json.loads(p.stdout.strip().splitlines()[-1])
    row["progress_lines"] = sum(
        ln.startswith("torchgrain: indexing") for ln in p.stderr.splitlines()
    )
    return row


def main() -> None:
    if sys.argv[1:2] == ["--write"]:
        d, a, b, per = sys.argv[2:6]
        write_shards(d, int(a), int(b), json.loads(per))
        return
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=30_000_000)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "torchgrain-index-build"))
    ap.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--base", help="another checkout of torchgrain to measure too")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="index_build", help="results/NAME.json ('' : none)")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from benchmarks._common import describe_machine, print_table, write_json

    print(describe_machine())
    prepare(args.dir, args.records, args.shards, args.workers)
    variants = [("this", ROOT)] + ([("base", os.path.abspath(args.base))] if args.base else [])
    rows = []
    for r in range(args.rounds):
        for name, where in variants:
            row = {"variant": name, "round": r, **run(args.dir, where)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    cols = ["variant", "round", "records", "shards", "seconds", "peak_rss_mib"]
    cols += ["kept_anon_mib", "kept_file_mib", "index_file_mib", "progress_lines"]
    if rows:
        print_table(rows, cols)
    if args.out:
        payload = {"records": args.records, "shards": args.shards, "rows": rows}
        if args.base:
            git = ["git", "-C", args.base, "rev-parse", "--short", "HEAD"]
            p = subprocess.run(git, capture_output=True, text=True)
            payload["base_commit"] = p.stdout.strip() or None
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
