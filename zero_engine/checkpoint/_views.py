"""What an engine holds of each parameter on this rank, in one shape for every ZeRO stage.

Stages 1-3 keep a ``ShardedParam`` per parameter: a flat padded shard in the compute dtype, and for trainable
parameters an fp32 master (the shard itself in fp32 training). Stage 0 keeps whole parameters on every rank; it is
described as a partition over one rank (rank 0's copy is the one saved), so saving, resharding and consolidation
need no stage-0 special case beyond where the values live.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from ._metadata import BufferInfo, ParamInfo, state_dict_layout

__all__ = ["ParamView", "param_views", "buffer_items", "dtype_name", "states_in_memory"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class ParamView:
    info: ParamInfo  # an expert parameter's is the global tensor's ([Note: checkpoints of expert parameters])
    start: int  # this rank's range [start, stop) of the parameter's real (unpadded) flat elements
    stop: int
    param: nn.Parameter
    shard: torch.Tensor | None  # flat, padded to info.shard_numel, compute dtype; None: this rank saves no copy
    master: torch.Tensor | None  # a separate fp32 master shard (16-bit training); None when the shard is the master
    opt_param: torch.Tensor | None  # the tensor the torch optimizer keys this parameter's state by
    sharded: object = None  # the ShardedParam (stages 1-3)


def param_views(engine) -> list[ParamView]:
    """One view per parameter, in the engine's fixed order (``model.named_parameters()``, tied ones once)."""
    views = []
    optimizer = engine.optimizer  # None for an engine without one (forward/backward only; loads weights only)
    masters = optimizer.masters if optimizer is not None else {}  # stage 0: whole fp32 masters under fp16/bf16
    world, rank = engine.comm.world_size, engine.comm.rank
    if engine.stage == 0:
        stepped = {id(p) for g in optimizer.optimizer.param_groups for p in g["params"]} if optimizer else set()
        for name, p in engine.module.named_parameters():
            group = engine.shard_groups.get(id(p))  # an MoE expert's: its edp group (zero/expert.py)
            ep = world // group.comm.world_size if group is not None else 1
            shape, numel, offset = _whole(p.shape, p.numel(), ep, rank % ep)
            info = ParamInfo(name, shape, numel, max(1, p.numel()), dtype_name(p.dtype), p.requires_grad, ep)
            master = masters.get(id(p))
            opt_param = master if master is not None else p
            saves = rank < ep  # rank 0; an expert's: the first rank of its edp group (world ranks 0 .. ep - 1)
            views.append(ParamView(info, offset, offset + p.numel(), p, p.detach().reshape(-1) if saves else None,
                                   master.detach().view(-1) if master is not None else None,
                                   opt_param if id(opt_param) in stepped else None))
        return views
    for sp in engine.sharded:
        local = sp.local_slice()
        ep = world // sp.world_size if sp.group is not None else 1
        shape, numel, offset = _whole(sp.shape, sp.numel, ep, rank % ep)
        info = ParamInfo(sp.fqn, shape, numel, sp.shard_numel, dtype_name(sp.dtype), sp.param.requires_grad, ep)
        master = sp.master if sp.master is not None and not sp.master_is_shard else None
        views.append(ParamView(info, offset + local.start, offset + local.stop, sp.param, sp.shard, master,
                               masters.get(id(sp.param)), sp))
    return views


def _whole(shape, numel: int, ep: int, ep_rank: int) -> tuple[tuple[int, ...], int, int]:
    """The shape and numel of the tensor a parameter is saved as, and where this rank's values start in it: itself,
    or for an expert parameter (``ep`` > 1) its ep ranks' tensors back to back ([Note: checkpoints of expert
    parameters] in _metadata.py)."""
    if ep == 1:
        return tuple(shape), numel, 0
    return ((ep * shape[0], *shape[1:]) if len(shape) else (ep,)), ep * numel, ep_rank * numel


def states_in_memory(engine):
    """Masters and optimizer states as in-memory tensors for the block. Under NVMe optimizer offload they live in
    files between steps; they are read in (this rank's whole states: host memory for them is needed), and written
    back after, so the checkpoint format is the same with and without offload."""
    enter = getattr(engine.optimizer, "states_in_memory", None)
    return enter() if enter is not None else contextlib.nullcontext()


def buffer_items(module: nn.Module) -> list[tuple[BufferInfo, torch.Tensor]]:
    """The persistent buffers ``state_dict()`` would hold, each once, by name."""
    by_name = dict(module.named_buffers())
    return [(BufferInfo(key, tuple(by_name[key].shape), dtype_name(by_name[key].dtype)), by_name[key])
            for key, kind, name in state_dict_layout(module) if kind == "buffer" and key == name]
