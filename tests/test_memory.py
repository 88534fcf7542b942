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
