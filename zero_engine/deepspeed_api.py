"""DeepSpeedEngineAPI: DeepSpeed's engine accessors, under DeepSpeed's names, for code written against DeepSpeed.

    engine, *_ = zero_engine.initialize(args=args, model=model, model_parameters=model.parameters())
    engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), engine.zero_optimization_stage()
    engine.is_gradient_accumulation_boundary(), engine.was_step_applied(), engine.local_rank, engine.device

ZeroEngine inherits this mixin so engine.py stays the training step. Everything here is a query of the validated
config or of the engine's counters, or a thin wrapper over what the engine already does; DeepSpeed's behaviour is
the spec (deepspeed/runtime/engine.py), and every difference is listed in docs/deepspeed_compat.md.

[Note: which micro-batch "the boundary" is]
DeepSpeed counts micro-steps in ``step()`` and answers ``is_gradient_accumulation_boundary()`` for the micro-batch
being processed: during its forward and backward and until its ``step()``, the answer is whether that micro-batch
completes the accumulation window. The engine counts micro-steps in ``backward()``. So between a ``backward()`` and
its ``step()`` (``_awaiting_step``) the answer is ``micro_steps % gas == 0``, and before the next backward it is
``(micro_steps + 1) % gas == 0``: the same answers DeepSpeed gives at every point of the loop.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from .errors import UsageError
from .precision import DTYPES

__all__ = ["DeepSpeedEngineAPI"]


class DeepSpeedEngineAPI:
    """Mixin: DeepSpeedEngine's public accessors over ZeroEngine's state (``config``, ``comm``, counters)."""

    # Set by the engine's __init__ before use; declared here for readers.
    _boundary_override: bool | None = None
    _awaiting_step: bool = False
    _step_applied: bool = False
    _inside_no_sync: bool = False

    def __getattr__(self, name: str):
        """The model's attribute when the engine has none (``engine.generate(...)``, custom methods), as
        DeepSpeedEngine.__getattr__ does (the engine's own names win: ``engine.config`` is the engine's). Python calls this only after the normal lookup
        failed; ``module`` is read from ``__dict__`` so that a half-built or unpickled engine (no ``module`` yet)
        raises instead of recursing, and dunder names (copy/pickle protocol probes) are never forwarded."""
        module = self.__dict__.get("module")
        if module is not None and not (name.startswith("__") and name.endswith("__")):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        owner = f" (nor has its module, a {type(module).__name__})" if module is not None else ""
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'{owner}")

    # ---- batch sizes and accumulation ------------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        """Samples per optimizer step across all ranks: micro x gradient_accumulation_steps x data-parallel world."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing gradient_accumulation_steps (the micro-batch size stays)."""
        per_micro = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size <= 0 or train_batch_size % per_micro != 0:
            raise ValueError(f"set_train_batch_size({train_batch_size}): must be a positive multiple of "
                             f"train_micro_batch_size_per_gpu x world = {per_micro}")
        self._set_batch_config(train_batch_size, self.train_micro_batch_size_per_gpu(),
                               train_batch_size // per_micro)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch size, keeping gradient_accumulation_steps (so the global batch changes)."""
        if micro_batch_size <= 0:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size}): must be positive")
        gas = self.gradient_accumulation_steps()
        self._set_batch_config(micro_batch_size * gas * self.dp_world_size, micro_batch_size, gas)

    def _set_batch_config(self, train: int, micro: int, gas: int) -> None:
        if self._backwards_since_update:
            raise RuntimeError("changing the batch size in the middle of an accumulation window is not supported; "
                               "call it right after a step() that updated the parameters")
        # The config is frozen: a copy with the new sizes, which satisfy the batch rule by construction.
        self.config = self.config.model_copy(update={
            "train_batch_size": train, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas})

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch ends the accumulation window (its step() updates the parameters).

        See [Note: which micro-batch "the boundary" is]; set_gradient_accumulation_boundary() overrides it.
        """
        if self._boundary_override is not None:
            return self._boundary_override
        gas = self.gradient_accumulation_steps()
        return self.micro_steps % gas == 0 if self._awaiting_step else (self.micro_steps + 1) % gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary for the next micro-batches (set it before each forward/backward; the last one
        True), so a loop can call step() once after all its micro-batches. Gradients are still divided by the
        configured gradient_accumulation_steps in backward(), as in DeepSpeed."""
        self._boundary_override = bool(is_boundary)

    def was_step_applied(self) -> bool:
        """True if the latest step() updated the parameters (False between boundaries and on a skipped step)."""
        return self._step_applied

    @contextmanager
    def no_sync(self):
        """Skip gradient reduction for the backward passes inside: gradients accumulate locally (stages 0 and 1,
        which reduce once at the step anyway). Refused at stages 2 and 3, whose partitioned gradients need a
        reduction in every backward, exactly as DeepSpeed refuses. step() inside the block is an error, and the
        micro-batches inside do not count towards gradient_accumulation_steps."""
        if self.zero_optimization_partition_gradients():
            raise UsageError(f"no_sync() is incompatible with the gradient partitioning of ZeRO stage "
                             f"{self.stage} (as in DeepSpeed): gradients are reduce-scattered in every backward. "
                             "Use zero_optimization.stage 0 or 1, or drop no_sync()")
        if self._inside_no_sync:
            raise UsageError("no_sync() cannot be nested (as in DeepSpeed)")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    # ---- ZeRO and precision settings ------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        return self.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.stage >= 3

    def zero_reduce_bucket_size(self) -> int:
        return self.config.zero_optimization.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self.config.zero_optimization.allgather_bucket_size

    def zero_overlap_comm(self) -> bool:
        return self.config.zero_optimization.overlap_comm

    def zero_contiguous_gradients(self) -> bool:
        return self.config.zero_optimization.contiguous_gradients

    def zero_sub_group_size(self) -> int:
        return self.config.zero_optimization.sub_group_size

    def zero_prefetch_bucket_size(self) -> int:
        return self.config.zero_optimization.prefetch_bucket_size

    def zero_param_persistence_threshold(self) -> int:
        return self.config.zero_optimization.param_persistence_threshold

    def zero_max_live_parameters(self) -> int:
        return self.config.zero_optimization.max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self.config.zero_optimization.max_reuse_distance

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero_optimization.gather_16bit_weights_on_model_save

    def zero_allgather_sequential(self) -> bool:
        return self.config.zero_optimization.allgather_sequential

    def zero_offload_optimizer(self):
        """The ``offload_optimizer`` section (None when absent), as DeepSpeed returns it."""
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self):
        """The ``offload_param`` section (None when absent), as DeepSpeed returns it."""
        return self.config.zero_optimization.offload_param

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: fp32 unless ``communication_data_type`` says otherwise (averaging
        16-bit gradients in 16-bit loses bits at every hop of the reduction; DeepSpeed's default is the model's
        dtype, see docs/deepspeed_compat.md)."""
        name = self.config.communication_data_type
        return DTYPES[name] if name else torch.float32

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def dynamic_loss_scale(self) -> bool:
        return self.fp16_enabled() and self.config.fp16.loss_scale == 0

    def loss_scale(self) -> float:
        """The configured static loss scale (0: dynamic), as DeepSpeed's accessor; the current scale is
        ``engine.optimizer.cur_scale`` (or ``engine.optimizer.loss_scale``), as in DeepSpeed."""
        return self.config.fp16.loss_scale

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def optimizer_name(self) -> str | None:
        return self.config.optimizer.type if self.config.optimizer is not None else None

    def optimizer_params(self) -> dict | None:
        return dict(self.config.optimizer.params) if self.config.optimizer is not None else None

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> dict | None:
        return self.config.scheduler.resolved_params() if self.config.scheduler is not None else None

    def get_mom(self) -> list:
        """Momentum per param group: ``momentum`` for SGD-like optimizers, ``betas`` for Adam-like ones."""
        if self.optimizer is None:
            return []
        key = "betas" if "betas" in self.optimizer.param_groups[0] else "momentum"
        return [g.get(key) for g in self.optimizer.param_groups]

    def get_type(self) -> list:
        """The ``type`` entry of each param group (DeepSpeed's MoE groups carry one), None where absent."""
        return [g.get("type") for g in self.optimizer.param_groups] if self.optimizer is not None else []

    # ---- where this rank is ---------------------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel world: the ranks that read different rows of the batch (every rank, over the tp size)."""
        return self.mesh.data_parallel_size

    @property
    def mp_world_size(self) -> int:
        """Model-parallel (tensor-parallel) world: the tp size, 1 without tp."""
        return self.mesh.tp_size

    @property
    def local_rank(self) -> int:
        """LOCAL_RANK from the launcher's environment (torchrun, deepspeed), else 0."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def device(self) -> torch.device:
        """The device the engine computes on: where initialize() placed the parameters (zero_engine.device)."""
        if getattr(self, "_device", None) is not None:
            return self._device
        for p in self.module.parameters():
            return p.device
        return torch.device("cpu")

    def get_data_parallel_rank(self) -> int:
        return self.mesh.data_parallel_rank

    def get_model_parallel_rank(self) -> int:
        return self.mesh.tp_rank

    def get_tensor_parallel_rank(self) -> int:
        return self.mesh.tp_rank

    # ---- states and memory --------------------------------------------------------------------------------------
    def empty_partition_cache(self) -> None:
        """Release every gathered parameter that is not persistent (stage 3), waiting for prefetches in flight, so
        only shards stay until the next forward gathers again. Call it outside forward/backward."""
        if self.coordinator is not None:  # stages 0-2 keep parameters whole by design: nothing is cached
            self.coordinator.release_all()

    # ---- DeepSpeed features zero_engine refuses by name (docs/deepspeed_compat.md says why) -----------------------
    def offload_states(self, include=None, device=None, pin_memory=True, non_blocking=False):
        raise NotImplementedError("engine.offload_states(): moving states to the host on demand is not supported "
                                  "by zero_engine; configure zero_optimization.offload_optimizer / offload_param")

    def reload_states(self, non_blocking=False):
        raise NotImplementedError("engine.reload_states(): not supported by zero_engine (see offload_states)")

    def compile(self, backend=None, compile_kwargs=None, schedule=None, traced: bool = False) -> None:
        """Compile the model with ``torch.compile`` (DeepSpeed's signature), region by region at stage 3.

        Stages 0-2 keep parameters whole: the whole model is compiled (``module.compile(backend=...,
        **compile_kwargs)``), as DeepSpeed does. At stage 3 each *region* is compiled on its own and is one gather
        unit: the leaf modules if any, else the transformer blocks (modules held in a ModuleList or Sequential), else
        each unit's module; their hooks gather the whole region before the compiled call and release it after, so a
        region compiles to one graph with no graph break, blocks of one shape share that graph, and nothing
        recompiles after the first step. Memory: a region's parameters are live together while it runs (as with
        leaf modules or FSDP2's per-block wrapping). ``backend``: a torch.compile backend name or callable
        (default "inductor"); ``compile_kwargs``: passed to torch.compile (``fullgraph``, ``dynamic``, ``mode``...).
        ``schedule`` (DeepCompile's pass schedule) is not supported. Call it on every rank, after ``initialize`` and
        outside a step. See compile.py. A transformers model: set ``model.config.use_cache = False`` for training
        (warned of otherwise: a KV cache makes each layer a graph of its own); its ``generate`` then compiles
        nothing, using the regions' graphs where they fit (so it leaves the training's compile budget alone).

        ``traced=True`` (stage 3; the config's ``compile.traced``): each region's parameter all-gather and gradient
        reduce-scatter become functional collectives *inside* its graph, so the compiler may bucket and reorder them
        around the compute; the region is then no gather unit (its hooks and the coordinator never gather it).
        Memory: the gather is recomputed in backward, so a region's whole parameters live only while its forward or
        backward runs, as in eager ZeRO-3; what stays between steps is its shards. Communication: per region and
        step one all-gather in forward, one in backward and one reduce-scatter, per flat shard (coalesced) or per
        parameter (``stage3_allgather_sequential: true``); these are not counted in ``comm_stats()``. Not supported
        yet (refused by name): stages 0-2, ``offload_param``, ZeRO++, MiCS / hierarchical meshes, tensor and expert
        parallelism, external parameters read inside a region, a weight tied across a region's boundary; and, when
        called, the model's ``generate`` (a rank crashed in about 1 run of 8, cause not found). See zero/traced.py,
        [Note: the traced mode]."""
        if schedule is not None:
            raise NotImplementedError("engine.compile(schedule=...): DeepCompile's compiler passes are not supported "
                                      "yet; engine.compile() compiles each ZeRO-3 region with torch.compile")
        from .compile import compile_engine

        compile_engine(self, backend, compile_kwargs, traced=traced)

    def _backward_epilogue(self):
        raise NotImplementedError("engine._backward_epilogue() (DeepSpeed's joint training with one shared loss and "
                                  "loss.backward()): not supported by zero_engine; call engine.backward(loss) on each "
                                  "engine's own loss")

    def save_fp16_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        """DeepSpeed's older name for save_16bit_model()."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters=exclude_frozen_parameters)
