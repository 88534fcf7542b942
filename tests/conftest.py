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
# multi-threaded, use of fork() may lead to deadlocks in the child"). torchgrain's
# threads stop around a fork (torchgrain/io/process.py); a warning of that kind in the
# test process fails the run. (Turning it into an error with -W does not work: the
# interpreter swallows an error raised there.)
_FORK_WARNING = "use of fork() may lead to deadlocks"
_fork_warnings: list[str] = []


def pytest_warning_recorded(warning_message, when, nodeid, location):
    if _FORK_WARNING in str(warning_message.message):
        _fork_warnings.append(f"{nodeid or location}: {warning_message.message}")


def pytest_sessionfinish(session, exitstatus):
    if _fork_warnings:
        print("\nforked with threads alive:\n  " + "\n  ".join(_fork_warnings))
        session.exitstatus = 1
