"""Train a small model with DDP over torchgrain, checkpoint mid-epoch, and resume.

Run on CPU with two processes (gloo)::

    torchrun --nproc_per_node=2 benchmarks/ddp_train.py --data /tmp/tg-ddp --stop-after 20
    torchrun --nproc_per_node=2 benchmarks/ddp_train.py --data /tmp/tg-ddp --resume
    # or resume on a different world size: every remaining sample is used exactly once
    torchrun --nproc_per_node=3 benchmarks/ddp_train.py --data /tmp/tg-ddp --resume

The first command builds a synthetic dataset (once), trains, writes a checkpoint after
20 steps (model, optimiser, sampler position) and stops as a killed job would. The second
continues the same epoch from the next batch. Each rank logs the sample ids it consumed
to ``DATA/consumed-rank{r}-{run}.txt`` so the split can be checked afterwards.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torchgrain as tg
from torchgrain.demo import SmallCNN, build_demo_dataset, random_flip


def to_tensors(rec):
    return {
        "image": torch.from_numpy(rec["image"]).permute(2, 0, 1),
        "label": torch.tensor(rec["label"]),
        "id": int(rec["id"].split("-")[1]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="dataset directory (built if missing)")
    p.add_argument("--num-records", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--stop-after", type=int, default=None, help="checkpoint and stop after N steps")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--checkpoint", default=None, help="default: DATA/ckpt.pt")
    args = p.parse_args()

    dist.init_process_group("gloo")
    train(args)
    # Leave the group cleanly (after a successful run; on an error torchrun stops the
    # ranks): every rank done, and the model, optimizer and loader (DDP's hooks hold
    # work on the group) freed with train's frame. Tearing the group down while a peer
    # still talks to it, or with gloo work alive at interpreter exit, aborts the process.
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_path = args.checkpoint or os.path.join(args.data, "ckpt.pt")
    if rank == 0:
        build_demo_dataset(args.data, args.num_records, num_shards=4)
    dist.barrier()

    ds = tg.Dataset(tg.ArrayRecordSource(args.data)).random_map(random_flip, seed=0)
    ds = ds.map(to_tensors)
    sampler = tg.GlobalShuffleSampler(ds, seed=0)  # rank and world size from the group
    loader = torch.utils.data.DataLoader(
        ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start_epoch, global_step = 0, 0
    if args.resume:
        state = torch.load(ckpt_path, weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        sampler.load_state_dict(state["sampler"])  # the world size may have changed
        start_epoch, global_step = state["epoch"], state["step"]
    run = "resume" if args.resume else "first"
    # closed explicitly on both exits below (a checkpoint-and-stop, or the end)
    log = open(os.path.join(args.data, f"consumed-rank{rank}-{run}.txt"), "w")  # noqa: SIM115

    t0 = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # same epoch as the checkpoint: keeps its position
        for step, batch in enumerate(loader, start=1):
            loss = torch.nn.functional.cross_entropy(
                model(batch["image"].float() / 255), batch["label"]
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            global_step += 1
            log.write(f"{epoch} " + " ".join(map(str, batch["id"].tolist())) + "\n")
            if args.stop_after and global_step == args.stop_after and not args.resume:
                state = {
                    "model": model.module.state_dict(),
                    "optim": opt.state_dict(),
                    # what every rank consumed in this pass: step batches
                    "sampler": sampler.state_dict(consumed=step * args.batch_size),
                    "epoch": epoch,
                    "step": global_step,
                }
                if rank == 0:
                    torch.save(state, ckpt_path)
                log.close()
                print(f"rank {rank}: checkpoint at step {global_step} (epoch {epoch})")
                return
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.3f}, {global_step} steps")
    log.close()
    if rank == 0:
        print(f"done: {global_step} steps in {time.perf_counter() - t0:.1f}s on {world} ranks")


if __name__ == "__main__":
    main()
