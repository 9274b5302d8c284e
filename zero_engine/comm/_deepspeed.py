"""``deepspeed.comm``'s functions, so ``import zero_engine as deepspeed; deepspeed.comm.get_rank()`` works.

DeepSpeed's ``deepspeed.comm`` is torch.distributed with the same signatures plus three keyword arguments for its
comms logger (``prof``, ``log_name``, ``debug``). Here each function is torch.distributed's own, taking those three
as well: ``log_name`` and ``debug`` only label a call in DeepSpeed's logger, which zero_engine does not have, so they
are accepted and have no effect; ``prof=True`` (asking for that logging) is refused. The engine's own collectives go
through ``Communicator``, whose counters are ``engine.comm_stats()``; calls made here are not counted there.
"""

from __future__ import annotations

import functools
import os

import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = ["ReduceOp", "is_initialized", "is_available", "get_rank", "get_world_size", "get_local_rank",
           "get_global_rank", "get_world_group", "get_all_ranks_from_group", "new_group", "destroy_process_group",
           "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "all_reduce", "reduce",
           "all_gather", "all_gather_object", "all_gather_into_tensor", "allgather_fn", "reduce_scatter",
           "reduce_scatter_tensor", "reduce_scatter_fn", "all_to_all_single", "send", "recv", "isend", "irecv",
           "gather", "scatter", "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "log_summary"]


def _with_logger_kwargs(torch_fn):
    """torch_fn, also accepting DeepSpeed's comms-logger keywords (see the module docstring)."""

    @functools.wraps(torch_fn)
    def call(*args, prof: bool = False, log_name: str | None = None, debug=None, **kwargs):
        if prof:
            raise NotImplementedError(f"deepspeed.comm.{torch_fn.__name__}(prof=True): zero_engine has no comms "
                                      "logger; use engine.comm_stats() for the engine's collectives, or "
                                      "torch.profiler")
        return torch_fn(*args, **kwargs)

    call.__doc__ = f"torch.distributed.{torch_fn.__name__}, with DeepSpeed's prof/log_name/debug keywords."
    return call


broadcast = _with_logger_kwargs(dist.broadcast)
all_reduce = _with_logger_kwargs(dist.all_reduce)
reduce = _with_logger_kwargs(dist.reduce)
all_gather = _with_logger_kwargs(dist.all_gather)
all_gather_into_tensor = _with_logger_kwargs(dist.all_gather_into_tensor)
reduce_scatter = _with_logger_kwargs(dist.reduce_scatter)
reduce_scatter_tensor = _with_logger_kwargs(dist.reduce_scatter_tensor)
all_to_all_single = _with_logger_kwargs(dist.all_to_all_single)
send = _with_logger_kwargs(dist.send)
recv = _with_logger_kwargs(dist.recv)
isend = _with_logger_kwargs(dist.isend)
irecv = _with_logger_kwargs(dist.irecv)
gather = _with_logger_kwargs(dist.gather)
scatter = _with_logger_kwargs(dist.scatter)
barrier = _with_logger_kwargs(dist.barrier)
monitored_barrier = dist.monitored_barrier
broadcast_object_list = dist.broadcast_object_list
all_gather_object = dist.all_gather_object
new_group = dist.new_group
destroy_process_group = dist.destroy_process_group
is_initialized = dist.is_initialized
is_available = dist.is_available


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    """DeepSpeed's name for all_gather_into_tensor."""
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None):
    """DeepSpeed's name for reduce_scatter_tensor."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op, prof=prof)


def get_rank(group=None) -> int:
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node: LOCAL_RANK from the launcher (torchrun, deepspeed), else 0."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)


def get_world_group():
    return dist.group.WORLD


def get_all_ranks_from_group(group=None) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def log_summary(show_straggler: bool = False):
    raise NotImplementedError("deepspeed.comm.log_summary(): zero_engine has no comms logger; use "
                              "engine.comm_stats() (calls and bytes per collective kind)")
