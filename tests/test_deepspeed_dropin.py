"""Behaviours DeepSpeed code relies on beyond the accessors (issue 26): an engine without an optimizer, the optimizer
object initialize() returns, attribute access forwarded to the model, and a second engine on a model whose first
engine was destroyed. DeepSpeed 0.19.8 (deepspeed/runtime/engine.py) is the reference; the differences we keep are
rows of docs/deepspeed_compat.md. Bodies named ``_*_body`` run on 2 simulated ranks.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero_engine as deepspeed
from zero_engine.engine import ZeroEngine
from zero_engine.testing import run_ranks
from zero_engine.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_local_fp32_param,
                               safe_set_full_fp32_param)
from zero_engine.zero.partition import sharded_param_of

TIMEOUT = 120


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.b = nn.Linear(10, 3)
        self.magic = 42  # a plain attribute of the user's module

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).pow(2).mean()

    def hello(self, name):
        return f"hello {name}"


def config(stage, optimizer=True, precision="fp32", **extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def batch(i, rank=None):
    """Rank ``rank``'s micro-batch ``i`` (this rank's by default); the two ranks' together are the whole batch."""
    g = torch.Generator().manual_seed(100 + 10 * i + (dist.get_rank() if rank is None else rank))
    return torch.randn(2, 6, generator=g)


# ---- item 1: no optimizer --------------------------------------------------------------------------------------
def _no_optimizer_body():
    out = {}
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            model = Small()
            reference = copy.deepcopy(model)
            engine, optimizer, _, scheduler = deepspeed.initialize(model=model,
                                                                   config=config(stage, False, precision))
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            # one process, the whole batch (both ranks' micro-batches), in the compute dtype
            reference.to(dtype)
            whole = torch.cat([batch(0, r) for r in range(dist.get_world_size())]).to(dtype)
            reference(whole).float().backward()
            loss = engine(batch(0))
            engine.backward(loss)
            grads = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}
            errs = [((grads[n] - p.grad.float()).abs().max() / p.grad.float().abs().max()).item()
                    for n, p in reference.named_parameters()]
            with pytest.raises(RuntimeError, match="no optimizer") as caught:
                engine.step()
            assert isinstance(caught.value, AssertionError)  # what DeepSpeed raises there
            engine.zero_grad()
            engine.eval()
            with torch.no_grad():
                evaluated = engine(batch(1)).float().item()  # inference after the backward: params gathered again
            stats = engine.memory_stats()
            masters = [sp for sp in engine.sharded if sp.master is not None or sp.master_init is not None]
            out[stage, precision] = (optimizer is None, engine.optimizer is None, scheduler is None, max(errs),
                                     stats["master_params"], stats["optimizer_states"], len(masters),
                                     {p.dtype for p in model.parameters()}, evaluated)
            engine.destroy()
    return out


def test_initialize_without_optimizer_partitions_and_runs_forward_and_backward_at_every_stage():
    for results in run_ranks(_no_optimizer_body, 2, timeout=TIMEOUT):
        for (stage, precision), (none, engine_none, no_sched, err, masters, states, n_masters, dtypes,
                                 evaluated) in results.items():
            where = f"stage {stage} {precision}"
            assert none and engine_none and no_sched, where  # DeepSpeed returns None at stage 0 too
            # gradients averaged over the ranks as one process computes them on the whole batch: fp32 to rounding,
            # bf16 to its 8-bit mantissa (one rounding of each rank's gradient, and of the reference's)
            assert err < (1e-5 if precision == "fp32" else 2e-2), (where, err)
            assert masters == 0 and states == 0 and n_masters == 0, where  # no fp32 copies, no optimizer states
            assert dtypes == {torch.bfloat16 if precision == "bf16" else torch.float32}, where
            assert evaluated == evaluated, where  # finite forward under no_grad after backward


