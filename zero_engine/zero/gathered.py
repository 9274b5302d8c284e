"""GatheredParameters: full parameters on every rank for the length of a ``with`` block.

    with zero_engine.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if dist.get_rank() == 0:
            model.lm_head.weight.zero_()      # kept: broadcast from rank 0, re-partitioned, fp32 master too

Without ``modifier_rank`` the block may only read: an edit is detected on exit (a fingerprint of each parameter
taken on entry) and raises instead of being silently dropped. Nested blocks and parameters already gathered (a
module in forward, a persistent parameter, stages 1-2) are fine: only what this block gathered is released.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Communicator, init_distributed
from .gather import SequentialGather
from .partition import ParamStatus, ShardedParam, sharded_param_of

__all__ = ["GatheredParameters"]


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().reshape(-1).double()
    weights = torch.arange(x.numel(), dtype=torch.float64, device=x.device) % 251 + 1  # order-sensitive, cheap
    return torch.stack([x.sum(), (x * weights).sum()])


class GatheredParameters:
    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if fwd_module is not None:
            raise NotImplementedError("GatheredParameters(fwd_module=...): registering gathered parameters as "
                                      "external parameters of a module is not supported by zero_engine; gather them "
                                      "inside that module's forward instead, or leave fwd_module unset")
        if isinstance(params, torch.Tensor):
            params = [params]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.sharded: list[ShardedParam] = []
        if enabled:
            for p in params:
                sp = sharded_param_of(p)
                if sp is not None and sp not in self.sharded:
                    self.sharded.append(sp)
        self._gathered: list[ShardedParam] = []
        self._fingerprints: list[torch.Tensor] = []

    def __enter__(self):
        if not self.sharded:
            return self
        if not dist.is_initialized():
            init_distributed()
        self.comm = Communicator()
        if self.modifier_rank is not None and not 0 <= self.modifier_rank < self.comm.world_size:
            raise ValueError(f"GatheredParameters: modifier_rank={self.modifier_rank} is not a rank of this "
                             f"world (0..{self.comm.world_size - 1})")
        for sp in self.sharded:
            if sp.status is ParamStatus.INFLIGHT:
                raise RuntimeError(f"GatheredParameters: {sp.fqn} is being gathered by the engine right now")
        self._gathered = [sp for sp in self.sharded if sp.status is ParamStatus.NOT_AVAILABLE]
        if self._gathered:
            SequentialGather(self.comm).issue(self._gathered, name="GatheredParameters").wait()
        if self.modifier_rank is None:
            self._fingerprints = [_fingerprint(sp.full[: sp.numel]) for sp in self.sharded]
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.sharded:
            return False
        edited = []
        try:
            if exc_type is None and self.modifier_rank is not None:
                for sp in self.sharded:  # the modifier's values everywhere, then into shards and fp32 masters
                    self.comm.broadcast(sp.full, src=self.modifier_rank, name=f"GatheredParameters {sp.fqn}")
                    sp.take_full_into_shard()
            elif self.modifier_rank is None:
                edited = [sp.fqn or str(tuple(sp.shape)) for sp, before in zip(self.sharded, self._fingerprints)
                          if not torch.allclose(_fingerprint(sp.full[: sp.numel]), before, rtol=0, atol=0,
                                                equal_nan=True)]
        finally:
            for sp in self._gathered:
                if sp.active_users == 0 and not sp.is_persistent:
                    sp.release()
        if edited and exc_type is None:
            raise RuntimeError(
                f"GatheredParameters(modifier_rank=None): {', '.join(edited)} changed inside the block on rank "
                f"{self.comm.rank}; without modifier_rank edits are not kept. Pass modifier_rank=<the rank whose "
                "edits to keep> to broadcast them and update the shards.")
        return False
