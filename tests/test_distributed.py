"""The samplers inside real torch.distributed (gloo) process groups.

Each rank builds its samplers without num_replicas/rank, so world size and rank
come from the process group; results are gathered to rank 0 and checked here.
"""

from __future__ import annotations

import collections
import itertools
import json
import os

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from torchgrain.sampling import BlockShuffleSampler, GlobalShuffleSampler

N = 1001
OFFSETS = np.concatenate([[0], np.cumsum(np.random.default_rng(0).integers(0, 60, 40))]).astype(
    np.int64
)


def _rank_main(rank: int, world: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        out = {}
        for name, make in [
            ("global", lambda: GlobalShuffleSampler(N, seed=3)),
            ("block", lambda: BlockShuffleSampler(None, block_offsets=OFFSETS, window=3, seed=3)),
        ]:
            s = make()
            assert (s.num_replicas, s.rank) == (world, rank)
            s.set_epoch(2)
            full = list(s)
            # Resume in lockstep: every rank stops after 10 and saves its state.
            s.set_epoch(5)
            it = iter(s)
            head = list(itertools.islice(it, 10))
            state = s.state_dict()
            states = [None] * world
            dist.all_gather_object(states, state)
            gathered = [None] * world
            dist.all_gather_object(gathered, {"full": full, "head": head})
            out[name] = {"ranks": gathered, "states_equal": all(x == states[0] for x in states)}
            out[name]["state"] = states[0]
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump(out, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_samplers_in_gloo_process_group(tmp_path, world):
    mp.spawn(_rank_main, args=(world, str(tmp_path)), nprocs=world, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    for name, total in [("global", N), ("block", int(OFFSETS[-1]))]:
        ranks = result[name]["ranks"]
        fulls = [r["full"] for r in ranks]
        assert len({len(f) for f in fulls}) == 1  # equal counts
        counts = collections.Counter(itertools.chain(*fulls))
        assert set(counts) == set(range(total))  # union covers everything
        # disjoint apart from padding: fewer than `world` repeats in total
        assert sum(counts.values()) - total == len(fulls[0]) * world - total < world
        assert result[name]["states_equal"]

        # The gathered state, loaded at world size 1, continues with exactly the rest.
        state = result[name]["state"]
        if name == "global":
            t = GlobalShuffleSampler(N, num_replicas=1, rank=0)
        else:
            t = BlockShuffleSampler(None, block_offsets=OFFSETS, num_replicas=1, rank=0)
        t.load_state_dict(state)
        heads = list(itertools.chain(*(r["head"] for r in ranks)))
        assert len(set(heads)) == len(heads) == 10 * world
        assert sorted(heads + list(t)) == list(range(total))
