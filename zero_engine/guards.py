"""Guards around the training step: what the engine checks so that bad data and misuse fail loudly or leave
nothing stale. engine.py calls each in one line; README's "Reliability" section lists what they guarantee.

- ``broadcast_initial_state``: every rank starts from rank 0's parameters and buffers (DDP and DeepSpeed do the
  same), whatever each rank's seed; without it stage 3 would train a patchwork of per-rank initialisations.
- ``claim_model`` / ``ModelSnapshot``: one engine per model; parameters added, or requires_grad flipped, after
  initialize are errors naming the parameter instead of being silently trained wrong or not at all.
- ``undo_failed_initialize``: an initialize() that raises leaves the model as a second one can take it (released,
  unhooked, NVMe files removed, a client optimizer's groups back on the parameters); ``tear_down`` is destroy().
- ``NonFiniteSteps``: a non-finite gradient norm (inf/nan on any rank) skips the step on every rank, names the ranks
  whose loss was non-finite, and raises after too many skips in a row.
- ``discard_failed_backward``: an exception inside backward drops the accumulation window it happened in (queued
  callback, half-filled buckets, gathered parameters, partial gradients), so training continues as if that window
  had never started.
- ``warn_backward_without_step``: backward() twice without step() in between is said once (what gets applied).
- ``refuse_after_destroy``: calling an engine after destroy() says so, instead of failing deep inside the model.
"""

from __future__ import annotations

import logging
import sys
import weakref

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from ._registrations import watch_registrations
from .errors import DistributedError, UsageError
from .zero.partition import sharded_param_of
from .zero.tensor_parallel import local_of

log = logging.getLogger("zero_engine.engine")

__all__ = ["broadcast_initial_state", "claim_model", "engine_of", "release_model", "refuse_partitioned_at_stage0",
           "tear_down", "client_optimizer_restorer", "undo_failed_initialize", "ModelSnapshot", "NonFiniteSteps",
           "discard_failed_backward", "warn_backward_without_step", "refuse_after_destroy"]


# ---- rank 0's initial state -------------------------------------------------------------------------------------
@torch.no_grad()
def broadcast_initial_state(model: nn.Module, comms: list, groups: dict | None = None) -> None:
    """Overwrite every rank's parameters and buffers with rank 0's (one broadcast per tensor and communicator, once).

    ``comms``: the groups whose ranks hold the same values, broadcast over in turn (mesh.value_comms: the world; with
    tensor parallelism the data-parallel groups, each rank keeping its own tp piece, a DTensor's local tensor).
    ``groups``: id(param) -> the ShardGroup of a parameter that differs across the world (an MoE expert,
    zero/expert.py), broadcast from the first rank of its group instead.
    Parameters partitioned by zero.Init are skipped: Init broadcast them from rank 0 before sharding.
    """
    comms = [comm for comm in comms if comm.world_size > 1]
    if not comms:
        return
    groups = groups or {}
    tensors = [(name, local_of(p).data, groups.get(id(p))) for name, p in model.named_parameters()
               if sharded_param_of(p) is None]
    tensors += [(name, local_of(b), None) for name, b in model.named_buffers()]
    for name, tensor, group in tensors:
        if tensor.numel() == 0:
            continue
        # Collectives need contiguous memory, and gloo has no bool: send a contiguous/uint8 copy, copy it back.
        wire = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor.contiguous()
        for comm in (comms if group is None else [group.comm]):
            comm.broadcast(wire, src=0, name=f"initialize {name}")
        if wire is not tensor:
            tensor.copy_(wire)


# ---- the model after initialize ---------------------------------------------------------------------------------
_ENGINE_OF = WeakIdKeyDictionary()  # model -> weakref to the engine wrapping it


def claim_model(model: nn.Module, engine) -> None:
    """Register ``engine`` as the one wrapping ``model``; a second live engine on it is an error."""
    previous = _ENGINE_OF.get(model)
    if previous is not None and previous() is not None:
        raise RuntimeError(
            f"initialize: this {type(model).__name__} is already wrapped by a live zero_engine engine (its "
            "parameters are partitioned and hooked by it: two engines would both gather and reduce them). Call that "
            "engine's destroy() on every rank first (the new engine then adopts the model as it is, partitioned "
            "parameters included), keep using it, or build a new model")
    _ENGINE_OF[model] = weakref.ref(engine)


