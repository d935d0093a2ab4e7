"""Splitting an epoch's seeds across the ranks of a torch.distributed job.

Data-parallel training (DDP) runs one process per rank, each with its own
loader over its own share of the seeds.  Every rank must take the *same
number* of optimiser steps per epoch: DDP all-reduces gradients at every
``backward()``, so a rank with one batch more than the others blocks forever
in that all-reduce.  :func:`shard_seeds` therefore gives every rank exactly
the same number of seeds, the way ``torch.utils.data.DistributedSampler``
does:

- ``drop_last=False``: the permutation is padded to a multiple of the world
  size by repeating its first seeds (a few seeds are trained on twice per
  epoch, none is left out);
- ``drop_last=True``: the last ``n % world_size`` seeds of the permutation are
  left out (they differ per epoch when shuffling).

Rank ``r`` takes positions ``r, r + W, r + 2W, ...`` of the padded
permutation, so the ranks' shares are disjoint apart from the padding.
"""

from __future__ import annotations

import torch

from .._integers import Count, integer
from ..errors import ConfigError


def ddp_rank_and_world_size() -> tuple[int, int]:
    """``(rank, world_size)`` of the default torch.distributed process group.

    Raises :class:`~pingpong.ConfigError` naming the fix when torch.distributed is
    unavailable or ``init_process_group`` has not been called.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("use_ddp=True: this torch build has no torch.distributed")
    if not dist.is_initialized():
        raise ConfigError(
            "use_ddp=True needs torch.distributed: call "
            "torch.distributed.init_process_group(...) in every rank before "
            "building the loader"
        )
    return dist.get_rank(), dist.get_world_size()


def resolve_rank(use_ddp: bool, num_replicas: Count | None, rank: Count | None) -> tuple[int, int]:
    """``(rank, world_size)`` for a loader, ``DistributedSampler``-style.

    Explicit ``num_replicas`` and ``rank`` (both or neither) win; otherwise
    ``use_ddp=True`` reads them from the default process group and
    ``use_ddp=False`` means one rank of one.  ``ValueError`` for a lone or bad
    value.
    """
    if num_replicas is None and rank is None:
        return ddp_rank_and_world_size() if use_ddp else (0, 1)
    if num_replicas is None or rank is None:
        raise ConfigError(
            f"give both num_replicas and rank, or neither; got num_replicas={num_replicas!r}, "
            f"rank={rank!r}"
        )
    for name, value in (("num_replicas", num_replicas), ("rank", rank)):
        if integer(value) is None:
            raise ConfigError(f"{name} must be an int, got {value!r}")
    num_replicas, rank = int(num_replicas), int(rank)
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ConfigError(f"need 0 <= rank < num_replicas, got rank={rank}, "
                         f"num_replicas={num_replicas}")
    return rank, num_replicas


def seeds_per_rank(num_seeds: int, world_size: int, drop_last: bool) -> int:
    """How many seeds each rank gets per epoch (the same on every rank)."""
    if drop_last:
        return num_seeds // world_size
    return -(-num_seeds // world_size)  # ceil


def shard_seeds(
    seeds: torch.Tensor, rank: int, world_size: int, drop_last: bool
) -> torch.Tensor:
    """Rank ``rank``'s share of ``seeds`` (already in this epoch's order).

    Contract: every rank gets :func:`seeds_per_rank` seeds; the shares of all
    ranks together are ``seeds`` (``drop_last=False``, plus the first
    ``padding`` seeds again) or its first ``world_size * (n // world_size)``
    seeds (``drop_last=True``).  The result is contiguous;
    ``world_size == 1`` returns ``seeds`` as is.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if world_size == 1:
        return seeds
    n = seeds.shape[0]
    total = world_size * seeds_per_rank(n, world_size, drop_last)
    if total > n:
        if n == 0:
            raise ConfigError("cannot pad an empty seed set across ranks")
        repeats = -(-(total - n) // n)
        padded = torch.cat([seeds, seeds.repeat(repeats)[: total - n]])
    else:
        padded = seeds[:total]
    return padded[rank:total:world_size].contiguous()
