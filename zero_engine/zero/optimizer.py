"""The partitioned optimizer: a torch optimizer that updates only this rank's fp32 master shards.

Each trainable parameter gets one *master*: an fp32 ``nn.Parameter`` of ``shard_numel`` elements. In fp32 training
the master IS the compute shard (same storage, nothing copied); in 16-bit training it is a separate fp32 copy and
the compute shard is refreshed from it after each step. The user's optimizer (an instance, a class or callable, or
one built from the config) is pointed at the masters with its param groups kept, so weight-decay exclusions and
per-group learning rates survive, and an LR scheduler built on it keeps working.

Step: one all-reduce of the squared gradient norm over all shards gives the global norm; gradients are clipped
by it; the optimizer steps; compute shards are refreshed where they are separate.
"""

from __future__ import annotations

import logging
import math
import torch
import torch.nn as nn

from .grads import GradReducer, all_reduce_grads
from .partition import ShardedParam

log = logging.getLogger("zero_engine.optimizer")

__all__ = ["ZeroOptimizer", "DataParallelOptimizer", "bind_optimizer", "build_torch_optimizer", "param_groups_of"]

_SUPPORTED_TYPES = ("adam", "adamw", "sgd")


def param_groups_of(model: nn.Module, model_parameters) -> list[dict]:
    """The user's param groups (a list of params, or of dicts with "params"), or all trainable params."""
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    model_parameters = list(model_parameters)
    if model_parameters and isinstance(model_parameters[0], dict):
        return [dict(g, params=list(g["params"])) for g in model_parameters]
    return [{"params": model_parameters}]


def build_torch_optimizer(opt_config, groups: list[dict]) -> torch.optim.Optimizer:
    """An optimizer from the config's ``optimizer`` block (type + params), over ``groups``."""
    kind = opt_config.type.lower()
    params = dict(opt_config.params)
    if kind in ("adam", "adamw"):
        # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
        decoupled = kind == "adamw" or params.pop("adam_w_mode", True)
        params.pop("torch_adam", None)
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(groups, foreach=True, **params)
    if kind == "sgd":
        return torch.optim.SGD(groups, **params)
    raise NotImplementedError(f"optimizer.type: {opt_config.type!r} is not supported yet; use one of "
                              f"{', '.join(_SUPPORTED_TYPES)} or pass a torch.optim.Optimizer to initialize()")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (scalars such as ``step`` excluded)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values()
               for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def bind_optimizer(optimizer, opt_config, groups: list[dict], substitute: dict[int, torch.Tensor]):
    """The torch optimizer that will update ``substitute[id(p)]`` in place of each trainable ``p``.

    ``optimizer`` is None (built from the config block), a torch.optim.Optimizer (its groups are re-pointed in
    place, so a scheduler already built on it keeps working), or a callable/class taking param groups.
    """
    def swap(params):
        return [substitute[id(p)] for p in params if id(p) in substitute]

    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("optimizer: the optimizer passed to initialize() already has state; pass a fresh one "
                             "and restore state with engine.load_checkpoint()")
        for g in optimizer.param_groups:
            g["params"] = swap(g["params"])
        return optimizer
    swapped = [dict(g, params=swap(g["params"])) for g in groups]
    swapped = [g for g in swapped if g["params"]]
    if callable(optimizer):
        built = optimizer(swapped)
        if not isinstance(built, torch.optim.Optimizer):
            raise ValueError(f"optimizer: the callable returned {type(built).__name__}, expected a "
                             "torch.optim.Optimizer")
        return built
    if optimizer is not None:
        raise ValueError(f"optimizer: expected None, a torch.optim.Optimizer, or a callable(params); got "
                         f"{type(optimizer).__name__}")
    if opt_config is None:
        raise ValueError('no optimizer: pass optimizer= to initialize() or add an "optimizer" block to the config')
    return build_torch_optimizer(opt_config, swapped)


class ZeroOptimizer:
    """Owns the masters and the wrapped torch optimizer; ``step()`` is the whole sharded update."""

    def __init__(self, sharded: list[ShardedParam], reducer: GradReducer, comm, gradient_clipping: float,
                 optimizer, opt_config, groups: list[dict]):
        self.reducer = reducer
        self.comm = comm
        self.gradient_clipping = float(gradient_clipping or 0.0)
        self.sharded = [sp for sp in sharded if sp.param.requires_grad]
        self.masters: dict[int, nn.Parameter] = {}  # id(original param) -> master
        for sp in self.sharded:
            data = sp.shard if sp.shard.dtype == torch.float32 else sp.shard.float()
            self.masters[id(sp.param)] = nn.Parameter(data)
        self.optimizer = bind_optimizer(optimizer, opt_config, groups, self.masters)
        self.global_grad_norm: float | None = None

    # Let LR schedulers and users read hyper-parameters as on any optimizer.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> float:
        """Clip by the global norm, update the masters, refresh separate compute shards. Returns the norm."""
        with torch.profiler.record_function("zero3::optimizer_step"):
            for sp in self.sharded:
                self.masters[id(sp.param)].grad = self.reducer.shard_grad(sp)
            norm = self._global_grad_norm()
            if self.gradient_clipping > 0 and norm > self.gradient_clipping:
                coef = self.gradient_clipping / (norm + 1e-6)
                for bucket in self.reducer.buckets:
                    if bucket.shard_grads is not None:
                        bucket.shard_grads.mul_(coef)
            self.optimizer.step()
            for sp in self.sharded:
                master = self.masters[id(sp.param)]
                if master.data_ptr() != sp.shard.data_ptr():
                    sp.shard.copy_(master.detach())
            self.global_grad_norm = norm
            return norm

    def _global_grad_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64)
        for bucket in self.reducer.buckets:
            if bucket.shard_grads is not None:
                sq += bucket.shard_grads.double().pow(2).sum()
        self.comm.all_reduce(sq, op="sum", name="grad norm")
        return math.sqrt(sq.item())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for master in self.masters.values():
            master.grad = None
        self.reducer.zero_grad()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    @property
    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)

    @property
    def master_bytes(self) -> int:
        """fp32 masters that are separate copies (in fp32 training the master is the compute shard itself)."""
        return sum(m.numel() * 4 for sp, m in ((sp, self.masters[id(sp.param)]) for sp in self.sharded)
                   if m.data_ptr() != sp.shard.data_ptr())


class DataParallelOptimizer:
    """Stage 0: every rank holds everything; gradients are averaged across ranks, then a plain optimizer step."""

    def __init__(self, params: list[nn.Parameter], comm, gradient_clipping: float, bucket_numel: int,
                 optimizer: torch.optim.Optimizer):
        self.params = params
        self.comm = comm
        self.gradient_clipping = float(gradient_clipping or 0.0)
        self.bucket_numel = int(bucket_numel)
        self.optimizer = optimizer
        self.global_grad_norm: float | None = None
        self.master_bytes = 0

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)

    def step(self) -> float:
        all_reduce_grads(self.params, self.comm, self.bucket_numel)
        # Gradients are identical on every rank now, so the local norm is the global one.
        norm = float(torch.nn.utils.clip_grad_norm_(
            self.params, self.gradient_clipping if self.gradient_clipping > 0 else float("inf")))
        self.optimizer.step()
        self.global_grad_norm = norm
        return norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
