"""DeepSpeed's public API under zero_engine: each accessor against DeepSpeed's documented behaviour.

The behaviour checked is DeepSpeed's (deepspeed/runtime/engine.py, deepspeed/utils/tensor_fragment.py, deepspeed/
comm/comm.py, deepspeed/runtime/zero/partition_parameters.py), where docs/deepspeed_compat.md says "same"; the
differences it lists are checked as what we do instead. Bodies named ``_*_body`` run on 2 simulated ranks.
"""

from __future__ import annotations

import argparse
import math
import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero_engine
import zero_engine as deepspeed
from zero_engine.initialize import _config_from
from zero_engine.testing import run_ranks
from zero_engine.zero import ParamStatus

TIMEOUT = 120


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.b = nn.Linear(10, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.b(torch.relu(self.a(x)))).pow(2).mean()


def config(stage, gas=2, optimizer="AdamW", **extra):
    params = {"lr": 1e-2, "weight_decay": 0.0} if optimizer == "AdamW" else {"lr": 0.1}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
           "optimizer": {"type": optimizer, "params": params},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    cfg.update(extra)
    return cfg


def batch(i):
    g = torch.Generator().manual_seed(100 + 10 * i + dist.get_rank())
    return torch.randn(2, 6, generator=g)


def make_engine(stage, **kw):
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Small(), config=config(stage, **kw))
    return engine


# ---- accessors -----------------------------------------------------------------------------------------------------
def _accessors_body(stage):
    engine = make_engine(stage)
    got = {
        "batch": (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                  engine.gradient_accumulation_steps(), engine.get_batch_info()),
        "zero": (engine.zero_optimization(), engine.zero_optimization_stage(),
                 engine.zero_optimization_partition_gradients(), engine.zero_optimization_partition_weights()),
        "precision": (engine.fp16_enabled(), engine.bfloat16_enabled(), engine.dynamic_loss_scale()),
        "where": (engine.global_rank, engine.world_size, engine.dp_world_size, engine.mp_world_size,
                  engine.local_rank == int(os.environ.get("LOCAL_RANK", "0")), engine.device.type),
        "optimizer": (engine.optimizer_name(), engine.get_lr(), engine.get_mom()),
    }
    # DeepSpeed: is_gradient_accumulation_boundary() answers for the micro-batch in progress; micro-steps are
    # counted by step(); backward() returns the loss divided by gradient_accumulation_steps.
    sequence = [engine.is_gradient_accumulation_boundary()]
    loss = engine(batch(0))
    returned = engine.backward(loss)
    got["returned"] = torch.allclose(returned, loss / 2)
    sequence.append(engine.is_gradient_accumulation_boundary())
    engine.step()
    sequence += [engine.was_step_applied(), engine.is_gradient_accumulation_boundary()]
    engine.backward(engine(batch(1)))
    sequence.append(engine.is_gradient_accumulation_boundary())
    engine.step()
    sequence += [engine.was_step_applied(), engine.is_gradient_accumulation_boundary(), engine.global_steps]
    got["sequence"] = sequence
    engine.set_train_batch_size(16)
    got["set_train_batch_size"] = engine.get_batch_info()
    engine.set_train_micro_batch_size(1)
    got["set_train_micro_batch_size"] = engine.get_batch_info()
    return got


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_accessors_follow_deepspeed(stage):
    for rank, got in enumerate(run_ranks(_accessors_body, 2, stage, timeout=TIMEOUT)):
        assert got["batch"] == (8, 2, 2, (8, 2, 2))
        assert got["zero"] == (stage > 0, stage, stage >= 2, stage >= 3)
        assert got["precision"] == (False, False, False)
        assert got["where"] == (rank, 2, 2, 1, True, "cpu")
        assert got["optimizer"] == ("adamw", [1e-2], [(0.9, 0.999)])
        assert got["returned"]
        # before, after backward 1, [step: applied?, boundary], after backward 2, [step: applied?, boundary, steps]
        assert got["sequence"] == [False, False, False, True, True, True, False, 1]
        assert got["set_train_batch_size"] == (16, 2, 4)
        assert got["set_train_micro_batch_size"] == (8, 1, 4)


def _cur_scale_body(stage):
    engine = make_engine(stage, fp16={"enabled": True, "initial_scale_power": 8})
    opt = engine.optimizer
    got = [engine.loss_scale(), opt.cur_scale, opt.loss_scale]
    opt.cur_scale = 2.0 ** 20  # DeepSpeed lets the scale be set through the optimizer too
    got.append(engine.loss_scaler.scale)
    engine.backward(engine(batch(0).half()))
    engine.backward(engine(batch(1).half()))
    engine.step()  # 1 * 2**20 scaled gradients of a tiny model: finite; the dynamic scale holds for the window
    got.append(opt.cur_scale == engine.loss_scaler.scale)
    bf16 = make_engine(stage, bf16={"enabled": True})
    try:
        bf16.optimizer.cur_scale = 4.0
        refused = None
    except ValueError as error:
        refused = str(error)
    return got, bf16.optimizer.cur_scale, refused


