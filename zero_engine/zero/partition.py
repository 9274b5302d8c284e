"""How one parameter is split across ranks, and the state machine of its full (gathered) data.

Every parameter is flattened and padded to ``shard_numel * world`` elements; rank ``r`` keeps the slice
``[r * shard_numel, (r + 1) * shard_numel)``. The last rank's slice is zero-padded, so a parameter with fewer
elements than ranks still gives every rank one shard of the same size (collectives need equal sizes).

[Note: release resizes storage, it does not swap tensors]
Autograd keeps views of a parameter for backward (``F.linear`` saves ``weight.t()``). If releasing only pointed
``param.data`` at an empty tensor, those saved views would keep the full storage alive: no memory returned, and the
accounting would lie. So each parameter owns one flat ``full`` buffer whose *storage* is resized to zero bytes on
release and back to full size on gather; every saved view shares that storage and sees the re-gathered values.
While released, ``param.data`` is a 0-element tensor: a full-shape tensor over a zero-byte storage would crash any
kernel that reads it.
"""

from __future__ import annotations

import enum
import math

import torch
import torch.nn as nn

__all__ = ["ParamStatus", "ShardedParam", "shard_numel_for"]


class ParamStatus(enum.Enum):
    NOT_AVAILABLE = "not_available"  # only the local shard exists
    INFLIGHT = "inflight"  # a gather into `full` has been issued and not waited on
    AVAILABLE = "available"  # `param.data` is the full tensor


def shard_numel_for(numel: int, world_size: int) -> int:
    return max(1, math.ceil(numel / world_size))


class ShardedParam:
    """The partition state of one parameter: metadata, this rank's shard, the full buffer and its status.

    Kept beside the ``nn.Parameter`` (the engine maps parameter -> ShardedParam); nothing is attached to the
    parameter object itself.
    """

    def __init__(self, param: nn.Parameter, fqn: str, index: int, rank: int, world_size: int):
        self.param = param
        self.fqn = fqn
        self.index = index  # position in the fixed parameter order: gradient buckets are built from it
        self.shape = param.shape
        self.numel = param.numel()
        self.dtype = param.dtype
        self.shard_numel = shard_numel_for(self.numel, world_size)
        self.padded_numel = self.shard_numel * world_size
        self.rank = rank
        self.world_size = world_size
        self.is_persistent = False  # kept gathered between uses (small params; stages 1 and 2: all params)
        self.active_users = 0  # modules between their pre- and post- (forward or backward) hooks
        self.status = ParamStatus.NOT_AVAILABLE
        self._empty = torch.empty(0, dtype=self.dtype, device=param.device)

        flat = param.detach().reshape(-1)
        start = rank * self.shard_numel
        self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=param.device)
        end = min(start + self.shard_numel, self.numel)
        if end > start:
            self.shard[: end - start].copy_(flat[start:end])
        # The full buffer starts with the parameter's own data; `release()` frees it.
        self.full = torch.empty(self.padded_numel, dtype=self.dtype, device=param.device)
        self.full[: self.numel].copy_(flat)
        self.full[self.numel :].zero_()
        param.data = self.full[: self.numel].view(self.shape)
        self.status = ParamStatus.AVAILABLE

    # ---- state transitions -------------------------------------------------------------------------------------
    def to_inflight(self, refresh: bool = False) -> None:
        """``refresh``: re-gather an AVAILABLE parameter after its shard changed (optimizer step)."""
        allowed = (ParamStatus.NOT_AVAILABLE, ParamStatus.AVAILABLE) if refresh else (ParamStatus.NOT_AVAILABLE,)
        if self.status not in allowed:
            raise AssertionError(f"{self.fqn}: gather issued while {self.status.name} on rank {self.rank}")
        self.status = ParamStatus.INFLIGHT

    def alloc_full(self) -> torch.Tensor:
        """Give the full buffer its bytes back (the same storage object) for a gather to write into."""
        storage = self.full.untyped_storage()
        if storage.size() != self.full_bytes:
            storage.resize_(self.full_bytes)
        return self.full

    def to_available(self) -> None:
        if self.status is not ParamStatus.INFLIGHT:
            raise AssertionError(f"{self.fqn}: made available while {self.status.name} on rank {self.rank}")
        self.param.data = self.full[: self.numel].view(self.shape)
        self.status = ParamStatus.AVAILABLE

    def release(self) -> None:
        """Free the full data (see [Note: release resizes storage, it does not swap tensors])."""
        if self.status is not ParamStatus.AVAILABLE:
            raise AssertionError(f"{self.fqn}: released while {self.status.name} on rank {self.rank}")
        self.param.data = self._empty
        self.full.untyped_storage().resize_(0)
        self.status = ParamStatus.NOT_AVAILABLE

    # ---- views -------------------------------------------------------------------------------------------------
    @property
    def full_bytes(self) -> int:
        return self.padded_numel * self.full.element_size()

    @property
    def is_available(self) -> bool:
        return self.status is ParamStatus.AVAILABLE

    def local_slice(self) -> slice:
        """This rank's range in the flat (unpadded) parameter; empty on ranks that hold only padding."""
        start = min(self.rank * self.shard_numel, self.numel)
        return slice(start, min(start + self.shard_numel, self.numel))

    def __repr__(self) -> str:
        return (f"ShardedParam({self.fqn}, shape={tuple(self.shape)}, shard={self.shard_numel}, "
                f"status={self.status.name}, persistent={self.is_persistent})")
