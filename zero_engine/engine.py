"""ZeroEngine: forward, backward and step of a model whose states are partitioned across ranks.

One training step, in order (stage 3):
  forward   ``engine(batch)``      the coordinator starts a step; module hooks gather parameters just in time
                                   (prefetching along the recorded trace) and release them after use
  backward  ``engine.backward(l)`` hooks gather again in reverse; each gradient goes into a bucket that is
                                   reduce-scattered into this rank's gradient shards (compute dtype: 16-bit in
                                   mixed precision, as DeepSpeed; grads.py); at the end of the pass one callback
                                   flushes the last buckets and releases what is still gathered
  step      ``engine.step()``      at the accumulation boundary only: global grad norm (one all-reduce), clipping,
                                   the optimizer on fp32 master shards, LR scheduler, logging

Stages 1 and 2 use the same pieces with parameters kept whole (gathered again after each step from the updated
shards); stage 1 reduces gradients once at the boundary, stage 2 during backward. Stage 0 is plain data parallel.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from ._profiling import profile_range
from .compile import refresh_units_if_compiled
from .comm import Communicator, init_distributed
from .comm.fingerprint import StepFingerprint
from .config import EngineConfig, load_config
from .config.tp_models import requested_autotp_size
from .deepspeed_api import DeepSpeedEngineAPI
from .device import local_device, place_module
from .errors import ArgumentError, UsageError
from .guards import (claim_model, client_optimizer_restorer, discard_failed_backward, refuse_after_destroy,
                     refuse_gradients_from_outside, refuse_partitioned_at_stage0, tear_down, undo_failed_initialize,
                     warn_backward_without_step)
from .memory import reset_rss_peak
from .memory.engine_stats import memory_stats, model_state_bytes
from .mesh import data_parallel_world, named_communicators, summed_stats
from .offload.placement import Placement
from .wiring import build_parts
from .zero.gathered import refresh_whole_params
from .zero.partition import sharded_param_of
from .zero.streams import CommStreams

log = logging.getLogger("zero_engine.engine")

__all__ = ["ZeroEngine"]


class ZeroEngine(DeepSpeedEngineAPI):
    """The training engine ``initialize()`` returns; DeepSpeed's accessors come from DeepSpeedEngineAPI."""

    destroyed = False  # destroy() ran (or initialize failed): the engine refuses to train
    grad_hooks: tuple = ()  # stage >= 2: the gradient hooks on the parameters, removed by destroy()
    # Parts an engine may lack (by its config, or construction failed before them): destroy() reads these defaults.
    coordinator = reducer = hooks = optimizer = backward_end = snapshot = None
    loaded_state = None  # LoadStateDictHooks: model.load_state_dict reaches shards and masters (loaded_state.py)
    # the mesh's communicators (mesh.py): parameters are sharded over shard_comm (the world's when flat), gradient
    # shards averaged across replicas over replicate_comm (None when flat)
    shard_comm = replicate_comm = None
    hpz_comm = hpz = None  # ZeRO++ hpZ: the secondary partition's group and gatherer (zero/hpz.py)
    mics_gather = None  # mics_hierarchical_params_gather: the two-step all-gather and its groups (zero/mics.py)
    shard_groups: dict = {}  # id(param) -> ShardGroup of MoE experts (their edp group: zero/expert.py); read-only
    param_swapper = None  # offload_param nvme (stage 3): shard buckets in files (offload/param_swap.py)
    host_params = None  # offload_param cpu with an accelerator: shards in host memory (offload/param_host.py)
    compiled_at_units = None  # CompiledModules: the compiled modules when the units were made (compile.py)
    is_compiled = False  # engine.compile() was called (DeepSpeed's attribute)
    traced_regions: list = []  # engine.compile(traced=True)'s regions (zero/traced.py); read-only
    presence = None  # stage 3, world > 1: which parameters get a gradient on some ranks only (zero/presence.py)
    # The step's counters, as each engine starts (class defaults: set on the instance as they move).
    skipped_steps = global_steps = micro_steps = global_samples = 0
    _stepped_at_micro_step = 0  # the boundary the last step() consumed: each is consumed once
    _awaiting_step = False  # a backward() has run since the last step() (see deepspeed_api.py)
    _backwards_since_update = 0  # gradients accumulated since the last applied step
    _step_applied = _inside_no_sync = False
    _boundary_override: bool | None = None
    _backward_ends = 0
    _last_loss: torch.Tensor | None = None
    _step_started: float | None = None
    last_step_time: float | None = None

    def __init__(self, model: nn.Module, config, optimizer=None, model_parameters=None, mesh=None, mpu=None):
        if not isinstance(model, nn.Module):
            raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        tp = requested_autotp_size(config)  # the batch rule counts data-parallel ranks: the world over tp
        self.config = config if isinstance(config, EngineConfig) else load_config(
            config, world_size=data_parallel_world(world, mesh, tp), model=model)
        created_group = not dist.is_initialized()
        if created_group:
            init_distributed(timeout_s=self.config.zero_engine.collective_timeout_s)
        elif (self.config.zero_engine.stall_timeout_s == 0 and dist.get_world_size() > 1
              and self.config.zero_engine.collective_timeout_s is not None):
            log.warning("zero_engine.collective_timeout_s=%g is not enforced: the process group was created before "
                        "the engine (its own timeout applies) and zero_engine.stall_timeout_s=0 turns off the "
                        "watchdog that enforces it; set stall_timeout_s > 0 or create the group with that timeout",
                        self.config.zero_engine.collective_timeout_s)
        data_parallel = data_parallel_world(dist.get_world_size(), mesh, self.config.tensor_parallel.size)
        if self.config.world_size != data_parallel:
            raise ValueError(f"config: resolved for {self.config.world_size} data-parallel ranks, running on "
                             f"{data_parallel}; load it with world_size={data_parallel}")
        zc = self.config.zero_optimization
        self.stage = zc.stage
        self.module = model
        # every buffer below is allocated on the parameters' device: put them on this rank's (device.py)
        self._device = place_module(model, local_device(), lambda p: sharded_param_of(p) is not None)
        self.streams = CommStreams(self._device)  # side streams on CUDA, no-ops elsewhere (zero/streams.py)
        self.placement = Placement.from_config(zc, self._device)  # where each state lives (offload/placement.py)
        if self.stage == 0:
            refuse_partitioned_at_stage0(model)
        if self.stage == 0 and self.placement.offloads_optimizer:
            raise ValueError("zero_optimization.offload_optimizer needs zero_optimization.stage >= 1 (the offloaded "
                             "optimizer steps over partitioned fp32 masters); set stage 1, or remove offload_optimizer")
        ze = self.config.zero_engine
        self.comm = Communicator(debug=ze.debug_collectives, stall_timeout_s=ze.stall_timeout_s,
                                 collective_timeout_s=ze.collective_timeout_s, step_fingerprint=ze.step_fingerprint)
        self.progress = self.comm.progress  # phase and step of each collective's record (comm/_records.py)
        restore_client_optimizer = client_optimizer_restorer(optimizer)
        try:
            claim_model(model, self)
            build_parts(self, model, optimizer, model_parameters, mesh, mpu)  # wiring.py
            if self.config.compile.is_on:  # the config's compile section: as engine.compile() (compile.py)
                self.compile(backend=self.config.compile.backend, compile_kwargs=self.config.compile.kwargs,
                             traced=self.config.compile.traced)
        except BaseException:
            undo_failed_initialize(self, restore_client_optimizer)  # a corrected initialize() can take the model
            raise

    # ---- the training step ---------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        refuse_after_destroy(self, "engine(...)")
        self.progress.phase = "forward"
        if self._step_started is None:
            self._step_started = time.perf_counter()
        if self.coordinator is not None:
            refresh_units_if_compiled(self)  # modules compiled since initialize become units (compile.py)
        if self.module.training and torch.is_grad_enabled():
            self.snapshot.check(self.module)
            if self.coordinator is not None:
                self.coordinator.begin_step()
        if self.hpz is not None:
            self.hpz.invalidate()  # [Note: when a secondary shard may be read] in zero/hpz.py
        if self.compute_dtype != torch.float32:  # float inputs follow the parameters' dtype; outputs are as computed
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        return self.module(*args, **kwargs)

    def _cast_input(self, x):
        return x.to(self.compute_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    __call__ = forward

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` (divided by gradient_accumulation_steps unless ``scale_wrt_gas=False``, and
        multiplied by the fp16 loss scale); returns the loss as divided, like DeepSpeed."""
        refuse_after_destroy(self, "backward()")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ArgumentError(f"backward: expected a scalar loss tensor, got {getattr(loss, 'shape', type(loss))}")
        warn_backward_without_step(self)
        self._last_loss = loss.detach()
        self.nonfinite.note_loss(loss)
        gas = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        scaled = loss.float() * (scale / gas) if scale != 1.0 or gas > 1 else loss
        ends = self._backward_ends
        self.progress.phase = "backward"
        if self.reducer is not None:  # the window's last pass averages across replicas (zero/grads.py)
            self.reducer.at_boundary = self.is_gradient_accumulation_boundary()
        if self.presence is not None:  # see [Note: a gradient on some ranks only] in zero/presence.py
            self.reducer.begin_pass(self.presence.irregular_for(scaled))
        with profile_range("zero3::backward"):
            try:
                scaled.backward(retain_graph=retain_graph)
            except BaseException:
                discard_failed_backward(self)
                raise
        if self.stage >= 2 and self._backward_ends == ends:
            self.on_backward_end()  # no hook fired in this pass (loss independent of the parameters)
        self._backwards_since_update += 1
        if not self._inside_no_sync:  # as in DeepSpeed, micro-batches under no_sync() are not counted
            self.micro_steps += 1
            self._awaiting_step = True
            self.global_samples += self.config.train_micro_batch_size_per_gpu * self.mesh.data_parallel_size
        return loss / gas if gas > 1 else loss

    # ---- what the parts call back (hooked up in wiring.py) --------------------------------------------------------
    def on_backward_end(self) -> None:  # queued at the end of a backward pass (BackwardEndCallback)
        with profile_range("zero3::backward_end"):
            if self.stage >= 2:
                self.reducer.finish()
            if self.coordinator is not None:
                self.coordinator.end_step()
        self._backward_ends += 1

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Call after every backward; updates only at the gradient-accumulation boundary (as DeepSpeed does).

        ``lr_kwargs`` are passed to the LR scheduler's ``step()``."""
        refuse_after_destroy(self, "step()")
        if self.optimizer is None:  # DeepSpeed asserts here too: a UsageError is also an AssertionError
            raise UsageError("step(): this engine has no optimizer (initialize() got no optimizer= and the config "
                               "has no \"optimizer\" block): it runs forward and backward only. Pass an optimizer "
                               "to initialize() to train")
        if self._inside_no_sync:
            raise UsageError("step() inside engine.no_sync() is not allowed (as in DeepSpeed): leave the block, "
                             "run the last micro-batch's backward, then call step()")
        refuse_gradients_from_outside(self)
        at_boundary = self.is_gradient_accumulation_boundary()
        self._awaiting_step = False
        self._step_applied = False
        if not at_boundary:
            return
        if self.micro_steps == self._stepped_at_micro_step:
            log.warning("rank %d: step() called again at step %d without a backward since the last update: the "
                        "accumulation boundary was already consumed; nothing to do", self.comm.rank, self.global_steps)
            return
        self._stepped_at_micro_step = self.micro_steps
        self.progress.phase = "step"
        # issued before anything is reduced or updated, checked with the norm: [Note: host syncs per step]
        fingerprint = StepFingerprint.start(self.comm, self._device) if self.config.zero_engine.step_fingerprint \
            else None
        if self.stage == 1:  # gradients accumulated whole across micro-steps; reduce once now
            for bucket in self.reducer.buckets:
                for sp in bucket.params:
                    if sp.param.grad is not None:
                        self.reducer.add(sp, sp.param.grad)
                        sp.param.grad = None
            self.reducer.finish()
        # A non-finite global norm (any rank) skips the update everywhere; see guards.NonFiniteSteps.
        result = self.optimizer.step(
            loss_scale=self.loss_scaler.scale if self.loss_scaler is not None else 1.0,
            skip_if_nonfinite=self.nonfinite.has_values, fingerprint=fingerprint)
        self.optimizer.zero_grad()
        self._backwards_since_update = 0
        if self.loss_scaler is not None:
            self.loss_scaler.update(result.overflow)
        if result.overflow:
            self.skipped_steps += 1  # parameters, optimizer states and the LR schedule are untouched
        self.nonfinite.after_step(result.overflow, self.global_steps)
        if not result.overflow:
            if self.stage >= 1:  # whole params refreshed from their new shards
                refresh_whole_params(self.sharded, self.refresh_gatherer, "refresh after step")
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self._step_applied = True
        if self.param_swapper is not None:  # after the refresh above; after skipped steps too
            trace = self.coordinator.trace.params if self.coordinator.trace is not None else ()
            self.param_swapper.after_step(trace)  # updated buckets written back; the next forward's read ahead
        self.global_steps += 1
        self.progress.step = self.global_steps
        if self.timeline is not None:
            self.record_timeline("step")
            self.timeline.flush()
        if self._step_started is not None:
            self.last_step_time = time.perf_counter() - self._step_started
            self._step_started = None
        if self.config.steps_per_print and self.global_steps % self.config.steps_per_print == 0:
            self._log_step()

    def _log_step(self) -> None:
        if self.comm.rank != 0:
            return
        mem = self.memory_stats()
        log.info("step %d: loss %.4f, lr %s, grad norm %.4f, step %.3fs, model states %.1f MiB, rss %.1f MiB",
                 self.global_steps, float(self._last_loss) if self._last_loss is not None else float("nan"),
                 ", ".join(f"{lr:.3g}" for lr in self.get_lr()), self.get_global_grad_norm() or 0.0,
                 self.last_step_time or 0.0, self.model_state_bytes(mem) / 2**20, mem["rss"] / 2**20)

    def record_timeline(self, event: str) -> None:  # the coordinator's events, with a memory timeline
        esize = self.compute_dtype.itemsize
        gathered = self.coordinator.live_numel * esize if self.coordinator is not None else 0
        self.timeline.record(self.global_steps, event, {
            "params_gathered": gathered, "grads": self.reducer.grad_bytes if self.reducer is not None else 0,
            "comm_buffers": self.accounting.current["comm_buffers"]})

    # ---- shutdown ------------------------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Finish everything in flight and stop the watchdog; call on every rank before
        ``torch.distributed.destroy_process_group()``. Safe to call twice; the engine cannot train afterwards: the
        module hooks are removed and parameters stay partitioned (read them with GatheredParameters or
        zero_engine.utils.safe_get_full_fp32_param).

        Waits for this rank's gathers still in flight (stray prefetches) and releases
        gathered parameters; then every rank waits for the others to be done too (through the store, with the
        watchdog; a barrier without it), so that no rank tears its process group down while a peer still exchanges
        with it. A rank still waiting in a collective this rank never issued gets RankDivergenceError instead of a
        hang, and so does this rank. After a DistributedError the group is unusable and only the local part runs.
        See [Note: clean shutdown] in comm/watchdog.py.
        """
        if not self.destroyed:
            self.destroyed = True
            self.progress.phase = "destroy"
            tear_down(self)

    # ---- the step's state, read by guards.py and utils (drop_window resets it) ---------------------------------------
    backwards_since_update = property(lambda self: self._backwards_since_update, doc="backwards since the last update")
    awaiting_step = property(lambda self: self._awaiting_step, doc="a backward() ran since the last step()")
    boundary_overridden = property(lambda self: self._boundary_override is not None,
                                   doc="the loop set the accumulation boundary (set_gradient_accumulation_boundary)")

    def drop_window(self) -> int:
        """Forget this accumulation window's micro-steps (a failed backward); returns how many were dropped."""
        dropped = self.micro_steps % self.gradient_accumulation_steps()
        self._backwards_since_update = 0
        self._awaiting_step = False
        self.micro_steps -= dropped
        self.global_samples -= dropped * self.config.train_micro_batch_size_per_gpu * self.mesh.data_parallel_size
        return dropped

    def counters(self) -> dict[str, int]:
        """The step counters and the accumulation window's place in it (a checkpoint saves them)."""
        return {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                "global_samples": self.global_samples, "skipped_steps": self.skipped_steps,
                "backwards_since_update": self._backwards_since_update, "awaiting_step": int(self._awaiting_step),
                "stepped_at_micro_step": self._stepped_at_micro_step}

    def load_counters(self, counters: dict, with_gradients: bool) -> None:
        """Restore ``counters()``. Without the window's gradients (not saved, or not loaded) the window restarts at
        its micro-step; a checkpoint from before the window's keys was saved after a step() (or at a boundary)."""
        self.global_steps, self.micro_steps = int(counters["global_steps"]), int(counters["micro_steps"])
        self.global_samples, self.skipped_steps = int(counters["global_samples"]), int(counters["skipped_steps"])
        into_window = self.micro_steps % self.gradient_accumulation_steps()
        self._stepped_at_micro_step = int(counters.get("stepped_at_micro_step", self.micro_steps - into_window))
        self._backwards_since_update = int(counters.get("backwards_since_update", into_window)) * with_gradients
        self._awaiting_step = bool(counters.get("awaiting_step", 0)) and with_gradients

    # ---- queries -------------------------------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.global_grad_norm if self.optimizer is not None else None

    def comm_stats(self, by_group: bool = False) -> dict:
        """Collectives issued since the last reset, per kind (``{"all_gather": {"calls", "bytes"}, ...}``) summed
        over the groups, or ``by_group`` one such dict per group (see ``communicators`` and mesh.py)."""
        per_group = {name: comm.stats() for name, comm in self.communicators().items()}
        return per_group if by_group else summed_stats(per_group)

    def reset_comm_stats(self) -> None:
        for comm in self.communicators().values():
            comm.reset_stats()

    def communicators(self) -> dict:
        """The communicators by group name: "world", and "dp_shard" / "dp_replicate" / "hpz" / "edp ep_size_<k>"
        and "hpz ep_size_<k>" (MoE experts' groups) / "gather_inter" and "gather_intra" (the two-step gather's) where
        they exist."""
        found = named_communicators(self.comm, self.shard_comm, self.replicate_comm, self.hpz_comm)
        found |= self.mics_gather.communicators() if self.mics_gather is not None else {}
        experts = set(self.shard_groups.values())
        return found | {f"edp {group.name}": group.comm for group in experts} | {
            f"hpz {group.name}": group.hpz_comm for group in experts if group.hpz_comm is not None}

    def memory_stats(self) -> dict:
        """Bytes on this rank per category (engine accounting, exact) plus process RSS (psutil / procfs).

        ``by_location`` splits the model-state categories by where they live: ``{"device": {...}, "host": {...},
        "nvme": {...}}`` (see Placement.by_location in offload/placement.py and README's memory_stats section)."""
        return memory_stats(self)  # memory/engine_stats.py

    model_state_bytes = staticmethod(model_state_bytes)

    def reset_memory_peaks(self) -> None:
        if self.coordinator is not None:
            self.coordinator.peak_live_numel = self.coordinator.live_numel
        self.accounting.reset_peaks()
        reset_rss_peak()

    # ---- module-like conveniences ----------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> "ZeroEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ZeroEngine":
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()
            return
        if self.reducer is not None:
            self.reducer.zero_grad()
        for p in self.module.parameters():
            p.grad = None

    # ---- checkpoints (zero_engine/checkpoint/ does the work) --------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """Collective: every rank calls it. Atomic; see zero_engine.checkpoint."""
        from .checkpoint import save_checkpoint

        _refuse_if(self.optimizer is None, "save_checkpoint() of an engine without an optimizer",
                   "a checkpoint holds optimizer states; use save_16bit_model() for the weights")
        _refuse_if(exclude_frozen_parameters, "save_checkpoint(exclude_frozen_parameters=True)",
                   "frozen parameters are always saved (they are small next to optimizer states)")
        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None, missing_ok=False):
        """Collective. Returns ``(path, client_state)``; works at a different world size than the save.
        A missing ``load_dir`` is an error unless ``missing_ok=True`` (then ``(None, None)``, as DeepSpeed)."""
        from .checkpoint import load_checkpoint

        _refuse_if(self.optimizer is None and not load_module_only, "load_checkpoint() into an engine without an "
                   "optimizer", "pass load_module_only=True to load the weights, or initialize with an optimizer")
        _refuse_if(not load_module_strict, "load_checkpoint(load_module_strict=False)",
                   "a checkpoint must match the model's parameters exactly")
        _refuse_if(custom_load_fn is not None, "load_checkpoint(custom_load_fn=...)",
                   "the sharded format is read by zero_engine.checkpoint only")
        return load_checkpoint(self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                               missing_ok=missing_ok)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        """Collective: gathers layer by layer onto rank 0, which writes a plain state dict in the compute dtype."""
        from .checkpoint import save_16bit_model

        _refuse_if(exclude_frozen_parameters, "save_16bit_model(exclude_frozen_parameters=True)",
                   "every parameter is written")
        return save_16bit_model(self, save_dir, save_filename=save_filename)


def _refuse_if(condition: bool, what: str, why: str) -> None:
    if condition:
        raise NotImplementedError(f"{what} is not supported by zero_engine: {why}. See docs/deepspeed_compat.md")
