"""A small training job run by tests/test_frameworks.py inside Lightning, Accelerate or
torchrun, with 2 processes on gloo. Every rank writes what it trained on, batch by batch
(record ids, the random_map draw of each record, the epoch), to OUT/rank<r>.json.

    python _framework_job.py lightning DATA OUT [--strategy ddp|ddp_spawn] [--where ...]
    torchrun --nproc_per_node 2 _framework_job.py accelerate DATA OUT [--where ...]
    torchrun --nproc_per_node 2 _framework_job.py torchrun DATA OUT ...

With ``--stop-step S --ckpt PATH`` the job saves a checkpoint after S steps and stops;
``--resume PATH`` continues from it through the framework's own checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader

import torchgrain as tg

BATCH = 10
SEED = 0


def pick(rec):
    return {"id": rec["id"]}


def jitter(rec, rng):
    return {"id": rec["id"], "noise": float(rng.random())}


def make_dataset(path):
    return tg.Dataset(tg.ArrayRecordSource(path)).map(pick).random_map(jitter, seed=7)


def make_sampler(ds, args, **kwargs):
    if args.sampler == "block":
        return tg.BlockShuffleSampler(ds, seed=SEED, window=3, **kwargs)
    return tg.GlobalShuffleSampler(ds, seed=SEED, **kwargs)


def loader_class(args):
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader
    return DataLoader


def make_loader(ds, sampler, args):
    kwargs = {"batch_size": BATCH, "sampler": sampler, "num_workers": args.workers}
    if args.workers:
        kwargs["persistent_workers"] = args.persistent
    loader = loader_class(args)(ds, **kwargs)
    return tg.ResumableLoader(loader) if args.loader == "resumable" else loader


def record(seen, epoch, batch):
    seen.append(
        {
            "epoch": int(epoch),
            "ids": batch["id"].tolist(),
            "noise": [round(float(x), 12) for x in batch["noise"]],
        }
    )


def write(out, rank, payload):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(payload, f)


# --------------------------------------------------------------------------- Lightning
# Module-level classes: ddp_spawn pickles the module into the processes it starts.
try:
    import lightning as L
except ImportError:  # the other frameworks' runs do not need it
    L = None

if L is not None:

    class Module(L.LightningModule):
        def __init__(self, args):
            super().__init__()
            self.args = args
            self.layer = torch.nn.Linear(1, 1)
            self.seen, self.val_seen = [], []
            self.ds = make_dataset(args.data)
            if args.where == "init":
                self.sampler = make_sampler(self.ds, args)

        def train_dataloader(self):
            args = self.args
            sampler = self.sampler if args.where == "init" else make_sampler(self.ds, args)
            return make_loader(self.ds, sampler, args)

        def val_dataloader(self):
            val = make_dataset(self.args.val_data)
            # Evaluation: every record exactly once over the ranks (no padding).
            sampler = tg.GlobalShuffleSampler(val, shuffle=False, pad=False)
            return DataLoader(val, batch_size=BATCH, sampler=sampler)

        def training_step(self, batch, batch_idx):
            record(self.seen, self.current_epoch, batch)
            x = batch["noise"].float().unsqueeze(1)
            return self.layer(x).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.val_seen.append({"epoch": int(self.current_epoch), "ids": batch["id"].tolist()})

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_train_end(self):
            payload = {"batches": self.seen, "val": self.val_seen}
            payload["world"] = self.trainer.world_size
            write(self.args.out, self.global_rank, payload)

    class DataModule(L.LightningDataModule):
        def __init__(self, args):
            super().__init__()
            self.args = args

        def setup(self, stage):
            self.ds = make_dataset(self.args.data)

        def train_dataloader(self):
            return make_loader(self.ds, make_sampler(self.ds, self.args), self.args)

    class SaveAt(L.Callback):
        def __init__(self, step, path):
            self.step, self.path = step, path

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.step and trainer.global_step == self.step:
                trainer.save_checkpoint(self.path)


def run_lightning(args):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        max_epochs=args.epochs,
        max_steps=args.stop_step or -1,
        use_distributed_sampler=not args.no_distributed_sampler,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=None if args.val_data else 0,
        callbacks=[SaveAt(args.stop_step, args.ckpt)],
    )
    model = Module(args)
    datamodule = DataModule(args) if args.where == "datamodule" else None
    trainer.fit(model, datamodule=datamodule, ckpt_path=args.resume)


# -------------------------------------------------------------------------- Accelerate
def run_accelerate(args):
    from accelerate import Accelerator

    ds = make_dataset(args.data)
    if args.where == "before":
        sampler = make_sampler(ds, args)
    accelerator = Accelerator(cpu=True)
    if args.where != "before":
        sampler = make_sampler(ds, args)
    loader = accelerator.prepare(make_loader(ds, sampler, args))
    model = accelerator.prepare(torch.nn.Linear(1, 1))
    if args.resumable:
        loader = tg.ResumableLoader(loader)
        accelerator.register_for_checkpointing(loader)
    if args.resume:
        accelerator.load_state(args.resume)
    seen, step = [], 0
    start = loader.epoch if args.resumable else 0
    for _ in range(start, args.epochs):
        for batch in loader:
            record(seen, sampler.epoch, batch)
            model(batch["noise"].float().unsqueeze(1)).sum().backward()
            step += 1
            if args.stop_step and step == args.stop_step:
                accelerator.save_state(args.ckpt)
                write(args.out, accelerator.process_index, {"batches": seen, "len": len(loader)})
                return
    write(args.out, accelerator.process_index, {"batches": seen, "len": len(loader)})


# ---------------------------------------------------------------------------- torchrun
def run_torchrun(args):
    import torch.distributed as dist

    ds = make_dataset(args.data)
    sampler = make_sampler(ds, args)  # before the process group exists
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = tg.ResumableLoader(make_loader(ds, sampler, args))
    if args.resume:
        loader.load_state_dict(torch.load(args.resume, weights_only=False))
    seen, step = [], 0
    try:
        for _ in range(loader.epoch, args.epochs):
            for batch in loader:
                record(seen, sampler.epoch, batch)
                step += 1
                if args.stop_step and step == args.stop_step:
                    if rank == 0:
                        torch.save(loader.state_dict(), args.ckpt)
                    dist.barrier()
                    write(args.out, rank, {"batches": seen, "len": len(loader)})
                    return
        write(args.out, rank, {"batches": seen, "len": len(loader)})
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("framework", choices=["lightning", "accelerate", "torchrun"])
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--where", default="hook")
    p.add_argument("--sampler", default="global", choices=["global", "block"])
    p.add_argument("--loader", default="plain", choices=["plain", "stateful", "resumable"])
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--no-distributed-sampler", action="store_true")
    p.add_argument("--val-data")
    p.add_argument("--resumable", action="store_true")
    p.add_argument("--stop-step", type=int, default=0)
    p.add_argument("--ckpt")
    p.add_argument("--resume")
    args = p.parse_args(argv)
    np.seterr(all="raise")
    {"lightning": run_lightning, "accelerate": run_accelerate, "torchrun": run_torchrun}[
        args.framework
    ](args)


if __name__ == "__main__":
    sys.exit(main())
