"""Stage-3 parameters used outside their own module's forward (zero/external.py): returned to the caller, read
through another module's attribute, registered with register_external_parameter, read by the model's forward
outside every unit (TRL's fused LM head), and leaf modules whose inputs need no gradient.

Parity: every rank trains on the same micro-batch as the one-process reference (SGD, fp32), so the averaged gradient
is the reference's gradient exactly at world 2 ((g + g) / 2 == g): losses and parameters must be bitwise equal. At
world 3 ((g + g + g) / 3 may round) they must agree to 1e-6 relative.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zero_engine
from zero_engine.testing import run_ranks
from zero_engine.utils import set_z3_leaf_modules
from zero_engine.zero import register_external_parameter, unregister_external_parameter
from zero_engine.zero.partition import ParamStatus, ShardedParam
from zero_engine.zero.units import gather_units

from test_zero3 import full_params  # every parameter whole, gathered by the test itself

TIMEOUT = 120


def _config(**zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def _all_released(engine) -> list[str]:
    """Names of parameters still holding gathered storage (a leak) after a step."""
    return [sp.fqn for sp in engine.sharded
            if sp.status is not ParamStatus.NOT_AVAILABLE or sp.full.untyped_storage().size() != 0]


def _compare(model, step_fn, steps=3, in_dim=5, before_init=None, after_forward=None):
    """Train ``model`` under the engine and a copy in one process with ``step_fn(call, module, x) -> loss``;
    return (bitwise equal?, max relative difference, leaks after any step)."""
    reference = copy.deepcopy(model)
    if before_init is not None:
        before_init(model)
    engine, *_ = zero_engine.initialize(model=model, config=_config())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    equal, worst, leaks = True, 0.0, []
    for _ in range(steps):
        x = torch.randn(2, in_dim, generator=g)
        ref_opt.zero_grad()
        ref_loss = step_fn(reference, reference, x)
        ref_loss.backward()
        ref_opt.step()
        loss = step_fn(engine, engine.module, x)
        if after_forward is not None:
            after_forward(engine)
        engine.backward(loss)
        engine.step()
        leaks += _all_released(engine)
        equal &= torch.equal(loss.detach(), ref_loss.detach())
        worst = max(worst, (abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())))
    ours, ref = full_params(engine), dict(reference.named_parameters())
    for name, value in ours.items():
        equal &= torch.equal(value, ref[name].detach())
        worst = max(worst, ((value - ref[name].detach()).norm() / ref[name].detach().norm()).item())
    return equal, worst, sorted(set(leaks))


def _check(results, world):
    for equal, worst, leaks in results:
        assert not leaks, f"still gathered after the step: {leaks}"
        if world == 2:
            assert equal, f"not bitwise equal at world 2 (max relative difference {worst})"
        assert worst < 1e-6, worst


def _plain_step(call, module, x):
    return call(x)


# ---- a parameter returned from forward (DeepSpeed: kept available for the caller) ---------------------------------
class _ReturnsBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 7, bias=False)
        self.bias = nn.Parameter(torch.randn(7))

    def forward(self, x):
        return self.lin(x), self.bias


class _UsesReturnedBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _ReturnsBias()
        self.scale = nn.Parameter(torch.tensor([1.5, 0.5, 2.0]))  # the root is a unit of its own too
        self.b = nn.Linear(7, 3)

    def forward(self, x):
        h, bias = self.a(x)
        self.seen_status = getattr(bias, "ds_status", None)  # the caller computes with it after `a` ended
        return (self.b(torch.tanh(h * bias + bias)) * self.scale).square().mean()


def _returned_body():
    torch.manual_seed(0)
    seen = []
    result = _compare(_UsesReturnedBias(), _plain_step,
                      after_forward=lambda engine: seen.append((engine.module.seen_status,
                                                                engine.module.a.bias.ds_status)))
    return result, seen


@pytest.mark.parametrize("world", [2, 3])
def test_parameter_returned_from_forward_stays_available_until_the_step_ends(world):
    results = run_ranks(_returned_body, world, timeout=TIMEOUT)
    _check([r for r, _ in results], world)
    for _, seen in results:
        # available for the caller, still after the forward (the backward needs it), released by the step's end
        assert seen == [(ParamStatus.AVAILABLE, ParamStatus.AVAILABLE)] * 3, seen


def _returned_without_grad_body():
    """Evaluation: no backward follows, so the returned parameter is held only until the model's forward returns."""
    torch.manual_seed(0)
    model = _UsesReturnedBias()
    reference = copy.deepcopy(model)
    engine, *_ = zero_engine.initialize(model=model, config=_config())
    engine.eval()
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = engine(x)
        expected = reference(x)
    return model.seen_status, _all_released(engine), torch.equal(loss, expected)


