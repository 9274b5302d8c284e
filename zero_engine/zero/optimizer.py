"""The partitioned optimizer: a torch optimizer that updates only this rank's fp32 master shards.

Each trainable parameter gets one *master*: an fp32 ``nn.Parameter`` of ``shard_numel`` elements. In fp32 training
the master IS the compute shard (same storage, nothing copied); in 16-bit training it is a separate fp32 copy and
the compute shard is refreshed from it after each step. The user's optimizer (an instance, a class or callable, or
one built from the config) is pointed at the masters with its param groups kept, so weight-decay exclusions and
per-group learning rates survive, and an LR scheduler built on it keeps working.

Step: one all-reduce of the squared gradient norm over all shards gives the global norm; gradients are clipped
by it; the optimizer steps; compute shards are refreshed where they are separate.

Offload (``zero_optimization.offload_optimizer``; where each state lives is the engine's ``Placement``,
offload/placement.py). ``cpu``: masters and optimizer states are host tensors and the step runs there (CPUAdam);
with an accelerator the masters are separate host copies even in fp32 training, the gradient shards arrive on the
host per reduced bucket (zero/grads.py), and each sub-group's updated shard is copied back to the device as soon as
it is updated (non-blocking from pinned memory), so the copy of one sub-group overlaps the update of the next.
``nvme``: the same, with masters and states swapped to files sub-group by sub-group (offload/optimizer_swap.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn

from .._profiling import profile_range
from .allreduce import all_reduce_grads
from .grads import GradReducer
from .partition import ShardedParam, runs

log = logging.getLogger("zero_engine.optimizer")

__all__ = ["ZeroOptimizer", "StepResult", "DataParallelOptimizer", "bind_optimizer", "build_torch_optimizer", "param_groups_of"]

_SUPPORTED_TYPES = ("adam", "adamw", "sgd")


def param_groups_of(model: nn.Module, model_parameters) -> list[dict]:
    """The user's param groups (a list of params, or of dicts with "params"), or all trainable params."""
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    model_parameters = list(model_parameters)
    if model_parameters and isinstance(model_parameters[0], dict):
        return [dict(g, params=list(g["params"])) for g in model_parameters]
    return [{"params": model_parameters}]


