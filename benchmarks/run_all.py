"""Run every benchmark in this directory, one after another, each in its own process.

Each ``benchmarks/*.py`` script (except this one and the ``_``-prefixed helpers) runs
with its default arguments, which are sized so that the whole set finishes in about
10-15 minutes on a 2-core machine, plus about an hour for the comparisons with other loaders
(``peers``, ``peers_remote``), which run in their own virtualenv ``.venv-peers`` that
``scripts/setup_peers.sh`` makes first. Every script writes its own
``benchmarks/results/NAME.json`` (and PNGs where it draws one); this one adds
``benchmarks/results/run_all.json``: which scripts ran, how long each took, and whether
it succeeded.

A benchmark that measures a library in an environment of its own first runs the script
that makes that environment (``SETUP``; seconds when it exists). If the setup fails the
benchmark still runs, without that library, and the failure is recorded.

Run:   python benchmarks/run_all.py                 (or: make bench)
       python benchmarks/run_all.py --only pipeline_lessons end_to_end
       python benchmarks/run_all.py --skip sampler --timeout 900
       python benchmarks/run_all.py --no-setup      (use only the environments already made)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import describe_machine, print_table, write_json

HERE = Path(__file__).resolve().parent

# The order they run in (scripts not named here run afterwards, alphabetically), and
# arguments that keep a script's run short where its defaults are sized for a big box.
ORDER = ("pipeline_lessons", "end_to_end", "random_access", "native_reader", "map_batch")
ARGS: dict[str, list[str]] = {"scale": ["--scale", "small"]}
# Environments a benchmark needs beside the main one, made before it runs: torchvision
# for the augmentation benchmark (its torch build must match, several GB, kept apart).
SETUP: dict[str, list[str]] = {
    "augmentation": ["bash", "scripts/setup_torchvision.sh"],
    # scale's measurements run in .venv-peers when it exists (HF datasets and Grain
    # beside torchgrain, one interpreter for all), else here without those two.
    "scale": ["bash", "scripts/setup_peers.sh"],
}
# Scripts that run in their own virtualenv, made (or checked) by a setup script first:
# the peers comparison needs loaders whose pins clash with the main environment.
VENVS: dict[str, tuple[str, str]] = {
    "peers": (".venv-peers", "scripts/setup_peers.sh"),
    "peers_remote": (".venv-peers", "scripts/setup_peers.sh"),
}
# Seconds allowed where a script needs more than --timeout.
TIMEOUTS: dict[str, float] = {"peers": 3600.0, "peers_remote": 3600.0, "scale": 3600.0}
# Scripts here that are not benchmarks (run them by hand, as their docstrings say).
NOT_BENCHMARKS = {"ddp_train": "a DDP training example, run with torchrun"}


def discover() -> list[str]:
    names = sorted(
        p.stem
        for p in HERE.glob("*.py")
        if not p.stem.startswith("_") and p.stem != "run_all" and p.stem not in NOT_BENCHMARKS
    )
    return [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", help="run just these (names without .py)")
    p.add_argument("--skip", nargs="*", default=[], help="leave these out")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per benchmark")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument(
        "--no-setup", action="store_true", help="don't make the environments in SETUP first"
    )
    args = p.parse_args(argv)

    names = [n for n in discover() if (not args.only or n in args.only) and n not in args.skip]
    if args.list:
        print("\n".join(names))
        return 0
    unknown = set(args.only or ()) - set(discover())
    if unknown:
        print(f"run_all: no benchmark named {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    print(f"machine: {describe_machine()}")
    rows = []
    root = str(HERE.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name in names:
        python = sys.executable
        setup = "" if args.no_setup or name not in SETUP else run_setup(SETUP[name], root)
        t0 = time.perf_counter()
        if name in VENVS:
            venv, script = VENVS[name]
            if not args.no_setup:
                setup = run_setup(["bash", script], root)
            if not os.path.exists(os.path.join(root, venv, "bin", "python")):
                row = {"benchmark": name, "status": f"no {venv} ({script} makes it)"}
                rows.append({**row, "seconds": time.perf_counter() - t0, "setup": setup})
                continue
            python = os.path.join(root, venv, "bin", "python")
        cmd = [python, str(HERE / f"{name}.py"), *ARGS.get(name, [])]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        timeout = max(args.timeout, TIMEOUTS.get(name, 0.0))
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, timeout=timeout)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:.0f}s"
        row = {"benchmark": name, "status": status, "seconds": time.perf_counter() - t0}
        rows.append({**row, "setup": setup} if setup else row)
    print()
    print_table(rows, ["benchmark", "status", "seconds", "setup"])
    write_json("run_all", {"runs": rows})
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def run_setup(cmd: list[str], root: str) -> str:
    """Run a setup script; 'ok (N s)' or why it failed (the benchmark runs regardless)."""
    print(f"\n=== setup: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"failed: {type(e).__name__}: {e}"
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        print(f"run_all: {' '.join(cmd)} exited {proc.returncode}; running without it")
        return f"failed: exit {proc.returncode} after {took:.0f} s"
    return f"ok ({took:.0f} s)"


if __name__ == "__main__":
    sys.exit(main())