def _no_optimizer_refusals_body(path):
    # built under zero.Init in bf16 (which keeps each trainable shard's exact fp32 value for a master): the engine
    # without an optimizer drops those, and runs forward
    cfg = config(3, False, "bf16")
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        torch.manual_seed(0)
        model = Small()
    kept_by_init = sum(sharded_param_of(p).master_init is not None for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    after = sum(sp.master_init is not None or sp.master is not None for sp in engine.sharded)
    loss = engine(batch(0)).float().item()
    engine.destroy()
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Small(), config=config(3, False))
    errors = [(kept_by_init, after, loss == loss)]
    for call in (lambda: engine.save_checkpoint("/nonexistent"), lambda: engine.load_checkpoint("/nonexistent")):
        with pytest.raises(NotImplementedError, match="without an optimizer") as caught:
            call()
        errors.append(str(caught.value))
    engine.destroy()
    model = Small()
    with pytest.raises(ValueError, match="needs an optimizer"):
        deepspeed.initialize(model=model, config={**config(3, False), "scheduler": {"type": "WarmupLR"}})
    engine, *_ = deepspeed.initialize(model=model, config=config(3))  # the failed engine let go of the model
    _train(engine, 1, 0)
    engine.save_checkpoint(path)
    trained = _full_params(model)
    engine.destroy()
    # evaluation of a trained checkpoint: an engine without an optimizer loads its weights
    torch.manual_seed(1)
    evaluator, *_ = deepspeed.initialize(model=Small(), config=config(3, False))
    evaluator.load_checkpoint(path, load_module_only=True)
    loaded = _full_params(evaluator.module)
    evaluator.destroy()
    errors.append(all(torch.equal(loaded[n], trained[n]) for n in trained))
    return errors


def test_without_optimizer_zero_init_masters_are_dropped_weights_load_and_the_rest_is_refused(tmp_path):
    for (kept_by_init, after, finite), *errors, loaded in run_ranks(_no_optimizer_refusals_body, 2, str(tmp_path),
                                                                     timeout=TIMEOUT):
        assert kept_by_init == 4 and after == 0 and finite
        assert len(errors) == 2 and loaded


def _no_optimizer_safe_set_body():
    out = {}
    for stage, precision in ((1, "fp32"), (3, "fp32"), (3, "bf16")):
        torch.manual_seed(0)
        model = Small()
        engine, *_ = deepspeed.initialize(model=model, config=config(stage, False, precision))
        value = torch.randn(10, 6, generator=torch.Generator().manual_seed(7))  # the same on both ranks
        safe_set_full_fp32_param(model.a.weight, value)  # no master: the compute shard takes the value
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        expected = value.to(dtype).float()
        shard = sharded_param_of(model.a.weight).shard_numel
        local = expected.reshape(-1)[dist.get_rank() * shard:][:shard]
        out[stage, precision] = (torch.equal(safe_get_full_fp32_param(model.a.weight), expected),
                                 torch.equal(safe_get_local_fp32_param(model.a.weight)[:local.numel()], local))
        engine.destroy()
    return out


def test_without_optimizer_safe_set_and_get_fp32_param_use_the_compute_shard():
    """What evaluation loaders (Lightning's validate(ckpt_path=file)) use to write whole weights into the shards."""
    for out in run_ranks(_no_optimizer_safe_set_body, 2, timeout=TIMEOUT):
        assert all(all(checks) for checks in out.values()), out


# ---- item 9: the optimizer initialize() returns ------------------------------------------------------------------
def _returned_optimizer_body():
    out = {}
    for kind in ("instance", "callable", "config"):
        torch.manual_seed(0)
        model = Small()
        client = torch.optim.AdamW(model.parameters(), lr=1e-2) if kind == "instance" else \
            (lambda params: torch.optim.SGD(params, lr=0.1)) if kind == "callable" else None
        engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=client, config=config(0, kind == "config"))
        loss = engine(batch(0))
        engine.backward(loss)
        engine.step()  # trains through the engine with the returned object as its optimizer
        out[kind] = (optimizer is client, type(optimizer).__name__, optimizer is engine.optimizer.optimizer,
                     isinstance(optimizer, torch.optim.Optimizer), engine.global_steps)
        engine.destroy()
    for stage, precision in ((0, "bf16"), (1, "fp32")):  # DeepSpeed returns its wrapper here too
        torch.manual_seed(0)
        model = Small()
        client = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=client,
                                                     config=config(stage, False, precision))
        out[stage, precision] = (optimizer is client, optimizer is engine.optimizer)
        engine.destroy()
    return out


