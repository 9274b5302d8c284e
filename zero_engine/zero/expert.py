"""Expert parameters' shard group: MoE experts sharded and reduced over their expert-data-parallel group.

An expert parameter is marked as DeepSpeed marks it (``param.allreduce = False``, ``param.group_name =
"ep_size_<k>"``; zero_engine/moe.py's layer does, as ``deepspeed.moe.layer.MoE`` does). The ranks of one ep group
hold *different* experts; the ranks of its expert-data-parallel (edp) group, W / k of them, hold the same ones (see
[Note: expert-parallel rank layout] in moe.py). So at ZeRO-3 (stages 0-2: below):

* a dense parameter is sharded over the whole data-parallel world, as always (``ShardedParam.group`` None);
* an expert parameter is sharded over its edp group (``ShardedParam.group``: a ``ShardGroup``): its shards, its
  all-gathers (``GroupedGather`` routes each parameter of a gather to its group's gatherer), its gradient
  reduce-scatter (grads.py cuts buckets where the group changes and runs each on its group) and its fp32 master and
  optimizer states are 1 / (W / k) of its size on each rank.

[Note: the gradient norm counts every element once]
Each rank sums the squares of all its gradient shards, dense and expert, and one all-reduce over the world adds
them (optimizer.py, unchanged): a dense element lives in exactly one rank's shard; an expert element lives in one
rank's shard of its edp group, and the other ep ranks' edp groups hold other experts. So every element is counted
exactly once, with one reduction.

Checkpoints, ``save_16bit_model`` and ``zero_engine.hf.save_pretrained`` hold each expert parameter whole, its ep
ranks' tensors concatenated along dim 0 (the ``[num_experts, ...]`` weight): see [Note: checkpoints of expert
parameters] in checkpoint/_metadata.py.

Parameter offload moves an expert's shard as it moves a dense one (the offload wrappers read a shard bucket in, or
copy it to the device, before the gather, whichever group the gather then runs on).

At stages 0-2 every parameter stays whole (an expert: its ep rank's experts). At stages 1-2 the gradient
reduce-scatter, the fp32 masters and optimizer states, and the refresh gather after the step (wiring.py) are its
group's as at stage 3; at stage 0 the gradient all-reduce is (see [Note: stage 0 with experts] in optimizer.py).

Not supported yet, refused at initialize naming the parameter: a hierarchical mesh (MiCS / HSDP).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..moe import ep_size_of_group_name, expert_group_name, expert_parallel_groups

__all__ = ["ShardGroup", "GroupedGather", "expert_shard_groups", "init_shard_group", "whole_expert_on_rank0"]


@dataclass(frozen=True)
class ShardGroup:
    """The group some parameters are sharded and reduced over instead of the engine's shard group."""

    name: str  # DeepSpeed's group name, "ep_size_<k>"
    comm: Any  # a Communicator over the edp group, sharing the world's progress records and watchdog
    # [Note: gradients of expert weights] in moe.py: the sum over the edp group divided by the world, i.e. the
    # reduce-scatter's average over the edp group times edp / world (= 1 / ep size)
    grad_scale: float
    # ZeRO++ hpZ: the secondary group of these parameters, k consecutive ranks of the edp group; None without hpZ, or
    # when k is the whole edp group or more (then backward gathers from the primary shards): see [Note: hpZ of experts]
    hpz_comm: Any = None


def expert_shard_groups(model: nn.Module, engine) -> dict[int, ShardGroup]:
    """id(param) -> its ShardGroup, for every marked expert parameter of ``model`` whose ep size is above 1 (an
    ``ep_size_1`` expert is held by every rank: it is dense for ZeRO). Collective when it makes the groups."""
    marked = [(name, p, expert_group_name(p)) for name, p in model.named_parameters()]
    marked = [(name, p, group) for name, p, group in marked if group is not None]
    sizes = {group: ep_size_of_group_name(group, name) for name, _, group in marked}
    marked = [(name, p, group) for name, p, group in marked if sizes[group] > 1]
    if not marked:
        return {}
    _refuse_unsupported(engine, marked[0][0], marked[0][2])
    world_comm = engine.comm
    groups: dict[str, ShardGroup] = {}
    for group_name in sorted({group for _, _, group in marked}):  # the same order on every rank
        ep = sizes[group_name]
        if world_comm.world_size % ep:
            name = next(n for n, _, g in marked if g == group_name)
            raise ValueError(f"{name}: group_name {group_name!r}: ep size {ep} does not divide the data-parallel "
                             f"world of {world_comm.world_size} ranks; use an ep size that divides it")
        from ..comm import Communicator

        found = expert_parallel_groups(ep, engine.device.type)
        watched = dict(debug=world_comm.debug, collective_timeout_s=world_comm.collective_timeout_s,
                       share_records_with=world_comm)
        hpz = _hpz_group(engine, found, group_name)
        groups[group_name] = ShardGroup(group_name, Communicator(found.edp_group, **watched),
                                        found.edp_size / world_comm.world_size,
                                        Communicator(hpz, **watched) if hpz is not None else None)
    return {id(p): groups[group] for _, p, group in marked}


