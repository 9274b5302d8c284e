"""Reading and validating a safetensors header before any tensor byte is trusted.

[Note: what a valid header is]
The rules are safetensors' own (``safetensors`` refuses a file that breaks any of them, and so does transformers):

* the file starts with an 8-byte little-endian header length N, at most 100,000,000, and ``8 + N`` is within the
  file (a corrupt length field would otherwise ask for terabytes: a bare MemoryError on every rank);
* the header is UTF-8 JSON: an object whose keys are unique; ``__metadata__``, if present, maps strings to strings;
  every other key is a tensor with a known ``dtype``, a ``shape`` of non-negative integers and ``data_offsets``
  ``[begin, end]`` relative to the data section (which starts right after the header);
* ``end - begin`` is exactly ``numel x dtype size`` (a shorter range would read into the next tensor);
* sorted by offset, the tensors tile the data section exactly: each begins where the previous one ended, the first
  at 0, the last at the end of the file. So no two tensors share bytes (k_proj pointing at q_proj's bytes), no
  range runs past the file (a truncated file is refused at open, on every rank reading it, not mid-load), and no
  bytes are unaccounted for.

A violation raises ``InvalidSafetensorsError`` naming the file and the tensor, before anything is read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

__all__ = ["InvalidSafetensorsError", "SafetensorsHeader", "HeaderTensor", "read_header", "MAX_HEADER_BYTES",
           "DTYPE_BITS"]

MAX_HEADER_BYTES = 100_000_000  # safetensors' MAX_HEADER_SIZE

# Every dtype safetensors knows, with its size in bits (sub-byte types pack several elements per byte).
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}


class InvalidSafetensorsError(ValueError):
    """A .safetensors file whose header is corrupt or inconsistent (see [Note: what a valid header is])."""


@dataclass(frozen=True)
class HeaderTensor:
    key: str
    dtype: str  # safetensors' name ("F32")
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    metadata: dict[str, str]
    data_start: int  # file offset of the data section
    tensors: dict[str, HeaderTensor]


def read_header(path: str, fd: int) -> SafetensorsHeader:
    """The validated header of the safetensors file open as ``fd`` (``path`` names it in errors)."""
    def invalid(problem: str) -> InvalidSafetensorsError:
        return InvalidSafetensorsError(f"zero_engine.hf: {path} is not a valid safetensors file: {problem}. "
                                       "Re-download or re-save the checkpoint")

    file_size = os.fstat(fd).st_size
    if file_size < 8:
        raise invalid(f"it has {file_size} bytes, fewer than the 8-byte header length")
    header_len = int.from_bytes(os.pread(fd, 8, 0), "little")
    if header_len > MAX_HEADER_BYTES:
        raise invalid(f"its header length field says {header_len} bytes, more than safetensors' limit of "
                      f"{MAX_HEADER_BYTES}")
    if 8 + header_len > file_size:
        raise invalid(f"its header length field says {header_len} bytes, past the end of the file ({file_size} "
                      "bytes; truncated file?)")
    raw = _pread_all(fd, header_len, 8)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise invalid(f"its header is not UTF-8 ({e.reason} at byte {8 + e.start})") from None
    except ValueError as e:
        raise invalid(f"its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise invalid(f"its header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise invalid("its __metadata__ is not an object of strings")
    tensors = {key: _tensor(key, info, invalid) for key, info in header.items()}
    data_size = file_size - 8 - header_len
    _check_tiling(sorted(tensors.values(), key=lambda t: (t.begin, t.end)), data_size, invalid)
    return SafetensorsHeader(metadata, 8 + header_len, tensors)


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        repeated = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"key {repeated!r} appears twice")
    return dict(pairs)


def _tensor(key: str, info, invalid) -> HeaderTensor:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise invalid(f"tensor {key!r}: expected an object with dtype, shape and data_offsets, got {info!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise invalid(f"tensor {key!r} has dtype {dtype!r}, which is not a safetensors dtype")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise invalid(f"tensor {key!r} has shape {shape!r}: expected a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise invalid(f"tensor {key!r} has data_offsets {offsets!r}: expected [begin, end], non-negative integers")
    begin, end = offsets
    if begin > end:
        raise invalid(f"tensor {key!r} has data_offsets [{begin}, {end}]: begin after end")
    numel = 1
    for s in shape:
        numel *= s
    bits = numel * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        raise invalid(f"tensor {key!r} ({dtype}, shape {shape}) needs {bits / 8:g} bytes but its data_offsets "
                      f"[{begin}, {end}] hold {end - begin}")
    return HeaderTensor(key, dtype, tuple(shape), begin, end)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tiling(tensors: list[HeaderTensor], data_size: int, invalid) -> None:
    """Each tensor begins where the previous one ended, and the last ends with the file. Overlaps and ranges past
    the file are looked for first: they say more than the gap they leave elsewhere."""
    for previous, t in zip(tensors, tensors[1:]):
        if t.begin < previous.end:
            raise invalid(f"tensor {t.key!r} (bytes [{t.begin}, {t.end}) of the data section) overlaps tensor "
                          f"{previous.key!r} (bytes [{previous.begin}, {previous.end}))")
    for t in tensors:
        if t.end > data_size:
            raise invalid(f"tensor {t.key!r} (bytes [{t.begin}, {t.end}) of the data section) runs past the end of "
                          f"the file: the data section has {data_size} bytes (truncated file?)")
    position, previous = 0, None
    for t in tensors:
        if t.begin != position:
            after = f"after tensor {previous.key!r}" if previous else "at the start of the data section"
            raise invalid(f"tensor {t.key!r} begins at byte {t.begin} of the data section, leaving bytes "
                          f"[{position}, {t.begin}) {after} unaccounted for")
        previous, position = t, t.end
    if position != data_size:
        raise invalid(f"its data section has {data_size} bytes but the tensors cover {position} (bytes after the "
                      "last tensor)")


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    parts, done = [], 0
    while done < n:
        chunk = os.pread(fd, n - done, offset + done)
        if not chunk:
            break
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)
