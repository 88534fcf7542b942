"""Interleavings that once deadlocked a process, each forced by a script in
tests/_deadlocks/ (events, a timer, a slowed lock or a collection placed where the race
window is): finalizers running in a forked child or inside the bookkeeping they call
back into, locks copied into a child while another thread held them, and a lock-order
inversion between the before-fork hook and a source registering a new read-ahead.

Each script runs in its own process with a deadline: a hang fails the test (with the
stacks the script's faulthandler writes), it never hangs the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "_deadlocks")


@pytest.mark.parametrize(
    "script",
    [
        "bufferpool_gc_selfdeadlock.py",
        "fork_hook_lock_inversion.py",
        "region_fork_lock_grandchild.py",
        "stats_release_in_child.py",
    ],
)
def test_no_deadlock(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    try:
        proc = subprocess.run(
            [sys.executable, os.path.join(SCRIPTS, script), str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
    except subprocess.TimeoutExpired as hang:
        pytest.fail(f"{script} deadlocked:\n{(hang.stderr or b'')[-4000:]!r}")
    assert proc.returncode == 0, proc.stderr[-4000:]
