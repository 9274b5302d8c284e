"""The validated config: `EngineConfig` and its smaller sections (precision, activation checkpointing, ours).

Every model is frozen and passed down whole; a component takes the section it needs (`cfg.zero_optimization`,
`cfg.fp16`). Defaults are DeepSpeed's (runtime/constants.py, runtime/precision_config.py) unless a field says
otherwise. Load configs with `load_config`, which checks keys, resolves "auto" and the batch sizes first.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from zero_engine.config.fields import (
    CONFIG_ERROR_TYPE,
    Auto,
    ConfigBool,
    ConfigFloat,
    ConfigInt,
    NotSupported,
    Section,
    value_error,
)
from zero_engine.config.optim_models import OptimizerConfig, SchedulerConfig
from zero_engine.config.tp_models import TensorParallelConfig
from zero_engine.config.unsupported import (HARMLESS_SECTIONS, TOP_LEVEL_NOT_SUPPORTED, _absent_or_empty,
                                            _all_switches_false)
from zero_engine.config.zero_models import ZeroConfig

_ENABLED_AUTO = Auto("false (Hugging Face's Trainer default when no --fp16/--bf16 flag)")


class Fp16Config(Section):
    """fp16 mixed precision: 16-bit parameters and gradients on the device, fp32 master weights in the
    optimizer, and a loss scale that keeps small gradients representable."""

    enabled: Annotated[ConfigBool, _ENABLED_AUTO] = Field(False, description="Train in fp16.")
    auto_cast: ConfigBool = Field(False, description="Cast floating-point inputs to fp16 before forward.")
    loss_scale: ConfigFloat = Field(0.0, ge=0, description="Static loss scale; 0 selects dynamic loss scaling.")
    initial_scale_power: ConfigInt = Field(
        16, ge=0, le=64, description="Dynamic scaling starts at 2**initial_scale_power (at most 2**64: far beyond "
        "any useful scale, and 2**1024 would overflow a float)."
    )
    loss_scale_window: ConfigInt = Field(1000, ge=1, description="Steps without overflow before the scale doubles.")
    hysteresis: ConfigInt = Field(2, ge=1, description="Overflows tolerated before the scale is lowered.")
    consecutive_hysteresis: ConfigBool = Field(False, description="Refill hysteresis after a step without overflow.")
    min_loss_scale: ConfigFloat = Field(1.0, ge=0, description="Dynamic scaling never goes below this.")

    not_supported = {
        "fp16_master_weights_and_grads": NotSupported(False, "fp16 master weights"),
        "fused_mode": NotSupported(True, "DeepSpeed's unfused fp16 optimizer"),
    }
    ignored_keys = {"opt_level": "it is an Apex AMP setting that DeepSpeed's fp16 section never read"}
    no_effect = {"auto_cast": "floating-point inputs are always cast to the compute dtype before forward"}


class Bf16Config(Section):
    """bf16 mixed precision: bf16 parameters and gradients, fp32 master weights; no loss scaling needed."""

    enabled: Annotated[ConfigBool, _ENABLED_AUTO] = Field(False, description="Train in bf16.")
    immediate_grad_update: ConfigBool = Field(
        False, description="Accepted for compatibility; no effect (gradients are applied at the step)."
    )
    check_grad_overflow: ConfigBool = Field(
        False, description="No effect: every step with inf/nan gradients is skipped on all ranks, whatever this says "
        "(see zero_engine.max_consecutive_skipped_steps)."
    )

    not_supported = {
        "bf16_master_weights_and_grads": NotSupported(False, "bf16 master weights"),
        "bf16_optimizer_states": NotSupported(False, "bf16 optimizer states"),
    }
    no_effect = {
        "immediate_grad_update": "gradients are applied to the fp32 masters at step()",
        "check_grad_overflow": "a step with inf/nan gradients is always skipped on every rank "
                               "(zero_engine.max_consecutive_skipped_steps)",
    }


class ActivationCheckpointingConfig(Section):
    """DeepSpeed's activation-checkpointing API settings. Accepted so configs load; zero_engine does not act on
    them (use torch.utils.checkpoint in the model)."""

    partition_activations: ConfigBool = Field(False, description="Not acted on.")
    contiguous_memory_optimization: ConfigBool = Field(False, description="Not acted on.")
    cpu_checkpointing: ConfigBool = Field(False, description="Not acted on.")
    number_checkpoints: ConfigInt | None = Field(None, description="Not acted on.")
    synchronize_checkpoint_boundary: ConfigBool = Field(False, description="Not acted on.")
    profile: ConfigBool = Field(False, description="Not acted on.")

    no_effect = {name: "DeepSpeed's activation-checkpointing API is not implemented; use torch.utils.checkpoint "
                       "(use_reentrant=False) in the model" for name in (
                           "partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                           "number_checkpoints", "synchronize_checkpoint_boundary", "profile")}


_TAG_VALIDATION_MODES = ("WARN", "IGNORE", "FAIL")


class CheckpointConfig(Section):
    """DeepSpeed's checkpoint section. Checkpoints are zero_engine's own sharded format (zero_engine.checkpoint), so
    DeepSpeed's universal, node-local and pipeline-parallel switches and its checkpoint writers are accepted off."""

    tag_validation: Literal["WARN", "IGNORE", "FAIL"] = Field(
        "WARN", description='What save_checkpoint does when ranks pass different tags ("Warn", "Ignore" or "Fail", '
        "any case, as DeepSpeed): Fail raises ArgumentError (an AssertionError too) on every rank and saves nothing; "
        "Warn and Ignore save one complete checkpoint under rank 0's tag (Warn logs each differing tag). DeepSpeed "
        "would write each rank's files under its own tag, leaving every tag incomplete. Costs nothing extra: the "
        "tags travel in the all-gather that already agrees the save directory.",
    )

    not_supported = {
        "load_universal": NotSupported(False, "universal checkpoints"),
        "use_node_local_storage": NotSupported(False, "node-local checkpoint storage"),
        "parallel_write": NotSupported(None, "pipeline-parallel checkpoint writes", is_off=_all_switches_false,
                                       accepted="absent, or every switch false"),
        "writer": NotSupported(None, "DeepSpeed's checkpoint writers (fast, decoupled)", is_off=_absent_or_empty,
                               accepted="absent or null"),
    }
    ignored_keys = {"checkpoint_serialization": "it chooses torch.save's file layout; zero_engine writes its own "
                                                "format (see zero_engine.checkpoint)"}

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _upper_mode(cls, value: Any) -> Any:
        # DeepSpeed upper-cases the value, so "Warn", "warn" and "WARN" are the same mode.
        if not isinstance(value, str) or value.upper() not in _TAG_VALIDATION_MODES:
            raise value_error('expected "Warn", "Ignore" or "Fail" (any case)')
        return value.upper()


