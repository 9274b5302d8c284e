"""The `tensor_parallel` section: DeepSpeed's AutoTP training settings (DeepSpeed's TPTrainingConfig).

`autotp_size` is the one setting zero_engine implements (zero_engine/autotp.py splits the model; the ("dp", "tp")
mesh comes from zero_engine.autotp.autotp_mesh). DeepSpeed's other keys are accepted only at their off values.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from zero_engine.config.fields import ConfigInt, NotSupported, Section
from zero_engine.config.unsupported import _absent_or_empty


def _inner_tp_off(value: Any) -> bool:
    """DeepSpeed's nested TPConfig (`tensor_parallel` / `tp`): off when absent or at sizes that split nothing."""
    if _absent_or_empty(value):
        return True
    if not isinstance(value, dict) or not set(value) <= {"tp_size", "tp_grain_size"}:
        return False
    return value.get("tp_size", 1) in (0, 1) and value.get("tp_grain_size", 1) == 1


_INNER_TP = NotSupported(None, "DeepSpeed's nested TPConfig: inference's tp_size, tp_grain_size, mpu, tp_group; "
                         "training uses autotp_size", is_off=_inner_tp_off,
                         accepted="absent, or tp_size <= 1 and tp_grain_size 1")


class TensorParallelConfig(Section):
    """DeepSpeed's AutoTP: split each transformer block's Linears over `autotp_size` consecutive ranks (q/k/v/gate/up
    column-wise, o/down row-wise, attention heads split; zero_engine/autotp.py), and shard model states with ZeRO
    over the world / autotp_size data-parallel ranks. Per-rank model states shrink by autotp_size on top of ZeRO;
    each block costs two all-reduces of its activations within the tp group in forward and two in backward. Supported
    models: Hugging Face Llama / Mistral / Qwen2 and the test GPT; another model is refused by name."""

    autotp_size: ConfigInt = Field(
        0, ge=0, description="Ranks per tensor-parallel group (consecutive ranks, usually within a node); 0 or 1: "
        "off (DeepSpeed's default 0). Must divide the world, the attention heads, the key/value heads and the MLP "
        "width."
    )

    not_supported = {
        "tp_overlap_comm": NotSupported(False, "overlapping tensor-parallel all-reduces with compute"),
        "vocab_parallel_lm_head": NotSupported(False, "a vocabulary-parallel LM head"),
        "vocab_parallel_ce_backend": NotSupported("torch", "a vocabulary-parallel loss backend"),
        "tensor_parallel": _INNER_TP,
        "tp": _INNER_TP,
        "tp_size": NotSupported(1, "inference's tensor-parallel size; training uses autotp_size",
                                is_off=lambda value: value in (0, 1), accepted="0 or 1"),
        "dtype": NotSupported(None, "converting the model's dtype here; use the fp16 / bf16 sections",
                              is_off=lambda value: value is None, accepted="absent or null"),
        "injection_policy_tuple": NotSupported(None, "injection policies", is_off=_absent_or_empty,
                                               accepted="absent or null"),
        "partition_config": NotSupported(None, "custom AutoTP partition rules; use parallelize_module",
                                         is_off=_absent_or_empty, accepted="absent or null"),
        "preset_model": NotSupported(None, "AutoTP presets; the family is recognised from the model",
                                     is_off=lambda value: value is None, accepted="absent or null"),
        "keep_module_on_host": NotSupported(False, "keeping checkpoint weights on the host"),
        "replace_with_kernel_inject": NotSupported(False, "inference kernel injection"),
        "kernel_inject": NotSupported(False, "inference kernel injection"),
    }

    @property
    def size(self) -> int:
        """Ranks per tensor-parallel group: 1 when off (autotp_size 0 or 1)."""
        return max(self.autotp_size, 1)


def requested_autotp_size(source) -> int:
    """``tensor_parallel.autotp_size`` as written in a config source (dict, path or JSON text) or an EngineConfig,
    before validation: the engine needs the data-parallel world for the batch rule before it loads the config. 0
    when absent or not a number (validation then reports it)."""
    section = getattr(source, "tensor_parallel", None)
    if section is not None:
        return section.size
    from .loader import read_config_source

    value = (read_config_source(source).get("tensor_parallel") or {}).get("autotp_size", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