def test_parameter_returned_from_forward_without_gradients_is_released_when_the_model_returns():
    for seen, leaks, equal in run_ranks(_returned_without_grad_body, 2, timeout=TIMEOUT):
        assert seen is ParamStatus.AVAILABLE and not leaks and equal, (seen, leaks, equal)


# ---- another module's parameter read through an attribute (DeepSpeed's automatic external parameters) -------------
class _ReadsSibling(nn.Module):
    def __init__(self, owner: nn.Module):
        super().__init__()
        self.w = nn.Parameter(torch.randn(7, 7) * 0.3)
        self.owner = [owner]  # a plain list: the owner is not a submodule of this one

    def forward(self, x):
        return x @ self.w + F.linear(x, self.owner[0].weight)  # the sibling's weight, after the sibling ran


class _SiblingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(5, 7)
        self.a = nn.Linear(7, 7)
        self.r = _ReadsSibling(self.a)
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.r(self.a(self.emb(x))))).square().mean()


def _sibling_body():
    torch.manual_seed(0)
    model = _SiblingModel()
    result = _compare(model, _plain_step, steps=3)
    return result


@pytest.mark.parametrize("world", [2, 3])
def test_sibling_weight_read_in_forward_is_gathered_for_the_reader(world):
    _check(run_ranks(_sibling_body, world, timeout=TIMEOUT), world)


def _reader_unit_body():
    torch.manual_seed(0)
    model = _SiblingModel()
    engine, *_ = zero_engine.initialize(model=model, config=_config())
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 5)))
        engine.step()
    trace = engine.coordinator.trace
    recorded = {f"{e.module}:{e.phase}": [sp.fqn for sp in params] for e, params in zip(trace.events, trace.params)}
    return [sp.fqn for sp in engine.coordinator.module_params[model.r]], recorded


def test_a_read_joins_the_readers_unit_in_the_trace_that_prefetching_follows():
    for unit, recorded in run_ranks(_reader_unit_body, 2, timeout=TIMEOUT):
        assert unit == ["r.w", "a.weight"], unit
        assert recorded["r:forward"] == recorded["r:backward"] == ["r.w", "a.weight"], recorded


# ---- register_external_parameter: a parameter the reader gets without an attribute read ---------------------------
class _ArgReader(nn.Module):
    def __init__(self, shared: nn.Parameter, own: bool):
        super().__init__()
        self.shared = [shared]  # a plain list: reading it does not go through a module's parameters
        if own:
            self.gain = nn.Parameter(torch.full((7,), 0.9))

    def forward(self, x):
        y = x * self.shared[0]
        return y * self.gain if hasattr(self, "gain") else y


class _RegisteredModel(nn.Module):
    def __init__(self, own: bool):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.reader = _ArgReader(self.a.bias, own)
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        return self.head(self.reader(torch.tanh(self.a(x)))).square().mean()


def _registered_before_body():
    torch.manual_seed(0)
    model = _RegisteredModel(own=False)  # the reader has no parameters: registration makes it a unit
    return _compare(model, _plain_step,
                    before_init=lambda m: register_external_parameter(m.reader, m.a.bias))


@pytest.mark.parametrize("world", [2, 3])
def test_register_external_parameter_before_initialize(world):
    _check(run_ranks(_registered_before_body, world, timeout=TIMEOUT), world)


