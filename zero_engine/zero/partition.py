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

[Note: flat shard storage]
Where the bytes of a ZeRO-3 step live (decided once, at initialize):

* *Shards*: every rank keeps ``ceil(numel / world)`` elements of each parameter (per-parameter padding, the on-disk
  checkpoint layout, the fp32 masters and the 16Psi/N formula all rest on this). The engine moves all shards into
  a few flat per-bucket buffers (``ShardBucket``: consecutive parameters, one dtype, up to a bucket of elements);
  ``ShardedParam.shard`` is a view into its bucket's buffer. A run of adjacent shards is then one tensor: it is the
  input of a coalesced all-gather as it stands (no ``cat``), and an offloader can move or swap a bucket as one
  tensor and re-point the views (``ShardBucket.rebind``).
* *Gathered parameters*: each parameter's full data is contiguous in its own ``full`` buffer (padded), so autograd's
  saved views and ``param.data`` stay valid across release/gather (the note above). A parameter of at least
  ``DIRECT_GATHER_NUMEL`` elements is all-gathered straight into that buffer: the collective's output *is* the
  parameter's storage, nothing is copied. Smaller parameters are coalesced, a run of them per collective, through
  a staging buffer and copied out: below that size one collective per parameter costs more in fixed latency than
  the copy (``bench/gather_probe.py``, 4 parameters, gloo, 2 and 4 ranks: coalescing wins clearly up to 256k
  elements each, ties from 512k to 1M, and loses 3x at 2M, where the large staging buffer's page faults dominate).
* Why not FSDP1's flat parameter (one collective per unit, parameters straddling ranks)? A parameter's shard would
  then be a rank-dependent fragment: checkpoints (per-parameter padded shards, resharding by ranges), the
  per-parameter masters and optimizer state, the estimator and GatheredParameters would all need a second layout.
  With per-parameter padding the all-gather of a large parameter already writes its storage directly; what the
  flat layout would add is fewer collectives for small parameters, which the staged run gives too.
* *Gradients*: see [Note: gradient buffers] in grads.py.

[Note: persistent shards last]
A gather unit's persistent parameters (at stage 3 the small ones: LayerNorm weights, biases) stay whole, so a
gather of the unit asks for the others only. In module order they lie between those (a block's ``ln1`` before its
``attn.qkv``), and the shards to gather would not be adjacent: every gather of the unit would ``cat`` them into a
staging input, a copy of the unit's shard per gather (8 a step on ``make demo``'s GPT, forward and backward). So
the layout puts each unit's persistent parameters after its others (``flatten_shards``; persistence is decided
before the buckets are built, wiring.py): a unit's gathered shards are one view. Per unit, not per bucket: a
traced region (traced.py) gathers its persistent parameters too, and needs the whole unit adjacent. A gather that
spans units (a prefetch) or buckets still stages with ``cat``, as FSDP2 copies every gather's input in. Only the
flat shard's order changes: units, gradient buckets, optimizer sub-groups and checkpoints (per parameter) keep
module order.
"""

from __future__ import annotations

import enum
import itertools
import math
from typing import Iterable

import torch
import torch._guards
import torch.nn as nn

from .tensor_parallel import local_of, match_local_dtype

__all__ = ["GatheredZeroParameter", "ParamStatus", "ShardBucket", "ShardedParam", "ZeroParameter", "DIRECT_GATHER_NUMEL", "flatten_shards",
           "runs", "shard_numel_for", "sharded_param_of"]

# A parameter at least this large is gathered by its own collective straight into its storage; smaller ones are
# coalesced through a staging buffer (see [Note: flat shard storage]): measured crossover, bench/gather_probe.py.
DIRECT_GATHER_NUMEL = 1 << 19

# [Note: a parameter holds its partition state] The ShardedParam of a partitioned parameter is in the parameter's
# own ``__dict__`` under this name, so zero.Init, GatheredParameters and the engine find it, and it lives exactly as
# long as the parameter. It was in a WeakIdKeyDictionary beside the parameter, which could never drop an entry: its
# value (the ShardedParam) holds the parameter, its key, so every partitioned model stayed in memory with its shards
# and fp32 masters for the life of the process, destroyed or not. As an attribute it is a reference cycle the
# garbage collector frees with the model. Copies and pickles of a parameter leave it behind
# (``ZeroParameter.__getstate__``; ``ShardedParam.__reduce__`` for a user's own Parameter class): a copy is a plain
# tensor, as before.
_STATE = "_zero_engine_state"
_IDS = itertools.count()  # ShardedParam.uid: unique per process, in creation order (DeepSpeed's ds_id)


def sharded_param_of(param: torch.Tensor) -> "ShardedParam | None":
    return param.__dict__.get(_STATE)


class ZeroParameter(nn.Parameter):
    """The class a partitioned ``nn.Parameter`` takes: using it while released is a clear error, not a silent 0.

    While released a parameter's data is a 0-element tensor, so ``model.lm_head.weight.sum()`` in user code would
    quietly return 0. Attribute access (``.grad``, ``.data``, ``.requires_grad``...) and metadata queries stay
    allowed; any other torch function on a released parameter raises, saying to use GatheredParameters.

    [Note: the check costs nothing while gathered] A Python ``__torch_function__`` runs on every torch op that
    touches the tensor (profiled: ~3% of a demo-model step, most ops being the model's own on gathered weights).
    So a gathered parameter switches its class to ``GatheredZeroParameter``, a subclass with torch's C fast path
    restored, and back on release: the check runs only on released parameters, where it is needed.
    ``isinstance(p, ZeroParameter)`` holds in both states.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            name = getattr(func, "__name__", "")
            if name == "__get__":  # an attribute: metadata (.shape, .grad, .data...) is fine, a view of data is not
                name = getattr(getattr(func, "__self__", None), "__name__", "")
                checked = name in _DATA_VIEWS
            else:
                checked = name not in _ALWAYS_ALLOWED
            if checked:
                # kwargs and lists too: F.linear(x, weight=w), torch.cat([w, ...])
                for arg in itertools.chain(args, (kwargs or {}).values()):
                    for tensor in (arg if isinstance(arg, (list, tuple)) else (arg,)):
                        _refuse_if_released(tensor, name)
            return func(*args, **(kwargs or {}))

    # [Note: ds_* properties] DeepSpeed hangs ds_numel, ds_shape, ds_id, ds_tensor, ds_status and ds_persist on
    # every partitioned parameter, and transformers, PEFT and Accelerate read them (PEFT counts parameters with
    # ds_numel; transformers sizes embeddings with ds_shape). Here they are read-only views of the ShardedParam.
    @property
    def ds_numel(self) -> int:
        """Elements of the whole parameter (``param.numel()`` is 0 while it is released)."""
        return _state_of(self).numel

    @property
    def ds_shape(self) -> torch.Size:
        """Shape of the whole parameter."""
        return _state_of(self).shape

    @property
    def ds_id(self) -> int:
        """A number unique to this parameter in this process."""
        return _state_of(self).uid

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's shard: a flat tensor of ceil(numel / world) elements, the last rank's zero-padded."""
        return _state_of(self).shard

    @property
    def ds_status(self) -> "ParamStatus":
        """AVAILABLE (whole), NOT_AVAILABLE (only the shard) or INFLIGHT (a gather is running)."""
        return _state_of(self).status

    @property
    def ds_persist(self) -> bool:
        """Kept whole between uses (small parameters at stage 3; every parameter at stages 1-2)."""
        return _state_of(self).is_persistent

    def __deepcopy__(self, memo):
        """A plain ``nn.Parameter`` with the whole value (see [Note: a copy of the model] in hooks.py); refused while
        released, when this rank holds only the shard."""
        _refuse_copy_if_released(self, "copy.deepcopy()")
        with torch._C.DisableTorchFunctionSubclass():
            copied = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol):
        """A pickle (``torch.save(model)``) is of a plain ``nn.Parameter``, as ``__deepcopy__``'s copy."""
        _refuse_copy_if_released(self, "pickling (torch.save)")
        return super().__reduce_ex__(protocol)

    def __getstate__(self):
        """What a pickle or copy of the parameter keeps: not its partition state (see [Note: a parameter holds its
        partition state])."""
        return {k: v for k, v in self.__dict__.items() if k != _STATE}


def _refuse_copy_if_released(param: ZeroParameter, what: str) -> None:
    sp = sharded_param_of(param)
    if sp is not None and sp.status is not ParamStatus.AVAILABLE:
        raise RuntimeError(
            f"{what} of {sp.fqn or 'a parameter'}, which ZeRO-3 has partitioned: this rank holds only its shard. "
            "Copy the model while its parameters are gathered, on every rank: inside `with zero_engine.zero."
            "GatheredParameters(list(model.parameters())):` a copy is a plain model with whole parameters (or "
            "copy it before initialize)")


def _dynamo_is_tracing() -> bool:
    """Dynamo is tracing a frame: its own metadata queries (``_is_view()``, ``size()``...) on a released parameter
    while it builds the parameter's fake tensor. Those are let through, so that the traced code reaches
    external.py's check of a released read and its error (see [Note: reads inside a compiled region])."""
    return torch._guards.TracingContext.try_get() is not None


def _refuse_if_released(tensor, func_name: str) -> None:
    if type(tensor) is ZeroParameter and tensor.numel() == 0 and not _dynamo_is_tracing():
        sp = sharded_param_of(tensor)
        if sp is not None and sp.status is not ParamStatus.AVAILABLE:
            raise RuntimeError(
                f"{sp.fqn or 'parameter'} is partitioned (ZeRO-3): this rank holds only its shard, so {func_name}() "
                "on it would see no data. Inside the model's forward it is gathered for the module that reads it; "
                "outside, read or edit it inside `with zero_engine.zero.GatheredParameters(param):` (pass "
                "modifier_rank= to keep edits), or move the computation into a module's forward.")


def _no_state() -> None:
    return None


def _state_of(param) -> "ShardedParam":
    sp = sharded_param_of(param)
    if sp is None:
        raise AttributeError("this ZeroParameter has no partition state (its ShardedParam was dropped)")
    return sp


class GatheredZeroParameter(ZeroParameter):
    """A partitioned parameter while gathered: no Python ``__torch_function__`` (see [Note: the check costs nothing
    while gathered])."""

    __torch_function__ = torch._C._disabled_torch_function_impl


# Attributes that are views of the data (``w.T``): refused on a released parameter like any other read.
_DATA_VIEWS = {"T", "mT", "H", "mH", "real", "imag"}
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

    Held by the ``nn.Parameter`` itself (``sharded_param_of``; see [Note: a parameter holds its partition state]).
    """

    def __init__(self, param: nn.Parameter, fqn: str, index: int, rank: int, world_size: int,
                 dtype: torch.dtype | None = None, fp32_master: bool = True):
        """Shard ``param`` (its current full data) for ``rank``; ``dtype``: the compute dtype to cast to;
        ``fp32_master``: keep the exact fp32 value for a master (16-bit training with an optimizer)."""
        self.param = param
        # the tensor whose storage is managed: a DTensor's local piece ([Note: the local tensor is the parameter's
        # data] in tensor_parallel.py), a plain parameter itself; shape and numel are its own
        self.local = local_of(param)
        self.fqn = fqn
        self.index = index  # position in the fixed parameter order: gradient buckets are built from it
        self.uid = next(_IDS)
        self.shape = self.local.shape
        self.numel = self.local.numel()
        self.dtype = dtype or param.dtype
        self.shard_numel = shard_numel_for(self.numel, world_size)
        self.padded_numel = self.shard_numel * world_size
        self.rank = rank
        self.world_size = world_size
        self.is_persistent = False  # kept gathered between uses (small params; stages 1 and 2: all params)
        self.active_users = 0  # modules between their pre- and post- (forward or backward) hooks
        self.held_by_user = 0  # GatheredParameters blocks and the engine's step holds keeping it gathered
        # (when it may be released: [Note: the release rule] in unit.py)
        self.live_owner = None  # the coordinator counting its full data in its live budget, if any
        self.status = ParamStatus.NOT_AVAILABLE
        self.master: torch.Tensor | None = None  # the fp32 master shard, once an optimizer owns one
        self.master_is_shard = False  # fp32 training: the master and the compute shard are one tensor
        self.bucket: ShardBucket | None = None  # the flat shard buffer `shard` is a view of (set by the engine)
        self.gather_sequential = False  # prefetched alone, one at a time ([Note: auto gather strategy], gather.py)
        # the ShardGroup it is sharded and reduced over, when not the engine's shard group: an MoE expert's
        # expert-data-parallel group (zero/expert.py); rank and world_size above are then that group's
        self.group = None
        self.bucket_offset = 0
        # stages 2-3: the GradReducer its gradient hook hands the gradient to ([Note: one call per gradient] in
        # grads.py); through it a model holds its engine until destroy() clears it
        self.grad_reducer = None
        self._empty = torch.empty(0, dtype=self.dtype, device=param.device)

        flat = self.local.detach().reshape(-1)
        exact = torch.zeros(self.shard_numel, dtype=param.dtype, device=param.device)
        local = self.local_slice()
        exact[: local.stop - local.start].copy_(flat[local])
        # The master starts from the full-precision value, not from its 16-bit rounding.
        needs_master = (fp32_master and param.requires_grad and param.is_floating_point()
                        and self.dtype != torch.float32)
        self.master_init = exact.float() if needs_master else None  # frozen params: no master, no copy
        self.shard = exact.to(self.dtype)
        # The full buffer starts with the parameter's own data; `release()` frees it.
        self.set_full(torch.empty(self.padded_numel, dtype=self.dtype, device=param.device))
        self.full[: self.numel].copy_(flat)
        self.full[self.numel:].zero_()
        self.local.data = self.full_view
        self._match_local_dtype()
        self.status = ParamStatus.AVAILABLE
        param.__dict__[_STATE] = self
        if type(param) is nn.Parameter:  # subclasses of users' own are left as they are
            param.__class__ = GatheredZeroParameter  # AVAILABLE until released

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
        del meta_param.__dict__[_STATE]
        param = nn.Parameter(torch.empty(0, dtype=sp.dtype, device=device), requires_grad=meta_param.requires_grad)
        sp.param = sp.local = param
        sp.shard = torch.zeros(sp.shard_numel, dtype=sp.dtype, device=device)
        sp.master_init = None if sp.master_init is None else torch.zeros(sp.shard_numel, dtype=torch.float32,
                                                                         device=device)
        sp.set_full(torch.empty(sp.padded_numel, dtype=sp.dtype, device=device))
        sp.full.untyped_storage().resize_(0)
        sp._empty = torch.empty(0, dtype=sp.dtype, device=device)
        param.data = sp._empty
        sp.status = ParamStatus.NOT_AVAILABLE
        param.__dict__[_STATE] = sp
        param.__class__ = ZeroParameter
        return sp

    def __reduce__(self):
        """Pickled or copied with a parameter of a user's own class (which keeps its ``__getstate__``): as nothing,
        so the copy is a plain parameter (see [Note: a parameter holds its partition state])."""
        return _no_state, ()

    def set_full(self, full: torch.Tensor) -> None:
        """``full`` becomes the buffer the whole parameter is gathered into, and ``full_view`` its first ``numel``
        elements in the parameter's shape: what the parameter's data is while gathered. The view is made once per
        buffer, not at every gather: it stays valid while the buffer's storage is freed and given its bytes back,
        as that is the same storage (see [Note: release resizes storage, it does not swap tensors])."""
        self.full = full
        self.full_view = full[: self.numel].view(self.shape)
        self.full_rows = full.view(-1, self.shard_numel)  # [world, shard_numel]: where a coalesced gather copies out
        self._rows_around = None  # rows_around's views of this buffer, made at its first call
        self.full_storage = full.untyped_storage()  # the storage object released and re-allocated
        self.full_nbytes = full.nbytes  # what it holds while allocated

    def rows_around(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``full_rows`` split at ``rank``: the rows before it, its own row (1-D) and the rows after it. Views of the
        full buffer, made once per buffer, as ``full_view`` (a gather that leaves this rank's row out copies into
        them at every gather: [Note: a gather that leaves this rank's row out] in gather.py)."""
        views = self._rows_around
        if views is None or views[0] != rank:
            rows = self.full_rows
            views = self._rows_around = (rank, rows[:rank], rows[rank], rows[rank + 1:])
        return views[1:]

    # ---- state transitions -------------------------------------------------------------------------------------
    def to_inflight(self, refresh: bool = False) -> None:
        """``refresh``: re-gather an AVAILABLE parameter after its shard changed (optimizer step)."""
        foreach_to_inflight((self,), refresh)

    def alloc_full(self) -> torch.Tensor:
        """Give the full buffer its bytes back (the same storage object) for a gather to write into."""
        return foreach_alloc_full((self,))[0]

    def to_available(self) -> None:
        foreach_to_available((self,))

    def release(self) -> None:
        """Free the full data (see [Note: release resizes storage, it does not swap tensors])."""
        foreach_release((self,))

    def take_full_into_shard(self) -> None:
        """After the full data was edited (GatheredParameters, zero.Init): keep this rank's slice of it."""
        if self.status is not ParamStatus.AVAILABLE:
            raise AssertionError(f"{self.fqn}: resharding needs the full data; status {self.status.name}")
        local = self.local_slice()
        for target in (self.shard, None if self.master_is_shard else self.master):
            if target is not None:
                target.zero_()
                target[: local.stop - local.start].copy_(self.full[local])

    def unpartition(self, comm) -> None:
        """Make the parameter whole and plain again, as it was before it was partitioned: the most exact values held
        (the fp32 master if there is one), gathered over ``comm``, the group it is partitioned over. Collective. For
        an engine that shards it over another group (wiring.py: zero.Init partitions over the world)."""
        if self.status is not ParamStatus.NOT_AVAILABLE:
            raise AssertionError(f"{self.fqn}: unpartitioned while {self.status.name} on rank {self.rank}")
        exact = self._most_exact().to(self.shard.device)  # an offloaded master's values, on the parameter's device
        whole = torch.empty(self.padded_numel, dtype=exact.dtype, device=exact.device)
        comm.all_gather_into_tensor(whole, exact.contiguous(), name=f"unpartition {self.fqn}")
        param = self.param
        del param.__dict__[_STATE]
        if type(param) is ZeroParameter:
            param.__class__ = nn.Parameter
        self.local.data = whole[: self.numel].view(self.shape)

    def _most_exact(self) -> torch.Tensor:
        """The most exact values held: the fp32 master (zero.Init's exact copy, or the separate master of an engine
        destroyed since), else the shard."""
        if self.master_init is not None:
            return self.master_init
        if self.master is not None and not self.master_is_shard:
            return self.master
        return self.shard

    def adopt(self, fqn: str, index: int, dtype: torch.dtype, fp32_master: bool = True) -> None:
        """Become a new engine's: the state zero.Init made, or that of an engine destroyed since. A destroyed engine's
        separate fp32 master seeds the new one and, in another dtype, the new shard: a 16-bit model goes on from the
        exact fp32 values, also as an fp32 model (bf16 -> fp32 keeps the master's bits, not their bf16 rounding)."""
        exact = self._most_exact()
        if exact is not self.shard:
            self.master_init = exact
        self.master, self.master_is_shard = None, False
        self.fqn, self.index = fqn, index
        self.gather_sequential = False
        self.cast_(dtype, fp32_master)
        if not fp32_master:
            self.master_init = None  # no optimizer: no master (zero.Init made one for 16-bit parameters)

    def cast_(self, dtype: torch.dtype, fp32_master: bool = True) -> None:
        """Change the compute dtype (zero.Init builds in fp32; the engine casts). A whole parameter (a destroyed
        stage 1-2 engine's, or a persistent one) is released first: the shard is cast from the most exact values
        held (``master_init`` if any, else the shard) and the engine gathers the whole tensor again from the cast
        shards (wiring._partition), so that both agree on every rank."""
        if dtype == self.dtype:
            return
        if self.status is ParamStatus.AVAILABLE:
            self.release()
        elif self.status is not ParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"rank {self.rank}: {self.fqn} cast to {dtype} while a gather of it is in flight; "
                               "wait for it (destroy() the engine that issued it) first")
        exact = self.master_init if self.master_init is not None else self.shard.float()
        keeps_master = fp32_master and dtype != torch.float32 and self.param.requires_grad
        self.master_init = exact if keeps_master else None
        self.shard = exact.to(self.shard.device, dtype, copy=True)  # the master may live elsewhere (offload)
        self.dtype = dtype
        self.set_full(torch.empty(self.padded_numel, dtype=dtype, device=self.shard.device))
        self.full.untyped_storage().resize_(0)
        self._empty = torch.empty(0, dtype=dtype, device=self.shard.device)
        self.local.data = self._empty
        self._match_local_dtype()

    # ---- views -------------------------------------------------------------------------------------------------
    def _match_local_dtype(self) -> None:
        """A DTensor parameter reports its local tensor's new dtype: [Note: a DTensor parameter's dtype]."""
        if self.local is not self.param:
            match_local_dtype(self.param)
            self.local = local_of(self.param)

    @property
    def compute_device(self) -> torch.device:
        """Where the gathered parameter lives (the rank's compute device), also when ``offload_param`` keeps the
        shard in host memory (offload/param_host.py)."""
        return self.full.device

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


