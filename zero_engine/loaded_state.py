"""``model.load_state_dict(sd)`` after ``initialize``: the loaded values reach the engine's shards and fp32 masters.

    engine, *_ = zero_engine.initialize(model=model, config=config)
    model.load_state_dict(torch.load("weights.pt"))       # every rank loads the whole state dict, at every stage

Left to torch alone, the load copies into the parameters only. At stages 1-2 (and at stage 0 in 16-bit training)
the next step then writes the parameters over from the fp32 masters the load never reached, and the loaded weights
are silently lost, as in DeepSpeed; at stage 3 the parameters hold no data (shape ``[0]``) and torch refuses every
key with "size mismatch". So the engine puts a pre-hook on each module: it takes the module's parameters out of the
state dict, and once the whole load has run without an error each value is written into the master, this rank's
shard and, where the parameter is whole, the parameter (``set_whole_value`` in zero_engine/utils, as
``safe_set_full_fp32_param``; nothing is exchanged, as every rank holds the whole state dict). The post-hooks take
those keys out of ``missing_keys``, where torch put them because they were no longer in the state dict. Buffers are
torch's to load, as they are whole on every rank. A value of the wrong shape is reported as torch reports it, with
the parameter's whole shape, and then no parameter is written. Refused with the reason: ``assign=True`` (it would
replace the engine's parameters), tensor-parallel (DTensor) and expert-parallel parameters (their state dict values
are not whole tensors).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from .errors import UsageError
from .utils import set_whole_value, states_in_memory_of
from .zero.partition import sharded_param_of
from .zero.tensor_parallel import is_dtensor

__all__ = ["LoadStateDictHooks"]


class LoadStateDictHooks:
    """A pre- and a post-hook on every module of ``engine.module``; ``remove()`` (destroy).

    [Note: the writes wait for the end of the load] The pre-hooks take the parameters' values out of the state dict;
    the post-hook of the module ``load_state_dict`` was called on (the one whose pre-hook saw the prefix ``""``; its
    post-hook runs after every child's) writes them all, inside one ``states_in_memory_of`` (under NVMe offload a
    read of every state in and back out: once per load, not once per parameter), and only when the load reported no
    error, so a refused load changes none of the engine's state. A new load (prefix ``""`` again) drops whatever an
    aborted one (a hook that raised) left."""

    def __init__(self, engine) -> None:
        self.engine = weakref.ref(engine)  # the model's hooks must not keep a dropped engine alive
        self.root: nn.Module | None = None  # the module the load in progress was called on
        self.values: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (parameter, value), to write
        self.errors: list = []  # the load's error_msgs
        self.handles = []
        for module in engine.module.modules():
            self.handles.append(module.register_load_state_dict_pre_hook(self._take))
            self.handles.append(module.register_load_state_dict_post_hook(self._finish))

    def __reduce__(self):
        """A copy or pickle of the model gets hooks that leave its loads to torch: see [Note: a copy of the model]
        in zero/hooks.py (the engine's weak reference would otherwise be shared with the copy)."""
        return _inert_load_hooks, ()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _take(self, module: nn.Module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
              error_msgs) -> None:
        engine = self.engine()
        if engine is None:  # garbage-collected without destroy(): torch's load alone
            return
        if prefix == "":  # a new load: see [Note: the writes wait for the end of the load]
            self.root, self.values, self.errors = module, {}, error_msgs
        for name, param in module.named_parameters(recurse=False):
            key = prefix + name
            if key not in state_dict:
                continue
            _refuse_unsupported(engine, key, param, local_metadata)
            value = state_dict.pop(key)
            sp = sharded_param_of(param) if engine.stage > 0 else None
            shape = tuple(sp.shape) if sp is not None else tuple(param.shape)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                found = f"shape {torch.Size(value.shape)}" if isinstance(value, torch.Tensor) else type(value)
                error_msgs.append(f"size mismatch for {key}: copying a param with {found} from checkpoint, the "
                                  f"shape in current model is {torch.Size(shape)}.")
            self.values[key] = (param, value)

    def _finish(self, module: nn.Module, incompatible_keys) -> None:
        # torch listed the keys taken out as missing
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in self.values]
        engine = self.engine()
        if module is not self.root or engine is None:
            return
        values, errors = self.values, self.errors
        self.root, self.values, self.errors = None, {}, []
        if errors or not values:  # torch raises for the errors after this hook: nothing written
            return
        with states_in_memory_of(next(iter(values.values()))[0]):  # NVMe optimizer offload: masters read in
            for key, (param, value) in values.items():
                set_whole_value(engine, param, value, f"load_state_dict {key}")


def _inert_load_hooks() -> LoadStateDictHooks:
    inert = object.__new__(LoadStateDictHooks)
    inert.engine, inert.root, inert.values, inert.errors, inert.handles = _no_engine, None, {}, [], []
    return inert


def _no_engine() -> None:
    return None


def _refuse_unsupported(engine, key: str, param: torch.Tensor, local_metadata: dict) -> None:
    if local_metadata.get("assign_to_params_buffers", False):
        raise UsageError(f"load_state_dict(assign=True) on a model trained by zero_engine ({key}): it would replace "
                         "the engine's parameters with the state dict's tensors. Call load_state_dict without assign")
    why = ("a tensor-parallel (DTensor) parameter" if is_dtensor(param)
           else "an expert-parallel parameter" if id(param) in engine.shard_groups else None)
    if why is not None:
        raise NotImplementedError(
            f"load_state_dict after initialize: {key} is {why}; loading it is not supported yet. Load the weights "
            "before initialize (or inside zero_engine.zero.Init), or use engine.load_checkpoint / "
            "zero_engine.hf.from_pretrained")
