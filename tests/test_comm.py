"""zero_engine.comm: collectives against local references, exact counters, emulated backend gaps, debug mode.

Functions whose names start with an underscore run on simulated ranks (run_ranks sends them by reference).
"""

import contextlib
import datetime
import math
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist

import zero_engine
from zero_engine.comm import CollectiveMismatchError, Communicator, Pending, init_distributed
from zero_engine.comm import _backend
from zero_engine.testing import fake_world, run_ranks

pytestmark = pytest.mark.timeout(120)

RANK_TIMEOUT_S = 45.0


# -- helpers shared by the rank functions and the local references ----------------------------------------------

def _rank_data(rank: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    """Distinct, exactly representable values per rank, so sums and averages have exact references."""
    return (torch.arange(numel, dtype=torch.float32) * (rank + 1) + 10 * rank).to(dtype)


def _shard_numel(full_numel: int, world_size: int) -> int:
    return math.ceil(full_numel / world_size)  # ZeRO-3 padding: the last rank's shard is padded


# -- every collective, sync and async, with exact counters ------------------------------------------------------

def _exercise_all_collectives(full_numel: int, debug: bool) -> dict:
    comm = Communicator(debug=debug)
    rank, world = comm.rank, comm.world_size
    shard = _shard_numel(full_numel, world)
    padded = shard * world
    results = {}

    for async_op in (False, True):
        tag = "async" if async_op else "sync"
        gathered = torch.full((padded,), -1.0)
        pending = comm.all_gather_into_tensor(gathered, _rank_data(rank, shard), async_op=async_op, name="gather")
        if not isinstance(pending, Pending):
            raise TypeError(f"expected Pending, got {type(pending)}")
        results[f"all_gather_{tag}"] = pending.wait().tolist()

        dst = world - 1  # onto one rank (a save's whole tensors), not the first, so the group's ranks are mapped
        into = torch.full((padded,), -1.0) if rank == dst else None
        pending = comm.gather(into, _rank_data(rank, shard), dst=dst, async_op=async_op, name="save")
        results[f"gather_{tag}"] = pending.wait().tolist() if rank == dst else None

        for op in ("sum", "avg"):
            shard_out = torch.full((shard,), -1.0)
            pending = comm.reduce_scatter_tensor(shard_out, _rank_data(rank, padded), op=op, async_op=async_op,
                                                 name=f"grads {op}")
            results[f"reduce_scatter_{op}_{tag}"] = pending.wait().tolist()

        for op in ("sum", "avg", "max", "min"):
            pending = comm.all_reduce(_rank_data(rank, full_numel), op=op, async_op=async_op, name=f"norm {op}")
            results[f"all_reduce_{op}_{tag}"] = pending.wait().tolist()

        source = world - 1
        pending = comm.broadcast(_rank_data(rank, full_numel), src=source, async_op=async_op, name="weights")
        results[f"broadcast_{tag}"] = pending.wait().tolist()

    # bfloat16 to check that bytes follow the element size, not a fixed 4 bytes per element.
    comm.all_gather_into_tensor(torch.empty(padded, dtype=torch.bfloat16), _rank_data(rank, shard, torch.bfloat16))
    results["object"] = comm.all_gather_object({"rank": rank})
    comm.barrier()
    results["stats"] = comm.stats()
    comm.reset_stats()
    results["stats_after_reset"] = comm.stats()
    return results


def _reference(full_numel: int, world: int, rank: int) -> dict:
    shard = _shard_numel(full_numel, world)
    padded = shard * world
    reference = {}
    gathered = torch.cat([_rank_data(r, shard) for r in range(world)]).tolist()
    summed_input = sum(_rank_data(r, padded) for r in range(world))
    my_slice = slice(rank * shard, (rank + 1) * shard)
    full = torch.stack([_rank_data(r, full_numel) for r in range(world)])
    for tag in ("sync", "async"):
        reference[f"all_gather_{tag}"] = gathered
        reference[f"gather_{tag}"] = gathered if rank == world - 1 else None
        reference[f"reduce_scatter_sum_{tag}"] = summed_input[my_slice].tolist()
        reference[f"reduce_scatter_avg_{tag}"] = (summed_input[my_slice] / world).tolist()
        reference[f"all_reduce_sum_{tag}"] = full.sum(0).tolist()
        reference[f"all_reduce_avg_{tag}"] = (full.sum(0) / world).tolist()
        reference[f"all_reduce_max_{tag}"] = full.max(0).values.tolist()
        reference[f"all_reduce_min_{tag}"] = full.min(0).values.tolist()
        reference[f"broadcast_{tag}"] = _rank_data(world - 1, full_numel).tolist()
    reference["object"] = [{"rank": r} for r in range(world)]
    return reference


@pytest.mark.parametrize("world_size,full_numel,debug", [
    (1, 7, False),
    (2, 7, False),   # 7 elements over 2 ranks: padded shards of 4
    (3, 10, False),  # 10 over 3: padded shards of 4
    (3, 10, True),   # debug checks must not change results or counters
])
def test_collectives_match_local_reference_and_count_exactly(world_size, full_numel, debug):
    results = run_ranks(_exercise_all_collectives, world_size, full_numel, debug, timeout=RANK_TIMEOUT_S)

    shard = _shard_numel(full_numel, world_size)
    padded_bytes_fp32 = shard * world_size * 4
    full_bytes = full_numel * 4
    expected_stats = {
        # all_gather counts the gathered output: 2 fp32 calls + 1 bf16 call.
        "all_gather": {"calls": 3, "bytes": 2 * padded_bytes_fp32 + shard * world_size * 2},
        # reduce_scatter counts the unreduced input: (sum, avg) x (sync, async).
        # gather counts the gathered tensor on every rank, as all_gather, though only its destination receives it
        "gather": {"calls": 2, "bytes": 2 * padded_bytes_fp32},
        "reduce_scatter": {"calls": 4, "bytes": 4 * padded_bytes_fp32},
        "all_reduce": {"calls": 8, "bytes": 8 * full_bytes},
        "broadcast": {"calls": 2, "bytes": 2 * full_bytes},
    }
    if (world_size, full_numel) == (3, 10):  # the arithmetic above, spelled out once: shards of 4, padded to 12
        assert expected_stats["all_gather"]["bytes"] == 48 + 48 + 24
    for rank, result in enumerate(results):
        reference = _reference(full_numel, world_size, rank)
        for key, expected in reference.items():
            exact = key == "object" or expected is None
            assert result[key] == (expected if exact else pytest.approx(expected)), f"rank {rank} {key}"
        stats = result["stats"]
        for kind, counts in expected_stats.items():
            assert stats[kind] == counts, f"rank {rank} {kind}: {stats[kind]} != {counts}"
        assert stats["object"]["calls"] == 1 and stats["object"]["bytes"] > 0
        assert all(counts == {"calls": 0, "bytes": 0} for counts in result["stats_after_reset"].values())


# -- emulation of backend gaps ----------------------------------------------------------------------------------

@contextlib.contextmanager
def _forced(support, **fields):
    """``support``'s capability ``fields`` set for the block (tests force paths this way), restored after."""
    saved = {name: getattr(support, name) for name in fields}
    for name, value in fields.items():
        setattr(support, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(support, name, value)


def _exercise_emulated_collectives(full_numel: int) -> dict:
    """Force every emulation path (as on a gloo without single-tensor collectives or AVG) and compare results."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    shard = _shard_numel(full_numel, world)
    padded = shard * world
    results = {}
    # the emulations themselves, not gloo's all-to-all reduce-scatter
    with _forced(_backend.support_for(comm.backend), all_gather_single=False, reduce_scatter_single=False, avg=False,
                 reduce_scatter_by_all_to_all=False):
        for tag, async_op in (("sync", False), ("async", True)):
            gathered = torch.empty(padded)
            results[f"all_gather_{tag}"] = comm.all_gather_into_tensor(
                gathered, _rank_data(rank, shard), async_op=async_op).wait().tolist()
            for op in ("sum", "avg"):
                shard_out = torch.empty(shard)
                pending = comm.reduce_scatter_tensor(shard_out, _rank_data(rank, padded), op=op, async_op=async_op)
                pending.wait()
                results[f"reduce_scatter_{op}_{tag}"] = pending.wait().tolist()  # a second wait must not re-divide
            pending = comm.all_reduce(_rank_data(rank, full_numel), op="avg", async_op=async_op)
            pending.wait()
            results[f"all_reduce_avg_{tag}"] = pending.wait().tolist()
        results["stats"] = comm.stats()
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_emulated_collectives_match_native_results_and_counters(world_size):
    full_numel = 10
    results = run_ranks(_exercise_emulated_collectives, world_size, full_numel, timeout=RANK_TIMEOUT_S)
    shard = _shard_numel(full_numel, world_size)
    for rank, result in enumerate(results):
        reference = _reference(full_numel, world_size, rank)
        for key, value in result.items():
            if key != "stats":
                assert value == pytest.approx(reference[key]), f"rank {rank} {key}"
        # The logical collective is counted, not the all_reduce that emulates a reduce_scatter.
        assert result["stats"]["reduce_scatter"] == {"calls": 4, "bytes": 4 * shard * world_size * 4}
        assert result["stats"]["all_reduce"] == {"calls": 2, "bytes": 2 * full_numel * 4}
        assert result["stats"]["all_gather"] == {"calls": 2, "bytes": 2 * shard * world_size * 4}


def _reduce_scatter_on_gloo(full_numel: int) -> dict:
    """A reduce-scatter of CPU tensors on gloo runs as an all-to-all and a sum ([Note: gloo's reduce-scatter as an
    all-to-all]): gloo's own result (an all-reduce), bitwise at world 2; its input untouched; counted as the
    reduce-scatter it is, recorded as the all-to-all that runs (its wait honours timeouts). Scratch or not, and in
    each dtype the engine reduces in."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    shard = _shard_numel(full_numel, world)
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for op in ("sum", "avg"):
            for scratch in (False, True):
                inp = _rank_data(rank, shard * world).to(dtype)
                kept = inp.clone()
                native, ours = torch.empty(shard, dtype=dtype), torch.empty(shard, dtype=dtype)
                dist.reduce_scatter_tensor(native, inp.clone(), op=dist.ReduceOp.SUM)
                if op == "avg":
                    native.div_(world)
                comm.reduce_scatter_tensor(ours, inp, op=op, async_op=True, input_is_scratch=scratch).wait()
                out[(str(dtype), op, scratch)] = (torch.equal(native, ours),
                                                  torch.allclose(native.float(), ours.float(), rtol=1e-2, atol=1e-3),
                                                  torch.equal(inp, kept), comm.progress.last.kind)
    out["workspace"] = comm.reduce_scatter_workspace(torch.empty(8 * world))
    # above the cap, a scratch input is all-reduced in place: no workspace
    cap = _backend.ALL_TO_ALL_REDUCE_MAX_BYTES // 4
    large = torch.ones((cap // world + 1) * world)
    comm.reduce_scatter_tensor(torch.empty(large.numel() // world), large, op="sum", input_is_scratch=True)
    out["large"] = (comm.progress.last.kind, comm.reduce_scatter_workspace(large),
                    comm.reduce_scatter_workspace(torch.empty(cap)))
    out["stats"] = comm.stats()["reduce_scatter"]["calls"]
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_reduce_scatter_on_gloo_is_an_all_to_all_and_a_sum_with_gloos_result(world_size):
    for result in run_ranks(_reduce_scatter_on_gloo, world_size, 10, timeout=RANK_TIMEOUT_S):
        stats, workspace, large = result.pop("stats"), result.pop("workspace"), result.pop("large")
        for key, (equal, close, input_kept, kind) in result.items():
            assert close and input_kept and kind == "all_to_all", (key, result[key])
            if world_size == 2:  # one addition, a + b either way
                assert equal, key
        assert stats == 13
        # the received rows, counted by the caller: the input's size; at world 2 the peer's half only
        received = 1 / 2 if world_size == 2 else 1
        assert workspace == 8 * world_size * 4 * received
        # the cap itself still takes it
        assert large == ("all_reduce", 0, _backend.ALL_TO_ALL_REDUCE_MAX_BYTES * received)


def _all_gather_on_gloo(full_numel: int) -> dict:
    """An all-gather of CPU tensors on gloo runs as an all-to-all ([Note: gloo's all-gather as an all-to-all]; at
    world 2 one that sends nothing to this rank itself, above it one of the shard repeated) or, above world 2 from
    1 MiB of output, as a send and a receive per peer ([Note: gloo's gathers as sends and receives]): gloo's own
    result bitwise, in each dtype the engine gathers, sync and async; its input untouched; counted as the all-gather
    it is (the output's bytes), recorded as what runs."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    shard = _shard_numel(full_numel, world)
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for async_op in (False, True):
            inp = _rank_data(rank, shard, dtype)
            kept = inp.clone()
            native = torch.empty(shard * world, dtype=dtype)
            ours = torch.full((shard * world,), float("nan"), dtype=dtype)  # every element must be written
            dist.all_gather_into_tensor(native, inp)
            comm.all_gather_into_tensor(ours, inp, async_op=async_op, name="w").wait()
            out[(str(dtype), async_op)] = (torch.equal(native, ours), torch.equal(inp, kept), comm.progress.last.kind)
    out["stats"] = comm.stats()["all_gather"]
    # an output above ALL_TO_ALL_GATHER_MAX_BYTES: above world 2 sends and receives, or gloo's own where those are
    # turned off (the repeated shard would be as large as gloo's buffer)
    large = torch.full((_backend.ALL_TO_ALL_GATHER_MAX_BYTES // 4 // world + 1,), float(rank))
    out["large"] = []
    for send_recv in (True, False):
        with _forced(_backend.support_for(comm.backend), all_gather_by_send_recv=send_recv):
            gathered = comm.all_gather_into_tensor(torch.empty(large.numel() * world), large).tensor
            out["large"].append((comm.progress.last.kind, gathered.view(world, -1)[:, 0].tolist()))
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("full_numel", [10, 600_000])
def test_an_all_gather_on_gloo_is_an_all_to_all_or_sends_and_receives_with_gloos_result(world_size, full_numel):
    shard = _shard_numel(full_numel, world_size)
    for result in run_ranks(_all_gather_on_gloo, world_size, full_numel, timeout=RANK_TIMEOUT_S):
        stats, large = result.pop("stats"), result.pop("large")
        for key, (equal, input_kept, kind) in result.items():
            nbytes = shard * world_size * torch.empty((), dtype=getattr(torch, key[0].split(".")[1])).element_size()
            runs = "send_recv" if world_size > 2 and nbytes >= _backend.SEND_RECV_GATHER_MIN_BYTES else "all_to_all"
            assert equal and input_kept and kind == runs, (key, result[key], runs)
        assert stats == {"calls": 6, "bytes": 2 * shard * world_size * (4 + 2 + 2)}
        rows = [float(r) for r in range(world_size)]
        if world_size == 2:  # nothing is repeated: the all-to-all at any size
            assert large == [("all_to_all", rows), ("all_to_all", rows)], large
        else:
            assert large == [("send_recv", rows), ("all_gather", rows)], large


def _all_gather_peers_on_gloo(full_numel: int) -> dict:
    """``all_gather_peers`` ([Note: a gather that leaves this rank's row out] in gather.py): gloo's full result with
    this rank's row taken out, bitwise, in each dtype, sync and async; the output has world - 1 rows and every one
    is written; the input is untouched; counted and recorded as the full all-gather (the all-to-all that runs).
    Where the all-gather is not an all-to-all, it refuses with a message that names the method to use instead."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    shard = _shard_numel(full_numel, world)
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for async_op in (False, True):
            inp = _rank_data(rank, shard, dtype)
            kept = inp.clone()
            native = torch.empty(shard * world, dtype=dtype)
            peers = torch.full((shard * (world - 1),), float("nan"), dtype=dtype)  # every element must be written
            dist.all_gather_into_tensor(native, inp)
            assert comm.gathers_peers_only(inp)
            comm.all_gather_peers(peers, inp, async_op=async_op, name="w").wait()
            expected = torch.cat([row for r, row in enumerate(native.view(world, -1)) if r != rank])
            out[(str(dtype), async_op)] = (torch.equal(expected, peers), torch.equal(inp, kept),
                                           comm.progress.last.kind)
    out["stats"] = comm.stats()["all_gather"]
    # two gathers in flight at once, waited in the other order (their own tags above world 2), and the all-to-all
    # of the repeated shard where the sends and receives are off: the same rows
    first, second = _rank_data(rank, shard), _rank_data(rank + world, shard)
    rows = [torch.empty(shard * (world - 1)) for _ in range(2)]
    pending = [comm.all_gather_peers(rows[0], first, async_op=True, name="a"),
               comm.all_gather_peers(rows[1], second, async_op=True, name="b")]
    pending[1].wait()
    pending[0].wait()
    out["two_in_flight"] = [torch.equal(row, torch.cat([_rank_data(r + k * world, shard) for r in range(world)
                                                        if r != rank])) for k, row in enumerate(rows)]
    with _forced(_backend.support_for(comm.backend), all_gather_by_send_recv=False):
        row = torch.empty(shard * (world - 1))
        comm.all_gather_peers(row, first, name="repeated").wait()
        out["repeated"] = (torch.equal(row, rows[0]), comm.progress.last.kind)
    with _forced(_backend.support_for(comm.backend), all_gather_by_all_to_all=False):
        inp = torch.ones(shard)
        out["refused_where"] = comm.gathers_peers_only(inp)
        try:
            comm.all_gather_peers(torch.empty(shard * (world - 1)), inp, name="w")
            out["refused"] = ""
        except ValueError as error:
            out["refused"] = str(error)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("full_numel", [10, 600_000])
def test_all_gather_peers_is_gloos_result_without_this_ranks_row(world_size, full_numel):
    shard = _shard_numel(full_numel, world_size)
    for result in run_ranks(_all_gather_peers_on_gloo, world_size, full_numel, timeout=RANK_TIMEOUT_S):
        stats, refused_where, refused = result.pop("stats"), result.pop("refused_where"), result.pop("refused")
        two_in_flight, repeated = result.pop("two_in_flight"), result.pop("repeated")
        for key, (equal, input_kept, kind) in result.items():
            # what runs: one all-to-all at world 2; above, a send and a receive per peer from 1 MiB of output
            # ([Note: gloo's gathers as sends and receives] in _backend.py), the all-to-all below
            nbytes = shard * world_size * torch.empty((), dtype=getattr(torch, key[0].split(".")[1])).element_size()
            runs = "send_recv" if world_size > 2 and nbytes >= _backend.SEND_RECV_GATHER_MIN_BYTES else "all_to_all"
            assert equal and input_kept and kind == runs, (key, result[key], runs)
        assert stats == {"calls": 6, "bytes": 2 * shard * world_size * (4 + 2 + 2)}  # as the full all-gather
        assert two_in_flight == [True, True] and repeated == (True, "all_to_all"), (two_in_flight, repeated)
        assert not refused_where and "all_gather_into_tensor" in refused, refused


def _scratch_reduce_scatter_without_all_to_all(full_numel: int) -> dict:
    """Where the all-to-all does not apply (gloo with CUDA tensors; forced off here), a scratch input is all-reduced
    in place: bitwise the native result, recorded as the all-reduce that runs."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    shard = _shard_numel(full_numel, world)
    out = {}
    with _forced(_backend.support_for(comm.backend), reduce_scatter_by_all_to_all=False):
        for op in ("sum", "avg"):
            native, scratch = torch.empty(shard), torch.empty(shard)
            comm.reduce_scatter_tensor(native, _rank_data(rank, shard * world), op=op).wait()
            inp = _rank_data(rank, shard * world)
            comm.reduce_scatter_tensor(scratch, inp, op=op, async_op=True, input_is_scratch=True).wait()
            out[op] = (torch.equal(native, scratch), comm.progress.last.kind)
        out["workspace"] = comm.reduce_scatter_workspace(torch.empty(8 * world))
    out["in_place"] = _backend.decide_support("gloo", (2, 13)).reduce_scatter_copies_input
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_scratch_reduce_scatter_without_the_all_to_all_is_an_in_place_all_reduce_with_the_same_result(world_size):
    for result in run_ranks(_scratch_reduce_scatter_without_all_to_all, world_size, 10, timeout=RANK_TIMEOUT_S):
        assert result["sum"] == (True, "all_reduce") and result["avg"] == (True, "all_reduce")
        assert result["workspace"] == 0 and result["in_place"]


def _native_error_mentioning_support() -> list:
    """A native op failing with a message that contains "support" must be re-raised, and nothing process-wide may
    change: the next collective is issued exactly as on the other ranks."""
    comm = Communicator()
    support = _backend.support_for(comm.backend)
    before = (support.all_gather_single, support.reduce_scatter_single, support.avg)
    native = _backend._reduce_scatter_single
    calls = []

    def fail_on_rank_1(*args, **kwargs):
        calls.append(1)
        if comm.rank == 1 and len(calls) == 1:
            raise RuntimeError("unsupported tensor layout (a bug, not a missing backend op)")
        return native(*args, **kwargs)

    _backend._reduce_scatter_single = fail_on_rank_1
    raised = None
    try:  # with the native reduce-scatter on CPU tensors: the op under test
        with _forced(support, reduce_scatter_by_all_to_all=False):
            output = torch.empty(2)
            if comm.rank == 1:
                try:
                    comm.reduce_scatter_tensor(output, torch.ones(2 * comm.world_size), op="sum")
                except RuntimeError as error:
                    raised = str(error)
            else:
                raised = "rank 0 skips the first call"
            comm.reduce_scatter_tensor(output, torch.ones(2 * comm.world_size) * (comm.rank + 1), op="sum")
    finally:
        _backend._reduce_scatter_single = native
    after = (support.all_gather_single, support.reduce_scatter_single, support.avg)
    return [output.tolist(), raised, before == after]


def test_a_native_error_is_reraised_and_changes_nothing_process_wide():
    for output, raised, unchanged in run_ranks(_native_error_mentioning_support, 2, timeout=RANK_TIMEOUT_S):
        assert output == [3.0, 3.0]  # 1 + 2: both ranks issued the same native reduce-scatter afterwards
        assert raised is not None
        assert unchanged


def test_native_or_emulated_is_a_function_of_backend_name_and_torch_version():
    everything = ("all_gather_single", "reduce_scatter_single", "avg")
    decide = _backend.decide_support
    assert all(getattr(decide("gloo", (2, 13)), name) for name in everything)
    assert not any(getattr(decide("gloo", (2, 4)), name) for name in everything)
    assert all(getattr(decide("nccl", (2, 4)), name) for name in everything)
    assert not any(getattr(decide("mpi", (2, 13)), name) for name in everything)  # unknown: emulate
    assert not decide("cpu:gloo,cuda:nccl", (2, 4)).avg and decide("cpu:gloo,cuda:nccl", (2, 13)).avg
    assert not hasattr(_backend, "_is_unsupported_error")  # no decision is ever taken from an error message
    # gloo's reduce-scatter runs as an all-to-all (CPU tensors; any torch: all_to_all_single is older than 2.13)
    assert decide("gloo", (2, 13)).reduce_scatter_by_all_to_all and decide("gloo", (2, 4)).reduce_scatter_by_all_to_all
    assert not decide("nccl", (2, 13)).reduce_scatter_by_all_to_all
    assert not decide("mpi", (2, 13)).reduce_scatter_by_all_to_all
    # and its all-gathers
    assert decide("gloo", (2, 13)).all_gather_by_all_to_all and not decide("nccl", (2, 13)).all_gather_by_all_to_all
    assert not decide("cpu:gloo,cuda:nccl", (2, 13)).all_gather_by_all_to_all


# -- debug mode: mismatched collectives become errors on every rank ----------------------------------------------

def _issue_mismatched_collective(mismatch: str) -> dict:
    comm = Communicator(debug=True)
    rank = comm.rank
    numel = 4
    try:
        if mismatch == "size" and rank == 1:
            comm.all_gather_into_tensor(torch.empty(5 * comm.world_size), torch.ones(5), name="layer.weight")
        elif mismatch == "kind" and rank == 1:
            comm.all_reduce(torch.ones(numel), name="layer.weight")
        else:
            comm.all_gather_into_tensor(torch.empty(numel * comm.world_size), torch.ones(numel), name="layer.weight")
        outcome = {"raised": False, "message": ""}
    except CollectiveMismatchError as error:
        outcome = {"raised": True, "message": str(error)}
    # The check left every rank in step: the communicator is still usable afterwards.
    total = comm.all_reduce(torch.ones(1), name="after").wait()
    outcome["after"] = total.item()
    return outcome


@pytest.mark.parametrize("mismatch", ["size", "kind"])
def test_debug_mode_turns_mismatched_collective_into_error_on_every_rank(mismatch):
    results = run_ranks(_issue_mismatched_collective, 3, mismatch, timeout=RANK_TIMEOUT_S)
    messages = {outcome["message"] for outcome in results}
    assert all(outcome["raised"] for outcome in results), results
    assert len(messages) == 1, "every rank reports the same diagnosis"
    message = messages.pop()
    assert "ranks [1] issued a different collective than ranks [0, 2]" in message
    assert "test_comm.py:" in message and "_issue_mismatched_collective" in message  # the call sites
    if mismatch == "size":
        assert "numel=5" in message and "numel=4" in message
    else:
        assert "all_reduce(" in message and "all_gather(" in message
    assert all(outcome["after"] == 3.0 for outcome in results)


def _debug_mode_accepts_matching_collectives() -> dict:
    comm = Communicator(debug=True)
    shard = torch.full((3,), float(comm.rank))
    gathered = comm.all_gather_into_tensor(torch.empty(3 * comm.world_size), shard, name="w").wait()
    return {"gathered": gathered.tolist(), "stats": comm.stats()}


def test_debug_mode_passes_matching_collectives_through():
    results = run_ranks(_debug_mode_accepts_matching_collectives, 2, timeout=RANK_TIMEOUT_S)
    for result in results:
        assert result["gathered"] == [0.0] * 3 + [1.0] * 3
        assert result["stats"]["all_gather"] == {"calls": 1, "bytes": 24}  # the check itself is not counted


# -- the per-collective Python path ----------------------------------------------------------------------------

def _zero_engine_calls_per_collective() -> dict:
    """zero_engine's Python calls for one collective, issued and waited, with the stall watchdog watching the wait
    (as in training): the path every collective of every step takes, kept to a few calls."""
    comm = Communicator(stall_timeout_s=30.0)
    world = comm.world_size
    package = os.path.dirname(zero_engine.__file__) + os.sep
    calls: list[str] = []

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls.append(frame.f_code.co_name)

    def measured(collective) -> list[str]:
        collective().wait()  # the first of a process names its dtype once (a cache): measure the next one
        calls.clear()
        sys.setprofile(count)
        try:
            collective().wait()
        finally:
            sys.setprofile(None)
        return list(calls)

    out = {
        "all_gather": measured(lambda: comm.all_gather_into_tensor(torch.empty(4 * world), torch.ones(4),
                                                                   async_op=True, name="w")),
        "reduce_scatter": measured(lambda: comm.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * world),
                                                                      op="avg", async_op=True, name="g",
                                                                      input_is_scratch=True)),
        "watched": comm.watchdog is not None and comm.watchdog.watches_waits,
    }
    comm.close()
    return out


def test_a_collective_issued_and_waited_is_a_handful_of_python_calls():
    for result in run_ranks(_zero_engine_calls_per_collective, 2, timeout=RANK_TIMEOUT_S):
        assert result["watched"]
        # all_gather_into_tensor, _issue, ProgressLog.record, profile_range, all_gather_plan,
        # CollectiveIssuer.all_gather, Pending.wait, StallWatchdog.wait: no per-collective helper towers (there were
        # 13 calls).
        assert len(result["all_gather"]) <= 8, result["all_gather"]
        # the same, plus reduce_scatter_plan and the sum that completes gloo's all-to-all reduce-scatter
        assert len(result["reduce_scatter"]) <= 9, result["reduce_scatter"]
        assert "_wait_slice" not in result["all_gather"] + result["reduce_scatter"]


# -- argument checks (shape-only, in this process) ----------------------------------------------------------------

def _grouped_all_gather(debug: bool) -> dict:
    comm = Communicator(debug=debug)
    rank, world = comm.rank, comm.world_size
    sizes = (5, 1, 7)  # shard sizes
    inputs = [_rank_data(rank, n) for n in sizes]
    outputs = [torch.empty(n * world) for n in sizes]
    pending = comm.all_gather_grouped(outputs, inputs, async_op=True, name="grouped")
    pending.wait()
    expected = [torch.cat([_rank_data(r, n) for r in range(world)]) for n in sizes]
    records = [r for r in comm.progress.recent if r.name == "grouped"]
    sync = comm.all_gather_grouped([torch.empty(2 * world, dtype=torch.bfloat16)],
                                   [_rank_data(rank, 2, torch.bfloat16)], name="one")
    return {"equal": [torch.equal(o, e) for o, e in zip(outputs, expected)], "stats": comm.stats()["all_gather"],
            "records": [(r.kind, r.dtype, r.numel) for r in records], "sync": sync.tensor.tolist(),
            "groups": comm.groups_all_gathers}


@pytest.mark.parametrize("world_size,debug", [(2, False), (3, True)])
def test_a_grouped_all_gather_gathers_each_pair_as_one_collective(world_size, debug):
    """[Note: large parameters gathered as one group] in gather.py: each pair gathered exactly, issued as one call
    of the backend (torch's coalescing manager), counted and recorded as one all-gather of all the pairs'
    elements; synchronous too. Only NCCL groups them for the engine; gloo runs the group all the same."""
    for out in run_ranks(_grouped_all_gather, world_size, debug, timeout=60):
        assert out["equal"] == [True, True, True]
        assert out["stats"] == {"calls": 2, "bytes": (13 * 4 + 2 * 2) * world_size}
        assert out["records"] == [("all_gather", "float32", 13)]
        assert out["sync"] == [0.0, 1.0] + [v for r in range(1, world_size) for v in (10.0 * r, 10.0 * r + r + 1)]
        assert out["groups"] is False  # gloo


def test_wrong_sizes_and_ops_are_rejected_with_the_rank_and_the_fix():
    with fake_world(4, rank=2) as comm:
        with pytest.raises(ValueError, match=r"all_gather 'p' on rank 2 .*expected world_size x input = 4 x 3 = 12"):
            comm.all_gather_into_tensor(torch.empty(10), torch.empty(3), name="p")
        with pytest.raises(ValueError, match=r"reduce_scatter.*input has 10 elements"):
            comm.reduce_scatter_tensor(torch.empty(3), torch.empty(10))
        with pytest.raises(ValueError, match=r"op='max' is not supported"):
            comm.reduce_scatter_tensor(torch.empty(3), torch.empty(12), op="max")
        with pytest.raises(ValueError, match=r"op='mean' is not a reduce op"):
            comm.all_reduce(torch.empty(3), op="mean")
        with pytest.raises(ValueError, match=r"op='avg' needs a floating-point tensor"):
            comm.all_reduce(torch.ones(3, dtype=torch.int64), op="avg")
        with pytest.raises(ValueError, match=r"dtype"):
            comm.all_gather_into_tensor(torch.empty(12, dtype=torch.float16), torch.empty(3))
        with pytest.raises(ValueError, match=r"contiguous"):
            comm.all_reduce(torch.empty(4, 4).t())
        with pytest.raises(ValueError, match=r"src=4 is not a rank"):
            comm.broadcast(torch.empty(2), src=4)
        # each check behind a collective's one-line common-case test still raises its own message
        with pytest.raises(ValueError, match=r"reduce_scatter.*output dtype torch.float16 differs"):
            comm.reduce_scatter_tensor(torch.empty(3, dtype=torch.float16), torch.empty(12))
        with pytest.raises(ValueError, match=r"all_gather.*output is on meta but input is on cpu"):
            comm.all_gather_into_tensor(torch.empty(12, device="meta"), torch.empty(3))
        with pytest.raises(ValueError, match=r"all_gather.*must be contiguous"):
            comm.all_gather_into_tensor(torch.empty(12), torch.empty(3, 2).t()[0])
        with pytest.raises(ValueError, match=r"reduce_scatter.*op='avg' needs a floating-point tensor"):
            comm.reduce_scatter_tensor(torch.ones(3, dtype=torch.int64), torch.ones(12, dtype=torch.int64))
        with pytest.raises(ValueError, match=r"all_to_all.*a multiple of world_size 4"):
            comm.all_to_all_single(torch.empty(6), torch.empty(6))
        with pytest.raises(ValueError, match=r"all_to_all.*dtype"):
            comm.all_to_all_single(torch.empty(8, dtype=torch.float16), torch.empty(8))
        with pytest.raises(ValueError, match=r"broadcast.*contiguous"):
            comm.broadcast(torch.empty(4, 4).t(), src=0)
        with pytest.raises(ValueError, match=r"gather 's' on rank 2 .*output must be given on rank dst=0 and only"):
            comm.gather(torch.empty(12), torch.empty(3), dst=0, name="s")
        with pytest.raises(ValueError, match=r"gather 's' on rank 2 .*output must be given on rank dst=2 and only"):
            comm.gather(None, torch.empty(3), dst=2, name="s")
        with pytest.raises(ValueError, match=r"gather 's' on rank 2 .*expected world_size x input = 4 x 3 = 12"):
            comm.gather(torch.empty(10), torch.empty(3), dst=2, name="s")
        with pytest.raises(ValueError, match=r"gather.*dst=4 is not a rank"):
            comm.gather(None, torch.empty(3), dst=4)
        with pytest.raises(ValueError, match=r"all_gather 'g' on rank 2: 2 outputs for 1 inputs"):
            comm.all_gather_grouped([torch.empty(4), torch.empty(4)], [torch.empty(1)], name="g")
        with pytest.raises(ValueError, match=r"all_gather 'g' on rank 2 .*an output has 10 elements; expected"):
            comm.all_gather_grouped([torch.empty(4), torch.empty(10)], [torch.empty(1), torch.empty(3)], name="g")
        assert all(counts["calls"] == 0 for counts in comm.stats().values()), "rejected calls are not counted"


def test_communicator_without_process_group_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="init_distributed"):
        Communicator()


# -- init_distributed ----------------------------------------------------------------------------------------------

@pytest.fixture
def no_process_group_after():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_init_distributed_single_process_without_launcher_is_idempotent(monkeypatch, no_process_group_after):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    init_distributed(timeout_s=30)
    assert dist.get_world_size() == 1 and dist.get_rank() == 0
    assert dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    group = dist.group.WORLD
    init_distributed(rank=5, world_size=9)  # already initialized: a quiet no-op, arguments ignored
    assert dist.group.WORLD is group and dist.get_world_size() == 1


def test_init_distributed_reads_torchrun_environment(monkeypatch, no_process_group_after):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    init_distributed(backend="gloo", timeout_s=30)
    assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"


@pytest.mark.parametrize("kwargs,env,match", [
    ({"rank": 0}, {}, "give both"),
    ({"rank": 0, "world_size": 2}, {}, "needs a rendezvous"),
    ({"rank": 2, "world_size": 2, "init_method": "file:///tmp/never"}, {}, r"rank=2 is not in 0\.\.world_size-1"),
    ({"timeout_s": 0}, {}, "timeout_s=0 must be positive"),
    ({}, {"RANK": "x", "WORLD_SIZE": "1"}, "RANK='x' is not an integer"),
])
def test_init_distributed_rejects_incomplete_settings(monkeypatch, no_process_group_after, kwargs, env, match):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        init_distributed(**kwargs)
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_init_distributed_refuses_nccl_without_cuda(no_process_group_after):
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA"):
        init_distributed(backend="nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:1")


def _restart_group_from_environment(master_port: int) -> dict:
    """Replace the harness's group with one made by init_distributed from torchrun-style variables."""
    rank = dist.get_rank()
    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))  # RANK/WORLD_SIZE set by the harness
    init_distributed(timeout_s=30)
    total = Communicator().all_reduce(torch.tensor([float(rank + 1)])).wait()
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "total": total.item()}


def test_init_distributed_from_environment_on_two_ranks():
    results = run_ranks(_restart_group_from_environment, 2, _free_port(), timeout=RANK_TIMEOUT_S)
    assert results == [{"rank": 0, "world": 2, "total": 3.0}, {"rank": 1, "world": 2, "total": 3.0}]


# -- collective_timeout_s: whose timeout applies (issue 20 item 8) -------------------------------------------------

def _timeout_engine(**zero_engine_section):
    import zero_engine

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3}, "zero_engine": zero_engine_section}
    engine, *_ = zero_engine.initialize(model=torch.nn.Linear(2, 2), config=config)
    engine.destroy()
    return engine.comm.collective_timeout_s


def test_collective_timeout_defaults_to_the_process_groups_own(monkeypatch, no_process_group_after):
    from zero_engine.comm._init import group_timeout_s

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    # The engine makes the group: 30 minutes, torch's and DeepSpeed's default.
    assert _timeout_engine() == 1800 and group_timeout_s() == 1800
    dist.destroy_process_group()
    # The user made the group with an hour: an hour, unless the config says otherwise (then that, whoever made it).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(hours=1))
    assert _timeout_engine() == 3600
    assert _timeout_engine(collective_timeout_s=7) == 7
    assert Communicator(group=dist.new_group([0], timeout=datetime.timedelta(seconds=42))).collective_timeout_s == 42
