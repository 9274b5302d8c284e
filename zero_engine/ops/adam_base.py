"""What CPUAdam and FusedAdam share: arguments, state layout, and grouping of tensors into kernel calls.

State per parameter is exactly torch.optim.AdamW's (``step`` as a float32 scalar tensor, ``exp_avg``,
``exp_avg_sq``), so optimizer checkpoints move between these classes and torch's in both directions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

from .builder import load_op


class BatchedTensors:
    """Tensors of one kernel call: the parameters of one group that share a step count (and a key)."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []

    def append(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]) -> None:
        self.params.append(param)
        self.grads.append(grad)
        self.exp_avgs.append(state["exp_avg"])
        self.exp_avg_sqs.append(state["exp_avg_sq"])


class OpAdamBase(torch.optim.Optimizer):
    """Adam/AdamW driven by a compiled op; subclasses say how a batch of tensors is updated.

    Args follow torch.optim.AdamW, plus:
        adamw_mode: True for decoupled weight decay (AdamW: ``p *= 1 - lr * wd``), False for L2
            regularisation added to the gradient (Adam: ``g += wd * p``).
        bias_correction: divide the moments by ``1 - beta^t`` as Adam does; False skips it.
    amsgrad is not implemented by the kernels: True raises ValueError.
    """

    op_name = ""  # set by subclasses: the op loaded by load_op

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 amsgrad: bool = False, *, adamw_mode: bool = True, bias_correction: bool = True) -> None:
        if amsgrad:
            raise ValueError(f"{type(self).__name__}: amsgrad=True is not supported by the fused kernels; pass "
                             "amsgrad=False, or use torch.optim.AdamW(amsgrad=True)")
        if not float(lr) >= 0.0:
            raise ValueError(f"{type(self).__name__}: lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"{type(self).__name__}: eps must be >= 0, got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"{type(self).__name__}: betas must each be in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"{type(self).__name__}: weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        adamw_mode=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self._op = load_op(self.op_name)  # raises OpBuildError when the op cannot be built (caller falls back)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            # A state dict saved by torch.optim.Adam / AdamW names the mode decoupled_weight_decay.
            group.setdefault("amsgrad", False)
            group.setdefault("adamw_mode", bool(group.get("decoupled_weight_decay", True)))
            group.setdefault("bias_correction", True)

    # Subclass hooks -------------------------------------------------------------------------------

    def _check_param(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def _batch_key(self, param: torch.Tensor, grad: torch.Tensor) -> Hashable:
        """Tensors with equal keys (and equal step counts) go into one kernel call."""
        return ()

    def _update_batch(self, group: dict[str, Any], step: int, batch: BatchedTensors) -> None:
        raise NotImplementedError

    # Shared machinery -----------------------------------------------------------------------------

    def _state_for(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if len(state) == 0:
            # As torch.optim.AdamW (not capturable, not fused): step is a float32 CPU scalar tensor.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        for key in ("exp_avg", "exp_avg_sq"):
            # A loaded checkpoint may hold strided or differently typed moments; the kernels need
            # contiguous tensors of the parameter's dtype.
            value = state[key]
            if not value.is_contiguous() or value.dtype != param.dtype or value.device != param.device:
                state[key] = value.to(device=param.device, dtype=param.dtype).contiguous()
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("amsgrad", False):
                raise ValueError(f"{type(self).__name__}: amsgrad=True is not supported (param group option)")
            batches: dict[tuple[int, Hashable], BatchedTensors] = defaultdict(BatchedTensors)
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients")
                self._check_param(param, grad)
                state = self._state_for(param)
                step_tensor = state["step"]
                if isinstance(step_tensor, torch.Tensor):
                    step_tensor += 1
                    step = int(step_tensor.item())
                else:  # a checkpoint from an older torch stored a plain number
                    step = int(step_tensor) + 1
                    state["step"] = torch.tensor(float(step), dtype=torch.float32)
                batches[(step, self._batch_key(param, grad))].append(param, grad.contiguous(), state)
            for (step, _key), batch in batches.items():
                self._update_batch(group, step, batch)
        return loss
