"""Gather units (zero_engine/zero/units.py): leaf modules gather their whole subtree as one unit.

Parity: a leaf unit changes when parameters are gathered, never the math, so a run with leaf modules must match
the same run without them bitwise, and the single process within the suite's parity tolerance.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero_engine
from zero_engine import ConfigError
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPT, GPTConfig, make_batches
from zero_engine.utils import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                               set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module)
from zero_engine.zero.units import gather_units, mark_by_granularity

from test_zero3 import ds_config, full_params, train_and_compare

TIMEOUT = 120


# ---- which modules are units -------------------------------------------------------------------------------------
def test_a_leaf_gathers_its_subtree_and_its_descendants_are_no_units():
    model = GPT(GPTConfig(n_layer=2))
    before = {name for name, _, _ in gather_units(model)}
    assert "blocks.0.attn.qkv" in before and "blocks.0" not in before
    marked = set_z3_leaf_modules(model, ["Block"])
    assert marked == list(model.blocks) and all(z3_leaf_module(b) for b in model.blocks)
    units = {name: params for name, _, params in gather_units(model)}
    assert {"blocks.0", "blocks.1"} <= set(units) and not any(n.startswith("blocks.0.") for n in units)
    assert len(units["blocks.0"]) == len(list(model.blocks[0].parameters()))
    assert {n for n in units if not n.startswith("blocks")} == {n for n in before if not n.startswith("blocks")}
    unset_z3_leaf_modules(model, [type(model.blocks[0])])
    assert get_z3_leaf_modules(model) == []


def test_a_container_that_never_runs_cannot_be_a_leaf():
    model = GPT(GPTConfig(n_layer=2))
    set_z3_leaf_modules_by_name(model, ["blocks"])
    with pytest.raises(ValueError, match="blocks: a ModuleList is marked as a ZeRO-3 leaf module, but its forward "
                                         "never runs"):
        list(gather_units(model))


def test_the_estimator_counts_a_leaf_as_one_layer():
    from zero_engine.memory.estimator import count_model_params

    model = GPT(GPTConfig(n_layer=2))
    assert count_model_params(model).largest_layer_name != "blocks.0"
    set_z3_leaf_modules(model, ["Block"])
    counts = count_model_params(model)
    assert counts.largest_layer_name == "blocks.0"
    assert counts.largest_layer_params == sum(p.numel() for p in model.blocks[0].parameters())


def test_leaf_helpers_by_name_and_suffix_and_their_errors():
    model = GPT(GPTConfig(n_layer=2))
    marked, missing = set_z3_leaf_modules_by_name(model, ["blocks.1.mlp", "nope"], raise_if_not_found=False)
    assert marked == [model.blocks[1].mlp] and missing == ["nope"]
    marked, _ = set_z3_leaf_modules_by_suffix(model, ["attn"])
    assert marked == [model.blocks[0].attn, model.blocks[1].attn]
    with pytest.raises(ValueError, match="no module named nope"):
        set_z3_leaf_modules_by_name(model, ["nope"])
    with pytest.raises(ValueError, match="no module of class Missing"):
        set_z3_leaf_modules(model, ["Missing"])


def test_granularity_threshold_follows_deepspeeds_rule():
    """DeepSpeed: granularity = subtree elements // (1 + non-container descendant layers), plain layers and
    containers never leaves, marked top-down. Hand-computed on a two-level model."""
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # a container: never a leaf
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(10, 10), nn.Linear(10, 10)  # 110 elements each
    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair, self.inner, self.head = Pair(), inner, nn.Linear(10, 1)
    model = Top()
    numel = lambda p: p.numel()  # noqa: E731
    # Pair: 220 elements / 3 layers = 73; Top: (220 + 40 + 11) / (3 + 2 + 1 + 1) = 38
    assert mark_by_granularity(model, 37, numel) == []
    assert mark_by_granularity(model, 38, numel) == [model]  # the root first, as DeepSpeed's pre-order walk
    model = Top()
    model.head = nn.Linear(10, 1000)  # Top becomes coarse: (220 + 40 + 11000) / 7 = 1608
    assert mark_by_granularity(model, 73, numel) == [model.pair]


def test_config_leaf_modules_name_their_key_when_nothing_matches():
    from zero_engine.zero.units import apply_leaf_module_config
    from zero_engine.config import load_config

    def cfg(section):
        return load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, "leaf_module": section}},
                           world_size=1).zero_optimization.leaf_module

    model = GPT(GPTConfig(n_layer=1))
    assert apply_leaf_module_config(model, cfg({})) == []  # DeepSpeed's default MoE classes: absent, no error
    assert apply_leaf_module_config(model, cfg({"classes": "Block"})) == [model.blocks[0]]
    with pytest.raises(ConfigError, match=r"leaf_module\.classes: no module of class 'Blok'"):
        apply_leaf_module_config(GPT(GPTConfig(n_layer=1)), cfg({"classes": ["Blok"]}))
    with pytest.raises(ConfigError, match=r"leaf_module\.names: 'blocks\.9'"):
        apply_leaf_module_config(GPT(GPTConfig(n_layer=1)), cfg({"names": ["blocks.9"]}))


# ---- training ----------------------------------------------------------------------------------------------------
def _parity_body(seq, model_kwargs, leaf):
    cfg = GPTConfig(frozen_param=True, reuse_block=True, **model_kwargs)
    return train_and_compare(cfg, ds_config(3, seq, optimizer="SGD", lr=0.05, leaf_module=leaf))


@pytest.mark.parametrize("world,seq,model_kwargs", [(2, False, {}), (3, True, {}),
                                                    (2, False, {"checkpoint_blocks": True})])
def test_leaf_blocks_match_the_single_process(world, seq, model_kwargs):
    for loss_err, param_err in run_ranks(_parity_body, world, seq, model_kwargs, {"classes": ["Block"]},
                                         timeout=TIMEOUT):
        assert loss_err < 1e-5 and param_err < 1e-5, (loss_err, param_err)


def _same_as_per_module_body(zero):
    """The same training with and without leaf blocks: every loss and every parameter bitwise equal, and fewer
    gathers issued with them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(n_layer=3)
    results = []
    for extra in ({}, zero):
        torch.manual_seed(0)
        engine, *_ = zero_engine.initialize(model=GPT(cfg), config=ds_config(3, gas=1, **extra))
        losses = []
        for x, y in make_batches(cfg, 3, 2 * world):
            loss = engine(x[2 * rank: 2 * rank + 2], y[2 * rank: 2 * rank + 2])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        stats = engine.comm_stats()["all_gather"]["calls"]
        results.append((losses, full_params(engine), stats, len(engine.coordinator.trace.events)))
        engine.destroy()
    (l0, p0, calls0, events0), (l1, p1, calls1, events1) = results
    return l0 == l1, all(torch.equal(p0[n], p1[n]) for n in p0), calls1 < calls0, events1 < events0


