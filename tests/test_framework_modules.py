"""torchgrain/frameworks: the only code that knows what torch and Accelerate keep private.

Each module is checked against the installed framework's real classes (so a new torch or
Accelerate release that moves things fails here, not silently in a training job), and
the rest of the package is checked to keep out of their private parts.
"""

from __future__ import annotations

import ast
import collections
import io
import os
import re
import tokenize
import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader

import torchgrain as tg
from torchgrain.frameworks import accelerate as fw_accelerate
from torchgrain.frameworks import dataloader as fw_dataloader
from torchgrain.sampling import GlobalShuffleSampler, LoaderBinding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What reading torch's, Accelerate's or Lightning's private parts looks like in code.
PRIVATE = re.compile(
    r"_getframe|f_locals|f_back|_index_sampler|_BaseDataLoaderIter|_worker_loop|data_queue"
    r"|_num_workers|[\"']_dataset[\"']|\. _dataset\b|\. _utils\b"
    r"|^\s*(import|from) (accelerate|lightning|pytorch_lightning)\b"
    r"|[\"'](accelerate|lightning|pytorch_lightning)[.\"']"
)


@pytest.fixture
def no_launcher_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _code_lines(path):
    """(line number, code) of a module, comments and docstrings left out."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    prose = set()
    for node in ast.walk(ast.parse(source)):
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            prose.update(range(node.lineno, node.end_lineno + 1))
    lines = collections.defaultdict(str)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or tok.start[0] in prose:
            continue
        lines[tok.start[0]] += tok.string + " "
    return sorted(lines.items())


def test_private_framework_parts_are_read_only_in_torchgrain_frameworks():
    found = []
    package = os.path.join(ROOT, "torchgrain")
    for folder, _, files in os.walk(package):
        if os.path.relpath(folder, package).split(os.sep)[0] == "frameworks":
            continue
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            for number, code in _code_lines(path):
                if PRIVATE.search(code):
                    found.append(f"{os.path.relpath(path, ROOT)}:{number}: {code}")
    assert not found, "\n".join(found)


# --------------------------------------------------------------------- torch DataLoader


class Probe(torch.utils.data.Dataset):
    """Records what the frameworks.dataloader lookups see from inside a batch read."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        it = fw_dataloader.loader_iterator(skip=1)
        return {
            "i": i,
            "found": it is not None and fw_dataloader.iterator_dataset(it) is self,
            "key": id(fw_dataloader.iterator_key(it)) if it is not None else 0,
            "pipe": fw_dataloader.worker_result_pipe() or -1,
        }


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_lookups_find_the_loader_reading_a_batch(workers):
    loader = DataLoader(
        Probe(),
        batch_size=4,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )
    batches = list(loader)
    assert all(bool(x) for b in batches for x in b["found"])
    # Keyed like loader_key(loader), which reads public attributes only (a forked worker
    # sees the parent's objects at the same addresses).
    assert {int(k) for b in batches for k in b["key"]} == {id(fw_dataloader.loader_key(loader))}
    pipes = {int(p) for b in batches for p in b["pipe"]}
    assert (pipes == {-1}) if workers == 0 else (-1 not in pipes)
    unbatched = DataLoader(Probe(), batch_size=None)
    assert fw_dataloader.loader_key(unbatched) is unbatched.sampler
    assert fw_dataloader.loader_iterator() is None  # no loader on this stack


def test_unbound_sampler_finds_the_driving_loader_shape():
    sampler = GlobalShuffleSampler(12, num_replicas=1, rank=0)
    shapes = []

    class Spy(BatchSampler):
        def __iter__(self):
            shapes.append(fw_dataloader.driving_loader_shape(sampler, skip=1))
            yield from super().__iter__()

    list(DataLoader(list(range(12)), batch_sampler=Spy(sampler, 5, False)))
    assert shapes == [(5, 0)]
    assert fw_dataloader.driving_loader_shape(sampler) is None


# --------------------------------------------------------------------------- Accelerate


def _prepared(n=101, batch=10, **kw):
    from accelerate.data_loader import prepare_data_loader

    sampler = GlobalShuffleSampler(n, seed=1)
    loader = DataLoader(list(range(n)), batch_size=batch, sampler=sampler)
    return sampler, prepare_data_loader(loader, **kw)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("even", [True, False])
def test_accelerate_batch_sharding_is_described(split, even, no_launcher_env):
    pytest.importorskip("accelerate")
    sampler, loader = _prepared(
        num_processes=2, process_index=1, split_batches=split, even_batches=even
    )
    assert tg.bind(loader) is loader
    step = 10 if split else 20
    assert sampler._binding == LoaderBinding(
        batch_size=10,
        num_workers=0,
        sharder="accelerate.data_loader.BatchSamplerShard",
        step=step,
        pad_to=step if even else 1,
    )
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    # Padded (even_batches) as Accelerate itself would fill the last step.
    assert len(sampler) == (-(-101 // step) * step if even else 101)


def test_accelerate_single_process_loader_splits_nothing(no_launcher_env):
    pytest.importorskip("accelerate")
    sampler, loader = _prepared(num_processes=1, process_index=0)
    assert fw_accelerate.describe(loader) is None
    tg.bind(loader)
    assert sampler._binding == LoaderBinding(batch_size=10, num_workers=0)


def test_accelerate_dispatcher_is_found_and_described(monkeypatch, no_launcher_env):
    pytest.importorskip("accelerate")
    from accelerate.state import PartialState

    PartialState()  # one process, made before the launcher variables below
    sampler, loader = _prepared(dispatch_batches=True, put_on_device=True)
    # As in rank 0 of 2: alone, the sampler would hand out half of the order. Unbound, it
    # finds the dispatcher behind the DataLoader iterator that draws from it.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    got = [i for b in loader for i in b.tolist()]
    assert got == list(GlobalShuffleSampler(101, seed=1, num_replicas=1, rank=0))
    assert sampler._external == "accelerate.data_loader.DataLoaderDispatcher"
    described = fw_accelerate.describe(loader)
    assert described["reads_for_all"] and described["step"] == 10 and described["pad_to"] == 1
    # Plain loaders and objects that do not draw from this sampler are not mistaken for it.
    assert fw_accelerate.describe(DataLoader(list(range(4)))) is None
    other = GlobalShuffleSampler(101, seed=1)
    assert fw_accelerate.sharder_driving(other) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(loader) == 11