@pytest.mark.parametrize("stage", [0, 3])
def test_optimizer_cur_scale_is_the_current_loss_scale(stage):
    for got, bf16_scale, refused in run_ranks(_cur_scale_body, 2, stage, timeout=TIMEOUT):
        assert got == [0, 256.0, 256.0, 2.0 ** 20, True], got
        assert bf16_scale == 1.0
        assert refused is not None and "fp16.enabled" in refused, refused


def _manual_boundary_body():
    engine = make_engine(3)  # gas 2 in the config
    before = [p.detach().clone() for p in engine.module.parameters() if p.ds_numel == 0]  # none: all partitioned
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(engine(batch(0)))
    engine.step()
    first = (engine.was_step_applied(), engine.global_steps)
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(engine(batch(1)))
    engine.backward(engine(batch(2)))
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(batch(3)))
    engine.step()  # one step after four micro-batches, as DeepSpeed's docstring shows
    return first, engine.was_step_applied(), engine.global_steps, len(before)


def test_set_gradient_accumulation_boundary_lets_the_loop_own_the_boundary():
    for first, applied, steps, whole in run_ranks(_manual_boundary_body, 2, timeout=TIMEOUT):
        assert first == (False, 0) and applied and steps == 1 and whole == 0


def _no_sync_body(stage):
    engine = make_engine(stage, gas=1)
    try:
        with engine.no_sync():
            engine.backward(engine(batch(0)))
            try:
                engine.step()
                inside = "stepped"
            except RuntimeError as e:
                inside = str(e)
    except RuntimeError as e:
        return "refused", str(e)
    engine.backward(engine(batch(1)))
    engine.step()
    return inside, engine.global_steps, engine.micro_steps


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_sync_refused_at_stages_2_and_3_like_deepspeed(stage):
    for got in run_ranks(_no_sync_body, 2, stage, timeout=TIMEOUT):
        if stage >= 2:
            assert got[0] == "refused" and f"ZeRO stage {stage}" in got[1]
        else:  # micro-batches under no_sync are not counted; step() inside is an error
            assert "inside engine.no_sync()" in got[0] and got[1:] == (1, 1)


def _no_sync_parity_body():
    """Stage 1, gas 1: two backward passes (one under no_sync) then one step == one step on both batches."""
    a = make_engine(1, gas=1, optimizer="SGD")
    with a.no_sync():
        a.backward(a(batch(0)) / 2)
    a.backward(a(batch(1)) / 2)
    a.step()
    b = make_engine(1, gas=1, optimizer="SGD")
    b.backward((b(batch(0)) + b(batch(1))) / 2)
    b.step()
    return max((p - q).abs().max().item() for p, q in zip(a.module.parameters(), b.module.parameters()))


def test_no_sync_accumulates_locally_and_reduces_at_the_step():
    for diff in run_ranks(_no_sync_parity_body, 2, timeout=TIMEOUT):
        assert diff < 1e-6


def _destroy_body():
    engine = make_engine(3, gas=1)
    engine.eval()
    with torch.no_grad():
        engine(batch(0))
    engine.empty_partition_cache()
    cached = engine.memory_stats()["params_gathered"], {p.ds_status for p in engine.module.parameters()}
    engine.destroy()
    engine.destroy()
    try:
        engine.module(batch(0))
        after = "forward ran"
    except RuntimeError as e:
        after = str(e)
    return cached, after


def test_empty_partition_cache_and_destroy():
    for (gathered, statuses), after in run_ranks(_destroy_body, 2, timeout=TIMEOUT):
        assert gathered == 0 and statuses == {ParamStatus.NOT_AVAILABLE}
        assert "partitioned (ZeRO-3)" in after  # no hooks gather any more


# ---- ds_* properties -----------------------------------------------------------------------------------------------
def _ds_properties_body():
    engine = make_engine(3)
    rows = []
    for name, p in engine.module.named_parameters():
        try:
            p.ds_numel = 5
            writable = True
        except AttributeError:
            writable = False
        rows.append((name, p.ds_numel, tuple(p.ds_shape), p.ds_tensor.numel(), p.ds_status, p.ds_id, writable,
                     p.numel(), p.ds_persist))
    return rows


