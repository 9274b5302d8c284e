"""Checkpoints on simulated ranks: exact resume, loading at another world size, crash consistency, verification,
offline consolidation and the 16-bit model export.

Bodies named ``_*_body`` run on every rank (module level, so the rank pool can import them).

"New processes load": the rank pool reuses its processes across ``run_ranks`` calls, so a resumed run is a new
call that builds a new model (from another seed) and a new engine, and restores everything from the files; nothing
of the saving engine survives in the loading one except what is written in the checkpoint. The RNG states are
checked by drawing from them right after the save and right after the load.

Tolerances: resuming at the same world size must be bitwise identical (losses, compute-dtype parameters, fp32
masters, loss scale): the same shards, states and data go through the same operations. At another world size the
loaded shards are compared bitwise with the saved ones (resharding copies bytes), and the continued training with
the uninterrupted run within the tolerances of test_zero3.py (reductions over another number of ranks sum in
another order: 1e-5 relative on losses, 2e-4 relative L2 on AdamW parameters).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import random
import shutil
import signal

import pytest
import torch
import torch.distributed as dist

import zero_engine
from zero_engine.checkpoint import (CheckpointError, get_fp32_state_dict_from_zero_checkpoint,
                                    load_state_dict_from_zero_checkpoint, verify_checkpoint)
from zero_engine.checkpoint._atomic import publish, resolve_checkpoint
from zero_engine.checkpoint._partition import pieces
from zero_engine.checkpoint._tensorfile import TensorFile, write_tensor_file
from zero_engine.testing import RankError, run_ranks
from zero_engine.testing.models import GPT, GPTConfig, make_batches

TIMEOUT = 120
GAS, MICRO, STEPS, SAVE_STEP = 2, 2, 6, 3


def config(stage, precision="fp32", gas=GAS, micro=MICRO, **extra):
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "stage3_prefetch_bucket_size": 3000,
                                 "stage3_param_persistence_threshold": 40}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    for section, values in extra.items():  # e.g. zero_optimization={...}: merged into that section
        cfg.setdefault(section, {}).update(values)
    return cfg


def tiny_gpt(seed: int, **kw) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(frozen_param=True, **kw))
    model.register_buffer("scale", torch.tensor([1.5, -2.0, 0.25]))  # persistent: saved and restored
    model.register_buffer("scratch", torch.zeros(2), persistent=False)  # not in state_dict: never saved
    return model


def rank_micro_batches(model_cfg: GPTConfig, steps: int, gas: int, micro: int):
    """This rank's micro-batches, step by step: the same global batches whatever the world size."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for x, y in make_batches(model_cfg, steps, world * micro * gas, seed=1):
        for m in range(gas):
            lo = (m * world + rank) * micro
            out.append((x[lo: lo + micro], y[lo: lo + micro]))
    return out


def train(engine, batches, start: int, stop: int) -> list[float]:
    losses = []
    for x, y in batches[start:stop]:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def gathered(engine) -> dict[str, torch.Tensor]:
    """Compute-dtype parameters, fp32 masters and Adam moments whole, gathered by the test itself."""
    out = {}
    if engine.stage == 0:  # whole everywhere already
        for name, p in engine.module.named_parameters():
            out[f"param/{name}"] = p.detach().clone()
            for key, value in engine.optimizer.optimizer.state.get(p, {}).items():
                out[f"optim/{key}/{name}"] = value.clone()
        return out

    def whole(tensor, sp):
        buf = torch.empty(sp.padded_numel, dtype=tensor.dtype)
        dist.all_gather_into_tensor(buf, tensor.contiguous())
        return buf[: sp.numel].view(sp.shape)

    for sp in engine.sharded:
        out[f"param/{sp.fqn}"] = whole(sp.shard, sp)
        if sp.master is not None:
            out[f"master/{sp.fqn}"] = whole(sp.master, sp)
            master = engine.optimizer.masters[id(sp.param)]
            for key, value in engine.optimizer.optimizer.state.get(master, {}).items():
                out[f"optim/{key}/{sp.fqn}"] = whole(value, sp) if value.dim() else value.clone()
    return out


def engine_summary(engine) -> dict:
    return {"counters": (engine.global_steps, engine.micro_steps, engine.global_samples, engine.skipped_steps),
            "scale": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
            "lr": engine.get_lr()}


def draws() -> tuple:
    return torch.rand(3).tolist(), random.random()