class MemoryTimelineConfig(Section):
    """Record memory per category over time (zero_engine.memory)."""

    enabled: ConfigBool = Field(False, description="Sample memory accounting and RSS during training.")
    path: str | None = Field(None, description="Where to write the timeline; null: not written.")


class AioConfig(Section):
    """Asynchronous I/O for NVMe offload (zero_engine/offload/nvme.py: a thread pool of O_DIRECT preadv/pwritev)."""

    block_size: ConfigInt = Field(
        1_048_576, ge=1, description="Bytes per I/O request: a tensor is read and written in chunks of this size "
        "(rounded up to 4096), spread over the I/O threads.",
    )
    queue_depth: ConfigInt = Field(8, ge=1, description="libaio's requests in flight per submission.")
    thread_count: ConfigInt = Field(
        1, ge=1, description="I/O threads per rank (DeepSpeed's intra_op_parallelism): chunks of one tensor are "
        "transferred in parallel by this many threads.",
    )
    checksum: ConfigBool = Field(
        True, description="zero_engine: keep a CRC-32 of every block written to an NVMe swap file and check it when "
        "the block is read back, so a swap file changed or damaged on disk raises an error naming the file instead "
        "of training on garbage. Costs one CRC pass over the swapped bytes on the I/O threads (measured in "
        "docs/benchmarks.md); false turns it off.",
    )
    single_submit: ConfigBool = Field(False, description="libaio: submit requests one at a time.")
    overlap_events: ConfigBool = Field(True, description="libaio: overlap request submission and completion.")

    key_aliases = {"intra_op_parallelism": "thread_count"}
    not_supported = {"use_gds": NotSupported(False, "GPUDirect Storage")}
    no_effect = {
        "queue_depth": "each I/O thread has one synchronous request in flight, so the depth is thread_count",
        "single_submit": "requests are issued by the I/O threads one each; there is no batched submission",
        "overlap_events": "I/O always overlaps the step: it runs on the I/O threads while the optimizer updates",
    }


