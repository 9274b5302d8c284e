"""Tensor files on NVMe: the asynchronous I/O under optimizer and parameter offload (ZeRO-Infinity).

A ``NvmeStore`` owns one directory per run and rank under ``nvme_path``; each key is one file. ``write`` and
``read`` return at once with an ``IoHandle``; the transfer runs on a pool of ``thread_count`` threads, split into
``block_size`` chunks so that several chunks of one tensor are in flight together.

[Note: the I/O path]
Each chunk is one ``os.pwritev`` / ``os.preadv`` on a file opened with ``O_DIRECT`` where the file system allows it
(the page cache is bypassed: a model's states are written once per step and read once, caching them would only
evict the training process's own memory). ``O_DIRECT`` wants the buffer address, the length and the file offset
aligned to the device's block (we align to 4096, which covers 512-byte and 4K devices): buffers from
``aligned_empty`` are, and chunks of any other tensor go through an aligned bounce buffer per thread. Files are
padded to 4096 bytes; the logical size is kept beside. Where ``O_DIRECT`` cannot be opened (tmpfs, some network
file systems) the store says so once and uses buffered I/O. The threads release the GIL inside the system calls,
so I/O overlaps the optimizer's update (CPUAdam releases it too).

[Note: swap checksums]
With ``checksum`` (``aio.checksum``, on by default) every chunk gets a CRC-32 (``zlib.crc32``) as it is written,
kept in memory beside the logical size, and each chunk read back is checked against it: a swap file changed after
it was written (another process, a failing disk, a bit flip in the page cache) raises ``NvmeError`` naming the file
and the byte range, instead of feeding garbage into the next step. The CRC runs on the I/O threads, chunk by chunk,
with the GIL released (zlib does for buffers over 5 KiB), so it overlaps the other chunks' I/O and the optimizer.
Why zlib's CRC-32: it is in the standard library (no new dependency) and runs at several GB/s per thread; CRC32C
would need a package, and a sum or xor of words would miss swapped or shifted blocks. Its cost on a training step
is measured in docs/benchmarks.md ("NVMe swap checksums").

Safety. Directories are named ``zero_engine-<job>-<pid>-rank<r>`` (``<job>``: torchrun's run id, else a random
tag), so two jobs or two ranks sharing ``nvme_path`` never touch each other's files; the directory is removed by
``close()``, at normal interpreter exit and on SIGTERM, and a later run reclaims it after a crash (see [Note: swap
after a crash] in swap_cleanup.py). A key whose write failed is marked bad and reading it raises: a
partially written state is never read back. Errors name the path and say what to do (missing directory, no write
permission, out of space with the bytes needed and free).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import os
import shutil
import threading
import uuid
import weakref
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .._owned_dirs import OWNER_FILE, write_owner
from .swap_cleanup import forget_run_dir, reclaim_abandoned, remember_run_dir

__all__ = ["ALIGNMENT", "IoHandle", "NvmeError", "NvmeStore", "store_options"]

log = logging.getLogger("zero_engine.offload")

ALIGNMENT = 4096


class NvmeError(OSError):
    """An NVMe offload file could not be created, written or read; the message names the path and the fix."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _buffer(tensor: torch.Tensor, start: int, length: int):
    """A writable memoryview of ``length`` bytes of ``tensor``'s memory from byte ``start`` (no copy)."""
    return memoryview((ctypes.c_char * length).from_address(tensor.data_ptr() + start)).cast("B")


class IoHandle:
    """One ``read`` or ``write`` in flight: its chunks' futures. ``wait()`` raises ``NvmeError`` on failure."""

    def __init__(self, futures: list[Future], keep_alive: torch.Tensor, on_done=None):
        self._futures = futures
        self._keep_alive = keep_alive  # the tensor the threads read from / write into
        self._on_done = on_done
        self._waited = False

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        if self._waited:
            return
        error = None
        for future in self._futures:
            exc = future.exception()
            error = error or exc
        self._waited = True
        self._keep_alive = None
        if self._on_done is not None:
            self._on_done(error)
        if error is not None:
            raise error


