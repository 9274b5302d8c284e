"""AutoTP: DeepSpeed's ``tensor_parallel.autotp_size``, as torch's tensor parallelism on a DeviceMesh.

    mesh = autotp_mesh(world_size, autotp_size=2, device_type="cuda")   # ("dp", "tp"); consecutive ranks: one tp group
    apply_autotp(model, mesh["tp"])     # the standard plan: q/k/v/gate/up column-wise, o/down row-wise

The plan splits each transformer block's Linears over the ``tp`` ranks with torch's ``parallelize_module``
(Megatron's layout): the Linears that read the block's input (q, k, v, gate, up) keep a slice of their output
features (``ColwiseParallel``), and the Linears that write the block's output (o, down) keep the matching slice of
their input features (``RowwiseParallel``), whose partial results one all-reduce per Linear sums. A tp rank thus
computes ``num_attention_heads / tp`` whole attention heads and ``intermediate_size / tp`` MLP features, and two
all-reduces per block (forward, and two more in backward) are the whole cost. Every split parameter becomes a
DTensor on the tp mesh; ZeRO then shards each one's local tensor over the data-parallel dim. Embeddings, norms and
the LM head are not split: they stay plain tensors, replicated over tp (and sharded by ZeRO over dp).
Module inputs and outputs stay plain tensors (``use_local_output=True``), so the model's own code runs unchanged
on its local slices -- which is why a family is supported only once its attention infers the head count from the
tensor (``view(..., -1, head_dim)``) instead of reading it from the config.

Families (``SUPPORTED_FAMILIES``):
* Hugging Face Llama-shaped causal LMs (``model_type`` llama, mistral, qwen2: ``LlamaForCausalLM``,
  ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and their base / task-head classes). The plan is transformers' own
  (``config.base_model_tp_plan``, which also drives ``from_pretrained(tp_plan="auto")``), the standard one
  above when the installed transformers has none.
* zero_engine.testing.models.GPT (the test model): its fused ``qkv`` is split as three column-wise blocks (each rank
  keeps its heads' rows of q, of k and of v), ``fc`` column-wise, the two ``proj`` row-wise.
Any other model is refused by name: apply your own plan with ``parallelize_module`` instead.

[Note: gradients of whole parameters]
A parameter the plan leaves whole (embeddings, norms, LM head as plain tensors; a row-wise Linear's bias as a
Replicate DTensor) gets the same, complete gradient on every tp rank: tp ranks compute differently only inside a
split region, and torch sums the gradient of that region's replicated input over tp (the backward of
``DTensor.from_local``) before it reaches anything outside. So whole parameters need no tp reduction -- but a global
gradient norm must count them once, not tp times. This holds only while no whole parameter is used inside a split
region: Qwen3's per-head q_norm / k_norm are (each rank would see the gradient of its own heads only), which is why
Qwen3 is not in the family yet.

[Note: why the heads must divide]
A column-wise split is a split of features; for q/k/v it must also be a split of heads, or a rank would hold half
a head and attend with it. ``num_attention_heads`` and ``num_key_value_heads`` must each be divisible by the tp size
(each rank keeps whole query heads and the key/value heads they share, so grouped-query attention keeps its
ratio); ``intermediate_size`` too. The hidden size is never split by this plan, so it need not divide.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Callable

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
# _StridedShard is the placement torch's own FSDP2 + TP and transformers' packed styles use for "a slice of each
# block": no public name exists for it yet.
from torch.distributed.tensor.placement_types import _StridedShard

from .errors import ConfigError

__all__ = ["apply_autotp", "autotp_plan", "autotp_mesh", "PackedColwiseParallel", "SUPPORTED_FAMILIES", "KEY"]

KEY = "tensor_parallel.autotp_size"
DP, TP = "dp", "tp"
HF_LLAMA_FAMILY = ("llama", "mistral", "qwen2")  # model_type values, checked by tests/test_autotp.py
SUPPORTED_FAMILIES = ("Hugging Face " + " / ".join(HF_LLAMA_FAMILY) + " (LlamaForCausalLM, MistralForCausalLM, "
                      "Qwen2ForCausalLM and their base and task-head classes)",
                      "zero_engine.testing.models.GPT")

# transformers' Llama plan, for a transformers too old to carry config.base_model_tp_plan.
_STANDARD_LLAMA_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}


class PackedColwiseParallel(ParallelStyle):
    """Column-wise split of a Linear whose output packs ``parts`` equal blocks (a fused q|k|v projection).

    A plain ``ColwiseParallel`` would hand rank 0 the first rows of the packed weight: all of q and part of k.
    Here each rank keeps its slice of every block (placement ``_StridedShard(0, split_factor=parts)``), so its
    output is ``[q_r | k_r | v_r]``: the same packing, over its own heads. ``full_tensor()`` gives back the packed
    weight in its original order. The input is replicated over tp; its gradient is summed over tp by torch (the
    backward of ``DTensor.from_local``), as for ColwiseParallel."""

    def __init__(self, parts: int, *, use_local_output: bool = True):
        super().__init__()
        if parts < 1:
            raise ValueError(f"PackedColwiseParallel: parts={parts}; expected the number of packed blocks (>= 1)")
        self.parts = parts
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"PackedColwiseParallel splits nn.Linear only, got {type(module).__name__}")
        placement = _StridedShard(0, split_factor=self.parts)

        def partition(name, mod, mesh):
            for param_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                                requires_grad=param.requires_grad))

        def prepare_input(mod, inputs, mesh):
            x = inputs[0]
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False) if not isinstance(x, DTensor) else x

        def prepare_output(mod, output, mesh):
            return output.to_local() if self.use_local_output else output

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)


def autotp_mesh(world: int, autotp_size: int, device_type: str) -> DeviceMesh:
    """The ("dp", "tp") DeviceMesh of ``tensor_parallel.autotp_size``: dp outer, tp inner, so consecutive ranks
    form a tp group (as DeepSpeed's AutoTP and Megatron lay them out: a tp group stays within a node, where its
    per-layer all-reduces are cheapest). ``autotp_size`` 0 (DeepSpeed's off) means 1. Collective: every rank calls
    it."""
    if isinstance(autotp_size, bool) or not isinstance(autotp_size, int) or autotp_size < 0:
        raise ConfigError(f"{KEY}: {autotp_size!r}; expected a non-negative integer (ranks per tensor-parallel "
                          "group; 0 or 1: off)")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"autotp_mesh: world={world!r}; expected the number of ranks (a positive integer)")
    tp = max(autotp_size, 1)
    if world % tp:
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise ConfigError(f"{KEY}: {tp} does not divide the world of {world} ranks; use one of {divisors} "
                          "(ranks per tensor-parallel group, usually GPUs per node or fewer)")
    if dist.is_initialized() and dist.get_world_size() != world:
        raise ValueError(f"autotp_mesh: world={world}, but torch.distributed's world has {dist.get_world_size()} "
                         "ranks; pass dist.get_world_size()")
    return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=(DP, TP))


def apply_autotp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split ``model`` in place over the 1-D ``tp_mesh`` with the standard plan of its family (module docstring),
    after checking that the tp size divides the heads and the split features. Returns the model.

    Split weights are taken from the tp group's first rank (``distribute_tensor`` scatters them); the parameters
    left whole must already be equal on every rank of the group (same seed, same checkpoint, or the engine's initial
    broadcast, which must run before the split: afterwards ranks hold different slices). Every rank of a tp group
    must feed the same batch: the inputs of split Linears are taken as replicated over tp. Raises ConfigError (a ValueError) naming the config attribute or parameter when the sizes do
    not divide, NotImplementedError for a model whose family is not supported."""
    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise ValueError(f"apply_autotp: tp_mesh must be a 1-D DeviceMesh (the tp dim, e.g. autotp_mesh(...)"
                         f"[\"tp\"]), got {tp_mesh!r}")
    plan = autotp_plan(model, tp_mesh.size())
    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, plan)
    return model