class ZeroEngineSection(Section):
    """zero_engine's own settings (DeepSpeed ignores this section)."""

    debug_collectives: ConfigBool = Field(
        False,
        description="Before each collective, check that all ranks agree on its kind, dtype and size, and raise on "
        "every rank instead of hanging. Costs one small all-gather per collective.",
    )
    collective_timeout_s: ConfigFloat | None = Field(
        None, ge=0.1, le=31_536_000,
        description="Seconds a collective may take before it is an error (0.1 s to a year). null: the process "
        "group's own timeout when you created the group (init_process_group(timeout=...): a group made with 1 hour "
        "waits 1 hour), and 1800 s (30 minutes, torch's and DeepSpeed's default) when the engine creates it. A value "
        "acts whoever created the group: the engine's waits enforce it (with stall_timeout_s > 0), and a group the "
        "engine creates gets it as its own timeout.",
    )
    stall_timeout_s: ConfigFloat = Field(
        20.0, ge=0, description="Seconds a collective may wait before the ranks compare their progress records "
        "through the store: ranks in different collectives raise RankDivergenceError, a dead rank RankLostError "
        "(both on every surviving rank, naming the rank, module, phase and step); all ranks in the same slow "
        "collective only log it. Costs nothing until a wait lasts this long, plus one heartbeat thread. 0 turns "
        "the watchdog off (waits block in the backend until collective_timeout_s).",
    )
    step_fingerprint: ConfigBool = Field(
        True, description="At each accumulation boundary, before the optimizer, compare a hash of the step's "
        "collectives across ranks (inside the gradient norm's all-reduce with ZeRO over a flat world, else one "
        "2-element all-reduce of its own) and raise RankDivergenceError on a difference, with "
        "parameters and optimizer states untouched. Catches same-shaped collectives that paired up across "
        "different modules (silently mixed data).",
    )
    max_consecutive_skipped_steps: ConfigInt = Field(
        10, ge=0,
        description="A step whose gradients are non-finite (inf/nan on any rank; a NaN loss on one rank is enough) is "
        "skipped on every rank with a warning naming the ranks whose loss was non-finite: weights, optimizer states "
        "and the LR schedule are untouched. After more than this many skips in a row, training raises "
        "FloatingPointError (0: raise at the first). fp32 and bf16; fp16's loss scaler skips overflowing steps "
        "while it adapts the scale, and those do not raise.",
    )
    memory_timeline: MemoryTimelineConfig = Field(
        default_factory=MemoryTimelineConfig, description="Memory timeline recording (see its section)."
    )
    memory_limit: ConfigInt | None = Field(
        None, ge=1,
        description="Bytes of host memory this rank may use; read by zero_optimization.stage3_allgather_sequential: "
        "\"auto\" to decide which buckets are gathered sequentially. null: the cgroup limit (else physical memory) "
        "divided by the ranks on this node; on GPU the device's free memory is used instead.",
    )


_BATCH_DOC = "Resolved by the batch rule train_batch_size = micro x gas x world (see docs/config.md)."
_TRAIN_AUTO = Auto("train_micro_batch_size_per_gpu x gradient_accumulation_steps x world")
_MICRO_AUTO = Auto("derived from the others, else 8 (HF's default)")
_GAS_AUTO = Auto("derived from the others, else 1 (HF's default)")


_AVERAGED = ("gradients are averaged by the reduce-scatter in fp32 (or communication_data_type); when the division "
             "by the world size happens matters only for the range of DeepSpeed's fp16 all-reduce")


# DeepCompile's settings (DeepSpeed's compile section since 0.16): they act only with deepcompile true.
_DEEPCOMPILE_KEYS = ("free_activation", "offload_activation", "offload_opt_states", "offload_parameters",
                     "double_buffer", "symmetric_memory", "dump_graphs", "debug_log", "sync_before_reduce",
                     "sync_after_reduce", "sync_before_allgather", "sync_after_allgather", "keep_int_input_tensors",
                     "keep_all_input_tensors")


