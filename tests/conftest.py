"""Shared fixtures: small datasets generated into tmp dirs (nothing is downloaded)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("ci")

# Keep worker start-up cheap and reproducible on small CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# albumentations otherwise checks online for a newer version at every import
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")


def make_records(n: int, *, seed: int = 0, image_shape=(4, 4, 3)) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.integers(0, 255, image_shape, dtype=np.uint8),
            "label": i % 7,
            "id": f"r{i}",
            "score": float(i) / 3,
        }
        for i in range(n)
    ]


@pytest.fixture
def small_dataset(tmp_path):
    """100 records in 3 shards, returns (directory, records)."""
    import torchgrain as tg

    recs = make_records(100)
    d = tmp_path / "ds"
    tg.write_array_record(recs, d, num_shards=3)
    return str(d), recs


# Python >= 3.12 warns when a process with threads forks ("This process ... is
# multi-threaded, use of fork() may lead to deadlocks in the child"). torchgrain's own
# threads stop around a fork (torchgrain/io/process.py; tests/test_fork_safety.py checks
# it), but the warning counts every thread of the process: numpy's BLAS pool, pyarrow's
# jemalloc background thread, array_record's writer pool (in a process that wrote shards),
# and torch's queue feeder threads of another DataLoader's live workers. The run reports
# how many forks warned; with TORCHGRAIN_TEST_FORK_WARNINGS=error it fails on them.
# (An error filter, -W error, does not work: the interpreter swallows an error raised there.)
_FORK_WARNING = "use of fork() may lead to deadlocks"
_fork_warnings: list[str] = []


def pytest_warning_recorded(warning_message, when, nodeid, location):
    if _FORK_WARNING in str(warning_message.message):
        _fork_warnings.append(nodeid or str(location))


def pytest_sessionfinish(session, exitstatus):
    if not _fork_warnings:
        return
    tests = sorted(set(_fork_warnings))
    print(f"\n{len(_fork_warnings)} forks with threads alive, in {len(tests)} tests")
    if os.environ.get("TORCHGRAIN_TEST_FORK_WARNINGS") == "error":
        print("  " + "\n  ".join(tests))
        session.exitstatus = 1
