"""Reading a Hugging Face checkpoint one tensor range at a time, without loading any file whole.

A checkpoint directory holds one of (transformers' order of preference):
  model.safetensors | model.safetensors.index.json + shards | pytorch_model.bin | pytorch_model.bin.index.json + shards

[Note: reading only this rank's bytes]
A safetensors file is an 8-byte header length, a JSON header (dtype, shape, [begin, end) byte offsets of each tensor)
and the raw row-major data. The flat range ``[start, stop)`` of a tensor is therefore the byte range
``begin + start*itemsize .. begin + stop*itemsize``: a rank reads exactly its shard's bytes with one positioned
read into its shard (or into a bounded staging buffer when the file's dtype differs), no mmap, so nothing but the
shard enters the process. The header is validated first, by safetensors' rules (see [Note: what a valid header
is] in _header.py), so a lying offset can never read another tensor's bytes. A ``.bin`` is a zip of pickled
storages: it is opened with ``torch.load(mmap=True)``, which maps the file and materialises nothing; slicing a
tensor touches only the pages of that slice. Those pages are file-backed: they count in RSS while the file stays
mapped, and the kernel may drop them at any time, as for the page cache; each .bin shard is unmapped once its
tensors were read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ._header import read_header

__all__ = ["CheckpointFiles", "find_checkpoint", "TensorEntry", "open_tensor_file"]

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_STAGING_BYTES = 16 << 20  # a dtype-converting read goes through a buffer of at most this size


@dataclass(frozen=True)
class CheckpointFiles:
    """The weight files of a checkpoint directory: ``key_to_file`` maps each tensor name to its file."""
    directory: str
    files: list[str]
    fmt: str  # "safetensors" | "bin"
    sharded: bool


def find_checkpoint(directory: str, use_safetensors: bool | None = None) -> CheckpointFiles:
    """The weight files in ``directory``, safetensors first unless ``use_safetensors=False`` (as transformers)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"zero_engine.hf: {directory!r} is not a local directory. zero_engine.hf loads from disk "
                         "only; download the model first (e.g. `huggingface-cli download <repo> --local-dir DIR`).")
    candidates = []
    if use_safetensors is not False:
        candidates += [(SAFE_WEIGHTS, "safetensors", False), (SAFE_INDEX, "safetensors", True)]
    if use_safetensors is not True:
        candidates += [(BIN_WEIGHTS, "bin", False), (BIN_INDEX, "bin", True)]
    for name, fmt, sharded in candidates:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        if not sharded:
            return CheckpointFiles(directory, [path], fmt, False)
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({os.path.join(directory, fname) for fname in weight_map.values()})
        for fpath in files:
            if not os.path.isfile(fpath):
                raise FileNotFoundError(f"zero_engine.hf: {path} names the shard {os.path.basename(fpath)}, "
                                        f"which is not in {directory}")
        return CheckpointFiles(directory, files, fmt, True)
    wanted = ", ".join(name for name, _, _ in candidates)
    raise FileNotFoundError(f"zero_engine.hf: no weights in {directory} (looked for {wanted})")


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class _SafetensorsFile:
    """Positioned reads of tensor ranges from one .safetensors file (see [Note: reading only this rank's bytes])."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "rb", buffering=0)
        try:
            header = read_header(path, self._f.fileno())  # see [Note: what a valid header is] in _header.py
        except BaseException:
            self._f.close()
            raise
        self.metadata = header.metadata
        self._data_start = header.data_start
        self._offsets = {}
        self.entries: dict[str, TensorEntry] = {}
        for key, tensor in header.tensors.items():
            if tensor.dtype not in _SAFETENSORS_DTYPES:
                self._f.close()
                raise NotImplementedError(f"zero_engine.hf: {path}: tensor {key} has dtype {tensor.dtype}, "
                                          f"which is not supported (supported: {', '.join(_SAFETENSORS_DTYPES)})")
            self.entries[key] = TensorEntry(key, _SAFETENSORS_DTYPES[tensor.dtype], tensor.shape)
            self._offsets[key] = tensor.begin

    def read_into(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of the flattened tensor ``key``, cast into ``out`` (``stop - start`` long)."""
        entry = self.entries[key]
        itemsize = entry.dtype.itemsize
        pos = self._data_start + self._offsets[key] + start * itemsize
        if out.dtype == entry.dtype and out.is_contiguous() and out.device.type == "cpu":  # else staged (GPU shards)
            self._readinto(pos, out.view(torch.uint8))
            return
        step = max(1, _STAGING_BYTES // itemsize)
        staging = torch.empty(min(step, stop - start), dtype=entry.dtype)
        for lo in range(0, stop - start, step):
            n = min(step, stop - start - lo)
            self._readinto(pos + lo * itemsize, staging[:n].view(torch.uint8))
            out[lo: lo + n].copy_(staging[:n])

    def _readinto(self, pos: int, dest: torch.Tensor) -> None:
        view = memoryview(dest.numpy()).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self._f.fileno(), [view[done:]], pos + done)
            if n <= 0:
                raise OSError(f"zero_engine.hf: {self.path} ended early (truncated file?) at byte {pos + done}")
            done += n

    def close(self) -> None:
        self._f.close()


class _TorchBinFile:
    """A pytorch_model.bin mapped with ``torch.load(mmap=True)``: tensors are materialised one slice at a time."""

    def __init__(self, path: str):
        self.path = path
        self._state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        self.metadata = {}
        self.entries = {key: TensorEntry(key, t.dtype, tuple(t.shape)) for key, t in self._state.items()
                        if isinstance(t, torch.Tensor)}

    def read_into(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        tensor = self._state[key]
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)  # a tied alias may be a view
        out.copy_(flat[start:stop])

    def close(self) -> None:
        self._state = None


def open_tensor_file(path: str, fmt: str):
    return _SafetensorsFile(path) if fmt == "safetensors" else _TorchBinFile(path)