class CompileConfig(Section):
    """torch.compile of the model at initialize, as ``engine.compile(backend, kwargs)`` does: regions at stage 3
    (each leaf module, else each block of a ModuleList / Sequential: one gather unit and one graph each), the whole
    model at stages 0-2. Two generations of DeepSpeed's switch are read: ``enabled: true``, or the older
    ``disable: false``. DeepCompile (``deepcompile: true``) is not supported yet."""

    enabled: ConfigBool = Field(False, description="Compile the model at initialize (see engine.compile()).")
    disable: ConfigBool | None = Field(
        None, description="DeepSpeed's older switch: false compiles (as enabled: true), true does not; null: "
        "enabled decides."
    )
    backend: str = Field("inductor", description="The torch.compile backend (\"inductor\", \"aot_eager\", "
                         "\"eager\", or a registered name).")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to torch.compile (fullgraph, dynamic, mode, options...)."
    )
    traced: ConfigBool = Field(
        False, description="Stage 3: each region's parameter all-gather and gradient reduce-scatter run as "
        "functional collectives inside its compiled graph (SimpleFSDP's idea), so the compiler may bucket and "
        "reorder them around the compute; the gather is recomputed in backward, so memory stays as in eager ZeRO-3 "
        "(a region's parameters whole only while it runs); under MiCS / HSDP over the shard group, the gradient shards "
        "then averaged across replicas. Needs enabled: true. Not supported yet with stages 0-2, offload_param, "
        "ZeRO++, mics_hierarchical_params_gather, tensor parallelism. See engine.compile(traced=True)."
    )

    not_supported = {"deepcompile": NotSupported(False, "DeepCompile (ZeRO-3 as compiler passes)")}
    ignored_keys = {key: "a DeepCompile setting; it acts only with deepcompile: true" for key in _DEEPCOMPILE_KEYS}

    @model_validator(mode="after")
    def _one_switch(self) -> "CompileConfig":
        if self.enabled and self.disable:
            raise value_error("enabled is true and disable is true; set one of them (enabled: true "
                              "compiles)")
        return self

    @property
    def is_on(self) -> bool:
        return self.enabled or self.disable is False


