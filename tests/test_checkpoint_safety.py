"""Checkpoints shared between jobs, and load paths that must not silently start from scratch (issue 15 items 2, 10).

Two jobs saving into one directory: a staging directory names the job that owns it (host, pid, process start time)
and is removed by another save only when that owner is provably gone (same host, process dead) or it was abandoned
long ago (another host: nothing written in it for ``STALE_STAGING_S``). Nothing is renamed into place unless every
file the ranks reported is there with the size they wrote.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

import zero_engine
from zero_engine.checkpoint import CheckpointError
from zero_engine import _owned_dirs
from zero_engine.checkpoint import _atomic
from zero_engine.checkpoint._atomic import (create_staging, publish, remove_stale_staging, resolve_checkpoint,
                                            write_latest)
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPT, GPTConfig, make_batches

TIMEOUT = 120


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_staging_of_a_live_job_survives_another_jobs_cleanup(tmp_path):
    other_job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = create_staging(str(tmp_path), "step5", owner_pid=other_job.pid)
        crashed = create_staging(str(tmp_path), "step4", owner_pid=dead_pid())
        removed = remove_stale_staging(str(tmp_path))
        assert os.path.isdir(live), "a live job's staging directory was removed"
        assert not os.path.exists(crashed) and removed == [os.path.basename(crashed)]
    finally:
        other_job.kill()
        other_job.wait()
    assert remove_stale_staging(str(tmp_path)) == [os.path.basename(live)]  # its owner is gone now


def test_staging_names_identify_the_job(tmp_path):
    a = create_staging(str(tmp_path), "step1")
    b = create_staging(str(tmp_path), "step1")
    assert a != b and f"-{os.getpid()}-" in os.path.basename(a)


def test_staging_of_another_host_is_removed_only_when_old(tmp_path, monkeypatch):
    staging = create_staging(str(tmp_path), "step1")
    monkeypatch.setattr(_owned_dirs, "_HOST", "another-host")  # seen from another host: liveness cannot be checked
    assert remove_stale_staging(str(tmp_path)) == [] and os.path.isdir(staging)
    old = time.time() - _atomic.STALE_STAGING_S - 60
    for root, _, files in os.walk(staging):
        for name in [*files, "."]:
            os.utime(os.path.join(root, name), (old, old))
    assert remove_stale_staging(str(tmp_path)) == [os.path.basename(staging)]


def test_staging_without_an_owner_file_is_removed_only_when_old(tmp_path):
    legacy = tmp_path / ".step1.tmp-0123abcd"  # the format before owner files, or a crash right after mkdir
    legacy.mkdir()
    assert remove_stale_staging(str(tmp_path)) == [] and legacy.is_dir()
    old = time.time() - _atomic.STALE_STAGING_S - 60
    os.utime(legacy, (old, old))
    assert remove_stale_staging(str(tmp_path)) == [legacy.name]


def test_publish_refuses_a_staging_directory_missing_what_was_written(tmp_path):
    staging = create_staging(str(tmp_path), "step1")
    with open(os.path.join(staging, "rank_0.bin"), "wb") as f:
        f.write(b"x" * 10)
    expected = {"rank_0.bin": 10, "rank_1.bin": 7}
    with pytest.raises(CheckpointError, match="rank_1.bin"):
        publish(str(tmp_path), staging, "step1", expected_files=expected)
    assert not (tmp_path / "step1").exists()
    with open(os.path.join(staging, "rank_1.bin"), "wb") as f:
        f.write(b"x" * 3)  # truncated
    with pytest.raises(CheckpointError, match="rank_1.bin: 3 bytes, expected 7"):
        publish(str(tmp_path), staging, "step1", expected_files=expected)
    with open(os.path.join(staging, "rank_1.bin"), "wb") as f:
        f.write(b"x" * 7)
    assert publish(str(tmp_path), staging, "step1", expected_files=expected) == str(tmp_path / "step1")


def test_latest_is_written_through_a_job_private_temporary(tmp_path, monkeypatch):
    seen = []
    original = os.replace

    def spy(src, dst):
        seen.append(os.path.basename(src))
        return original(src, dst)

    monkeypatch.setattr(_atomic.os, "replace", spy)
    write_latest(str(tmp_path), "step1")
    assert (tmp_path / "latest").read_text() == "step1"
    assert seen and seen[0] != "latest.tmp" and str(os.getpid()) in seen[0]


def _save_beside_another_job_body(save_dir, other_staging):
    torch_seed = 0
    import torch

    torch.manual_seed(torch_seed)
    model = GPT(GPTConfig())
    engine, *_ = zero_engine.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3}})
    for x, y in make_batches(model.cfg, 1, 1):
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(save_dir, tag="mine")
    return os.path.isdir(other_staging)


def test_save_leaves_a_concurrent_jobs_staging_alone(tmp_path):
    other_job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        other = create_staging(str(tmp_path), "theirs", owner_pid=other_job.pid)
        with open(os.path.join(other, "rank_0.safetensors"), "wb") as f:
            f.write(b"half written")
        assert run_ranks(_save_beside_another_job_body, 2, str(tmp_path), other, timeout=TIMEOUT) == [True, True]
        assert os.path.isdir(other) and (tmp_path / "latest").read_text() == "mine"
    finally:
        other_job.kill()
        other_job.wait()


# ---- load paths ------------------------------------------------------------------------------------------------------
def test_a_latest_file_that_is_not_utf8_is_a_checkpoint_error(tmp_path):
    (tmp_path / "latest").write_bytes(b"\xff\xfeglobal_step1")
    with pytest.raises(CheckpointError, match="latest.*not UTF-8"):
        resolve_checkpoint(str(tmp_path), None)


def test_a_load_directory_that_does_not_exist_is_an_error_unless_tolerated(tmp_path):
    missing = tmp_path / "typo"
    with pytest.raises(CheckpointError, match=r"typo.*does not exist.*missing_ok=True"):
        resolve_checkpoint(str(missing), None)
    assert resolve_checkpoint(str(missing), None, missing_ok=True) is None
    assert resolve_checkpoint(str(tmp_path), None) is None  # exists, nothing saved yet: DeepSpeed's (None, None)


def _load_missing_body(load_dir):
    import torch

    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(GPTConfig()), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3}})
    tolerated = engine.load_checkpoint(load_dir, missing_ok=True)
    try:
        engine.load_checkpoint(load_dir)
    except CheckpointError as error:
        return tolerated, str(error)
    return tolerated, None


def test_engine_load_from_a_missing_directory(tmp_path):
    for tolerated, error in run_ranks(_load_missing_body, 2, str(tmp_path / "nope"), timeout=TIMEOUT):
        assert tolerated == (None, None)
        assert error is not None and "does not exist" in error, error
