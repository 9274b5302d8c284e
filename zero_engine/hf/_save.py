"""save_pretrained: a directory that plain ``transformers.AutoModel*.from_pretrained`` loads, written from the shards.

    zero_engine.hf.save_pretrained(engine, "out/model")                      # compute dtype (bf16 under bf16)
    zero_engine.hf.save_pretrained(engine, "out/model", dtype=torch.float32) # from the fp32 master weights

Collective: every rank calls it. Each tensor is gathered on its own onto rank 0 (a watched ``gather`` of the shards
into one buffer there; the other ranks allocate nothing), written into the open safetensors shard and dropped, so
rank 0's extra memory is one tensor and the others' is none. The files: ``config.json`` (``dtype`` and
``architectures`` set as transformers sets them), ``generation_config.json`` when the model has one, and
``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` (``max_shard_size``,
transformers' default 50GB). Tied weights are saved once, under the first of their names in ``state_dict()``
(the input embedding for the usual LM head tying), and ``_keys_to_ignore_on_save`` are left out, as transformers
does. An MoE expert parameter (zero_engine.moe; DeepSpeed's marks) is saved whole, ``[num_experts, ...]``: its ep
ranks' experts in order, as ``save_16bit_model`` and the checkpoints hold it (``whole_expert_on_rank0``), the stacked
layout of transformers' own MoE experts (Mixtral's ``gate_up_proj`` / ``down_proj``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re

import torch

from ..checkpoint._atomic import private_temporary
from ..zero.expert import whole_expert_on_rank0
from ..zero.partition import ShardedParam, sharded_param_of
from ..zero.tensor_parallel import is_dtensor
from ._transformers import require_transformers
from ._writer import SafetensorsWriter, parse_size, plan_shards

log = logging.getLogger("zero_engine.hf")

__all__ = ["save_pretrained"]

_WEIGHT_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def save_pretrained(engine, path, dtype: torch.dtype | None = None, max_shard_size: int | str = "50GB") -> None:
    """Write ``engine.module`` (a transformers model) to ``path``; see the module docstring. ``dtype``: None for
    the compute dtype (the values the engine computes with), ``torch.float32`` for the fp32 master weights
    (exactly what the optimizer holds), or another floating dtype (cast from the masters)."""
    require_transformers("zero_engine.hf.save_pretrained")
    model = engine.module
    if not hasattr(model, "config") or not hasattr(model.config, "save_pretrained"):
        raise ValueError(f"save_pretrained: engine.module is a {type(model).__name__}, not a transformers model; "
                         "use engine.save_checkpoint or engine.save_16bit_model")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"save_pretrained: dtype={dtype} is not a floating dtype")
    comm = engine.comm
    path = os.path.abspath(os.fspath(path))
    entries = _tensors_to_save(model, engine, dtype)
    plan = plan_shards([(name, out_dtype, _shape(t, engine)) for name, t, out_dtype in entries],
                       parse_size(max_shard_size))
    error = None
    if comm.rank == 0:
        error = _try(lambda: _prepare_directory(path, model, entries))
    writer, file_index, position = None, 0, 0
    filenames = plan.filenames()
    with _masters_in_memory(engine, entries):  # NVMe optimizer offload: fp32 masters read in for the save
        for name, tensor, out_dtype in entries:
            with torch.profiler.record_function(f"zero3::hf_save {name}"):
                value = _gather_on_rank0(tensor, out_dtype, engine, comm)
            if comm.rank != 0 or error is not None:
                continue
            try:
                if writer is None:
                    writer = SafetensorsWriter(os.path.join(path, filenames[file_index]), plan.files[file_index])
                writer.write(name, value)
                position += 1
                if position == len(plan.files[file_index]):
                    writer.close()
                    writer, file_index, position = None, file_index + 1, 0
            except Exception as exc:  # noqa: BLE001 -- keep gathering with the others; every rank raises below
                error = exc
                if writer is not None:
                    writer.abort()
            del value
    if comm.rank == 0 and error is None and len(filenames) > 1:
        error = _try(lambda: _write_json(os.path.join(path, "model.safetensors.index.json"), plan.index()))
    outcome = comm.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if outcome[0] is not None:
        raise RuntimeError(f"save_pretrained: writing {path} failed on rank 0 (this is rank {comm.rank}): "
                           f"{outcome[0]}")
    if comm.rank == 0:
        log.info("save_pretrained: wrote %s (%d tensors in %d file(s))", path, len(entries), len(filenames))


def _try(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 -- reported to every rank by the caller
        return exc
    return None


def _tensors_to_save(model, engine, dtype) -> list[tuple[str, torch.Tensor, torch.dtype]]:
    """(name, parameter or buffer, saved dtype) in state_dict order; tied weights once; ignore-on-save left out."""
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    seen, out = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen or name in ignore:
            continue
        seen.add(id(tensor))
        sp = sharded_param_of(tensor)
        current = sp.dtype if sp is not None else tensor.dtype
        out.append((name, tensor, dtype if dtype is not None and current.is_floating_point else current))
    return out


def _shape(tensor: torch.Tensor, engine) -> tuple[int, ...]:
    if is_dtensor(tensor):  # split by tensor parallelism: the whole tensor is saved
        return tuple(tensor.shape)
    sp = sharded_param_of(tensor)
    shape = tuple(sp.shape if sp is not None else tensor.shape)
    edp = _expert_data_parallel_size(tensor, engine)
    if edp is None:
        return shape
    return (engine.comm.world_size // edp * shape[0], *shape[1:])  # every ep rank's experts, stacked


def _expert_data_parallel_size(tensor: torch.Tensor, engine) -> int | None:
    """The size of an expert parameter's edp group (its copies of the same experts), or None for any other tensor."""
    group = engine.shard_groups.get(id(tensor))
    return None if group is None else group.comm.world_size


