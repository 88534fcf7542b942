"""A small training job run by tests/test_frameworks.py inside Lightning, Accelerate, HF
Trainer, Ray Train or torchrun, with 2 processes on gloo. Every rank writes what it
trained on, batch by batch (record ids, the random_map draw of each record, the
epoch), to OUT/rank<r>.json.

    python _framework_job.py lightning DATA OUT [--strategy ddp|ddp_spawn] [--where ...]
    torchrun --nproc_per_node 2 _framework_job.py accelerate DATA OUT [--where ...]
    torchrun --nproc_per_node 2 _framework_job.py accelerate-modes - OUT
    torchrun --nproc_per_node 2 _framework_job.py trainer DATA OUT [--workers W]
    torchrun --nproc_per_node 2 _framework_job.py torchrun DATA OUT ...

With ``--stop-step S --ckpt PATH`` the job saves a checkpoint after S steps and stops
(``--save-step S`` saves and goes on); ``--resume PATH`` continues from it through the
framework's own checkpoint. ``accelerate-modes`` runs every Accelerate dataloader mode
in one launch (see :func:`run_accelerate_modes`). Ray Train runs :func:`ray_loop` from
the test itself. With ``TORCHGRAIN_TEST_START_METHOD`` set (e.g. ``forkserver``),
DataLoader workers start that way.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import multiprocessing
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed.nn  # before any process group exists: see main()
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


class Records:
    """``n`` records ``{"id": i}`` in memory (a map-style source any worker can pickle)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"id": i}


def memory_dataset(n):
    return tg.Dataset(Records(n)).random_map(jitter, seed=7)


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


def start_method():
    method = os.environ.get("TORCHGRAIN_TEST_START_METHOD")
    if method:
        multiprocessing.set_start_method(method, force=True)
    if method == "forkserver":
        # Imported once, in the fork server: each DataLoader worker it forks has them
        # (otherwise every worker of every pass imports torch again, seconds each).
        multiprocessing.set_forkserver_preload(["__main__", "numpy", "torch", "torchgrain"])


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
# Module-level classes: ddp_spawn pickles the module into the processes it starts. Only
# Lightning's runs import it: spawn and forkserver DataLoader workers import this module
# again (with the job's argv), and Lightning's imports cost each of them seconds.
L = None
if sys.argv[1:2] == ["lightning"]:
    with contextlib.suppress(ImportError):  # (its test is skipped then)
        import lightning as L

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

        def setup(self, trainer, pl_module, stage):
            # A rank ddp_spawn started exits without main()'s finally: its group ends at exit.
            atexit.register(end_process_group)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.step and trainer.global_step == self.step:
                trainer.save_checkpoint(self.path)


def run_lightning(args):
    start_method()
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
        callbacks=[SaveAt(args.stop_step or args.save_step, args.ckpt)],
    )
    model = Module(args)
    datamodule = DataModule(args) if args.where == "datamodule" else None
    trainer.fit(model, datamodule=datamodule, ckpt_path=args.resume)


# -------------------------------------------------------------------------- Accelerate
def run_accelerate(args):
    from accelerate import Accelerator

    start_method()
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


# Every Accelerate dataloader mode, each with 1,000 and 1,001 records and 0 and 2 workers.
ACCELERATE_MODES = {
    "default": {},
    "split_batches": {"split_batches": True},
    "dispatch_batches": {"dispatch_batches": True},
    "dispatch_split": {"dispatch_batches": True, "split_batches": True},
    "even_batches_false": {"even_batches": False},
}
MODE_SIZES = (1000, 1001)
MODE_WORKERS = (0, 2)
MODE_EPOCHS = 2
MODE_STOP = (1, 7)  # save_state in epoch 1, after its 7th step


def _mode_pass(loader, epoch, stop=None):
    """One pass over ``loader``: its batches (stopping after ``stop`` steps)."""
    seen = []
    for batch in loader:
        record(seen, epoch, batch)
        if stop is not None and len(seen) == stop:
            break
    return seen


