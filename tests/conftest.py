"""Shared fixtures: small datasets generated into tmp dirs (nothing is downloaded)."""

from __future__ import annotations

import contextlib
import gc
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from tests import _procs

# Scripts run as programs by the tests, never imported (``--doctest-modules`` would import
# them): the deadlock scripts fork and exit at import, the stack-dump hook is a
# sitecustomize for the test jobs.
collect_ignore = ["_deadlocks", "_stack_dumps"]

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


@pytest.fixture(autouse=True)
def _decoded_cache_ignores_the_hosts_free_space(monkeypatch):
    """The decoded Parquet cache leaves 5% of its disk (at most 8 GiB) free by default: on
    a test host whose disk is that full, it would store nothing and the tests of what it
    stores would fail. Tests of that floor set ``min_free_bytes`` themselves; processes a
    test starts from scratch (spawned pools, scripts) pass ``min_free_bytes=0``."""
    from torchgrain.sources.parquet import decoded_cache

    monkeypatch.setattr(decoded_cache, "default_min_free_bytes", lambda disk_total: 0)


@pytest.fixture(autouse=True)
def _no_remote_file_pinned_by_an_earlier_test():
    """A process remembers each remote file's version (ETag, size) by URL and refuses a
    file that changed (412 to If-Match). A test's server on 127.0.0.1 may get the port an
    earlier test's server had, and serve other files at the same URLs: each test starts
    as a fresh process would, with no file pinned."""
    from torchgrain.io import responses

    responses._PINS.clear()
    yield
    responses._PINS.clear()


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


def _report_fork_warnings(session) -> None:
    if not _fork_warnings:
        return
    tests = sorted(set(_fork_warnings))
    print(f"\n{len(_fork_warnings)} forks with threads alive, in {len(tests)} tests")
    if os.environ.get("TORCHGRAIN_TEST_FORK_WARNINGS") == "error":
        print("  " + "\n  ".join(tests))
        session.exitstatus = 1


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
    """This process's multiprocessing fork server and resource tracker, and torch's shared
    memory manager (started by the ``file_system`` sharing strategy): they serve it until
    it exits (their connections from it close then), so they may be running now."""
    pids = set()
    with contextlib.suppress(Exception):
        from multiprocessing import forkserver, resource_tracker

        pids.add(forkserver._forkserver._forkserver_pid)
        pids.add(resource_tracker._resource_tracker._pid)
    for p in _procs.descendants(os.getpid()):
        with contextlib.suppress(OSError), open(f"/proc/{p.pid}/comm") as f:
            # (comm is cut to 15 characters: "torch_shm_manag")
            if p.ppid == os.getpid() and "torch_shm_manager".startswith(f.read().strip()):
                pids.add(p.pid)
    return pids - {None}


def _report_hung_jobs(session) -> None:
    """Jobs that hung once and passed when run again (tests/_procs.py
    ``run_job_again_if_hung``), with the stacks of every process of the hung run."""
    if not _procs.hung_jobs:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter is not None else print
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", f"{len(_procs.hung_jobs)} job(s) hung once, passed when run again")
    for cmd, stacks in _procs.hung_jobs:
        write(f"--- {cmd[:300]}")
        write(stacks)
    if os.environ.get("TORCHGRAIN_TEST_HANGS") == "error":
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if processes it started are still running (naming them), after a
    grace period; then kill them, so that the run leaves nothing behind either way.
    Also reports the forks that warned of threads alive (see above) and the jobs that
    hung once."""
    _report_fork_warnings(session)
    _report_hung_jobs(session)
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
