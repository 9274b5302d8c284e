"""A file of named tensors in the safetensors layout: written in one pass with its checksum, read by byte range.

Layout (the safetensors format): 8 bytes, little-endian, the header length N; N bytes of JSON
``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded with
spaces to a multiple of 8; then the tensors' bytes back to back (offsets are relative to the end of the header).

[Note: why this layout for shards]
- A slice of a flat shard is one byte range. A rank loading at another world size reads exactly the elements it
  now owns with ``readinto`` at an offset, instead of unpickling whole files of the old ranks.
- Writing copies nothing: each tensor's storage goes straight to the file, and the SHA-256 is computed on the way,
  so the checksum costs no second read.
- No pickle: a shard file cannot run code when it is read, and the ``safetensors`` package (and its tools) can read
  our files, and our ``to-fp32`` output, without zero_engine.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from ._errors import CheckpointError

__all__ = ["FileDigest", "TensorFile", "TensorFileWriter", "write_tensor_file", "sha256_of_file", "DTYPE_NAMES"]

DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
_MAX_HEADER_BYTES = 512 * 2**20  # far above any real header; a larger length field means a corrupt file
_IO_CHUNK = 16 * 2**20  # bytes per write call / hash update (views of the tensors: no copy)
_VERIFY_CHUNK = 2**20  # verification reads into one reused buffer of this size: negligible memory


class FileDigest(NamedTuple):
    """What the metadata records of a written file, and what a reader checks."""

    name: str  # file name inside the checkpoint directory
    nbytes: int
    sha256: str


def _cpu_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a tensor without copying when it is already a contiguous CPU tensor."""
    t = tensor.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    # Not ``t.numpy()``: sharing memory with numpy marks the storage non-resizable for good, and NVMe parameter
    # offload frees shard buffers by resizing their storage (offload/param_swap.py).
    raw = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    raw.keep_alive = t  # the memoryview holds `raw`, `raw` holds the tensor
    return memoryview(raw).cast("B")


class TensorFileWriter:
    """Streams tensors into one file whose header (names, dtypes, shapes) is known before any data is written.

    Used where holding every tensor at once would cost memory (offline consolidation writes one parameter at a
    time): ``add`` must then be called with tensors of exactly the declared dtype and shape, in declared order.
    """

    def __init__(self, path: str, layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header, offset = {}, 0
        for name, dtype, shape in layout:
            if dtype not in DTYPE_NAMES:
                raise CheckpointError(f"{name}: cannot store a tensor of dtype {dtype} (supported: "
                                      f"{', '.join(str(d) for d in DTYPE_NAMES)})")
            nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = path
        self._layout = list(layout)
        self._next = 0
        self._hash = hashlib.sha256()
        self._nbytes = 0
        self._file = open(path, "xb", buffering=0)  # never overwrite: the caller gives a fresh staging path
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="zero_engine-checkpoint-hash")
        self._write(struct.pack("<Q", len(raw)) + raw)

    def _write(self, data) -> None:
        """Write and hash each chunk at the same time: both release the GIL, so the checksum costs little time."""
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _IO_CHUNK):
            chunk = view[start: start + _IO_CHUNK]
            hashed = self._hasher.submit(self._hash.update, chunk) if len(chunk) > _IO_CHUNK // 16 else None
            if hashed is None:
                self._hash.update(chunk)
            written = 0
            while written < len(chunk):
                written += self._file.write(chunk[written:])
            if hashed is not None:
                hashed.result()
        self._nbytes += len(view)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._layout):
            raise AssertionError(f"{self.path}: more tensors written than declared ({name})")
        expected_name, dtype, shape = self._layout[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (expected_name, dtype, tuple(shape)):
            raise AssertionError(f"{self.path}: tensor {self._next} is {name} {tensor.dtype} {tuple(tensor.shape)}; "
                                 f"the header declared {expected_name} {dtype} {tuple(shape)}")
        self._write(_cpu_bytes(tensor))
        self._next += 1

    def abort(self) -> None:
        """Close without fsync after a failure; the caller removes the incomplete file."""
        self._release()

    def _release(self) -> None:
        self._file.close()
        self._hasher.shutdown()

    def close(self) -> FileDigest:
        """Flush to stable storage (fsync) and return the file's size and checksum."""
        if self._next != len(self._layout):
            raise AssertionError(f"{self.path}: {len(self._layout) - self._next} declared tensors never written")
        try:
            os.fsync(self._file.fileno())
        finally:
            self._release()
        return FileDigest(os.path.basename(self.path), self._nbytes, self._hash.hexdigest())


def write_tensor_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
                      ) -> FileDigest:
    """Write ``tensors`` (in their own dtypes and shapes) and fsync; returns the size and SHA-256 of the file."""
    writer = TensorFileWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], metadata)
    try:
        for name, tensor in tensors.items():
            writer.add(name, tensor)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def sha256_of_file(path: str) -> tuple[int, str]:
    """(size in bytes, hex SHA-256) of a file, read in chunks into one reused buffer."""
    digest = hashlib.sha256()
    buffer = bytearray(_VERIFY_CHUNK)
    view = memoryview(buffer)
    nbytes = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            nbytes += n
    return nbytes, digest.hexdigest()


