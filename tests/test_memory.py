"""Worker memory stays flat over a long epoch (copy-on-read safe, bounded caches)."""

import os

import numpy as np
import pytest
from torch.utils.data import DataLoader

import torchgrain as tg

N = 1_000_000
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def attach_rss(rec):
    # Sample the worker's resident set every 20,000 records.
    i = int(rec["i"])
    rss = _rss_bytes() if i % 20_000 == 0 else -1
    return {"i": i, "rss": rss, "pid": os.getpid()}


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_worker_rss_flat_over_a_million_records(tmp_path):
    tg.write_array_record(({"i": i} for i in range(N)), tmp_path, num_shards=4, group_size=64)
    src = tg.ArrayRecordSource(tmp_path)
    assert len(src) == N and src[N - 1]["i"] in range(N)  # read in the parent first
    ds = tg.Dataset(src).map(attach_rss)
    sampler = tg.GlobalShuffleSampler(ds, seed=0)
    loader = DataLoader(ds, batch_size=1000, sampler=sampler, num_workers=2)
    samples: dict[int, list[int]] = {}
    seen = np.zeros(N, dtype=bool)
    for batch in loader:
        seen[batch["i"].numpy()] = True
        for rss, pid in zip(batch["rss"].tolist(), batch["pid"].tolist()):
            if rss > 0:
                samples.setdefault(pid, []).append(rss)
    assert seen.all()  # every record exactly covered
    assert len(samples) == 2
    for pid, series in samples.items():
        assert len(series) >= 10
        # after warm-up (first 10% of the epoch), growth must stay under 10%
        start = series[max(1, len(series) // 10)]
        growth = (max(series) - start) / start
        assert growth < 0.10, f"worker {pid} RSS grew {100 * growth:.1f}%: {series}"


# ------------------------------------------------------------------ cache budget
# A whole shuffled epoch may grow a reading process by its cache_bytes plus this much
# (docs/parquet.md states it): Arrow's pool may keep up to 32 MiB of freed decode buffers
# (torchgrain.sources.parquet.pool.RELEASE_BYTES), a row group being converted exists
# twice for a moment (decoded and converted, about 23 MiB for the 10,000 rows of 1 KiB
# here), and the allocators keep some slack.
BUDGET_SLACK = 64 << 20
CACHE_BYTES = 224 << 20  # holds the whole epoch's decoded rows (about 200 MB)
ROWS = 150_000

_EPOCH = r"""
import json, os, sys
import numpy as np, torch
import torchgrain as tg

def mem():
    out = {"uss": 0, "pss": 0}
    pids = [os.getpid()]
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
            pids += [int(c) for c in f.read().split()]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                kb = {l.split(":")[0]: int(l.split()[1]) for l in f.read().splitlines()[1:]}
        except OSError:
            continue
        out["uss"] += (kb["Private_Clean"] + kb["Private_Dirty"]) * 1024
        out["pss"] += kb["Pss"] * 1024
    return out

kind, path, cache_bytes, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if kind == "parquet":
    src = tg.ParquetSource(path, cache_bytes=cache_bytes)
else:
    src = tg.ArrayRecordSource(path, cache_bytes=cache_bytes)
ds = tg.Dataset(src)
loader = torch.utils.data.DataLoader(
    ds, batch_size=256, sampler=tg.GlobalShuffleSampler(ds, seed=0), num_workers=workers
)
key = "pss" if workers else "uss"
seen = np.zeros(len(src), dtype=bool)
base = mem()[key]
peak = 0
for b, batch in enumerate(loader):
    seen[batch["id"].numpy()] = True
    if b % 8 == 0 or b == len(loader) - 1:
        peak = max(peak, mem()[key] - base)
print(json.dumps({"growth": peak, "all": bool(seen.all())}))
"""


@pytest.fixture(scope="module")
def budget_data(tmp_path_factory):
    """The same 150,000 records of 1 KiB as Parquet (15 row groups of 10,000) and as
    ArrayRecord (16 records per zstd chunk)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("budget")
    rng = np.random.default_rng(0)
    payload = [rng.bytes(1024) for _ in range(ROWS)]
    os.makedirs(root / "parquet")
    table = pa.table({"id": pa.array(np.arange(ROWS)), "data": pa.array(payload, pa.binary())})
    pq.write_table(table, root / "parquet" / "data.parquet", row_group_size=10_000)
    tg.write_array_record(
        ({"id": i, "data": payload[i]} for i in range(ROWS)), root / "arrayrecord", group_size=16
    )
    return root


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux /proc")
@pytest.mark.parametrize("kind, workers", [("parquet", 0), ("arrayrecord", 0), ("parquet", 2)])
def test_epoch_memory_within_cache_budget(budget_data, kind, workers):
    """A global-shuffle epoch, in a fresh process, grows it (USS; with workers, the sum
    of PSS over the process and its workers) by at most cache_bytes + BUDGET_SLACK per
    reading process, as measured by the kernel, not by the cache's own accounting."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _EPOCH,
            kind,
            str(budget_data / kind),
            str(CACHE_BYTES),
            str(workers),
        ],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["all"], "the epoch missed records"
    readers = max(1, workers)
    limit = readers * (CACHE_BYTES + BUDGET_SLACK)
    assert result["growth"] <= limit, (
        f"{kind}, {workers} workers: grew {result['growth'] / 2**20:.0f} MiB, more than "
        f"{readers} x (cache_bytes {CACHE_BYTES >> 20} MiB + {BUDGET_SLACK >> 20} MiB)"
    )