def engine_of(model: nn.Module):
    """The live engine wrapping ``model``, or None (none yet, or it was destroyed)."""
    found = _ENGINE_OF.get(model)
    return None if found is None else found()


def release_model(model: nn.Module, engine) -> None:
    """Forget ``engine`` as the one wrapping ``model`` (engine.destroy() calls this once the engine let go of the
    model); a claim by another engine stays (a second initialize() refused as "already wrapped" undoes itself)."""
    previous = _ENGINE_OF.get(model)
    if previous is not None and previous() in (engine, None):
        del _ENGINE_OF[model]


def refuse_partitioned_at_stage0(model: nn.Module) -> None:
    """Stage 0 trains plain whole parameters; ones partitioned before (zero.Init, or a destroyed engine of stage 1-3)
    belong to partition state that stage 0 would leave stale."""
    name = next((n for n, p in model.named_parameters() if sharded_param_of(p) is not None), None)
    if name is not None:
        raise NotImplementedError(
            f"zero_optimization.stage 0 on a model whose parameters are partitioned ({name}: built under zero.Init, "
            "or wrapped by a ZeRO stage 1-3 engine before) is not supported yet; use stage 1 or higher, or build the "
            "model without zero.Init")


def refuse_unsupported_parameters(model: nn.Module, stage: int, compute_dtype: torch.dtype) -> None:
    """A lazy module's parameter not materialized yet has no value to broadcast or partition (rank 0 failed alone,
    and the others waited). Stages 1-3 hold parameters in flat shards of the compute dtype, with fp32 masters: a
    float64 parameter would be cast (silently losing the precision its owner chose), a complex one its imaginary
    part."""
    for name, p in model.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise UsageError(
                f"{name} is not initialized yet (nn.LazyLinear or another lazy module): its shape is decided by the "
                "first forward. Run a forward with a dummy batch before initialize to materialize it")
        if stage > 0 and (p.is_complex() or p.dtype == torch.float64):
            dtype, compute = (str(t).removeprefix("torch.") for t in (p.dtype, compute_dtype))
            fix = ("represent it as two real parameters (torch.view_as_complex in the forward)" if p.is_complex()
                   else "cast it to float32 before initialize")
            raise NotImplementedError(
                f"{name}: a {dtype} parameter at zero_optimization.stage {stage} is not supported yet: stages 1-3 "
                f"hold parameters in flat shards of the compute dtype ({compute}), so it would be cast to it. Use "
                f"stage 0, which trains it as it is (its gradient averaged in {dtype}), or {fix}")


