"""Top-level DeepSpeed keys we do not act on: features not implemented yet, and harmless tool sections.

A feature key is accepted only while it is off, so a config never silently loses a feature it asked for.
A harmless section (logging, profiling, monitoring) does not change what training computes; it is accepted and
named once in the log as ignored.
"""
from __future__ import annotations

from typing import Any

from zero_engine.config.fields import NotSupported


def _absent_or_empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def _not_enabled(value: Any) -> bool:
    """Off for sections with an `enabled` switch: DeepSpeed reads `enabled` (default false) and nothing else."""
    return _absent_or_empty(value) or (isinstance(value, dict) and value.get("enabled", False) is False)


def _explicitly_disabled(value: Any) -> bool:
    """Off for sections that DeepSpeed switches on by their presence unless they say enabled false."""
    return _absent_or_empty(value) or (isinstance(value, dict) and value.get("enabled", True) is False)


def _all_values_null(value: Any) -> bool:
    return _absent_or_empty(value) or (isinstance(value, dict) and all(v is None for v in value.values()))


def _fp32_comm(value: Any) -> bool:
    return isinstance(value, str) and value.lower() in ("fp32", "float32")


def _all_switches_false(value: Any) -> bool:
    return _absent_or_empty(value) or (isinstance(value, dict) and all(v is False for v in value.values()))


_OFF = "absent, or a section with enabled false"

TOP_LEVEL_NOT_SUPPORTED: dict[str, NotSupported] = {
    "amp": NotSupported(None, "Apex AMP; use fp16 or bf16", is_off=_not_enabled, accepted=_OFF),
    "sparse_attention": NotSupported(None, "sparse attention", is_off=_absent_or_empty, accepted="absent"),
    "quantize_training": NotSupported(
        None, "quantization-aware training (MoQ)", is_off=_explicitly_disabled,
        accepted='absent, or {"enabled": false}',
    ),
    "compression_training": NotSupported(None, "compression", is_off=_absent_or_empty, accepted="absent"),
    "weight_quantization": NotSupported(None, "weight quantization", is_off=_absent_or_empty, accepted="absent"),
    "eigenvalue": NotSupported(None, "eigenvalue computation", is_off=_not_enabled, accepted=_OFF),
    "progressive_layer_drop": NotSupported(None, "progressive layer drop", is_off=_not_enabled, accepted=_OFF),
    "curriculum_learning": NotSupported(None, "curriculum learning", is_off=_not_enabled, accepted=_OFF),
    "data_efficiency": NotSupported(None, "data efficiency", is_off=_not_enabled, accepted=_OFF),
    "elasticity": NotSupported(None, "elastic training", is_off=_not_enabled, accepted=_OFF),
    "hybrid_engine": NotSupported(None, "the hybrid (RLHF) engine", is_off=_not_enabled, accepted=_OFF),
    "torch_autocast": NotSupported(None, "torch.autocast", is_off=_not_enabled, accepted=_OFF),
    "nebula": NotSupported(None, "Nebula checkpointing", is_off=_not_enabled, accepted=_OFF),
    "pipeline": NotSupported(None, "pipeline parallelism", is_off=_absent_or_empty, accepted="absent"),
    "data_types": NotSupported(
        None, "choosing the gradient accumulation dtype", is_off=_all_values_null, accepted="absent or nulls"
    ),
    "seq_parallel_communication_data_type": NotSupported(
        "fp32", "sequence parallelism", is_off=_fp32_comm, accepted='"fp32"'
    ),
    "seq_parallel_comm_data_type": NotSupported("fp32", "sequence parallelism", is_off=_fp32_comm, accepted='"fp32"'),
    "sequence_parallel_size": NotSupported(1, "sequence parallelism"),
    "sparse_gradients": NotSupported(False, "sparse gradients"),
    "disable_allgather": NotSupported(False, "disabling all-gather"),
    "graph_harvesting": NotSupported(False, "graph harvesting"),
}

# Sections that only observe training (logs, profiles, monitors) or configure tools zero_engine does not run.
HARMLESS_SECTIONS: dict[str, str] = {
    "tensorboard": "monitoring",
    "wandb": "monitoring",
    "csv_monitor": "monitoring",
    "comet": "monitoring",
    "monitor_config": "monitoring",
    "flops_profiler": "profiling",
    "comms_logger": "communication logging",
    "timers": "timing",
    "log": "logging",
    "memory_breakdown": "memory logging",
    "dump_state": "debug printing",
    "vocabulary_size": "a tensor-core alignment warning",
    "autotuning": "the launcher's autotuner",
}
