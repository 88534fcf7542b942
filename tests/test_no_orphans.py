"""A job killed with SIGKILL takes every process it started with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import torchgrain as tg
from tests import _procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# How long the helpers of a killed conversion may take to notice and exit.
EXIT_WITHIN_S = 30.0

pytestmark = pytest.mark.skipif(not _procs.supported(), reason="needs Linux's /proc")


def test_a_killed_convert_takes_its_workers_fork_server_and_resource_tracker_with_it(tmp_path):
    rng = np.random.default_rng(0)
    recs = [{"x": rng.integers(0, 255, 20_000, dtype=np.uint8), "i": k} for k in range(1500)]
    tg.write_array_record(recs, tmp_path / "src", num_shards=4)
    cmd = [sys.executable, "-m", "torchgrain", "convert", str(tmp_path / "src"),
           str(tmp_path / "out"), "--num-shards", "300", "--workers", "2"]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "PYTHONPATH": ROOT},
        start_new_session=True,  # its own process group: everything it starts is in it
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # The converting process, its fork server and resource tracker, and two workers.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if sum(p.running for p in _procs.in_group(proc.pid)) >= 5:
                break
            time.sleep(0.05)  # polling /proc, not synchronising on time
        started = [_procs.describe(p.pid) for p in _procs.in_group(proc.pid) if p.running]
        assert proc.poll() is None, "the conversion ended before it could be killed"
        assert len(started) >= 5, started
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    left = _procs.wait_gone(lambda: _procs.in_group(proc.pid), EXIT_WITHIN_S)
    names = [_procs.describe(p.pid) for p in left]
    _procs.kill(left)
    assert names == [], f"still running {EXIT_WITHIN_S:.0f} s after the kill: {names}"


def test_a_job_past_its_deadline_fails_with_the_stacks_of_all_its_processes():
    """The framework tests' job runner: a hang ends in an error that shows where every
    process of the job (a forked child included) was stuck, and nothing is left running."""
    code = (
        "import os, time\n"
        "def parent_waits(): time.sleep(120)\n"
        "def child_waits(): time.sleep(120)\n"
        "child_waits() if os.fork() == 0 else parent_waits()\n"
    )
    with pytest.raises(_procs.JobTimeout) as raised:
        _procs.run_job([sys.executable, "-c", code], timeout=5, env=dict(os.environ))
    message = str(raised.value)
    assert "parent_waits" in message and "child_waits" in message, message
    assert message.count("most recent call first") >= 2, message
    pids = [
        int(line.split()[1].rstrip(":")) for line in message.splitlines() if line.startswith("pid ")
    ]
    assert len(pids) == 2, message
    assert not _procs.wait_gone(
        lambda: [p for p in _procs.snapshot().values() if p.pid in pids], 10
    )


def test_a_job_whose_processes_left_its_session_is_still_dumped_and_killed():
    """torchrun starts each rank in a session of its own: a hung rank is outside the job's
    process group but holds its output pipes. It is dumped and killed like the rest, and
    the timeout ends instead of waiting for the pipes to close."""
    code = (
        "import os, time\n"
        "def parent_waits(): time.sleep(120)\n"
        "def rank_waits(): time.sleep(120)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    rank_waits()\n"
        "else:\n"
        "    parent_waits()\n"
    )
    start = time.monotonic()
    with pytest.raises(_procs.JobTimeout) as raised:
        _procs.run_job([sys.executable, "-c", code], timeout=5, env=dict(os.environ))
    assert time.monotonic() - start < 60
    message = str(raised.value)
    assert "parent_waits" in message and "rank_waits" in message, message
    pids = [
        int(line.split()[1].rstrip(":")) for line in message.splitlines() if line.startswith("pid ")
    ]
    assert len(pids) == 2, message
    assert not _procs.wait_gone(
        lambda: [p for p in _procs.snapshot().values() if p.pid in pids], 10
    )


def test_a_rank_whose_launcher_exited_is_still_dumped_and_killed():
    """A rank in a session of its own whose launcher has exited is nobody's descendant in
    the job (the test process, a subreaper, adopts it) and holds the job's output pipes:
    it is found by the job's mark, dumped and killed, and the timeout ends."""
    code = (
        "import os, time\n"
        "def rank_waits(): time.sleep(120)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    rank_waits()\n"
    )
    start = time.monotonic()
    with pytest.raises(_procs.JobTimeout) as raised:
        _procs.run_job([sys.executable, "-c", code], timeout=5, env=dict(os.environ))
    assert time.monotonic() - start < 30
    message = str(raised.value)
    assert "rank_waits" in message, message
    pids = [
        int(line.split()[1].rstrip(":")) for line in message.splitlines() if line.startswith("pid ")
    ]
    assert len(pids) == 1, message
    assert not _procs.wait_gone(
        lambda: [p for p in _procs.snapshot().values() if p.pid in pids], 10
    )


def test_a_job_that_hangs_once_is_run_again_and_reported(tmp_path):
    """The first run hangs, the second finishes: the test passes, and the hang (with its
    stacks) is kept for the report at the end of the test run."""
    marker = tmp_path / "first-run"
    code = (
        "import os, sys, time\n"
        f"m = {str(marker)!r}\n"
        "if not os.path.exists(m):\n"
        "    open(m, 'w').close()\n"
        "    time.sleep(120)\n"
        "print('second run')\n"
    )
    before = len(_procs.hung_jobs)
    try:
        done = _procs.run_job_again_if_hung(
            [sys.executable, "-c", code], timeout=5, env=dict(os.environ)
        )
        assert done.returncode == 0 and done.stdout.strip() == "second run"
        assert len(_procs.hung_jobs) == before + 1
        assert "most recent call first" in _procs.hung_jobs[-1][1]
    finally:
        del _procs.hung_jobs[before:]  # not a real hang: keep it out of the run's report
