"""``deepspeed.utils.zero_to_fp32``'s entry points, with DeepSpeed's signatures, over zero_engine.checkpoint.

    from zero_engine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("checkpoints")      # offline, no ranks

They read zero_engine's sharded checkpoints (DeepSpeed's own checkpoint files are a different format and are not
read). zero_engine.checkpoint has the same functions with zero_engine's arguments (file output, verification).
"""

from __future__ import annotations

import os
import re

import torch
import torch.nn as nn

from ..checkpoint import _consolidate

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint"]

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _refuse(condition: bool, what: str, why: str) -> None:
    if condition:
        raise NotImplementedError(f"zero_to_fp32: {what} is not supported by zero_engine: {why}")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False) -> dict:
    """Every parameter whole in fp32, plus persistent buffers, from a checkpoint directory (``latest`` names the tag
    unless ``tag`` is given)."""
    _refuse(exclude_frozen_parameters, "exclude_frozen_parameters=True", "frozen parameters are always included")
    _refuse(lazy_mode, "lazy_mode=True", "tensors are read eagerly, one parameter at a time")
    return _consolidate.get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """Write ``output_dir/pytorch_model.bin`` (or ``model.safetensors`` with ``safe_serialization=True``).

    One file only: a model whose fp32 weights exceed ``max_shard_size`` is refused (zero_engine does not split the
    output into shards); pass a larger ``max_shard_size``."""
    _refuse(exclude_frozen_parameters, "exclude_frozen_parameters=True", "frozen parameters are always included")
    limit = _parse_size(max_shard_size)
    path = _consolidate.locate_checkpoint(checkpoint_dir, tag)
    with _consolidate.CheckpointReader(path) as reader:
        total = sum(_nbytes(dtype, shape) for _, _, dtype, shape in _consolidate.checkpoint_entries(reader))
    _refuse(total > limit, f"max_shard_size={max_shard_size!r} for {total} bytes of weights",
            "the output is written as one file, not split into shards; pass a max_shard_size of at least "
            f"{total} bytes")
    os.makedirs(output_dir, exist_ok=True)
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    return _consolidate.convert_zero_checkpoint_to_fp32_state_dict(
        checkpoint_dir, os.path.join(output_dir, name), tag=tag,
        fmt="safetensors" if safe_serialization else "torch")


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir, tag=None) -> nn.Module:
    """Load the consolidated fp32 weights into a plain (unpartitioned) ``model`` on the CPU; returns the model."""
    return _consolidate.load_state_dict_from_zero_checkpoint(model.cpu(), checkpoint_dir, tag)


def _nbytes(dtype, shape) -> int:
    return torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not match:
        raise ValueError(f"max_shard_size={size!r}: expected bytes (int) or a size such as '5GB' or '500MiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])
