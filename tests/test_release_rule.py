"""The one rule that decides whether a gathered parameter may be freed (zero_engine/zero/unit.py, ``releasable``).

A parameter is released only when it is whole, not persistent, used by no running module, held by no user (a
``GatheredParameters`` block, the engine's hold to the end of the step) and, following the trace, not reused soon;
every release site (end of step, a unit's reshard after its module ran, making room under
``stage3_max_live_parameters``, the end of what a forward held, a block's exit) asks that one predicate.

The distributed test: parity against one process, every rank trains on the same micro-batch (SGD, fp32), so at world
2 the averaged gradient is the reference's exactly and losses and parameters must be bitwise equal. The others drive
each release site of a coordinator on its own (test_zero_units.py's loopback communicator, no process group).
"""

from __future__ import annotations

import bisect
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero_engine
from torch.utils._python_dispatch import TorchDispatchMode
from zero_engine.testing import run_ranks
from zero_engine.zero import GatheredParameters, unit
from zero_engine.zero.partition import ParamStatus

from test_zero3 import full_params
from test_zero_units import build_coordinator, run_step

TIMEOUT = 120


class _HoldsTiedWeight(nn.Module):
    """Holds the tied embedding weight with GatheredParameters (DeepSpeed's idiom) while its inner Linear is
    fetched, and reads it inside the block after that fetch."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.tied = [embedding.weight]  # a plain list: not read through a module attribute (external.py)
        self.inner = nn.Linear(16, 40)
        self.out = nn.Linear(40, 16)

    def forward(self, h):
        w = self.tied[0]
        with GatheredParameters(w):
            h = self.out(torch.tanh(self.inner(h)))  # fetching inner needs room under the live budget
            with torch.no_grad():
                scale = 1.0 + w.float().square().mean()  # the held weight must still be whole here
        return h * scale


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(120, 16)  # 1920 elements: with inner's 680, more than max_live_parameters
        self.mid = _HoldsTiedWeight(self.emb)
        self.head = nn.Linear(16, 120, bias=False)
        self.head.weight = self.emb.weight  # tied: kept between its uses within the forward

    def forward(self, idx):
        return self.head(self.mid(self.emb(idx))).logsumexp(-1).mean()


def train_beside_one_process(model: nn.Module, zero: dict, steps: int, vocab: int, between=None):
    """``steps`` SGD steps of ``model`` under the engine (``zero``: its zero_optimization section) and of a copy in
    one process, on the same micro-batch on every rank (at world 2 the averaged gradient is the copy's exactly):
    the engine's losses, the copy's, the engine and the copy. ``between(model, under_engine)`` runs between each
    forward and its backward, on either model."""
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": zero}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(steps):
        idx = torch.randint(0, vocab, (2, 5), generator=g)
        ref_opt.zero_grad()
        ref_loss = reference(idx)
        if between is not None:
            between(reference, False)
        ref_loss.backward()
        ref_opt.step()
        loss = engine(idx)
        if between is not None:
            between(model, True)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    return losses, ref_losses, engine, reference


def _leaks_and_sameness(engine, reference) -> tuple[list[str], bool]:
    leaks = [sp.fqn for sp in engine.sharded if sp.status is not ParamStatus.NOT_AVAILABLE]
    ref = dict(reference.named_parameters())
    return leaks, all(torch.equal(v, ref[n].detach()) for n, v in full_params(engine).items())


def _held_tied_weight_body():
    torch.manual_seed(0)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 2500,
            "stage3_prefetch_bucket_size": 100}
    losses, ref_losses, engine, reference = train_beside_one_process(_TiedLM(), zero, 3, 120)
    leaks, same = _leaks_and_sameness(engine, reference)
    return losses, ref_losses, same, leaks


def test_parameter_held_by_gathered_parameters_is_not_freed_to_make_room():
    for losses, ref_losses, same, leaks in run_ranks(_held_tied_weight_body, 2, timeout=TIMEOUT):
        assert losses == ref_losses, (losses, ref_losses)  # bitwise at world 2
        assert same, "parameters differ from the one-process run"
        assert not leaks, f"still gathered after the step: {leaks}"


class _ReadsALaterWeight(nn.Module):
    """Reads the weight of a module that runs after it, inside a GatheredParameters block in its forward (a
    reference kept at construction: no module attribute read, so only the block gathers it). From the second step
    on, the coordinator's prefetch has that weight's gather in flight when the block enters."""

    def __init__(self, later: nn.Linear):
        super().__init__()
        self.later_weight = [later.weight]
        self.lin = nn.Linear(16, 16)
        self.seen: list[str] = []  # the weight's status at each block's entry (the engine's model only)

    def forward(self, h):
        w = self.later_weight[0]
        if hasattr(w, "ds_status"):
            self.seen.append(w.ds_status.name)
        with GatheredParameters(w):
            scale = 1.0 + w.detach().square().mean()
        return self.lin(h) * scale


class _ReadsAheadLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mid = nn.Linear(16, 16)
        self.late = nn.Linear(16, 16)
        self.reads = _ReadsALaterWeight(self.late)
        self.head = nn.Linear(16, 50)

    def forward(self, idx):
        return self.head(self.late(self.mid(self.reads(self.emb(idx))))).logsumexp(-1).mean()


def _block_on_prefetched_body():
    torch.manual_seed(0)
    model = _ReadsAheadLM()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 100_000}
    losses, ref_losses, engine, reference = train_beside_one_process(model, zero, 3, 50)
    leaks, same = _leaks_and_sameness(engine, reference)
    return losses, ref_losses, same, leaks, model.reads.seen, engine.coordinator.live_numel


def test_gathered_parameters_on_a_prefetched_parameter_waits_for_its_gather():
    """DeepSpeed's idiom inside a forward, on a parameter the engine is prefetching: the block waits for the engine's
    gather (issued on every rank) and leaves the parameter to its module, instead of raising."""
    for losses, ref_losses, same, leaks, seen, live in run_ranks(_block_on_prefetched_body, 2, timeout=TIMEOUT):
        assert "INFLIGHT" in seen, f"the prefetch never had the weight in flight at the block: {seen}"
        assert losses == ref_losses, (losses, ref_losses)  # bitwise at world 2
        assert same, "parameters differ from the one-process run"
        assert not leaks and live == 0, f"still gathered after the step: {leaks}, {live} elements counted"


class _HalvesALaterWeight(nn.Module):
    """Halves the weight of a module that runs after it with ``safe_set_full_fp32_param`` in its forward (the
    reference model, in place). From the second step on, the engine's prefetch has that weight in flight."""

    def __init__(self, later: nn.Linear):
        super().__init__()
        self.later_weight = [later.weight]
        self.lin = nn.Linear(16, 16)
        self.seen: list[str] = []

    def forward(self, h):
        from zero_engine.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

        w = self.later_weight[0]
        if hasattr(w, "ds_status"):
            self.seen.append(w.ds_status.name)
            safe_set_full_fp32_param(w, safe_get_full_fp32_param(w) * 0.5)
        else:
            with torch.no_grad():
                w.mul_(0.5)
        return self.lin(h)


class _HalvingLM(_ReadsAheadLM):
    def __init__(self):
        super().__init__()
        self.reads = _HalvesALaterWeight(self.late)


def _set_on_prefetched_body():
    torch.manual_seed(0)
    model = _HalvingLM()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 100_000}
    losses, ref_losses, engine, reference = train_beside_one_process(model, zero, 3, 50)
    leaks, same = _leaks_and_sameness(engine, reference)
    return losses, ref_losses, same, leaks, model.reads.seen


