"""A top-k gated mixture-of-experts FFN whose experts are split across an expert-parallel group: a layer to copy.

    groups = zero_engine.moe.expert_parallel_groups(ep_size=2)      # collective: every rank calls it
    block.mlp = zero_engine.moe.MoE(dim=64, hidden=256, num_experts=8, top_k=2, groups=groups)
    engine, *_ = zero_engine.initialize(model=model, config=cfg)     # ZeRO-3: experts sharded over their edp group

Each rank holds ``num_experts / ep_size`` experts; the tokens routed to an expert on another rank travel there and
back with two all-to-alls. The expert weights carry DeepSpeed's marks (``param.allreduce = False``,
``param.group_name = "ep_size_<k>"``, as ``deepspeed.moe.layer.MoE`` sets them and ``deepspeed.moe.utils.
is_moe_param`` reads them): zero_engine's engine reads the same marks (zero/expert.py) to shard and reduce those
parameters over their expert-data-parallel group instead of the whole world. Nothing else is hung on them.

[Note: expert-parallel rank layout]
DeepSpeed's (and torchtitan's ``ep`` borrowed from the data-parallel dims): the world of W ranks is a
(W / ep) x ep mesh with dims ("edp", "ep"), ep innermost. The ``ep`` group of a rank is the ep consecutive ranks
around it: they hold different experts and exchange tokens. Its ``edp`` (expert-data-parallel) group is the ranks
``r mod ep, r mod ep + ep, ...``: they hold the same experts, so ZeRO shards those over it (W / ep ranks), while
dense parameters are sharded over all W. ``expert_parallel_groups(k)`` builds that mesh once per world and ep size,
so the layer and the engine use the same groups.

[Note: dropless dispatch]
No capacity factor: every token reaches its top-k experts, whatever the load (MegaBlocks' and torchtitan's choice;
nothing is dropped, so the result is the single-process MoE's exactly, at any ep). The price is a data-dependent
all-to-all: each rank first exchanges its per-expert token counts (one small all-to-all), then the tokens (uneven
splits), and the expert outputs come back the same way. An expert that got no tokens still runs on its empty
slice, so every expert weight is in the graph on every rank (its gradient is zeros, not missing: the engine's
reduce-scatters stay the same on every rank).

[Note: gradients of expert weights]
The global loss is the mean of the W ranks' losses. A dense weight gets rank r's part from rank r alone: its
gradient is the average over the world. An expert weight on rank r gets the parts of every rank of its ep group
(the backward all-to-all brings them), and the ranks of its edp group hold the other parts: its gradient is the
*sum* over the edp group divided by W (the average over the edp group divided by ep). zero_engine applies that
(zero/expert.py); a hand-written data-parallel loop must do the same (tests/test_expert_parallel.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ExpertParallelGroups", "GroupedExperts", "MoE", "expert_group_name", "expert_parallel_groups",
           "ep_size_of_group_name"]

_GROUP_NAME = re.compile(r"ep_size_(\d+)")


def expert_group_name(param: torch.Tensor) -> Optional[str]:
    """DeepSpeed's mark of an expert parameter (``is_moe_param``): its group name, or None for a dense one."""
    if getattr(param, "allreduce", True):
        return None
    return getattr(param, "group_name", None) or "ep_size_1"


def ep_size_of_group_name(name: str, where: str = "") -> int:
    match = _GROUP_NAME.fullmatch(str(name))
    if match is None or int(match.group(1)) < 1:
        raise ValueError(f"{where or 'expert parameter'}: group_name {name!r} is not understood; expert parameters "
                         "are marked as DeepSpeed marks them, param.allreduce = False and param.group_name = "
                         "\"ep_size_<k>\" (k: the expert-parallel size)")
    return int(match.group(1))


