"""``model.load_state_dict(sd)`` after ``initialize``: the loaded values reach the engine's shards and fp32 masters.

    engine, *_ = zero_engine.initialize(model=model, config=config)
    model.load_state_dict(torch.load("weights.pt"))       # every rank loads the whole state dict, at every stage

Left to torch alone, the load copies into the parameters only. At stages 1-2 (and at stage 0 in 16-bit training)
the next step then writes the parameters over from the fp32 masters the load never reached, and the loaded weights
are silently lost, as in DeepSpeed; at stage 3 the parameters hold no data (shape ``[0]``) and torch refuses every
key with "size mismatch". So the engine puts a pre-hook on each module that owns parameters: it takes each of that
module's parameters out of the state dict and writes the value into the master, this rank's shard and, where the
parameter is whole, the parameter (``set_whole_value`` in zero_engine/utils, as ``safe_set_full_fp32_param``;
nothing is exchanged, as every rank holds the whole state dict). A post-hook then takes those keys out of
``missing_keys``, where torch put them because they were no longer in the state dict. Buffers are torch's to load,
as they are whole on every rank. A value of the wrong shape is reported as torch reports it, with the parameter's
whole shape. Refused with the reason: ``assign=True`` (it would replace the engine's parameters), tensor-parallel
(DTensor) and expert-parallel parameters (their state dict values are not whole tensors).
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
    """The pre- and post-hooks on every module of ``engine.module`` that owns parameters; ``remove()`` (destroy)."""

    def __init__(self, engine) -> None:
        self.engine = weakref.ref(engine)  # the model's hooks must not keep a dropped engine alive
        self.handles = []
        for module in engine.module.modules():
            if any(True for _ in module.parameters(recurse=False)):
                taken: set[str] = set()  # this module's keys, from its pre-hook to its post-hook
                self.handles.append(module.register_load_state_dict_pre_hook(self._pre_hook(taken)))
                self.handles.append(module.register_load_state_dict_post_hook(self._post_hook(taken)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _pre_hook(self, taken: set[str]):
        engine_ref = self.engine

        def hook(module: nn.Module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs) -> None:
            engine = engine_ref()
            if engine is None:  # garbage-collected without destroy(): torch's load alone
                return
            for name, param in module.named_parameters(recurse=False):
                key = prefix + name
                if key not in state_dict:
                    continue
                _refuse_unsupported(engine, key, param, local_metadata)
                value = state_dict.pop(key)
                taken.add(key)
                sp = sharded_param_of(param) if engine.stage > 0 else None
                shape = tuple(sp.shape) if sp is not None else tuple(param.shape)
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                    found = f"shape {torch.Size(value.shape)}" if isinstance(value, torch.Tensor) else type(value)
                    error_msgs.append(f"size mismatch for {key}: copying a param with {found} from checkpoint, the "
                                      f"shape in current model is {torch.Size(shape)}.")
                    continue
                with states_in_memory_of(param):  # NVMe optimizer offload: the masters read in
                    set_whole_value(engine, param, value, f"load_state_dict {key}")

        return hook

    @staticmethod
    def _post_hook(taken: set[str]):
        def hook(module: nn.Module, incompatible_keys) -> None:
            incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in taken]
            taken.clear()

        return hook


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