def test_safe_set_full_fp32_param_on_a_prefetched_parameter_is_not_undone_by_its_gather():
    """The set waits for the engine's gather in flight; before, the gather landed after the set, and the forward
    computed with the old weight (losses off one process from the second step)."""
    for losses, ref_losses, same, leaks, seen in run_ranks(_set_on_prefetched_body, 2, timeout=TIMEOUT):
        assert "INFLIGHT" in seen, f"the prefetch never had the weight in flight at the set: {seen}"
        assert losses == ref_losses, (losses, ref_losses)  # bitwise at world 2
        assert same and not leaks, (same, leaks)


class _ThreeLayerLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.late = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, idx):
        return self.head(self.late(self.emb(idx))).logsumexp(-1).mean()


def _halve_the_late_weight(model: nn.Module, under_engine: bool) -> None:
    from zero_engine.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    w = model.late.weight
    if under_engine:
        safe_set_full_fp32_param(w, safe_get_full_fp32_param(w) * 0.5)
    else:
        w.data.mul_(0.5)  # backward's input gradient reads the halved weight


def _set_between_forward_and_backward_body(zero: dict):
    torch.manual_seed(0)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}
    losses, ref_losses, engine, reference = train_beside_one_process(_ThreeLayerLM(), zero, 3, 50,
                                                                     between=_halve_the_late_weight)
    return losses, ref_losses, _leaks_and_sameness(engine, reference)[1]