class EngineConfig(Section):
    """A validated ds_config.json. Build it with `load_config`."""

    train_batch_size: Annotated[ConfigInt, _TRAIN_AUTO] = Field(
        ge=1, description="Samples per optimizer step over all ranks. " + _BATCH_DOC
    )
    train_micro_batch_size_per_gpu: Annotated[ConfigInt, _MICRO_AUTO] = Field(
        ge=1, description="Samples per forward/backward on one rank. " + _BATCH_DOC
    )
    gradient_accumulation_steps: Annotated[ConfigInt, _GAS_AUTO] = Field(
        ge=1, description="Micro-batches accumulated per optimizer step. " + _BATCH_DOC
    )
    world_size: ConfigInt = Field(ge=1, description="Data-parallel ranks the batch rule used (not a file key).")
    gradient_clipping: Annotated[ConfigFloat, Auto("1.0 (HF's max_grad_norm)")] = Field(
        0.0, ge=0, description="Clip the global gradient norm to this value; 0 disables clipping."
    )
    steps_per_print: ConfigInt | None = Field(
        None, ge=1, description="Log progress every N optimizer steps; null: never (DeepSpeed's current default)."
    )
    wall_clock_breakdown: ConfigBool = Field(False, description="Log forward/backward/step timings.")
    prescale_gradients: ConfigBool = Field(False, description="Divide gradients before reduction, not after.")
    gradient_predivide_factor: ConfigFloat = Field(
        1.0, gt=0, description="Divide gradients by this before reduction and by world/factor after (fp16 range)."
    )
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description="dtype of gradient reductions; null: the compute dtype."
    )
    zero_allow_untested_optimizer: ConfigBool = Field(
        False, description="Allow a client optimizer that ZeRO was not tested with."
    )
    zero_force_ds_cpu_optimizer: ConfigBool = Field(
        True, description="With optimizer offload, require the CPU optimizer of the engine."
    )
    dataloader_drop_last: ConfigBool = Field(False, description="Drop the last incomplete batch of the dataloader.")
    fp16: Fp16Config = Field(default_factory=Fp16Config, description="fp16 mixed precision (see its section).")
    bf16: Bf16Config = Field(default_factory=Bf16Config, description="bf16 mixed precision (see its section).")
    optimizer: OptimizerConfig | None = Field(None, description="null: pass an optimizer to initialize().")
    scheduler: SchedulerConfig | None = Field(None, description="null: no schedule, or pass one to initialize().")
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO stage and its knobs.")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig, description="Accepted; not acted on."
    )
    aio: AioConfig = Field(default_factory=AioConfig, description="Asynchronous I/O for NVMe offload.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoint tag validation (see its section)."
    )
    compile: CompileConfig = Field(
        default_factory=CompileConfig, description="torch.compile at initialize (see its section)."
    )
    zero_engine: ZeroEngineSection = Field(
        default_factory=ZeroEngineSection, description="zero_engine's own settings (DeepSpeed ignores them)."
    )
    tensor_parallel: TensorParallelConfig = Field(
        default_factory=TensorParallelConfig, description="AutoTP: tensor parallelism (see its section)."
    )

    key_aliases = {"bfloat16": "bf16"}
    not_supported = TOP_LEVEL_NOT_SUPPORTED
    ignored_keys = HARMLESS_SECTIONS
    deprecated_keys = {}
    derived_fields = frozenset({"world_size"})
    no_effect = {
        "wall_clock_breakdown": "the step time is always measured (engine.last_step_time) and logged every "
                                "steps_per_print steps; there is no finer breakdown",
        "prescale_gradients": _AVERAGED,
        "gradient_predivide_factor": _AVERAGED,
        "zero_allow_untested_optimizer": "any torch.optim.Optimizer is accepted",
        "zero_force_ds_cpu_optimizer": "a client optimizer is used as given; Adam built from the config runs "
                                       "zero_engine's CPUAdam on CPU unless optimizer.params.torch_adam is true",
        "activation_checkpointing": ActivationCheckpointingConfig.no_effect["profile"],
    }

    @field_validator("communication_data_type", mode="before")
    @classmethod
    def _lower_dtype(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, str):
            raise value_error('expected "fp32", "fp16", "bf16" or null')
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_consistency(self) -> EngineConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise PydanticCustomError(
                CONFIG_ERROR_TYPE, "{detail}",
                {"detail": "true together with bf16.enabled true; enable at most one", "subpath": "fp16.enabled"},
            )
        _check_mics_shard_size(self.zero_optimization, self.world_size)
        _check_hpz_partition_size(self.zero_optimization, self.world_size)
        _check_mics_hierarchical(self.zero_optimization)
        _check_quantized(self.zero_optimization)
        if self.compile.traced:
            _raise_if(traced_conflict(self) or (None if self.compile.is_on else
                      "true needs compile.enabled true (the traced mode is a way to compile)"), "compile.traced")
        expected = self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps * self.world_size
        if self.train_batch_size != expected:
            raise PydanticCustomError(
                CONFIG_ERROR_TYPE, "{detail}",
                {"detail": f"train_batch_size {self.train_batch_size} != micro {self.train_micro_batch_size_per_gpu}"
                           f" x gas {self.gradient_accumulation_steps} x world {self.world_size} = {expected}",
                 "subpath": "train_batch_size"},
            )
        return self

    @property
    def compute_dtype_name(self) -> Literal["fp16", "bf16", "fp32"]:
        """The dtype forward and backward run in."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"


def _check_mics_shard_size(zc, world_size: int) -> None:
    """mics_shard_size against the stage and the world the batch rule used (the mesh checks it again against the
    process group: zero_engine/mesh.py)."""
    k = zc.mics_shard_size
    if k == -1:
        return
    fix = None
    if k == 0:
        fix = "0 ranks per shard group; use a divisor of the data-parallel world, or -1 (off)"
    elif zc.stage == 0:
        fix = "needs zero_optimization.stage 1, 2 or 3 (stage 0 shards nothing); raise the stage or set -1"
    elif world_size % k:
        fix = divisor_fix("mics_shard_size", k, world_size)
    _raise_if(fix, "zero_optimization.mics_shard_size")


def _check_hpz_partition_size(zc, world_size: int) -> None:
    """zero_hpz_partition_size against the stage, MiCS and the world (LOCAL_WORLD_SIZE: zero_engine/mesh.py)."""
    k = zc.zero_hpz_partition_size
    if k == 1:
        return
    fix = None
    if zc.stage != 3:
        fix = f"{k} needs zero_optimization.stage 3 (it partitions gathered parameters); set stage 3 or 1 (off)"
    elif zc.mics_shard_size not in (-1, world_size):
        fix = (f"{k} together with mics_shard_size {zc.mics_shard_size} is not supported yet; use one of the two "
               "(hpZ keeps states sharded over every rank, MiCS within groups)")
    elif world_size % k:
        fix = divisor_fix("zero_hpz_partition_size", k, world_size)
    _raise_if(fix, "zero_optimization.zero_hpz_partition_size")


def _check_mics_hierarchical(zc) -> None:
    """mics_hierarchical_params_gather splits MiCS's shard group; the node size is checked by zero_engine/mesh.py."""
    if not zc.mics_hierarchical_params_gather:
        return
    fix = None
    if zc.mics_shard_size == -1:
        fix = ("true needs zero_optimization.mics_shard_size (the shard group it gathers over in two steps); set "
               "mics_shard_size or set the key false")
    elif zc.zero_hpz_partition_size != 1:
        fix = "true together with zero_hpz_partition_size is not supported yet; use one of the two"
    _raise_if(fix, "zero_optimization.mics_hierarchical_params_gather")


