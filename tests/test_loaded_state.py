"""``model.load_state_dict`` after ``initialize`` reaches the engine's shards and fp32 masters (loaded_state.py).

Before, at stages 1-2 and at stage 0 in bf16 the next step wrote the loaded weights over from the old masters, and at
stage 3 torch refused every key ("size mismatch ... torch.Size([0])").
"""

from __future__ import annotations

import copy

import pytest
import torch

import zero_engine
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPT, GPTConfig, make_batches
from zero_engine.utils import safe_get_full_fp32_param

from test_zero3 import full_params

TIMEOUT = 120


def _config(stage: int, bf16: bool, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": bf16},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 40, **zero}}


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(frozen_param=True))  # tied embedding, a frozen parameter, buffers


def _load_then_train_body(stage: int, bf16: bool, zero: dict):
    loaded = _gpt(1).state_dict()  # other weights than the engine's model: all must come from the load
    engine, *_ = zero_engine.initialize(model=_gpt(0), config=_config(stage, bf16, **zero))
    if stage == 3 and not zero:  # a prefetch in flight and a parameter held whole by persistence, at the load
        x, y = make_batches(engine.module.cfg, 1, 2, seed=3)[0]
        engine(x, y)
    result = engine.module.load_state_dict(loaded)
    masters = {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters() if p.requires_grad}
    reference = _gpt(0)
    reference.load_state_dict(loaded)
    if bf16:
        reference.to(torch.bfloat16)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    losses, ref_losses = [], []
    for x, y in make_batches(engine.module.cfg, 3, 2, seed=1):  # the same micro-batch on every rank
        engine.backward(loss := engine(x, y))
        engine.step()
        ref_opt.zero_grad()
        (ref_loss := reference(x, y)).backward()
        ref_opt.step()
        losses.append(loss.float().item())
        ref_losses.append(ref_loss.float().item())
    ours = full_params(engine)
    same = sorted(n for n, p in reference.named_parameters() if not torch.equal(ours[n], p.detach()))
    exact = sorted(n for n, m in masters.items() if not torch.equal(m, loaded[n].float()))
    engine.destroy()
    return str(result), exact, losses, ref_losses, same


CASES = [(stage, bf16, {}) for stage in (0, 1, 2, 3) for bf16 in (False, True)] + [
    (3, False, {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}),
    (3, False, {"zero_hpz_partition_size": 2})]


@pytest.mark.parametrize("stage,bf16,zero", CASES, ids=[
    f"stage{s}-{'bf16' if b else 'fp32'}{'-' + '-'.join(z) if z else ''}" for s, b, z in CASES])
def test_load_state_dict_after_initialize_trains_from_the_loaded_weights(stage, bf16, zero):
    """Every key matched; the fp32 masters hold the loaded fp32 values exactly; training goes on from them as one
    process trains from the same load (fp32 bitwise; bf16: the reference trains in bf16 without masters, so the
    first loss only is bitwise)."""
    world = 4 if "zero_hpz_partition_size" in zero else 2
    for result, exact, losses, ref_losses, same in run_ranks(_load_then_train_body, world, stage, bf16, zero,
                                                              timeout=TIMEOUT):
        assert result == "<All keys matched successfully>", result
        assert exact == [], f"masters differ from the loaded values: {exact}"
        if bf16:
            assert losses[0] == ref_losses[0], (losses, ref_losses)
        else:
            assert losses == ref_losses, (losses, ref_losses)
            assert same == [], same


def _refusals_body():
    engine, *_ = zero_engine.initialize(model=_gpt(0), config=_config(3, False))
    loaded = _gpt(1).state_dict()
    out = {}
    wrong = copy.copy(loaded)
    wrong["blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    for name, call in (("shape", lambda: engine.module.load_state_dict(wrong)),
                       ("assign", lambda: engine.module.load_state_dict(loaded, assign=True))):
        try:
            call()
            out[name] = "no error"
        except Exception as error:  # noqa: BLE001 -- the message is the result
            out[name] = f"{type(error).__name__}: {error}"
    out["unchanged by the refused loads"] = torch.equal(safe_get_full_fp32_param(engine.module.wte.weight),
                                                        _gpt(0).wte.weight.detach())
    missing = dict(loaded)
    missing.pop("blocks.1.mlp.fc.bias")
    out["non-strict"] = engine.module.load_state_dict(missing, strict=False).missing_keys
    block = {k.removeprefix("blocks.0."): v * 2 for k, v in loaded.items() if k.startswith("blocks.0.")}
    out["a submodule's load"] = str(engine.module.blocks[0].load_state_dict(block))
    out["its values"] = torch.equal(safe_get_full_fp32_param(engine.module.blocks[0].mlp.fc.weight),
                                    block["mlp.fc.weight"])
    engine.destroy()
    return out


def test_a_wrong_shape_and_assign_are_refused_with_the_key_and_missing_keys_are_reported():
    """A refused load writes nothing (the values wait for the end of the load); a submodule's load_state_dict writes
    too (the load's root is the module it was called on)."""
    out = run_ranks(_refusals_body, 2, timeout=TIMEOUT)[0]
    assert out["unchanged by the refused loads"] and out["its values"], out
    assert out["a submodule's load"] == "<All keys matched successfully>", out
    assert "size mismatch for blocks.0.attn.qkv.weight: copying a param with shape torch.Size([3, 3])" in out["shape"]
    assert "the shape in current model is torch.Size([99, 33])" in out["shape"], out["shape"]
    assert out["assign"].startswith("UsageError") and "assign=True" in out["assign"], out["assign"]
    assert out["non-strict"] == ["blocks.1.mlp.fc.bias"], out["non-strict"]


def test_load_state_dict_after_initialize_under_nvme_offload(tmp_path):
    """Shards and fp32 masters in files between uses: the load writes the values there too."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    zero = {"offload_param": nvme, "offload_optimizer": nvme}
    for result, exact, losses, ref_losses, same in run_ranks(_load_then_train_body, 2, 3, False, zero,
                                                              timeout=TIMEOUT):
        assert result == "<All keys matched successfully>" and exact == [], (result, exact)
        assert losses == ref_losses and same == [], (losses, ref_losses, same)
