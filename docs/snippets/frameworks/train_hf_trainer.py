"""HF Trainer with a torchgrain sampler: `torchrun --nproc_per_node=2 train_hf_trainer.py` (or
`python train_hf_trainer.py` for one process). It saves a checkpoint every 10 steps; run it again
to resume from the last one."""

import os
import shutil

import numpy as np
import torch
import torch.distributed.nn  # before the process group exists: see the end
from transformers import TrainingArguments

import torchgrain as tg
from torchgrain.frameworks.transformers import Trainer  # transformers.Trainer + SamplerMixin


def make_dataset(path="data/train", n=2000):
    """``n`` records ``{"x": float32[4], "y": float}`` as ArrayRecord shards, made by the
    first process of the job that gets there (the others find it complete)."""
    if not os.path.exists(path):
        x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
        records = [{"x": x[i], "y": float(x[i].sum())} for i in range(n)]
        tmp = f"{path}.{os.getpid()}"
        tg.write_array_record(records, tmp, num_shards=4)
        try:
            os.rename(tmp, path)  # whole, or not at all
        except OSError:  # another process was first
            shutil.rmtree(tmp)
    return tg.Dataset(tg.ArrayRecordSource(path))


class Model(torch.nn.Module):  # forward takes the record's keys, returns the loss
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return {"loss": (self.layer(x).squeeze(1) - y).pow(2).mean()}


model, ds, output_dir = Model(), make_dataset(), "trainer-out"
resume = os.path.isdir(output_dir) and any(
    d.startswith("checkpoint-") for d in os.listdir(output_dir)
)
# --8<-- [start:recipe]
args = TrainingArguments(
    output_dir,
    per_device_train_batch_size=64,
    dataloader_num_workers=2,
    remove_unused_columns=False,
    num_train_epochs=2,
    save_steps=10,
    use_cpu=True,
    report_to=[],
    disable_tqdm=True,
)
trainer = Trainer(
    model=model, args=args, train_dataset=ds, train_sampler=tg.GlobalShuffleSampler(ds, seed=0)
)  # default: seed=args.seed
trainer.train(resume_from_checkpoint=resume)  # True: from the last checkpoint in output_dir
# --8<-- [end:recipe]
print(f"done at step {trainer.state.global_step}", flush=True)  # one write: ranks share stdout
# Free the Trainer, then end the group. A gloo group left to the interpreter's exit can
# abort it, and the Trainer's objects (its DDP model) hold the group in reference cycles.
# The other order can hang: a collection that frees the last hold on an ended group joins
# its threads while holding the GIL, which a thread freeing a finished collective's
# tensors waits for. torch.distributed.nn is imported above: first imported after the
# group exists (DDP does), its functions keep the group as their default argument.
accelerator = trainer.accelerator
del trainer
accelerator.free_memory()  # (collects)
accelerator.end_training()