class NvmeStore:
    """Per-run, per-rank directory of tensor files under ``nvme_path``; async reads and writes on a thread pool."""

    def __init__(self, nvme_path: str, *, rank: int, purpose: str, block_size: int = 1 << 20, queue_depth: int = 8,
                 thread_count: int = 1, use_direct: bool = True, checksum: bool = True):
        self.nvme_path = os.path.abspath(os.path.expanduser(str(nvme_path)))
        _check_directory(self.nvme_path)
        job = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:8]
        self.run_dir = os.path.join(self.nvme_path, f"zero_engine-{job}-{os.getpid()}-rank{rank}")
        self.directory = os.path.join(self.run_dir, purpose)
        reclaim_abandoned(self.nvme_path)
        try:
            os.makedirs(self.directory, exist_ok=False)
            if not os.path.exists(os.path.join(self.run_dir, OWNER_FILE)):  # a second store of this process shares it
                write_owner(self.run_dir)
        except OSError as e:
            raise NvmeError(e.errno, f"offload nvme_path: cannot create {self.directory}: {e.strerror}; give a "
                            "directory this process can write") from None
        self.block_size = max(ALIGNMENT, _round_up(int(block_size), ALIGNMENT))
        self.queue_depth = max(1, int(queue_depth))
        self.thread_count = max(1, int(thread_count))
        self.direct = use_direct and _direct_io_works(self.directory)
        self._pool = ThreadPoolExecutor(self.thread_count, thread_name_prefix=f"zero_engine-nvme-{purpose}")
        self._bounce = threading.local()  # one aligned bounce buffer per I/O thread
        self._sizes: dict[str, int] = {}  # key -> logical bytes of what was written
        self.checksum = bool(checksum)
        self._crcs: dict[str, list[int]] = {}  # key -> CRC-32 of each block_size chunk ([Note: swap checksums])
        self._bad: set[str] = set()  # keys whose last write failed: never read back
        self._in_flight: set[IoHandle] = set()
        self._closed = False
        # weakref: the store can be garbage-collected before exit; close() then already ran or runs from __del__
        atexit.register(_close_at_exit, weakref.ref(self))
        remember_run_dir(self.run_dir)  # removed on SIGTERM while this store is open

    # ---- buffers -----------------------------------------------------------------------------------------------
    @staticmethod
    def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor whose memory starts on a 4096-byte boundary and is padded to a multiple of
        4096 bytes (so it is written and read without a bounce copy)."""
        nbytes = _round_up(max(1, numel * dtype.itemsize), ALIGNMENT)
        raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
        start = (-raw.data_ptr()) % ALIGNMENT
        return raw[start: start + nbytes].view(dtype)[:numel]

    # ---- I/O -----------------------------------------------------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor) -> IoHandle:
        """Write ``tensor`` (contiguous, on the CPU) under ``key``, replacing what was there. The caller keeps the
        tensor unchanged until ``wait()``."""
        tensor = self._check_tensor(key, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        path = self._path(key)
        self._bad.add(key)  # until this write is complete
        self._sizes.pop(key, None)
        self._crcs.pop(key, None)
        starts = range(0, nbytes, self.block_size)
        crcs = [0] * len(starts) if self.checksum else None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if self.direct else 0), 0o600)
        except OSError as e:
            raise self._error("create", path, e) from None
        self._preallocate(fd, path, _round_up(nbytes, ALIGNMENT))
        futures = [self._pool.submit(self._write_chunk, fd, path, tensor, start,
                                     min(self.block_size, nbytes - start), crcs, i)
                   for i, start in enumerate(starts)]

        def done(error):
            os.close(fd)
            if error is None:
                self._sizes[key] = nbytes
                if crcs is not None:
                    self._crcs[key] = crcs
                self._bad.discard(key)

        return self._track(IoHandle(futures, tensor, done))

    def read(self, key: str, out: torch.Tensor) -> IoHandle:
        """Fill ``out`` (contiguous, on the CPU, as many bytes as were written) with what ``key`` holds."""
        out = self._check_tensor(key, out)
        nbytes = out.numel() * out.element_size()
        path = self._path(key)
        if key in self._bad or key not in self._sizes:
            why = "its last write failed" if key in self._bad else "nothing was written under it"
            raise NvmeError(errno.ENOENT, f"offload: cannot read {key!r} from {path}: {why}")
        if self._sizes[key] != nbytes:
            raise NvmeError(errno.EINVAL, f"offload: {key!r} holds {self._sizes[key]} bytes, the read asks for "
                            f"{nbytes}")
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except OSError as e:
            raise self._error("open", path, e) from None
        crcs = self._crcs.get(key) if self.checksum else None
        futures = [self._pool.submit(self._read_chunk, fd, path, out, start, min(self.block_size, nbytes - start),
                                     crcs[i] if crcs is not None else None)
                   for i, start in enumerate(range(0, nbytes, self.block_size))]
        return self._track(IoHandle(futures, out, lambda error: os.close(fd)))

    def nbytes(self) -> int:
        """Bytes of tensor data stored now (files are padded to 4096 bytes on disk)."""
        return sum(self._sizes.values())

    def wait_all(self) -> None:
        for handle in list(self._in_flight):
            handle.wait()

    def close(self) -> None:
        """Wait for I/O in flight, stop the threads and remove this run's directory. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for handle in list(self._in_flight):
            try:
                handle.wait()
            except OSError:
                pass  # the files are removed below; nothing will read them
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.directory, ignore_errors=True)
        try:
            if set(os.listdir(self.run_dir)) <= {OWNER_FILE}:  # the other store of this process is closed too
                shutil.rmtree(self.run_dir, ignore_errors=True)
        except OSError:
            pass
        forget_run_dir(self.run_dir)

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()

    # ---- internals -----------------------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        if self._closed:
            raise NvmeError(errno.EBADF, f"offload: the store under {self.directory} is closed (engine.destroy() ran)")
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"offload: invalid key {key!r}: a plain file name")
        return os.path.join(self.directory, key)

    @staticmethod
    def _check_tensor(key: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"offload: {key!r}: NVMe I/O needs a contiguous CPU tensor, got "
                             f"{'a non-contiguous' if tensor.device.type == 'cpu' else tensor.device} tensor")
        return tensor

    def _track(self, handle: IoHandle) -> IoHandle:
        self._in_flight.add(handle)
        on_done = handle._on_done

        def finish(error):
            self._in_flight.discard(handle)
            on_done(error)
        handle._on_done = finish
        return handle

    def _preallocate(self, fd: int, path: str, size: int) -> None:
        """Reserve the file's blocks up front, so a full disk fails here, by name, not halfway through a write."""
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
                return  # the file system cannot preallocate; a short write is still caught below
            os.close(fd)
            raise self._error("write", path, e, size) from None

    def _bounce_buffer(self) -> torch.Tensor:
        buf = getattr(self._bounce, "buf", None)
        if buf is None:
            buf = self._bounce.buf = self.aligned_empty(self.block_size, torch.uint8)
        return buf

    def _aligned(self, tensor: torch.Tensor, start: int, length: int) -> bool:
        """Can this chunk go to the disk straight from the tensor's memory? (Always, without O_DIRECT.)"""
        if not self.direct:
            return True
        storage_end = tensor.untyped_storage().data_ptr() + tensor.untyped_storage().nbytes()
        address = tensor.data_ptr() + start
        padded = _round_up(length, ALIGNMENT)
        return address % ALIGNMENT == 0 and address + padded <= storage_end

    def _write_chunk(self, fd: int, path: str, tensor: torch.Tensor, start: int, length: int,
                     crcs: list[int] | None, index: int) -> None:
        padded = _round_up(length, ALIGNMENT) if self.direct else length
        if self._aligned(tensor, start, length):
            view = _buffer(tensor, start, padded)
        else:
            bounce = self._bounce_buffer()
            view = _buffer(bounce, 0, padded)
            view[:length] = _buffer(tensor, start, length)
        if crcs is not None:
            crcs[index] = zlib.crc32(view[:length])
        self._io(os.pwritev, fd, path, view, start, "write")

    def _read_chunk(self, fd: int, path: str, out: torch.Tensor, start: int, length: int,
                    expected_crc: int | None) -> None:
        padded = _round_up(length, ALIGNMENT) if self.direct else length
        if self._aligned(out, start, length):
            view = _buffer(out, start, padded)
            self._io(os.preadv, fd, path, view, start, "read")
        else:
            view = _buffer(self._bounce_buffer(), 0, padded)
            self._io(os.preadv, fd, path, view, start, "read")
            _buffer(out, start, length)[:] = view[:length]
        if expected_crc is not None:
            crc = zlib.crc32(view[:length])
            if crc != expected_crc:
                raise NvmeError(errno.EIO, f"offload: {path} is corrupt: bytes [{start}, {start + length}) read back "
                                f"with CRC-32 {crc:08x}, written with {expected_crc:08x}. The swap file was changed "
                                "after this process wrote it (another process writing under nvme_path, or a failing "
                                "disk); the read raised before its data could be used. Restart from the last "
                                "checkpoint")

    def _io(self, call, fd: int, path: str, view: memoryview, offset: int, what: str) -> None:
        done = 0
        while done < len(view):  # a short transfer (signal, end of a buffered page) continues where it stopped
            try:
                n = call(fd, [view[done:]], offset + done)
            except OSError as e:
                raise self._error(what, path, e, len(view)) from None
            if n <= 0:
                raise NvmeError(errno.EIO, f"offload: {what} of {len(view)} bytes at offset {offset} in {path} "
                                f"stopped after {done} bytes (file shorter than expected)")
            done += n

    def _error(self, what: str, path: str, e: OSError, needed: int = 0) -> NvmeError:
        if e.errno == errno.ENOSPC:
            free = shutil.disk_usage(self.nvme_path).free
            return NvmeError(e.errno, f"offload: out of space at {path}: needs {needed} more bytes, {free} free; "
                             "free space there or point nvme_path at a larger disk")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return NvmeError(e.errno, f"offload: cannot {what} {path}: {e.strerror}; give an nvme_path this process "
                             "can write")
        return NvmeError(e.errno, f"offload: {what} failed at {path}: {e.strerror}")