def autotp_plan(model: nn.Module, tp_size: int) -> dict[str, ParallelStyle]:
    """The plan ``apply_autotp`` applies (fully qualified module name -> ParallelStyle), checked against
    ``tp_size``; nothing is changed. Raises as ``apply_autotp``."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"{KEY}: {tp_size!r}; expected a positive integer")
    family = _family_of(model)
    if family is None:
        raise NotImplementedError(
            f"{KEY}: AutoTP has no plan for {type(model).__module__}.{type(model).__qualname__}; supported: "
            f"{'; '.join(SUPPORTED_FAMILIES)}. Split another model yourself with torch's parallelize_module "
            "(ColwiseParallel / RowwiseParallel over a mesh's \"tp\" dim) and leave autotp_size at 0")
    patterns, check_heads = family
    check_heads(model, tp_size)
    plan = _expand(model, patterns)
    _check_split_features(model, plan, tp_size)
    return plan


# --- families ------------------------------------------------------------------------------------------------------

def _family_of(model: nn.Module):
    """(plan patterns -> style, head check) of the model's family, or None."""
    test_models = sys.modules.get("zero_engine.testing.models")  # a test GPT means its module is imported
    if test_models is not None and isinstance(model, test_models.GPT):
        return _GPT_PLAN, _check_gpt_heads
    if _is_hf_llama(model):
        return _hf_plan(model), _check_hf_heads
    return None


