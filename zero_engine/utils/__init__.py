"""DeepSpeed's ``deepspeed.utils`` helpers: read and write whole or local model states of a parameter.

    from zero_engine.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
    engine.backward(loss)
    grad = safe_get_full_grad(param)                       # collective: every rank calls it
    exp_avg = safe_get_full_optimizer_state(param, "exp_avg")

The ``full`` functions are collectives (every rank must call them, with the same value for the ``set`` ones): they
all-gather this rank's shard with the others', so they cost one parameter's worth of memory and traffic. The
``local`` functions touch only this rank's shard: a flat tensor of ``param.ds_tensor.numel()`` elements (padded
with zeros on the last rank). Values are fp32 and unscaled (the fp16 loss scale is divided out of gradients).

With tensor parallelism (a mesh with a ``tp`` dim, zero_engine/zero/tensor_parallel.py) a parameter split by
``parallelize_module`` is a DTensor, and these functions work on this rank's **tp-local** piece, the tensor the
rank's forward computes with (``param.to_local()``'s shape): ``full`` means whole over the data-parallel ranks,
``local`` this rank's dp shard of it. ``tp_full_tensor(param, value)`` turns such a tp-local value into the whole
tensor of the unsplit model (torch's all-gather over tp; collective), and ``safe_set_full_*`` take tp-local values.

When each state is valid (as in DeepSpeed): gradients after ``backward()`` and until the ``step()`` that applies
them (then None); fp32 parameters and optimizer states at any time, updated by ``step()``. Optimizer states exist
from the first applied step on. A parameter that no engine trains (frozen, or not passed to ``initialize``) gives
None from the ``get`` functions, as in DeepSpeed; the ``set`` functions raise for it rather than do nothing.
Differences from DeepSpeed are listed in docs/deepspeed_compat.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..mesh import value_comms
from ..zero.hpz import forget_secondaries
from ..zero.partition import ParamStatus, ShardedParam, sharded_param_of
from ..zero.tensor_parallel import is_dtensor, local_grad
from ..zero.units import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                          set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module)

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized", "tp_full_tensor", "logger", "log_dist",
           # ZeRO-3 leaf modules (zero/units.py): call before initialize
           "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix"]

logger = logging.getLogger("zero_engine")

# parameter -> weak reference to the engine that trains it (registered by ZeroEngine.__init__)
_ENGINES = WeakIdKeyDictionary()


def states_in_memory_of(param):
    """A context in which the fp32 master and optimizer states of ``param``'s engine are in memory (under NVMe
    optimizer offload they live in files between steps; see zero_engine/offload/optimizer_swap.py)."""
    ref = _ENGINES.get(param)
    engine = ref() if ref is not None else None
    enter = getattr(getattr(engine, "optimizer", None), "states_in_memory", None)
    return enter() if enter is not None else contextlib.nullcontext()


def shards_in_memory_of(sharded: list):
    """A context in which the compute shards of ``sharded`` (ShardedParams of one engine) are in memory, read-only:
    under NVMe parameter offload they live in files between uses (zero_engine/offload/param_swap.py)."""
    ref = _ENGINES.get(sharded[0].param) if sharded else None
    engine = ref() if ref is not None else None
    # NVMe: read in (offload/param_swap.py); host shards with an accelerator: copied to the device (param_host.py)
    swapper = getattr(engine, "param_swapper", None) or getattr(engine, "host_params", None)
    return swapper.holding(sharded) if swapper is not None and not swapper.closed else contextlib.nullcontext()


def _with_states_in_memory(fn):
    @functools.wraps(fn)
    def wrapper(param, *args, **kwargs):
        with states_in_memory_of(param):
            return fn(param, *args, **kwargs)
    return wrapper


def shard_comm_of(sharded: list):
    """The communicator the parameters of ``sharded`` are partitioned over when their engine shards within a mesh's
    sub-group (MiCS / HSDP, zero_engine/mesh.py); None when flat (the world) or not an engine's."""
    ref = _ENGINES.get(sharded[0].param) if sharded else None
    engine = ref() if ref is not None else None
    if engine is None or engine.shard_comm is None or engine.shard_comm is engine.comm:
        return None
    return engine.shard_comm


def register_engine(engine) -> None:
    ref = weakref.ref(engine)
    for p in engine.module.parameters():
        _ENGINES[p] = ref


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given ranks only (None or [-1]: every rank), prefixed with the rank."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


