"""The `zero_optimization` section: ZeRO stage, buckets, prefetch/persistence policy and offload.

Defaults are DeepSpeed's (deepspeed/runtime/zero/config.py and offload_config.py), so an existing ds_config.json
means the same thing here. Fields are named by their short name; the `stage3_*` spellings are aliases.
"""
from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from zero_engine.config.fields import (
    CONFIG_ERROR_TYPE,
    Auto,
    ConfigBool,
    ConfigFloat,
    ConfigInt,
    NotSupported,
    Section,
    same_json_value,
    show,
    value_error,
)
from zero_engine.config.notes import LoadNotes
from zero_engine.errors import ConfigError

class OffloadParamConfig(Section):
    """Where partitioned parameters live between uses (stage 3 only)."""

    device: Literal["none", "cpu", "nvme"] = Field(
        "none",
        description="Memory that holds the parameter shards: 'none' keeps them on the accelerator; 'cpu' moves "
        "them to host memory (saves device memory, costs a host-to-device copy per gather); 'nvme' (ZeRO-Infinity) "
        "keeps them in per-rank files under nvme_path and reads each shard bucket in ahead of its all-gather "
        "(a CPU compute device only, so far).",
    )
    nvme_path: str | None = Field(None, description="Directory on the NVMe drive for the parameter shards' files "
                                  "(device 'nvme'); each run and rank gets its own subdirectory, removed at exit.")
    buffer_count: ConfigInt = Field(5, ge=0, description="NVMe: how many shard buckets are read ahead of their "
                                    "all-gathers along the recorded module order (at least 1).")
    buffer_size: Annotated[ConfigInt, Auto("DeepSpeed's default 1e8")] = Field(
        100_000_000, ge=0, description="NVMe: elements per shard bucket, the unit read and written (a parameter "
        "whose shard is larger is a bucket of its own)."
    )
    max_in_cpu: ConfigInt = Field(
        1_000_000_000, ge=0, description="NVMe: parameter shard elements held in memory at once (read-ahead stops "
        "there; the buckets one all-gather or one optimizer sub-group needs are read even beyond it)."
    )
    pin_memory: ConfigBool = Field(
        False, description="Page-locked host buffers: faster copies, but pinned memory cannot be swapped."
    )

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> "OffloadParamConfig":
        if self.device == "nvme" and not self.nvme_path:
            raise PydanticCustomError(CONFIG_ERROR_TYPE, "{detail}", {
                "detail": 'device "nvme" needs nvme_path: a directory on the NVMe drive (e.g. "/local_nvme")',
                "subpath": "nvme_path"})
        return self