def foreach_to_inflight(params: Iterable["ShardedParam"], refresh: bool = False) -> None:
    """The transition NOT_AVAILABLE -> INFLIGHT of each of ``params`` (a gather's, in one call: see [Note: a
    gather's transitions in one call]). ``refresh``: AVAILABLE ones too, re-gathered after their shard changed."""
    for p in params:
        status = p.status
        if status is not ParamStatus.NOT_AVAILABLE and not (refresh and status is ParamStatus.AVAILABLE):
            raise AssertionError(f"{p.fqn}: gather issued while {status.name} on rank {p.rank}")
        p.status = ParamStatus.INFLIGHT


def foreach_alloc_full(params: Iterable["ShardedParam"]) -> list[torch.Tensor]:
    """Give each full buffer of ``params`` its bytes back (the same storage objects) for a gather to write into; the
    buffers, in order."""
    fulls = []
    for p in params:
        storage = p.full_storage
        if storage.size() != p.full_nbytes:  # a refresh of an AVAILABLE parameter keeps its bytes
            storage.resize_(p.full_nbytes)
        fulls.append(p.full)
    return fulls


def foreach_to_available(params: Iterable["ShardedParam"]) -> None:
    """The transition INFLIGHT -> AVAILABLE of each of ``params``, whose full buffers hold the gathered data.

    [Note: a gather's transitions in one call]
    A gather moves all of its parameters through the same states together, so its issue and its wait make one call
    each for them (not one method call per parameter: that was a tenth of the step's Python calls); the checks and
    their messages are those of ``ShardedParam.to_inflight`` / ``to_available``, which call these."""
    for p in params:
        if p.status is not ParamStatus.INFLIGHT:
            raise AssertionError(f"{p.fqn}: made available while {p.status.name} on rank {p.rank}")
        param = p.param
        if type(param) is ZeroParameter:
            # the class first: setting .data below then takes torch's C path, not ZeroParameter.__torch_function__
            # (see [Note: the check costs nothing while gathered])
            param.__class__ = GatheredZeroParameter
        p.local.data = p.full_view
        p.status = ParamStatus.AVAILABLE


