"""The NVMe tensor store under offload (zero_engine/offload/nvme.py): bitwise round trips through O_DIRECT and
buffered I/O, isolation between stores sharing a directory, cleanup, and errors that name the path."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

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


def _overwrite_with_random_bytes(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.parametrize("direct", [True, False])
def test_a_swap_file_changed_on_disk_is_refused_naming_it(tmp_path, direct):
    """[Note: swap checksums]: a file overwritten with random bytes of the same size is caught at read, naming the
    file and the range; unchanged keys still read back bitwise."""
    s = NvmeStore(str(tmp_path), rank=0, purpose="crc", block_size=1 << 14, thread_count=2, use_direct=direct)
    try:
        value = torch.randn(50_000)
        s.write("x", value).wait()
        s.write("y", value).wait()
        _overwrite_with_random_bytes(os.path.join(s.directory, "x"))
        out = torch.empty_like(value)
        with pytest.raises(NvmeError, match=rf"{os.path.join(s.directory, 'x')} is corrupt: bytes \[0, 16384\)"):
            s.read("x", out).wait()
        s.read("y", out).wait()
        assert torch.equal(out, value)
    finally:
        s.close()


def test_checksum_off_reads_whatever_the_file_holds(tmp_path):
    """aio.checksum=false acts: the store does no check (and a changed file is read back as it is)."""
    s = NvmeStore(str(tmp_path), rank=0, purpose="nocrc", block_size=1 << 14, checksum=False)
    try:
        s.write("x", torch.randn(50_000)).wait()
        _overwrite_with_random_bytes(os.path.join(s.directory, "x"))
        out = torch.empty(50_000)
        s.read("x", out).wait()
        with open(os.path.join(s.directory, "x"), "rb") as f:
            assert f.read(out.numel() * 4) == out.numpy().tobytes()
    finally:
        s.close()


def test_checksum_config_key_reaches_the_store():
    from zero_engine.config import load_config
    from zero_engine.offload.nvme import store_options

    assert store_options(load_config({"train_batch_size": 1}, world_size=1).aio)["checksum"] is True
    cfg = load_config({"train_batch_size": 1, "aio": {"checksum": False}}, world_size=1)
    assert store_options(cfg.aio)["checksum"] is False


def test_a_short_read_names_the_file(store):
    store.write("x", torch.ones(20_000)).wait()
    path = os.path.join(store.directory, "x")
    os.truncate(path, 4096)
    with pytest.raises(NvmeError, match=rf"in {path} stopped after \d+ bytes \(file shorter than expected\)"):
        store.read("x", torch.empty(20_000)).wait()


# ---- after a crash: SIGTERM and reclaiming abandoned directories ([Note: swap after a crash]) --------------------
_HOLD_SWAP = """
import faulthandler, os, signal, sys, time, torch
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's report, should the child not end
from zero_engine.offload.nvme import NvmeStore
if {previous!r} == "exit":
    def handler(signum, frame):  # e.g. a trainer that checkpoints on SIGTERM: it still needs the swap files
        print("handler ran, files present:", os.path.exists(store.directory + "/k"), flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, handler)