def run_accelerate_modes(args):
    """In one launch, for every mode, size and worker count:

    * ``cover``: the loader as ``accelerator.prepare`` returns it, no ``len()`` first,
      no ``set_epoch`` by hand, 2 epochs;
    * ``head``: the same through ``tg.ResumableLoader`` registered for checkpointing,
      ``save_state`` at step 7 of epoch 1; ``tail``: new objects (a new Accelerator,
      sampler, loader), ``load_state``, to the end.

    Each rank writes ``{config: {"len", "cover", "head", "tail"}}``.
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    start_method()
    results, rank = {}, None

    def prepared(config, n, workers, resumable):
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
        ds = memory_dataset(n)
        sampler = tg.GlobalShuffleSampler(ds, seed=SEED)
        loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=workers)
        loader = accelerator.prepare(loader)
        if resumable:
            loader = tg.ResumableLoader(loader)
            accelerator.register_for_checkpointing(loader)
        return accelerator, loader

    for mode, config in ACCELERATE_MODES.items():
        for n in MODE_SIZES:
            for workers in MODE_WORKERS:
                accelerator, loader = prepared(config, n, workers, False)
                rank = accelerator.process_index
                cover = [_mode_pass(loader, epoch) for epoch in range(MODE_EPOCHS)]
                length = len(loader)
                del loader

                ckpt = os.path.join(args.out, f"state-{mode}-{n}-{workers}")
                accelerator, loader = prepared(config, n, workers, True)
                stop_epoch, stop_step = MODE_STOP
                head = []
                for epoch in range(stop_epoch + 1):
                    head += _mode_pass(loader, epoch, stop_step if epoch == stop_epoch else None)
                accelerator.save_state(ckpt)
                accelerator.wait_for_everyone()  # rank 0 writes it; all ranks read it next
                del loader

                accelerator, loader = prepared(config, n, workers, True)
                accelerator.load_state(ckpt)
                tail = []
                for epoch in range(loader.epoch, MODE_EPOCHS):
                    tail += _mode_pass(loader, epoch)
                del loader
                results[f"{mode}-{n}-w{workers}"] = {
                    "len": length,
                    "cover": cover,
                    "head": head,
                    "tail": tail,
                }
                accelerator.wait_for_everyone()
    write(args.out, rank, results)


# --------------------------------------------------------------------------- HF Trainer
TRAINER_SAVE_STEP = 13  # epoch 1, step 3: a mid-epoch checkpoint


def trainer_can_resume():
    """transformers refuses to load a checkpoint (torch.load) under torch < 2.6 since
    its 4.50 release, and its 4.49 release cannot restore one on CPU processes there."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 6)


def run_trainer(args):
    """``torchgrain.frameworks.transformers.Trainer``: 2 epochs with a checkpoint saved at
    step 13 (``--save-step``), then a new Trainer resumed from that checkpoint. Each rank
    writes the batches of both runs and every set_epoch call the sampler got.
    ``--dispatch``: Accelerate's ``dispatch_batches=True``; ``--grad-accum``: the
    Trainer's ``gradient_accumulation_steps``."""
    import transformers

    from torchgrain.frameworks.transformers import Trainer

    start_method()
    save_step = args.save_step or TRAINER_SAVE_STEP

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen = []

        def forward(self, id, noise):
            if self.training:
                self.seen.append(
                    {"ids": id.tolist(), "noise": [round(float(x), 12) for x in noise]}
                )
            return {"loss": self.layer(noise.float().unsqueeze(1)).pow(2).mean()}

    def train(resume):
        ds = make_dataset(args.data)
        sampler = tg.GlobalShuffleSampler(ds, seed=SEED)
        calls = []
        set_epoch = sampler.set_epoch

        def counting_set_epoch(epoch):
            calls.append(int(epoch))
            set_epoch(epoch)

        sampler.set_epoch = counting_set_epoch
        model = Model()
        training_args = transformers.TrainingArguments(
            output_dir=os.path.join(args.out, "trainer"),
            per_device_train_batch_size=BATCH,
            num_train_epochs=args.epochs,
            save_strategy="steps",
            save_steps=save_step,
            save_total_limit=None,
            logging_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=SEED,
            dataloader_num_workers=args.workers,
            remove_unused_columns=False,
            disable_tqdm=True,
            learning_rate=1e-3,
            gradient_accumulation_steps=args.grad_accum,
            accelerator_config={"dispatch_batches": True} if args.dispatch else None,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=ds, train_sampler=sampler)
        trainer.train(resume_from_checkpoint=resume)
        return model.seen, calls, trainer.args.process_index

    reference, reference_calls, rank = train(None)
    checkpoint = os.path.join(args.out, "trainer", f"checkpoint-{save_step}")
    resumed = resumed_calls = None
    if trainer_can_resume():
        resumed, resumed_calls, _ = train(checkpoint)
    write(
        args.out,
        rank,
        {
            "reference": reference,
            "reference_set_epoch": reference_calls,
            "resumed": resumed,
            "resumed_set_epoch": resumed_calls,
        },
    )