@pytest.mark.parametrize("zero", [{"leaf_module": {"classes": ["Block"]}},
                                  {"leaf_module": {"name_suffixes": ["attn", "mlp"]}},
                                  {"stage3_module_granularity_threshold": 10**6}])
def test_leaf_units_change_when_not_what(zero):
    for same_losses, same_params, fewer_gathers, fewer_events in run_ranks(_same_as_per_module_body, 2, zero,
                                                                            timeout=TIMEOUT):
        assert same_losses and same_params
        assert fewer_gathers and fewer_events


class Router(nn.Module):
    """A toy mixture of experts: each token goes to one expert, and an expert with no token on this rank is not
    called, so per-module hooks would gather different experts on different ranks."""

    def __init__(self, width: int, experts: int):
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x):
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                out[mask] = expert(x[mask])
        return x + out


class MoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.moe = Router(16, 4)
        self.out = nn.Linear(16, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.out(self.moe(self.inp(x))), y)


def _sgd_config(micro: int, bucket: int) -> dict:
    """Stage 3, SGD, nothing persistent (every parameter gathered), small buckets, a short stall timeout."""
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "reduce_bucket_size": bucket, "stage3_prefetch_bucket_size": bucket},
            "zero_engine": {"stall_timeout_s": 5}}


def _reference_step(reference: nn.Module, opt, loss_of) -> float:
    """One plain SGD step on the full batch; an expert no token reached gets a zero gradient, as under ZeRO."""
    opt.zero_grad()
    loss = loss_of(reference)
    loss.backward()
    for p in reference.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.step()
    return loss.item()


