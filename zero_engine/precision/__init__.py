"""Precision policy: the compute dtype a config asks for, and fp16 loss scaling."""

from __future__ import annotations

import torch

from .loss_scaler import DynamicLossScaler, StaticLossScaler, make_loss_scaler

__all__ = ["compute_dtype_of", "cast_floating_", "DynamicLossScaler", "StaticLossScaler", "make_loss_scaler", "DTYPES"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def compute_dtype_of(config) -> torch.dtype:
    """fp16 or bf16 when enabled (the config refuses both at once), else fp32."""
    if config.fp16.enabled:
        return torch.float16
    if config.bf16.enabled:
        return torch.bfloat16
    return torch.float32


@torch.no_grad()
def cast_floating_(model: torch.nn.Module, dtype: torch.dtype, params: bool = True) -> None:
    """Cast the model's floating buffers (and, with ``params``, its whole floating parameters) to ``dtype`` in
    place, as DeepSpeed's ``module.half()`` / ``module.bfloat16()``. Partitioned parameters are the engine's."""
    from ..zero.partition import sharded_param_of

    tensors = list(model.buffers())
    if params:
        tensors += [p for p in model.parameters() if sharded_param_of(p) is None]
    for t in tensors:
        if t.is_floating_point() and t.dtype != dtype:
            t.data = t.data.to(dtype)
