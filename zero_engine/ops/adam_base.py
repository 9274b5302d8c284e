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


def _still_views(states: list[dict[str, Any]], views: tuple[torch.Tensor, ...]) -> bool:
    """Each state's ``step`` is still the view of the step buffer made for it (see ``OpAdamBase._count_steps``)."""
    for state, view in zip(states, views):  # a loop, not all(<generator>): no Python call per parameter
        if state["step"] is not view:
            return False
    return True


class BatchedTensors:
    """Tensors of one kernel call: the parameters of one group that share a step count (and a key). Gradients are
    made contiguous as they go in."""

    def __init__(self, params: list[torch.Tensor] | None = None, grads: list[torch.Tensor] | None = None,
                 states: list[dict[str, Any]] | None = None) -> None:
        self.params: list[torch.Tensor] = params or []
        self.grads: list[torch.Tensor] = [grad.contiguous() for grad in grads or ()]
        self.exp_avgs: list[torch.Tensor] = [state["exp_avg"] for state in states or ()]
        self.exp_avg_sqs: list[torch.Tensor] = [state["exp_avg_sq"] for state in states or ()]

    def append(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]) -> None:
        self.params.append(param)
        self.grads.append(grad.contiguous())
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
        # the step counts of the states stepped together: {ids of the states: (buffer, its views)}; see
        # [Note: the step counts are views of one buffer]
        self._step_buffers: dict[tuple[int, ...], tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self._grad_scale = 1.0  # for the step in progress (see step)

    accepts_grad_scale = True  # step(grad_scale=...) scales the gradients inside the kernel

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # unpickled or copied (torch's __getstate__ keeps the state and the groups only): the op and the step
        # counts' buffers are made again (load_op is cached per process)
        if "_op" not in self.__dict__:
            self._op = load_op(self.op_name)
        self.__dict__.setdefault("_step_buffers", {})
        self._grad_scale = 1.0
        for group in self.param_groups:
            # A state dict saved by torch.optim.Adam / AdamW names the mode decoupled_weight_decay.
            group.setdefault("amsgrad", False)
            group.setdefault("adamw_mode", bool(group.get("decoupled_weight_decay", True)))
            group.setdefault("bias_correction", True)

    # Subclass hooks -------------------------------------------------------------------------------

    def _check_params(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Raise ValueError naming the first parameter (or gradient) the kernel cannot take."""
        raise NotImplementedError

    def _batch_keys(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[Hashable] | None:
        """Each tensor's key: tensors with equal keys (and equal step counts) go into one kernel call. None: one key
        for all of them."""
        return None

    def _update_batch(self, group: dict[str, Any], step: int, batch: BatchedTensors) -> None:
        raise NotImplementedError

    # Shared machinery -----------------------------------------------------------------------------

    def _states_for(self, params: list[torch.Tensor]) -> list[dict[str, Any]]:
        """Each parameter's state, made on its first step (as torch.optim.AdamW, not capturable, not fused: ``step``
        a float32 CPU scalar tensor) and made usable by the kernels: a loaded checkpoint may hold strided or
        differently typed moments, the kernels need contiguous tensors of the parameter's dtype."""
        states = []
        for param in params:  # one loop, not a call per parameter: see [Note: the step's Python per group]
            state = self.state[param]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
            for key in ("exp_avg", "exp_avg_sq"):
                value = state[key]
                if not value.is_contiguous() or value.dtype != param.dtype or value.device != param.device:
                    state[key] = value.to(device=param.device, dtype=param.dtype).contiguous()
            states.append(state)
        return states

    def _count_steps(self, states: list[dict[str, Any]]) -> list[int]:
        """Add one to each state's step count and return the new counts.

        [Note: the step counts are views of one buffer]
        Each state's ``step`` is a float32 CPU scalar tensor, as torch.optim.AdamW keeps it. Adding one to 52 of them
        cost 0.34 ms a step on this CPU (``_foreach_add_`` runs one op per tensor on CPU, then a stack to read them).
        So the counts of the tensors stepped together are 0-d views of one float32 buffer (``steps`` here): one
        ``add_`` and one read a step. A view is still a float32 scalar tensor in the state (checkpoints, torch's
        optimizers and a user's in-place edit see and change it as before). A state whose ``step`` is no longer the
        view made for it (a loaded checkpoint put a tensor of its own, a plain number from an older torch, a
        capturable optimizer's device tensor) makes a new buffer from the current counts, exactly (float32 to
        float and back)."""
        key = tuple(map(id, states))
        steps, views = self._step_buffers.get(key, (None, ()))
        if steps is None or not _still_views(states, views):
            steps = torch.tensor([float(state["step"]) for state in states], dtype=torch.float32)
            views = steps.unbind()
            for state, view in zip(states, views):
                state["step"] = view
            if len(self._step_buffers) >= 64:  # the states stepped together changed often (sub-groups): start over
                self._step_buffers.clear()
            self._step_buffers[key] = (steps, views)
        steps.add_(1)  # float32 + 1, as ``counter += 1``
        return [int(step) for step in steps.tolist()]

    def step(self, closure: Callable[[], Any] | None = None, *, grad_scale: float = 1.0) -> Any:
        """One Adam step of every parameter that has a gradient; each gradient is first multiplied by ``grad_scale``
        in fp32 inside the kernel, exactly as ``grad.float() * grad_scale`` (the ZeRO optimizer's unscale and
        clipping coefficient), so a 16-bit gradient needs no fp32 copy."""
        self._grad_scale = float(grad_scale)
        try:
            return self._step_groups(closure)
        finally:
            self._grad_scale = 1.0

    @torch.no_grad()
    def _step_groups(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step of every parameter that has a gradient, scaled by ``self._grad_scale``.

        [Note: the step's Python per group]
        The kernels take lists; so does everything before them: the checks, the states, the step counts and the
        batching each run once per param group over its tensors (a loop inside one call), not as method calls per
        parameter, which were a tenth of a ZeRO-3 training step's Python calls (issue 22)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("amsgrad", False):
                raise ValueError(f"{type(self).__name__}: amsgrad=True is not supported (param group option)")
            params = [param for param in group["params"] if param.grad is not None]
            if not params:
                continue
            grads = [param.grad for param in params]
            for grad in grads:
                if grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients")
            self._check_params(params, grads)
            states = self._states_for(params)
            steps = self._count_steps(states)
            keys = self._batch_keys(params, grads)
            if keys is None and steps.count(steps[0]) == len(steps):  # the usual case: one kernel call
                batches = {(steps[0], ()): BatchedTensors(params, grads, states)}
            else:
                batches = defaultdict(BatchedTensors)
                for i, (param, grad, state) in enumerate(zip(params, grads, states)):
                    batches[(steps[i], () if keys is None else keys[i])].append(param, grad, state)
            for (step, _key), batch in batches.items():
                self._update_batch(group, step, batch)
        return loss
