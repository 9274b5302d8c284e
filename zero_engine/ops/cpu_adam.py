"""CPUAdam: Adam/AdamW over fp32 CPU parameters, one vectorized OpenMP pass per step
(zero_engine/csrc/adam/cpu_adam.cpp).

This is the optimizer for ZeRO's CPU offload: fp32 master shards, moments and the update live in host
memory, where the step is bound by memory bandwidth. The kernel reads each element once and writes it
once, reads bf16/fp16 gradients directly (no fp32 copy of the gradient) and scales them in fp32
(``step(grad_scale=...)``: ZeRO's unscale-and-clip coefficient, so the ZeRO optimizer hands its 16-bit
gradient shards over as they are), and can write the updated parameter's bf16/fp16 copy in the same pass
(``set_low_precision_copy``), which saves a separate read-convert-write pass over the parameters before they
are sent back to the accelerator.
"""

from __future__ import annotations

from typing import Any

import torch

from .adam_base import BatchedTensors, OpAdamBase

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_COPY_DTYPES = (torch.bfloat16, torch.float16)


class CPUAdam(OpAdamBase):
    """torch.optim.AdamW's arguments and state, computed by the ``cpu_adam`` op.

    Parameters must be contiguous fp32 CPU tensors. Gradients may be fp32, bf16 or fp16 (a parameter
    takes a gradient of another dtype once its ``grad_dtype`` is set, e.g. ``p.grad_dtype = torch.bfloat16``);
    they are converted inside the kernel. The kernel uses ``torch.get_num_threads()`` threads.

    Raises OpBuildError (from the constructor) when the op cannot be built; see zero_engine.ops.make_adam
    for the fallback to torch's AdamW.
    """

    op_name = "cpu_adam"

    def __init__(self, params: Any, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, amsgrad: bool = False, *, adamw_mode: bool = True,
                 bias_correction: bool = True) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, adamw_mode=adamw_mode,
                         bias_correction=bias_correction)
        # Kept out of state_dict(): these are views into buffers the caller owns, not optimizer state.
        self._low_precision_copies: dict[torch.Tensor, torch.Tensor] = {}
        # Threads of the kernel; None: torch.get_num_threads(). Set from offload_optimizer.cpuadam_cores_perc.
        self.num_threads: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "num_threads": self.num_threads}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A copy writes no low-precision copies: those are its caller's buffers, bound to the original's parameters.
        self.__dict__.setdefault("_low_precision_copies", {})
        self.__dict__.setdefault("num_threads", None)

    @property
    def kernel_info(self) -> str:
        """The instruction set and threads of the loaded kernel, e.g. ``avx512 (16 fp32 lanes), ...``."""
        return str(self._op.kernel_info())

    def set_low_precision_copy(self, param: torch.Tensor, tensor: torch.Tensor | None) -> None:
        """After each step, also write ``param``'s new value into ``tensor`` (bf16/fp16, same numel).

        The copy is rounded to nearest even, exactly as ``param.to(tensor.dtype)`` would. ``None``
        stops copying for this parameter.
        """
        if not any(param is p for group in self.param_groups for p in group["params"]):
            raise ValueError("set_low_precision_copy: the parameter is not in any param group of this optimizer")
        if tensor is None:
            self._low_precision_copies.pop(param, None)
            return
        if tensor.dtype not in _COPY_DTYPES:
            raise ValueError(f"set_low_precision_copy: tensor must be bf16 or fp16, got {tensor.dtype}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"set_low_precision_copy: tensor must be a contiguous CPU tensor, got device "
                             f"{tensor.device}, contiguous={tensor.is_contiguous()}")
        if tensor.numel() != param.numel():
            raise ValueError(f"set_low_precision_copy: tensor has {tensor.numel()} elements, the parameter "
                             f"{param.numel()}")
        self._low_precision_copies[param] = tensor

    def _check_params(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        for param, grad in zip(params, grads):
            if param.device.type != "cpu" or param.dtype != torch.float32 or not param.is_contiguous():
                raise ValueError(f"CPUAdam needs contiguous fp32 CPU parameters, got {param.dtype} on {param.device} "
                                 f"(contiguous={param.is_contiguous()}, shape {tuple(param.shape)}); \"torch_adam\": "
                                 "true in the config optimizer's params selects torch's Adam")
            if grad.dtype not in _GRAD_DTYPES or grad.device.type != "cpu":
                raise ValueError(f"CPUAdam needs fp32/bf16/fp16 CPU gradients, got {grad.dtype} on {grad.device} "
                                 f"for a parameter of shape {tuple(param.shape)}")

    def _update_batch(self, group: dict[str, Any], step: int, batch: BatchedTensors) -> None:
        beta1, beta2 = group["betas"]
        copies = [self._low_precision_copies.get(param) for param in batch.params]
        self._op.adam_step(batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, copies, step,
                           float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                           float(group["weight_decay"]), bool(group["adamw_mode"]), bool(group["bias_correction"]),
                           self._grad_scale, self.num_threads or torch.get_num_threads())