class OffloadOptimizerConfig(Section):
    """Where the fp32 master weights and optimizer states live, and where the optimizer step runs
    (zero_engine/offload/: placement.py says where, optimizer_swap.py streams NVMe states)."""

    device: Literal["none", "cpu", "nvme"] = Field(
        "none",
        description="'none' keeps optimizer states on the accelerator; 'cpu' keeps fp32 masters, moments and "
        "gradient shards in host memory and runs the step there with CPUAdam (removes 12 bytes/parameter plus the "
        "gradient shards from device memory, adds a device-to-host gradient copy and a host-to-device parameter "
        "copy per step); 'nvme' keeps masters and moments in per-rank files under nvme_path and streams them "
        "through the step sub-group by sub-group (host memory: buffer_count sub-groups of states).",
    )
    nvme_path: str | None = Field(None, description="Directory on the NVMe drive for the optimizer states' files "
                                  "(device 'nvme'); each run and rank gets its own subdirectory, removed at exit.")
    buffer_count: ConfigInt = Field(4, ge=0, description="Host buffers the NVMe step streams sub-groups through: "
                                    "1 sequential, 2 overlaps the next read with the update, 3+ also the previous "
                                    "write. Each holds one sub-group's master and moments.")
    pin_memory: ConfigBool = Field(False, description="Page-locked host buffers (masters, gradient shards, swap "
                                   "buffers): faster, asynchronous copies to and from the accelerator; pinned memory "
                                   "cannot be swapped by the OS. No effect without an accelerator.")
    pipeline_read: ConfigBool = Field(False, description="NVMe: read the next sub-group's states while this one "
                                      "is updated (needs buffer_count >= 2).")
    pipeline_write: ConfigBool = Field(False, description="NVMe: write an updated sub-group's states while the "
                                       "next ones are read and updated (otherwise each write is waited at once).")
    fast_init: ConfigBool = Field(False, description="Fast optimizer initialisation under NVMe offload.")
    ratio: ConfigFloat = Field(
        1.0, ge=0.0, le=1.0, description="Fraction of optimizer states offloaded; only 1.0 is supported."
    )
    super_offload: ConfigBool = Field(False, description="DeepSpeed SuperOffload; not supported yet.")
    convert_grad_on_cpu: ConfigBool = Field(True, description="Convert gradients to fp32 on the CPU side.")
    cpuadam_cores_perc: ConfigFloat = Field(
        0.8, ge=0.0, le=1.0, description="Share of this process's CPU cores CPUAdam's kernel uses under offload "
        "(never more than torch's thread count)."
    )

    not_supported = {
        "ratio": NotSupported(1.0, "partial optimizer offload"),
        "super_offload": NotSupported(False, "SuperOffload"),
    }
    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> "OffloadOptimizerConfig":
        if self.device == "nvme" and not self.nvme_path:
            raise PydanticCustomError(CONFIG_ERROR_TYPE, "{detail}", {
                "detail": 'device "nvme" needs nvme_path: a directory on the NVMe drive (e.g. "/local_nvme")',
                "subpath": "nvme_path"})
        return self

    no_effect = {
        "fast_init": "optimizer states are created by the first step and written then, so start-up never writes "
                     "zero moments (what DeepSpeed's fast_init skips); see zero_engine/offload/optimizer_swap.py",
        "convert_grad_on_cpu": "gradients always reach the host in the gradient shards' dtype and CPUAdam converts "
                               "them to fp32 inside its kernel (the CPU side), which keeps offload bitwise equal "
                               "to no offload",
    }


def _is_empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def _names(value: Any) -> Any:
    if isinstance(value, str):  # DeepSpeed accepts one name for a list of one
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(dict.fromkeys(value))
    raise value_error("expected a string or a list of strings")


Names = Annotated[list[str], BeforeValidator(_names)]

# DeepSpeed's default leaf classes (deepspeed/runtime/zero/leaf_module_config.py): Hugging Face's mixture-of-experts
# blocks, whose experts run by data-dependent routing (see zero_engine/zero/units.py).
DEFAULT_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


class LeafModuleConfig(Section):
    """Stage 3 leaf modules: each is gathered and released as one unit with its whole subtree, and its descendants
    get no hooks (zero_engine/zero/units.py). Fewer, larger gathers; all its parameters live while it runs."""

    classes: Names = Field(
        default_factory=lambda: list(DEFAULT_LEAF_CLASSES),
        description="Module classes, by name (\"Block\") or fully qualified name. Default: DeepSpeed's, the "
        "mixture-of-experts blocks of Mixtral, Qwen2-MoE and Qwen3-MoE (absent ones are skipped); a class you name "
        "must exist in the model.",
    )
    names: Names = Field(default_factory=list, description="Module names as model.named_modules() gives them.")
    name_suffixes: Names = Field(default_factory=list, description="Modules whose name ends with one of these.")


def _bool_or_auto(value: Any) -> Any:
    if isinstance(value, bool) or value == "auto":
        return value
    raise value_error('expected true, false or "auto"')