def _is_hf_llama(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # a transformers model means transformers is imported
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return False
    return getattr(model.config, "model_type", None) in HF_LLAMA_FAMILY


_GPT_PLAN: dict[str, Callable[[], ParallelStyle]] = {
    "blocks.*.attn.qkv": lambda: PackedColwiseParallel(3),
    "blocks.*.attn.proj": RowwiseParallel,
    "blocks.*.mlp.fc": ColwiseParallel,
    "blocks.*.mlp.proj": RowwiseParallel,
}

_HF_STYLES: dict[str, Callable[[], ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def _hf_plan(model: nn.Module) -> dict[str, Callable[[], ParallelStyle]]:
    """transformers' base-model plan, under the base model's prefix in ``model`` ("model." for a ForCausalLM)."""
    config = model.config
    base_plan = getattr(type(config), "base_model_tp_plan", None) or _STANDARD_LLAMA_PLAN
    prefix = "" if model.base_model is model else f"{model.base_model_prefix}."
    plan = {}
    for pattern, style in base_plan.items():
        if style not in _HF_STYLES:
            raise NotImplementedError(
                f"{KEY}: {type(config).__name__}.base_model_tp_plan[{pattern!r}] is {style!r}; AutoTP applies "
                f"{' and '.join(map(repr, _HF_STYLES))} only (this transformers version changed the "
                f"{config.model_type} plan): not supported yet")
        plan[prefix + pattern] = _HF_STYLES[style]
    return plan


def _check_gpt_heads(model: nn.Module, tp: int) -> None:
    _check_divides(tp, {"GPTConfig.n_head": model.cfg.n_head}, "each tp rank computes whole attention heads")


def _check_hf_heads(model: nn.Module, tp: int) -> None:
    config = model.config
    name = type(config).__name__
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    _check_divides(tp, {f"{name}.num_attention_heads": heads, f"{name}.num_key_value_heads": kv_heads,
                        f"{name}.intermediate_size": config.intermediate_size},
                   "each tp rank computes whole query and key/value heads and a slice of the MLP")


def _check_divides(tp: int, sizes: dict[str, int], why: str) -> None:
    """Each size (config attribute -> value) must be a multiple of ``tp``: else a ConfigError naming the attribute
    and the sizes that would fit (see [Note: why the heads must divide])."""
    for attribute, size in sizes.items():
        if size % tp:
            common = math.gcd(*sizes.values())
            fits = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
            shown = ", ".join(f"{a.split('.')[-1]} = {s}" for a, s in sizes.items())
            raise ConfigError(f"{KEY}: {tp} does not divide {attribute} = {size} ({why}); use an autotp_size that "
                              f"divides {shown}: {fits}")


# --- plan expansion and the per-parameter check -------------------------------------------------------------------

def _expand(model: nn.Module, patterns: dict[str, Callable[[], ParallelStyle]]) -> dict[str, ParallelStyle]:
    """Each pattern ("layers.*.mlp.up_proj", * = one name) -> the Linears it names, each with its own style object.
    A pattern that names nothing means the model is not shaped as its family's plan expects: refused."""
    modules = dict(model.named_modules())
    plan: dict[str, ParallelStyle] = {}
    for pattern, make_style in patterns.items():
        regex = re.compile("\\.".join("[^.]+" if atom == "*" else re.escape(atom) for atom in pattern.split(".")))
        names = [name for name in modules if regex.fullmatch(name)]
        if not names:
            raise NotImplementedError(f"{KEY}: {type(model).__name__} has no module matching the plan entry "
                                      f"{pattern!r}: it is not shaped like its family; not supported yet")
        for name in names:
            if not isinstance(modules[name], nn.Linear):
                raise NotImplementedError(f"{KEY}: {name} is a {type(modules[name]).__name__}, the plan splits "
                                          "nn.Linear only; not supported yet")
            plan[name] = make_style()
    return plan


def _check_split_features(model: nn.Module, plan: dict[str, ParallelStyle], tp: int) -> None:
    """The split dim of every planned weight must divide evenly (uneven DTensor shards would break the model's
    reshapes): output features for column-wise, input features for row-wise."""
    modules = dict(model.named_modules())
    for name, style in plan.items():
        linear = modules[name]
        if isinstance(style, RowwiseParallel):
            size, what = linear.in_features, "input features (row-wise split)"
        else:
            parts = style.parts if isinstance(style, PackedColwiseParallel) else 1
            size, what = linear.out_features // parts, ("output features per packed block" if parts > 1
                                                        else "output features") + " (column-wise split)"
        if size % tp:
            raise ConfigError(f"{KEY}: {tp} does not divide the {size} {what} of {name}.weight "
                              f"{tuple(linear.weight.shape)}; use an autotp_size that divides {size}")
