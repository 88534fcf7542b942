"""Shared fixtures: small datasets generated into tmp dirs (nothing is downloaded)."""

from __future__ import annotations

import contextlib
import gc
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from tests import _procs

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


@pytest.fixture(scope="session")
def moto_s3():
    """One moto S3 server for the session (it takes seconds to start): ``(client, endpoint)``.

    Tests create their own buckets in it.
    """
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    from tests.servers import start_moto_s3

    server, endpoint = start_moto_s3()
    yield boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1"), endpoint
    server.stop()


# ------------------------------------------------------------ no process left behind
# Seconds the processes a test started get to exit once the last test is done.
_STRAGGLER_GRACE = 20.0


def pytest_configure(config):
    # Orphans (a killed job's helpers) become our children, not init's: the check at the
    # end of the run finds them too.
    if _procs.supported():
        _procs.become_subreaper()


def _own_mp_helpers() -> set[int]:
    """This process's multiprocessing fork server and resource tracker: they serve it
    until it exits (their pipes from it close then), so they may be running now."""
    pids = set()
    with contextlib.suppress(Exception):
        from multiprocessing import forkserver, resource_tracker

        pids.add(forkserver._forkserver._forkserver_pid)
        pids.add(resource_tracker._resource_tracker._pid)
    return pids - {None}


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if processes it started are still running (naming them), after a
    grace period; then kill them, so that the run leaves nothing behind either way."""
    if not _procs.supported() or hasattr(session.config, "workerinput"):
        # An xdist worker reports only what it was asked to run: a leak found here would
        # be lost. What it leaves behind becomes the controller's (a subreaper, its
        # parent) when it exits, and the controller's check names it.
        return
    gc.collect()  # loaders that only a reference cycle still holds stop their workers now
    me = os.getpid()

    def leftovers():
        helpers = _own_mp_helpers()
        return [p for p in _procs.descendants(me) if p.pid not in helpers]

    running = _procs.wait_gone(leftovers, _STRAGGLER_GRACE)
    if not running:
        return
    names = [_procs.describe(p.pid) for p in running]
    _procs.kill(running)
    _procs.wait_gone(leftovers, 10.0)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [
        f"{len(names)} process(es) started by the tests were still running "
        f"{_STRAGGLER_GRACE:.0f} s after the last test (killed now):",
        *(f"  {n}" for n in names),
    ]
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "processes left behind", red=True)
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=True)
        else:
            print(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
