"""A training-loop stand-in run in a fresh process by tests/test_resume.py.

    python tests/_resume_job.py DATA MODE WORKERS STOP CKPT OUT [--resume]

Iterates epochs 0 and 1 of a shuffled, randomly augmented torchgrain pipeline, writes every
batch's (ids, noise) it consumed to OUT (.npz), and when STOP >= 0 saves a checkpoint
after STOP batches of epoch 1 and exits hard (os._exit, like a killed job). With
``--resume`` it starts from CKPT instead of from scratch.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

import torchgrain as tg

BATCH = 8


def jitter(rec, rng):
    return {"id": rec["label"] * 1000 + int(rec["id"][1:]), "noise": rng.integers(1 << 40)}


def main(argv: list[str]) -> None:
    data, mode, workers, stop, ckpt, out = argv[:6]
    workers, stop, resume = int(workers), int(stop), "--resume" in argv
    ds = tg.Dataset(tg.ArrayRecordSource(data)).random_map(jitter, seed=11)
    sampler = tg.GlobalShuffleSampler(ds, seed=5)
    kwargs = dict(batch_size=BATCH, sampler=sampler, num_workers=workers)
    if mode == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(ds, **kwargs)
    else:
        loader = torch.utils.data.DataLoader(ds, **kwargs)
    start_epoch = 0
    if resume:
        state = torch.load(ckpt, weights_only=False)
        start_epoch = state["epoch"]
        if mode == "stateful":
            loader.load_state_dict(state["loader"])
        else:
            sampler.load_state_dict(state["sampler"])
    ids, noise = [], []
    for epoch in range(start_epoch, 2):
        sampler.set_epoch(epoch)
        for step, batch in enumerate(loader, start=1):
            ids.append(batch["id"].numpy())
            noise.append(batch["noise"].numpy())
            if epoch == 1 and step == stop and not resume:
                if mode == "stateful":
                    state = {"epoch": epoch, "loader": loader.state_dict()}
                else:
                    state = {"epoch": epoch, "sampler": sampler.state_dict(consumed=step * BATCH)}
                torch.save(state, ckpt)
                np.savez(out, ids=np.concatenate(ids), noise=np.concatenate(noise))
                sys.stdout.flush()
                os._exit(0)
    np.savez(out, ids=np.concatenate(ids), noise=np.concatenate(noise))


if __name__ == "__main__":
    main(sys.argv[1:])
