"""save_checkpoint / load_checkpoint arguments and the offline converter as DeepSpeed's scripts and tests call them
(issue 26 items 4, 5, 6): checkpoint.tag_validation, empty or missing directories, conversion on every rank at once.

DeepSpeed's behaviour is the reference (deepspeed/runtime/engine.py save_checkpoint, _checkpoint_tag_validation,
runtime/config.py get_checkpoint_tag_validation_mode); where we differ on purpose docs/deepspeed_compat.md says why.
Bodies named ``_*_body`` run on simulated ranks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import zero_engine
import zero_engine as deepspeed
from zero_engine.checkpoint import CheckpointError, _atomic, verify_checkpoint
from zero_engine.testing import run_ranks

from test_deepspeed_api import Small  # a frozen layer too: frozen parameters are saved and converted

TIMEOUT = 120


def make_engine(stage=3, **extra):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage}, **extra}
    engine, *_ = deepspeed.initialize(model=Small(), config=cfg)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x))
    engine.step()
    return engine


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# ---- item 4: checkpoint.tag_validation -------------------------------------------------------------------------------
def _tag_per_rank_body(root):
    """For each mode (None: the section left out, DeepSpeed's default "Warn"): each rank saves under its own tag."""
    rank = dist.get_rank()
    records = Records()
    logging.getLogger("zero_engine.checkpoint").addHandler(records)
    outcomes = {}
    for mode in ("Fail", "warn", "IGNORE", None):
        engine = make_engine(**({"checkpoint": {"tag_validation": mode}} if mode else {}))
        save_dir = os.path.join(root, str(mode))
        records.messages.clear()
        try:
            path = engine.save_checkpoint(save_dir, tag=f"tag-{rank}")
        except AssertionError as error:  # what DeepSpeed's tests catch under "Fail"
            outcomes[mode] = ("raised", type(error).__name__, isinstance(error, ValueError), str(error),
                              sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else None)
            continue
        warned = [m for m in records.messages if "different tags" in m]
        dist.barrier()
        fresh = make_engine(**({"checkpoint": {"tag_validation": mode}} if mode else {}))
        loaded, _ = fresh.load_checkpoint(save_dir)
        full = deepspeed.utils.safe_get_full_fp32_param
        same = all(torch.equal(full(p), full(q)) for p, q in zip(engine.module.parameters(),
                                                                  fresh.module.parameters()) if p.requires_grad)
        outcomes[mode] = ("saved", path, loaded, warned, same, sorted(os.listdir(save_dir)))
        engine.destroy()
        fresh.destroy()
    try:
        make_engine().save_checkpoint(os.path.join(root, f"dir-{rank}"), tag="same")
    except ValueError as error:
        outcomes["dirs"] = str(error)
    return outcomes


def test_tag_validation_modes_when_ranks_pass_different_tags(tmp_path):
    results = run_ranks(_tag_per_rank_body, 2, str(tmp_path), timeout=TIMEOUT)
    for rank, outcomes in enumerate(results):
        kind, name, is_value_error, message, listing = outcomes["Fail"]
        assert kind == "raised" and name == "ArgumentError" and is_value_error, outcomes["Fail"]
        assert "'tag-0' on rank 0; 'tag-1' on rank 1" in message and '"Fail"' in message, message
        assert listing in (None, []), f"Fail must write nothing, found {listing}"
        for mode, warns in (("warn", True), ("IGNORE", False), (None, True)):
            kind, path, loaded, warned, same, listing = outcomes[mode]
            save_dir = tmp_path / str(mode)
            # One complete checkpoint under rank 0's tag, the one `latest` names; it loads on a fresh engine.
            assert kind == "saved" and path == loaded == str(save_dir / "tag-0"), outcomes[mode]
            assert listing == ["latest", "tag-0"] and (save_dir / "latest").read_text() == "tag-0"
            assert same, f"rank {rank}, mode {mode}: loaded weights differ from the saved engine's"
            assert bool(warned) == warns, (mode, warned)
            if warns:
                assert f"rank {rank}" in warned[0] and "'tag-0'" in warned[0] and "'tag-1'" in warned[0]
        assert "different save_dirs" in outcomes["dirs"]
    verify_checkpoint(str(tmp_path / "warn"))


@pytest.mark.parametrize("value", ["foo", 1, None, ""])
def test_unknown_tag_validation_is_deepspeeds_config_error(value):
    with pytest.raises(deepspeed.DeepSpeedConfigError, match=r"checkpoint\.tag_validation.*Warn.*Ignore.*Fail"):
        zero_engine.config.load_config({"train_batch_size": 2, "checkpoint": {"tag_validation": value}},
                                       world_size=1)
    assert deepspeed.DeepSpeedConfigError is zero_engine.ConfigError


def test_tag_validation_spellings_and_default_are_deepspeeds():
    def mode(section):
        cfg = {"train_batch_size": 2, **({"checkpoint": section} if section is not None else {})}
        return zero_engine.config.load_config(cfg, world_size=1).checkpoint.tag_validation

    assert [mode({"tag_validation": v}) for v in ("Warn", "ignore", "FAIL", "fAiL")] == ["WARN", "IGNORE", "FAIL",
                                                                                         "FAIL"]
    assert mode(None) == mode({}) == "WARN"


# ---- item 5: save_dir / load_dir that name no directory --------------------------------------------------------------
def _empty_dirs_body(root):
    engine = make_engine()
    rank = dist.get_rank()
    engine.save_checkpoint(root, tag="a")
    engine.save_checkpoint(root, tag="b")
    got = {}
    calls = {
        "save None": lambda: engine.save_checkpoint(None),
        "save ''": lambda: engine.save_checkpoint(""),
        "load None": lambda: engine.load_checkpoint(None),
        "load ''": lambda: engine.load_checkpoint("", tag="x"),
        # one rank's mistake must not leave the other waiting in a collective
        "save '' on rank 1": lambda: engine.save_checkpoint(root if rank == 0 else ""),
        "load '' on rank 1": lambda: engine.load_checkpoint(root if rank == 0 else ""),
    }
    for name, call in calls.items():
        try:
            call()
            got[name] = "no error"
        except Exception as error:  # noqa: BLE001 -- the type is what is checked
            got[name] = (type(error).__name__, str(error))
    try:
        engine.load_checkpoint(root, tag="a" if rank == 0 else "b")
        got["load different tags"] = "no error"
    except CheckpointError as error:
        got["load different tags"] = str(error)
    return got


def test_save_and_load_refuse_a_missing_or_empty_directory_on_every_rank(tmp_path):
    for rank, got in enumerate(run_ranks(_empty_dirs_body, 2, str(tmp_path / "ckpt"), timeout=TIMEOUT)):
        for name in ("save None", "save ''", "load None", "load ''"):
            kind, message = got[name]
            assert kind == "ValueError" and "must be a non-empty path" in message, (name, got[name])
        for name in ("save '' on rank 1", "load '' on rank 1"):
            kind, message = got[name]
            if rank == 1:
                assert kind == "ValueError" and "non-empty path" in message, (name, got[name])
            else:
                assert kind in ("ValueError", "CheckpointError") and "rank 1" in message, (name, got[name])
        assert "ranks would load different checkpoints" in got["load different tags"], got["load different tags"]
        assert "'a'" in got["load different tags"] and "'b'" in got["load different tags"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["a", "b", "latest"]  # nothing saved by the refused calls


# ---- item 6: conversion on every rank at once ------------------------------------------------------------------------
def _save_then_convert_everywhere_body(ckpt, out, rounds):
    """Every rank converts the same checkpoint into the same directory at the same moment, as DeepSpeed's test does."""
    from zero_engine.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    engine = make_engine()
    engine.save_checkpoint(ckpt)
    for _ in range(rounds):
        dist.barrier()
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, out)
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, safe_serialization=True)
        zero_engine.checkpoint.convert_zero_checkpoint_to_fp32_state_dict(ckpt, os.path.join(out, "w.safetensors"))
    dist.barrier()
    return sorted(os.listdir(out))


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("world", [2, 3])
def test_conversion_called_on_every_rank_at_once_writes_each_file_once(tmp_path, world):
    # With one shared temporary name (path + ".tmp") this fails at either world: a rank's rename finds the
    # temporary already renamed by another (FileNotFoundError), as the issue reports.
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    for listing in run_ranks(_save_then_convert_everywhere_body, world, str(ckpt), str(out), 4, timeout=TIMEOUT):
        assert listing == ["model.safetensors", "pytorch_model.bin", "w.safetensors"], listing  # no temporaries left
    # The same bytes as one writer alone: concurrent writers replace the file with identical content.
    from zero_engine.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    alone = tmp_path / "alone"
    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(alone))
    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(alone), safe_serialization=True)
    for name in ("pytorch_model.bin", "model.safetensors"):
        assert sha256(out / name) == sha256(alone / name), name
    state = torch.load(out / "pytorch_model.bin")
    reference = zero_engine.checkpoint.get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state)


