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
    if engine.stage == 0:
        stepped = {id(p) for g in optimizer.optimizer.param_groups for p in g["params"]} if optimizer else set()
        for name, p in engine.module.named_parameters():
            info = ParamInfo(name, tuple(p.shape), p.numel(), max(1, p.numel()), dtype_name(p.dtype),
                             p.requires_grad)
            master = masters.get(id(p))
            opt_param = master if master is not None else p
            views.append(ParamView(info, 0, p.numel(), p, p.detach().reshape(-1) if engine.comm.rank == 0 else None,
                                   master.detach().view(-1) if master is not None else None,
                                   opt_param if id(opt_param) in stepped else None))
        return views
    world = engine.comm.world_size
    for sp in engine.sharded:
        local = sp.local_slice()
        # an expert's piece of the global tensor: see [Note: checkpoints of expert parameters] in _metadata.py
        ep = world // sp.world_size if getattr(sp, "group", None) is not None else 1
        offset = engine.comm.rank % ep * sp.numel
        shape = tuple(sp.shape) if ep == 1 else (ep * sp.shape[0], *sp.shape[1:]) if sp.shape else (ep,)
        info = ParamInfo(sp.fqn, shape, ep * sp.numel, sp.shard_numel, dtype_name(sp.dtype),
                         sp.param.requires_grad, ep)
        master = sp.master if sp.master is not None and not sp.master_is_shard else None
        views.append(ParamView(info, offset + local.start, offset + local.stop, sp.param, sp.shard, master,
                               masters.get(id(sp.param)), sp))
    return views


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