# ---- finding the state of a parameter -----------------------------------------------------------------------------
def _trained(param: torch.Tensor):
    """(engine, ShardedParam or None at stage 0), or None when no engine trains ``param``."""
    ref = _ENGINES.get(param)
    engine = ref() if ref is not None else None
    if engine is None or not param.requires_grad:
        return None
    return engine, (sharded_param_of(param) if engine.stage > 0 else None)


def _require(param: torch.Tensor, what: str):
    found = _trained(param)
    if found is None:
        raise ValueError(f"{what}: this parameter is not trained by a zero_engine engine (frozen, or its model was "
                         "not passed to zero_engine.initialize()); there is no state to set")
    return found


def _require_partitioned(param: torch.Tensor, what: str):
    engine, sp = _require(param, what)
    if sp is None:
        raise ValueError(f"{what}: defined for partitioned parameters (ZeRO stages 1-3); this engine runs stage 0, "
                         "where nothing is partitioned: use the full variant")
    return engine, sp


def _loss_scale(engine) -> float:
    return engine.loss_scaler.scale if engine.loss_scaler is not None else 1.0


def _gather(engine, sp: ShardedParam, shard: torch.Tensor, what: str) -> torch.Tensor:
    """The whole parameter-shaped fp32 tensor from every rank's ``shard`` (one all-gather), on the shard's device.
    Gathered on the compute device: a master, an optimizer state or a gradient shard may be on the host (offload),
    which NCCL does not take."""
    device = sp.compute_device
    out = torch.empty(sp.padded_numel, dtype=torch.float32, device=device)
    comm = engine.shard_comm if sp.group is None else sp.group.comm  # an MoE expert: its edp group (this ep rank's)
    comm.all_gather_into_tensor(out, shard.detach().to(device, torch.float32).contiguous(),  # over its shard group
                                name=f"{what} {sp.fqn}").wait()
    return out[: sp.numel].view(sp.shape).to(shard.device)