def test_ds_properties_are_read_only_views_of_the_partition():
    for rows in run_ranks(_ds_properties_body, 2, timeout=TIMEOUT):
        shapes = {"a.weight": (10, 6), "a.bias": (10,), "b.weight": (3, 10), "b.bias": (3,),
                  "frozen.weight": (3, 3), "frozen.bias": (3,)}
        assert [r[0] for r in rows] == list(shapes)
        for name, numel, shape, shard, status, _, writable, visible, persist in rows:
            assert shape == shapes[name] and numel == math.prod(shape) and shard == math.ceil(numel / 2)
            assert status is ParamStatus.NOT_AVAILABLE and visible == 0 and not persist and not writable
        assert len({r[5] for r in rows}) == len(rows)  # ds_id unique


# ---- deepspeed.utils -----------------------------------------------------------------------------------------------
def _utils_body(stage):
    engine = make_engine(stage, gas=1, optimizer="SGD")
    u = deepspeed.utils
    params = dict(engine.module.named_parameters())
    w = params["a.weight"]
    out = {}
    # fp32 params: set then get (full), local view of the same
    value = torch.arange(60, dtype=torch.float32).view(10, 6) / 100
    u.safe_set_full_fp32_param(w, value)
    out["full_roundtrip"] = torch.equal(u.safe_get_full_fp32_param(w), value)
    if stage > 0:
        local = u.safe_get_local_fp32_param(w)
        out["local_numel"] = local.numel() == w.ds_tensor.numel()
        u.safe_set_local_fp32_param(w, local + 1)
        out["local_set"] = torch.equal(u.safe_get_full_fp32_param(w), value + 1)
        u.safe_set_full_fp32_param(w, value)
    out["frozen"] = u.safe_get_full_fp32_param(params["frozen.weight"]) is None
    # the model computes with the value that was set
    with zero_engine.zero.GatheredParameters([w]):
        out["compute_copy"] = torch.equal(w.detach().float(), value)
    # gradients: valid between backward and the step; zero them and the SGD step changes nothing
    out["grad_before"] = u.safe_get_full_grad(w) is None
    engine.backward(engine(batch(0)))
    grads = {n: u.safe_get_full_grad(p) for n, p in params.items()}
    out["grad_shapes"] = all(grads[n].shape == params[n].ds_shape if stage == 3 else grads[n].shape == params[n].shape
                             for n in grads if n.startswith(("a.", "b.")))
    if stage >= 2:
        local = u.safe_get_local_grad(w)
        u.safe_set_local_grad(w, local)
    before = {n: u.safe_get_full_fp32_param(p) for n, p in params.items() if p.requires_grad}
    for n, p in params.items():
        if p.requires_grad:
            u.safe_set_full_grad(p, torch.zeros(p.ds_shape if stage == 3 else p.shape))
    engine.step()
    after = {n: u.safe_get_full_fp32_param(p) for n, p in params.items() if p.requires_grad}
    out["zero_grad_no_change"] = all(torch.equal(before[n], after[n]) for n in before)
    out["grad_after_step"] = u.safe_get_full_grad(w) is None
    return out, {n: g for n, g in grads.items() if g is not None}


def _reference_grads():
    """Full-batch gradient of both ranks' micro-batches (batch(0) on ranks 0 and 1), with the value set above."""
    torch.manual_seed(0)
    model = Small()
    with torch.no_grad():
        model.a.weight.copy_(torch.arange(60, dtype=torch.float32).view(10, 6) / 100)
    xs = []
    for rank in range(2):
        g = torch.Generator().manual_seed(100 + rank)
        xs.append(torch.randn(2, 6, generator=g))
    loss = sum(model(x) for x in xs) / 2
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_get_set_helpers(stage):
    ref = _reference_grads()
    for out, grads in run_ranks(_utils_body, 2, stage, timeout=TIMEOUT):
        assert all(out.values()), out
        for n, g in ref.items():
            assert torch.allclose(grads[n].view_as(g), g, rtol=1e-5, atol=1e-7), n


def _optimizer_state_body(stage):
    engine = make_engine(stage, gas=1)
    u = deepspeed.utils
    w = engine.module.b.weight
    try:
        u.safe_get_full_optimizer_state(w, "exp_avg")
        early = "no error"
    except ValueError as e:
        early = str(e)
    engine.backward(engine(batch(0)))
    engine.step()
    state = u.safe_get_full_optimizer_state(w, "exp_avg")
    u.safe_set_full_optimizer_state(w, torch.full_like(state, 0.5), "exp_avg")
    full = u.safe_get_full_optimizer_state(w, "exp_avg")
    local = u.safe_get_local_optimizer_state(w, "exp_avg_sq") if stage > 0 else None
    return early, tuple(state.shape), torch.equal(full, torch.full_like(state, 0.5)), \
        None if local is None else local.numel()


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_optimizer_state_helpers(stage):
    for early, shape, set_ok, local in run_ranks(_optimizer_state_body, 2, stage, timeout=TIMEOUT):
        assert "created by the first applied step" in early
        assert shape == (3, 10) and set_ok
        assert local == (None if stage == 0 else 15)