def build_torch_optimizer(opt_config, groups: list[dict]) -> torch.optim.Optimizer:
    """An optimizer from the config's ``optimizer`` block (type + params), over ``groups``.

    Adam/AdamW use zero_engine's fused kernels (CPUAdam on CPU, FusedAdam on CUDA) unless ``torch_adam: true``;
    when a kernel cannot be built, torch's fused/foreach AdamW is used after one warning (zero_engine.ops).
    """
    kind = opt_config.type.lower()
    params = dict(opt_config.params)
    if kind in ("adam", "adamw"):
        # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false (the config lifts both flags out of params).
        decoupled = kind == "adamw" or opt_config.adam_w_mode
        use_torch = opt_config.torch_adam
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
        device = next((p.device.type for g in groups for p in g["params"]), "cpu")
        if not use_torch and device in ("cpu", "cuda"):  # meta (shape-only runs) has no kernel: torch's Adam
            from ..ops import make_adam

            optimizer, _description = make_adam(groups, device, adamw_mode=decoupled, **params)
            return optimizer
        if not params.pop("bias_correction", True):
            raise NotImplementedError("optimizer.params.bias_correction: false with torch_adam: true is not "
                                      "supported yet (torch's Adam always corrects); drop torch_adam")
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(groups, foreach=True, **params)
    if kind == "sgd":
        return torch.optim.SGD(groups, **params)
    raise NotImplementedError(f"optimizer.type: {opt_config.type!r} is not supported yet; use one of "
                              f"{', '.join(_SUPPORTED_TYPES)} or pass a torch.optim.Optimizer to initialize()")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (scalars such as ``step`` excluded)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values()
               for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def bind_optimizer(optimizer, opt_config, groups: list[dict], substitute: dict[int, torch.Tensor]):
    """The torch optimizer that will update ``substitute[id(p)]`` in place of each trainable ``p``.

    ``optimizer`` is None (built from the config block), a torch.optim.Optimizer (its groups are re-pointed in
    place, so a scheduler already built on it keeps working), or a callable/class taking param groups.
    """
    def swap(params):  # frozen parameters are left out: they never have a gradient
        unknown = [p for p in params if id(p) not in substitute and p.requires_grad]
        if unknown:
            raise ValueError(
                f"optimizer: {len(unknown)} of the parameters to optimize (the first of shape "
                f"{tuple(unknown[0].shape)}) are not trainable parameters of the model given to initialize(), so the "
                "engine would never update them; build the optimizer (or model_parameters) from that model's "
                "parameters, after anything that replaces them (e.g. torch's parallelize_module)")
        return [substitute[id(p)] for p in params if id(p) in substitute]

    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("optimizer: the optimizer passed to initialize() already has state; pass a fresh one "
                             "and restore state with engine.load_checkpoint()")
        for g in optimizer.param_groups:
            g["params"] = swap(g["params"])
        return optimizer
    swapped = [dict(g, params=swap(g["params"])) for g in groups]
    swapped = [g for g in swapped if g["params"]]
    if callable(optimizer):
        built = optimizer(swapped)
        if not isinstance(built, torch.optim.Optimizer):
            raise ValueError(f"optimizer: the callable returned {type(built).__name__}, expected a "
                             "torch.optim.Optimizer")
        return built
    if optimizer is not None:
        raise ValueError(f"optimizer: expected None, a torch.optim.Optimizer, or a callable(params); got "
                         f"{type(optimizer).__name__}")
    if opt_config is None:
        raise ValueError('no optimizer: pass optimizer= to initialize() or add an "optimizer" block to the config')
    return build_torch_optimizer(opt_config, swapped)


class StepResult(NamedTuple):
    grad_norm: float  # global L2 norm of the (unscaled) gradients, before clipping
    overflow: bool  # non-finite gradients on some rank: the update was skipped everywhere


