"""resize_token_embeddings on a model whose parameters are partitioned (from_pretrained, zero.Init).

transformers' ``resize_token_embeddings`` reads the old embedding's shape and rows and builds whole new modules. It
knows partitioned parameters only through DeepSpeed (``is_deepspeed_zero3_enabled()``), so on ours it read a
released parameter (0 elements) and failed with "not enough values to unpack". This runs transformers' own resize
with the old embedding, head and head bias gathered, so the copied rows, the new rows' init (``mean_resizing`` too)
and the tying are transformers'; the new whole parameters are then partitioned as ``zero.Init(module=...)`` does,
with rank 0's values on every rank (the ranks' RNG may differ). A 16-bit model keeps its fp32 masters: see
[Note: the masters of resized rows].

Before ``initialize()`` only: the engine's optimizer, buckets and units were built on the old parameters, so a
resize after it is refused by name, at every stage (``destroy()`` the engine, or resize first).
"""

from __future__ import annotations

import torch
from torch import nn

from .._instance_methods import install_bound_wrapper, wrapped
from ..comm import Communicator
from ..errors import UsageError
from ..guards import engine_of
from ..zero.gathered import GatheredParameters
from ..zero.init import Init
from ..zero.partition import ShardedParam, sharded_param_of

__all__ = ["install_resize_token_embeddings", "resize_token_embeddings"]


def install_resize_token_embeddings(model: nn.Module) -> None:
    """Make ``model.resize_token_embeddings`` this one (a transformers model: it has the method; else nothing)."""
    if callable(getattr(model, "resize_token_embeddings", None)):
        install_bound_wrapper(model, "resize_token_embeddings", resize_token_embeddings)


def resize_token_embeddings(self: nn.Module, *args, **kwargs):
    """transformers' ``resize_token_embeddings(new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True)``
    on a model whose parameters may be partitioned; collective when they are (call it on every rank)."""
    if engine_of(self) is not None:
        raise UsageError(
            "resize_token_embeddings() after zero_engine.initialize(): the engine's optimizer, gradient buckets and "
            "gather units were built on the old embedding, which it would keep training. Resize before initialize "
            "(zero_engine.hf.from_pretrained(...), then model.resize_token_embeddings(n), then initialize), or "
            "destroy() the engine first and initialize a new one")
    resize = wrapped(self, resize_token_embeddings, "resize_token_embeddings")
    old = _embedding_tensors(self)
    partitioned = [sharded_param_of(p) for p in old.values() if sharded_param_of(p) is not None]
    if not partitioned:
        return resize(*args, **kwargs)  # whole parameters: transformers' own, as it is
    comm = Communicator()
    try:
        masters = {role: _whole_master(sharded_param_of(p), comm) for role, p in old.items()}
        with GatheredParameters([sp.param for sp in partitioned], _comm=comm):
            whole = {sp: sp.param.data for sp in partitioned}
            result = resize(*args, **kwargs)
            resized = {}
            for sp, data in whole.items():
                if sp.param.data_ptr() != data.data_ptr():  # resized in place: transformers set .data to the new
                    resized[sp] = sp.param.data  # tensor (an Embedding keeps its class and hooks so)
                    sp.param.data = data  # released as it was gathered; the new tensor becomes a new parameter
        for sp, data in resized.items():
            _replace_parameter(self, sp.param, nn.Parameter(data, requires_grad=sp.param.requires_grad))
        dtypes = {}
        for role, param in _embedding_tensors(self).items():
            master = masters.get(role)
            if sharded_param_of(param) is None and master is not None:
                dtypes[id(param)] = param.dtype
                param.data = _with_exact_rows(param.detach(), master)
        Init(module=self)  # the new whole parameters: rank 0's values, partitioned (fp32 where a master was)
        for param in self.parameters():
            if id(param) in dtypes:
                sharded_param_of(param).cast_(dtypes[id(param)])  # the exact fp32 values become its master
    finally:
        comm.close()
    return result


def _replace_parameter(model: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """``new`` in place of ``old`` under every name (a tied head shares it)."""
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is old:
                module._parameters[key] = new


def _embedding_tensors(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters a resize replaces, by role (a tied head is the embedding: listed once)."""
    found: dict[str, nn.Parameter] = {}
    inputs = model.get_input_embeddings()
    outputs = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if inputs is not None:
        found["input"] = inputs.weight
    if outputs is not None and outputs.weight is not found.get("input"):
        found["output"] = outputs.weight
    if outputs is not None and getattr(outputs, "bias", None) is not None:
        found["output bias"] = outputs.bias
    return found


# [Note: the masters of resized rows]
# A 16-bit model from from_pretrained (or zero.Init) holds each trainable parameter's fp32 value next to its shard
# (ShardedParam.master_init: the file's exact fp32 values when the checkpoint is fp32), and initialize() starts the
# optimizer's masters from it. transformers copies the old rows in the 16-bit dtype, so the rows kept by a resize
# are given their fp32 values back before the new parameter is partitioned (in fp32, then cast_ keeps those values
# as its master); the new rows' values are transformers' init in the 16-bit dtype, exact in fp32 too.
def _whole_master(sp: ShardedParam | None, comm: Communicator) -> torch.Tensor | None:
    """The whole fp32 value of ``sp``'s master (collective), or None without one."""
    if sp is None or sp.master_init is None:
        return None
    out = torch.empty(sp.padded_numel, dtype=torch.float32, device=sp.compute_device)
    comm.all_gather_into_tensor(out, sp.master_init.to(out.device).contiguous(), name=f"resize {sp.fqn}").wait()
    return out[: sp.numel].view(sp.shape)


def _with_exact_rows(new: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """``new`` in fp32, its leading rows (those transformers copied from the old tensor) from ``master``."""
    exact = new.float()
    kept = min(new.shape[0], master.shape[0])
    exact[:kept] = master[:kept].to(exact.device)
    return exact