# ---- refusals, each naming the argument ------------------------------------------------------------------------------
def test_initialize_reads_the_config_like_deepspeed():
    args = argparse.ArgumentParser()
    args = deepspeed.add_config_arguments(args).parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and _config_from(args, None, None) == "ds.json"
    assert _config_from(None, None, {"a": 1}) == {"a": 1}  # config_params, the older name
    assert _config_from(types.SimpleNamespace(deepscale_config="old.json"), None, None) == "old.json"
    with pytest.raises(ValueError, match="both as args.deepspeed_config"):
        _config_from(args, {"train_batch_size": 1}, None)
    with pytest.raises(ValueError, match="config is required"):
        _config_from(types.SimpleNamespace(), None, None)
    with pytest.raises(ValueError, match="has no get_data_parallel_group"):  # an mpu works: tests/test_mesh.py
        deepspeed.initialize(model=nn.Linear(1, 1), config={}, mpu=object())
    with pytest.raises(NotImplementedError, match="mesh_param"):
        deepspeed.initialize(model=nn.Linear(1, 1), config={}, mesh_param=(1, 1))


@pytest.mark.parametrize("kwargs,match", [
    ({"pin_memory": True}, "pin_memory"), ({"remote_device": "nvme"}, "remote_device"),
    ({"mpu": object()}, "mpu"), ({"zero_quantized_weights": True}, "zero_quantized_weights"),
    ({"param_swapper": object()}, "param_swapper"), ({"dtype": torch.int8}, "dtype")])
def test_zero_init_refuses_what_it_cannot_honour(kwargs, match):
    with pytest.raises((NotImplementedError, ValueError), match=match):
        deepspeed.zero.Init(**kwargs)


def test_refused_deepspeed_calls_name_themselves():
    with pytest.raises(NotImplementedError, match="prof=True"):
        deepspeed.comm.all_reduce(torch.zeros(1), prof=True)
    with pytest.raises(NotImplementedError, match="log_summary"):
        deepspeed.comm.log_summary()
    with pytest.raises(NotImplementedError, match="config"):
        deepspeed.init_distributed(dist_backend="gloo", config=object())
    with pytest.raises(AttributeError, match="TiledLinear is not supported"):
        deepspeed.zero.TiledLinear
    assert not hasattr(deepspeed.zero, "MiCS_Init")
    for method in ("offload_states", "reload_states", "_backward_epilogue"):
        with pytest.raises(NotImplementedError, match=method):
            getattr(zero_engine.engine.ZeroEngine, method)(None)


def _zero_init_body():
    from zero_engine.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = Small()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    deepspeed.zero.Init(module=model, dtype=torch.bfloat16)  # an existing model, partitioned now
    statuses = {p.ds_status for p in model.parameters()}
    dtypes = {p.ds_tensor.dtype for p in model.parameters()}
    with deepspeed.zero.Init(config_dict_or_path=config(3, bf16={"enabled": True})):
        built = nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, config=config(3))  # fp32 engine: shards cast back
    full = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters() if p.requires_grad}
    err = max((full[n] - expected[n]).abs().max().item() for n in full)
    return statuses, dtypes, built.weight.ds_tensor.dtype, err, deepspeed.comm.get_world_size()


def test_zero_init_module_dtype_and_config():
    for statuses, dtypes, built, err, world in run_ranks(_zero_init_body, 2, timeout=TIMEOUT):
        assert statuses == {ParamStatus.NOT_AVAILABLE} and dtypes == {torch.bfloat16} and built == torch.bfloat16
        assert err < 1e-2 and world == 2  # the bf16 rounding of the initial values, nothing more


# ---- zero_to_fp32 entry points ---------------------------------------------------------------------------------------
def _save_body(path):
    engine = make_engine(3, gas=1)
    engine.backward(engine(batch(0)))
    engine.step()
    engine.save_checkpoint(path)
    try:
        engine.save_checkpoint(path, exclude_frozen_parameters=True)
    except NotImplementedError as e:
        return {n: deepspeed.utils.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}, str(e)


def test_zero_to_fp32_entry_points(tmp_path):
    from zero_engine.utils import zero_to_fp32

    weights, refused = run_ranks(_save_body, 2, str(tmp_path / "ckpt"), timeout=TIMEOUT)[0]
    assert "exclude_frozen_parameters" in refused
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    for n, w in weights.items():
        if w is not None:
            assert torch.equal(state[n], w), n
    out = tmp_path / "out"
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(out))
    assert torch.load(out / "pytorch_model.bin").keys() == state.keys()
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(out), safe_serialization=True)
    assert (out / "model.safetensors").exists()
    with pytest.raises(NotImplementedError, match="max_shard_size"):
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(out), max_shard_size=100)
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(Small(), str(tmp_path / "ckpt"))
    assert torch.equal(model.a.weight, state["a.weight"])
