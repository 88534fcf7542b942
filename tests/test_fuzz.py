"""The fuzz suite (``tests/fuzz.py``) in the test run: every case that once failed is
replayed, and a short seeded campaign runs against every decoder.

``make fuzz`` runs the same targets for longer (10 minutes by default) and adds what
fails to ``tests/fuzz_corpus``.
"""

from __future__ import annotations

import fuzz
import pytest


@pytest.fixture(scope="module")
def supervisor():
    sup = fuzz.Supervisor(case_seconds=60)
    yield sup
    sup.close()


CORPUS = fuzz.corpus_cases()


@pytest.mark.parametrize("case", [c for _, c in CORPUS], ids=[name for name, _ in CORPUS])
def test_every_case_that_once_failed_now_passes(supervisor, case):
    assert supervisor.run(case) == ""


#: Cases per target: about a minute in all on a 2-core machine.
CASES = {
    "arrayrecord": 120,
    "msgpack": 2000,
    "msgpack_columns": 1000,
    "tf_example": 1500,
    "tfrecord": 800,
    "parquet": 300,
    "parquet_pages": 150,
    "byteranges": 2000,
    "range_answer": 2000,
}


@pytest.mark.parametrize("target", fuzz.FUZZED)
def test_a_seeded_campaign_finds_no_misbehaviour(supervisor, target):
    run, failures = fuzz.campaign([target], seed=20240611, cases=CASES[target], sup=supervisor)
    assert run == CASES[target]
    assert not failures, "\n".join(f"{v.splitlines()[0][:300]}" for _, v in failures[:5])


@pytest.mark.parametrize(
    ("mode", "verdict"),
    [
        ("ok", ""),
        ("crash", "crash: the worker died (exit -6)\nFatal Python error: Aborted"),
        ("hang", "hang: no answer"),
        ("memory", "peak RSS"),
        ("bare", "bare KeyError"),
        ("hidden_memory_error", "hides a MemoryError"),
    ],
)
def test_the_harness_sees_crashes_hangs_memory_and_bare_errors(mode, verdict):
    sup = fuzz.Supervisor(case_seconds=3)
    try:
        assert sup.run({"target": "selftest", "data": "", "mode": "ok"}) == ""  # started
        got = sup.run({"target": "selftest", "data": "", "mode": mode})
        assert verdict in got if verdict else got == ""
        # The supervisor goes on after a dead or killed worker.
        assert sup.run({"target": "selftest", "data": "", "mode": "ok"}) == ""
    finally:
        sup.close()


def test_a_killed_supervisor_leaves_no_worker_behind(tmp_path):
    """The supervisor killed (kill -9) while its worker runs a case that would take an
    hour: the worker dies with it instead of living on as an orphan."""
    import os
    import signal
    import subprocess
    import sys
    import time

    started = tmp_path / "started"
    script = (
        "import sys, fuzz\n"
        "sup = fuzz.Supervisor(case_seconds=3600)\n"
        "assert sup.run({'target': 'selftest', 'data': '', 'mode': 'ok'}) == ''\n"
        "print(sup.proc.pid, flush=True)\n"
        f"sup.run({{'target': 'selftest', 'data': '', 'mode': 'hang', 'started': {str(started)!r}}})\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([fuzz.ROOT, fuzz.HERE]))
    sup = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    try:
        worker = int(sup.stdout.readline())
        deadline = time.monotonic() + 120
        while not started.exists():
            assert time.monotonic() < deadline, "the worker never started the case"
            time.sleep(0.05)
    finally:
        sup.kill()
        sup.wait()

    def alive(pid: int) -> bool:  # a zombie (dead, not yet reaped) is not
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 60
    while alive(worker):
        if time.monotonic() > deadline:
            os.kill(worker, signal.SIGKILL)  # (what the harness should have done)
            raise AssertionError(f"worker {worker} outlived its supervisor")
        time.sleep(0.1)