class ModelSnapshot:
    """The parameters initialize partitioned, their requires_grad flags and dtypes; ``check`` compares the model now.

    ``check`` runs at every training forward, so it does not walk the module tree: a parameter or module registered
    anywhere after initialize (torch's global registration hooks) marks the snapshot changed, and only then is the
    model walked by name; otherwise it compares the flags of the parameters it knows (two reads each; a walk of
    ``named_parameters()`` cost 0.44 ms a forward on a 32-layer model here). initialize takes the dtypes again
    (``settle()``) once it has cast the parameters to the compute dtype."""

    def __init__(self, model: nn.Module):
        self.params = list(model.parameters())
        self.requires_grad = {id(p): p.requires_grad for p in self.params}
        self.settle()
        self.changed = False
        self.close = watch_registrations(self, parameters=True)  # destroy() calls it; else garbage collection

    def settle(self) -> None:
        """Take the dtypes (again at the end of initialize, which casts to the compute dtype)."""
        self.dtypes = {id(p): p.dtype for p in self.params}
        self.flags = self._flags()

    def _flags(self) -> list:
        with torch._C.DisableTorchFunctionSubclass():  # a released parameter's check would run per read (partition.py)
            return [(p.requires_grad, p.dtype) for p in self.params]

    def check(self, model: nn.Module) -> None:
        if not self.changed and self._flags() == self.flags:
            return
        self._walk(model)
        self.changed = False  # a registration elsewhere (another model): nothing of ours changed

    def _walk(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            known = self.requires_grad.get(id(p))
            if known is None:
                raise RuntimeError(
                    f"{name} was added to the model after initialize (a new module or a replaced parameter): the "
                    "engine neither partitions nor optimizes it. Build the whole model before initialize")
            if p.requires_grad != known:
                raise RuntimeError(
                    f"{name}: requires_grad changed from {known} to {p.requires_grad} after initialize; the engine "
                    "decided at initialize which parameters get gradient buckets and optimizer states. Freeze or "
                    "unfreeze parameters before initialize (or initialize a new engine)")
            if p.dtype != self.dtypes.get(id(p), p.dtype):
                raise RuntimeError(
                    f"{name}: dtype changed from {self.dtypes[id(p)]} to {p.dtype} after initialize (model.to(), "
                    ".half(), .bfloat16()?); the engine set its compute dtype, gradient buckets and fp32 masters at "
                    "initialize from the config, and its next step would write the parameters back in that dtype. "
                    "Train in 16 bits with the config's \"bf16\": {\"enabled\": true} (or \"fp16\"), or initialize "
                    "a new engine")


# ---- tearing an engine down: destroy(), and a failed initialize ----------------------------------------------------
def tear_down(engine, wait: bool = True) -> None:
    """What ``engine.destroy()`` does (its docstring says what and why), on an engine built whole or in part: the
    parts it lacks are None (class defaults of ZeroEngine). ``wait=False``: leave the process group at once, telling
    the other ranks nothing (see Communicator.close)."""
    watchdog = engine.comm.watchdog
    try:
        if engine.coordinator is not None and (watchdog is None or not watchdog.failed):
            engine.coordinator.release_all()  # waits for stray prefetches; reductions complete in step()
        if engine.hooks is not None:
            engine.hooks.remove()  # the model no longer gathers on forward; parameters stay partitioned
        for handle in engine.grad_hooks:
            handle.remove()
        if engine.loaded_state is not None:
            engine.loaded_state.remove()  # model.load_state_dict is torch's alone again
        for sp in engine.reducer.params if engine.reducer is not None else ():
            if sp.grad_reducer is engine.reducer:  # the model no longer holds this engine
                sp.grad_reducer = None
        for region in engine.traced_regions:
            region.remove()  # plain modules again: no compiled call, no gradient hooks
    finally:
        if engine.snapshot is not None:
            engine.snapshot.close()  # its hooks on every module registration
        if engine.compiled_at_units is not None:
            engine.compiled_at_units.close()  # its hook too (compile.py)
        release_model(engine.module, engine)  # a new engine may adopt the model (and its partitioned parameters)
        try:
            if hasattr(engine.optimizer, "close"):
                engine.optimizer.close()  # NVMe offload: this run's files are removed
        finally:
            try:
                if engine.param_swapper is not None:
                    engine.param_swapper.close()  # no optimizer, or it failed before taking the swapper: files too
            finally:
                experts = {comm for group in engine.shard_groups.values()  # MoE experts' edp and hpZ groups
                           for comm in (group.comm, group.hpz_comm)}
                two_step = engine.mics_gather.communicators().values() if engine.mics_gather is not None else ()
                for sub in (engine.shard_comm, engine.replicate_comm, engine.hpz_comm, *experts, *two_step):
                    if sub is not None and sub is not engine.comm:
                        sub.close()  # a mesh's sub-groups: only let go; the world communicator waits
                engine.comm.close(wait=wait)


def client_optimizer_restorer(optimizer):
    """A function that points a client torch optimizer's param groups back at the parameters they hold now.

    The engine re-points them in place at its fp32 masters; after a failed initialize() the user may pass the same
    optimizer again, which must then find the model's parameters, not a dead engine's masters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return lambda: None
    params = [list(group["params"]) for group in optimizer.param_groups]

    def restore():
        for group, group_params in zip(optimizer.param_groups, params):
            group["params"] = group_params
    return restore


def undo_failed_initialize(engine, restore_client_optimizer) -> None:
    """initialize() raised after ``engine`` was started (a client optimizer with state, an NVMe path that cannot be
    written, a scheduler that cannot be built...): undo what it set up, so that a corrected initialize() can take the
    same model and optimizer. The caller re-raises the original error; this never raises (a second error is logged).

    The model is released and unhooked, its parameters stay as far as they got: whole at stages 0-2, partitioned at
    stage 3 (the next engine adopts them, fp32 master values included, as after destroy()). NVMe files are removed.
    The process group is left at once and no failure note is posted: the error either escapes the program (whose
    excepthook posts one, see comm/liveness.py) or is handled and the process goes on, where a note would be stale.
    """
    engine.destroyed = True
    try:
        tear_down(engine, wait=False)
    except Exception:  # noqa: BLE001 -- the original error is the one to report
        log.warning("rank %d: cleaning up after the failed initialize raised too", engine.comm.rank, exc_info=True)
    finally:
        restore_client_optimizer()


# ---- non-finite steps -------------------------------------------------------------------------------------------
class NonFiniteSteps:
    """Counts skipped steps in a row; says which ranks saw a non-finite loss; raises past ``max_consecutive``.

    The skip decision itself needs no extra collective: the global gradient norm is already all-reduced, so it is
    non-finite on every rank at once. Naming the ranks costs one small all_gather, only when a step is skipped.
    """

    def __init__(self, comm, max_consecutive: int, loss_scaled: bool, has_values: bool = True):
        self.comm = comm
        self.has_values = has_values  # False for shape-only runs (meta tensors): there is no norm to check
        self.max_consecutive = max_consecutive
        self.loss_scaled = loss_scaled  # fp16: skipping while the scale adapts is normal; the scaler reports it
        self.consecutive = 0
        self._loss_finite: torch.Tensor | None = None  # this window's losses all finite (a tensor: no sync)

    def note_loss(self, loss: torch.Tensor) -> None:
        finite = torch.isfinite(loss.detach()).all()
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite

    def reset_window(self) -> None:
        self._loss_finite = None

    def after_step(self, skipped: bool, step: int) -> None:
        window_loss_finite, self._loss_finite = self._loss_finite, None
        if not skipped or not self.has_values:
            self.consecutive = 0
            return
        self.consecutive += 1
        if self.loss_scaled:
            return
        loss_finite = True if window_loss_finite is None else bool(window_loss_finite)  # read only on this path
        finite_by_rank = self.comm.all_gather_object(loss_finite)
        bad = [r for r, ok in enumerate(finite_by_rank) if not ok]
        cause = (f"non-finite loss on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}" if bad else
                 "non-finite gradients (every rank's loss was finite)")
        if self.consecutive > self.max_consecutive:
            raise FloatingPointError(
                f"rank {self.comm.rank}: {self.consecutive} consecutive steps skipped, the last at step {step} "
                f"({cause}); more than zero_engine.max_consecutive_skipped_steps={self.max_consecutive}. Training "
                "is not recovering: lower the learning rate, check the data, or raise the limit")
        log.warning("rank %d: step %d skipped on every rank: %s; weights, optimizer states and the LR schedule are "
                    "unchanged (%d in a row, limit zero_engine.max_consecutive_skipped_steps=%d)", self.comm.rank,
                    step, cause, self.consecutive, self.max_consecutive)


# ---- an exception inside backward -------------------------------------------------------------------------------
def discard_failed_backward(engine) -> None:
    """Drop everything the failed backward (and its accumulation window) left behind; see the module docstring.

    The window's earlier micro-steps are dropped too: their gradients were already summed with the failed pass's
    partial ones in the same buffers, and cannot be separated again. The next backward starts a new window.

    After a DistributedError (a rank failed, was lost or diverged) nothing is dropped: the process group is unusable,
    and waiting for the reductions in flight would block on a dead peer and replace the error that names it.
    """
    if isinstance(sys.exc_info()[1], DistributedError):
        return
    engine.backward_end.reset()
    if engine.reducer is not None:
        engine.reducer.discard()
    if engine.coordinator is not None:
        engine.coordinator.release_all()
    for p in engine.module.parameters():
        p.grad = None
    engine.zero_grad()
    engine.nonfinite.reset_window()
    dropped = engine.drop_window()
    log.warning("rank %d: backward raised at step %d; the gradients of this accumulation window (%d earlier "
                "micro-step(s) and the failed one) were dropped; the next backward starts the window again",
                engine.comm.rank, engine.global_steps, dropped)


# ---- the call order -----------------------------------------------------------------------------------------------
_WARNED_BACKWARD_WITHOUT_STEP: "weakref.WeakSet" = weakref.WeakSet()  # engines told once


def warn_backward_without_step(engine) -> None:
    """Warn once per engine when backward() runs again with no step() since the previous backward().

    DeepSpeed's loop calls step() after every backward() (step() updates only at the accumulation boundary). Without
    it the gradients simply accumulate: the next update applies the sum of every backward() since the last update,
    each divided by gradient_accumulation_steps, at every stage. DeepSpeed 0.19 does the same at stages 0 and 3, and
    silently keeps only the last backward's gradient at stages 1 and 2; a warning says which it is here.
    A loop that set the boundary itself (``set_gradient_accumulation_boundary``: the Trainer and Lightning
    integrations, which call step() once per window) is not warned.
    """
    if not engine.awaiting_step or engine.boundary_overridden or engine in _WARNED_BACKWARD_WITHOUT_STEP:
        return
    _WARNED_BACKWARD_WITHOUT_STEP.add(engine)
    log.warning("rank %d: backward() called again at step %d without a step() after the previous backward(): the "
                "gradients accumulate, and the next update applies the sum of every backward() since the last "
                "update, each divided by gradient_accumulation_steps=%d. Call engine.step() after every "
                "engine.backward() (it updates only at the accumulation boundary), and raise "
                "gradient_accumulation_steps to accumulate over more micro-batches. (Warned once.)",
                engine.comm.rank, engine.global_steps, engine.gradient_accumulation_steps())


def refuse_gradients_from_outside(engine) -> None:
    """step() with no engine.backward() since the last update, while gradients wait (in ``.grad``, or reduced at
    stages 2-3 by the hooks): they came from ``loss.backward()`` or ``torch.autograd.backward``. Such a step updated
    nothing, as micro-steps (and so the accumulation boundary) are counted by engine.backward, and its loss had not
    been divided by gradient_accumulation_steps nor scaled for fp16; so it is refused. Checked only when no
    engine.backward() ran, which a training loop never does."""
    if engine.backwards_since_update:
        return
    waiting = engine.reducer is not None and engine.reducer.grad_bytes > 0
    if not waiting and not any(p.grad is not None for p in engine.module.parameters() if p.requires_grad):
        return
    raise UsageError(
        f"rank {engine.comm.rank}: step() at step {engine.global_steps} found gradients from a backward that did not "
        "go through the engine (loss.backward()?), and no engine.backward() since the last update. Call "
        "engine.backward(loss) instead: it divides the loss by gradient_accumulation_steps, applies the fp16 loss "
        "scale and counts the micro-step by which step() finds the accumulation boundary; after loss.backward() "
        "step() would update nothing")


def refuse_after_destroy(engine, call: str) -> None:
    """RuntimeError when ``engine.destroy()`` has run: its hooks are gone and its communicator closed."""
    if engine.destroyed:
        raise RuntimeError(
            f"rank {engine.comm.rank}: {call} on an engine after engine.destroy(): it cannot run forward, backward "
            "or step any more (its module hooks were removed and its communicator closed). Build a new engine with "
            "zero_engine.initialize(); the parameters stay partitioned: read them with "
            "zero_engine.zero.GatheredParameters or zero_engine.utils.safe_get_full_fp32_param")
