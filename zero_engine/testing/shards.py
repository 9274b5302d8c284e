"""Whole values put together from an engine's shards by the test itself (not by the engine's own gather paths), so a
parity test compares against one process what the ranks really hold."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

__all__ = ["gathered_params", "whole_from_shards"]


def whole_from_shards(engine, tensor_of: Optional[Callable] = None,
                      params: Optional[Iterable] = None) -> dict[str, torch.Tensor]:
    """Each ShardedParam's whole value (name -> tensor of its shape): ``tensor_of(sp)`` (default: the compute-dtype
    shard; a master or an optimizer state works too) all-gathered over the engine's shard group, padding dropped.
    Collective over that group. ``params``: a subset of ``engine.sharded``."""
    out = {}
    for sp in engine.sharded if params is None else params:
        shard = sp.shard if tensor_of is None else tensor_of(sp)
        if shard.numel() and shard.untyped_storage().nbytes() == 0:  # the collective would read freed memory
            raise RuntimeError(f"whole_from_shards: {sp.fqn}'s shard is not in memory (NVMe parameter offload "
                               "swapped it out); use gathered_params, which reads the shards in")
        buf = torch.empty(sp.padded_numel, dtype=shard.dtype)
        dist.all_gather_into_tensor(buf, shard.contiguous(), group=engine.shard_comm.group)
        out[sp.fqn] = buf[: sp.numel].view(sp.shape)
    return out


def gathered_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter's whole compute-dtype value (name -> a copy), through the engine's own gather
    (``GatheredParameters``), which reads offloaded shards in first. Collective over the engine's ranks."""
    from ..zero import GatheredParameters

    named = list(engine.module.named_parameters())
    with GatheredParameters([p for _, p in named]):
        return {name: p.detach().clone() for name, p in named}