def test_stage0_fp32_returns_the_torch_optimizer_itself_as_deepspeed():
    for out in run_ranks(_returned_optimizer_body, 2, timeout=TIMEOUT):
        assert out["instance"] == (True, "AdamW", True, True, 1)
        assert out["callable"][1:] == ("SGD", True, True, 1)
        assert out["config"][1:] == (out["config"][1], True, True, 1)  # the config's Adam kernel, not a wrapper
        assert out[0, "bf16"] == (False, True) and out[1, "fp32"] == (False, True)


# ---- item 12: attributes of the model ---------------------------------------------------------------------------
def _getattr_body():
    torch.manual_seed(0)
    model = Small()
    engine, *_ = deepspeed.initialize(model=model, config=config(3))
    with pytest.raises(AttributeError, match="'ZeroEngine' object has no attribute 'nothing'") as caught:
        engine.nothing
    shallow = copy.copy(engine)  # the copy protocol probes dunders: answered without the module, no recursion
    result = (engine.magic, engine.hello("x"), hasattr(engine, "nothing"), "Small" in str(caught.value),
              engine.train() is engine,  # the engine's own method wins over the module's
              engine.module is model, shallow.module is model)
    engine.destroy()
    return result


def test_engine_forwards_unknown_attributes_to_the_model():
    for result in run_ranks(_getattr_body, 2, timeout=TIMEOUT):
        assert result == (42, "hello x", False, True, True, True, True)


def test_getattr_on_an_engine_without_a_module_does_not_recurse():
    half_built = ZeroEngine.__new__(ZeroEngine)  # as during construction or unpickling: no ``module`` yet
    assert not hasattr(half_built, "anything")
    with pytest.raises(AttributeError, match="no attribute 'module'"):
        half_built.module


# ---- item 8: a second engine on the same model -------------------------------------------------------------------
def _train(engine, steps, start):
    for i in range(start, start + steps):
        loss = engine(batch(i))
        engine.backward(loss)
        engine.step()


def _full_params(model):
    return {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}