class ZeroConfig(Section):
    """ZeRO: partition optimizer states (stage 1), gradients (stage 2) and parameters (stage 3) across the
    data-parallel ranks. Each stage removes a replica from every rank's memory at the cost of communication."""

    stage: ConfigInt = Field(
        0,
        ge=0,
        le=3,
        description="0: plain data parallel. 1: optimizer states partitioned (4x less optimizer memory at N=4). "
        "2: gradients too (reduce-scatter instead of all-reduce, same traffic). 3: parameters too "
        "(per-rank model states ~16 bytes x params / N; 1.5x DDP's traffic: all-gathers in forward and backward).",
    )
    contiguous_gradients: ConfigBool = Field(
        True, description="Copy reduced gradients into one contiguous buffer: less fragmentation, one more copy."
    )
    reduce_scatter: ConfigBool = Field(
        True, description="Average gradients with reduce-scatter (each rank keeps only its shard) not all-reduce."
    )
    reduce_bucket_size: Annotated[ConfigInt, Auto("hidden*hidden with a model, else DeepSpeed's default 5e8")] = (
        Field(
            500_000_000,
            ge=0,
            description="Elements per gradient reduce-scatter bucket. Larger: fewer, more efficient collectives; "
            "smaller: less transient memory (one bucket in the compute dtype).",
        )
    )
    allgather_partitions: ConfigBool = Field(
        True, description="Stages 1-2: gather updated parameters with all-gather (true) or a series of broadcasts."
    )
    allgather_bucket_size: ConfigInt = Field(
        500_000_000, ge=0, description="Stages 1-2: elements per parameter all-gather after the step."
    )
    overlap_comm: ConfigBool = Field(
        False,
        description="Overlap gradient reduction with the backward pass (default: true at stage 3, false below, "
        "as DeepSpeed). Costs extra bucket memory.",
    )
    offload_param: OffloadParamConfig | None = Field(
        None, description="Parameter offload (stage 3). `false` or absent: off."
    )
    offload_optimizer: OffloadOptimizerConfig | None = Field(
        None, description="Optimizer state offload (stages 1-3). `false` or absent: off."
    )
    sub_group_size: ConfigInt = Field(
        1_000_000_000, ge=0, description="Elements per optimizer-step tile; bounds the step's working memory."
    )
    prefetch_bucket_size: Annotated[ConfigInt, Auto("int(0.9*hidden*hidden) with a model, else 5e7")] = Field(
        50_000_000,
        ge=0,
        description="Stage 3: elements fetched ahead of use, a whole gather unit at a time (a unit larger than the "
        "bucket is fetched in part). Larger hides more all-gather latency and holds more gathered parameters at once.",
    )
    param_persistence_threshold: Annotated[ConfigInt, Auto("10*hidden with a model, else 1e5")] = Field(
        100_000,
        ge=0,
        description="Stage 3: parameters with fewer elements stay gathered (not partitioned): saves many small, "
        "latency-bound all-gathers at the cost of their full size on every rank.",
    )
    model_persistence_threshold: ConfigInt = Field(
        sys.maxsize, ge=0, description="Stage 3: cap on the total elements kept persistent by the threshold above "
        "(parameters are taken in model order until the cap is reached; the rest are partitioned)."
    )
    max_live_parameters: Annotated[ConfigInt, Auto("DeepSpeed's default 1e9")] = Field(
        1_000_000_000,
        ge=0,
        description="Stage 3: most gathered parameter elements alive per rank before releasing; bounds the "
        "working set, smaller values mean more re-gathering.",
    )
    max_reuse_distance: Annotated[ConfigInt, Auto("DeepSpeed's default 1e9")] = Field(
        1_000_000_000,
        ge=0,
        description="Stage 3: keep a parameter gathered if it is used again within this many elements of "
        "fetching; trades memory for fewer all-gathers.",
    )
    allgather_sequential: Annotated[bool | Literal["auto"], BeforeValidator(_bool_or_auto)] = Field(
        False,
        description="Stage 3 gather strategy. false: coalesced, prefetching up to prefetch_bucket_size elements "
        "along the recorded module order (large parameters are all-gathered straight into their storage, small ones "
        "share one collective). true: one parameter at a time, one prefetched ahead: the gathered working set is "
        "the module running plus one parameter; more, smaller collectives and less overlap. \"auto\": decided per "
        "shard bucket at initialize from the measured memory headroom (zero_engine.memory_limit, else the cgroup "
        "or physical memory limit shared by the local ranks; free device memory on GPU): buckets whose coalesced "
        "prefetch would not fit are gathered sequentially, the rest coalesced; the choice is logged.",
    )
    leaf_module: LeafModuleConfig = Field(
        default_factory=LeafModuleConfig,
        description="Stage 3: modules gathered as one unit with their whole subtree (ZeRO-3 leaf modules).",
    )
    module_granularity_threshold: ConfigInt = Field(
        0,
        ge=0,
        description="Stage 3: mark leaf modules automatically, as DeepSpeed does: going down from the root, the "
        "first module whose parameter elements per layer (its subtree's elements / (1 + its non-container "
        "descendant layers)) is at most this becomes a leaf. 0: off.",
    )
    mics_shard_size: ConfigInt = Field(
        -1,
        ge=-1,
        description="MiCS / HSDP (stages 1-3): shard model states within groups of this many consecutive ranks and "
        "replicate them across the world / k groups (the mesh dp_replicate x dp_shard, zero_engine/mesh.py). "
        "Model states per rank 16 bytes x params / k instead of / N; parameter all-gathers and the gradient "
        "reduce-scatter stay within the group (within a node when k is the GPUs per node), and each gradient "
        "bucket's shard is then all-reduced across the replicas (one collective per bucket, of its "
        "shard: 1/k of the bucket's bytes). Must divide the data-parallel world. -1: off (shard over every rank); the world size: the same.",
    )
    mics_hierarchical_params_gather: ConfigBool = Field(
        False,
        description="MiCS (with mics_shard_size k spanning several nodes of LOCAL_WORLD_SIZE ranks): gather "
        "parameters in two steps, as DeepSpeed's MiCS does: an all-gather across nodes among the shard group's "
        "ranks with the same local rank, then one within the node (zero_engine/zero/mics.py). The cross-node "
        "collective has k / LOCAL_WORLD_SIZE ranks and 1/LOCAL_WORLD_SIZE of the gathered bytes per rank; the "
        "result is bitwise the flat gather's; costs a transient buffer of the gathered size and a copy per "
        "gather. k must be a multiple of LOCAL_WORLD_SIZE; a shard group within one node is gathered in one "
        "collective, as without the key (logged). Needs mics_shard_size.",
    )
    zero_hpz_partition_size: ConfigInt = Field(
        1,
        ge=1,
        description="ZeRO++ hpZ (stage 3): besides the model states sharded over every rank, keep a secondary copy "
        "of the compute-dtype parameters sharded within groups of this many consecutive ranks (a node), refreshed "
        "by each forward's gather; backward all-gathers read it within the group, so the cross-group all-gather "
        "bytes of a step drop from 2 x to 1 x the parameter bytes. Costs 2 bytes x params / k more per rank "
        "(memory_stats' params_secondary). Must divide the world and be at most the ranks per node "
        "(LOCAL_WORLD_SIZE). 1: off.",
    )
    zero_quantized_weights: ConfigBool = Field(
        False,
        description="ZeRO++ qwZ (stage 3): parameter all-gathers move int8 values with one fp32 scale per 256 "
        "elements (zero_engine/zero/quantize.py), dequantized into the parameter's storage: 1.016 bytes per "
        "element instead of 2 (bf16), about half the all-gather bytes. Forward and backward compute with weights "
        "within half an int8 step (1/254 of their block's largest magnitude) of the exact ones; the shards, fp32 "
        "masters and optimizer stay exact, so the error does not accumulate. Persistent parameters, "
        "GatheredParameters and checkpoints gather exactly. With zero_hpz_partition_size the secondary shards "
        "hold 16-bit copies of the dequantized weights.",
    )
    zero_quantized_gradients: ConfigBool = Field(
        False,
        description="ZeRO++ qgZ (stage 3): each gradient bucket is quantized to int4 (one fp32 scale per 256 "
        "elements) and exchanged with one all-to-all over the shard group instead of a reduce-scatter; each rank "
        "dequantizes the pieces of its shard and sums them in fp32. 0.516 bytes per element instead of 4 (fp32 "
        "reduce-scatter, 0.129 x) or 2 (bf16, 0.258 x); each rank's contribution is within 1/14 of its block's "
        "largest magnitude (one rounding: zero_engine/zero/quantize.py).",
    )
    gather_16bit_weights_on_model_save: ConfigBool = Field(
        False, description="Stage 3: gather full 16-bit weights when saving the model."
    )
    round_robin_gradients: ConfigBool = Field(
        False, description="Stages 1-2 with CPU offload: spread gradient copies across ranks."
    )

    key_aliases = {
        "stage3_prefetch_bucket_size": "prefetch_bucket_size",
        "stage3_param_persistence_threshold": "param_persistence_threshold",
        "stage3_model_persistence_threshold": "model_persistence_threshold",
        "stage3_max_live_parameters": "max_live_parameters",
        "stage3_max_reuse_distance": "max_reuse_distance",
        "stage3_allgather_sequential": "allgather_sequential",
        "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
        "stage3_module_granularity_threshold": "module_granularity_threshold",
    }
    runtime_auto = frozenset({"allgather_sequential"})  # "auto" kept: the engine decides it at initialize
    not_supported = {
        "zero_quantized_nontrainable_weights": NotSupported(False, "ZeRO++ int8 storage of frozen weights; zero_quantized_weights quantizes their gathers"),
        "zeropp_loco_param": NotSupported(None, "LoCo-ZeRO++", is_off=_is_empty),
        "zenflow": NotSupported(None, "ZenFlow", is_off=_is_empty),
        "use_multi_rank_bucket_allreduce": NotSupported(True, "multi-rank bucket all-reduce switch"),
        "load_from_fp32_weights": NotSupported(True, "loading master weights from 16-bit copies"),
        "elastic_checkpoint": NotSupported(False, "elastic checkpoints"),
        "legacy_stage1": NotSupported(False, "legacy stage 1"),
        "ignore_unused_parameters": NotSupported(True, "failing on unused parameters"),
        "memory_efficient_linear": NotSupported(True, "switching off memory-efficient linear"),
        "override_module_apply": NotSupported(True, "switching off module.apply override"),
        "pipeline_loading_checkpoint": NotSupported(False, "pipelined checkpoint loading"),
        "enable_sanity_checks": NotSupported(False, "DeepSpeed's internal sanity checks"),
        "save_muon_momentum_buffer_in_memory": NotSupported(False, "Muon optimizer"),
        "stage3_use_all_reduce_for_fetch_params": NotSupported(False, "all-reduce parameter fetch"),
        "use_all_reduce_for_fetch_params": NotSupported(False, "all-reduce parameter fetch"),
        "stage3_partition_stream_chunk_size": NotSupported(0, "streamed partitioning"),
        "partition_stream_chunk_size": NotSupported(0, "streamed partitioning"),
    }
    ignored_keys = {"log_trace_cache_warnings": "it only controls DeepSpeed's trace-cache log messages"}
    no_effect = {
        "contiguous_gradients": "gradients are always reduced through contiguous per-bucket buffers into "
                                "contiguous shards",
        "reduce_scatter": "gradients are always averaged with a reduce-scatter (each rank keeps its shard); the "
                          "averages are those of an all-reduce",
        "allgather_partitions": "updated parameters are always all-gathered, one collective per bucket",
        "round_robin_gradients": "it orders DeepSpeed's CPU-offload gradient copies across ranks; zero_engine's "
                                 "copies do not depend on it",
    }
    deprecated_keys = {
        "cpu_offload": 'offload_optimizer: {"device": "cpu"}',
        "cpu_offload_param": 'offload_param: {"device": "cpu"}',
        "cpu_offload_params": 'offload_param: {"device": "cpu"}',
        "cpu_offload_use_pin_memory": "pin_memory inside offload_param / offload_optimizer",
        "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save",
    }

    @model_validator(mode="before")
    @classmethod
    def _overlap_comm_default(cls, data: Any) -> Any:
        # DeepSpeed's default depends on the stage: overlapping pays off when stage 3 gathers in backward.
        if isinstance(data, dict) and data.get("overlap_comm") is None:
            data = {**data, "overlap_comm": same_json_value(data.get("stage", 0), 3)}
        return data

    @property
    def offloads_params(self) -> bool:
        return self.offload_param is not None and self.offload_param.device != "none"

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer is not None and self.offload_optimizer.device != "none"

    @classmethod
    def prepare(cls, raw: dict[str, Any], path: str, notes: LoadNotes) -> dict[str, Any]:
        raw = dict(raw)
        for key in ("offload_param", "offload_optimizer"):
            if raw.get(key) is False:
                del raw[key]  # `false` is a common way to write "off"
            elif raw.get(key) is True:
                raise ConfigError(
                    f'{path}.{key}: invalid value true: expected an object such as {{"device": "cpu"}}, or false'
                )
        _map_deprecated_cpu_offload(raw, path, notes)
        _map_deprecated_fp16_gather(raw, path, notes)
        stage = raw.get("stage", 0)
        if not same_json_value(stage, 3) and isinstance(raw.get("offload_param"), dict):
            if raw["offload_param"].get("device", "none") != "none":
                notes.warn(f"{path}.offload_param only acts at stage 3 (stage is {stage}); DeepSpeed ignores it too.")
        return raw


