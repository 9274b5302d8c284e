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

from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ParamStatus", "ShardedParam", "ZeroParameter", "shard_numel_for", "sharded_param_of"]

# nn.Parameter -> its ShardedParam, so zero.Init, GatheredParameters and the engine find a parameter's state
# without attaching anything to the parameter object (weak: a dropped model frees its entries).
_REGISTRY = WeakIdKeyDictionary()


def sharded_param_of(param: torch.Tensor) -> "ShardedParam | None":
    return _REGISTRY.get(param)


class ZeroParameter(nn.Parameter):
    """The class a partitioned ``nn.Parameter`` takes: using it while released is a clear error, not a silent 0.

    While released a parameter's data is a 0-element tensor, so ``model.lm_head.weight.sum()`` in user code would
    quietly return 0. Attribute access (``.grad``, ``.data``, ``.requires_grad``...) and metadata queries stay
    allowed; any other torch function on a released parameter raises, saying to use GatheredParameters. Inside the
    engine's hooks the parameter is gathered, so the check passes at the cost of one dictionary lookup per op.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            if getattr(func, "__name__", "") not in _ALWAYS_ALLOWED:
                for arg in args:
                    if type(arg) is ZeroParameter and arg.numel() == 0:
                        sp = _REGISTRY.get(arg)
                        if sp is not None and sp.status is not ParamStatus.AVAILABLE:
                            raise RuntimeError(
                                f"{sp.fqn or 'parameter'} is partitioned (ZeRO-3): this rank holds only its shard, "
                                f"so {getattr(func, '__name__', func)}() on it would see no data. Read or edit it "
                                "inside `with zero_engine.zero.GatheredParameters(param):` (pass modifier_rank= to "
                                "keep edits).")
            return func(*args, **(kwargs or {}))


_ALWAYS_ALLOWED = {"__get__", "__set__", "__delete__", "__repr__", "__format__", "numel", "dim", "size",
                   "element_size", "is_floating_point", "is_complex", "requires_grad_", "register_hook",
                   "register_post_accumulate_grad_hook", "untyped_storage", "data_ptr", "__reduce_ex__",
                   "__deepcopy__", "__hash__", "__eq__"}


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

    def __init__(self, param: nn.Parameter, fqn: str, index: int, rank: int, world_size: int,
                 dtype: torch.dtype | None = None):
        """Shard ``param`` (its current full data) for ``rank``; ``dtype``: the compute dtype to cast to."""
        self.param = param
        self.fqn = fqn
        self.index = index  # position in the fixed parameter order: gradient buckets are built from it
        self.shape = param.shape
        self.numel = param.numel()
        self.dtype = dtype or param.dtype
        self.shard_numel = shard_numel_for(self.numel, world_size)
        self.padded_numel = self.shard_numel * world_size
        self.rank = rank
        self.world_size = world_size
        self.is_persistent = False  # kept gathered between uses (small params; stages 1 and 2: all params)
        self.active_users = 0  # modules between their pre- and post- (forward or backward) hooks
        self.held_by_user = 0  # GatheredParameters blocks holding it gathered: the coordinator must not release it
        self.live_owner = None  # the coordinator counting its full data in its live budget, if any
        self.status = ParamStatus.NOT_AVAILABLE
        self.master: torch.Tensor | None = None  # the fp32 master shard, once an optimizer owns one
        self.master_is_shard = False  # fp32 training: the master and the compute shard are one tensor
        self._empty = torch.empty(0, dtype=self.dtype, device=param.device)

        flat = param.detach().reshape(-1)
        exact = torch.zeros(self.shard_numel, dtype=param.dtype, device=param.device)
        local = self.local_slice()
        exact[: local.stop - local.start].copy_(flat[local])
        # The master starts from the full-precision value, not from its 16-bit rounding.
        needs_master = param.requires_grad and param.is_floating_point() and self.dtype != torch.float32
        self.master_init = exact.float() if needs_master else None  # frozen params: no master, no copy
        self.shard = exact.to(self.dtype)
        # The full buffer starts with the parameter's own data; `release()` frees it.
        self.full = torch.empty(self.padded_numel, dtype=self.dtype, device=param.device)
        self.full[: self.numel].copy_(flat)
        self.full[self.numel:].zero_()
        param.data = self.full[: self.numel].view(self.shape)
        self.status = ParamStatus.AVAILABLE
        _REGISTRY[param] = self
        if type(param) is nn.Parameter:  # subclasses of users' own are left as they are
            param.__class__ = ZeroParameter

    @classmethod
    def from_meta(cls, meta_param: nn.Parameter, fqn: str, index: int, rank: int, world_size: int,
                  device: torch.device | str = "cpu") -> "ShardedParam":
        """The released state of a parameter built on the meta device, without ever allocating its full data.

        For values that come from elsewhere (zero_engine.hf streams a checkpoint into ``shard``): the shard is
        zero-filled, the fp32 ``master_init`` (16-bit trainable parameters) too; the caller writes both. A meta
        tensor cannot take CPU data in place, so the state holds a new parameter (``.param``, a ZeroParameter with
        the same requires_grad) that the caller puts into the module(s) in place of ``meta_param``.
        """
        if meta_param.device.type != "meta":
            raise ValueError(f"ShardedParam.from_meta: {fqn} is on {meta_param.device}, expected the meta device")
        sp = cls(meta_param, fqn, index, rank, world_size)  # on meta: metadata only, nothing allocated
        del _REGISTRY[meta_param]
        param = nn.Parameter(torch.empty(0, dtype=sp.dtype, device=device), requires_grad=meta_param.requires_grad)
        sp.param = param
        sp.shard = torch.zeros(sp.shard_numel, dtype=sp.dtype, device=device)
        sp.master_init = None if sp.master_init is None else torch.zeros(sp.shard_numel, dtype=torch.float32,
                                                                         device=device)
        sp.full = torch.empty(sp.padded_numel, dtype=sp.dtype, device=device)
        sp.full.untyped_storage().resize_(0)
        sp._empty = torch.empty(0, dtype=sp.dtype, device=device)
        param.data = sp._empty
        sp.status = ParamStatus.NOT_AVAILABLE
        _REGISTRY[param] = sp
        param.__class__ = ZeroParameter
        return sp

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

    def take_full_into_shard(self) -> None:
        """After the full data was edited (GatheredParameters, zero.Init): keep this rank's slice of it."""
        if self.status is not ParamStatus.AVAILABLE:
            raise AssertionError(f"{self.fqn}: resharding needs the full data; status {self.status.name}")
        local = self.local_slice()
        for target in (self.shard, None if self.master_is_shard else self.master):
            if target is not None:
                target.zero_()
                target[: local.stop - local.start].copy_(self.full[local])

    def cast_(self, dtype: torch.dtype) -> None:
        """Change the compute dtype of a released parameter (zero.Init builds in fp32; the engine casts)."""
        if dtype == self.dtype:
            return
        if self.status is not ParamStatus.NOT_AVAILABLE:
            raise AssertionError(f"{self.fqn}: cast while {self.status.name}")
        self.master_init = self.shard.float() if dtype != torch.float32 and self.param.requires_grad else None
        self.shard = self.shard.to(dtype)
        self.dtype = dtype
        self.full = torch.empty(self.padded_numel, dtype=dtype, device=self.shard.device)
        self.full.untyped_storage().resize_(0)
        self._empty = torch.empty(0, dtype=dtype, device=self.shard.device)
        self.param.data = self._empty

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