@dataclass(frozen=True)
class ExpertParallelGroups:
    """The expert-parallel and expert-data-parallel groups of one ep size (see [Note: expert-parallel rank
    layout]). ``ep_group`` is None when ep_size is 1 (every expert local: no all-to-all)."""

    ep_size: int
    world_size: int
    rank: int
    ep_group: Any = None
    edp_group: Any = None
    device_mesh: Any = None
    world: Any = None  # the default group these were made in (a new world: new groups)

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def edp_size(self) -> int:
        return self.world_size // self.ep_size

    @property
    def group_name(self) -> str:
        return f"ep_size_{self.ep_size}"


_GROUPS: dict[int, ExpertParallelGroups] = {}


def expert_parallel_groups(ep_size: Optional[int] = None, device_type: Optional[str] = None,
                           mesh=None) -> ExpertParallelGroups:
    """The groups for ``ep_size`` in the current world, made once (collective the first time: every rank calls it,
    in the same order as its other group creations). ``device_type``: the DeviceMesh's (default: "cuda" under
    nccl, else "cpu"). ``mesh``: a DeviceMesh of dims ("edp", "ep") to take them from instead (the same one given
    to ``zero_engine.initialize(mesh=...)``); it becomes the groups of its ep size."""
    if mesh is not None:
        return _groups_of_mesh(mesh)
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"expert_parallel_groups: ep_size={ep_size!r} must be a positive int")
    if not dist.is_initialized():
        if ep_size == 1:
            return ExpertParallelGroups(1, 1, 0)
        raise RuntimeError(f"expert_parallel_groups(ep_size={ep_size}): torch.distributed is not initialized; call "
                           "zero_engine.init_distributed() (or launch with torchrun) first")
    world, rank = dist.get_world_size(), dist.get_rank()
    found = _GROUPS.get(ep_size)
    if found is not None and found.world is dist.group.WORLD and found.world_size == world:
        return found
    if world % ep_size:
        raise ValueError(f"expert_parallel_groups: ep_size={ep_size} does not divide the world of {world} ranks; "
                         f"use a divisor of {world}")
    if ep_size == 1:
        groups = ExpertParallelGroups(1, world, rank, None, dist.group.WORLD, None, dist.group.WORLD)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        device = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
        mesh = init_device_mesh(device, (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
        groups = ExpertParallelGroups(ep_size, world, rank, mesh.get_group("ep"), mesh.get_group("edp"), mesh,
                                      dist.group.WORLD)
    _GROUPS[ep_size] = groups
    return groups


def _groups_of_mesh(mesh) -> ExpertParallelGroups:
    names = tuple(mesh.mesh_dim_names or ())
    if names != ("edp", "ep"):
        raise ValueError(f"expert_parallel_groups(mesh=...): dims {names}; an expert-parallel mesh has dims "
                         "(\"edp\", \"ep\"), ep innermost (init_device_mesh(device, (world // ep, ep), "
                         "mesh_dim_names=(\"edp\", \"ep\")))")
    world, rank = dist.get_world_size(), dist.get_rank()
    if mesh.size() != world or not torch.equal(mesh.mesh.flatten().cpu(), torch.arange(world)):
        raise NotImplementedError(f"expert_parallel_groups(mesh=...): ranks {mesh.mesh.tolist()}; only a mesh over "
                                  "every rank laid out by init_device_mesh (ep innermost) is supported yet")
    ep_size = int(mesh.mesh.shape[1])
    groups = ExpertParallelGroups(ep_size, world, rank, mesh.get_group("ep") if ep_size > 1 else None,
                                  mesh.get_group("edp"), mesh, dist.group.WORLD)
    _GROUPS[ep_size] = groups
    return groups


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


class GroupedExperts(nn.Module):
    """This rank's experts, as two batched weights (torchtitan's GroupedExperts): expert e is
    ``gelu(x @ w1[e]) @ w2[e]``. ``forward(x, counts)``: rows of ``x`` grouped by expert, ``counts[e]`` of them."""

    def __init__(self, num_local: int, dim: int, hidden: int, w1: torch.Tensor, w2: torch.Tensor, group_name: str):
        super().__init__()
        self.num_local = num_local
        self.w1 = nn.Parameter(w1)
        self.w2 = nn.Parameter(w2)
        for p in (self.w1, self.w2):  # DeepSpeed's marks (deepspeed/moe/layer.py): read by zero/expert.py
            p.allreduce = False
            p.group_name = group_name

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # every expert runs, also on an empty slice: see [Note: dropless dispatch]
        chunks = x.split(counts)
        return torch.cat([F.gelu(chunk @ self.w1[e]) @ self.w2[e] for e, chunk in enumerate(chunks)])


class MoE(nn.Module):
    """Top-k gated MoE FFN (Mixtral's routing: softmax over all experts, keep the top k, renormalise), dropless,
    with ``num_experts / groups.ep_size`` experts on each rank.

    Every rank draws the initial weights of all ``num_experts`` experts from its generator and keeps its own: with
    the same seed the model is the same whatever the ep size (one process holding every expert included)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 2,
                 groups: Optional[ExpertParallelGroups] = None):
        super().__init__()
        groups = groups or ExpertParallelGroups(1, 1, 0)
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be between 1 and num_experts={num_experts}")
        if num_experts % groups.ep_size:
            raise ValueError(f"MoE: num_experts={num_experts} is not divisible by the expert-parallel size "
                             f"ep_size={groups.ep_size}; every ep rank holds the same number of experts, so use an "
                             f"ep_size that divides {num_experts} (or a multiple of {groups.ep_size} experts)")
        self.dim, self.num_experts, self.top_k, self.groups = dim, num_experts, top_k, groups
        self.num_local = num_experts // groups.ep_size
        self.gate = nn.Linear(dim, num_experts, bias=False)
        w1 = torch.randn(num_experts, dim, hidden) * dim ** -0.5
        w2 = torch.randn(num_experts, hidden, dim) * hidden ** -0.5
        mine = slice(groups.ep_rank * self.num_local, (groups.ep_rank + 1) * self.num_local)
        self.experts = GroupedExperts(self.num_local, dim, hidden, w1[mine].clone(), w2[mine].clone(),
                                      groups.group_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)
        probs = self.gate(x).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        flat_chosen = chosen.reshape(-1)  # token t's k choices at t*k .. t*k+k-1
        order = flat_chosen.argsort(stable=True)  # the (token, choice) pairs grouped by expert
        token_of = order // self.top_k
        counts = torch.bincount(flat_chosen, minlength=self.num_experts)
        out = self._run_experts(x[token_of], counts)
        out = out * weights.reshape(-1)[order].unsqueeze(1)
        return x.new_zeros(x.shape).index_add(0, token_of, out).reshape(shape)

    def _run_experts(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``routed``: rows grouped by (global) expert, ``counts`` per expert; returns their outputs, same order."""
        ep, local = self.groups.ep_size, self.num_local
        if ep == 1:
            return self.experts(routed, counts.tolist())
        group = self.groups.ep_group
        # how many rows each rank of the ep group sends for each of this rank's experts: [source rank, local expert]
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)
        received_counts = received_counts.view(ep, local)
        in_splits = counts.view(ep, local).sum(dim=1).tolist()
        out_splits = received_counts.sum(dim=1).tolist()
        received = _AllToAll.apply(routed, out_splits, in_splits, group)  # by source rank, then by local expert
        expert_of = torch.repeat_interleave(torch.arange(local, device=counts.device).repeat(ep),
                                            received_counts.reshape(-1))
        by_expert = expert_of.argsort(stable=True)
        done = self.experts(received[by_expert], received_counts.sum(dim=0).tolist())
        back = done[by_expert.argsort()]  # by source rank again
        return _AllToAll.apply(back, in_splits, out_splits, group)