def foreach_release(params: Iterable["ShardedParam"]) -> None:
    """The transition AVAILABLE -> NOT_AVAILABLE of each of ``params``: free their full data (see [Note: release
    resizes storage, it does not swap tensors]); a unit's reshard releases its parameters in this one call, as a
    gather makes its transitions (see [Note: a gather's transitions in one call]). ``ShardedParam.release`` calls
    it."""
    for p in params:
        if p.status is not ParamStatus.AVAILABLE:
            raise AssertionError(f"{p.fqn}: released while {p.status.name} on rank {p.rank}")
        p.local.data = p._empty
        p.full_storage.resize_(0)
        p.status = ParamStatus.NOT_AVAILABLE
        param = p.param
        if type(param) is GatheredZeroParameter:
            param.__class__ = ZeroParameter


class ShardBucket:
    """One flat buffer holding the shards of consecutive parameters; each ``ShardedParam.shard`` is a view of it.

    See [Note: flat shard storage]. ``rebind(flat)`` moves the whole bucket to another tensor of the same size and
    dtype (another device, pinned host memory...) and re-points every parameter's shard at it.
    """

    def __init__(self, params: list[ShardedParam], index: int):
        self.params = params
        self.index = index
        self.numel = sum(p.shard_numel for p in params)
        dtype = params[0].shard.dtype
        self.flat = torch.empty(self.numel, dtype=dtype, device=params[0].shard.device)
        offset = 0
        for p in params:
            self.flat[offset: offset + p.shard_numel].copy_(p.shard)
            p.bucket, p.bucket_offset = self, offset
            offset += p.shard_numel
        self.rebind(self.flat)

    def rebind(self, flat: torch.Tensor) -> None:
        if flat.numel() != self.numel or flat.dtype != self.flat.dtype or not flat.is_contiguous():
            raise ValueError(f"shard bucket {self.index}: expected a contiguous {self.flat.dtype} tensor of "
                             f"{self.numel} elements, got {flat.dtype} {tuple(flat.shape)}")
        self.flat = flat
        for p in self.params:
            p.shard = flat[p.bucket_offset: p.bucket_offset + p.shard_numel]

    def run_view(self, params: list[ShardedParam]) -> torch.Tensor | None:
        """The shards of ``params`` as one tensor without a copy, if they are adjacent in this bucket, in order."""
        offset = params[0].bucket_offset
        for p in params:
            if p.bucket is not self or p.bucket_offset != offset:
                return None
            offset += p.shard_numel
        return self.flat[params[0].bucket_offset: offset]


