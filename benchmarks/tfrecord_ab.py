"""Paired A/B of TFRecordSource between two checkouts: every read path a user reaches.

Each case is timed in a fresh process importing torchgrain from checkout A or B, rounds
interleaved (A, B / B, A ...), after an untimed first round that builds each checkout's
offsets index; the data in the page cache:

* ``global``: 200k ``tf.train.Example`` records (64 bytes and a label) in 8 files, a
  global shuffle, ``src.__getitems__`` of batches of 256 over the whole epoch;
* ``columns``: the same batches through ``src.read_columns``;
* ``single``: 20,000 ``src[i]`` in a shuffled order;
* ``remote-global``: 16 files of 512 raw 1 KiB records served over HTTP on 127.0.0.1
  (``_fast_store.py``, 10 ms added per request), a global shuffle in batches of 256.

Prints each case's median B/A ratio of records/s and of the process's CPU seconds over
rounds (the ratio within a round) with their ranges, and writes
``results/<--json-name>.json``. On a busy 2-core machine a rate ratio >= ~0.95 reads as
"no slower".

Run: ``python benchmarks/tfrecord_ab.py --a /path/to/baseline [--b .] [--rounds 4]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import describe_machine, print_table, write_json  # noqa: E402

CASES = ("global", "columns", "single", "remote-global")

CHILD = r"""
import json, os, resource, sys, time, warnings
warnings.simplefilter("ignore")
root, case, data, index_dir, url = sys.argv[1:6]
sys.path.insert(0, root)
import numpy as np
import torchgrain as tg

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

if case == "remote-global":
    src = tg.TFRecordSource(url, codec="raw", index_dir=index_dir)
else:
    src = tg.TFRecordSource(os.path.join(data, "local"), index_dir=index_dir)
order = np.random.default_rng(0).permutation(len(src))
if case == "single":
    idx = order[:20000].tolist()
    for i in idx[:2000]:
        src[i]
    t0, c0 = time.perf_counter(), cpu()
    for i in idx:
        src[i]
    n = len(idx)
else:
    batches = [order[i : i + 256].tolist() for i in range(0, len(order), 256)]
    read = src.read_columns if case == "columns" else src.__getitems__
    for b in batches[:10]:
        read(b)
    t0, c0 = time.perf_counter(), cpu()
    for b in batches:
        read(b)
    n = len(order)
print(json.dumps({"records": n, "seconds": time.perf_counter() - t0, "cpu": cpu() - c0}))
"""


def write_data(root: str, checkout: str) -> None:
    sys.path.insert(0, checkout)
    import numpy as np

    from torchgrain.formats.tf_example import encode_tf_example
    from torchgrain.formats.tfrecord import write_tfrecord

    rng = np.random.default_rng(1)
    os.makedirs(os.path.join(root, "local"))
    os.makedirs(os.path.join(root, "remote"))
    for f in range(8):
        recs = [encode_tf_example({"x": rng.bytes(64), "label": [i]}) for i in range(25_000)]
        write_tfrecord(recs, os.path.join(root, "local", f"p{f}.tfrecord"))
    for f in range(16):
        recs = [rng.bytes(1024) for _ in range(512)]
        write_tfrecord(recs, os.path.join(root, "remote", f"p{f}.tfrecord"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="checkout A (the baseline)")
    p.add_argument("--b", default=os.path.dirname(HERE), help="checkout B")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--json-name", default="tfrecord_ab")
    args = p.parse_args()
    cases = args.cases.split(",")
    data = tempfile.mkdtemp(prefix="tfrecord-ab-")
    write_data(data, args.b)
    store = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "_fast_store.py"), os.path.join(data, "remote")],
        stdout=subprocess.PIPE,
        text=True,
    )
    url = store.stdout.readline().strip()  # type: ignore[union-attr]
    urllib.request.urlopen(url + "/__latency?s=0.01").read()
    got: dict[str, dict[str, list[dict]]] = {c: {"A": [], "B": []} for c in cases}
    try:
        for r in range(args.rounds + 1):  # round 0: each checkout builds its index
            for case in cases:
                pairs = [("A", args.a), ("B", args.b)]
                for tag, root in pairs if r % 2 == 0 else pairs[::-1]:
                    index_dir = os.path.join(data, f"index-{tag}")
                    cmd = [sys.executable, "-c", CHILD, root, case, data, index_dir, url + "/"]
                    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                    if out.returncode:
                        raise SystemExit(f"{case} on {root} failed:\n{out.stderr[-3000:]}")
                    if r:
                        got[case][tag].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        store.kill()
    rows, summary = [], {}
    for case in cases:
        a, b = got[case]["A"], got[case]["B"]
        rate = [(y["records"] / y["seconds"]) / (x["records"] / x["seconds"]) for x, y in zip(a, b)]
        cpu = [y["cpu"] / x["cpu"] for x, y in zip(a, b)]
        summary[case] = {
            "A_records_per_s": statistics.median(x["records"] / x["seconds"] for x in a),
            "B_records_per_s": statistics.median(y["records"] / y["seconds"] for y in b),
            "rate_B_over_A": statistics.median(rate),
            "rate_range": [min(rate), max(rate)],
            "cpu_B_over_A": statistics.median(cpu),
            "cpu_range": [min(cpu), max(cpu)],
            "rounds": {"A": a, "B": b},
        }
        s = summary[case]
        rows.append(
            {
                "case": case,
                "A rec/s": f"{s['A_records_per_s']:,.0f}",
                "B rec/s": f"{s['B_records_per_s']:,.0f}",
                "rate B/A": f"{s['rate_B_over_A']:.3f} ({min(rate):.2f}-{max(rate):.2f})",
                "cpu B/A": f"{s['cpu_B_over_A']:.3f} ({min(cpu):.2f}-{max(cpu):.2f})",
            }
        )
    print(describe_machine())
    print(f"A = {args.a}\nB = {args.b}")
    print_table(rows, ["case", "A rec/s", "B rec/s", "rate B/A", "cpu B/A"])
    write_json(args.json_name, {"a": args.a, "b": args.b, "cases": summary})


if __name__ == "__main__":
    main()
