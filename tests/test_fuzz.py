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
        ("crash", "crash: the worker died"),
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