def traced_conflict(config: "EngineConfig") -> str | None:
    """What in ``config`` the traced mode of compile (zero/traced.py) does not support yet, or None."""
    zc = config.zero_optimization
    if zc.stage != 3:
        return f"true needs zero_optimization.stage 3, got {zc.stage} (parameters are whole at stages 0-2: use " \
               "compile.enabled without traced)"
    conflicts = [key for key, on in (
        ("zero_optimization.offload_param", zc.offloads_params),
        ("zero_optimization.zero_quantized_weights", zc.zero_quantized_weights),
        ("zero_optimization.zero_quantized_gradients", zc.zero_quantized_gradients),
        ("zero_optimization.zero_hpz_partition_size", zc.zero_hpz_partition_size != 1),
        # the graph gathers over the shard group in one step: MiCS's two-step gather is the eager gatherer's
        ("zero_optimization.mics_hierarchical_params_gather", zc.mics_hierarchical_params_gather),
        ("tensor_parallel.autotp_size", config.tensor_parallel.size > 1)) if on]
    if conflicts:
        return f"true together with {conflicts[0]} is not supported yet with compile.traced; drop one of the two"
    return None


def _check_quantized(zc) -> None:
    """ZeRO++ qwZ / qgZ quantize stage 3's gathers and gradient reduction (zero_engine/zero/quantize.py)."""
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if getattr(zc, key) and zc.stage != 3:
            _raise_if("true needs zero_optimization.stage 3 (ZeRO++ quantizes stage 3's collectives); set stage 3 "
                      "or false", f"zero_optimization.{key}")


# What a group size means, and the value that turns it off, for each key that sizes groups of data-parallel ranks
_GROUP_SIZE_KEYS = {"mics_shard_size": ("the ranks per shard group, e.g. GPUs per node", -1),
                    "zero_hpz_partition_size": ("the ranks per node", 1)}


def divisor_fix(key: str, k: int, world_size: int) -> str:
    """The fix for zero_optimization.``key``'s group size ``k`` that does not divide the data-parallel world: the
    sizes that do, but the off value (named once, as the way to turn the feature off). The config's checks and
    zero_engine/mesh.py's (against the process group) word it alike."""
    meaning, off = _GROUP_SIZE_KEYS[key]
    choices = [str(d) for d in range(1, world_size + 1) if world_size % d == 0 and d != off]
    world = f"the data-parallel world of {world_size} rank{'s' if world_size != 1 else ''}"
    if not choices:  # one rank (AutoTP over the whole world, say): nothing to split it into groups
        return f"{k} does not divide {world}, which has nothing to partition; set {off} (off)"
    use = choices[0] if len(choices) == 1 else f"one of {', '.join(choices)}"
    return f"{k} does not divide {world}; use {use} ({meaning}), or {off} (off)"


def _raise_if(fix: str | None, subpath: str) -> None:
    if fix is not None:
        raise PydanticCustomError(CONFIG_ERROR_TYPE, "{detail}", {"detail": fix, "subpath": subpath})