class _OptimizerWrapper:
    """What both wrappers expose of the torch optimizer they drive (schedulers and users read these)."""

    optimizer: torch.optim.Optimizer
    loss_scaler = None  # the engine's fp16 loss scaler (precision/loss_scaler.py); None in bf16 and fp32

    @property
    def cur_scale(self) -> float:
        """The current loss scale, as DeepSpeed's fp16 and ZeRO optimizers expose it (``loss_scale`` too): the
        dynamic scale as it moves, the static one, or 1.0 without fp16. Setting it sets the engine's scale."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        if self.loss_scaler is None:
            raise ValueError(f"optimizer.cur_scale = {value}: there is no loss scale to set without fp16 "
                             "(fp16.enabled is false); bf16 and fp32 training use no loss scaling")
        self.loss_scaler.scale = float(value)

    loss_scale = cur_scale

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    @property
    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)


class ZeroOptimizer(_OptimizerWrapper):
    """Owns the masters and the wrapped torch optimizer; ``step()`` is the whole sharded update."""

    def __init__(self, sharded: list[ShardedParam], reducer: GradReducer, comm, gradient_clipping: float,
                 optimizer, opt_config, groups: list[dict], sub_group_size: int = 10**9, placement=None,
                 offload=None, aio=None, loss_scaler=None, unit_groups: list[list[ShardedParam]] | None = None,
                 norm_counted: set[int] | None = None, grads_in_params: bool = False):
        """``norm_counted``: with tensor parallelism, the ids of the parameters whose gradient shards this rank adds
        to the norm summed over the world (``comm``); None: all, summed over the shard group (tensor_parallel.py).
        ``grads_in_params``: the window's gradients wait in the parameters' ``.grad`` until the step (stage 1)."""
        self.loss_scaler = loss_scaler
        self.grads_in_params = grads_in_params
        self.norm_counted = norm_counted
        self.reducer = reducer
        self.comm = comm
        # the compute device: the grad-norm all-reduce runs there (NCCL reduces device tensors only)
        self.device = next((sp.compute_device for sp in sharded), torch.device("cpu"))
        self.gradient_clipping = float(gradient_clipping or 0.0)
        self.sharded = [sp for sp in sharded if sp.param.requires_grad]
        # Sub-groups (see [Note: sub-groups]) are runs of whole gather units (unit_groups: each unit's parameters;
        # None: each parameter alone, as at stages 1-2), so a unit's masters and states are updated, and swapped,
        # together.
        groups_in = [[sp] for sp in sharded] if unit_groups is None else unit_groups
        self.sub_groups = runs([[sp for sp in g if sp.param.requires_grad] for g in groups_in], sub_group_size)
        # offload with an accelerator: masters on the host, and host staging for the updated compute shards
        self.host_copies = placement is not None and placement.offloads_optimizer and placement.has_separate_host
        pin = placement is not None and placement.pins
        self.staging: dict[int, torch.Tensor] = {}  # id(param) -> host copy of its compute shard (16-bit)
        self.masters: dict[int, nn.Parameter] = {}  # id(original param) -> master
        for sp in self.sharded:
            # fp32 training: the master IS the compute shard. 16-bit: a separate fp32 copy of the exact value.
            value = sp.master_init if sp.master_init is not None else sp.shard
            if self.host_copies:
                value = _host_copy(value, torch.float32, pin)
                if sp.dtype != torch.float32:
                    self.staging[id(sp.param)] = _host_copy(sp.shard, sp.dtype, pin)
            master = nn.Parameter(value)
            sp.master, sp.master_is_shard, sp.master_init = master.data, value is sp.shard, None
            self.masters[id(sp.param)] = master
        self.optimizer = bind_optimizer(optimizer, opt_config, groups, self.masters)
        self.global_grad_norm: float | None = None
        if offload is not None and hasattr(self.optimizer, "num_threads"):  # CPUAdam
            self.optimizer.num_threads = _cpu_adam_threads(offload.cpuadam_cores_perc)
        # CPUAdam writes the updated 16-bit compute shard in the same pass as the fp32 master (one memory pass).
        self.fused_shard_copy = hasattr(self.optimizer, "set_low_precision_copy")
        # CPUAdam and FusedAdam scale 16-bit gradients in their kernels: the shards go in as they are, with no fp32
        # copy (the master takes a gradient of its compute dtype: grad_dtype).
        self.grads_in_kernel = getattr(self.optimizer, "accepts_grad_scale", False)
        if self.grads_in_kernel:
            for sp in self.sharded:
                self.masters[id(sp.param)].grad_dtype = self.reducer.grad_dtype
        if self.fused_shard_copy:
            for sp in self.sharded:
                if not sp.master_is_shard and sp.dtype != torch.float32:
                    self.optimizer.set_low_precision_copy(self.masters[id(sp.param)],
                                                          self.staging.get(id(sp.param), sp.shard))
        self.swapper = None  # NVMe offload: masters and states stream from files (offload/optimizer_swap.py)
        self.param_swapper = None  # NVMe parameter offload: shard buckets read in around each sub-group's update
        if placement is not None and placement.swaps_optimizer:
            from ..offload.optimizer_swap import make_swapper

            self.swapper = make_swapper(self, offload, placement, comm.rank, aio)

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self, loss_scale: float = 1.0, skip_if_nonfinite: bool = False, fingerprint=None) -> StepResult:
        """Unscale, clip by the global norm, update the masters, refresh separate compute shards. ``fingerprint``:
        the step fingerprint issued at the boundary (comm/fingerprint.py), checked before anything is updated.

        [Note: sub-groups] In 16-bit training the gradient shards are 16-bit; the optimizer needs fp32. Converting
        them all at once would cost 4 bytes per parameter more for the length of the step, so the update runs
        over sub-groups of at most ``sub_group_size`` elements: only one sub-group's fp32 gradients exist at a
        time. A torch optimizer skips parameters whose grad is None, which is what makes this work. Our kernels
        (CPUAdam, FusedAdam) need no fp32 gradients at all: each takes the 16-bit shards as they are and applies
        ``coef`` (unscaling, clipping) in fp32 as it reads them, bitwise what ``grad.float() * coef`` gives
        (``grads_in_kernel``).
        """
        with profile_range("zero3::optimizer_step"):
            scaled_norm = self._global_grad_norm(fingerprint)
            overflow = not math.isfinite(scaled_norm)
            norm = scaled_norm / loss_scale
            self.global_grad_norm = norm
            if overflow and skip_if_nonfinite:
                return StepResult(norm, True)
            coef = 1.0 / loss_scale
            if self.gradient_clipping > 0 and norm > self.gradient_clipping:
                coef *= self.gradient_clipping / (norm + 1e-6)
            update = partial(self._update_sub_group, coef=coef)
            if self.param_swapper is not None:
                update = self.param_swapper.around_update(update, self.sub_groups)
            if self.swapper is not None:
                self.swapper.run(update)  # each sub-group read from NVMe around its update
            else:
                for group in self.sub_groups:
                    update(group)
            return StepResult(norm, overflow)

    def _update_sub_group(self, group: list[ShardedParam], coef: float) -> None:
        if self.grads_in_kernel:  # CPUAdam, FusedAdam: the gradient shards as they are, scaled by coef in the kernel
            for sp, grad in zip(group, self.reducer.shard_grads(group)):
                self.masters[id(sp.param)].grad = grad
            self.optimizer.step(grad_scale=coef)
        else:
            for sp, grad in zip(group, self._fp32_grads(group, coef)):
                self.masters[id(sp.param)].grad = grad
            self.optimizer.step()
        shards, updated = [], []  # the compute shards refreshed from their masters, in one kernel below
        for sp in group:
            master = self.masters[id(sp.param)]
            master.grad = None
            if sp.master_is_shard:
                continue
            if self.host_copies:  # [Note: the host-to-device shard copy]
                staging = self.staging.get(id(sp.param))
                if staging is not None and not self.fused_shard_copy:
                    staging.copy_(master.detach())  # a torch optimizer: round on the host, then copy
                # fp32 training copies the master itself; under NVMe its buffer is reused at once: a blocking copy
                source = staging if staging is not None else master.detach()
                sp.shard.copy_(source, non_blocking=staging is not None or self.swapper is None)
            elif not self.fused_shard_copy or sp.dtype == torch.float32:
                shards.append(sp.shard)
                updated.append(master.detach())
        if shards:  # one multi-tensor copy (rounding to the compute dtype as copy_ does), not one kernel each
            torch._foreach_copy_(shards, updated)

    def _fp32_grads(self, group: list[ShardedParam], coef: float) -> list[torch.Tensor | None]:
        """Each parameter's gradient shard in fp32, times ``coef`` (None where it has none): converted and scaled once
        per run of adjacent shards (``GradReducer.shard_grad_runs``), two kernels a run instead of two a parameter,
        then split into views, one per master. The same values as converting each alone; a 16-bit shard is left as
        it was (the conversion is a new tensor), an fp32 one is scaled in place (the step consumes it). Used for an
        optimizer that does not scale gradients itself (torch's; our kernels take the shards as they are)."""
        grads: list[torch.Tensor | None] = [None] * len(group)
        for run, members in self.reducer.shard_grad_runs(group):
            if run.dtype != torch.float32:
                run = run.float()
            if coef != 1.0:
                run.mul_(coef)
            for i, grad in zip(members, run.split([group[i].shard_numel for i in members])):
                grads[i] = grad
        return grads

    def _global_grad_norm(self, fingerprint=None) -> float:
        """One all-reduce of the summed squares; inf/nan on any rank makes the result non-finite everywhere. Read
        on the host with the step fingerprint's verdict: see [Note: host syncs per step]."""
        # On the gradients' device: NCCL all-reduces device tensors only.
        self.reducer.wait_for_host_copies()  # offload only: see [Note: host syncs per step]
        self.reducer.average_across_replicas()  # a window that ended with no pass marked last: [Note: gradients
        # across replicas] in grads.py (a no-op otherwise)
        counted = self.norm_counted
        grads = []  # bucket order: the squares are summed in this order
        for bucket in self.reducer.buckets:
            if bucket.shard_grads is None:
                continue
            if counted is None or all(id(p) in counted for p in bucket.params):
                grads.append(bucket.shard_grads)  # the whole bucket's shard: no copy
            else:  # tp: replicated parameters counted on tp rank 0 only
                grads.extend(self.reducer.shard_grad(p) for p in bucket.params if id(p) in counted)
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if grads:
            if grads[0].device.type == "cpu":  # in pieces: see [Note: the gradient norm on the host]
                grads = [piece for grad in grads for piece in grad.split(NORM_PIECE_NUMEL)]
            # fp32 norms, as clip_grad_norm_, in one multi-tensor kernel on CUDA (per bucket it was five ops each);
            # squared in fp64 and summed in order by cumsum, bitwise the running sum the loop made
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            sq = (torch.stack(norms).to(self.device).double() ** 2).cumsum(0)[-1]
        # over the group the gradient shards are partitioned on: under a hierarchical mesh the replicas hold the same
        # shards (averaged across them, grads.py), so the world would count each one replicate_size times; with tp
        # over the world, each value counted on one rank ([Note: the global gradient norm with tp])
        comm = self.reducer.comm if counted is None else self.comm
        summed = fingerprint.carry(sq.view(1), comm) if fingerprint is not None else None  # [Note: step fingerprint]
        if summed is None:
            comm.all_reduce(sq, op="sum", name="grad norm")
        else:
            sq = summed[0]
        value = read_step_values(sq, fingerprint)
        return math.sqrt(value) if math.isfinite(value) else float("inf")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """End the accumulation window: its gradients are dropped, wherever they wait (the gradient shards; at stage
        1 the parameters' own ``.grad``, reduced only in the step), as torch's and DeepSpeed's zero_grad do."""
        for master in self.masters.values():
            master.grad = None
        if self.grads_in_params:  # stages 2-3 take each .grad in its hook: nothing waits there
            for sp in self.sharded:
                sp.param.grad = None
        self.reducer.zero_grad()

    @property
    def master_bytes(self) -> int:
        """fp32 masters that are separate copies (in fp32 training the master is the compute shard itself),
        wherever they are (under NVMe offload, their size in the files)."""
        return sum(sp.shard_numel * 4 for sp in self.sharded if not sp.master_is_shard)

    @property
    def state_bytes(self) -> int:
        if self.swapper is not None:
            return self.swapper.state_bytes
        return optimizer_state_bytes(self.optimizer)

    def state_dict(self) -> dict:
        """The torch optimizer's state dict; under NVMe offload read in for the call and returned as copies (the
        in-memory tensors are views of swap buffers that are reused once the states are written back)."""
        if self.swapper is None:
            return self.optimizer.state_dict()
        with self.states_in_memory():
            state = self.optimizer.state_dict()
            state["state"] = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in entry.items()}
                              for k, entry in state["state"].items()}
            return state

    def load_state_dict(self, state: dict) -> None:
        with self.states_in_memory():  # under NVMe offload: loaded into memory, then written to the files
            self.optimizer.load_state_dict(state)

    @contextlib.contextmanager
    def states_in_memory(self):
        """A context in which every master and optimizer state is an ordinary in-memory tensor (checkpoints read
        and write them); under NVMe offload they are swapped in for the block and written back after. Under NVMe
        parameter offload the compute shards (in fp32 training: the masters) are read in too."""
        with contextlib.ExitStack() as stack:
            if self.param_swapper is not None:
                stack.enter_context(self.param_swapper.all_in())
            if self.swapper is not None:
                stack.enter_context(self.swapper.all_in())
            yield

    def close(self) -> None:
        """Remove the NVMe files of this run (engine.destroy()), both stores' even when the first one raises."""
        param_swapper, self.param_swapper = self.param_swapper, None
        swapper, self.swapper = self.swapper, None
        try:
            if param_swapper is not None:
                param_swapper.close()
        finally:
            if swapper is not None:
                swapper.close()