def _check_directory(path: str) -> None:
    if not os.path.isdir(path):
        raise NvmeError(errno.ENOENT, f"offload nvme_path {path!r} does not exist or is not a directory: create it "
                        "(on a local NVMe disk) or set nvme_path to one that exists")
    if not os.access(path, os.W_OK | os.X_OK):
        raise NvmeError(errno.EACCES, f"offload nvme_path {path!r} is not writable by this process: fix its "
                        "permissions or choose another directory")


_said_buffered: set[str] = set()


def _direct_io_works(directory: str) -> bool:
    """Whether the file system under ``directory`` accepts O_DIRECT (tmpfs does not); said once per directory."""
    probe = os.path.join(directory, ".direct-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        if directory not in _said_buffered:
            _said_buffered.add(directory)
            log.info("zero_engine: O_DIRECT is not available under %s; NVMe offload uses buffered I/O there (the "
                     "page cache will hold recently written states)", directory)
        return False
    else:
        os.close(fd)
        return True
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


def _close_at_exit(ref) -> None:
    store = ref()
    if store is not None:
        store.close()


def store_options(aio) -> dict:
    """``NvmeStore`` keyword arguments from the config's ``aio`` section (``AioConfig``)."""
    return {"block_size": aio.block_size, "thread_count": aio.thread_count, "checksum": aio.checksum}