@pytest.mark.parametrize("world,zero", [(2, {}), (4, {"zero_hpz_partition_size": 2})], ids=["flat", "hpz"])
def test_safe_set_full_fp32_param_between_forward_and_backward_reaches_backwards_gather(world, zero):
    """Backward gathers the weight again, so it computes with the set value, as one process's backward reads the
    parameter as it is then. Under hpZ that gather reads the secondary shard the forward's gather refreshed: the set
    forgets it (it read the copy from before the set; the flat case passes before too, as the control)."""
    for losses, ref_losses, same in run_ranks(_set_between_forward_and_backward_body, world, zero, timeout=TIMEOUT):
        assert losses == ref_losses, (losses, ref_losses)
        assert same, "parameters differ from the one-process run"


def _steps_inside_a_block_body(stage: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    params = list(engine.module.parameters())
    seen, expected = [], []
    with GatheredParameters(params):  # read-only: the engine's steps are not the user's edits
        for _ in range(2):
            x = torch.randn(2, 8, generator=g)
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            ref_opt.zero_grad()
            reference(x).square().mean().backward()
            ref_opt.step()
            seen.append([p.detach().clone() for p in params])
            expected.append([p.detach().clone() for p in reference.parameters()])
    return [all(map(torch.equal, a, b)) for a, b in zip(seen, expected)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_steps_inside_a_gathered_parameters_block_update_what_it_holds(stage):
    """The engine's step inside a block rewrites the whole parameters it holds from their new shards (as persistent
    ones are), so the block, and a forward inside it, read the updated weights; the read-only block's edit check
    does not take that update for the user's edit."""
    for same in run_ranks(_steps_inside_a_block_body, 2, stage, timeout=TIMEOUT):
        assert same == [True, True], same


def _bf16_steps_body(stage: int, block: bool):
    from zero_engine.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(1)
    losses = []

    def step():
        loss = engine(torch.randn(2, 8, generator=g).bfloat16()).float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    params = list(engine.module.parameters())
    with GatheredParameters(params, modifier_rank=0) if block else contextlib.nullcontext():
        step()  # no edit in the block: its exit must change nothing
        step()
    step()
    return losses, [safe_get_full_fp32_param(p) for p in params]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_steps_inside_a_modifier_block_keep_the_fp32_master_bits(stage):
    """A modifier_rank block compares what it holds at exit with what it found; a step inside it rewrites that from
    the new shards (16-bit), which must not read as an edit and round the fp32 masters."""
    inside = run_ranks(_bf16_steps_body, 2, stage, True, timeout=TIMEOUT)
    plain = run_ranks(_bf16_steps_body, 2, stage, False, timeout=TIMEOUT)
    for (losses, masters), (ref_losses, ref_masters) in zip(inside, plain):
        assert losses == ref_losses, (losses, ref_losses)
        assert all(map(torch.equal, masters, ref_masters))


# ---- every release site asks the one rule (a coordinator on its own) --------------------------------------------------
PER_LAYER = 16 * 16 + 16  # build_coordinator's Linear(16, 16)


def _release_by_module(coordinator, layers, sp, protect):
    coordinator.begin_step()
    coordinator.fetch(layers[0], "forward")
    protect(sp)
    coordinator.release(layers[0])


def _release_at_end_of_step(coordinator, layers, sp, protect):
    coordinator.begin_step()
    coordinator.fetch(layers[0], "forward")
    protect(sp)
    coordinator.end_step(adopt_trace=False)


def _release_to_make_room(coordinator, layers, sp, protect):
    coordinator.begin_step()
    coordinator.fetch(layers[0], "forward")
    sp.active_users -= 1  # its module ran; the trace reuses it soon, so release() kept it:
    coordinator.gathered.kept[id(sp)] = sp
    protect(sp)
    coordinator.fetch(layers[1], "forward")  # over max_live_parameters: gives up kept parameters first


def _release_held_at_end_of_forward(coordinator, layers, sp, protect):
    coordinator.begin_step()
    with torch.no_grad():  # a forward without gradients: no backward follows, what it held ends with it
        coordinator.hold_for_step(sp)  # read by the model's forward outside every unit
        protect(sp)
        coordinator.end_model_forward()


def _release_at_block_exit(coordinator, layers, sp, protect, monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # the block gathers through the loopback comm
    with GatheredParameters(sp.param, _comm=coordinator.comm):
        protect(sp)


SITES = {"module release": _release_by_module, "end of step": _release_at_end_of_step,
         "make room": _release_to_make_room, "end of forward": _release_held_at_end_of_forward,
         "block exit": _release_at_block_exit}


def _persistent(sp):
    sp.is_persistent = True


def _held(sp):  # what a GatheredParameters block around this does
    sp.held_by_user += 1


def _in_use(sp):  # what an enclosing unit that also gathers it does
    sp.active_users += 1


def _nothing(sp):
    pass


def _run_site(site, sp_protect, monkeypatch):
    coordinator, layers, _ = build_coordinator(n_layers=2, max_live_parameters=PER_LAYER)
    sp = coordinator.unit_of(layers[0]).params[0]
    args = (monkeypatch,) if site == "block exit" else ()
    SITES[site](coordinator, layers, sp, sp_protect, *args)
    return coordinator, sp


@pytest.mark.parametrize("site", list(SITES))
@pytest.mark.parametrize("protection", [_persistent, _held, _in_use, _nothing], ids=lambda f: f.__name__[1:])
def test_no_release_site_frees_a_persistent_held_or_used_parameter(site, protection, monkeypatch):
    if site == "end of step" and protection is _in_use:
        pytest.skip("at the end of a step no module runs: end_step clears every use")
    coordinator, sp = _run_site(site, protection, monkeypatch)
    if protection is _nothing:  # the control: each site does release a parameter nothing keeps
        assert sp.status is ParamStatus.NOT_AVAILABLE and sp.full.untyped_storage().size() == 0, site
    else:
        assert sp.status is ParamStatus.AVAILABLE, f"{site} released a {protection.__name__[1:]} parameter"
        assert sp.full.untyped_storage().size() == sp.full_bytes
    assert coordinator.live_numel >= 0


@pytest.mark.parametrize("site", list(SITES))
def test_every_release_site_consults_the_one_predicate(site, monkeypatch):
    """With the rule refusing everything, no site releases anything: none decides on its own."""
    asked = []

    def refuse(params, *args, **kwargs):
        asked.extend(params)
        return [], []

    monkeypatch.setattr(unit, "releasable", refuse)
    coordinator, sp = _run_site(site, _nothing, monkeypatch)
    assert any(p is sp for p in asked), f"{site} did not ask the release rule"
    assert sp.status is ParamStatus.AVAILABLE, f"{site} released a parameter the rule refused"


# ---- the trace's next-use table ---------------------------------------------------------------------------------
def _next_use_by_search(trace, p, after):
    """What the coordinator computed before the table: a search of the parameter's uses."""
    uses = [i for i, params in enumerate(trace.params) if any(q is p for q in params)]
    k = bisect.bisect_right(uses, after)
    if k == len(uses):
        return unit.NextUse(None, False)
    nxt = uses[k]
    shared = len({trace.events[i].module for i in uses}) > 1
    return unit.NextUse(trace.start_numel[nxt] - trace.start_numel[after + 1],
                        shared and trace.events[nxt].phase == trace.events[after].phase)


def test_trace_next_use_table_matches_a_search_of_the_trace():
    """Nested units (the outer one ends after the inner ones) and a weight shared by two units (tied)."""
    coordinator, layers, _ = build_coordinator(n_layers=4)
    coordinator.unit_of(layers[3]).add_external(coordinator.unit_of(layers[0]).params[0])  # a tied weight
    coordinator.begin_step()
    order = [(layers[0], "forward", False), (layers[1], "forward", True), (layers[2], "forward", False),
             (layers[1], "forward", "end"), (layers[3], "forward", False), (layers[3], "backward", False),
             (layers[2], "backward", False), (layers[1], "backward", False), (layers[0], "backward", False)]
    for layer, phase, nested in order:  # layers[1] encloses layers[2]
        if nested != "end":
            coordinator.fetch(layer, phase)
        if nested is not True:
            coordinator.release(layer)
    coordinator.end_step()
    trace = coordinator.trace
    assert [e.module for e in trace.events] == ["layers.0", "layers.1", "layers.2", "layers.3", "layers.3",
                                                "layers.2", "layers.1", "layers.0"]
    assert [u.name for u in trace.units] == [e.module for e in trace.events]
    for fetched_at, params in enumerate(trace.params):
        for after in range(fetched_at, len(trace.events) - 1):
            for p in params:
                assert trace.next_use(p, fetched_at, after) == _next_use_by_search(trace, p, after), \
                    (p.fqn, fetched_at, after)


def test_trace_next_uses_are_looked_up_once_and_again_when_a_unit_grows(monkeypatch):
    """The trace does not change between recordings: a following step finds every release's ``NextUse``s cached
    (no per-parameter lookup), until an external parameter joins a unit (its list grows in place)."""
    coordinator, layers, _ = build_coordinator(n_layers=3)
    run_step(coordinator, layers)  # records the trace
    run_step(coordinator, layers)  # follows it: computes each release's next uses
    trace = coordinator.trace
    looked_up = []
    next_event = trace.next_event
    monkeypatch.setattr(trace, "next_event", lambda p, *args: looked_up.append(p) or next_event(p, *args))
    run_step(coordinator, layers)
    assert looked_up == []
    tied = coordinator.unit_of(layers[0]).params[0]
    coordinator.add_external(layers[2], tied.param, gather_now=False)
    run_step(coordinator, layers)
    assert coordinator.trace is trace and coordinator.follows_trace is False  # the same trace, followed to the end
    grown = coordinator.unit_of(layers[2]).params
    assert len(looked_up) == 2 * len(grown) and set(map(id, looked_up)) == set(map(id, grown))  # forward, backward
    for (fetched_at, after), (params, uses, nexts) in trace._next_uses.items():
        assert uses == [trace.next_use(p, fetched_at, after) for p in params], (fetched_at, after)
        assert nexts == {id(p): trace.next_event(p, fetched_at, after) for p in params}


def _counting(monkeypatch, name, calls):
    """Swap ``unit.<name>`` (a function over a list of parameters) for one that records the length of each list."""
    original = getattr(unit, name)

    def counted(params, *args, **kwargs):
        calls.append((name, len(params)))
        return original(params, *args, **kwargs)

    monkeypatch.setattr(unit, name, counted)


def test_a_unit_and_the_end_of_step_ask_the_rule_and_release_in_one_call_each(monkeypatch):
    coordinator, layers, _ = build_coordinator(n_layers=3, max_reuse_distance=2 * PER_LAYER)
    run_step(coordinator, layers)  # records the trace
    calls = []
    _counting(monkeypatch, "releasable", calls)
    _counting(monkeypatch, "foreach_release", calls)
    coordinator.begin_step()
    coordinator.fetch(layers[0], "forward")
    coordinator.release(layers[0])  # used again only at the end of the backward: released, both parameters
    assert calls == [("releasable", 2), ("foreach_release", 2)]
    assert all(p.status is ParamStatus.NOT_AVAILABLE for p in coordinator.unit_of(layers[0]).params)
    calls.clear()
    coordinator.fetch(layers[1], "forward")
    coordinator.fetch(layers[2], "forward")
    coordinator.release(layers[2])  # used again next (its backward): kept, nothing released
    assert calls == [("releasable", 2)] and len(coordinator.gathered.kept) == 2
    calls.clear()
    # every parameter of the model, once each, in one call: layers[1] in use, layers[2] kept, layers[0] prefetched
    coordinator.end_step(adopt_trace=False)
    assert calls == [("releasable", 6), ("foreach_release", 6)]
    assert coordinator.live_numel == 0 and not coordinator.gathered.kept


def test_releasing_a_parameter_that_is_not_whole_still_raises():
    coordinator, layers, _ = build_coordinator(n_layers=1)
    sp = coordinator.unit_of(layers[0]).params[1]
    with pytest.raises(AssertionError, match=r"layers.0.bias: released while NOT_AVAILABLE on rank 0"):
        sp.release()


def test_units_are_listed_in_module_order_and_own_their_parameters():
    coordinator, layers, _ = build_coordinator(n_layers=3)
    assert [u.module for u in coordinator.units] == layers
    assert [u.name for u in coordinator.units] == ["layers.0", "layers.1", "layers.2"]
    first, last = coordinator.units[0], coordinator.units[-1]
    tied = first.params[0]
    assert tied in first and tied not in last
    coordinator.add_external(layers[2], tied.param, gather_now=False)
    assert tied in last and last.params[-1] is tied and coordinator.module_params[layers[2]] is last.params
    run_step(coordinator, layers)  # the tied weight is gathered with both units, released after the step
    assert tied.status is ParamStatus.NOT_AVAILABLE and coordinator.live_numel == 0
    coordinator.remove_external(layers[2], tied.param)
    assert tied not in last and tied in first


class _CountedStatus:
    """Counts how often the coordinator looks at a parameter's status (a class swapped onto the ShardedParams)."""

    reads = 0

    @property
    def status(self):
        _CountedStatus.reads += 1
        return self._status

    @status.setter
    def status(self, value):
        self._status = value


def _status_reads_of_a_step(n_layers: int) -> int:
    coordinator, layers, _ = build_coordinator(n_layers=n_layers, max_reuse_distance=10**9)
    for p in [p for u in coordinator.units for p in u.params]:
        status = p.status
        p.__class__ = type("Counted", (_CountedStatus, type(p)), {})
        p.status = status
    run_step(coordinator, layers)  # records the trace
    run_step(coordinator, layers)  # follows it
    assert coordinator.prefetch_count > 0
    _CountedStatus.reads = 0
    run_step(coordinator, layers)
    return _CountedStatus.reads


def test_prefetch_does_not_walk_the_gathered_trace_ahead_again_at_every_fetch():
    """With every parameter kept (a reuse distance larger than the model), each fetch once found nothing to prefetch
    by walking the whole rest of the trace: status reads per step grew with the square of the trace's length (3.5x
    for twice the layers). The look-ahead resumes where the last one stopped while nothing it passed was released
    ([Note: the prefetch frontier]): linear (2x)."""
    small, large = _status_reads_of_a_step(20), _status_reads_of_a_step(40)
    assert large < 2.5 * small, (small, large)


class _TwoParamLayer(nn.Module):
    """A unit of a 200-element and a 100-element parameter (100 and 50 per rank at world 2)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(20, 10) * 0.1)
        self.b = nn.Parameter(torch.randn(10, 10) * 0.1)

    def forward(self, h):
        return torch.tanh(h @ self.a.t())[:, :10] @ self.b.t()


def _sgd_engine_and_reference(layers: list[nn.Module], **zero_optimization):
    """A ZeRO-3 engine (SGD, lr 0.1, micro-batch 2) over ``nn.Sequential(*layers)``, and a copy of the model made
    before it is partitioned: the reference ``_train_beside_sgd`` trains."""
    model = nn.Sequential(*layers)
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, **zero_optimization}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    return engine, reference


def _unit_layout_body():
    torch.manual_seed(0)
    # 250 elements per rank: filled by size alone, a shard bucket would hold [0.a 0.b 1.a] [1.b 2.a 2.b] (and
    # sub-groups alike), splitting the second unit; as runs of whole units, each unit (150) is a bucket and a
    # sub-group.
    engine, reference = _sgd_engine_and_reference([_TwoParamLayer() for _ in range(3)],
                                                  stage3_param_persistence_threshold=0,
                                                  stage3_prefetch_bucket_size=500, sub_group_size=250)
    units = [[p.fqn for p in u.params] for u in engine.coordinator.units]
    buckets = [[p.fqn for p in b.params] for b in engine.shard_buckets]
    sub_groups = [[p.fqn for p in g] for g in engine.optimizer.sub_groups]
    one_tensor = all(u.params[0].bucket.run_view(u.params) is not None for u in engine.coordinator.units)
    same_losses, same_params = _train_beside_sgd(engine, reference, torch.randn(2, 10, generator=_seeded(1)), 2)
    engine.destroy()
    return units, buckets, sub_groups, one_tensor, same_losses, same_params


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _train_beside_sgd(engine, reference: nn.Module, x: torch.Tensor, steps: int, watch=None):
    """``steps`` steps of ``engine`` and of ``reference`` under torch's SGD (lr 0.1) on the same micro-batch ``x``:
    whether each step's loss and the final parameters are bitwise equal. ``watch``: a context manager entered
    around each of the engine's forward and backward."""
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    same_losses = []
    for _ in range(steps):
        ref_opt.zero_grad()
        ref_loss = reference(x).square().mean()
        ref_loss.backward()
        ref_opt.step()
        with watch if watch is not None else contextlib.nullcontext():
            loss = engine(x).square().mean()
            engine.backward(loss)
        engine.step()
        same_losses.append(torch.equal(loss.detach(), ref_loss.detach()))
    ours, ref = full_params(engine), dict(reference.named_parameters())
    return same_losses, all(torch.equal(v, ref[n].detach()) for n, v in ours.items())


def test_shard_buckets_and_optimizer_sub_groups_are_runs_of_whole_units():
    for units, buckets, sub_groups, one_tensor, same_losses, same_params in run_ranks(_unit_layout_body, 2,
                                                                                     timeout=TIMEOUT):
        assert units == [["0.a", "0.b"], ["1.a", "1.b"], ["2.a", "2.b"]]
        assert buckets == units and sub_groups == units
        assert one_tensor  # each unit's all-gather input is a view of its bucket: no cat
        assert all(same_losses) and same_params  # bitwise: the same micro-batch on every rank, SGD, fp32


class _NormedBlock(nn.Module):
    """A transformer block's parameter pattern: small LayerNorm weights and biases (persistent under a threshold of
    100) between the weights the unit gathers (256 elements each: coalesced, below DIRECT_GATHER_NUMEL)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.fc1 = nn.LayerNorm(16), nn.Linear(16, 16)
        self.ln2, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(self.ln1(h))) + self.ln2(h))


class _CountCats(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.cats = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.cats += func is torch.ops.aten.cat.default
        return func(*args, **(kwargs or {}))


def _persistent_layout_body():
    torch.manual_seed(0)
    # a prefetch takes one unit (512 elements): no gather spans two units
    engine, reference = _sgd_engine_and_reference([_NormedBlock() for _ in range(3)],
                                                  stage3_param_persistence_threshold=100,
                                                  stage3_prefetch_bucket_size=600, stage3_max_reuse_distance=0,
                                                  leaf_module={"classes": ["_NormedBlock"]})
    gathered = [[p for p in u.params if not p.is_persistent] for u in engine.coordinator.units]
    one_tensor = [p[0].bucket.run_view(p) is not None for p in gathered]
    # forward and backward watched; a step's refresh of the persistent parameters spans units (one staged gather)
    counter = _CountCats()
    same_losses, same_params = _train_beside_sgd(engine, reference, torch.randn(2, 16, generator=_seeded(1)), 3,
                                                 watch=counter)
    engine.destroy()
    return [len(g) for g in gathered], one_tensor, counter.cats, same_losses, same_params


def test_a_units_gathered_shards_are_one_tensor_with_its_persistent_parameters_beside_them():
    """[Note: persistent shards last]: a unit's persistent parameters (LayerNorms, biases) lie after the ones it
    gathers in the flat shard, so the all-gather input of a block is a view, not a ``cat`` of its shards each time
    it is gathered (6 in forward and backward before: 3 blocks, each gathered twice)."""
    for sizes, one_tensor, cats, same_losses, same_params in run_ranks(_persistent_layout_body, 2,
                                                                       timeout=TIMEOUT):
        assert sizes == [2, 2, 2]  # fc1.weight and fc2.weight: the LayerNorms and biases are persistent
        assert all(one_tensor)
        assert cats == 0, cats  # in the 3 steps' forward and backward
        assert all(same_losses) and same_params  # bitwise: the same micro-batch on every rank, SGD, fp32


def _whole_unit_prefetch_body():
    torch.manual_seed(0)
    # a unit gathers 512 elements; the prefetch bucket (900) holds one unit and half of the next
    engine, reference = _sgd_engine_and_reference([_NormedBlock() for _ in range(4)],
                                                  stage3_param_persistence_threshold=100,
                                                  stage3_prefetch_bucket_size=900, stage3_max_reuse_distance=0,
                                                  leaf_module={"classes": ["_NormedBlock"]})
    coordinator = engine.coordinator
    unit_of = {id(p): u.name for u in coordinator.units for p in u.params}
    gathers = []
    live = coordinator.gathered
    issue = live.issue

    def logged_issue(params, name):  # the units each gather covers
        gathers.append(sorted({unit_of[id(p)] for p in params}))
        return issue(params, name)

    live.issue = logged_issue
    x = torch.randn(2, 16, generator=_seeded(1))
    counter = _CountCats()
    same_losses, same_params = _train_beside_sgd(engine, reference, x, 2)  # the trace is recorded at step 0
    steady = len(gathers)
    more_losses, more_params = _train_beside_sgd(engine, reference, x, 1, watch=counter)
    engine.destroy()
    return gathers[steady:], counter.cats, same_losses + more_losses, same_params and more_params


def test_a_prefetch_takes_whole_units():
    """[Note: a unit is prefetched whole]: a prefetch bucket with room for one unit and half of the next gathers one
    unit per collective. Before, it took the next unit and the first weight of the one after, which made 2 gathers
    of that unit instead of 1 and a gather spanning two units (its input staged by a ``cat``)."""
    for gathers, cats, same_losses, same_params in run_ranks(_whole_unit_prefetch_body, 2, timeout=TIMEOUT):
        assert all(len(units) == 1 for units in gathers), gathers
        # forward: blocks 0-3; max_reuse_distance 0 releases block 3 after its forward, and the backward begins with
        # it: gathered again on demand, then block 2 prefetched. Block 3's look-ahead stops at its own backward
        # ([Note: a released parameter is prefetched in order]); before, it gathered block 2 there, out of order.
        assert [units[0] for units in gathers] == ["0", "1", "2", "3", "3", "2", "1", "0"], str(gathers)
        assert cats == 0, cats
        assert all(same_losses) and same_params  # bitwise: the same micro-batch on every rank, SGD, fp32