def _registered_after_body():
    torch.manual_seed(0)
    model = _RegisteredModel(own=True)
    engine, *_ = zero_engine.initialize(model=model, config=_config())
    x = torch.randn(2, 5)
    errors, units = [], []
    try:
        engine(x)  # not registered: the reader's mul() would see an empty shard, and says so
    except RuntimeError as error:
        errors.append(str(error))
    engine.coordinator.release_all()
    register_external_parameter(model.reader, model.a.bias)
    loss = engine(x)
    engine.backward(loss)
    engine.step()
    units.append([sp.fqn for sp in engine.coordinator.module_params[model.reader]])
    unregister_external_parameter(model.reader, model.a.bias)
    units.append([sp.fqn for sp in engine.coordinator.module_params[model.reader]])
    try:
        unregister_external_parameter(model.reader, model.a.bias)
    except ValueError as error:
        errors.append(str(error))
    with zero_engine.zero.GatheredParameters([model.a.bias], fwd_module=model.reader):  # registers, as DeepSpeed
        pass
    units.append([sp.fqn for sp in engine.coordinator.module_params[model.reader]])
    return errors, units, loss.item(), _all_released(engine)


def test_register_and_unregister_external_parameter_after_initialize_and_gathered_parameters_fwd_module():
    for errors, units, loss, leaks in run_ranks(_registered_after_body, 2, timeout=TIMEOUT):
        assert len(errors) == 2, errors
        assert "a.bias is partitioned" in errors[0] and "mul()" in errors[0], errors[0]
        assert "not registered as external" in errors[1], errors[1]
        assert units == [["reader.gain", "a.bias"], ["reader.gain"], ["reader.gain", "a.bias"]], units
        assert loss > 0 and not leaks, (loss, leaks)


def test_register_external_parameter_checks_its_arguments():
    with pytest.raises(TypeError, match="nn.Parameter"):
        register_external_parameter(nn.Linear(1, 1), torch.zeros(1))
    with pytest.raises(TypeError, match="nn.Module"):
        register_external_parameter(object(), nn.Parameter(torch.zeros(1)))
    with pytest.raises(ValueError, match="not registered as external"):
        unregister_external_parameter(nn.Linear(1, 1), nn.Parameter(torch.zeros(1)))
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    register_external_parameter(model[1], nn.Parameter(torch.zeros(3)))  # not the model's
    with pytest.raises(ValueError, match=r"register_external_parameter\(1, \.\.\.\): the parameter \(shape \(3,\)\)"):
        list(gather_units(model))


