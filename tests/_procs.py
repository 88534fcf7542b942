"""Processes as Linux's /proc shows them: who descends from whom, who is still running.

The test suite uses it to check that it leaves no process behind (``conftest.py``) and
that killed jobs take their helpers with them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36
#: The environment variable that marks every process of one :func:`run_job`.
JOB_MARK = "TORCHGRAIN_TEST_JOB"


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    state: str  # "R", "S", "Z" (exited, not yet reaped), ...

    @property
    def running(self) -> bool:
        return self.state not in ("Z", "X")


def supported() -> bool:
    return os.path.isdir("/proc/self/task")


def snapshot() -> dict[int, Proc]:
    """Every process visible in /proc now."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(name)] = Proc(int(name), int(fields[1]), int(fields[2]), fields[0])
    return out


def descendants(root: int, procs: dict[int, Proc] | None = None) -> list[Proc]:
    """The processes below ``root`` (children, their children, ...)."""
    procs = snapshot() if procs is None else procs
    children: dict[int, list[Proc]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child.pid)
    return out


def in_group(pgid: int) -> list[Proc]:
    """The processes of process group ``pgid``."""
    return [p for p in snapshot().values() if p.pgid == pgid]


def describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f"pid {pid}: {cmd[:300]}"


def reap(procs: list[Proc]) -> None:
    """Collect the exit status of those of ``procs`` that are our exited children."""
    me = os.getpid()
    for p in procs:
        if not p.running and p.ppid == me:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(p.pid, os.WNOHANG)


def wait_gone(find, seconds: float) -> list[Proc]:
    """Poll ``find()`` (a list of processes) until none is running, for up to
    ``seconds``; the ones still running then."""
    deadline = time.monotonic() + seconds
    while True:
        found = find()
        reap(found)
        running = [p for p in found if p.running]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (not init's), so that
    :func:`descendants` still finds them. Linux only; whether it worked."""
    import ctypes

    try:
        return ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def kill(procs: list[Proc]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)


STACK_DUMPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_stack_dumps")


class JobTimeout(AssertionError):
    """A job ran past its deadline; the message holds every process's stacks."""


def run_job(
    cmd: list[str], *, timeout: float, env: dict[str, str], cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True)`` for a multi-process job
    (torchrun, Lightning's launcher, DataLoader workers), in a process group of its own.

    Past ``timeout`` seconds every process of the job writes its threads' stacks to the
    job's stderr (SIGUSR1, see tests/_stack_dumps), the job is killed, and
    :class:`JobTimeout` is raised with the end of that output: a hang fails with where
    each process was stuck, and leaves no process behind. The job's processes are its
    process group and every descendant of its first process: torchrun starts its ranks
    in sessions of their own, outside the group, holding the job's output pipes.
    """
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (STACK_DUMPS, env.get("PYTHONPATH")) if x)
    # Every process of the job inherits this mark: one whose launcher exited (an orphan
    # in a session of its own) is found by it.
    mark = env[JOB_MARK] = uuid.uuid4().hex
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job = _job_processes(proc.pid, mark)
        listing = "\n".join(describe(p.pid) for p in job)
        for p in job:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(3)
        for _ in range(10):  # what the job started meanwhile is killed in the next round
            # Children first: once the first process is gone, its orphans leave its tree.
            kill(_job_processes(proc.pid, mark)[::-1])
            try:
                out, err = proc.communicate(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            proc.kill()
            proc.stdout.close()
            proc.stderr.close()
            proc.wait()
            out, err = "", "(the job's output pipes stayed open after it was killed)"
        raise JobTimeout(
            f"{cmd[:6]} ran past {timeout:.0f} s; its processes:\n{listing}\n"
            f"--- stdout (end) ---\n{out[-3000:]}\n--- stderr with stacks (end) ---\n"
            f"{err[-30000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _job_processes(root: int, mark: str) -> list[Proc]:
    """The running processes of the job whose first process is ``root``: that process,
    its process group, its descendants, then those whose environment holds the job's
    ``mark`` (a rank whose launcher exited), parents before their children."""
    procs = snapshot()
    found = {root: procs[root]} if root in procs else {}
    found.update((p.pid, p) for p in descendants(root, procs))
    found.update((p.pid, p) for p in procs.values() if p.pgid == root)
    found.update((p.pid, p) for p in procs.values() if p.pid not in found and _marked(p, mark))
    return [p for p in found.values() if p.running]


def _marked(p: Proc, mark: str) -> bool:
    """Whether ``p`` started with ``JOB_MARK=mark`` in its environment."""
    try:
        with open(f"/proc/{p.pid}/environ", "rb") as f:
            return f"{JOB_MARK}={mark}".encode() in f.read().split(b"\0")
    except OSError:  # exited meanwhile, or another user's
        return False


#: Jobs that ran past their deadline and passed when run again: (command, message with
#: every process's stacks). conftest.py prints them at the end of the run.
hung_jobs: list[tuple[str, str]] = []


def run_job_again_if_hung(
    cmd: list[str], *, timeout: float, env: dict[str, str], cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """:func:`run_job`; a job that runs past ``timeout`` is run once more.

    For the 2-process framework jobs on a busy 2-core machine. A job that hangs twice
    fails the test; one that hangs once passes if the second run passes, and the first
    run's stacks are printed at the end of the test run (with
    ``TORCHGRAIN_TEST_HANGS=error`` the run fails on them), so a rare hang is never
    silent. Only a hang is run again: a job that fails, or delivers the wrong records,
    fails the test at once.
    """
    try:
        return run_job(cmd, timeout=timeout, env=env, cwd=cwd)
    except JobTimeout as hang:
        hung_jobs.append((" ".join(cmd), str(hang)))
        return run_job(cmd, timeout=timeout, env=env, cwd=cwd)
