"""FusedAdam: Adam/AdamW on CUDA, one multi-tensor launch per ~36 tensors (zero_engine/csrc/adam/fused_adam.cu).

Parameters may be fp32, fp16 or bf16; the moments are kept in the parameter's dtype, as
torch.optim.AdamW keeps them, and the arithmetic is fp32. Gradients may differ in dtype from their
parameter (set ``p.grad_dtype``) and are scaled in fp32 as the kernel reads them (``step(grad_scale=...)``),
so the ZeRO optimizer hands its 16-bit gradient shards over as they are, as it does to CPUAdam. Tensors are
grouped by (device, param dtype, grad dtype, step) into kernel calls.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from .adam_base import BatchedTensors, OpAdamBase

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedAdam(OpAdamBase):
    """torch.optim.AdamW's arguments and state, computed by the ``fused_adam`` op.

    Raises OpBuildError (from the constructor) without a CUDA build of torch, a matching CUDA toolkit
    or a visible GPU; see zero_engine.ops.make_adam for the fallback to torch's fused AdamW.
    """

    op_name = "fused_adam"

    def _check_params(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        for param, grad in zip(params, grads):
            if param.device.type != "cuda" or param.dtype not in _DTYPES or not param.is_contiguous():
                raise ValueError(f"FusedAdam needs contiguous fp32/fp16/bf16 CUDA parameters, got {param.dtype} on "
                                 f"{param.device} (contiguous={param.is_contiguous()}, shape {tuple(param.shape)})")
            if grad.dtype not in _DTYPES or grad.device != param.device:
                raise ValueError(f"FusedAdam needs fp32/fp16/bf16 gradients on the parameter's device {param.device}, "
                                 f"got {grad.dtype} on {grad.device} for a parameter of shape {tuple(param.shape)}")

    def _batch_keys(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[Hashable]:
        return [(param.device, param.dtype, grad.dtype) for param, grad in zip(params, grads)]

    def _update_batch(self, group: dict[str, Any], step: int, batch: BatchedTensors) -> None:
        beta1, beta2 = group["betas"]
        self._op.adam_step(batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, step, float(group["lr"]),
                           float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                           bool(group["adamw_mode"]), bool(group["bias_correction"]), self._grad_scale)
