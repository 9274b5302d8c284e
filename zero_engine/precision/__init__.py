"""Precision policy: the compute dtype a config asks for, and fp16 loss scaling."""

from __future__ import annotations

import torch

from .loss_scaler import DynamicLossScaler, StaticLossScaler, make_loss_scaler

__all__ = ["compute_dtype_of", "DynamicLossScaler", "StaticLossScaler", "make_loss_scaler", "DTYPES"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def compute_dtype_of(config) -> torch.dtype:
    """fp16 or bf16 when enabled (the config refuses both at once), else fp32."""
    if config.fp16.enabled:
        return torch.float16
    if config.bf16.enabled:
        return torch.bfloat16
    return torch.float32
