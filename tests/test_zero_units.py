"""The coordinator and the gradient reducer on their own, against a loopback communicator (no process group).

``LoopbackComm`` stands in for the Communicator as rank ``rank`` of ``world_size`` ranks that all hold this rank's
data: an all-gather tiles the input, a reduce-scatter of identical inputs hands back this rank's row, and every call
is recorded. That is enough to check what these parts decide (which collectives, in which order, of which sizes;
when parameters are gathered, prefetched and released; where gradients land) without an engine.

Ranks that see different data must issue identical collectives; ``test_reducer_issues_the_same_collectives_*``
checks that property directly: whatever order gradients arrive in and whichever parameters get none.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from zero_engine.comm._records import ProgressLog
from zero_engine.zero.coordinator import ParamCoordinator
from zero_engine.zero.gather import CoalescedGather, SequentialGather
from zero_engine.zero.grads import GradReducer
from zero_engine.zero.partition import ParamStatus, ShardedParam


class _Done:
    def __init__(self, tensor):
        self.tensor = tensor

    def wait(self):
        return self.tensor


class LoopbackComm:
    def __init__(self, world_size: int = 2, rank: int = 0, other_traces=None):
        self.world_size, self.rank = world_size, rank
        self.calls: list[tuple] = []
        self.other_traces = other_traces  # what the other ranks report from all_gather_object, if not the same
        self.progress = ProgressLog()  # the coordinator names the module it gathers for in the progress records
        self.checking = False  # check_every_collective: on for the step that records the trace

    def check_every_collective(self, on):
        self.checking = on
        self.calls.append(("check_every_collective", on))

    def all_gather_into_tensor(self, out, inp, async_op=False, name=""):
        self.calls.append(("all_gather", out.numel(), inp.dtype))
        out.view(self.world_size, -1).copy_(inp.reshape(1, -1))
        return _Done(out)

    def reduce_scatter_tensor(self, out, inp, op="avg", async_op=False, name="", input_is_scratch=False):
        self.calls.append(("reduce_scatter", inp.numel(), inp.dtype, name))
        row = inp.view(self.world_size, -1)[self.rank]
        out.copy_(row if op == "avg" else row * self.world_size)
        return _Done(out)

    def reduce_scatter_workspace(self, inp):
        return 0

    def all_reduce(self, tensor, op="sum", async_op=False, name=""):
        self.calls.append(("all_reduce", tensor.numel()))
        if op == "sum":
            tensor.mul_(self.world_size)
        return _Done(tensor)

    def all_gather_object(self, obj):
        self.calls.append(("all_gather_object",))
        others = self.other_traces or [obj] * (self.world_size - 1)
        return [obj, *others]


def sharded(module: nn.Module, world: int, rank: int, prefix: str) -> list[ShardedParam]:
    return [ShardedParam(p, f"{prefix}.{n}", i, rank, world) for i, (n, p) in enumerate(module.named_parameters())]


# ---- gathers -------------------------------------------------------------------------------------------------------
class _InputsComm(LoopbackComm):
    """Also keeps the id of every tensor a collective was given to read."""

    def __init__(self):
        super().__init__(2, 0)
        self.inputs: list[int] = []

    def all_gather_into_tensor(self, out, inp, async_op=False, name=""):
        self.inputs.append(id(inp))
        return super().all_gather_into_tensor(out, inp, async_op, name)


@pytest.mark.parametrize("sequential", [False, True])
def test_a_gather_holds_every_input_its_collectives_read_until_wait(sequential):
    """On CUDA the all-gather reads its input on a side stream; streams.py requires a reference until the compute
    stream waited. Shards outside a bucket are concatenated for a coalesced gather: that temporary must be held by
    the work (before, nothing referenced it once the collective was issued)."""
    torch.manual_seed(0)
    sps = sharded(nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)), 2, 0, "m")  # small: one coalesced run
    for sp in sps:
        sp.release()
    comm = _InputsComm()
    gatherer = SequentialGather(comm) if sequential else CoalescedGather(comm, 10_000)
    work = gatherer.issue(sps)
    assert comm.inputs and {id(t) for t in work.keep_alive} == set(comm.inputs), (comm.inputs, work.keep_alive)
    if not sequential:  # the concatenated shards: a new tensor nothing else holds
        assert len(comm.inputs) == 1 and work.keep_alive[0].numel() == sum(sp.shard_numel for sp in sps)
    work.wait()
    assert work.keep_alive == [] and all(sp.status is ParamStatus.AVAILABLE for sp in sps)


# ---- the coordinator ------------------------------------------------------------------------------------------------
def zero_config(**overrides):
    values = dict(prefetch_bucket_size=10_000, max_live_parameters=10**9, max_reuse_distance=0,
                  allgather_sequential=False)
    values.update(overrides)
    return SimpleNamespace(**values)


def build_coordinator(n_layers=4, width=16, world=2, comm=None, **overrides):
    torch.manual_seed(0)
    layers = [nn.Linear(width, width) for _ in range(n_layers)]
    comm = comm or LoopbackComm(world)
    params, names = {}, {}
    for i, layer in enumerate(layers):
        sps = sharded(layer, world, comm.rank, f"layers.{i}")
        for sp in sps:
            sp.release()
        params[layer], names[layer] = sps, f"layers.{i}"
    zc = zero_config(**overrides)
    gatherer = SequentialGather(comm) if zc.allgather_sequential else CoalescedGather(comm, zc.prefetch_bucket_size)
    return ParamCoordinator(params, names, gatherer, comm, zc), layers, comm


def run_step(coordinator, layers, observe=None):
    coordinator.begin_step()
    for phase, order in (("forward", layers), ("backward", layers[::-1])):
        for layer in order:
            coordinator.fetch(layer, phase)
            assert all(sp.status is ParamStatus.AVAILABLE for sp in coordinator.module_params[layer])
            if observe:
                observe(coordinator)
            coordinator.release(layer)
    coordinator.end_step()


@pytest.mark.parametrize("sequential", [False, True])
def test_coordinator_records_then_prefetches_and_releases_everything(sequential):
    coordinator, layers, comm = build_coordinator(allgather_sequential=sequential)
    run_step(coordinator, layers)
    assert coordinator.prefetch_count == 0, "nothing to prefetch before the trace is recorded"
    assert coordinator.trace is not None and len(coordinator.trace.events) == 2 * len(layers)
    first_fetches = coordinator.fetch_count
    run_step(coordinator, layers)
    assert coordinator.fetch_count == 2 * first_fetches
    # Following the trace, every module after the first one of each pass finds its parameters prefetched.
    assert coordinator.prefetch_count > 0
    assert coordinator.prefetch_count >= (2 * len(layers) - 2) * (1 if sequential else 2)
    everything = [sp for sps in coordinator.module_params.values() for sp in sps]
    assert all(sp.status is ParamStatus.NOT_AVAILABLE for sp in everything)
    assert coordinator.live_numel == 0


def test_coordinator_never_exceeds_the_live_budget():
    per_layer = 16 * 16 + 16
    budget = 2 * per_layer  # room for the module in use and one prefetched
    coordinator, layers, _ = build_coordinator(max_live_parameters=budget)
    seen = []
    for _ in range(3):
        run_step(coordinator, layers, observe=lambda c: seen.append(c.live_numel))
    assert max(seen) <= budget, (max(seen), budget)
    assert coordinator.prefetch_count > 0
    assert coordinator.peak_live_numel == max(seen)  # the peak counts prefetches too (issued inside a fetch)


def test_coordinator_keeps_a_parameter_reused_soon():
    coordinator, layers, comm = build_coordinator(max_reuse_distance=100)
    run_step(coordinator, layers)
    coordinator.begin_step()
    for layer in layers:
        coordinator.fetch(layer, "forward")
        coordinator.release(layer)
    # The last layer's forward is followed at once by its backward (reuse distance 0 < 100): kept gathered. The
    # first layer is used again only after six other fetches (1632 elements >= 100): released.
    assert all(sp.is_available for sp in coordinator.module_params[layers[-1]])
    assert not any(sp.is_available for sp in coordinator.module_params[layers[0]])
    gathers = len([c for c in comm.calls if c[0] == "all_gather"])
    coordinator.fetch(layers[-1], "backward")
    assert len([c for c in comm.calls if c[0] == "all_gather"]) == gathers, "a kept parameter was gathered again"
    coordinator.release(layers[-1])
    coordinator.end_step(adopt_trace=False)


def test_coordinator_prefetches_a_block_released_at_the_turn_before_the_blocks_after_it():
    """[Note: a released parameter is prefetched in order], on the demo's shape: four blocks, then a head that needs no
    gather (its parameters persistent here; the demo's is the tied embedding, kept within the pass), then the
    backward. The last block's forward looks past its own backward (the block is gathered then), but its release
    frees it: the look-ahead stops there, and the head's forward prefetches it. Before, that look-ahead gathered the
    block before it for the backward, whose gather in flight took the prefetch budget, and the backward began with
    an on-demand gather of the last block."""
    per_layer = 16 * 16 + 16
    coordinator, layers, _ = build_coordinator(n_layers=5, prefetch_bucket_size=per_layer * 3 // 2)
    for sp in coordinator.module_params[layers[4]]:
        sp.is_persistent = True  # gathered at its first fetch, never released
    order = [(layer, "forward") for layer in layers] + [(layer, "backward") for layer in layers[::-1]]
    issued = []
    issue = coordinator.gathered.issue
    coordinator.gathered.issue = lambda params, name: issued.append(
        (name, sorted({int(sp.fqn.split(".")[1]) for sp in params}))) or issue(params, name)
    for step in range(2):
        issued.clear()
        coordinator.begin_step()
        for layer, phase in order:
            coordinator.fetch(layer, phase)
            coordinator.release(layer)
        coordinator.end_step()
    assert [layer for _, gathered in issued for layer in gathered] == [0, 1, 2, 3, 3, 2, 1, 0], issued
    assert [name for name, _ in issued if not name.startswith("prefetch")] == ["layers.0"], issued  # no other
    assert issued[4] == ("prefetch after layers.4", [3]), issued  # the head's forward prefetches the last block


def test_coordinator_checks_the_collectives_of_the_recording_step_only():
    """[Note: the recording step is checked]: every gather of the step that records the trace is checked across ranks
    (on from its forward, off at its end), none of a step that follows it."""
    coordinator, layers, comm = build_coordinator()
    checked_gathers = []
    run_step(coordinator, layers, observe=lambda _: checked_gathers.append(comm.checking))
    switches = [c for c in comm.calls if c[0] == "check_every_collective"]
    assert comm.calls[0] == ("check_every_collective", True) and switches[-1] == ("check_every_collective", False)
    assert all(checked_gathers) and len(checked_gathers) == 2 * len(layers)
    comm.calls.clear()
    checked_gathers.clear()
    run_step(coordinator, layers, observe=lambda _: checked_gathers.append(comm.checking))
    assert ("check_every_collective", True) not in comm.calls and not any(checked_gathers)


def test_coordinator_raises_when_ranks_record_different_module_orders():
    comm = LoopbackComm(2, other_traces=[["layers.1:forward"]])
    coordinator, layers, _ = build_coordinator(comm=comm)
    with pytest.raises(RuntimeError, match=r"first difference at fetch #0: rank 0: layers.0:forward, rank 1: "
                                           r"layers.1:forward"):
        run_step(coordinator, layers)


# ---- the reducer ----------------------------------------------------------------------------------------------------
def build_reducer(world=2, rank=0, bucket_numel=40):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 5), nn.Linear(5, 3))
    params = sharded(model, world, rank, "model")
    comm = LoopbackComm(world, rank)
    return GradReducer(list(reversed(params)), comm, bucket_numel, reduce_dtype=torch.float32), params, comm


def expected_shard(sp: ShardedParam, grad: torch.Tensor | None) -> torch.Tensor:
    out = torch.zeros(sp.shard_numel)
    if grad is not None:
        local = sp.local_slice()
        out[: local.stop - local.start] = grad.reshape(-1)[local]
    return out


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 2)])
def test_reducer_puts_each_gradient_slice_in_this_ranks_shard(world, rank):
    reducer, params, _ = build_reducer(world, rank)
    grads = {sp.fqn: torch.randn(sp.shape) for sp in params}
    for sp in random.Random(0).sample(params, len(params)):  # arrival order does not matter
        reducer.add(sp, grads[sp.fqn])
    reducer.finish()
    for sp in params:
        assert torch.equal(reducer.shard_grad(sp), expected_shard(sp, grads[sp.fqn])), sp.fqn


def test_reducer_issues_the_same_collectives_whatever_arrives():
    """A data-dependent branch on one rank (a parameter without gradient, another arrival order) must not change
    which reduce-scatters this rank issues: the other ranks issue theirs from the fixed bucket layout."""
    sequences = []
    for seed, missing in ((0, set()), (1, {"model.1.weight"}), (2, {"model.0.bias", "model.2.weight"})):
        reducer, params, comm = build_reducer()
        present = [sp for sp in params if sp.fqn not in missing]
        for sp in random.Random(seed).sample(present, len(present)):
            reducer.add(sp, torch.ones(sp.shape))
        reducer.finish()
        sequences.append(comm.calls)
        for sp in params:  # a parameter that got no gradient contributes zeros
            expected = expected_shard(sp, None if sp.fqn in missing else torch.ones(sp.shape))
            assert torch.equal(reducer.shard_grad(sp), expected), sp.fqn
    assert len(sequences[0]) == len(build_reducer()[0].buckets) > 1
    assert sequences[0] == sequences[1] == sequences[2]


def test_reducer_accumulates_across_passes_and_adds_a_late_gradient_at_the_end_of_the_pass():
    """A gradient after its bucket was reduced (a block applied several times under reentrant checkpointing) was
    refused; it is reduced on its own at the end of the pass now ([Note: a gradient after its bucket])."""
    reducer, params, _ = build_reducer(bucket_numel=10**6)  # one bucket
    for _ in range(2):
        for sp in params:
            reducer.add(sp, torch.ones(sp.shape))
        reducer.finish()
    for sp in params:
        assert torch.equal(reducer.shard_grad(sp), 2 * expected_shard(sp, torch.ones(sp.shape)))
    reducer.zero_grad()
    for sp in params:
        reducer.add(sp, torch.ones(sp.shape))  # the bucket is complete and reduced at once
    reducer.add(params[0], 2 * torch.ones(params[0].shape))  # late: held
    reducer.add(params[0], 4 * torch.ones(params[0].shape))  # and another, added to it
    reducer.finish()
    for sp in params:
        late = 7 if sp is params[0] else 1
        assert torch.equal(reducer.shard_grad(sp), expected_shard(sp, late * torch.ones(sp.shape))), sp.fqn


def test_reducer_discard_drops_a_half_filled_pass():
    reducer, params, comm = build_reducer()
    for sp in params:
        reducer.add(sp, torch.ones(sp.shape))
    reducer.finish()
    reducer.zero_grad()
    reducer.add(params[-1], torch.full(params[-1].shape, 5.0))  # a pass that then fails
    reducer.discard()
    for sp in params:
        reducer.add(sp, torch.full(sp.shape, 3.0))
    reducer.finish()
    for sp in params:
        assert torch.equal(reducer.shard_grad(sp), expected_shard(sp, torch.full(sp.shape, 3.0))), sp.fqn


class SendWrites(TorchDispatchMode):
    """Records the name of every op that writes into one of ``reducer``'s send buffers (copy-in, padding, zeros)."""

    WRITES = {"copy_", "add_", "zero_", "fill_", "_chunk_cat", "split_with_sizes_copy", "_foreach_copy_", "cat"}

    def __init__(self, reducer):
        super().__init__()
        self.reducer = reducer
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in self.WRITES:
            sends = {b.send.untyped_storage().data_ptr() for b in self.reducer.buckets if b.send is not None}
            target = kwargs.get("out", args[0] if args else None)
            targets = target if isinstance(target, (list, tuple)) else [target]
            if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in sends for t in targets):
                self.names.append(name)
        return func(*args, **kwargs)


