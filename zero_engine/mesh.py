"""The process groups an engine's collectives run on, described once: which ranks shard the model states, and which
hold replicas of them.

    engine, *_ = zero_engine.initialize(model=model, config=cfg)                    # flat: shard over every rank
    cfg["zero_optimization"]["mics_shard_size"] = 8                                 # MiCS / HSDP from the config
    mesh = init_device_mesh("cuda", (nodes, 8), mesh_dim_names=("dp_replicate", "dp_shard"))
    engine, *_ = zero_engine.initialize(model=model, config=cfg, mesh=mesh)         # or the same from a DeviceMesh
    engine, *_ = zero_engine.initialize(model=model, config=cfg, mpu=mpu)           # DeepSpeed's mpu (dp only)

Dim names are torchtitan's: ``dp`` (every data-parallel rank: ZeRO as it always was), or ``dp_replicate`` x
``dp_shard`` (HSDP / MiCS: model states sharded within each ``dp_shard`` group of k ranks, replicated across the
``dp_replicate`` groups). A last dim ``tp`` (tensor parallelism: ``("dp", "tp")`` or ``("dp_replicate", "dp_shard",
"tp")``) holds parameters split by torch's ``parallelize_module`` into DTensors on ``mesh["tp"]``; ZeRO shards each
rank's local piece over the data-parallel dims (zero/tensor_parallel.py). ``("edp", "ep")``: expert parallelism
(moe.py, zero/expert.py): flat ZeRO over every rank for dense parameters, MoE experts over their ``edp`` group.
Other model-parallel dims are refused for now.

[Note: what runs on which group]
* ``dp_shard`` (``ZeroMesh.shard_group``; the world when flat): every all-gather of parameters (forward, backward,
  the refresh after a step at stages 1-2, GatheredParameters, safe_get_full_*), the gradient reduce-scatter, and
  the gradient-norm all-reduce: after the replica all-reduce every replica holds the same gradient shards, so the
  sum of squares over one shard group is the global one, with nothing counted twice.
* ``gather_inter`` / ``gather_intra`` (only with ``mics_hierarchical_params_gather`` and a shard group over several
  nodes): the engine's parameter all-gathers, in two steps, in place of ``dp_shard`` (zero/mics.py); the other
  ``dp_shard`` collectives stay on it.
* ``dp_replicate`` (``replicate_group``; absent when flat): one all-reduce (average) of each gradient bucket's shard
  after its reduce-scatter. Reduce-scatter (avg over k) then all-reduce (avg over N/k) is the average over N.
* the world: everything that must agree across every rank: the initial broadcast of the model, the step fingerprint,
  gradient presence (a parameter with a gradient on some ranks only), the module-order check, the non-finite-loss
  exchange, checkpoint agreement, the auto gather budget.
* with a ``tp`` dim, the ranks of the world no longer hold the same model: tp ranks hold different local pieces. What
  moves model values runs on the data-parallel groups of one tp rank (``value_comms``: the initial broadcast); what
  only agrees on control flow stays on the world; the gradient norm is one all-reduce over the world with each value
  counted on one rank ([Note: the global gradient norm with tp] in zero/tensor_parallel.py). Ranks are laid out
  with ``tp`` innermost (world rank = dp rank x tp + tp rank), as ``init_device_mesh`` does.
The sub-group communicators share the world communicator's progress records and stall watchdog: every shard group
issues the same collectives (same kinds, sizes and names) in the same order, so the records of all ranks of the world
still line up, the step fingerprint compares them across the world, and a stall in a sub-group collective is
diagnosed by the same watchdog.

[Note: rank layout of a hierarchical mesh]
Ranks are laid out with ``dp_shard`` innermost: world rank = replica x k + shard rank, as torchtitan's and
``init_device_mesh`` lay out a ``(dp_replicate, dp_shard)`` mesh (consecutive ranks, so a shard group of k = GPUs per
node stays within a node). A checkpoint is written by replica 0, whose shard rank r is world rank r, so the files
read like a flat checkpoint over k ranks (checkpoint/_save.py). A DeviceMesh with another rank order is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .config.models import divisor_fix
from .errors import ConfigError

log = logging.getLogger("zero_engine.mesh")

__all__ = ["ZeroMesh", "resolve_mesh", "check_mpu", "data_parallel_world", "named_communicators", "summed_stats", "DP",
           "DP_REPLICATE",
           "DP_SHARD", "TP", "value_comms"]

DP, DP_REPLICATE, DP_SHARD, TP = "dp", "dp_replicate", "dp_shard", "tp"
_MODEL_PARALLEL_DIMS = {"tp": "tensor parallelism", "ep": "expert parallelism", "cp": "context parallelism",
                        "pp": "pipeline parallelism", "sp": "sequence parallelism"}


@dataclass(frozen=True)
class ZeroMesh:
    """The data-parallel groups of one engine (see [Note: what runs on which group]).

    ``shard_group`` None: the world group. ``replicate_group`` None: no replicas (flat ZeRO). ``source`` says where
    the description came from, for logs and errors."""

    world_size: int
    rank: int
    shard_size: int
    replicate_size: int
    shard_group: Any = None
    replicate_group: Any = None
    source: str = "flat"
    device_mesh: Any = None
    hpz_size: int = 1  # ZeRO++ hpZ: the secondary partition's group size (1: off); see zero/hpz.py
    hpz_group: Any = None
    tp_size: int = 1  # tensor parallelism: the mesh's innermost dim "tp" (1: none); see zero/tensor_parallel.py
    tp_group: Any = None
    # mics_hierarchical_params_gather (zero/mics.py): the shard group's all-gathers in two steps; 0: one collective
    gather_node_size: int = 0  # ranks per node (LOCAL_WORLD_SIZE) within the shard group
    gather_inter_group: Any = None  # the shard group's ranks of this local rank: one per node
    gather_intra_group: Any = None  # the shard group's ranks on this node

    @property
    def is_hierarchical(self) -> bool:
        return self.replicate_size > 1

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different rows of the batch: the world over tp (the tp ranks of a dp rank read the same)."""
        return self.world_size // self.tp_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's row block of the batch (tp innermost: the ranks of one tp group share it)."""
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size  # tp innermost

    @property
    def tp_mesh(self):
        """The mesh's tp dim, where DTensor parameters must live; None without one."""
        return self.device_mesh[TP] if self.tp_size > 1 else None

    @property
    def shard_rank(self) -> int:
        return (self.rank // self.tp_size) % self.shard_size  # [Note: rank layout of a hierarchical mesh]

    @property
    def replicate_rank(self) -> int:
        return self.rank // (self.shard_size * self.tp_size)

    @property
    def saves_shards(self) -> bool:
        """This rank writes model states into checkpoints (replica 0 only; the others hold the same values)."""
        return self.replicate_rank == 0

    def describe(self) -> str:
        tp = f" x {TP} {self.tp_size}" if self.tp_size > 1 else ""
        if not self.is_hierarchical:
            if tp:
                return f"{DP} {self.shard_size}{tp} ({self.source}): each tp piece sharded over {self.shard_size} ranks"
            return f"flat over {self.world_size} ranks ({self.source})"
        return (f"{DP_REPLICATE} {self.replicate_size} x {DP_SHARD} {self.shard_size}{tp} ({self.source}): model "
                f"states sharded within groups of {self.shard_size} ranks, replicated {self.replicate_size} times")


def flat_mesh(world_size: int, rank: int, source: str = "flat") -> ZeroMesh:
    return ZeroMesh(world_size, rank, world_size, 1, source=source)


def resolve_mesh(zero_config, device_type: str, mesh=None, mpu=None) -> ZeroMesh:
    """The groups of an engine, from (in this order) a DeviceMesh, DeepSpeed's mpu, or the config's
    ``mics_shard_size``; flat when none is given; plus hpZ's group (``zero_hpz_partition_size``). Collective when
    it creates groups (every rank calls it)."""
    found = _resolve_dp(zero_config, device_type, mesh, mpu)
    if zero_config.mics_hierarchical_params_gather:
        found = _with_two_step_gather(found, device_type)
    k = zero_config.zero_hpz_partition_size
    dp, tp = found.data_parallel_size, found.tp_size
    if k in (1, dp):
        return found
    key = "zero_optimization.zero_hpz_partition_size"
    if found.is_hierarchical:
        raise ConfigError(f"{key}: {k} with a hierarchical mesh ({found.describe()}) is not supported yet; use hpZ "
                          "(states sharded over every rank) or MiCS / HSDP, not both")
    if dp % k:
        raise ConfigError(f"{key}: {divisor_fix('zero_hpz_partition_size', k, dp)}")
    require_hpz_within_node(k, tp, "tp")
    from torch.distributed.device_mesh import init_device_mesh

    # [Note: hpZ with a tp dim] the secondary groups are k consecutive dp ranks of one tp rank (tp innermost: world
    # ranks d * tp + t), which hold the same tp piece whole after a gather, as the k ranks of a flat world do
    shape, names = ((dp // k, k, tp), ("hpz_replicate", "hpz_shard", "tp")) if tp > 1 else \
        ((dp // k, k), ("hpz_replicate", "hpz_shard"))
    groups = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return dataclasses.replace(found, hpz_size=k, hpz_group=groups.get_group("hpz_shard"),
                               source=f"{found.source}; hpZ secondary within {k} ranks")


def require_hpz_within_node(k: int, stride: int = 1, stride_name: str = "", whose: str = "") -> None:
    """hpZ's secondary group of ``k`` ranks, ``stride`` apart (a tp or ep dim between them), spans ``k x stride``
    consecutive ranks, which must lie within a node (``LOCAL_WORLD_SIZE``): a ConfigError naming the key otherwise."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None or not local.isdigit() or k * stride <= int(local):
        return
    within = f"{k} x {stride_name} {stride}" if stride > 1 else f"{k}"
    raise ConfigError(f"zero_optimization.zero_hpz_partition_size: {within} is larger than a node (LOCAL_WORLD_SIZE="
                      f"{local}): the secondary partition{whose} exists to keep backward all-gathers within a node; "
                      f"use {int(local) // stride} or a divisor of it")


def _with_two_step_gather(found: ZeroMesh, device_type: str) -> ZeroMesh:
    """``mics_hierarchical_params_gather``: the two sub-groups of each shard group that zero/mics.py gathers over,
    made once. See [Note: the two-step gather] in zero/mics.py for the layout."""
    key, k = "zero_optimization.mics_hierarchical_params_gather", found.shard_size
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or int(local) < 1:
        raise ConfigError(f"{key}: true needs the ranks per node, from LOCAL_WORLD_SIZE (found {local!r}); launch "
                          "with torchrun (which sets it) or set it yourself, or set the key false")
    node = int(local)
    if found.tp_size > 1:
        raise NotImplementedError(f"{key}: true with a tp mesh dim ({found.describe()}) is not supported yet; set it "
                                  "false")
    if k <= node and node % k == 0:  # the shard group lies within one node: its one collective is intra-node already
        if found.rank == 0:
            log.info("%s: shard groups of %d ranks lie within a node of %d: gathered in one collective, as without "
                     "the key (nothing crosses nodes)", key, k, node)
        return found
    if k % node:
        raise ConfigError(f"{key}: true with mics_shard_size {k} and {node} ranks per node (LOCAL_WORLD_SIZE): a shard "
                          f"group must span whole nodes to gather in two steps; use a mics_shard_size that is a "
                          f"multiple of {node} (or a divisor of it: within a node), or set the key false")
    from torch.distributed.device_mesh import init_device_mesh

    groups = init_device_mesh(device_type, (found.world_size // k, k // node, node),
                              mesh_dim_names=("gather_replicate", "gather_inter", "gather_intra"))
    if found.rank == 0:
        log.info("%s: shard groups of %d ranks gather in two steps: across %d nodes (one rank each), then within the "
                 "node of %d", key, k, k // node, node)
    return dataclasses.replace(found, gather_node_size=node, gather_inter_group=groups.get_group("gather_inter"),
                               gather_intra_group=groups.get_group("gather_intra"),
                               source=f"{found.source}; two-step gather over {k // node} nodes x {node}")


def _resolve_dp(zero_config, device_type: str, mesh=None, mpu=None) -> ZeroMesh:
    world, rank = dist.get_world_size(), dist.get_rank()
    k = zero_config.mics_shard_size
    if mesh is not None or mpu is not None:
        found = _from_device_mesh(mesh, world, rank) if mesh is not None else _from_mpu(mpu, world, rank)
        # the size the mesh's shard groups have is no contradiction: with tp (AutoTP's mesh too), the dp ranks
        if k not in (-1, found.shard_size):
            given = "mesh=" if mesh is not None else "mpu="
            raise ConfigError(f"zero_optimization.mics_shard_size: {k} given together with initialize({given}...), "
                              f"whose shard groups have {found.shard_size} ranks; the mesh already says how ranks are "
                              f"grouped: remove mics_shard_size (or set -1), or drop {given}")
        return found
    if k in (-1, world):
        return flat_mesh(world, rank, "flat" if k == -1 else "mics_shard_size = world: flat")
    if k < 1 or world % k:
        raise ConfigError(f"zero_optimization.mics_shard_size: {divisor_fix('mics_shard_size', k, world)}")
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh(device_type, (world // k, k), mesh_dim_names=(DP_REPLICATE, DP_SHARD))
    return _hierarchical(device_mesh, world, rank, f"zero_optimization.mics_shard_size = {k}")


def _from_device_mesh(mesh, world: int, rank: int) -> ZeroMesh:
    names = tuple(mesh.mesh_dim_names or ())
    if not names:
        raise ValueError("initialize(mesh=...): the DeviceMesh has no dim names; build it with mesh_dim_names=(\"dp\","
                         ") or (\"dp_replicate\", \"dp_shard\") (torchtitan's names)")
    if names == ("edp", "ep"):  # expert parallel: dense states flat over the world, experts over edp (moe.py)
        from .moe import expert_parallel_groups

        groups = expert_parallel_groups(mesh=mesh)
        return flat_mesh(world, rank, f"DeviceMesh edp {groups.edp_size} x ep {groups.ep_size}: dense parameters "
                                      "sharded over every rank, experts over edp (zero/expert.py)")
    dp_names = names[:-1] if names[-1] == TP else names  # tp: the innermost dim (see [Note: what runs on which group])
    for name in dp_names:
        if name in _MODEL_PARALLEL_DIMS:
            where = " other than a last \"tp\"" if name == TP else ""
            raise NotImplementedError(
                f"initialize(mesh=...): mesh dim {name!r} ({_MODEL_PARALLEL_DIMS[name]}){where} is not supported yet: "
                "zero_engine shards over data-parallel dims and composes with tensor parallelism on a last dim "
                "\"tp\"; use a mesh with dims (\"dp\",), (\"dp_replicate\", \"dp_shard\"), (\"dp\", \"tp\") or "
                "(\"dp_replicate\", \"dp_shard\", \"tp\")")
    if mesh.size() != world:
        raise ValueError(f"initialize(mesh=...): the mesh's dims {dict(zip(names, mesh.mesh.shape))} multiply to "
                         f"{mesh.size()} ranks, the world has {world}; give a mesh over every rank "
                         f"(init_device_mesh(device, (...), mesh_dim_names=...) whose sizes multiply to {world})")
    if dp_names != names:
        return _with_tp(mesh, dp_names, world, rank)
    if names == (DP,):
        return flat_mesh(world, rank, "DeviceMesh dp")
    if names == (DP_REPLICATE, DP_SHARD):
        return _hierarchical(mesh, world, rank, "DeviceMesh dp_replicate x dp_shard")
    raise ValueError(f"initialize(mesh=...): dim names {names} are not understood; use (\"dp\",) for flat ZeRO or "
                     "(\"dp_replicate\", \"dp_shard\") for HSDP / MiCS, in that order")


def _hierarchical(mesh, world: int, rank: int, source: str) -> ZeroMesh:
    replicate, shard = (int(n) for n in mesh.mesh.shape)
    if not torch.equal(mesh.mesh.flatten().cpu(), torch.arange(world)):
        raise NotImplementedError(
            f"initialize(mesh=...): ranks {mesh.mesh.tolist()} are not laid out with dp_shard innermost (world rank = "
            "replica x shard size + shard rank) -- another order is not supported yet; build the mesh with "
            "init_device_mesh, which lays them out that way")
    if replicate == 1:
        return flat_mesh(world, rank, source + " (one replica: flat)")
    return ZeroMesh(world, rank, shard, replicate, mesh.get_group(DP_SHARD), mesh.get_group(DP_REPLICATE),
                    source, mesh)


def _with_tp(mesh, dp_names: tuple, world: int, rank: int) -> ZeroMesh:
    """A mesh whose last dim is ``tp``: ZeRO's groups are its data-parallel dims, taken from the mesh itself."""
    if dp_names not in ((DP,), (DP_REPLICATE, DP_SHARD)):
        raise ValueError(f"initialize(mesh=...): dim names {dp_names + (TP,)} are not understood; use (\"dp\", \"tp\") "
                         "or (\"dp_replicate\", \"dp_shard\", \"tp\"), in that order")
    if not torch.equal(mesh.mesh.flatten().cpu(), torch.arange(world)):
        raise NotImplementedError(
            f"initialize(mesh=...): ranks {mesh.mesh.tolist()} are not laid out with tp innermost (world rank = dp "
            "rank x tp size + tp rank) -- another order is not supported yet; build the mesh with init_device_mesh")
    sizes = dict(zip(dp_names + (TP,), (int(n) for n in mesh.mesh.shape)))
    shard_dim = dp_names[-1]
    replicate = sizes.get(DP_REPLICATE, 1)
    source = "DeviceMesh " + " x ".join(dp_names + (TP,))
    return ZeroMesh(world, rank, sizes[shard_dim], replicate, mesh.get_group(shard_dim),
                    mesh.get_group(DP_REPLICATE) if replicate > 1 else None, source, mesh,
                    tp_size=sizes[TP], tp_group=mesh.get_group(TP))


def data_parallel_world(world: int, mesh=None, autotp_size: int = 0) -> int:
    """The ranks that read different rows of the batch, before any group exists (the batch rule of the config needs
    it first): the world, over the size of a last ``tp`` dim of ``mesh`` or over ``tensor_parallel.autotp_size``.
    A size that does not divide the world is left to the mesh's own checks, which name it."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    tp = int(mesh.mesh.shape[-1]) if names and names[-1] == TP else max(int(autotp_size or 0), 1)
    return world // tp if tp > 1 and world % tp == 0 else world


def check_mpu(mpu) -> None:
    """What can be checked of DeepSpeed's mpu before any process group exists (initialize() calls it first)."""
    for method in ("get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank"):
        if not callable(getattr(mpu, method, None)):
            raise ValueError(f"initialize(mpu=...): {type(mpu).__name__} has no {method}(); an mpu must offer "
                             "get_data_parallel_group / _world_size / _rank (and get_model_parallel_world_size)")
    mp = _model_parallel_world_size(mpu)
    if mp > 1:
        raise NotImplementedError(f"initialize(mpu=...): a model-parallel world size of {mp} is not supported yet "
                                  "(tensor/pipeline parallelism is issue 25); an mpu whose model-parallel size is 1 "
                                  "works")


def _from_mpu(mpu, world: int, rank: int) -> ZeroMesh:
    """DeepSpeed's mpu (Megatron's parallel_state shape): its data-parallel group is ZeRO's group."""
    check_mpu(mpu)
    dp_world, dp_rank = int(mpu.get_data_parallel_world_size()), int(mpu.get_data_parallel_rank())
    group = mpu.get_data_parallel_group()
    group_world = dist.get_world_size(group)
    if dp_world != world or group_world != world or dp_rank != rank:
        raise ValueError(f"initialize(mpu=...): data-parallel world {dp_world} (group of {group_world}), rank "
                         f"{dp_rank}; with model-parallel size 1 the data-parallel group must be every rank ({world}"
                         f", this one {rank})")
    return flat_mesh(world, rank, "mpu")


def _model_parallel_world_size(mpu) -> int:
    for method in ("get_model_parallel_world_size", "get_tensor_model_parallel_world_size"):
        fn = getattr(mpu, method, None)
        if callable(fn):
            size = int(fn())
            pipeline = getattr(mpu, "get_pipeline_model_parallel_world_size", None)
            return size * (int(pipeline()) if callable(pipeline) else 1)
    return 1


def hpz_communicator(mesh: ZeroMesh, world_comm):
    """The communicator of hpZ's secondary partition (zero/hpz.py), or None when hpZ is off."""
    if mesh.hpz_size == 1:
        return None
    from .comm import Communicator

    return Communicator(mesh.hpz_group, debug=world_comm.debug, collective_timeout_s=world_comm.collective_timeout_s,
                        share_records_with=world_comm)


def gather_communicators(mesh: ZeroMesh, world_comm) -> Optional[tuple[Any, Any]]:
    """(inter-node, intra-node) communicators of the two-step gather (zero/mics.py), or None when it is off."""
    if not mesh.gather_node_size:
        return None
    from .comm import Communicator

    return tuple(Communicator(group, debug=world_comm.debug, collective_timeout_s=world_comm.collective_timeout_s,
                              share_records_with=world_comm)
                 for group in (mesh.gather_inter_group, mesh.gather_intra_group))


def mesh_communicators(mesh: ZeroMesh, world_comm) -> tuple[Any, Optional[Any]]:
    """(shard communicator, replicate communicator or None): the world communicator itself when flat; else
    communicators on the mesh's groups that share its progress records and watchdog ([Note: what runs on which
    group])."""
    if mesh.shard_group is None:
        return world_comm, None
    from .comm import Communicator

    def sub(group):
        return Communicator(group, debug=world_comm.debug, collective_timeout_s=world_comm.collective_timeout_s,
                            share_records_with=world_comm)

    return sub(mesh.shard_group), sub(mesh.replicate_group) if mesh.replicate_group is not None else None


def value_comms(mesh: ZeroMesh, world_comm, shard_comm, replicate_comm) -> list:
    """The communicators whose ranks hold the same model values, to broadcast them over in turn: the world without
    tp; with tp, the data-parallel groups of this rank's tp piece (shard group, then replicas)."""
    if mesh.tp_size == 1:
        return [world_comm]
    return [comm for comm in (shard_comm, replicate_comm) if comm is not None]


def named_communicators(world_comm, shard_comm, replicate_comm, hpz_comm) -> dict:
    """An engine's communicators by group name: "world", and "dp_shard" / "dp_replicate" / "hpz" where the mesh has
    them (flat: the shard group is the world's own communicator, listed once)."""
    found = {"world": world_comm}
    if shard_comm is not None and shard_comm is not world_comm:
        found["dp_shard"] = shard_comm
    if replicate_comm is not None:
        found["dp_replicate"] = replicate_comm
    if hpz_comm is not None:
        found["hpz"] = hpz_comm
    return found


def summed_stats(per_group: dict) -> dict:
    """Communicator stats of several groups, summed per kind of collective."""
    total = {kind: {"calls": 0, "bytes": 0} for kind in per_group["world"]}
    for stats in per_group.values():
        for kind, counts in stats.items():
            total[kind]["calls"] += counts["calls"]
            total[kind]["bytes"] += counts["bytes"]
    return total