def _map_deprecated_cpu_offload(raw: dict[str, Any], path: str, notes: LoadNotes) -> None:
    pin_memory = raw.pop("cpu_offload_use_pin_memory", None)
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise ConfigError(
            f"{path}.cpu_offload_use_pin_memory: invalid value {show(pin_memory)}: expected true or false"
        )
    mapped = []
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"),
                     ("cpu_offload_params", "offload_param")):
        if old not in raw:
            continue
        value = raw.pop(old)
        if not isinstance(value, bool):
            raise ConfigError(f"{path}.{old}: invalid value {show(value)}: expected true or false")
        if not value:
            notes.deprecated(f"{path}.{old}", "nothing (false is the default)")
            continue
        if raw.get(new) not in (None, False) and new not in mapped:
            raise ConfigError(f"{path}.{old}: deprecated key given together with {path}.{new}; keep only {new}")
        raw[new] = {"device": "cpu", "pin_memory": bool(pin_memory)}
        mapped.append(new)
        pin_note = f', "pin_memory": {str(bool(pin_memory)).lower()}' if pin_memory is not None else ""
        notes.deprecated(f"{path}.{old}", f'{path}.{new} = {{"device": "cpu"{pin_note}}}')
    if pin_memory is not None:
        if mapped:
            notes.deprecated(f"{path}.cpu_offload_use_pin_memory", f"pin_memory of {', '.join(mapped)}")
        else:
            notes.warn(
                f"{path}.cpu_offload_use_pin_memory is deprecated and has no effect here; "
                "set pin_memory inside offload_param / offload_optimizer."
            )


def _map_deprecated_fp16_gather(raw: dict[str, Any], path: str, notes: LoadNotes) -> None:
    old = "stage3_gather_fp16_weights_on_model_save"
    if old not in raw:
        return
    value = raw.pop(old)
    for current in ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"):
        if current in raw:
            if not same_json_value(raw[current], value):
                raise ConfigError(
                    f"{path}.{old}: deprecated key contradicts {path}.{current} "
                    f"({show(value)} vs {show(raw[current])}); keep only {current}"
                )
            notes.deprecated(f"{path}.{old}", f"{path}.gather_16bit_weights_on_model_save")
            return
    raw["gather_16bit_weights_on_model_save"] = value
    notes.deprecated(f"{path}.{old}", f"{path}.gather_16bit_weights_on_model_save = {show(value)}")
