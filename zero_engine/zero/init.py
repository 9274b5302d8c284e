"""zero.Init: build a model that does not fit one rank, partitioning parameters as modules are constructed.

    with zero_engine.zero.Init():
        model = BigModel()                  # each submodule is partitioned once its constructor has finished
    engine, *_ = zero_engine.initialize(model=model, config=cfg)   # adopts the partitioning as it is

How "finished" is known: a submodule is registered into its parent (``self.fc = nn.Linear(...)``) only after its
own ``__init__`` returned. A global module-registration hook, installed for the ``with`` block only and removed on
exit (also on error), partitions every parameter of the registered submodule that is not partitioned yet. What is
left (parameters registered directly on the root) is partitioned on exit. So at any moment at most one module's
parameters are whole: peak memory ~ the sharded total plus the largest module.

Identical initial weights. Values are broadcast from rank 0 before a parameter is sharded, so every rank holds a
slice of the same tensor even when ranks were seeded differently. A parent that re-initialises its children after
building them (nanoGPT's ``self.apply(self._init_weights)``, Hugging Face's post_init) would touch 0-element
tensors; during the block a TorchFunctionMode catches any ``torch.nn.init`` function or in-place tensor method
called on a partitioned parameter, gathers it, runs the call on the full tensor (drawing the same random numbers
as without Init), broadcasts rank 0's result and re-partitions. Writes through ``param.data`` cannot be seen this
way: use ``torch.nn.init`` functions or GatheredParameters(modifier_rank=0) in such code.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..comm import Communicator, init_distributed
from ..device import local_device
from .gathered import GatheredParameters
from .partition import ParamStatus, ShardedParam, sharded_param_of

log = logging.getLogger("zero_engine.init")

__all__ = ["Init"]


class _GatherOnInitCall(TorchFunctionMode):
    """Runs ``torch.nn.init.*`` and in-place methods on partitioned parameters against their full data."""

    def __init__(self):
        super().__init__()
        self.active = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and _is_init_call(func):
            params = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                      and (sp := sharded_param_of(t)) is not None and sp.status is ParamStatus.NOT_AVAILABLE]
            if params:
                self.active = False
                try:
                    with GatheredParameters(params, modifier_rank=0):
                        return func(*args, **kwargs)
                finally:
                    self.active = True
        return func(*args, **kwargs)


def _is_init_call(func) -> bool:
    name = getattr(func, "__name__", "")
    module = getattr(func, "__module__", "") or ""
    return module == "torch.nn.init" or (name.endswith("_") and not name.startswith("_"))


class Init:
    """Partition parameters as modules are built. ``config`` is accepted for DeepSpeed compatibility (the
    partitioning here needs only the world size); ``enabled=False`` makes the block a no-op."""

    def __init__(self, config=None, enabled: bool = True):
        self.config = config
        self.enabled = enabled
        self._handles = []
        self._mode: _GatherOnInitCall | None = None
        self._roots: list[nn.Module] = []

    def __enter__(self):
        if not self.enabled:
            return self
        if not dist.is_initialized():
            init_distributed()
        self.comm = Communicator()
        self.device = local_device()
        self._handles = [
            nn.modules.module.register_module_module_registration_hook(self._on_submodule),
            nn.modules.module.register_module_parameter_registration_hook(self._on_parameter),
        ]
        self._mode = _GatherOnInitCall()
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        try:
            self._mode.__exit__(exc_type, exc, tb)
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
        if exc_type is None:
            for module in self._roots:  # parameters registered on a module that never became anyone's child
                self._partition(module)
        self._roots.clear()
        return False

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def _on_submodule(self, parent: nn.Module, name: str, submodule: nn.Module | None):
        if submodule is not None:
            self._partition(submodule)
            self._roots = [m for m in self._roots if m is not submodule]
        if parent not in self._roots:
            self._roots.append(parent)
        return None

    def _on_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None):
        if module not in self._roots:
            self._roots.append(module)
        return None

    # ---- partitioning ----------------------------------------------------------------------------------------------
    def _partition(self, module: nn.Module) -> None:
        self._mode.active = False
        try:
            for name, param in module.named_parameters():
                if sharded_param_of(param) is not None or param.numel() == 0:
                    continue
                if param.device.type != "meta" and param.device != self.device:
                    param.data = param.data.to(self.device)  # see [Note: one device per rank] in device.py
                self.comm.broadcast(param.data, src=0, name=f"zero.Init {name}")  # one init, whatever the seeds
                ShardedParam(param, name, -1, self.comm.rank, self.comm.world_size).release()
        finally:
            self._mode.active = True
