"""GatheredParameters: full parameters on every rank for the length of a ``with`` block.

    with zero_engine.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if dist.get_rank() == 0:
            model.lm_head.weight.zero_()      # kept: broadcast from rank 0, re-partitioned, fp32 master too

Without ``modifier_rank`` the block may only read: an edit is detected on exit (a fingerprint of each parameter
taken on entry) and raises instead of being silently dropped. Nested blocks and parameters already gathered (a
module in forward, a persistent parameter, stages 1-2) are fine: only what this block gathered is released.

With ``modifier_rank``, the modifier's full values are broadcast on exit and each rank takes its slice into its
shard; only the elements that changed (compared with the values from before the block: see [Note: edits are
compared with what the block found]) are written, so the fp32 master of everything not edited keeps its bits
instead of being rounded to 16 bits.

``fwd_module=module`` registers the parameters as external parameters of ``module`` (external.py), as DeepSpeed does.

An MoE expert parameter (zero_engine.moe) is gathered over its expert-data-parallel group: inside the block each
rank sees its own ep rank's experts. With ``modifier_rank`` each edp group keeps the edits of its member at the
modifier's place (``_modifier_of``): the modifier's own experts take its edits.

A parameter split by tensor parallelism (a DTensor on a mesh's ``tp`` dim) is gathered over the data-parallel
ranks only: inside the block it is a whole DTensor, ``param.to_local()`` this rank's tp piece and
``param.full_tensor()`` the whole tensor of the unsplit model (torch's all-gather over tp). Read-only for now.

A parameter the engine is prefetching when the block enters (the block sits in a forward, the parameter belongs
to a module that runs later) is waited for, not gathered again: it stays the engine's, released by its module.

[Note: edits are compared with what the block found]
A parameter the engine had gathered (in flight or whole when a block inside a forward enters) holds the values the
forward reads, and the block sees those: under qwZ (zero/quantize.py) they are int8-rounded, not the shard's. So
with ``modifier_rank`` the edits are the elements that differ from what the block found (this rank's slice, copied
at entry), not from the shard: compared with the shard, every rounded element would read as an edit and the
rounding would be written into the shards and fp32 masters. For a parameter the block gathered itself (exact) the
two are the same values, and no copy is made; the copies are this rank's slices (1/N of each parameter).

Engine calls inside the block (a forward, an eval loop, a training step) work: the parameters stay gathered for the
block (the engine's coordinator does not release what a block holds), a step rewrites them from their new shards
(``refresh_whole_params``; that update does not read as an edit), and the block's exit hands each one back to the
coordinator that counted it, so its live-parameter budget stays right.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..comm import Communicator, init_distributed
from .external import register_external_parameter
from .gather import SequentialGather
from .hpz import forget_secondaries
from .partition import ParamStatus, ShardedParam, sharded_param_of
from .tensor_parallel import is_dtensor
from .unit import release_if_unused

__all__ = ["GatheredParameters", "refresh_whole_params"]


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().reshape(-1).double()
    weights = torch.arange(x.numel(), dtype=torch.float64, device=x.device) % 251 + 1  # order-sensitive, cheap
    return torch.stack([x.sum(), (x * weights).sum()])


def _take_edits_into_shard(sp: ShardedParam, before: torch.Tensor | None = None) -> None:
    """Write the elements of this rank's slice of ``sp.full`` that the block changed into the shard and into every
    fp32 copy (master, or the master-to-be of a parameter no optimizer owns yet); the rest keep their bits.
    ``before``: that slice as the block found it, for a parameter the engine had gathered (see [Note: edits are
    compared with what the block found]); None: the block gathered it exactly, so its shard holds those values."""
    local = sp.local_slice()
    n = local.stop - local.start
    if n == 0:
        return
    shard = sp.shard[:n]
    new = sp.full[local].to(shard.device)  # compared where the shard is: the host under offload_param
    old = shard if before is None else before
    changed = (new != old) & ~(new.isnan() & old.isnan())
    if not bool(changed.any()):
        return
    shard.copy_(torch.where(changed, new, shard))
    for fp32 in (None if sp.master_is_shard else sp.master, sp.master_init):
        if fp32 is not None:  # on the host under offload_optimizer, the shard on the device
            fp32[:n].copy_(torch.where(changed.to(fp32.device), new.to(fp32.device, fp32.dtype), fp32[:n]))


def refresh_whole_params(sharded: list[ShardedParam], gatherer, name: str) -> None:
    """Re-gather the parameters of ``sharded`` that are whole now from their shards, which changed (the step, a
    load): persistent ones, all of them at stages 1-2, and those a block holds at stage 3. Then tell the open blocks
    (``rebase_open_blocks``)."""
    whole = [sp for sp in sharded if sp.is_available]
    if whole:
        gatherer.issue(whole, name=name, refresh=True).wait()
        rebase_open_blocks(whole)


def rebase_open_blocks(params: list[ShardedParam]) -> None:
    """The engine rewrote ``params``' whole values from their new shards (the refresh after a step or a load): every
    open block holding one of them takes what it found at entry again, so the engine's update is not taken for the
    user's edit at the block's exit: a read-only block its fingerprint, a modifier_rank block its copy of what the
    engine had gathered (dropped: the values are now the shard's, exactly). An edit made in the block before the
    refresh is overwritten by it, as a read-only block's exit would drop it."""
    if not GatheredParameters.open:  # the usual step: no block open, nothing to do
        return
    ids = {id(sp) for sp in params}
    for block in list(GatheredParameters.open):
        if block._fingerprints:
            block._fingerprints = [_fingerprint(sp.full[: sp.numel]) if id(sp) in ids else before
                                   for sp, before in zip(block.sharded, block._fingerprints)]
        for key in ids.intersection(block._before):
            del block._before[key]


class GatheredParameters:
    open: "weakref.WeakSet[GatheredParameters]" = weakref.WeakSet()  # blocks inside their ``with``

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True, *,
                 _comm: Communicator | None = None):
        """``fwd_module``: as in DeepSpeed, also register the parameters as external parameters of that module
        (``register_external_parameter``), so its forward gathers them from then on."""
        if isinstance(params, torch.Tensor):
            params = [params]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._comm = _comm  # the caller's Communicator (from_pretrained's, watched); default: a plain one
        self.sharded: list[ShardedParam] = []
        if enabled:
            for p in params:
                sp = sharded_param_of(p)
                if sp is not None and sp not in self.sharded:
                    self.sharded.append(sp)
                    if fwd_module is not None:
                        register_external_parameter(fwd_module, p)
        self._gathered: list[ShardedParam] = []
        self._fingerprints: list[torch.Tensor] = []
        self._before: dict[int, torch.Tensor] = {}  # modifier_rank: this rank's slices the engine had gathered

    def __enter__(self):
        if not self.sharded:
            return self
        if not dist.is_initialized():
            init_distributed()
        self.comm = self._comm if self._comm is not None else Communicator()
        if self.modifier_rank is not None and not 0 <= self.modifier_rank < self.comm.world_size:
            raise ValueError(f"GatheredParameters: modifier_rank={self.modifier_rank} is not a rank of this "
                             f"world (0..{self.comm.world_size - 1})")
        split = [sp.fqn for sp in self.sharded if is_dtensor(sp.param)]
        if self.modifier_rank is not None and split:
            raise NotImplementedError(
                f"GatheredParameters(modifier_rank={self.modifier_rank}): {', '.join(split)} are split by tensor "
                "parallelism (DTensors), whose pieces differ across tp ranks, and broadcasting edits of them is not "
                "supported yet; read them without modifier_rank, or set values with "
                "zero_engine.utils.safe_set_full_fp32_param (tp-local values)")
        for sp in self.sharded:
            if sp.status is ParamStatus.INFLIGHT:  # the engine's prefetch, issued on every rank: wait for it
                sp.live_owner.acquire([sp])  # (counted by that engine, released by its module: not ours to free)
        self._gathered = [sp for sp in self.sharded if sp.status is ParamStatus.NOT_AVAILABLE]
        if self._gathered:
            from ..utils import shard_comm_of, shards_in_memory_of

            # gathered over the group they are sharded on (a mesh's dp_shard under MiCS / HSDP; else the world);
            # modifier_rank's broadcast below is over the world
            gather_comm = shard_comm_of(self._gathered) or self.comm
            experts = [sp for sp in self._gathered if sp.group is not None]  # over their edp group (zero/expert.py)
            dense = [sp for sp in self._gathered if sp.group is None]
            with shards_in_memory_of(self._gathered):  # NVMe parameter offload: the shards read in for the gather
                for comm, params in [(gather_comm, dense)] + [(sp.group.comm, [sp]) for sp in experts]:
                    if params:
                        SequentialGather(comm).issue(params, name="GatheredParameters").wait()
        for sp in self.sharded:
            sp.held_by_user += 1
        if self.modifier_rank is not None:  # see [Note: edits are compared with what the block found]
            ours = {id(sp) for sp in self._gathered}
            self._before = {id(sp): sp.full[sp.local_slice()].to(sp.shard.device, copy=True)
                            for sp in self.sharded if id(sp) not in ours}
        else:
            self._fingerprints = [_fingerprint(sp.full[: sp.numel]) for sp in self.sharded]
        GatheredParameters.open.add(self)
        return self

    def _modifier_of(self, sp: ShardedParam):
        """The communicator and source rank of ``sp``'s broadcast on exit. An MoE expert parameter (zero/expert.py)
        holds other experts on each ep rank, so each of its edp groups (the ranks holding the same experts) takes the
        values of its member at the modifier's place in its own group: world rank r = d * ep + e is member d of ep
        rank e's edp group (moe.py's rank layout), so the modifier's experts take its edits, and every other ep rank's
        those of its member d. For modifier_rank 0 (member 0 everywhere) that is DeepSpeed's choice too: it reads
        modifier_rank as a rank of the parameter's own group and broadcasts over that group."""
        if sp.group is None:
            return self.comm, self.modifier_rank
        ep = self.comm.world_size // sp.group.comm.world_size
        return sp.group.comm, self.modifier_rank // ep

    def __exit__(self, exc_type, exc, tb):
        if not self.sharded:
            return False
        GatheredParameters.open.discard(self)
        edited = []
        try:
            if exc_type is None and self.modifier_rank is not None:
                from ..utils import states_in_memory_of

                with states_in_memory_of(self.sharded[0].param):  # NVMe optimizer offload: masters read in
                    for sp in self.sharded:  # the modifier's values everywhere, then the edits into shards, masters
                        comm, src = self._modifier_of(sp)
                        comm.broadcast(sp.full, src=src, name=f"GatheredParameters {sp.fqn}")
                        _take_edits_into_shard(sp, self._before.get(id(sp)))
                    forget_secondaries(self.sharded)  # hpZ: copies from before the edit are stale
            elif self.modifier_rank is None:
                edited = [sp.fqn or str(tuple(sp.shape)) for sp, before in zip(self.sharded, self._fingerprints)
                          if not torch.allclose(_fingerprint(sp.full[: sp.numel]), before, rtol=0, atol=0,
                                                equal_nan=True)]
        finally:
            for sp in self.sharded:
                sp.held_by_user -= 1
            # [Note: the release rule] in unit.py: kept if a running module or another block uses it; the engine
            # call inside the block that counted it as live (live_owner) uncounts it
            for sp in self._gathered:
                release_if_unused(sp)
        if edited and exc_type is None:
            raise RuntimeError(
                f"GatheredParameters(modifier_rank=None): {', '.join(edited)} changed inside the block on rank "
                f"{self.comm.rank}; without modifier_rank edits are not kept. Pass modifier_rank=<the rank whose "
                "edits to keep> to broadcast them and update the shards.")
        return False