def test_reducer_copies_a_units_gradients_into_its_bucket_with_one_op():
    """[Note: one copy per unit]: each run of a unit's parameters in a bucket is copied in by one ``_chunk_cat`` when
    its last gradient arrives (the per-parameter copy made 2-4 ops per parameter), with the same values; a group
    with a parameter missing, and a second gradient, take the per-parameter path and stay right."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 5), nn.Linear(5, 3))
    params = sharded(model, 2, 1, "model")
    units = [params[0:2], params[2:4], params[4:6]]  # each layer's weight and bias
    # reversed, padded at world 2: 2.bias 4, 2.weight 16, 1.bias 6 | 1.weight 36 | 0.bias 8 | 0.weight 70 (adopted)
    reducer = GradReducer(list(reversed(params)), LoopbackComm(2, 1), 40, reduce_dtype=torch.float32,
                          copy_groups=units)
    assert [[p.fqn for p in b.params] for b in reducer.buckets] == [
        ["model.2.bias", "model.2.weight", "model.1.bias"], ["model.1.weight"], ["model.0.bias"], ["model.0.weight"]]
    grads = {sp.fqn: torch.randn(sp.shape) for sp in params}
    with SendWrites(reducer) as writes:
        for sp in random.Random(0).sample(params, len(params)):
            reducer.add(sp, grads[sp.fqn])
        reducer.finish()
    # groups: [2.bias, 2.weight], [1.bias] | [1.weight] | [0.bias]; 0.weight is reduced from its own gradient
    assert writes.names == ["_chunk_cat"] * 4, writes.names
    for sp in params:
        assert torch.equal(reducer.shard_grad(sp), expected_shard(sp, grads[sp.fqn])), sp.fqn

    reducer.zero_grad()
    by_name = {sp.fqn: sp for sp in params}
    with SendWrites(reducer) as writes:
        reducer.add(by_name["model.2.bias"], grads["model.2.bias"])
        reducer.add(by_name["model.2.bias"], grads["model.2.bias"])  # before its group is complete: held, summed
        reducer.add(by_name["model.2.weight"], grads["model.2.weight"])  # completes the group: one op
        reducer.add(by_name["model.2.weight"], grads["model.2.weight"])  # after: added in place
        reducer.finish()  # the others get none: zeros, one parameter at a time
    assert writes.names[0] == "_chunk_cat" and "_chunk_cat" not in writes.names[1:], writes.names
    for sp in params:
        twice = 2 * grads[sp.fqn] if sp.fqn in ("model.2.bias", "model.2.weight") else None
        assert torch.equal(reducer.shard_grad(sp), expected_shard(sp, twice)), sp.fqn


def test_reducer_regroup_copies_each_new_unit_with_one_op():
    """The units made again (a module compiled after initialize becomes one unit of its subtree): ``regroup`` cuts the
    copy groups by the new units, so the whole model's gradients go in with one op per new unit and bucket, with the
    same values. Refused inside a pass, where a group holds gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 5), nn.Linear(5, 3))
    params = sharded(model, 2, 1, "model")
    reducer = GradReducer(list(reversed(params)), LoopbackComm(2, 1), 10**6, reduce_dtype=torch.float32,
                          copy_groups=[params[0:2], params[2:4], params[4:6]])
    grads = {sp.fqn: torch.randn(sp.shape) for sp in params}
    reducer.add(params[0], grads[params[0].fqn])
    with pytest.raises(RuntimeError, match="regroup inside a backward pass"):
        reducer.regroup([params])
    reducer.discard()
    reducer.regroup([params])  # one unit of the whole model: one group in the one bucket
    with SendWrites(reducer) as writes:
        for sp in random.Random(0).sample(params, len(params)):
            reducer.add(sp, grads[sp.fqn])
        reducer.finish()
    assert writes.names == ["_chunk_cat"], writes.names  # three with the old units
    for sp in params:
        assert torch.equal(reducer.shard_grad(sp), expected_shard(sp, grads[sp.fqn])), sp.fqn
