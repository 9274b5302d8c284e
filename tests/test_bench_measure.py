"""bench/_measure.py's count of a step's collectives from the torch profiler (what bench/compare.py reports for every
system) agrees with zero_engine's own counters, including gloo's reduce-scatter run as an all-to-all."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import zero_engine
from zero_engine.testing import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from _measure import collectives_from_trace, profile_collectives  # noqa: E402


def _profiled_step_body(cap_bytes: int, large: bool):
    from zero_engine.comm import _backend

    _backend.ALL_TO_ALL_REDUCE_MAX_BYTES, cap = cap_bytes, _backend.ALL_TO_ALL_REDUCE_MAX_BYTES
    try:
        return _profiled_step(large)
    finally:
        _backend.ALL_TO_ALL_REDUCE_MAX_BYTES = cap


def _profiled_step(large: bool):
    torch.manual_seed(0)
    # large: above world 2 every gather runs as sends and receives, the first Linear's (501k elements, weight and
    # bias staged: the other ranks' rows) and the second's (600k, straight into its storage: a whole all-gather)
    model = (nn.Sequential(nn.Linear(500, 1000), nn.Tanh(), nn.Linear(1000, 600)) if large
             else nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "reduce_bucket_size": 1000}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    x = torch.randn(2, 500 if large else 32)

    def step():
        engine.backward(engine(x).square().mean())
        engine.step()

    step()
    before = engine.comm_stats()
    _, counted = profile_collectives(step, 4)
    after = engine.comm_stats()
    engine.destroy()
    ours = {kind: after[kind]["bytes"] - before[kind]["bytes"] for kind in ("all_gather", "reduce_scatter")}
    return counted, ours


@pytest.mark.parametrize("world, cap_bytes, large", [(2, 4 << 20, False), (2, 0, False), (3, 4 << 20, True)],
                         ids=["all-to-all", "all-reduce in place", "sends and receives"])
def test_a_profiled_step_counts_what_the_engine_counts(world, cap_bytes, large):
    for counted, ours in run_ranks(_profiled_step_body, world, cap_bytes, large, timeout=120):
        assert ours["reduce_scatter"] > 0
        for kind in ("all_gather", "reduce_scatter"):
            assert counted.get(kind, {}).get("bytes", 0) == ours[kind], (kind, counted, ours)
        assert set(counted) == {"all_gather", "reduce_scatter", "all_reduce"}, counted  # grad norm, fingerprint


def test_an_all_to_all_outside_a_reduce_scatter_range_is_its_own_kind():
    alltoall = {"name": "c10d::alltoall_base_", "tid": 1, "ts": 50, "dur": 5,
                "args": {"Input Dims": [[8], [8]], "Input type": ["float", "float"]}}
    ranged = {"name": "zero3::reduce_scatter grads bucket 0", "tid": 1, "ts": 40, "dur": 20}
    assert collectives_from_trace({"traceEvents": [alltoall]}, 4) == {"all_to_all": {"calls": 1, "bytes": 32}}
    assert collectives_from_trace({"traceEvents": [ranged, alltoall]}, 4) == {
        "reduce_scatter": {"calls": 1, "bytes": 32}}
    allreduce = {"name": "c10d::allreduce_", "tid": 1, "ts": 45, "dur": 5,
                 "args": {"Input Dims": [[[8]]], "Input type": ["TensorList"]}}
    assert collectives_from_trace({"traceEvents": [ranged, allreduce]}, 4) == {  # in place, above the cap
        "reduce_scatter": {"calls": 1, "bytes": 32}}
    elsewhere = dict(ranged, tid=2)  # another thread's range does not hold this op
    assert collectives_from_trace({"traceEvents": [elsewhere, alltoall]}, 4) == {
        "all_to_all": {"calls": 1, "bytes": 32}}


def test_an_all_to_all_inside_an_all_gather_range_is_that_all_gather_by_its_gathered_size():
    """On gloo the engine's all-gathers are all-to-alls ([Note: gloo's all-gather as an all-to-all]): above world 2
    of the shard repeated (the input is the gathered size), at world 2 of the shard alone, with split sizes; the
    world-2 reduce-scatter sends half its input the same way."""
    ranged = {"name": "zero3::all_gather blocks.0", "tid": 1, "ts": 40, "dur": 20}
    repeated = {"name": "c10d::alltoall_base_", "tid": 1, "ts": 50, "dur": 5,
                "args": {"Input Dims": [[12], [12], [], []], "Input type": ["float", "float", "", ""],
                         "Concrete Inputs": ["", "", "", "[]", "[]"]}}
    assert collectives_from_trace({"traceEvents": [ranged, repeated]}, 4) == {"all_gather": {"calls": 1, "bytes": 48}}
    world_2 = dict(repeated, args={"Input Dims": [[6], [6], [], []], "Input type": ["float", "float", "", ""],
                                   "Concrete Inputs": ["", "", "", "[6, 0]", "[6, 0]"]})
    assert collectives_from_trace({"traceEvents": [ranged, world_2]}, 4) == {"all_gather": {"calls": 1, "bytes": 48}}
    reduced = dict(ranged, name="zero3::reduce_scatter grads bucket 0")
    assert collectives_from_trace({"traceEvents": [reduced, world_2]}, 4) == {
        "reduce_scatter": {"calls": 1, "bytes": 48}}
    # qgZ's own all-to-all, in no such range, keeps its split sizes' meaning: its input
    assert collectives_from_trace({"traceEvents": [world_2]}, 4) == {"all_to_all": {"calls": 1, "bytes": 24}}


def test_the_sends_and_receives_inside_an_all_gather_range_are_that_one_all_gather_by_its_gathered_size():
    """Above world 2 a gather of 1 MiB or more runs as a send and a receive per peer ([Note: gloo's gathers as sends
    and receives]): one all-gather of world x row bytes, not one call per send and receive (it was 2 (world - 1)
    calls of a row each: 1.5 x the bytes at world 4)."""
    ranged = {"name": "zero3::all_gather blocks.0", "tid": 1, "ts": 40, "dur": 20}
    second = dict(ranged, ts=70)

    def point_to_point(name, ts):
        return {"name": name, "tid": 1, "ts": ts, "dur": 1,
                "args": {"Input Dims": [[[6]], [], [], []], "Input type": ["TensorList", "", "Scalar", "Scalar"]}}

    world_4 = [point_to_point("c10d::recv_", 41 + i) for i in range(3)]
    world_4 += [point_to_point("c10d::send", 44 + i) for i in range(3)]
    assert collectives_from_trace({"traceEvents": [ranged, *world_4]}, 4) == {"all_gather": {"calls": 1, "bytes": 96}}
    again = [dict(e, ts=e["ts"] + 30) for e in world_4]
    assert collectives_from_trace({"traceEvents": [ranged, second, *world_4, *again]}, 4) == {
        "all_gather": {"calls": 2, "bytes": 192}}

