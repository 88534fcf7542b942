"""Exact mid-epoch resume in a fresh process, random transforms included."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import torchgrain as tg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "_resume_job.py")


def run_job(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run([sys.executable, JOB, *map(str, args)], check=True, env=env, timeout=240)


@pytest.mark.parametrize("mode", ["plain", "stateful"])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_in_fresh_process_matches_uninterrupted(small_dataset, tmp_path, mode, workers):
    if mode == "stateful":
        pytest.importorskip("torchdata.stateful_dataloader")
    d, _ = small_dataset
    full, part, rest, ckpt = (tmp_path / f"{n}.npz" for n in ("full", "part", "rest", "ckpt"))
    run_job(d, mode, workers, -1, ckpt, full)
    run_job(d, mode, workers, 5, ckpt, part)  # stops after 5 batches of epoch 1
    run_job(d, mode, workers, -1, ckpt, rest, "--resume")
    ref, a, b = (np.load(p) for p in (full, part, rest))
    for key in ("ids", "noise"):
        joined = np.concatenate([a[key], b[key]])
        np.testing.assert_array_equal(joined, ref[key])
    # nothing repeated or skipped within the resumed epoch
    epoch1 = np.concatenate([a["ids"][100:], b["ids"]])
    assert sorted(epoch1.tolist()) == sorted(ref["ids"][:100].tolist())


def crash_in_worker(rec):
    info = torch.utils.data.get_worker_info()
    if info is not None and info.id == 1 and rec["label"] == 3 and os.environ.get("TG_KILL"):
        os.kill(os.getpid(), 9)
    return rec["label"]


def test_killed_worker_surfaces_and_resume_loses_nothing(small_dataset, monkeypatch):
    d, _ = small_dataset
    ds = tg.Dataset(tg.ArrayRecordSource(d)).map(crash_in_worker)
    sampler = tg.GlobalShuffleSampler(ds, seed=1)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, timeout=60)
    reference = [b.tolist() for b in loader]

    monkeypatch.setenv("TG_KILL", "1")
    # Each batch and the state after it are kept in one step: the DataLoader reports the
    # killed worker from its SIGCHLD handler, which runs between any two bytecodes of
    # this loop (between keeping a batch and taking the state after it, say).
    steps: list[tuple[list, dict]] = []
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        for step, batch in enumerate(loader, start=1):
            steps.append((batch.tolist(), sampler.state_dict(consumed=step * 4)))
    monkeypatch.delenv("TG_KILL")
    got = [b for b, _ in steps]
    state = steps[-1][1] if steps else None
    # restart from the last checkpoint in a new loader: exactly the rest of the epoch
    fresh = tg.GlobalShuffleSampler(ds, seed=1)
    if state is not None:
        fresh.load_state_dict(state)
    loader = DataLoader(ds, batch_size=4, sampler=fresh, num_workers=2)
    got += [b.tolist() for b in loader]
    assert got == reference
