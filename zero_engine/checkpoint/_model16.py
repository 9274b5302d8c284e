"""engine.save_16bit_model: one plain state dict in the compute dtype, gathered onto rank 0 one parameter at a time.

At stage 3 this needs ``zero_optimization.stage3_gather_16bit_weights_on_model_save: true`` (as in DeepSpeed);
without it nothing is written and False is returned, since no rank holds whole weights. Each partitioned
parameter is all-gathered on its own and released right after rank 0 copied it, so the transient cost on every
rank is one parameter; rank 0 streams each one to host memory as it arrives, so its GPU never holds more than one
gathered parameter either; the whole model is held once, in host memory, in the compute dtype (2 bytes per
parameter for bf16/fp16), which is what it writes.

With a ``tp`` mesh dim the file holds the whole tensors of the unsplit model, as zero_engine.hf.save_pretrained
writes them: each tp rank's piece is gathered over its dp ranks, then torch's ``DTensor.full_tensor`` all-gathers
the pieces over tp (every rank takes part; one whole parameter at a time is the transient cost). An MoE expert
parameter is written whole, ``[num_experts, ...]``: its shards gathered over the world onto rank 0
(``whole_expert_on_rank0``).
"""

from __future__ import annotations

import logging
import os

import torch

from ..zero.expert import whole_expert_on_rank0
from ..zero.gather import SequentialGather
from ._atomic import private_temporary
from ._collective import agree, rendezvous
from ._metadata import state_dict_layout
from ._views import buffer_items
from ..zero.tensor_parallel import is_dtensor

log = logging.getLogger("zero_engine.checkpoint")

__all__ = ["save_16bit_model"]


def save_16bit_model(engine, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
    """Collective: rank 0 writes ``save_dir/save_filename`` (torch.save of a state dict); returns True if saved.

    Every rank must call it. A rank that does not makes the others raise within
    ``zero_engine.collective_timeout_s`` seconds (naming it, on gloo) instead of waiting forever.
    """
    comm = engine.comm
    if engine.stage == 3 and not engine.config.zero_optimization.gather_16bit_weights_on_model_save:
        if comm.rank == 0:
            log.warning("save_16bit_model: did not save %s: at ZeRO stage 3 it needs "
                        "zero_optimization.stage3_gather_16bit_weights_on_model_save: true (no rank holds whole "
                        "weights otherwise); use save_checkpoint + `zero-engine to-fp32` instead",
                        os.path.join(os.fspath(save_dir), save_filename))
        return False
    rendezvous(comm, "save_16bit_model", comm.collective_timeout_s)
    from ..utils import shards_in_memory_of
    values: dict[str, torch.Tensor] = {}
    gatherer = SequentialGather(engine.shard_comm or comm)  # each shard group gathers; world rank 0 writes
    if engine.stage == 0:
        for name, p in engine.module.named_parameters():
            group = engine.shard_groups.get(id(p))  # an MoE expert's: whole over its ep ranks (zero/expert.py)
            value = p.detach() if group is None else \
                whole_expert_on_rank0(p.detach().reshape(-1), comm, group.comm.world_size, p.numel(), p.shape)
            if comm.rank == 0:
                values[name] = to_host(value)
    for sp in engine.sharded:
        if sp.group is not None:  # an expert's: whole over its ep ranks (zero/expert.py)
            with shards_in_memory_of([sp]):  # NVMe parameter offload: its shard bucket read in for the gather
                whole = whole_expert_on_rank0(sp.shard, comm, sp.world_size, sp.numel, sp.shape)
            if whole is not None:
                values[sp.fqn] = to_host(whole)
            continue
        if sp.is_available:  # stages 1-2, and persistent parameters at stage 3: already whole everywhere
            _keep_on_rank0(values, sp, comm.rank)
            continue
        with shards_in_memory_of([sp]):  # NVMe parameter offload: its shard bucket read in for the gather
            gatherer.issue([sp], name=f"save_16bit_model {sp.fqn}").wait()
        try:
            _keep_on_rank0(values, sp, comm.rank)
        finally:
            sp.release()
    for info, buffer in buffer_items(engine.module):
        values[info.name] = to_host(buffer)
    path = os.path.join(os.path.abspath(os.fspath(save_dir)), save_filename)
    agree(comm, f"writing {path}", lambda: _write(path, values, state_dict_layout(engine.module))
          if comm.rank == 0 else None)
    return True


def _keep_on_rank0(values: dict, sp, rank: int) -> None:
    """Rank 0 keeps a host copy of the gathered parameter; a DTensor's tp pieces are first put together (a
    collective over tp, so every rank calls this)."""
    local = sp.full[: sp.numel].view(sp.shape)
    if is_dtensor(sp.param):
        from ..utils import tp_full_tensor

        local = tp_full_tensor(sp.param, local)
    if rank == 0:
        values[sp.fqn] = to_host(local)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` (never a view of it): a GPU tensor is copied out at once, so rank 0's GPU holds
    one gathered parameter at a time, not the whole model."""
    return tensor.detach().to("cpu", copy=True)


def _write(path: str, values: dict[str, torch.Tensor], layout) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state_dict = {key: values[name] for key, _, name in layout}  # tied names share one tensor, as in state_dict()
    with private_temporary(path) as tmp:  # this writer's own temporary, renamed over path (fsynced)
        with open(tmp, "wb") as f:
            torch.save(state_dict, f)
            f.flush()
            os.fsync(f.fileno())
    log.info("save_16bit_model: wrote %s (%d tensors)", path, len(values))
