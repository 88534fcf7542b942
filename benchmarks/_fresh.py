"""Fresh-process measurements: one whole shuffled pass per reader, each in a new process.

What a DataLoader worker sees in its first epoch is a cold process: nothing imported
beyond what the script imports, no reader opened, no decompression context made, no
page of the file mapped yet (the file itself is in the page cache, as it is after the
first epoch of any real job). :func:`run_fresh` starts one ``python benchmarks/_fresh.py``
per (round, reader), rounds interleaved, and collects what each child reports.

A child imports numpy, torch and torchgrain (not timed: every reader pays it alike),
builds the batches of the pass (not timed), then times opening its reader and reading
every record once in the given order (timed: wall and CPU seconds, the CPU of
DataLoader worker processes included).

    python benchmarks/_fresh.py cpp_single --file F --order shuffle   # one child, by hand
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH = 256

#: reader name -> what it does (the table's wording)
READERS = {
    "cpp_single": "C++ read(i, i+1) loop",
    "cpp_batched": "C++ read(indices), batches of 256",
    "native_single": "native ArrayRecordFile.read([i]) loop",
    "native_batched": "native ArrayRecordFile.read(batch of 256)",
    "source_raw": "ArrayRecordSource(codec='raw').__getitems__",
    "source_msgpack": "ArrayRecordSource (msgpack) __getitems__",
    "loader_0": "Dataset + DataLoader, 0 workers",
    "loader_2": "Dataset + DataLoader, 2 workers",
}


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def child(reader: str, file: str | None, directory: str | None, n: int | None) -> dict:
    """One timed pass in this (new) process; see the module docstring."""
    import numpy as np

    sys.path.insert(0, os.path.dirname(HERE))
    import torch  # imported before timing, as in a training script

    import torchgrain as tg

    if file is None:
        assert directory is not None
        file = tg.ArrayRecordSource(directory, codec="raw").paths[0]
    if n is None:
        from torchgrain.formats.arrayrecord_file import ArrayRecordFile

        with ArrayRecordFile(file) as f:
            n = f.num_records
    # The GlobalShuffleSampler's epoch-0 order, as the DataLoader rows draw it.
    perm = tg.GlobalShuffleSampler(n, seed=0, num_replicas=1, rank=0).indices(0, n)
    batches = [perm[k : k + BATCH].tolist() for k in range(0, n, BATCH)]
    del np

    t0, c0 = time.perf_counter(), _cpu()
    if reader == "cpp_single":
        from array_record.python.array_record_module import ArrayRecordReader

        r = ArrayRecordReader(file, "readahead_buffer_size:0,max_parallelism:0")
        read = r.read
        for b in batches:
            for i in b:
                read(i, i + 1)
    elif reader == "cpp_batched":
        from array_record.python.array_record_module import ArrayRecordReader

        r = ArrayRecordReader(file, "readahead_buffer_size:0")
        for b in batches:
            r.read(b)
    elif reader == "native_single":
        from torchgrain.formats.arrayrecord_file import ArrayRecordFile

        f = ArrayRecordFile(file)
        read = f.read
        for b in batches:
            for i in b:
                read([i])
    elif reader == "native_batched":
        from torchgrain.formats.arrayrecord_file import ArrayRecordFile

        f = ArrayRecordFile(file)
        for b in batches:
            f.read(b)
    elif reader in ("source_raw", "source_msgpack"):
        src = tg.ArrayRecordSource(directory, codec=reader.split("_")[1])
        for b in batches:
            src.__getitems__(b)
    elif reader in ("loader_0", "loader_2"):
        workers = int(reader[-1])
        ds = tg.Dataset(tg.ArrayRecordSource(directory))
        sampler = tg.GlobalShuffleSampler(ds, seed=0)
        loader = torch.utils.data.DataLoader(
            ds, batch_size=BATCH, sampler=sampler, num_workers=workers, collate_fn=_keep
        )
        got = sum(len(b) for b in loader)
        assert got == n, (got, n)
        del loader  # workers joined: their CPU is in RUSAGE_CHILDREN
    else:
        raise ValueError(f"unknown reader {reader!r}")
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    return {"reader": reader, "records": n, "seconds": wall, "cpu_seconds": cpu}


def _keep(batch: list) -> list:
    return batch


def run_fresh(
    readers: Sequence[str],
    rounds: int,
    *,
    file: str | None = None,
    directory: str | None = None,
    timeout: float = 600.0,
) -> dict[str, list[dict]]:
    """Each reader's pass in its own new process, ``rounds`` times, rounds interleaved.

    Returns reader -> the children's reports, one per round.
    """
    out: dict[str, list[dict]] = {r: [] for r in readers}
    args = (["--file", file] if file else []) + (["--dir", directory] if directory else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.dirname(HERE), env.get("PYTHONPATH")])
    )
    for k in range(rounds):
        for reader in readers:
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), reader, *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"fresh-process {reader} failed:\n{proc.stderr[-3000:]}")
            rep = json.loads(proc.stdout.strip().splitlines()[-1])
            out[reader].append(rep)
            print(
                f"  round {k + 1}/{rounds} fresh {READERS[reader]:<46} "
                f"{rep['records'] / rep['seconds']:>10,.0f} rec/s "
                f"({rep['records'] / rep['cpu_seconds']:,.0f}/CPU-s)",
                flush=True,
            )
    return out


def median_rate(reports: list[dict], key: str = "seconds") -> float:
    """Median records/s over rounds (wall seconds, or ``cpu_seconds``)."""
    return statistics.median(r["records"] / r[key] for r in reports)


def median_ratio(a: list[dict], b: list[dict], key: str = "seconds") -> float:
    """Median over rounds of (rate of ``a``) / (rate of ``b``), paired by round."""
    return statistics.median(y[key] / x[key] for x, y in zip(a, b))


def rows(
    results: dict[str, list[dict]], base: str, column: str = "x C++ loop"
) -> list[dict[str, Any]]:
    """Table rows of fresh-process results: median records/s (wall and per CPU second)
    and the median per-round ratio to reader ``base`` (in ``column`` and ``column (CPU)``).
    """
    out = []
    for reader, reps in results.items():
        out.append(
            {
                "reader": "fresh process: " + READERS[reader],
                "records/s": median_rate(reps),
                column: median_ratio(reps, results[base]),
                "CPU rec/s": median_rate(reps, "cpu_seconds"),
                f"{column} (CPU)": median_ratio(reps, results[base], "cpu_seconds"),
                "rounds": len(reps),
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("reader", choices=sorted(READERS))
    p.add_argument("--file", default=None, help="an ArrayRecord file")
    p.add_argument("--dir", default=None, help="a torchgrain dataset directory (one shard)")
    p.add_argument("--records", type=int, default=None)
    a = p.parse_args()
    print(json.dumps(child(a.reader, a.file, a.dir, a.records)))


if __name__ == "__main__":
    main()
