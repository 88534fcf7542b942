"""Behaviour the line cuts in caches, transforms and convert's plan must keep."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from torchgrain import caches
from torchgrain.convert.journal import plan_tasks
from torchgrain.transforms import _GeneratorRandom


def test_list_caches_counts_a_file_below_the_recursion_limits_depth(tmp_path):
    cache = tmp_path / "shards"
    dirs = [str(cache)]
    for _ in range(sys.getrecursionlimit() + 50):
        dirs.append(os.path.join(dirs[-1], "d"))
    for d in dirs:
        os.mkdir(d)
    deepest = os.path.join(dirs[-1], "f.bin")
    with open(deepest, "wb") as f:
        f.write(b"x" * 10)
    try:
        (listed,) = caches.list_caches(tmp_path)
        assert (listed["name"], listed["bytes"], listed["entries"]) == ("shards", 10, 1)
    finally:  # (shutil.rmtree recurses as well)
        os.unlink(deepest)
        for d in reversed(dirs):
            os.rmdir(d)


def test_zero_random_bits_leave_the_records_generator_as_it_was():
    g = _GeneratorRandom()
    g.gen = np.random.default_rng(5)
    assert (g.getrandbits(0), g.randbytes(0)) == (0, b"")
    assert g.random() == np.random.default_rng(5).random()


@pytest.mark.parametrize("counts", [[1, 2], [1, 2, 3, 4]], ids=["fewer", "more"])
def test_a_plan_per_input_has_one_task_per_input_or_refuses(counts):
    try:
        tasks = plan_tasks(counts, 3, None, "array_record")
    except (IndexError, ValueError):
        return  # refused: no input left out
    assert [t.name for t in tasks] == [f"data-0000{i}-of-00003.array_record" for i in range(3)]
    assert [t.pieces for t in tasks] == [[(i, 0, None)] for i in range(3)]
