"""Time to the first batch after a mid-epoch resume, far into a huge epoch.

A resume must not draw again the indices it skips: at position 10^8 of a 10^9-record
epoch that would take minutes. Each row is a fresh process (as a restarted job is)
that loads a saved state and takes one batch; the clock runs from just before the load
to the first batch. Records are their own indices (no I/O), so the time is the
loader's and the sampler's alone.

torchgrain's recipes:
* ``tg.ResumableLoader`` (plain loops, torchrun, HF Accelerate's ``load_state``);
* torchdata's ``StatefulDataLoader`` with a torchgrain sampler inside (Lightning);
* a whole PyTorch Lightning ``Trainer.fit(ckpt_path=...)``: from ``fit()`` to the first
  ``training_step``, at position 10^8 against position 0 (the difference is the resume).

The alternatives fast-forward by drawing the skipped indices: torchdata's
``StatefulDistributedSampler`` (``islice`` over torch's ``DistributedSampler``) and
Accelerate's ``skip_first_batches``. They run at smaller positions and are
extrapolated linearly to 10^8 (marked so).

Run:  python benchmarks/resume.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import describe_machine, print_table, write_json

N = 10**9
POSITION = 10**8
BATCH = 32


# ------------------------------------------------------------------ in the child process
class Ids:
    """A dataset of ``n`` records whose values are their indices (no I/O)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def __getitems__(self, idx):
        return list(idx)


def _sampler_state(n: int, position: int) -> dict:
    import torchgrain as tg

    state = tg.GlobalShuffleSampler(n, seed=1, num_replicas=1, rank=0).state_dict()
    return {**state, "position": position}


