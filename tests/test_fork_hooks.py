"""What the fork hooks give a forked child: a new fork generation, so that objects that
compare it on their hot paths (the mapped shard region) make their per-process state
again, a lock held by a thread of the parent at the fork included."""

from __future__ import annotations

import json
import operator
import os
import threading

import numpy as np
import pytest

from torchgrain.io import process
from torchgrain.io.region import ShardRegion, supported


def _in_child(report, body) -> dict:
    """Run ``body()`` in a forked child; its dict comes back through ``report``."""
    pid = os.fork()
    if pid == 0:
        out = {}
        try:
            out = body()
        except BaseException as e:  # reported to the parent, which fails the test
            out = {"error": repr(e)}
        finally:
            report.write_text(json.dumps(out))
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return json.loads(report.read_text())


@pytest.mark.timeout(120)
def test_a_forked_child_gets_a_new_generation_and_token(tmp_path):
    parent = process.generation, process.token()
    got = _in_child(
        tmp_path / "child.json",
        lambda: {"generation": process.generation, "token": list(process.token())},
    )
    assert got["generation"] == parent[0] + 1
    assert tuple(got["token"]) != parent[1] and got["token"][1] == parent[0] + 1


@pytest.mark.timeout(120)
def test_a_forked_child_knows_its_parents_token_and_no_other(tmp_path):
    parent = process.token()
    assert not process.forked_from(parent)  # this process itself
    got = _in_child(
        tmp_path / "child.json",
        lambda: {
            "parent": process.forked_from(parent),
            "own": process.forked_from(process.token()),
            "older": process.forked_from((parent[0], parent[1] - 1)),
        },
    )
    assert got == {"parent": True, "own": False, "older": False}


@pytest.mark.skipif(not supported(), reason="needs Linux x86-64/arm64")
@pytest.mark.timeout(120)
def test_a_region_whose_lock_a_parent_thread_held_at_the_fork_reads_in_the_child(tmp_path):
    shard = tmp_path / "s0"
    shard.write_bytes(bytes(range(256)) * 16)
    region = ShardRegion([str(shard)], np.array([4096], np.int64))
    holding, release = threading.Event(), threading.Event()

    def hold():  # a reader thread of the parent, inside the region's lock at the fork
        with region._lock:
            holding.set()
            release.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    assert holding.wait(60)

    def child():
        result = {}

        def read():
            at = region.acquire_one(0)
            result["bytes"] = bytes(region.u8[at + 1 : at + 4]).hex()
            region.release()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(30)  # a lock inherited held would wait forever
        return {"done": not reader.is_alive(), **result}

    try:
        got = _in_child(tmp_path / "child.json", child)
    finally:
        release.set()
        t.join(60)
    assert got == {"done": True, "bytes": "010203"}


def test_fork_safe_pool_runs_a_task_in_the_caller_while_a_fork_is_under_way():
    """A task submitted while another thread is between the before-fork and after-fork
    hooks must not start a pool thread (it would run across the fork): it runs in the
    calling thread, and the pool starts threads again once the fork is over."""
    pool = process.ForkSafeThreadPool(2, "tg-test-forking")
    here = threading.current_thread().name
    process._fork_lock.acquire()  # what a fork in another thread holds
    try:
        assert pool.submit(lambda: threading.current_thread().name).result() == here
        assert pool.submit(operator.truediv, 1, 0).exception() is not None
        assert not [t for t in threading.enumerate() if t.name.startswith("tg-test-forking")]
    finally:
        process._fork_lock.release()
    assert pool.submit(lambda: threading.current_thread().name).result() != here
    pool.shutdown()