def runs(groups: Iterable[list[ShardedParam]], limit: int) -> list[list[ShardedParam]]:
    """Consecutive runs of whole ``groups`` (gather units, or single parameters) of at most ``limit`` shard elements
    each, one dtype and device per run. A group is cut only where it alone exceeds ``limit`` (then at parameter
    boundaries). The layout every per-rank grouping of shards is made from: shard buckets, gradient buckets,
    optimizer sub-groups."""
    out: list[list[ShardedParam]] = []
    current: list[ShardedParam] = []
    size = 0

    def cut() -> None:
        nonlocal current, size
        if current:
            out.append(current)
        current, size = [], 0

    for group in groups:
        if current and size + sum(p.shard_numel for p in group) > limit:
            cut()  # the whole group does not fit after what is there: start it afresh
        for p in group:
            if current and (size + p.shard_numel > limit or p.shard.dtype != current[0].shard.dtype
                            or p.shard.device != current[0].shard.device):
                cut()
            current.append(p)
            size += p.shard_numel
    cut()
    return out


def flatten_shards(groups: Iterable[list[ShardedParam]], bucket_numel: int) -> list[ShardBucket]:
    """Move the shards into flat buckets, each a run of whole ``groups`` (see ``runs``): at stage 3 the gather
    units in module order, so that a unit's shards are one tensor (the input of its all-gather, no ``cat``) and an
    offloader moves or swaps units whole. In each unit the persistent parameters come after the others: [Note:
    persistent shards last]."""
    groups = [[p for p in group if not p.is_persistent] + [p for p in group if p.is_persistent] for group in groups]
    return [ShardBucket(run, i) for i, run in enumerate(runs(groups, bucket_numel))]