def _reinitialize_body(stage, precision, path):
    cfg = config(stage, precision=precision)
    torch.manual_seed(0)
    model = Small()
    uninterrupted_model = copy.deepcopy(model)
    first, *_ = deepspeed.initialize(model=model, config=cfg)
    _train(first, 2, 0)
    first.save_checkpoint(path, tag="t")
    with pytest.raises(RuntimeError, match="already wrapped by a live zero_engine engine"):
        deepspeed.initialize(model=model, config=cfg)
    _train(first, 1, 5)  # moves the weights away from the checkpoint: the load below must bring them back
    before_destroy = _full_params(model)
    first.destroy()
    second, *_ = deepspeed.initialize(model=model, config=cfg)  # adopts the (partitioned) parameters
    adopted = _full_params(model)
    carried = all(torch.equal(adopted[n], before_destroy[n]) for n in adopted)  # fp32 values, not 16-bit copies
    second.load_checkpoint(path, tag="t")
    _train(second, 2, 2)
    resumed = _full_params(model)
    second.destroy()

    uninterrupted, *_ = deepspeed.initialize(model=uninterrupted_model, config=cfg)
    _train(uninterrupted, 4, 0)
    expected = _full_params(uninterrupted_model)
    uninterrupted.destroy()
    return carried, max((resumed[n] - expected[n]).abs().max().item() for n in expected)


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")])
def test_second_engine_after_destroy_loads_and_trains_as_an_uninterrupted_run(tmp_path, stage, precision):
    for carried, diff in run_ranks(_reinitialize_body, 2, stage, precision, str(tmp_path), timeout=TIMEOUT):
        assert carried
        assert diff == 0.0  # the resume is exact (as tests/test_checkpoint.py's)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _other_dtype_body(stage, path):
    """Engine A (dtype X) trains, saves, destroy(); engine B (dtype Y) adopts the same model, loads and trains; a
    fresh model of dtype Y loads the same checkpoint and trains alike (the checkpoint carries the fp32 masters)."""
    out = []
    for first, second in (("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "fp16")):
        tag = f"{first}-{second}"
        torch.manual_seed(0)
        model = Small()
        fresh_model = copy.deepcopy(model)
        engine, *_ = deepspeed.initialize(model=model, config=config(stage, precision=first))
        _train(engine, 2, 0)
        engine.save_checkpoint(path, tag=tag)
        _train(engine, 1, 5)  # away from the checkpoint
        before_destroy = _full_params(model)
        engine.destroy()
        engine, *_ = deepspeed.initialize(model=model, config=config(stage, precision=second))
        adopted = _full_params(model)
        # the old fp32 values (a 16-bit engine's masters), not their 16-bit rounding; whole parameters match them
        carried = all(torch.equal(adopted[n], before_destroy[n]) for n in adopted)
        consistent = stage == 3 or all(p.dtype == DTYPES[second] and torch.equal(p.data, adopted[n].to(p.dtype))
                                       for n, p in model.named_parameters())
        engine.load_checkpoint(path, tag=tag, load_module_only=True)  # another dtype: the fp32 masters only
        _train(engine, 2, 2)
        resumed = _full_params(model)
        engine.destroy()

        fresh, *_ = deepspeed.initialize(model=fresh_model, config=config(stage, precision=second))
        fresh.load_checkpoint(path, tag=tag, load_module_only=True)
        _train(fresh, 2, 2)
        expected = _full_params(fresh_model)
        fresh.destroy()
        out.append((tag, carried, consistent, all(torch.equal(resumed[n], expected[n]) for n in expected)))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_second_engine_with_another_dtype_adopts_loads_and_trains_as_a_fresh_model(tmp_path, stage):
    for results in run_ranks(_other_dtype_body, 2, stage, str(tmp_path), timeout=TIMEOUT):
        assert results == [(tag, True, True, True) for tag in ("bf16-fp32", "fp32-bf16", "bf16-fp16")]


def _collected_body():
    torch.manual_seed(0)
    model = Small()
    engine, *_ = deepspeed.initialize(model=model, config=config(1))
    _train(engine, 1, 0)
    del engine
    gc.collect()  # stages 0-1 put no hooks on the model: nothing keeps an unreferenced engine alive
    engine, *_ = deepspeed.initialize(model=model, config=config(1))
    _train(engine, 1, 1)
    engine.destroy()
    return True


def test_second_engine_after_the_first_was_garbage_collected():
    assert run_ranks(_collected_body, 2, timeout=TIMEOUT) == [True, True]


def _dropped_but_hooked_body(stage):
    from zero_engine import guards

    torch.manual_seed(0)
    model = Small()
    engine, *rest = deepspeed.initialize(model=model, config=config(stage))
    _train(engine, 1, 0)
    del engine, rest
    gc.collect()  # stages 2-3 hook the model (its parameters' gradient hooks reach the reducer through their
    # ShardedParam.grad_reducer, and it the engine)
    with pytest.raises(RuntimeError, match="already wrapped by a live zero_engine engine"):
        deepspeed.initialize(model=model, config=config(stage))
    guards._ENGINE_OF[model]().destroy()  # the engine the hooks kept alive, found as initialize found it
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_an_engine_dropped_without_destroy_is_kept_alive_by_the_hooks_on_its_model(stage):
    # a second engine would hook the same parameters; the first one's gradient hooks would take their gradients
    assert run_ranks(_dropped_but_hooked_body, 2, stage, timeout=TIMEOUT) == [True, True]


def _freed_body(stage, destroy, traced=False, zero=None, compiled=False):
    """Whether a model trained by an engine, and the engine, are freed once the caller drops both (after
    ``destroy()``, or without it), and what a pickle and a copy of a partitioned parameter carry. ``traced``: the
    engine compiled in the traced mode first (zero/traced.py hooks its own leaves); ``compiled``: regionally;
    ``zero``: more zero_optimization keys."""
    import pickle
    import tempfile
    import weakref

    torch.manual_seed(0)
    model = Small()
    if not traced:  # (the traced mode refuses external parameters)
        deepspeed.zero.register_external_parameter(model.b, model.a.weight)  # kept on model.b, not beside it
    cfg = config(stage)
    cfg["zero_optimization"].update(copy.deepcopy(zero or {}))
    for section in cfg["zero_optimization"].values():
        if isinstance(section, dict) and section.get("device") == "nvme":
            section["nvme_path"] = tempfile.mkdtemp()
    engine, *rest = deepspeed.initialize(model=model, config=cfg)
    if traced or compiled:
        engine.compile(backend="aot_eager", traced=traced)
    _train(engine, 1, 0)
    weight = model.a.weight
    refused = 0  # copies of a released parameter: see [Note: a copy of the model] in zero/hooks.py
    for copier in (lambda w: pickle.loads(pickle.dumps(w)), copy.copy, copy.deepcopy):
        try:
            copier(weight)
        except RuntimeError:
            refused += 1
    with deepspeed.zero.GatheredParameters([weight]):
        copies = [pickle.loads(pickle.dumps(weight)), copy.copy(weight), copy.deepcopy(weight)]
    plain = [sharded_param_of(c) is None and type(c) is nn.Parameter and c.shape == (10, 6) for c in copies]
    plain.append(refused == (3 if stage == 3 else 0))
    param, engine_ref = weakref.ref(weight), weakref.ref(engine)
    if destroy:
        engine.destroy()
    del model, engine, rest, weight
    gc.collect()
    return param() is None, engine_ref() is None, plain


@pytest.mark.parametrize("destroy", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_dropped_model_and_its_engine_are_freed_and_copies_of_its_parameters_are_plain(stage, destroy):
    """[Note: a parameter holds its partition state] in partition.py: a registry beside the parameters kept every
    partitioned model (with its shards) for the life of the process, destroyed or not; so did the one of
    register_external_parameter (external.py), for a model that declared one. And at stages 2-3 without destroy()
    the gradient hooks did, holding the reducer where the collector does not look ([Note: one call per gradient] in
    grads.py); while the model lives they still hold its engine
    (test_an_engine_dropped_without_destroy_is_kept_alive_by_the_hooks_on_its_model). A copy or pickle of a gathered
    parameter is a plain nn.Parameter with its whole value; of a released one (stage 3) refused, as it would hold
    nothing ([Note: a copy of the model] in zero/hooks.py)."""
    for freed_param, freed_engine, plain in run_ranks(_freed_body, 2, stage, destroy, timeout=TIMEOUT):
        assert freed_param and freed_engine, (freed_param, freed_engine)
        assert plain == [True, True, True, True], plain


FEATURES = {"offload to CPU": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
            "offload to NVMe": {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}},
            "hpZ": {"zero_hpz_partition_size": 2},
            "qwZ and qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True}}


@pytest.mark.parametrize("feature", list(FEATURES) + ["regional compile"])
def test_a_dropped_model_is_freed_without_destroy_whatever_its_features(feature):
    """The features that hold buffers or hooks of their own (offload's swappers and host buffers, ZeRO++'s secondary
    shards, compiled regions): a model and its engine dropped without destroy() are still freed."""
    zero, compiled = FEATURES.get(feature), feature == "regional compile"
    for freed_param, freed_engine, _ in run_ranks(_freed_body, 2, 3, False, False, zero, compiled, timeout=TIMEOUT):
        assert freed_param and freed_engine, (freed_param, freed_engine)


def test_a_dropped_model_compiled_in_the_traced_mode_is_freed_without_destroy():
    """The traced mode's gradient hooks on its leaves held their piece, and through it the engine: never freed
    without destroy() (see TracedRegion.hook_gradients)."""
    for freed_param, freed_engine, _ in run_ranks(_freed_body, 2, 3, False, True, timeout=TIMEOUT):
        assert freed_param and freed_engine, (freed_param, freed_engine)


def _stage0_after_stage3_body():
    torch.manual_seed(0)
    model = Small()
    engine, *_ = deepspeed.initialize(model=model, config=config(3))
    engine.destroy()
    with pytest.raises(NotImplementedError, match=r"stage 0 on a model whose parameters are partitioned \(a.weight"):
        deepspeed.initialize(model=model, config=config(0))
    engine, *_ = deepspeed.initialize(model=model, config=config(1))  # stages 1-3 adopt the partitioned parameters
    _train(engine, 1, 0)
    engine.destroy()
    return True


def test_stage0_engine_on_parameters_partitioned_before_is_refused_by_name():
    assert run_ranks(_stage0_after_stage3_body, 2, timeout=TIMEOUT) == [True, True]
