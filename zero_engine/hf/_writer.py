"""Writing safetensors shards tensor by tensor: the header is known before any value, so nothing is held whole.

safetensors puts every tensor's dtype, shape and byte offsets in a JSON header before the data. All of it follows
from the model's metadata (names, shapes, the saved dtype), so the header is written first and each tensor's bytes
are appended as soon as it has been gathered, then dropped: the writer's memory is one tensor. Shards are planned
the way transformers/huggingface_hub plan them: in order, a new file when the next tensor would pass
``max_shard_size`` (a tensor bigger than that gets a file of its own), named ``model-00001-of-0000N.safetensors``
with ``model.safetensors.index.json``, or a single ``model.safetensors``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch

__all__ = ["ShardPlan", "plan_shards", "SafetensorsWriter", "parse_size"]

_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL"}


def parse_size(size: int | str) -> int:
    """``"5GB"`` / ``"500MB"`` / ``"10KiB"`` / an int -> bytes (decimal units as transformers, binary with i)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", size.upper())
    if match is None:
        raise ValueError(f"max_shard_size={size!r}: expected bytes as an int or a size such as '5GB' or '500MB'")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(unit or " "))


@dataclass
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass
class ShardPlan:
    files: list[list[_Entry]] = field(default_factory=list)

    def filenames(self) -> list[str]:
        if len(self.files) == 1:
            return ["model.safetensors"]
        n = len(self.files)
        return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    def index(self) -> dict:
        weight_map = {e.name: fname for fname, entries in zip(self.filenames(), self.files) for e in entries}
        total = sum(e.nbytes for entries in self.files for e in entries)
        return {"metadata": {"total_size": total}, "weight_map": weight_map}


def plan_shards(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_size: int) -> ShardPlan:
    plan, current, size = ShardPlan(), [], 0
    for name, dtype, shape in tensors:
        entry = _Entry(name, dtype, tuple(shape))
        if current and size + entry.nbytes > max_shard_size:
            plan.files.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    plan.files.append(current)
    return plan


class SafetensorsWriter:
    """One .safetensors file: header at open, then ``write(name, tensor)`` in the planned order, then ``close()``.

    Written to ``path + ".tmp"`` and renamed on close, so a crash never leaves a truncated file under the real name.
    """

    def __init__(self, path: str, entries: list[_Entry], metadata: dict[str, str] | None = None):
        self.path = path
        self._expected = list(entries)
        self._next = 0
        header, offset = {}, 0
        for e in entries:
            if e.dtype not in _DTYPE_NAMES:
                raise NotImplementedError(f"save_pretrained: {e.name} has dtype {e.dtype}; safetensors here takes "
                                          f"{', '.join(str(d) for d in _DTYPE_NAMES)}")
            header[e.name] = {"dtype": _DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        header["__metadata__"] = {"format": "pt", **(metadata or {})}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the safetensors library writes it
        self._f = open(path + ".tmp", "wb")
        self._f.write(len(raw).to_bytes(8, "little"))
        self._f.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        entry = self._expected[self._next]
        if name != entry.name or tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise AssertionError(f"save_pretrained: {self.path}: expected {entry.name} {entry.shape} {entry.dtype} "
                                 f"next, got {name} {tuple(tensor.shape)} {tensor.dtype}")
        self._next += 1
        data = tensor.detach().contiguous().view(-1).view(torch.uint8)
        self._f.write(memoryview(data.numpy()))

    def close(self) -> None:
        if self._next != len(self._expected):
            raise AssertionError(f"save_pretrained: {self.path}: {len(self._expected) - self._next} tensors missing")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.path + ".tmp", self.path)

    def abort(self) -> None:
        self._f.close()
        if os.path.exists(self.path + ".tmp"):
            os.remove(self.path + ".tmp")