def child(method: str, n: int, position: int, state_file: str) -> dict:
    import torch
    from torch.utils.data import DataLoader

    import torchgrain as tg

    if method == "tg-resumable":
        sampler = tg.GlobalShuffleSampler(Ids(n), num_replicas=1, rank=0)
        loader = tg.ResumableLoader(DataLoader(Ids(n), batch_size=BATCH, sampler=sampler))
        state = {"version": 1, "epoch": 0, "sampler": _sampler_state(n, position)}
        t0 = time.perf_counter()
        loader.load_state_dict(state)
        first = next(iter(loader))
        t1 = time.perf_counter()
        expected = tg.GlobalShuffleSampler(n, seed=1, num_replicas=1, rank=0)
        assert first.tolist() == expected.indices(position, position + BATCH).tolist()
        return {"seconds": t1 - t0}

    if method in ("tg-stateful", "torchdata-fastforward"):
        from torchdata.stateful_dataloader import StatefulDataLoader

        with open(state_file) as f:
            state = json.load(f)
        if method == "tg-stateful":
            sampler = tg.GlobalShuffleSampler(Ids(n), num_replicas=1, rank=0)
        else:
            from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

            sampler = StatefulDistributedSampler(Ids(n), num_replicas=1, rank=0, seed=1)
        loader = StatefulDataLoader(Ids(n), batch_size=BATCH, sampler=sampler)
        t0 = time.perf_counter()
        loader.load_state_dict(state)
        next(iter(loader))
        return {"seconds": time.perf_counter() - t0}

    if method == "accelerate-skip":
        from accelerate.data_loader import skip_first_batches

        sampler = tg.GlobalShuffleSampler(Ids(n), seed=1, num_replicas=1, rank=0)
        loader = DataLoader(Ids(n), batch_size=BATCH, sampler=sampler)
        t0 = time.perf_counter()
        skipped = skip_first_batches(loader, position // BATCH)
        next(iter(skipped))
        return {"seconds": time.perf_counter() - t0}

    if method == "lightning":
        return _lightning_child(n, position, state_file)
    raise ValueError(method)
    del torch


def _lightning_child(n: int, position: int, ckpt: str) -> dict:
    import lightning as L
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    import torchgrain as tg

    marks: dict[str, float] = {}

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def train_dataloader(self):
            sampler = tg.GlobalShuffleSampler(Ids(n), seed=1)
            if not os.path.exists(ckpt):  # making the checkpoint: start at `position`
                sampler.load_state_dict(_sampler_state(n, position))
            return StatefulDataLoader(Ids(n), batch_size=BATCH, sampler=sampler)

        def training_step(self, batch, batch_idx):
            if "first_step" not in marks:
                marks["first_step"] = time.perf_counter()
                marks["first_batch"] = batch.tolist()
            return self.layer(batch.float().unsqueeze(1)).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class SaveAfterFirstStep(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:  # as ModelCheckpoint does
            trainer.save_checkpoint(ckpt)

    resume = os.path.exists(ckpt)
    trainer = L.Trainer(
        callbacks=[] if resume else [SaveAfterFirstStep()],
        accelerator="cpu",
        devices=1,
        max_steps=2 if resume else 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t0 = time.perf_counter()
    trainer.fit(Module(), ckpt_path=ckpt if resume else None)
    if not resume:
        return {}
    # The checkpoint was taken one batch after `position`: the resumed run goes on there.
    expected = tg.GlobalShuffleSampler(n, seed=1, num_replicas=1, rank=0)
    assert marks["first_batch"] == expected.indices(position + BATCH, position + 2 * BATCH).tolist()
    return {"seconds": marks["first_step"] - t0}


# ------------------------------------------------------------------------ the parent
def run_child(method: str, n: int, position: int, state_file: str = "") -> dict:
    cmd = [sys.executable, __file__, "--child", method, str(n), str(position), state_file]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_states(tmp: str, positions: dict[str, int]) -> dict[str, str]:
    """Saved StatefulDataLoader states at the positions each method resumes from."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    import torchgrain as tg

    files = {}
    for method, pos in positions.items():
        n = N if method == "tg-stateful" else FASTFORWARD_N
        if method == "tg-stateful":
            sampler = tg.GlobalShuffleSampler(Ids(n), num_replicas=1, rank=0)
            sampler.load_state_dict(_sampler_state(n, pos - BATCH))
            loader = StatefulDataLoader(Ids(n), batch_size=BATCH, sampler=sampler)
            it = iter(loader)
            next(it)
        else:
            sampler = StatefulDistributedSampler(Ids(n), num_replicas=1, rank=0, seed=1)
            loader = StatefulDataLoader(Ids(n), batch_size=BATCH, sampler=sampler)
            it = iter(loader)
            for _ in range(pos // BATCH):
                next(it)
        path = os.path.join(tmp, f"{method}.json")
        with open(path, "w") as f:
            json.dump(loader.state_dict(), f)
        files[method] = path
    return files


FASTFORWARD_N = 10**7  # torch's DistributedSampler materialises a permutation of N


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", nargs=4, metavar=("METHOD", "N", "POSITION", "STATE"))
    args = p.parse_args()
    if args.child:
        method, n, pos, state = args.child
        print(json.dumps(child(method, int(n), int(pos), state)))
        return

    print(f"Resume at position {POSITION:,} of {N:,} records, batch {BATCH} ({describe_machine()})")
    small = {"torchdata-fastforward": 10**6, "accelerate-skip": 10**6}
    with tempfile.TemporaryDirectory() as tmp:
        states = make_states(tmp, {"tg-stateful": POSITION, "torchdata-fastforward": 10**6})
        ckpt_far, ckpt_zero = os.path.join(tmp, "far.ckpt"), os.path.join(tmp, "zero.ckpt")
        run_child("lightning", N, POSITION, ckpt_far)  # writes the checkpoints
        run_child("lightning", N, 0, ckpt_zero)
        plan = [
            ("tg-resumable", N, POSITION, ""),
            ("tg-stateful", N, POSITION, states["tg-stateful"]),
            ("lightning", N, POSITION, ckpt_far),
            ("lightning", N, 0, ckpt_zero),
            (
                "torchdata-fastforward",
                FASTFORWARD_N,
                small["torchdata-fastforward"],
                states["torchdata-fastforward"],
            ),
            ("accelerate-skip", N, small["accelerate-skip"], ""),
        ]
        times: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            for method, n, pos, state in plan:
                t = run_child(method, n, pos, state)["seconds"]
                times.setdefault((method, pos), []).append(t)
            print(f"round {r + 1}/{args.rounds} done")

    rows = []
    tg_time = statistics.median(times[("tg-resumable", POSITION)])
    labels = {
        "tg-resumable": "tg.ResumableLoader (plain loop, torchrun, Accelerate)",
        "tg-stateful": "StatefulDataLoader + tg sampler (Lightning's loader)",
        "lightning": "Lightning Trainer.fit(ckpt_path) to first step",
        "torchdata-fastforward": "StatefulDataLoader + StatefulDistributedSampler",
        "accelerate-skip": "Accelerate skip_first_batches",
    }
    for (method, pos), ts in times.items():
        med = statistics.median(ts)
        row = {
            "method": labels[method],
            "position": pos,
            "seconds": med,
            "seconds at 1e8": med * POSITION / pos if pos and pos != POSITION else med,
            "extrapolated": bool(pos and pos != POSITION),
            "rounds": ts,
        }
        rows.append(row)
    for row in rows:
        row["x tg.ResumableLoader"] = row["seconds at 1e8"] / tg_time
    lightning_far = statistics.median(times[("lightning", POSITION)])
    lightning_zero = statistics.median(times[("lightning", 0)])
    print_table(
        rows,
        ["method", "position", "seconds", "seconds at 1e8", "extrapolated", "x tg.ResumableLoader"],
    )
    print(
        f"Lightning: first step {lightning_far:.2f}s after fit() at position 1e8 vs "
        f"{lightning_zero:.2f}s at 0 (the resume adds {lightning_far - lightning_zero:+.2f}s)"
    )
    write_json(
        "resume",
        {
            "n": N,
            "position": POSITION,
            "batch_size": BATCH,
            "rows": rows,
            "lightning_resume_overhead_s": lightning_far - lightning_zero,
        },
    )


if __name__ == "__main__":
    main()