class _Entry(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()


class TensorFile:
    """Read side: the header once, then whole tensors or element ranges of them, read straight into tensors."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "rb", buffering=0)
        try:
            self.entries, self.metadata = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _corrupt(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a valid tensor file ({why}); the file is truncated or corrupt")

    def _read_header(self) -> tuple[dict[str, _Entry], dict[str, str]]:
        size = os.fstat(self._file.fileno()).st_size
        head = self._file.read(8)
        if len(head) != 8:
            raise self._corrupt(f"{size} bytes, shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise self._corrupt(f"header length {length} does not fit in a file of {size} bytes")
        try:
            header = json.loads(self._file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._corrupt(f"header is not JSON: {error}") from None
        metadata = header.pop("__metadata__", {}) or {}
        data_start = 8 + length
        entries = {}
        for name, spec in header.items():
            try:
                dtype = _DTYPES[spec["dtype"]]
                shape = tuple(int(d) for d in spec["shape"])
                begin, end = (int(x) for x in spec["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._corrupt(f"bad header entry for {name!r}: {spec!r}") from None
            entry = _Entry(dtype, shape, data_start + begin, end - begin)
            if entry.nbytes != entry.numel * torch.empty(0, dtype=dtype).element_size() or \
                    entry.begin + entry.nbytes > size:
                raise self._corrupt(f"{name!r}: bytes [{begin}, {end}) do not hold {spec['dtype']} {list(shape)} "
                                    f"inside a file of {size} bytes")
            entries[name] = entry
        return entries, metadata

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def entry(self, name: str) -> _Entry:
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: no tensor named {name!r} (the file has {len(self.entries)}; e.g. "
                                  f"{', '.join(list(self.entries)[:5])})")
        return self.entries[name]

    def read(self, name: str) -> torch.Tensor:
        entry = self.entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self._readinto(entry.begin, out)
        return out

    def read_range_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of the flattened tensor ``name`` into ``out``.

        ``out`` may have another dtype or live on another device; then the bytes go through a temporary.
        """
        entry = self.entry(name)
        count = out.numel()
        if start < 0 or start + count > entry.numel:
            raise CheckpointError(f"{self.path}: elements [{start}, {start + count}) of {name!r} requested; it has "
                                  f"{entry.numel}")
        direct = out.dtype == entry.dtype and out.device.type == "cpu" and out.is_contiguous()
        target = out if direct else torch.empty(count, dtype=entry.dtype)
        self._readinto(entry.begin + start * target.element_size(), target)
        if not direct:
            out.copy_(target.view(out.shape))

    def _readinto(self, offset: int, out: torch.Tensor) -> None:
        view = _cpu_bytes(out) if out.numel() else memoryview(b"")
        done = 0
        while done < len(view):
            n = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            if n <= 0:
                raise self._corrupt(f"unexpected end of file at byte {offset + done}")
            done += n

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