def diff_keys(a: dict, b: dict) -> list[str]:
    """Names whose tensors are not bitwise equal (or missing on one side)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


# ---- exact resume at the same world size -------------------------------------------------------------------------
def _resume_save_body(stage, precision, save_dir):
    rank = dist.get_rank()
    cfg = config(stage, precision)
    reference, *_ = zero_engine.initialize(model=tiny_gpt(0), config=cfg)
    batches = rank_micro_batches(reference.module.cfg, STEPS, GAS, MICRO)
    ref_losses = train(reference, batches, 0, len(batches))
    ref_state, ref_summary = gathered(reference), engine_summary(reference)

    engine, *_ = zero_engine.initialize(model=tiny_gpt(0), config=cfg)
    expected_draws = {}
    for tag, stop in (("boundary", SAVE_STEP * GAS), ("mid", SAVE_STEP * GAS + 1)):
        train(engine, batches, engine.micro_steps, stop)
        engine.module.scale.fill_(stop)
        torch.manual_seed(100 + rank)
        random.seed(200 + rank)
        engine.save_checkpoint(save_dir, tag=tag, client_state={"tag": tag, "micro": stop})
        expected_draws[tag] = draws()
    return ref_losses, ref_state, ref_summary, expected_draws


def _resume_load_body(stage, precision, save_dir):
    cfg = config(stage, precision)
    results = {}
    for tag in ("boundary", "mid"):
        engine, *_ = zero_engine.initialize(model=tiny_gpt(seed=7), config=cfg)  # other weights: all from the files
        batches = rank_micro_batches(engine.module.cfg, STEPS, GAS, MICRO)
        path, client_state = engine.load_checkpoint(save_dir, tag=tag)
        loaded_draws, buffer = draws(), engine.module.scale.float().tolist()
        losses = train(engine, batches, engine.micro_steps, len(batches))
        results[tag] = (os.path.basename(path), client_state, loaded_draws, buffer, losses, gathered(engine),
                        engine_summary(engine))
    return results


RESUME_CASES = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16", "fp16")]


@pytest.mark.parametrize("stage,precision", RESUME_CASES)
def test_resume_is_bitwise_identical(tmp_path, stage, precision):
    saved = run_ranks(_resume_save_body, 2, stage, precision, str(tmp_path), timeout=TIMEOUT)
    loaded = run_ranks(_resume_load_body, 2, stage, precision, str(tmp_path), timeout=TIMEOUT)
    assert (tmp_path / "latest").read_text() == "mid"
    for rank, ((ref_losses, ref_state, ref_summary, expected_draws), results) in enumerate(zip(saved, loaded)):
        for tag, start in (("boundary", SAVE_STEP * GAS), ("mid", SAVE_STEP * GAS + 1)):
            name, client_state, loaded_draws, buffer, losses, state, summary = results[tag]
            assert name == tag and client_state == {"tag": tag, "micro": start}
            assert loaded_draws == expected_draws[tag], (rank, tag)  # python and torch RNG states restored
            assert buffer == [float(start)] * 3, buffer
            assert losses == ref_losses[start:], (rank, tag, losses, ref_losses[start:])
            assert diff_keys(state, ref_state) == [], (rank, tag, diff_keys(state, ref_state))
            assert summary == ref_summary, (rank, tag, summary, ref_summary)
        if precision == "fp16":  # the scaler really moved, so restoring it mattered
            assert ref_summary["scale"]["scale"] != 2.0 ** 8


def _between_backward_and_step_body(stage, save_dir):
    from zero_engine.utils import safe_get_full_grad

    cfg = config(stage)
    reference, *_ = zero_engine.initialize(model=tiny_gpt(0), config=cfg)
    batches = rank_micro_batches(reference.module.cfg, STEPS, GAS, MICRO)
    ref_losses = train(reference, batches, 0, len(batches))
    engine, *_ = zero_engine.initialize(model=tiny_gpt(0), config=cfg)
    start = SAVE_STEP * GAS + 1  # through the window's first micro-batch: its backward ran, its step() did not
    train(engine, batches, 0, start - 1)
    engine.backward(engine(*batches[start - 1]))
    weight = engine.module.blocks[0].attn.qkv.weight
    saved = (engine.is_gradient_accumulation_boundary(), safe_get_full_grad(weight))
    engine.save_checkpoint(save_dir, tag="between")
    engine.destroy()
    engine, *_ = zero_engine.initialize(model=tiny_gpt(seed=7), config=cfg)
    engine.load_checkpoint(save_dir, tag="between")
    weight = engine.module.blocks[0].attn.qkv.weight
    loaded = (engine.is_gradient_accumulation_boundary(), safe_get_full_grad(weight))
    engine.step()
    losses = train(engine, batches, start, len(batches))
    return ref_losses[start:], losses, diff_keys(gathered(engine), gathered(reference)), saved, loaded


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_checkpoint_saved_between_backward_and_step_resumes_bitwise(tmp_path, stage):
    """The window's place is saved with the counters: the loaded engine's step() is the boundary's, as the saving
    engine's would have been. Before, the loaded engine took the micro-batch whose backward had run for the next one:
    its step() updated with half the window, and the gradient helpers returned None (no backward since the load)."""
    for ref_losses, losses, differ, saved, loaded in run_ranks(_between_backward_and_step_body, 2, stage,
                                                               str(tmp_path), timeout=TIMEOUT):
        assert not saved[0] and not loaded[0], (saved[0], loaded[0])  # gas 2: its step() ends no window
        assert saved[1] is not None and loaded[1] is not None and torch.equal(saved[1], loaded[1])
        assert losses == ref_losses, (losses, ref_losses)
        assert differ == [], differ


# ---- another world size ------------------------------------------------------------------------------------------
GLOBAL_BATCH = 12  # divisible by 1, 2 and 3 ranks


def _reshard_config(stage, world):
    return config(stage, gas=1, micro=GLOBAL_BATCH // world)


def _reshard_save_body(stage, save_dir):
    world = dist.get_world_size()
    engine, *_ = zero_engine.initialize(model=tiny_gpt(0), config=_reshard_config(stage, world))
    batches = rank_micro_batches(engine.module.cfg, STEPS, 1, GLOBAL_BATCH // world)
    train(engine, batches, 0, SAVE_STEP)
    engine.save_checkpoint(save_dir)
    at_save = gathered(engine)
    losses = train(engine, batches, SAVE_STEP, STEPS)
    # Mid-accumulation at stages 2-3: the reduced gradient shards are resharded like everything else.
    accumulating, *_ = zero_engine.initialize(model=tiny_gpt(0), config=config(stage, gas=2))
    train(accumulating, rank_micro_batches(accumulating.module.cfg, 1, 2, MICRO), 0, 1)
    accumulating.save_checkpoint(save_dir, tag="mid", save_latest=False)
    return at_save, mean_over_ranks(losses), gathered(engine), gathered_grads(accumulating)


def gathered_grads(engine) -> dict[str, torch.Tensor]:
    out = {}
    for sp in engine.sharded:
        grad = engine.reducer.shard_grad(sp) if sp.param.requires_grad else None
        if grad is not None:
            buf = torch.empty(sp.padded_numel, dtype=grad.dtype)
            dist.all_gather_into_tensor(buf, grad.contiguous())
            out[sp.fqn] = buf[: sp.numel].view(sp.shape)
    return out


def local_grads(engine) -> dict[str, torch.Tensor]:
    """Stages 0-1: this rank's own unreduced gradients, as its parameters' ``.grad``."""
    return {name: p.grad.clone() for name, p in engine.module.named_parameters() if p.grad is not None}


def mean_over_ranks(losses: list[float]) -> list[float]:
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def _reshard_load_body(stage, save_dir):
    world = dist.get_world_size()
    engine, *_ = zero_engine.initialize(model=tiny_gpt(seed=7), config=_reshard_config(stage, world))
    engine.load_checkpoint(save_dir)
    at_load = gathered(engine)
    batches = rank_micro_batches(engine.module.cfg, STEPS, 1, GLOBAL_BATCH // world)
    losses = train(engine, batches, engine.micro_steps, STEPS)
    accumulating, *_ = zero_engine.initialize(model=tiny_gpt(7), config=config(stage, gas=2))
    accumulating.load_checkpoint(save_dir, tag="mid")
    return (at_load, mean_over_ranks(losses), gathered(engine), engine.global_steps, gathered_grads(accumulating),
            accumulating.micro_steps)


def relative_l2(ours: dict, reference: dict, prefix: str) -> float:
    names = [k for k in reference if k.startswith(prefix)]
    diff = sum((ours[n].double() - reference[n].double()).pow(2).sum() for n in names).sqrt()
    return (diff / sum(reference[n].double().pow(2).sum() for n in names).sqrt()).item()


@pytest.mark.parametrize("stage", [3, 2])
def test_load_at_another_world_size_reshards_parameters_and_optimizer_states(tmp_path, stage):
    [at_save, ref_losses, ref_final, grads], _ = run_ranks(_reshard_save_body, 2, stage, str(tmp_path),
                                                            timeout=TIMEOUT)
    for world in (3, 1):
        for at_load, losses, final, steps, loaded_grads, micro_steps in run_ranks(
                _reshard_load_body, world, stage, str(tmp_path), timeout=TIMEOUT):
            assert steps == STEPS and micro_steps == 1
            assert grads and diff_keys(loaded_grads, grads) == [], world
            # Parameters, masters and both Adam moments: the same bytes, now split over `world` ranks.
            assert diff_keys(at_load, at_save) == [], (world, diff_keys(at_load, at_save))
            assert any(k.startswith("optim/exp_avg_sq/") for k in at_load)
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            assert worst < 1e-5, (world, losses, ref_losses)
            assert relative_l2(final, ref_final, "param/") < 2e-4, world


def _stage_change_load_body(stage, save_dir):
    """The checkpoint of ``_reshard_save_body`` resumed at ``stage``: at the boundary, and mid-accumulation (its
    gradients, or the refusal and then a load without them)."""
    world = dist.get_world_size()
    engine, *_ = zero_engine.initialize(model=tiny_gpt(seed=7), config=_reshard_config(stage, world))
    engine.load_checkpoint(save_dir)
    at_load, summary = gathered(engine), engine_summary(engine)
    batches = rank_micro_batches(engine.module.cfg, STEPS, 1, GLOBAL_BATCH // world)
    losses = train(engine, batches, engine.micro_steps, STEPS)
    accumulating, *_ = zero_engine.initialize(model=tiny_gpt(7), config=config(stage, gas=2))
    try:
        accumulating.load_checkpoint(save_dir, tag="mid")
        mid = gathered_grads(accumulating) if stage >= 2 else local_grads(accumulating)
    except CheckpointError as error:
        accumulating.load_checkpoint(save_dir, tag="mid", load_optimizer_states=False)
        mid = str(error)
    return at_load, summary, mean_over_ranks(losses), gathered(engine), mid, accumulating.micro_steps


def _local_grads_body(stage, save_dir):
    """Stages 0-1 mid-accumulation: each rank's own unreduced gradients, as its parameters' .grad."""
    engine, *_ = zero_engine.initialize(model=tiny_gpt(0), config=config(stage, gas=2))
    train(engine, rank_micro_batches(engine.module.cfg, 1, 2, MICRO), 0, 1)
    engine.save_checkpoint(save_dir, tag="mid", save_latest=False)
    return local_grads(engine)


@pytest.mark.parametrize("saved,loaded", [(3, 1), (1, 3), (0, 3), (3, 0), (2, 3), (3, 2), (1, 0)])
def test_a_checkpoint_resumes_at_another_stage_with_its_optimizer_states(tmp_path, saved, loaded):
    """[Note: resuming at another stage] in checkpoint/_load.py: the loaded parameters, masters and Adam moments are
    the saved bytes; the counters, LR and training continue as the uninterrupted run (the tolerances of another world
    size: the stages reduce in another order); mid-accumulation gradients load where both stages keep them alike
    (stages 2-3: reduced shards; 0-1: each rank's own) and are refused by name otherwise."""
    [at_save, ref_losses, ref_final, grads], _ = run_ranks(_reshard_save_body, 2, saved, str(tmp_path),
                                                            timeout=TIMEOUT)
    if saved < 2:  # the save body's mid-accumulation checkpoint holds reduced shards at stages 2-3 only
        grads = run_ranks(_local_grads_body, 2, saved, str(tmp_path), timeout=TIMEOUT)
    ref_summary = {"counters": (SAVE_STEP, SAVE_STEP, SAVE_STEP * GLOBAL_BATCH, 0)}
    for rank, (at_load, summary, losses, final, mid, micro_steps) in enumerate(run_ranks(
            _stage_change_load_body, 2, loaded, str(tmp_path), timeout=TIMEOUT)):
        if 0 in (saved, loaded):  # stage 0 in fp32 has no master apart from the parameter
            at_save = {k: v for k, v in at_save.items() if not k.startswith("master/")}
            at_load = {k: v for k, v in at_load.items() if not k.startswith("master/")}
        assert any(k.startswith("optim/exp_avg_sq/") for k in at_load)
        assert diff_keys(at_load, at_save) == [], diff_keys(at_load, at_save)
        assert summary["counters"] == ref_summary["counters"], summary
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert worst < 1e-5, (losses, ref_losses)
        assert relative_l2(final, ref_final, "param/") < 2e-4
        assert micro_steps == 1
        if (saved >= 2) == (loaded >= 2):
            expected = grads if saved >= 2 else grads[rank]
            assert isinstance(mid, dict) and mid and diff_keys(mid, expected) == [], mid
        else:
            assert f"middle of gradient accumulation at stage {saved}" in mid and f"stage {loaded} keeps" in mid
            assert "load_optimizer_states=False" in mid


def _stage1_mid_save_body(save_dir):
    engine, *_ = zero_engine.initialize(model=tiny_gpt(0), config=config(1))
    train(engine, rank_micro_batches(engine.module.cfg, 1, GAS, MICRO), 0, 1)
    engine.save_checkpoint(save_dir)


def _stage1_mid_load_body(save_dir):
    engine, *_ = zero_engine.initialize(model=tiny_gpt(7), config=config(1, micro=2 * MICRO))
    try:
        engine.load_checkpoint(save_dir)
        refused = ""
    except CheckpointError as error:
        refused = str(error)
    path, _ = engine.load_checkpoint(save_dir, load_optimizer_states=False)
    return refused, engine.micro_steps, any(p.grad is not None for p in engine.module.parameters())


def test_stage_1_mid_accumulation_needs_the_same_world_size(tmp_path):
    run_ranks(_stage1_mid_save_body, 2, str(tmp_path), timeout=TIMEOUT)
    refused, micro_steps, has_grads = run_ranks(_stage1_mid_load_body, 1, str(tmp_path), timeout=TIMEOUT)[0]
    assert "middle of gradient accumulation at stage 1 on 2 ranks" in refused and "load_optimizer_states" in refused
    assert micro_steps == 1 and not has_grads  # weights and counters loaded; the partial window is dropped


# ---- verification and refusals -----------------------------------------------------------------------------------
def _save_good_body(save_dir):
    engine, *_ = zero_engine.initialize(model=tiny_gpt(0), config=config(3, "bf16", gas=1))
    train(engine, rank_micro_batches(engine.module.cfg, 1, 1, MICRO), 0, 1)
    engine.save_checkpoint(save_dir, tag="good")
    return gathered(engine)


LOAD_CASES = {  # name: (tag, stage, precision, GPT keyword arguments, load_module_only)
    "ok": ("good", 3, "bf16", {}, False),
    "other_shapes": ("good", 3, "bf16", {"n_embd": 36}, False),
    "other_stage": ("good", 2, "bf16", {}, False),
    "other_dtype": ("good", 3, "fp16", {}, False),
    "module_only_other_stage_and_dtype": ("good", 2, "fp32", {}, True),
    "truncated": ("truncated", 3, "bf16", {}, False),
    "bit_flip": ("bit_flip", 3, "bf16", {}, False),
    "missing": ("missing", 3, "bf16", {}, False),
    "metadata_edited": ("metadata_edited", 3, "bf16", {}, False),
    "no_such_tag": ("nope", 3, "bf16", {}, False),
}


def _load_cases_body(save_dir):
    outcomes = {}
    for case, (tag, stage, precision, model_kw, module_only) in LOAD_CASES.items():
        engine, *_ = zero_engine.initialize(model=tiny_gpt(7, **model_kw), config=config(stage, precision, gas=1))
        before = gathered(engine)
        try:
            engine.load_checkpoint(save_dir, tag=tag, load_module_only=module_only)
            outcomes[case] = ("loaded", gathered(engine))
        except CheckpointError as error:
            outcomes[case] = (str(error), diff_keys(gathered(engine), before))
    return outcomes


def files_fingerprint(directory) -> dict[str, tuple[int, str]]:
    return {str(p): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_corrupt_missing_and_mismatched_checkpoints_are_refused_naming_what_differs(tmp_path):
    [saved, _] = run_ranks(_save_good_body, 2, str(tmp_path), timeout=TIMEOUT)
    good = tmp_path / "good"
    for case in ("truncated", "bit_flip", "missing", "metadata_edited"):
        shutil.copytree(good, tmp_path / case)
    shard = tmp_path / "truncated" / "rank_00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    data = bytearray((tmp_path / "bit_flip" / "rank_00000.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x10
    (tmp_path / "bit_flip" / "rank_00000.safetensors").write_bytes(bytes(data))
    (tmp_path / "missing" / "rank_00001.safetensors").unlink()
    meta = tmp_path / "metadata_edited" / "metadata.json"
    meta.write_text(meta.read_text().replace('"global_steps": 1', '"global_steps": 5'))
    fingerprint = files_fingerprint(tmp_path)

    outcomes = run_ranks(_load_cases_body, 2, str(tmp_path), timeout=TIMEOUT)
    assert files_fingerprint(tmp_path) == fingerprint, "loading modified a checkpoint"
    expected = {
        "other_shapes": ["blocks.0.ln_1.weight is [33] in the checkpoint and [36] in the model", "does not fit"],
        "other_dtype": ["dtype bf16 (this engine: fp16)", "load_module_only=True"],
        "truncated": ["truncated/rank_00001.safetensors is truncated or damaged"],
        "bit_flip": ["bit_flip/rank_00000.safetensors is corrupt"],
        "missing": ["missing/rank_00001.safetensors is missing"],
        "metadata_edited": ["metadata_edited/metadata.json is corrupt"],
        "no_such_tag": ["checkpoint 'nope' not found", "good"],
    }
    for rank, results in enumerate(outcomes):
        assert results["ok"][0] == "loaded" and diff_keys(results["ok"][1], saved) == []
        # another stage resumes (see test_a_checkpoint_resumes_at_another_stage_with_its_optimizer_states)
        assert results["other_stage"][0] == "loaded" and diff_keys(results["other_stage"][1], saved) == []
        message, loaded = results["module_only_other_stage_and_dtype"]
        assert message == "loaded"  # fp32 stage 2 engine: its weights are the saved fp32 masters exactly
        assert all(torch.equal(loaded[f"param/{n}"], saved[f"master/{n}"]) for n in
                   (k.removeprefix("master/") for k in saved if k.startswith("master/")))
        for case, needles in expected.items():
            message, changed = results[case]
            for needle in needles:
                assert needle in message, (rank, case, message)
            assert changed == [], (case, "a refused checkpoint changed the engine")
    # The same checks offline, with no ranks.
    for case, needle in [("truncated", "is truncated"), ("bit_flip", "is corrupt"), ("missing", "is missing"),
                         ("metadata_edited", "metadata.json is corrupt")]:
        with pytest.raises(CheckpointError, match=needle):
            verify_checkpoint(tmp_path, tag=case)


# ---- offline consolidation ---------------------------------------------------------------------------------------
ODD = {"n_embd": 34, "n_head": 2}  # most sizes (34, 97 x 34, 137 x 34...) are not divisible by 3 ranks


def _consolidate_body(save_dir, precision):
    engine, *_ = zero_engine.initialize(model=tiny_gpt(0, **ODD), config=config(3, precision, gas=1))
    train(engine, rank_micro_batches(engine.module.cfg, 2, 1, MICRO), 0, 2)
    engine.module.scale.fill_(0.75)
    engine.save_checkpoint(save_dir)
    state = gathered(engine)
    # The live value a consolidated fp32 parameter must equal: the fp32 master, or the parameter itself (fp32
    # training, frozen parameters).
    return {sp.fqn: state.get(f"master/{sp.fqn}", state[f"param/{sp.fqn}"].float()) for sp in engine.sharded}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offline_fp32_consolidation_equals_live_parameters(tmp_path, precision):
    from zero_engine.cli import main

    live = run_ranks(_consolidate_body, 3, str(tmp_path / "ckpt"), precision, timeout=TIMEOUT)[0]
    state_dict = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    model = tiny_gpt(5, **ODD)
    assert list(state_dict) == list(model.state_dict())  # tied name, frozen parameter, persistent buffer; in order
    assert "frozen_gain" in live and diff_keys({k: state_dict[k] for k in live}, live) == []
    assert state_dict["lm_head.weight"] is state_dict["wte.weight"]
    assert state_dict["scale"].tolist() == [0.75] * 3 and state_dict["scale"].dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in state_dict.values())
    load_state_dict_from_zero_checkpoint(model, tmp_path / "ckpt")  # strict
    assert diff_keys({k: v.detach() for k, v in model.state_dict().items()}, state_dict) == []

    assert main(["to-fp32", str(tmp_path / "ckpt"), str(tmp_path / "model.pt")]) == 0
    assert diff_keys(torch.load(tmp_path / "model.pt"), state_dict) == []
    assert main(["to-fp32", str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")]) == 0
    with TensorFile(str(tmp_path / "model.safetensors")) as f:
        written = {name: f.read(name) for name in f.entries}
        assert json.loads(f.metadata["zero_engine.aliases"]) == {"lm_head.weight": "wte.weight"}
    assert diff_keys(written, {k: v for k, v in state_dict.items() if k != "lm_head.weight"}) == []
    if importlib.util.find_spec("safetensors") is not None:  # when installed, it reads our files as its own
        from safetensors.torch import load_file

        assert diff_keys(load_file(str(tmp_path / "model.safetensors")), written) == []


# ---- save_16bit_model --------------------------------------------------------------------------------------------
def _model16_body(save_dir, gather):
    engine, *_ = zero_engine.initialize(model=tiny_gpt(0), config=config(
        3, "bf16", gas=1, zero_optimization={"stage3_gather_16bit_weights_on_model_save": gather}))
    train(engine, rank_micro_batches(engine.module.cfg, 1, 1, MICRO), 0, 1)
    saved = engine.save_16bit_model(save_dir)
    live = {sp.fqn: gathered_param(sp) for sp in engine.sharded}
    released = all(sp.param.numel() == 0 for sp in engine.sharded if not sp.is_persistent)
    return saved, live, released


def test_save_16bit_model_gathers_a_plain_state_dict_on_rank_0(tmp_path):
    saved, live, released = run_ranks(_model16_body, 2, str(tmp_path), True, timeout=TIMEOUT)[0]
    assert saved and released
    state_dict = torch.load(tmp_path / "pytorch_model.bin")
    model = tiny_gpt(5).to(torch.bfloat16)
    assert list(state_dict) == list(model.state_dict())
    assert diff_keys({k: state_dict[k] for k in live}, live) == [] and state_dict["scale"].dtype == torch.bfloat16
    model.load_state_dict(state_dict)  # strict: a drop-in state dict for the plain model

    saved, _, _ = run_ranks(_model16_body, 2, str(tmp_path / "off"), False, timeout=TIMEOUT)[0]
    assert saved is False and not (tmp_path / "off").exists()  # stage 3 without the flag: DeepSpeed's behaviour


# ---- pieces on their own (no ranks) ------------------------------------------------------------------------------
@pytest.mark.parametrize("numel,old_world,new_world", [(1, 4, 3), (5, 3, 2), (7, 4, 3), (12, 4, 1), (33, 2, 3),
                                                       (3, 1, 4)])
def test_pieces_reassemble_any_range_from_saved_shards(numel, old_world, new_world):
    full = torch.arange(numel, dtype=torch.float32)
    old = -(-numel // old_world)
    padded = torch.cat([full, torch.zeros(old * old_world - numel)])
    shards = [padded[r * old: (r + 1) * old] for r in range(old_world)]
    new = -(-numel // new_world)
    for rank in range(new_world):
        start, stop = min(rank * new, numel), min((rank + 1) * new, numel)
        out = torch.full((stop - start,), -1.0)
        for p in pieces(numel, old, start, stop):
            assert p.src_start + p.length <= old  # never reads padding or past a shard
            out[p.dst_start: p.dst_start + p.length] = shards[p.rank][p.src_start: p.src_start + p.length]
        assert torch.equal(out, full[start:stop])
    assert len(pieces(numel, old, 0, numel)) == -(-numel // old)


@pytest.mark.parametrize("piece_numel,ep,edp", [(10, 2, 2), (7, 2, 3), (5, 4, 1), (1, 2, 4), (9, 3, 2)])
def test_pieces_of_an_expert_parameter_reassemble_any_range(piece_numel, ep, edp):
    """An expert parameter saved as ``ep`` pieces (its ep ranks' tensors back to back), each split over ``edp``
    ranks, world rank d * ep + e holding shard d of piece e ([Note: checkpoints of expert parameters]): every range
    of the whole tensor, across pieces included, is read from the right files."""
    numel = piece_numel * ep
    full = torch.arange(numel, dtype=torch.float32)
    shard = -(-piece_numel // edp)
    files = {}
    for e in range(ep):
        padded = torch.cat([full[e * piece_numel: (e + 1) * piece_numel], torch.zeros(shard * edp - piece_numel)])
        for d in range(edp):
            files[d * ep + e] = padded[d * shard: (d + 1) * shard]
    assert sorted(files) == list(range(ep * edp))
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            out = torch.full((stop - start,), -1.0)
            for p in pieces(numel, shard, start, stop, ep):
                assert p.src_start + p.length <= shard
                out[p.dst_start: p.dst_start + p.length] = files[p.rank][p.src_start: p.src_start + p.length]
            assert torch.equal(out, full[start:stop]), (start, stop)
    with pytest.raises(ValueError, match="ep_size=4 does not divide"):
        pieces(6, 3, 0, 6, 4)


def test_tensor_file_round_trip_and_ranges(tmp_path):
    tensors = {"a": torch.randn(5, 7).to(torch.bfloat16), "b": torch.arange(10, dtype=torch.int64),
               "c": torch.tensor(3.5), "d": torch.zeros(0), "e": torch.tensor([True, False])}
    digest = write_tensor_file(str(tmp_path / "f.safetensors"), tensors, {"k": "v"})
    assert digest.nbytes == (tmp_path / "f.safetensors").stat().st_size
    assert digest.sha256 == hashlib.sha256((tmp_path / "f.safetensors").read_bytes()).hexdigest()
    with TensorFile(str(tmp_path / "f.safetensors")) as f:
        assert f.metadata == {"k": "v"}
        assert diff_keys({n: f.read(n) for n in tensors}, tensors) == []
        out = torch.empty(4, dtype=torch.float32)  # another dtype: converted on the way
        f.read_range_into("a", 30, out)
        assert torch.equal(out, tensors["a"].reshape(-1)[30:34].float())
        with pytest.raises(CheckpointError, match=r"elements \[33, 37\) of .a. requested; it has 35"):
            f.read_range_into("a", 33, out)
    with pytest.raises(FileExistsError):  # never overwrites
        write_tensor_file(str(tmp_path / "f.safetensors"), tensors)
    (tmp_path / "g.safetensors").write_bytes((tmp_path / "f.safetensors").read_bytes()[:20])
    with pytest.raises(CheckpointError, match="g.safetensors: not a valid tensor file"):
        TensorFile(str(tmp_path / "g.safetensors"))


def test_interrupted_replacement_of_a_tag_falls_back_to_the_complete_previous_copy(tmp_path, monkeypatch):
    for version in ("old", "new"):
        (tmp_path / f".t.tmp-{version}").mkdir()
        (tmp_path / f".t.tmp-{version}" / "metadata.json").write_text(version)
    publish(str(tmp_path), str(tmp_path / ".t.tmp-old"), "t")
    real_rename = os.rename

    def crash_on_second_rename(src, dst):
        if src.endswith(".tmp-new"):
            raise KeyboardInterrupt("power cut between the two renames")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        publish(str(tmp_path), str(tmp_path / ".t.tmp-new"), "t")
    monkeypatch.undo()
    path, tag = resolve_checkpoint(tmp_path, "t")  # the old copy, complete, read where it is
    assert tag == "t" and path.endswith(".t.previous") and open(os.path.join(path, "metadata.json")).read() == "old"
    publish(str(tmp_path), str(tmp_path / ".t.tmp-new"), "t")  # the next save of the tag cleans up
    assert sorted(os.listdir(tmp_path)) == ["t"] and (tmp_path / "t" / "metadata.json").read_text() == "new"


@pytest.mark.parametrize("tag", ["", "a/b", ".hidden", "latest", ".."])
def test_bad_tags_are_refused(tag):
    from zero_engine.checkpoint._atomic import check_tag

    with pytest.raises(ValueError, match="checkpoint tag"):
        check_tag(tag)


def test_no_latest_means_nothing_to_resume_and_offline_tools_say_what_to_pass(tmp_path):
    assert resolve_checkpoint(tmp_path, None) is None  # load_checkpoint then returns (None, None), as DeepSpeed
    with pytest.raises(CheckpointError, match="no 'latest' file and no metadata.json"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path)


# ---- crash consistency -------------------------------------------------------------------------------------------
def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _crash_body(save_dir, victim, point):
    """Save checkpoint "step1", then die (SIGKILL, rank `victim`) at `point` while saving "step2"."""
    from zero_engine.checkpoint import _save
    from zero_engine.checkpoint._tensorfile import TensorFileWriter

    rank = dist.get_rank()
    engine, *_ = zero_engine.initialize(model=tiny_gpt(0), config=config(3, gas=1))
    batches = rank_micro_batches(engine.module.cfg, 2, 1, MICRO)
    train(engine, batches, 0, 1)
    engine.save_checkpoint(save_dir, tag="step1")
    live = {sp.fqn: gathered_param(sp) for sp in engine.sharded}
    if rank == 0:
        torch.save(live, os.path.join(save_dir, "..", "step1.pt"))
    train(engine, batches, 1, 2)
    if rank == victim and point == "write":
        def write_half_then_die(path, tensors, metadata=None):  # a partial shard file, then the process is gone
            writer = TensorFileWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], metadata)
            for name in list(tensors)[: len(tensors) // 2]:
                writer.add(name, tensors[name])
            _die()

        _save.write_tensor_file = write_half_then_die
    if rank == victim and point == "latest":
        _save.write_latest = lambda *args: _die()  # the directory is published, `latest` not yet updated
    engine.save_checkpoint(save_dir, tag="step2")


def _load_after_crash_body(save_dir):
    engine, *_ = zero_engine.initialize(model=tiny_gpt(seed=7), config=config(3, gas=1))
    path, _ = engine.load_checkpoint(save_dir)
    engine.save_checkpoint(save_dir, tag="step3", save_latest=False)  # also removes leftovers of the crash
    state = {sp.fqn: gathered_param(sp) for sp in engine.sharded}
    return os.path.basename(path), state, engine.global_steps


def gathered_param(sp) -> torch.Tensor:
    buf = torch.empty(sp.padded_numel, dtype=sp.shard.dtype)
    dist.all_gather_into_tensor(buf, sp.shard)
    return buf[: sp.numel].view(sp.shape)


@pytest.mark.parametrize("victim,point", [(1, "write"), (0, "write"), (0, "latest")])
def test_rank_killed_while_saving_leaves_previous_checkpoint_loadable(tmp_path, victim, point):
    save_dir = tmp_path / "ckpt"
    with pytest.raises(RankError) as err:
        run_ranks(_crash_body, 2, str(save_dir), victim, point, timeout=TIMEOUT)
    assert f"rank {victim}: process exited with code -9" in str(err.value)
    assert (save_dir / "latest").read_text() == "step1"
    assert verify_checkpoint(save_dir).tag == "step1"  # every file of step1 intact
    staging = glob.glob(str(save_dir / ".step2.tmp-*"))
    if point == "latest":  # step2 was complete before the kill; only `latest` still names step1
        assert not staging and verify_checkpoint(save_dir, tag="step2").counters["global_steps"] == 2
    else:
        assert not (save_dir / "step2").exists()
        assert bool(staging) == (victim == 0)  # rank 0 removes the staging directory when it survives

    expected = torch.load(tmp_path / "step1.pt")
    if point == "latest":  # offline only: each engine load here costs a new rank pool (the crash killed it)
        state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
        assert diff_keys({k: state[k] for k in expected}, expected) == [], "step1 is not intact"
        return
    name, state, steps = run_ranks(_load_after_crash_body, 2, str(save_dir), timeout=TIMEOUT)[0]
    assert name == "step1" and steps == 1
    assert diff_keys(state, expected) == [], "step1 did not load intact"
    assert not glob.glob(str(save_dir / ".*.tmp-*")), "a later save removes what the crash left"


# ---- a rank that does not join (last: like the crash tests, it ends with a killed rank pool) ---------------
def _model16_one_rank_body(save_dir):
    engine, *_ = zero_engine.initialize(model=tiny_gpt(0), config=config(
        3, gas=1, zero_optimization={"stage3_gather_16bit_weights_on_model_save": True},
        zero_engine={"collective_timeout_s": 2}))
    if dist.get_rank() == 0:
        engine.save_16bit_model(save_dir)


def test_save_16bit_model_called_on_one_rank_is_an_error_not_a_hang(tmp_path):
    with pytest.raises(RankError) as err:
        run_ranks(_model16_one_rank_body, 2, str(tmp_path), timeout=60)
    failure = {f.rank: f for f in err.value.failures}[0]
    assert "save_16bit_model is a collective: every rank must call it" in failure.exception
    assert "Ranks 1 failed to pass monitoredBarrier" in failure.exception
    assert not (tmp_path / "pytorch_model.bin").exists()