def _gather_on_rank0(tensor: torch.Tensor, out_dtype: torch.dtype, engine, comm) -> torch.Tensor | None:
    sp = sharded_param_of(tensor)
    # Every value comes back in host memory (the writer reads it through numpy); the gather itself runs on the
    # shards' device, which NCCL requires, one parameter at a time.
    edp = _expert_data_parallel_size(tensor, engine)
    if sp is None:  # a buffer, or a parameter at stage 0: whole on every rank; rank 0's copy is saved
        masters = getattr(engine.optimizer, "masters", {}) if engine.stage == 0 else {}
        master = masters.get(id(tensor))  # fp16/bf16 at stage 0: the fp32 master, the most precise value
        value = (master if master is not None and out_dtype != tensor.dtype else tensor).detach()
        if edp is not None:  # an expert's: its ep rank's experts, the same on its edp ranks; every ep rank's stacked
            value = whole_expert_on_rank0(value.to(out_dtype).reshape(-1), comm, edp, tensor.numel(), tensor.shape)
        return value.to(device="cpu", dtype=out_dtype, copy=True) if comm.rank == 0 else None
    from ..utils import shards_in_memory_of

    with shards_in_memory_of([sp]):  # NVMe parameter offload: its shard bucket read in for the gather
        source = _source_shard(sp, out_dtype)
        local = source.to(sp.compute_device, out_dtype)  # a master on the host (offload): NCCL needs the device
        if edp is not None:  # an expert's: sharded over its edp group (never with a mesh or tp: refused there)
            whole = whole_expert_on_rank0(local, comm, edp, sp.numel, sp.shape)
            return whole.to("cpu", copy=True) if whole is not None else None
        shard_comm = engine.shard_comm  # the world, or a mesh's dp_shard group (MiCS / HSDP: zero_engine/mesh.py)
        if is_dtensor(tensor):  # every rank's tp piece whole over dp, then torch's all-gather over tp
            from ..utils import tp_full_tensor

            piece = torch.empty(sp.padded_numel, dtype=out_dtype, device=local.device)
            shard_comm.all_gather_into_tensor(piece, local, name=f"save_pretrained {sp.fqn}").wait()
            full = tp_full_tensor(tensor, piece[: sp.numel])
            return full.to("cpu", copy=True) if comm.rank == 0 else None
        if shard_comm.world_size == 1:
            return local[: sp.numel].view(sp.shape).to("cpu", copy=True)
        if not engine.mesh.saves_shards or engine.mesh.tp_rank != 0:  # replica 0 of tp rank 0 (world rank 0's)
            return None
        full = torch.empty(sp.padded_numel, dtype=out_dtype, device=local.device) if comm.rank == 0 else None
        shard_comm.gather(full, local, dst=0, name=f"save_pretrained {sp.fqn}")
        return full[: sp.numel].view(sp.shape).to("cpu") if full is not None else None


def _masters_in_memory(engine, entries):
    """A context in which the fp32 masters that ``_source_shard`` reads for ``entries`` are in memory (under NVMe
    optimizer offload they live in files between steps: offload/optimizer_swap.py); nothing when none is read."""
    for _, tensor, out_dtype in entries:
        sp = sharded_param_of(tensor)
        if sp is not None and _source_shard(sp, out_dtype) is not sp.shard:
            from ..utils import states_in_memory_of

            return states_in_memory_of(tensor)
    return contextlib.nullcontext()


def _source_shard(sp: ShardedParam, out_dtype: torch.dtype) -> torch.Tensor:
    """The compute-dtype shard, or the fp32 master shard (the most precise value) for any other dtype."""
    if out_dtype != sp.dtype and sp.master is not None and not sp.master_is_shard:
        return sp.master
    return sp.shard


def _prepare_directory(path: str, model, entries) -> None:
    os.makedirs(path, exist_ok=True)
    for fname in os.listdir(path):  # weights of an earlier save would be mixed with these (transformers does this)
        if _WEIGHT_FILE.match(fname):
            os.remove(os.path.join(path, fname))
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    floating = [out_dtype for _, _, out_dtype in entries if out_dtype.is_floating_point]
    if floating:
        config.dtype = floating[0]
    config.save_pretrained(path)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and model.can_generate():
        generation_config.save_pretrained(path)


def _write_json(path: str, obj) -> None:
    with private_temporary(path) as tmp:  # this writer's own temporary, renamed over path
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