def _hpz_group(engine, found, group_name: str):
    """[Note: hpZ of experts] hpZ's secondary partition of an expert parameter lies within its edp group (the ranks
    holding the same experts): k consecutive edp ranks of one ep rank, world ranks ``(b * k + j) * ep + e``, from a
    (edp / k, k, ep) mesh, so the expert's backward gathers stay among k ranks as a dense one's do. Its ranks are ep
    apart: within a node when k x ep ranks are (checked against LOCAL_WORLD_SIZE). None when hpZ is off, or k covers
    the whole edp group (the primary gather already runs within it)."""
    k, edp, ep = engine.mesh.hpz_size, found.edp_size, found.ep_size
    if k == 1 or k >= edp:
        return None
    key = "zero_optimization.zero_hpz_partition_size"
    if edp % k:
        raise ConfigError(f"{key}: {k} does not divide the {edp} ranks that hold the experts of {group_name!r} (its "
                          f"expert-data-parallel group); use a divisor of {edp}")
    from torch.distributed.device_mesh import init_device_mesh

    from ..mesh import require_hpz_within_node

    require_hpz_within_node(k, ep, "ep", f" of the experts of {group_name!r}")

    mesh = init_device_mesh(engine.device.type, (edp // k, k, ep), mesh_dim_names=("hpz_replicate", "hpz_shard", "ep"))
    return mesh.get_group("hpz_shard")


def init_shard_group(param, made: dict[str, ShardGroup]) -> ShardGroup | None:
    """zero.Init's shard group for ``param``: its edp group if it is an expert parameter of ep size above 1 (made by
    ``expert_parallel_groups``, as the layer's; one per group name in ``made``), else None. The engine takes such a
    parameter as zero.Init sharded it (wiring.py) and puts its own ShardGroup, watched as its other communicators, in
    its place."""
    group_name = expert_group_name(param)
    if group_name is None or ep_size_of_group_name(group_name) == 1:
        return None
    if group_name not in made:
        from ..comm import Communicator

        found = expert_parallel_groups(ep_size_of_group_name(group_name))
        made[group_name] = ShardGroup(group_name, Communicator(found.edp_group), found.edp_size / found.world_size)
    return made[group_name]


def _refuse_unsupported(engine, name: str, group: str) -> None:
    why = None
    if engine.mesh.is_hierarchical:
        why = f"a hierarchical mesh ({engine.mesh.describe()})"
    if why is not None:
        raise NotImplementedError(
            f"{name} is an expert parameter ({group!r}: sharded over its expert-data-parallel group); together with "
            f"{why} this is not supported yet. Use a flat data-parallel world (no MiCS / HSDP), or build the model "
            "with ep_size 1 (every expert on every rank)")


def whole_expert_on_rank0(shard: torch.Tensor, comm, edp: int, numel: int, shape) -> torch.Tensor | None:
    """An expert parameter whole on world rank 0 (None elsewhere): every rank's flat ``shard`` of it over its ``edp``
    ranks (at stage 0 the whole ep-local tensor: edp copies of one piece) gathered over the world ``comm``, its ep
    ranks' tensors of ``numel`` elements concatenated along dim 0 ([Note: checkpoints of expert parameters] in
    checkpoint/_metadata.py). Collective over the world; rank 0 holds the world's shards."""
    world, shard_numel = comm.world_size, shard.numel()
    ep = world // edp
    rows = torch.empty(world, shard_numel, dtype=shard.dtype, device=shard.device) if comm.rank == 0 else None
    comm.gather(rows, shard.contiguous(), dst=0, name="an expert parameter whole on rank 0")
    if rows is None:
        return None
    # world rank d * ep + e holds shard d of ep rank e's tensor: rows [edp, ep] -> [ep, edp], each ep rank's unpadded
    pieces = rows.view(edp, ep, shard_numel).transpose(0, 1).reshape(ep, edp * shard_numel)[:, :numel]
    return pieces.reshape((ep * shape[0], *shape[1:]) if len(shape) else (ep,))


class GroupedGather:
    """A gatherer that routes each parameter to its group's gatherer (``ShardedParam.group``; None: the engine's
    shard group) and returns one work covering them all. Every rank issues the same collectives on each group in the
    same order (the same parameters, in order), so groups never wait on each other. Each group's gatherer may be any
    strategy (exact or qwZ's, zero/quantize.py): their works are waited in turn."""

    def __init__(self, dense, by_group: dict[str, Any]):
        self.dense = dense
        self.by_group = by_group
        self.name = dense.name

    def issue(self, params, name: str = "", refresh: bool = False):
        split: dict[str | None, list] = {}
        for p in params:
            split.setdefault(None if p.group is None else p.group.name, []).append(p)
        works = [(self.dense if key is None else self.by_group[key]).issue(ps, name=name, refresh=refresh)
                 for key, ps in split.items()]
        return works[0] if len(works) == 1 else _GroupedWork(list(params), works)


@dataclass
class _GroupedWork:
    """The works of one gather split by group (the GatherWork interface): ``wait()`` finishes each, which makes its
    parameters available and uncounts its staging buffers."""

    params: list
    works: list
    keep_alive: list = field(default_factory=list)  # inputs an offload wrapper adds (param_host.py), until wait()
    done: bool = False

    @property
    def numel(self) -> int:
        return sum(work.numel for work in self.works)

    def wait(self) -> None:
        if self.done:
            return
        for work in self.works:
            work.wait()
        self.keep_alive.clear()
        self.done = True