def _moe_body():
    """Ranks route their tokens to different experts; with the router block as a leaf every rank gathers every
    expert in one unit, and training matches one process on the full batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MoEModel()
    reference = MoEModel()
    reference.load_state_dict(model.state_dict())
    set_z3_leaf_modules(model, [Router])
    engine, *_ = zero_engine.initialize(model=model, config=_sgd_config(4, 200))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    routes = []
    for _ in range(4):
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 1, generator=g)
        xs, ys = x[4 * rank: 4 * rank + 4], y[4 * rank: 4 * rank + 4]
        with torch.no_grad():  # the experts this rank's tokens go to (the reference has our weights, up to 1e-7)
            routes.append(sorted(set(reference.moe.gate(reference.inp(xs)).argmax(-1).tolist())))
        ref_loss = _reference_step(reference, ref_opt, lambda m: m(x, y))
        loss = engine(xs, ys)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        worst = max(worst, abs(total.item() / world - ref_loss) / ref_loss)
    ours = full_params(engine)
    ref = dict(reference.named_parameters())
    err = max(((ours[n] - ref[n].detach()).norm() / ref[n].detach().norm()).item() for n in ours)
    engine.destroy()
    return worst, err, routes


def test_mixture_of_experts_block_as_a_leaf_trains_with_different_routes_per_rank():
    results = run_ranks(_moe_body, 2, timeout=TIMEOUT)
    assert results[0][2] != results[1][2], "the ranks must route differently for this test to mean anything"
    for loss_err, param_err, _ in results:
        assert loss_err < 1e-5 and param_err < 1e-5, (loss_err, param_err)


def _mixtral_body():
    """transformers' Mixtral with the default config: its sparse MoE blocks are leaf modules (DeepSpeed's default
    classes), so ranks whose tokens pick different experts still gather the same parameters, and training matches
    one process on the full batch."""
    from transformers import MixtralConfig, MixtralForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1,
                        max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)
    reference = MixtralForCausalLM(cfg)
    reference.load_state_dict(model.state_dict())
    engine, *_ = zero_engine.initialize(model=model, config=_sgd_config(2, 2000))
    units = sorted(engine.coordinator.module_names[m] for m in engine.coordinator.module_params
                   if z3_leaf_module(m))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (2 * world, 16), generator=g)
        ref_loss = _reference_step(reference, ref_opt, lambda m: m(input_ids=ids, labels=ids).loss)
        mine = ids[2 * rank: 2 * rank + 2]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        worst = max(worst, abs(total.item() / world - ref_loss) / ref_loss)
    engine.destroy()
    return units, worst


def test_mixtral_moe_blocks_are_leaves_by_default_and_train():
    pytest.importorskip("transformers")
    for units, loss_err in run_ranks(_mixtral_body, 2, timeout=TIMEOUT):
        assert len(units) == 2 and all(u.startswith("model.layers.") for u in units), units
        assert loss_err < 1e-5, loss_err


def _pytree_walks_body():
    """One training step of the GPT with leaf blocks, counting the hooks' pytree walks and multi-gradient hooks."""
    from zero_engine.zero import hooks

    rank = dist.get_rank()
    cfg = GPTConfig(n_layer=2)
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=ds_config(3, gas=1, leaf_module={"classes": ["Block"]}))
    counts = {"tree_flatten": 0, "register_multi_grad_hook": 0}

    def counted(name):
        original = getattr(hooks, name)

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        return original, wrapper

    originals = {}
    for name in counts:
        originals[name], wrapper = counted(name)
        setattr(hooks, name, wrapper)
    try:
        for x, y in make_batches(cfg, 2, 4):
            loss = engine(x[2 * rank: 2 * rank + 2], y[2 * rank: 2 * rank + 2])
            engine.backward(loss)
            engine.step()
    finally:
        for name, original in originals.items():
            setattr(hooks, name, original)
        engine.destroy()
    return counts


def test_units_called_with_tensors_walk_no_pytree():
    """[Note: the hooks' common case]: every unit of the GPT is called with tensors only and returns one tensor, so
    its hooks neither flatten arguments or outputs nor register multi-gradient hooks."""
    for counts in run_ranks(_pytree_walks_body, 2, timeout=TIMEOUT):
        assert counts == {"tree_flatten": 0, "register_multi_grad_hook": 0}, counts