# ---- TRL's pattern: the LM head's weight read outside lm_head.forward ----------------------------------------------
class _ShapeOnlyHead(torch.autograd.Function):
    """Like TRL's chunked log-prob kernel: loops over the vocabulary by ``weight.shape[0]``, so an empty shard would
    make it compute nothing, silently."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        parts = [hidden @ weight[i: i + 4].t() for i in range(0, weight.shape[0], 4)]
        return torch.cat(parts, dim=-1) if parts else hidden.new_zeros(hidden.shape[0], 0)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ hidden


class _Trunk(nn.Module):
    """A causal LM whose forward can score through ``lm_head.weight`` directly (TRL's fused head): the root has no
    parameters of its own, so that read happens outside every unit."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6))
        self.lm_head = nn.Linear(6, 11, bias=False)

    def forward(self, x, fused: bool = False):
        hidden = self.body(x)
        if not fused:
            return hidden
        logits = _ShapeOnlyHead.apply(hidden, self.lm_head.weight)
        return logits.logsumexp(-1).mean()


def _fused_step(call, module, x):
    return call(x, fused=True)


def _trunk_body(step_fn):
    torch.manual_seed(0)
    return _compare(_Trunk(), step_fn)


@pytest.mark.parametrize("world", [2, 3])
def test_lm_head_weight_read_by_the_models_forward_is_gathered(world):
    _check(run_ranks(_trunk_body, world, _fused_step, timeout=TIMEOUT), world)


def _reference_pass_step(call, module, x):
    """DPO's step with a PEFT policy: the loss's forward, then a forward without gradients of the same model (TRL's
    reference pass, adapters off), then the backward of the first."""
    loss = call(x, fused=True)
    with torch.no_grad():
        module(x, fused=True)
    return loss


@pytest.mark.parametrize("world", [2, 3])
def test_a_forward_without_gradients_before_the_backward_keeps_what_the_backward_reads(world):
    # The second forward's end released the LM head held for the first one's backward, whose kernel then found an
    # empty weight: with TRL's, zero gradients (DPO + LoRA at stage 3 logged grad_norm 0.0).
    _check(run_ranks(_trunk_body, world, _reference_pass_step, timeout=TIMEOUT), world)


def _outside_forward_body(how):
    torch.manual_seed(0)
    model = _Trunk()
    engine, *_ = zero_engine.initialize(model=model, config=_config())
    hidden = engine(torch.randn(2, 5))
    w = model.lm_head.weight  # after the model's forward: nothing gathers it
    try:
        if how == "matmul":
            hidden @ w.T
        elif how == "linear":
            F.linear(hidden, weight=w)
        else:
            torch.cat([w, w])
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("how", ["matmul", "linear", "cat"])
def test_lm_head_weight_used_outside_the_models_forward_raises_naming_it(how):
    for message in run_ranks(_outside_forward_body, 2, how, timeout=TIMEOUT):
        assert "lm_head.weight is partitioned" in message, message


def test_released_parameter_refuses_data_views_kwargs_and_lists():
    p = nn.Parameter(torch.arange(6, dtype=torch.float32).view(2, 3))
    sp = ShardedParam(p, "lm_head.weight", 0, rank=0, world_size=1)
    sp.release()
    for use in (lambda: p.T, lambda: p.mT, lambda: F.linear(torch.ones(1, 3), weight=p), lambda: torch.cat([p, p]),
                lambda: torch.stack((p,))):
        with pytest.raises(RuntimeError, match="lm_head.weight is partitioned"):
            use()
    assert p.shape == (0,) and p.grad is None and p.data.numel() == 0 and p.requires_grad  # metadata still reads


def _trl_body():
    pytest.importorskip("trl")
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    add_fused_lm_head(model)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (2, 9), generator=g)

    def step(call, module, x):
        return call(input_ids=ids, labels=ids, fused_lm_head=True).loss

    return _compare(model, step)


def test_trl_fused_lm_head_on_llama_trains_as_one_process():
    # Not bitwise (6e-8 relative seen): plain Llama without the fused head is 4e-8 from one process too; world-3 rules.
    _check(run_ranks(_trl_body, 2, timeout=TIMEOUT), 3)


# ---- leaf modules whose inputs need no gradient --------------------------------------------------------------------
class _Experts(nn.Module):
    """A leaf that chooses one of its linears by a counter (DeepSpeed's unit-test model); as a first block: not the
    root, reading the data, its output used further."""

    def __init__(self):
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(5, 5, bias=False), nn.Linear(5, 5, bias=False)])
        self.counter = 0

    def forward(self, x):
        y = torch.relu(self.linears[self.counter % 2](x))
        self.counter += 1
        return y


class _ChooseByCounter(_Experts):
    """The same choice as the leaf root, whose inputs are data: its post-backward hook never fires."""

    def forward(self, x):
        return super().forward(x).square().mean()


class _ExpertsThenHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = _Experts()
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.experts(x)).square().mean()


def _leaf_no_grad_body(where):
    torch.manual_seed(0)
    model, leaf = (_ChooseByCounter(), _ChooseByCounter) if where == "root" else (_ExpertsThenHead(), _Experts)
    set_z3_leaf_modules(model, [leaf])
    return _compare(model, _plain_step, steps=4)


@pytest.mark.parametrize("where", ["root", "first block"])
@pytest.mark.parametrize("world", [2, 3])
def test_leaf_module_with_inputs_that_need_no_grad_trains_as_one_process(world, where):
    """DeepSpeed refuses this (a RuntimeError computing on an empty parameter); we accept it because the gradients
    are one process's (bitwise at world 2) and the leaf is released by the end of backward (its post-backward never
    fires: [Note: end of backward] in zero/hooks.py)."""
    _check(run_ranks(_leaf_no_grad_body, world, where, timeout=TIMEOUT), world)
