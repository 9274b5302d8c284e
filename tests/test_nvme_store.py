"""The NVMe tensor store under offload (zero_engine/offload/nvme.py): bitwise round trips through O_DIRECT and
buffered I/O, isolation between stores sharing a directory, cleanup, and errors that name the path."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch

from zero_engine.offload import nvme
from zero_engine.offload.nvme import ALIGNMENT, NvmeError, NvmeStore


@pytest.fixture
def store(tmp_path):
    s = NvmeStore(str(tmp_path), rank=0, purpose="test", block_size=1 << 14, thread_count=2)
    yield s
    s.close()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("numel,dtype", [(1, torch.float32), (4095, torch.bfloat16), (1 << 16, torch.float32),
                                         (77_777, torch.float16), (3, torch.int64)])
def test_round_trip_is_bitwise(tmp_path, direct, numel, dtype):
    s = NvmeStore(str(tmp_path), rank=0, purpose="rt", block_size=1 << 14, thread_count=3, use_direct=direct)
    try:
        value = torch.randn(numel).to(dtype) if dtype.is_floating_point else torch.arange(numel, dtype=dtype)
        s.write("x", value).wait()
        plain, aligned = torch.empty_like(value), s.aligned_empty(numel, dtype)
        s.read("x", plain).wait()
        s.read("x", aligned).wait()
        assert torch.equal(plain, value) and torch.equal(aligned, value)
        assert aligned.data_ptr() % ALIGNMENT == 0
        assert s.nbytes() == numel * dtype.itemsize
    finally:
        s.close()


def test_unaligned_views_and_many_operations_in_flight(store):
    base = torch.randn(300_001)
    parts = {f"p{i}": base[i * 1_001 + 3: (i + 1) * 1_001 + 3 + i] for i in range(50)}  # odd offsets and lengths
    handles = [store.write(k, v) for k, v in parts.items()]
    for h in handles:
        h.wait()
    outs = {k: torch.empty_like(v) for k, v in parts.items()}
    handles = [store.read(k, outs[k]) for k in parts]
    for h in handles:
        h.wait()
    assert all(torch.equal(outs[k], parts[k]) for k in parts)


def test_a_rewrite_replaces_and_a_wrong_size_is_refused(store):
    store.write("x", torch.ones(1000)).wait()
    store.write("x", torch.full((1000,), 2.0)).wait()
    out = torch.empty(1000)
    store.read("x", out).wait()
    assert torch.equal(out, torch.full((1000,), 2.0))
    with pytest.raises(NvmeError, match="holds 4000 bytes"):
        store.read("x", torch.empty(999))
    with pytest.raises(NvmeError, match="nothing was written"):
        store.read("never", torch.empty(1))


def test_two_stores_on_one_path_are_isolated_and_close_removes_only_their_own(tmp_path):
    a = NvmeStore(str(tmp_path), rank=0, purpose="opt")
    b = NvmeStore(str(tmp_path), rank=0, purpose="opt")  # another job (or engine) on the same nvme_path
    a.write("k", torch.zeros(10)).wait()
    b.write("k", torch.ones(10)).wait()
    out = torch.empty(10)
    a.read("k", out).wait()
    assert torch.equal(out, torch.zeros(10))
    assert a.run_dir != b.run_dir and os.path.isdir(a.run_dir)
    a.close()
    assert not os.path.exists(a.run_dir) and os.path.isdir(b.run_dir)
    with pytest.raises(NvmeError, match="closed"):
        a.read("k", out)
    b.read("k", out).wait()
    assert torch.equal(out, torch.ones(10))
    b.close()
    a.close()  # twice is fine
    assert os.listdir(tmp_path) == []


def test_files_are_removed_at_normal_exit_without_close(tmp_path):
    code = ("import torch; from zero_engine.offload.nvme import NvmeStore; "
            f"s = NvmeStore({str(tmp_path)!r}, rank=1, purpose='p'); s.write('k', torch.ones(5000)).wait(); "
            "import os; print(os.listdir(s.directory))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "'k'" in out.stdout
    assert os.listdir(tmp_path) == []


def test_a_missing_or_unusable_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(NvmeError, match=f"{missing}.*does not exist.*create it"):
        NvmeStore(str(missing), rank=0, purpose="p")
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(NvmeError, match="not a directory"):
        NvmeStore(str(a_file), rank=0, purpose="p")
    if os.geteuid() != 0:  # root may write anywhere
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o500)
        with pytest.raises(NvmeError, match="not writable"):
            NvmeStore(str(read_only), rank=0, purpose="p")


def test_a_failed_write_is_never_read_back(store, monkeypatch):
    store.write("k", torch.ones(100_000)).wait()

    def full_disk(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nvme.os, "pwritev", full_disk)
    with pytest.raises(NvmeError, match=r"out of space at .*needs \d+ more bytes, \d+ free"):
        store.write("k", torch.full((100_000,), 2.0)).wait()
    monkeypatch.undo()
    with pytest.raises(NvmeError, match="its last write failed"):
        store.read("k", torch.empty(100_000))
    store.write("k", torch.full((100_000,), 3.0)).wait()  # a later good write makes it readable again
    out = torch.empty(100_000)
    store.read("k", out).wait()
    assert torch.equal(out, torch.full((100_000,), 3.0))


def test_only_contiguous_cpu_tensors(store):
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        store.write("k", torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="plain file name"):
        store.write("../escape", torch.ones(1))