# [Note: the gradient norm on the host]
# On the CPU, ``_foreach_norm(..., dtype=torch.float32)`` first makes an fp32 copy of each 16-bit tensor, then
# reduces it in one running fp32 sum. Over a whole bucket's gradient shards (DeepSpeed's default reduce_bucket_size,
# 5e8 elements, is 2 GB of such a copy at world 1) that was a transient of 4 bytes an element in the step (CPU
# training, and the host shards of optimizer offload), the slowest part of the norm, and a relative error that grows
# with the length (4.6e-4 in the squared norm of 11.6M bf16 values, against an fp64 sum). So host gradient shards are
# normed in pieces of NORM_PIECE_NUMEL elements (views; each piece's copy is freed before the next is made) and the
# squares of the pieces' norms summed in fp64 in order: a 1 MiB transient, about 3 times faster for bf16 on this
# machine's CPU, and a relative error near 1e-5 (docs/benchmarks.md). A bucket of at most one piece is normed as
# before, bitwise.
# On CUDA the kernel reads 16-bit values as they are and reduces by a tree: whole buckets, in one launch.
NORM_PIECE_NUMEL = 1 << 18


# [Note: host syncs per step]
# A host synchronisation (the CPU waits for the device: ``.item()``, ``.tolist()``, ``bool()`` of a device tensor,
# a stream or device synchronize) stalls the CPU until the device has caught up, so it can no longer queue work
# ahead; on CUDA the GPU then idles while the CPU issues what comes next. The default path (any stage and dtype, step
# fingerprint on, no offload) has exactly one per step, in ``read_step_values``: the global gradient norm and the
# step fingerprint's verdict, read in one transfer before anything is updated. The skip decision needs it on the host
# (fp16 overflow, and a non-finite norm in any dtype, see guards.NonFiniteSteps: every rank skips the same update),
# so the clipping coefficient and ``get_global_grad_norm()`` come from the same read at no extra cost.
# Before issue 22 a stage-3 step had four, one of them in backward:
#   - backward (every pass): the gradient presence count ``.tolist()`` -> only in a pass that records the module
#     trace (see [Note: when the presence walk runs] in zero/presence.py): none in a steady step;
#   - step: the fingerprint's two ``int()`` (comm/fingerprint.py) -> read with the norm: none more;
#   - step: the grad-norm ``.item()`` -> this one (``read_step_values``), for both optimizer wrappers;
#   - step, on CUDA (found by the first GPU count, 2026-11-27): the fingerprint's all-reduce input made by
#     ``torch.tensor(..., device=cuda)``, which waits for its own host-to-device copy -> a pinned host tensor
#     copied with non_blocking=True: none;
#   - step, offload_optimizer with an accelerator only: a stream synchronize before the norm (the gradient shards
#     copied to the host must be complete before the host computes their norm) -> unchanged, off the default path;
#     it is ``GradReducer.wait_for_host_copies``, which the helpers and checkpoints that read those shards call too,
#     and which synchronises only after such a copy: the update's ``shard_grads`` after it adds none.
# Not counted: a step whose norm is non-finite (naming the ranks costs an object exchange), the first step and trace
# deviations (the trace check and the presence walk), and collectives' own waits (gloo completes on the host).
# tests/test_host_syncs.py counts them (CPU: wrapped Tensor methods; CUDA: torch.cuda.set_sync_debug_mode, at world 1
# over NCCL and at world 2 on the fake group, where the fingerprint runs); bench/gpu_check.py's syncs part lists them.

