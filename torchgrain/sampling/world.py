"""World discovery: how many processes split the data, and which one this is.

Decided when a sampler is used, not when it is built: explicit values, else the
initialised process group, else torchrun's ``WORLD_SIZE``/``RANK`` environment, else a
single process.
"""

from __future__ import annotations

import operator
import os

__all__ = ["check_world", "resolve_world"]


def check_world(num_replicas: int, rank: int) -> tuple[int, int]:
    """``(num_replicas, rank)`` as ints, checked: ``ValueError`` unless ``num_replicas
    >= 1`` and ``0 <= rank < num_replicas`` (DistributedSampler's message).

    Example:
        >>> check_world(4, 3)
        (4, 3)
    """
    num_replicas, rank = operator.index(num_replicas), operator.index(rank)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(
            f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
        )
    return num_replicas, rank


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def resolve_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """World size and rank, decided now: explicit values, else the initialised process
    group, else torchrun's ``WORLD_SIZE``/``RANK`` environment, else (1, 0).

    A process started by a launcher (``WORLD_SIZE > 1``), or given ``num_replicas > 1``,
    without a rank (``rank=``, ``RANK`` or a process group) cannot know its part of the
    data: that raises instead of silently reading everything (or rank 0's part in every
    process), as :class:`~torch.utils.data.DistributedSampler` does.

    Example:
        >>> resolve_world(4, 1)
        (4, 1)
        >>> resolve_world(None, None)  # no process group, no launcher here
        (1, 0)
    """
    import torch.distributed as dist

    if num_replicas is None or rank is None:
        if dist.is_available() and dist.is_initialized():
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        else:
            env_world = _env_int("WORLD_SIZE")
            if num_replicas is None:
                num_replicas = env_world if env_world is not None and env_world > 1 else 1
                told = f"WORLD_SIZE={env_world} is set"
            else:
                told = f"num_replicas={num_replicas} is given"
            if rank is None and num_replicas > 1:
                # torchrun's RANK, never rank 0 in every process.
                rank = _env_int("RANK")
                if rank is None:
                    raise RuntimeError(
                        f"{told} but RANK is not, and no torch.distributed process group is "
                        "initialised, so this process cannot tell which part of the data is "
                        "its own. Call torch.distributed.init_process_group() before "
                        "iterating the sampler, or pass num_replicas= and rank="
                    )
            rank = 0 if rank is None else rank
    return check_world(num_replicas, rank)