store = NvmeStore({path!r}, rank=0, purpose="optimizer")
other = NvmeStore({path!r}, rank=0, purpose="params")
store.write("k", torch.ones(300_000)).wait()
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("previous", ["default", "exit"])
def test_sigterm_removes_this_process_swap_files(tmp_path, previous):
    """torchrun SIGTERMs the surviving ranks when one fails: their swap directories must go. With the default
    disposition the process still dies of SIGTERM; a handler installed before is called first and decides."""
    child = subprocess.Popen([sys.executable, "-c", _HOLD_SWAP.format(path=str(tmp_path), previous=previous)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert len(os.listdir(tmp_path)) == 2  # two stores (without torchrun: two run directories)
        child.send_signal(subprocess.signal.SIGTERM)
        try:
            out, _ = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say where every thread of the child is, not only that it hangs
            child.send_signal(subprocess.signal.SIGUSR1)
            time.sleep(2)
            child.kill()
            pytest.fail(f"the child did not end within 60 s of SIGTERM; its threads:\n{child.communicate()[1]}")
    finally:
        child.kill()
    if previous == "default":
        assert child.returncode == -subprocess.signal.SIGTERM, child.returncode
    else:
        assert child.returncode == 0 and "handler ran, files present: True" in out, (child.returncode, out)
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_the_previous_sigterm_handler_is_back_after_close(tmp_path):
    import signal

    from zero_engine.offload import swap_cleanup

    before = signal.getsignal(signal.SIGTERM)
    a = NvmeStore(str(tmp_path), rank=0, purpose="a")
    b = NvmeStore(str(tmp_path), rank=1, purpose="b")
    assert signal.getsignal(signal.SIGTERM) is swap_cleanup._on_sigterm
    a.close()
    assert signal.getsignal(signal.SIGTERM) is swap_cleanup._on_sigterm  # b still holds swap files
    b.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_abandoned_swap_directories_are_reclaimed_and_live_ones_kept(tmp_path):
    from zero_engine._owned_dirs import write_owner

    live_job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        crashed = tmp_path / f"zero_engine-job1-{dead.pid}-rank0"
        alive = tmp_path / f"zero_engine-job2-{live_job.pid}-rank1"
        for directory, pid in ((crashed, dead.pid), (alive, live_job.pid)):
            (directory / "optimizer").mkdir(parents=True)
            (directory / "optimizer" / "state").write_bytes(b"x" * 4096)
            write_owner(str(directory), pid)
        unrelated = tmp_path / "zero_engine-notes"
        unrelated.mkdir()
        store = NvmeStore(str(tmp_path), rank=0, purpose="optimizer")
        try:
            assert not crashed.exists(), "a swap directory whose owner died was not reclaimed"
            assert alive.is_dir() and (alive / "optimizer" / "state").is_file(), "a live job's swap was removed"
            assert unrelated.is_dir()
        finally:
            store.close()
    finally:
        live_job.kill()
        live_job.wait()
    assert sorted(os.listdir(tmp_path)) == sorted([alive.name, unrelated.name])


# ---- another container on this host: same hostname, its own pids ([Note: provably abandoned]) -----------------------
def _new_pid_namespace() -> list[str] | None:
    """A command prefix that runs a program in a new pid namespace on this host and kernel (as a container with the
    host's network: same hostname, its own pids), or None where this machine does not allow it."""
    for prefix in (["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"],
                   ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


_OTHER_CONTAINER = """
import os, sys, torch
from zero_engine.offload.nvme import NvmeStore
store = NvmeStore({path!r}, rank=0, purpose="optimizer")
store.write("state", torch.ones(4096)).wait()
print("ready", os.getpid(), flush=True)
sys.stdin.read()  # runs until the test kills it
"""


def test_a_live_job_in_another_pid_namespace_keeps_its_swap(tmp_path):
    """Two jobs on one host in containers with the host's network (same hostname, their own pids) share nvme_path.
    The other job's owner pid means nothing here (it names no process, or one of ours started at another time: pid
    1 here), so its swap must be kept while it runs, and after it was killed until nothing was written in it for a
    day; it was reclaimed as "owner exited" while the job trained."""
    from zero_engine._owned_dirs import STALE_S
    from zero_engine.offload.swap_cleanup import reclaim_abandoned

    prefix = _new_pid_namespace()
    if prefix is None:
        pytest.skip("this machine does not allow creating a pid namespace (unshare --pid)")
    other = subprocess.Popen([*prefix, sys.executable, "-c", _OTHER_CONTAINER.format(path=str(tmp_path))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        word, pid = other.stdout.readline().split()
        assert word == "ready" and int(pid) != other.pid  # its own pid namespace
        [theirs] = os.listdir(tmp_path)
        state = tmp_path / theirs / "optimizer" / "state"
        mine = NvmeStore(str(tmp_path), rank=1, purpose="optimizer")  # reclaims abandoned directories first
        try:
            assert state.is_file(), "a live job's swap in another pid namespace was reclaimed"
        finally:
            mine.close()
    finally:
        other.kill()  # unshare --kill-child: the job in the namespace dies with it, as a container killed
        other.wait()
    assert reclaim_abandoned(str(tmp_path)) == [] and state.is_file()  # dead, but that cannot be checked from here
    old = os.path.getmtime(state) - STALE_S - 60
    for path in (state, state.parent, state.parent.parent, state.parent.parent / ".owner.json"):
        os.utime(path, (old, old))
    assert reclaim_abandoned(str(tmp_path)) == [theirs]


def test_swap_of_this_host_before_a_restart_is_reclaimed(tmp_path):
    """An owner file from an earlier boot of this host: every process of that boot is gone, whatever its pid names
    now. One without boot id and namespace (an older version's) is checked by pid, as before."""
    import json

    from zero_engine import _owned_dirs
    from zero_engine.offload.swap_cleanup import reclaim_abandoned

    rebooted, legacy = tmp_path / "zero_engine-a-1-rank0", tmp_path / f"zero_engine-b-{os.getpid()}-rank0"
    for directory in (rebooted, legacy):
        (directory / "optimizer").mkdir(parents=True)
    owner = _owned_dirs.write_owner(str(rebooted), os.getpid())  # this live process, but in another boot:
    owner["boot"] = "00000000-0000-0000-0000-000000000000"
    (rebooted / ".owner.json").write_text(json.dumps(owner))
    (legacy / ".owner.json").write_text(json.dumps({"host": _owned_dirs._HOST, "pid": os.getpid(),
                                                    "started": _owned_dirs.process_start_time(os.getpid())}))
    assert "ran before the host restarted" in _owned_dirs.abandoned_because(str(rebooted))
    assert reclaim_abandoned(str(tmp_path)) == [rebooted.name] and legacy.is_dir()