def test_private_temporaries_are_renamed_in_removed_on_error_and_cleaned_after_a_crash(tmp_path):
    target = tmp_path / "pytorch_model.bin"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    crashed = tmp_path / f"pytorch_model.bin.tmp-{_atomic._HOST_IN_NAME}-{child.pid}-0123abcd"  # its writer is gone
    writing = tmp_path / f"pytorch_model.bin.tmp-{_atomic._HOST_IN_NAME}-{os.getpid()}-4567abcd"  # still writing
    elsewhere = tmp_path / f"pytorch_model.bin.tmp-another_host-{child.pid}-89abcdef"  # liveness unknown
    for leftover in (crashed, writing, elsewhere):
        leftover.write_bytes(b"partial")
    with pytest.raises(OSError):
        with _atomic.private_temporary(str(target)) as tmp:
            open(tmp, "wb").close()
            raise OSError("disk full")
    assert not target.exists() and not crashed.exists() and writing.exists() and elsewhere.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([writing.name, elsewhere.name])  # its own removed
    with _atomic.private_temporary(str(target)) as tmp:
        assert os.path.basename(tmp) not in (target.name + ".tmp", writing.name)
        with open(tmp, "wb") as f:
            f.write(b"whole")
    assert target.read_bytes() == b"whole"