# ---------------------------------------------------------------------------- Ray Train
def ray_loop(config):
    """Ray Train's training function (run by tests/test_frameworks.py): the documented
    recipe. A checkpoint with the loader's state is reported at ``config["save_step"]``;
    ``config["resume"]`` (a ``ray.train.Checkpoint``) continues from one."""
    import ray.train
    import ray.train.torch

    start_method()
    ds = make_dataset(config["data"])
    sampler = tg.GlobalShuffleSampler(ds, seed=SEED)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=config["workers"])
    loader = tg.ResumableLoader(ray.train.torch.prepare_data_loader(loader))
    checkpoint = ray.train.get_checkpoint() or config.get("resume")
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            loader.load_state_dict(torch.load(os.path.join(d, "loader.pt")))
    rank = ray.train.get_context().get_world_rank()
    seen, calls, step = [], [], 0
    set_epoch = sampler.set_epoch

    def counting_set_epoch(epoch):
        calls.append(int(epoch))
        set_epoch(epoch)

    sampler.set_epoch = counting_set_epoch
    for _ in range(loader.epoch, config["epochs"]):
        for batch in loader:
            record(seen, sampler.epoch, batch)
            step += 1
            if step == config.get("save_step"):
                with tempfile.TemporaryDirectory() as d:
                    torch.save(loader.state_dict(), os.path.join(d, "loader.pt"))
                    ckpt = ray.train.Checkpoint.from_directory(d) if rank == 0 else None
                    ray.train.report({"step": step}, checkpoint=ckpt)
    write(
        config["out"],
        rank,
        {"batches": seen, "set_epoch": calls, "world": ray.train.get_context().get_world_size()},
    )


# ---------------------------------------------------------------------------- torchrun
def run_torchrun(args):
    import torch.distributed as dist

    start_method()
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
    p.add_argument(
        "framework", choices=["lightning", "accelerate", "accelerate-modes", "trainer", "torchrun"]
    )
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
    p.add_argument("--save-step", type=int, default=0)
    p.add_argument("--ckpt")
    p.add_argument("--resume")
    p.add_argument("--dispatch", action="store_true")
    p.add_argument("--grad-accum", type=int, default=1)
    args = p.parse_args(argv)
    np.seterr(all="raise")
    jobs = {
        "lightning": run_lightning,
        "accelerate": run_accelerate,
        "accelerate-modes": run_accelerate_modes,
        "trainer": run_trainer,
        "torchrun": run_torchrun,
    }
    try:
        jobs[args.framework](args)
    finally:
        # A gloo process group left for the interpreter's exit can abort the process
        # ("terminate called without an active exception", torch#190489): the HF Trainer
        # and Accelerate leave theirs unless told to end, and their objects hold it in
        # reference cycles (the DDP model). Those are collected first, while the group is
        # registered: a collection that frees the last hold on an ended group joins its
        # threads (gloo_tcp_loop, pt_gloo_runloop) with the GIL held, which a thread
        # freeing a finished collective's tensors waits for (a hang, seen 1 in ~80 runs).
        end_process_group()


def end_process_group() -> None:
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