def _local_part(sp: ShardedParam, value: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's padded shard of a whole ``value``, as fp32."""
    if value.numel() != sp.numel:
        raise ValueError(f"{what}: value has {value.numel()} elements, {sp.fqn} has {sp.numel} "
                         f"(shape {tuple(sp.shape)})")
    part = torch.zeros(sp.shard_numel, dtype=torch.float32, device=sp.shard.device)
    local = sp.local_slice()
    part[: local.stop - local.start].copy_(value.detach().reshape(-1)[local])
    return part


def _check_local(sp: ShardedParam, value: torch.Tensor, what: str) -> None:
    if value.numel() != sp.shard_numel:
        raise ValueError(f"{what}: value has {value.numel()} elements; the local shard of {sp.fqn} on rank "
                         f"{sp.rank} has {sp.shard_numel} (param.ds_tensor.numel())")


def _grads_valid(engine) -> bool:
    return engine.backwards_since_update > 0


def _state_tensor(engine, param, key: str, what: str) -> torch.Tensor:
    if engine.optimizer is None:
        raise ValueError(f"{what}: this engine has no optimizer (initialize() without one), so no optimizer states")
    master = engine.optimizer.masters.get(id(param), param)  # stage 0 in fp32: the parameter itself
    state = engine.optimizer.optimizer.state.get(master, {})
    if key not in state:
        known = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
        raise ValueError(f"{what}: no optimizer state {key!r} for this parameter"
                         + (f"; it has {', '.join(known)}" if known else
                            " yet (optimizer states are created by the first applied step)"))
    return state[key]


def _whole_master(engine, param) -> torch.Tensor:
    """Stage 0: the fp32 master of ``param`` (fp16/bf16 training), else the parameter itself."""
    masters = engine.optimizer.masters if engine.optimizer is not None else {}
    return masters.get(id(param), param)


# ---- fp32 parameters ----------------------------------------------------------------------------------------------
@_with_states_in_memory
def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 (master) value of ``param``. Collective."""
    found = _trained(param)
    if found is None:
        return None
    engine, sp = found
    if sp is None:
        return _whole_master(engine, param).detach().float().clone()
    # without an optimizer there is no master: the compute shard is the value (exact in fp32 training)
    return _gather(engine, sp, sp.master if sp.master is not None else sp.shard, "safe_get_full_fp32_param")


@_with_states_in_memory
def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the whole fp32 value of ``param`` (and its compute-dtype copy). Collective; same value on every rank."""
    engine, _ = _require(param, "safe_set_full_fp32_param")
    set_whole_value(engine, param, value, "safe_set_full_fp32_param")


def set_whole_value(engine, param: torch.Tensor, value: torch.Tensor, what: str) -> None:
    """Write the whole ``value`` of ``param`` (trained or frozen) into what ``engine`` holds of it: its fp32 master,
    this rank's shard and, where the parameter is whole, the parameter. Nothing is exchanged, but every rank calls it
    alike with the same value (under hpZ it changes which shards the next gathers read): ``safe_set_full_fp32_param``
    and ``model.load_state_dict`` after initialize (loaded_state.py)."""
    sp = sharded_param_of(param) if engine.stage > 0 else None
    if sp is None:
        with torch.no_grad():
            param.copy_(value.reshape(param.shape))
            _whole_master(engine, param).copy_(value.reshape(param.shape))
        return
    if sp.status is ParamStatus.INFLIGHT:  # prefetched: its gather would land the old value over the new one
        sp.live_owner.acquire([sp])  # waits for it (issued on every rank); its module still releases it
    _write_master(sp, _local_part(sp, value, what))
    if sp.is_available:  # whole parameters (stages 1-2, gathered or persistent ones at stage 3) are refreshed too
        sp.full[: sp.numel].copy_(value.detach().reshape(-1))
    forget_secondaries([sp])  # hpZ: a copy from a forward gather before the set is stale for backward's


@_with_states_in_memory
def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's fp32 shard of ``param`` (stages 1-3). Not collective."""
    if _trained(param) is None:
        return None
    _, sp = _require_partitioned(param, "safe_get_local_fp32_param")
    return (sp.master if sp.master is not None else sp.shard).detach().float().clone()


@_with_states_in_memory
def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's fp32 shard of ``param`` (and its compute-dtype shard). Not collective; a whole copy of the
    parameter held at stages 1-2 is refreshed at the next step."""
    _, sp = _require_partitioned(param, "safe_set_local_fp32_param")
    _check_local(sp, value, "safe_set_local_fp32_param")
    _write_master(sp, value.detach().reshape(-1).float())


def _write_master(sp: ShardedParam, part: torch.Tensor) -> None:
    with torch.no_grad():
        if sp.master is not None:  # without an optimizer there is no master: the compute shard is the value
            sp.master.copy_(part)
        if not sp.master_is_shard:
            sp.shard.copy_(part)


# ---- gradients ------------------------------------------------------------------------------------------------------
def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient of ``param``, averaged over ranks and accumulated over the micro-batches so far (each
    divided by gradient_accumulation_steps, as backward() does), fp32 and unscaled. Collective. None before the
    first backward of an accumulation window and after the step that applied it."""
    found = _trained(param)
    if found is None or not _grads_valid(found[0]):
        return None
    engine, sp = found
    if engine.stage <= 1:  # gradients are still whole and local: reduced only inside step()
        if param.grad is None:
            return None
        grad = local_grad(param, param.grad).detach().float().clone()
        # over the ranks holding the same values: the world; with tp, the data-parallel groups (mesh.value_comms)
        for comm in value_comms(engine.mesh, engine.comm, engine.shard_comm, engine.replicate_comm):
            comm.all_reduce(grad, op="sum", name="safe_get_full_grad").wait()
        return grad.div_(engine.world_size // engine.mesh.tp_size * _loss_scale(engine))
    engine.reducer.average_across_replicas()  # inside a window under MiCS / HSDP (zero/grads.py); collective
    shard = engine.reducer.shard_grad(sp)
    if shard is None:
        return None
    return _gather(engine, sp, shard, "safe_get_full_grad").div_(_loss_scale(engine))


def tp_full_tensor(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of the unsplit model from ``value``, this rank's tp-local piece of ``param`` (what
    ``safe_get_full_*`` return, or ``param.to_local()`` inside GatheredParameters): torch's all-gather over the tp
    ranks (``DTensor.full_tensor``), collective over them. A parameter not split by tensor parallelism: ``value``
    as it is."""
    if not is_dtensor(param):
        return value
    from torch.distributed.tensor import DTensor

    sp = sharded_param_of(param)  # the local shape: a released parameter's local tensor holds 0 elements
    local = value.reshape(sp.shape if sp is not None else param.to_local().shape)
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride()).full_tensor()


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the gradient the next step applies to ``param`` (fp32, unscaled). Collective; same value on every
    rank. Only between a backward() and the step that applies it."""
    engine, sp = _require(param, "safe_set_full_grad")
    _require_grads(engine, "safe_set_full_grad")
    scaled = value.detach().float().reshape(param.shape if engine.stage <= 1 else sp.shape) * _loss_scale(engine)
    if engine.stage <= 1:  # every rank holds the same value: the average inside step() leaves it unchanged
        param.grad = scaled.to(param.dtype)
        return
    engine.reducer.shard_grad(sp).copy_(_local_part(sp, scaled, "safe_set_full_grad"))


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's shard of the reduced gradient (stages 2-3, where gradients are partitioned). Not collective."""
    found = _trained(param)
    if found is None or not _grads_valid(found[0]):
        return None
    engine, sp = _require_grad_partitioned(param, "safe_get_local_grad")
    shard = engine.reducer.shard_grad(sp)
    return None if shard is None else shard.detach().float().div(_loss_scale(engine))


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace this rank's shard of the reduced gradient (stages 2-3; fp32, unscaled). Not collective."""
    engine, sp = _require_grad_partitioned(param, "safe_set_local_grad")
    _require_grads(engine, "safe_set_local_grad")
    _check_local(sp, value, "safe_set_local_grad")
    engine.reducer.shard_grad(sp).copy_(value.detach().reshape(-1).float() * _loss_scale(engine))


def safe_update_full_grad_vectorized(param_list, update_func: Callable) -> None:
    """For each parameter: ``new = update_func(full_grad, param)`` and set it as its gradient. Collective."""
    for p in param_list:
        grad = safe_get_full_grad(p)
        if grad is not None:
            safe_set_full_grad(p, update_func(grad, p))


def _require_grads(engine, what: str) -> None:
    if not _grads_valid(engine):
        raise RuntimeError(f"{what}: no gradients to set: call it after backward() and before the step() that "
                           "applies them")


def _require_grad_partitioned(param, what: str):
    engine, sp = _require_partitioned(param, what)
    if engine.stage < 2:
        raise ValueError(f"{what}: gradients are partitioned at ZeRO stages 2-3 only; this engine runs stage "
                         f"{engine.stage}: use safe_get_full_grad / safe_set_full_grad")
    return engine, sp


# ---- optimizer states -----------------------------------------------------------------------------------------------
@_with_states_in_memory
def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole fp32 optimizer state ``optim_state_key`` ("exp_avg", "exp_avg_sq", "momentum_buffer") of
    ``param``. Collective."""
    found = _trained(param)
    if found is None:
        return None
    engine, sp = found
    state = _state_tensor(engine, param, optim_state_key, "safe_get_full_optimizer_state")
    if sp is None:
        return state.detach().float().clone()
    return _gather(engine, sp, state, "safe_get_full_optimizer_state")


@_with_states_in_memory
def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the whole optimizer state ``optim_state_key`` of ``param``. Collective; same value on every rank."""
    engine, sp = _require(param, "safe_set_full_optimizer_state")
    state = _state_tensor(engine, param, optim_state_key, "safe_set_full_optimizer_state")
    with torch.no_grad():
        if sp is None:
            state.copy_(value.reshape(state.shape))
        else:
            state.copy_(_local_part(sp, value, "safe_set_full_optimizer_state"))


@_with_states_in_memory
def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's shard of the optimizer state ``optim_state_key`` (stages 1-3). Not collective."""
    if _trained(param) is None:
        return None
    engine, _ = _require_partitioned(param, "safe_get_local_optimizer_state")
    return _state_tensor(engine, param, optim_state_key, "safe_get_local_optimizer_state").detach().clone()


@_with_states_in_memory
def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's shard of the optimizer state ``optim_state_key`` (stages 1-3). Not collective."""
    engine, sp = _require_partitioned(param, "safe_set_local_optimizer_state")
    _check_local(sp, value, "safe_set_local_optimizer_state")
    state = _state_tensor(engine, param, optim_state_key, "safe_set_local_optimizer_state")
    with torch.no_grad():
        state.copy_(value.detach().reshape(-1))
