"""Offline: a plain fp32 state dict from a sharded checkpoint, with no ranks and no torch.distributed.

    from zero_engine.checkpoint import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("checkpoints")          # the tag in `latest`
    model.load_state_dict(state_dict)

    zero-engine to-fp32 checkpoints model.safetensors       # the same from the command line

Each parameter is assembled from its saved shards at whatever world size they were written, from the fp32 master
where one was saved (16-bit training) and otherwise from the saved values (fp32 training, frozen parameters).
Tied parameters appear under every name ``model.state_dict()`` has (the same tensor). Parameters are read one at a
time straight into their output tensor: building the dict needs the fp32 model once, and writing safetensors
streams parameter by parameter (one parameter in memory at a time).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Iterator, NamedTuple

import torch
import torch.nn as nn

from ._atomic import private_temporary, resolve_checkpoint
from ._errors import CheckpointError
from ._metadata import CheckpointMeta, read_metadata
from ._reader import CheckpointReader, verify_files
from ._tensorfile import TensorFileWriter

log = logging.getLogger("zero_engine.checkpoint")

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict", "verify_checkpoint", "ConversionResult"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ConversionResult(NamedTuple):
    path: str
    format: str  # "torch" or "safetensors"
    tensors: int  # distinct tensors written (tied names share one)
    nbytes: int  # bytes of tensor data


def locate_checkpoint(checkpoint_dir, tag: str | None) -> str:
    located = resolve_checkpoint(checkpoint_dir, tag)
    if located is None:
        raise CheckpointError(f"{os.path.abspath(os.fspath(checkpoint_dir))} holds no 'latest' file and no "
                              "metadata.json: pass the directory given to save_checkpoint (or a checkpoint "
                              "directory itself), and tag= if it has no 'latest'")
    return located[0]


def verify_checkpoint(checkpoint_dir, tag: str | None = None) -> CheckpointMeta:
    """Check every file of a checkpoint (size and SHA-256); raises CheckpointError naming the first bad file."""
    path = locate_checkpoint(checkpoint_dir, tag)
    meta = read_metadata(path)
    verify_files(path, meta)
    return meta


def _fp32_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _FLOATS else dtype


def checkpoint_entries(reader: CheckpointReader) -> Iterator[tuple[str, str, torch.dtype, tuple[int, ...]]]:
    """(name, kind, output dtype, shape) of every distinct tensor, in state-dict order."""
    saved_param = {p.name: p for p in reader.meta.params}
    saved_buffer = {b.name: b for b in reader.meta.buffers}
    for key, kind, name in reader.meta.state_dict_keys:
        if key != name:
            continue  # a tied name: the same tensor as `name`
        if kind == "param":
            source = "master" if reader.has("master", name) else "param"
            dtype = _fp32_dtype(reader.file(0).entry(f"{source}/{name}").dtype)
            yield name, source, dtype, saved_param[name].shape
        else:
            dtype = _fp32_dtype(reader.file(0).entry(f"buffer/{name}").dtype)
            yield name, "buffer", dtype, saved_buffer[name].shape


def _read(reader: CheckpointReader, name: str, source: str, dtype: torch.dtype) -> torch.Tensor:
    if source == "buffer":
        return reader.file(0).read(f"buffer/{name}").to(dtype)
    return reader.read_whole(source, name, dtype)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag: str | None = None,
                                             verify: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter whole, in fp32, plus persistent buffers: what ``model.state_dict()`` would hold.

    Args:
        checkpoint_dir: the directory given to save_checkpoint (``latest`` names the tag), or a checkpoint
            directory itself.
        tag: a checkpoint other than the latest.
        verify: check every file's size and SHA-256 first (reads the optimizer states too; about a second per GB).
    """
    path = locate_checkpoint(checkpoint_dir, tag)
    with CheckpointReader(path) as reader:
        if verify:
            verify_files(path, reader.meta)
        tensors = {name: _read(reader, name, source, dtype) for name, source, dtype, _ in checkpoint_entries(reader)}
        return {key: tensors[name] for key, _, name in reader.meta.state_dict_keys}


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir, tag: str | None = None,
                                         strict: bool = True) -> nn.Module:
    """Load the consolidated fp32 weights into a plain (unpartitioned) ``model``; returns the model."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model.load_state_dict(state_dict, strict=strict)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output: str, tag: str | None = None,
                                               fmt: str | None = None, verify: bool = True) -> ConversionResult:
    """Write the consolidated fp32 state dict to ``output`` as a torch file or as safetensors.

    ``fmt``: "torch" or "safetensors"; default from the suffix (``.safetensors`` or not). Safetensors output is
    written by zero_engine itself (the package is not needed) one parameter at a time; it cannot hold two names
    for one tensor, so tied names are listed in its metadata (``zero_engine.aliases``) and left out of the tensors.
    The file appears under its name only when complete (written to a temporary of this writer's own, fsynced,
    renamed), so several processes may convert into the same ``output`` at once (every rank, as DeepSpeed's scripts
    do): each writes the same bytes and the file is always whole.
    """
    fmt = fmt or ("safetensors" if str(output).endswith(".safetensors") else "torch")
    if fmt not in ("torch", "safetensors"):
        raise ValueError(f"fmt={fmt!r}: use 'torch' or 'safetensors'")
    path = locate_checkpoint(checkpoint_dir, tag)
    output = os.path.abspath(os.fspath(output))
    with CheckpointReader(path) as reader, private_temporary(output) as tmp:
        if verify:
            verify_files(path, reader.meta)
        entries = list(checkpoint_entries(reader))
        nbytes = sum(torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
                     for _, _, dtype, shape in entries)
        if fmt == "safetensors":
            aliases = {key: name for key, _, name in reader.meta.state_dict_keys if key != name}
            writer = TensorFileWriter(tmp, [(name, dtype, shape) for name, _, dtype, shape in entries],
                                      {"format": "pt", "zero_engine.aliases": json.dumps(aliases)})
            try:
                for name, source, dtype, _ in entries:
                    writer.add(name, _read(reader, name, source, dtype))
            except BaseException:
                writer.abort()
                raise
            writer.close()
        else:
            tensors = {name: _read(reader, name, source, dtype) for name, source, dtype, _ in entries}
            with open(tmp, "wb") as f:
                torch.save({key: tensors[name] for key, _, name in reader.meta.state_dict_keys}, f)
                f.flush()
                os.fsync(f.fileno())
    log.info("wrote %s (%s, %d tensors, %.1f MiB of fp32 weights)", output, fmt, len(entries), nbytes / 2**20)
    return ConversionResult(output, fmt, len(entries), nbytes)
