"""How a ZeroEngine is put together: its parameters partitioned into shards and buckets, the gradient reducer, the
gathering (coordinator, hooks, offload) at stage 3, and the optimizer over the fp32 masters.

``ZeroEngine.__init__`` claims the model and calls ``build_parts`` once; engine.py stays the training step. Each
function sets the parts it builds on the engine, in the order they depend on each other.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from .compile import CompiledModules, log_whole_model_compiled
from .guards import ModelSnapshot, NonFiniteSteps, broadcast_initial_state, refuse_unsupported_parameters
from .loaded_state import LoadStateDictHooks
from .memory import MemoryAccounting
from .memory.headroom import memory_budget
from .memory.timeline import MemoryTimeline
from .mesh import gather_communicators, hpz_communicator, mesh_communicators, resolve_mesh, value_comms
from .offload.placement import HOST, NVME
from .precision import cast_floating_, compute_dtype_of, make_loss_scaler
from .utils import register_engine
from .zero.coordinator import ParamCoordinator
from .zero.expert import GroupedGather, expert_shard_groups
from .zero.gather import CoalescedGather, choose_sequential_buckets, make_gatherer
from .zero.grads import GradReducer, hand_gradient_to_reducer
from .zero.hooks import BackwardEndCallback, ModuleHooks
from .zero.module_zero_grad import install_module_zero_grad
from .zero.optimizer import DataParallelOptimizer, ZeroOptimizer, param_groups_of
from .zero.partition import ShardedParam, flatten_shards, sharded_param_of
from .zero.presence import GradientPresence
from .zero.tensor_parallel import check_tp_params, norm_counted
from .zero.units import apply_leaf_module_config, gather_units, mark_by_granularity

log = logging.getLogger("zero_engine.engine")

__all__ = ["build_gathering", "build_parts"]


def build_parts(engine, model: nn.Module, optimizer, model_parameters, mesh=None, mpu=None) -> None:
    """Everything ``ZeroEngine.__init__`` builds after it claimed the model, in order; if a step raises, __init__
    undoes what came before (guards.undo_failed_initialize)."""
    zc = engine.config.zero_optimization
    # tensor_parallel.autotp_size: the model split, its ("dp", "tp") mesh; the split parameters are new objects,
    # so a client optimizer and model_parameters built before initialize() are pointed at them
    mesh, optimizer, model_parameters = _autotp(engine, model, mesh, mpu, optimizer, model_parameters)
    engine.mesh = resolve_mesh(zc, engine.device.type, mesh, mpu)  # collective when it creates groups
    engine.shard_comm, engine.replicate_comm = mesh_communicators(engine.mesh, engine.comm)
    engine.hpz_comm = hpz_communicator(engine.mesh, engine.comm)
    check_tp_params(model.named_parameters(), engine.mesh.tp_mesh)
    if engine.mesh.tp_size > 1 and engine.stage == 0:
        raise NotImplementedError(f"zero_optimization.stage: 0 with a tp mesh dim ({engine.mesh.describe()}) is not "
                                  "supported yet; use stage 1, 2 or 3")
    # MoE experts: sharded and reduced over their expert-data-parallel group (zero/expert.py); {} without experts
    engine.shard_groups = expert_shard_groups(model, engine)
    if engine.shard_groups and engine.mesh.tp_size > 1:
        raise NotImplementedError(f"MoE expert parameters (allreduce=False) with a tp mesh dim "
                                  f"({engine.mesh.describe()}) are not supported yet; use expert parallelism or "
                                  "tensor parallelism, not both")
    refuse_unsupported_parameters(model, engine.stage, compute_dtype_of(engine.config))
    broadcast_initial_state(model, value_comms(engine.mesh, engine.comm, engine.shard_comm, engine.replicate_comm),
                            engine.shard_groups)
    engine.snapshot = ModelSnapshot(model)
    if hasattr(model, "resize_token_embeddings"):  # a transformers model: hf/_engine_methods.py
        from .hf._engine_methods import adapt_transformers_model

        adapt_transformers_model(model, collective_forward=engine.comm.world_size > 1 and (
            engine.stage == 3 or engine.mesh.tp_size > 1))
    engine.accounting = MemoryAccounting()
    engine.compute_dtype = compute_dtype_of(engine.config)
    engine.loss_scaler = make_loss_scaler(engine.config.fp16)
    engine.nonfinite = NonFiniteSteps(engine.comm, engine.config.zero_engine.max_consecutive_skipped_steps,
                                      loss_scaled=engine.loss_scaler is not None,
                                      has_values=next(model.parameters(), torch.empty(0)).device.type != "meta")

    timeline = engine.config.zero_engine.memory_timeline
    engine.timeline = MemoryTimeline(timeline.path or "memory_timeline", engine.comm.rank) if timeline.enabled \
        else None
    groups = param_groups_of(model, model_parameters)
    # No optimizer anywhere: forward and backward only (evaluation, inference, gradient inspection), as
    # DeepSpeed; no fp32 masters or optimizer states are made, and step() raises.
    trains = optimizer is not None or engine.config.optimizer is not None
    engine.backward_end = BackwardEndCallback(engine.on_backward_end)
    if engine.stage == 0:
        engine.sharded = []
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine.optimizer = DataParallelOptimizer(
            trainable, engine.comm, engine.config.gradient_clipping, zc.reduce_bucket_size, optimizer,
            engine.config.optimizer, groups, engine.compute_dtype, engine.communication_data_type,
            loss_scaler=engine.loss_scaler, shard_groups=engine.shard_groups) if trains else None
        if engine.compute_dtype != torch.float32:  # fp32: the model as given, as DeepSpeed
            cast_floating_(model, engine.compute_dtype)  # after the fp32 masters were taken
    else:
        unit_groups = _partition(engine, model, zc, fp32_masters=trains)
        engine.optimizer = ZeroOptimizer(engine.sharded, engine.reducer, engine.comm, engine.config.gradient_clipping,
                                         optimizer, engine.config.optimizer, groups, zc.sub_group_size,
                                         engine.placement, zc.offload_optimizer, engine.config.aio,
                                         loss_scaler=engine.loss_scaler, unit_groups=unit_groups,
                                         norm_counted=norm_counted(engine.sharded, engine.mesh),
                                         grads_in_params=engine.stage == 1) \
            if trains else None
        if engine.param_swapper is not None:  # the optimizer aliased its masters to the shards: now swap out
            if engine.optimizer is not None:
                engine.optimizer.param_swapper = engine.param_swapper
            engine.param_swapper.start()
    engine.lr_scheduler = None  # initialize() sets these two: see initialize.py
    engine.training_dataloader = None
    register_engine(engine)  # zero_engine.utils.safe_get_* find the engine from a parameter
    engine.snapshot.settle()  # the parameters' dtypes, now cast to the compute dtype
    engine.loaded_state = LoadStateDictHooks(engine)  # model.load_state_dict reaches shards and masters
    if engine.comm.rank == 0:
        log.info("zero_engine: stage %d, world %d, mesh %s, %d parameters (%d elements), gather %s",
                 engine.stage, engine.comm.world_size, engine.mesh.describe(), sum(1 for _ in model.parameters()),
                 sum(p.numel() for p in model.parameters()) if engine.stage == 0 else
                 sum(sp.numel for sp in engine.sharded),
                 _gather_strategy(getattr(engine.coordinator, "gatherer", None)))
    engine.placement.log_once(engine.comm.rank)


def _gather_strategy(gatherer) -> str:
    """How parameters are gathered, for the log line of initialize (decided once: gather.py)."""
    if gatherer is None:
        return "none (params whole)"
    if getattr(gatherer, "group_large", False):
        return f"{gatherer.name} (large parameters of a gather as one group)"
    return gatherer.name


def _partition(engine, model: nn.Module, zc, fp32_masters: bool) -> list[list[ShardedParam]]:
    """Shards, buckets, the gradient reducer and (stage 3) the gathering; returns the parameters of each gather unit
    (stages 1-2: each parameter alone), of which shard buckets and optimizer sub-groups are runs."""
    gather_comm = _gather_comm(engine)  # the shard group's, or its two-step gather (zero/mics.py)
    engine.sharded = [_sharded_param(engine, p, name, i, fp32_masters)
                      for i, (name, p) in enumerate(model.named_parameters())]
    cast_floating_(model, engine.compute_dtype, params=False)
    by_param = {id(sp.param): sp for sp in engine.sharded}
    # See [Note: flat shard storage]: shards become views of flat per-bucket buffers, before any master aliases them.
    bucket = max(1, int(zc.prefetch_bucket_size if engine.stage == 3 else zc.allgather_bucket_size)
                 // engine.shard_comm.world_size)
    if engine.placement.params == NVME:  # the swap unit: see offload/param_swap.py
        bucket = min(bucket, max(1, int(zc.offload_param.buffer_size)))
    if engine.stage == 3:  # See zero/units.py: which modules gather which parameters (leaf modules: their subtree)
        if zc.module_granularity_threshold:
            mark_by_granularity(model, zc.module_granularity_threshold, lambda p: by_param[id(p)].numel)
        apply_leaf_module_config(model, zc.leaf_module)
        units = ([by_param[id(p)] for p in params] for _, _, params in gather_units(model))  # build_gathering's
        unit_groups = _owned_groups(units, engine.sharded)
    else:
        unit_groups = [[sp] for sp in engine.sharded]
    # Shard buckets and the optimizer's sub-groups (ZeroOptimizer) are runs of whole units; gradient buckets are
    # not (see [Note: gradient buckets are not runs of units] in zero/grads.py).
    if engine.stage == 3:
        _decide_persistence(engine.sharded, zc)  # before the layout, which places them
    engine.shard_buckets = flatten_shards(unit_groups, bucket)
    trainable = [sp for sp in reversed(engine.sharded) if sp.param.requires_grad]  # ~ the order backward goes
    engine.reducer = GradReducer(trainable, engine.shard_comm, zc.reduce_bucket_size,
                                 replicate_comm=engine.replicate_comm,
                                 reduce_dtype=engine.communication_data_type,
                                 grad_dtype=engine.compute_dtype, async_op=zc.overlap_comm,
                                 accounting=engine.accounting, streams=engine.streams,
                                 grad_device=engine.placement.optimizer_device, pin_memory=engine.placement.pins,
                                 quantized=_quantized_reduce(engine, zc),
                                 # gradients copied in a unit at a time (stage 1: a bucket at a time; every gradient
                                 # is there at once): [Note: one copy per unit] in zero/grads.py
                                 copy_groups=None if engine.stage == 1 else unit_groups,
                                 # the flush a pass's first gradient hook queues (stages 2-3, which have them):
                                 # through its parameters' grad_reducer the model holds its engine until destroy(),
                                 # as guards.py wants; at stage 1 nothing on the model does, nor does the optimizer a
                                 # user keeps
                                 backward_end=engine.backward_end if engine.stage >= 2 else None)
    if engine.stage >= 2:  # see [Note: one call per gradient] in zero/grads.py
        for sp in trainable:
            sp.grad_reducer = engine.reducer
        engine.grad_hooks = [sp.param.register_post_accumulate_grad_hook(hand_gradient_to_reducer)
                             for sp in trainable]
        install_module_zero_grad(model)  # the hooks take .grad: a module's zero_grad reaches the reducer instead
    if engine.stage < 3:
        for sp in engine.sharded:
            sp.is_persistent = True
        engine.refresh_gatherer = CoalescedGather(gather_comm, zc.allgather_bucket_size, engine.accounting,
                                                  engine.streams)
        if engine.shard_groups:  # an expert's shards are its edp group's: refreshed over it (zero/expert.py)
            engine.refresh_gatherer = GroupedGather(engine.refresh_gatherer, {
                g.name: CoalescedGather(g.comm, zc.allgather_bucket_size, engine.accounting, engine.streams)
                for g in set(engine.shard_groups.values())})
        _gather_persistent(engine)
        return unit_groups

    for sp in engine.sharded:  # persistence was decided before the layout
        if not sp.is_persistent and sp.is_available:
            sp.release()
    gatherer = _parameter_gatherer(engine, gather_comm, zc)
    if engine.shard_groups:  # expert parameters gather over their own group (zero/expert.py), qwZ's too
        gatherer = GroupedGather(gatherer, {g.name: _parameter_gatherer(engine, g.comm, zc)
                                            for g in set(engine.shard_groups.values())})
    if engine.placement.params == NVME:
        from .offload.param_swap import ParamSwapper, SwapInGather

        engine.param_swapper = ParamSwapper(engine.shard_buckets, zc.offload_param, engine.comm.rank, engine.config.aio)
        gatherer = SwapInGather(gatherer, engine.param_swapper)
    elif engine.placement.params == HOST and engine.placement.has_separate_host:
        from .offload.param_host import DeviceCopyGather, HostShards

        engine.host_params = HostShards(engine.shard_buckets, engine.placement.device, engine.placement.pins_params,
                                        engine.placement.offloads_optimizer)
        gatherer = DeviceCopyGather(gatherer, engine.host_params)
    if engine.hpz_comm is not None:
        # Under parameter offload the primary gathers read the shards in (the wrappers above); the secondary shards
        # are the compute device's, as without offload (2 Psi / k there: what hpZ costs).
        from .zero.hpz import HpzGather

        engine.hpz = gatherer = HpzGather(gatherer, engine.hpz_comm, engine.sharded, engine.accounting,
                                          engine.streams, bucket_numel=zc.prefetch_bucket_size)
    if zc.allgather_sequential is True:
        for sp in engine.sharded:
            sp.gather_sequential = True
    elif zc.allgather_sequential == "auto":
        _choose_gather_per_bucket(engine)
    engine.refresh_gatherer = gatherer
    _gather_persistent(engine)
    build_gathering(engine, model)
    if engine.comm.world_size > 1:
        engine.presence = GradientPresence(engine.reducer.params, engine.comm, engine.device, engine.coordinator)
    return unit_groups


def _parameter_gatherer(engine, comm, zc):
    """The stage-3 gatherer over ``comm``: the configured strategy, or ZeRO++ qwZ's int8 one (zero/quantize.py).
    Under parameter offload the wrappers around it read the shards in first (from NVMe, or a device copy of the host
    shards), so qwZ quantizes what the exact gather would send."""
    gatherer = make_gatherer(comm, zc, engine.accounting, engine.streams)
    if zc.zero_quantized_weights:
        from .zero.quantize import QuantizedGather

        gatherer = QuantizedGather(gatherer, comm, zc.prefetch_bucket_size, engine.accounting, engine.streams)
    return gatherer


def _decide_persistence(sharded: list[ShardedParam], zc) -> None:
    """Stage 3: which parameters stay whole between uses (small ones, up to DeepSpeed's cap on them all together),
    decided before the shard layout, which places them ([Note: persistent shards last] in zero/partition.py)."""
    persistent_budget = zc.model_persistence_threshold  # DeepSpeed's cap on all persistent elements together
    for sp in sharded:
        sp.is_persistent = sp.numel <= min(zc.param_persistence_threshold, persistent_budget)
        if sp.is_persistent:
            persistent_budget -= sp.numel


def _gather_comm(engine):
    """What the parameter gatherers all-gather with: the shard group's communicator, or with
    ``mics_hierarchical_params_gather`` its two-step gather (zero/mics.py), kept on the engine as ``mics_gather``."""
    comms = gather_communicators(engine.mesh, engine.comm)
    if comms is None:
        return engine.shard_comm
    from .zero.mics import TwoStepAllGather

    engine.mics_gather = TwoStepAllGather(engine.shard_comm, *comms, accounting=engine.accounting)
    return engine.mics_gather


def _quantized_reduce(engine, zc):
    """ZeRO++ qgZ (``zero_quantized_gradients``): the reducer's quantized all-to-all, or None (exact)."""
    if not zc.zero_quantized_gradients:
        return None
    from .zero.quantize import QuantizedReduceScatter

    return QuantizedReduceScatter(engine.accounting)


def build_gathering(engine, model: nn.Module) -> None:
    """The units of ``model`` (units.py), their coordinator and their hooks, on the engine. Called at initialize,
    and again by compile.py when modules were compiled since (a compiled module becomes one unit): the old hooks
    are removed and every gathered non-persistent parameter released first, and the next step records a new trace."""
    again = engine.coordinator is not None
    if again:
        engine.coordinator.release_all()
        engine.hooks.remove()
        ParamCoordinator.live.discard(engine.coordinator)
    by_param = {id(sp.param): sp for sp in engine.sharded}
    module_params, module_names = {}, {}
    for name, module, params in gather_units(model):
        module_params[module] = [by_param[id(p)] for p in params]
        module_names[module] = name or "<root>"
    if again:  # the gradients of a new unit are copied in together, as at initialize (_partition)
        engine.reducer.regroup(_owned_groups(module_params.values(), engine.sharded))
    engine.coordinator = ParamCoordinator(module_params, module_names, engine.refresh_gatherer, engine.comm,
                                          engine.config.zero_optimization,
                                          on_event=engine.record_timeline if engine.timeline else None,
                                          shard_swapper=engine.param_swapper)
    engine.hooks = ModuleHooks([unit.module for unit in engine.coordinator.units], engine.coordinator,
                               engine.backward_end, model)
    if engine.presence is not None:
        engine.presence.coordinator = engine.coordinator
    if engine.compiled_at_units is not None:
        engine.compiled_at_units.close()  # its registration hook
    engine.compiled_at_units = CompiledModules(model)
    log_whole_model_compiled(engine)


def _owned_groups(units, sharded: list[ShardedParam]) -> list[list[ShardedParam]]:
    """Each unit's parameters that it owns: a parameter gathered by several units (a tied weight, an external one)
    is owned by the first in module order, whose shard bucket holds it; parameters no unit gathers, each alone."""
    owned: set[int] = set()
    groups = []
    for params in units:
        mine = [p for p in params if id(p) not in owned]
        owned.update(id(p) for p in mine)
        if mine:
            groups.append(mine)
    return groups + [[sp] for sp in sharded if id(sp) not in owned]


def _choose_gather_per_bucket(engine) -> None:
    """See [Note: auto gather strategy] in zero/gather.py."""
    budget = memory_budget(engine.sharded[0].compute_device, engine.config.zero_engine.memory_limit)
    per_element = engine.compute_dtype.itemsize + 8 + (4 if engine.compute_dtype != torch.float32 else 0)
    if engine.placement.offloads_optimizer and engine.placement.has_separate_host:
        per_element = 0  # gradient shards, masters and moments go to the host, not into the device's headroom
    states_to_come = per_element * sum(sp.shard_numel for sp in engine.sharded if sp.param.requires_grad)
    engine.sequential_buckets = choose_sequential_buckets(engine.shard_buckets, budget.headroom, states_to_come,
                                                          engine.comm, budget.source)


def _autotp(engine, model: nn.Module, mesh, mpu, optimizer, model_parameters):
    """``tensor_parallel.autotp_size`` k > 1: split the model with AutoTP's plan (autotp.py) over the tp dim of a new
    ("dp", "tp") mesh, which the engine then uses as if it had been given. The model is first made equal on every
    rank (one broadcast over the world): the split keeps each tp group's first rank's values, and from then on the
    ranks of a tp group hold different slices, which only the dp groups can broadcast.

    torch's ``parallelize_module`` puts a new Parameter (a DTensor) in place of each weight it splits; a client
    optimizer and ``model_parameters``, built on the model before, still hold the old ones. They are pointed at the
    new ones (the optimizer's groups in place, as the engine re-points them at its masters later). Returns the
    mesh, the optimizer and the parameters."""
    k = engine.config.tensor_parallel.size
    if k <= 1:
        return mesh, optimizer, model_parameters
    if mesh is not None or mpu is not None:
        given = "mesh" if mesh is not None else "mpu"
        raise ValueError(f"tensor_parallel.autotp_size: {k} together with initialize({given}=...): give one of the "
                         "two (a mesh with a last dim \"tp\" over which you parallelized the model yourself, or "
                         "autotp_size and no mesh)")
    zc = engine.config.zero_optimization
    if zc.mics_shard_size not in (-1, engine.config.world_size):
        raise NotImplementedError("tensor_parallel.autotp_size with zero_optimization.mics_shard_size is not "
                                  "supported yet; for HSDP with tp give initialize a (\"dp_replicate\", \"dp_shard\", "
                                  "\"tp\") mesh")
    if any(sharded_param_of(p) is not None for p in model.parameters()):
        raise NotImplementedError("tensor_parallel.autotp_size with a model built under zero.Init is not supported "
                                  "yet: AutoTP splits whole weights; build the model without zero.Init")
    from .autotp import apply_autotp, autotp_mesh

    device_mesh = autotp_mesh(engine.comm.world_size, k, engine.device.type)
    broadcast_initial_state(model, [engine.comm])
    before = list(model.named_parameters())
    apply_autotp(model, device_mesh["tp"])
    log.info("rank %d: AutoTP split the model over tp %d (mesh %s)", engine.comm.rank, k, device_mesh)
    after = dict(model.named_parameters())
    split = {id(old): after[name] for name, old in before if after.get(name) is not old}

    def new(params):
        return [split.get(id(p), p) for p in params]
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            group["params"] = new(group["params"])
    if model_parameters is not None:  # as param groups, one of the forms initialize() takes
        model_parameters = [dict(g, params=new(g["params"])) for g in param_groups_of(model, model_parameters)]
    return device_mesh, optimizer, model_parameters


def _gather_persistent(engine) -> None:
    """Persistent parameters (all of them below stage 3) are whole from initialize on, gathered exactly as the refresh
    after a step gathers them: those that arrive partitioned (built under zero.Init, streamed into their shards, or a
    destroyed engine's) are gathered now, not at their first use by the coordinator's gatherer, which under qwZ is
    the int8 one ([Note: what stays exact] in zero/quantize.py)."""
    partitioned = [sp for sp in engine.sharded if sp.is_persistent and not sp.is_available]
    if partitioned:
        engine.refresh_gatherer.issue(partitioned, name="persistent params", refresh=True).wait()


def _same_group(a, b) -> bool:
    return a is not None and b is not None and a.name == b.name


def _sharded_param(engine, param: nn.Parameter, name: str, index: int, fp32_master: bool) -> ShardedParam:
    """A new ShardedParam, or the one zero.Init (or a destroyed engine) made before: adopted, cast, named."""
    dtype = engine.compute_dtype if param.is_floating_point() else param.dtype
    group = engine.shard_groups.get(id(param))  # an MoE expert's edp group (zero/expert.py), else None
    comm = engine.shard_comm if group is None else group.comm
    sp = sharded_param_of(param)
    if sp is None:
        sp = ShardedParam(param, name, index, comm.rank, comm.world_size, dtype=dtype, fp32_master=fp32_master)
        sp.group = group
        return sp
    if sp.world_size == comm.world_size and (sp.group is group or _same_group(sp.group, group)):
        sp.group = group  # zero.Init's expert group: the engine's in its place ([Note: experts under zero.Init])
        sp.adopt(name, index, dtype, fp32_master)
        return sp
    if group is not None or sp.group is not None:
        raise NotImplementedError(
            f"{name}: partitioned before initialize over {sp.group.name if sp.group else 'the world'} ({sp.world_size}"
            f" ranks), and this engine shards it over {group.name if group else 'the world'} ({comm.world_size} "
            "ranks): not supported yet. Mark expert parameters before zero.Init partitions them (zero_engine.moe's "
            "layer does), with the same ep size as the engine's")
    # zero.Init partitioned it over the world; the engine shards it over a group of ranks (a hierarchical mesh's
    # dp_shard): whole again, a parameter at a time, then sharded as if built without Init
    if sp.world_size != engine.comm.world_size or sp.group is not None:
        raise NotImplementedError(
            f"{name} is partitioned over a group of {sp.world_size} ranks (by an engine destroyed since); the engine "
            f"shards it over {comm.world_size} (mesh: {engine.mesh.describe()}): not supported yet. Gather it "
            "whole first (destroy the first engine with the same mesh as this one, or build the model again)")
    sp.unpartition(engine.comm)
    return _sharded_param(engine, param, name, index, fp32_master)