def read_step_values(norm_value: torch.Tensor, fingerprint=None) -> float:
    """The step's one host synchronisation: ``norm_value`` (a 0-dim tensor) and, with a step fingerprint, whether
    the ranks agree, in one transfer; raises RankDivergenceError (before any update) when they do not."""
    agree = fingerprint.agreement() if fingerprint is not None else None  # compared now if nothing carried it
    if norm_value.device.type == "meta":
        return 0.0  # shape-only run (fake process group): there are no values
    if agree is None:
        return norm_value.item()
    value, agreed = torch.stack([norm_value.double(), agree.to(norm_value.device, torch.float64)]).tolist()
    fingerprint.check(bool(agreed))
    return value


# [Note: the host-to-device shard copy]
# With an accelerator and offload, the updated compute shard is copied from host memory (pinned when pin_memory)
# with non_blocking=True as soon as its sub-group is updated, so it overlaps the next sub-group's update. The host
# source (CPUAdam's low-precision copy, or the master in fp32 training) is rewritten only by the next step, which
# reads the gradient norm on the host first (read_step_values): that synchronises with the stream the copies were
# queued on.

def _host_copy(value: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    out = torch.empty(value.numel(), dtype=dtype, device="cpu", pin_memory=pin)
    out.copy_(value)
    return out


def _cpu_adam_threads(cores_perc: float) -> int:
    """offload_optimizer.cpuadam_cores_perc of this process's cores, never more than torch's thread count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(torch.get_num_threads(), round(cores * cores_perc)))


# [Note: stage 0 with experts]
# Stage 0 keeps every parameter whole on every rank, an MoE expert parameter its ep rank's experts. Its gradient is
# then averaged over its expert-data-parallel group (the ranks holding the same experts) and scaled by the group's
# grad_scale, as the ZeRO stages' reduce-scatter of it is ([Note: gradients of expert weights] in moe.py); dense
# gradients are averaged over the world as before. The gradient norm can no longer be read locally (the experts'
# gradients differ across ep ranks): ``_global_norm``. Without experts nothing changes.


class DataParallelOptimizer(_OptimizerWrapper):
    """Stage 0: every rank holds everything; gradients are averaged across ranks, then a plain optimizer step.

    fp32 training: the optimizer steps the parameters themselves (it is the client's optimizer object, as in
    DeepSpeed). fp16/bf16 training (DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer at stage 0): the parameters
    are in the 16-bit compute dtype and each trainable one gets a whole fp32 master, made from its value when this
    is built (before the engine casts the model); the 16-bit gradients are averaged straight into the masters'
    fp32 gradients, unscaled, clipped, the optimizer steps the masters, and the parameters are refreshed from them.
    """

    def __init__(self, params: list[nn.Parameter], comm, gradient_clipping: float, bucket_numel: int,
                 optimizer, opt_config, groups: list[dict], compute_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype | None = None, loss_scaler=None, shard_groups: dict | None = None):
        """``shard_groups``: id(param) -> the ShardGroup of an MoE expert parameter (zero/expert.py); see [Note:
        stage 0 with experts]."""
        self.loss_scaler = loss_scaler
        self.params = params
        # the positions in params reduced over each group: the world's (None) first, then each expert group by name,
        # the same order on every rank
        by_group: dict = {}
        for i, p in enumerate(params):
            by_group.setdefault((shard_groups or {}).get(id(p)), []).append(i)
        self.reductions = sorted(by_group.items(), key=lambda item: "" if item[0] is None else item[0].name)
        self.reduce_dtype = reduce_dtype  # communication_data_type; None: fp32
        self.comm = comm
        self.gradient_clipping = float(gradient_clipping or 0.0)
        self.bucket_numel = int(bucket_numel)
        # id(param) -> its fp32 master (16-bit training only; the exact value, not its 16-bit rounding)
        self.masters: dict[int, nn.Parameter] = {}
        if compute_dtype != torch.float32:
            self.masters = {id(p): nn.Parameter(p.detach().float().clone()) for p in params
                            if p.is_floating_point()}
        self.optimizer = bind_optimizer(optimizer, opt_config, groups,
                                        {id(p): self.masters.get(id(p), p) for p in params})
        self.global_grad_norm: float | None = None

    @property
    def master_bytes(self) -> int:
        return sum(m.numel() * 4 for m in self.masters.values())

    def step(self, loss_scale: float = 1.0, skip_if_nonfinite: bool = False, fingerprint=None) -> StepResult:
        """Average, unscale (fp16), clip by the global norm, update, refresh 16-bit parameters from the masters.
        ``fingerprint``: as ZeroOptimizer.step's."""
        targets = [self.masters.get(id(p), p) for p in self.params]  # what the optimizer steps
        if self.masters:
            for master in targets:
                master.grad = torch.empty_like(master)
        for group, positions in self.reductions:  # [Note: stage 0 with experts]
            params = [self.params[i] for i in positions]
            all_reduce_grads(params, self.comm if group is None else group.comm, self.bucket_numel,
                             into=[targets[i].grad for i in positions] if self.masters else None,
                             reduce_dtype=self.reduce_dtype)
            if group is not None and group.grad_scale != 1.0:
                torch._foreach_mul_([targets[i].grad for i in positions], group.grad_scale)
        if self.masters:
            for p in self.params:
                p.grad = None  # the 16-bit gradients are in the masters now
            if loss_scale != 1.0:
                torch._foreach_mul_([m.grad for m in targets], 1.0 / loss_scale)
        max_norm = self.gradient_clipping if self.gradient_clipping > 0 else float("inf")
        if len(self.reductions) == 1 and self.reductions[0][0] is None:
            # Gradients are identical on every rank now, so the local norm is the global one.
            norm = torch.nn.utils.clip_grad_norm_(targets, max_norm)
        else:
            norm = self._global_norm(targets)
            torch.nn.utils.clip_grads_with_norm_(targets, max_norm, norm)
        norm = read_step_values(norm, fingerprint)
        self.global_grad_norm = norm
        if skip_if_nonfinite and not math.isfinite(norm):
            return StepResult(norm, True)
        self.optimizer.step()
        with torch.no_grad():
            for p in self.params:
                master = self.masters.get(id(p))
                if master is not None:
                    p.copy_(master)
        return StepResult(norm, not math.isfinite(norm))

    def _global_norm(self, targets: list[torch.Tensor]) -> torch.Tensor:
        """[Note: stage 0 with experts] The world's gradient norm when expert parameters differ across ep ranks: a
        dense gradient is the same on every rank and counted once; an expert group's squares are summed over the
        world, where each of its ep ranks' experts is held by the ``edp`` ranks of its group, and divided by ``edp``.
        One all-reduce of the groups' squares (fp64), as the ZeRO stages sum theirs."""
        none = torch.zeros((), dtype=torch.float64, device=targets[0].device)
        squares = []
        for group, positions in self.reductions:
            grads = [targets[i].grad for i in positions if targets[i].grad is not None]
            local = torch.nn.utils.get_total_norm(grads).double() ** 2 if grads else none
            squares.append(local if group is None else local / group.comm.world_size)
        dense = squares.pop(0) if self.reductions[0][0] is None else none
        experts = torch.stack(squares)
        self.comm.all_reduce(experts, op="sum", name="grad norm of expert gradients")
        return (dense + experts.sum()).sqrt().float()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for master in self.masters.values():
            master.grad = None
