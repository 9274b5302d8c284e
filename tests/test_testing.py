"""zero_engine.testing: the simulated-rank harness (results, raising and hanging ranks, pooling) and fake_world.

Functions whose names start with an underscore run on simulated ranks (run_ranks sends them by reference).
"""

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from zero_engine.testing import RankError, RankTimeoutError, fake_world, on_ranks, run_ranks

pytestmark = pytest.mark.timeout(120)


def _rank_and_sum(offset: int, scale: float = 1.0) -> dict:
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": total.item(), "offset": offset,
            "scale": scale, "threads": torch.get_num_threads()}


@pytest.mark.parametrize("world_size", [1, 4])
def test_results_come_back_indexed_by_rank(world_size):
    results = run_ranks(_rank_and_sum, world_size, 7, scale=2.5, timeout=60)
    expected_sum = float(sum(range(world_size)))
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world"] == world_size and r["sum"] == expected_sum for r in results)
    assert all(r["offset"] == 7 and r["scale"] == 2.5 for r in results)
    assert all(r["threads"] == max(1, 2 // world_size) for r in results)


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 is left waiting for rank 1 here


def test_raising_rank_is_reported_with_its_rank_exception_and_traceback():
    started = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_ranks(_raise_on_rank_one, 2, timeout=30)
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert "rank 1 raised ValueError: deliberate failure on rank 1" in message
    assert "Traceback (most recent call last)" in message
    assert 'test_testing.py", line' in message and "in _raise_on_rank_one" in message
    # rank 0 never returns from its barrier: it is killed after the grace period, with its stack shown.
    assert "rank 0 did not finish" in message and "in barrier" in message
    assert caught.value.ranks == [0, 1]
    assert not isinstance(caught.value, TimeoutError)
    assert elapsed < 20, f"took {elapsed:.1f}s; the blocked rank should only get a short grace"


def _sleep_forever_on_rank_one() -> None:
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()


def test_hanging_rank_times_out_with_every_ranks_stack():
    run_ranks(_rank_and_sum, 2, 0, timeout=60)  # start the pool first, so the timeout below measures the call only
    started = time.monotonic()
    with pytest.raises(RankTimeoutError) as caught:
        run_ranks(_sleep_forever_on_rank_one, 2, timeout=2.0)
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert isinstance(caught.value, TimeoutError) and isinstance(caught.value, RankError)
    assert "did not finish within 2.0s" in message
    assert "rank 0 (still running) Python stack:" in message and "rank 1 (still running) Python stack:" in message
    rank_zero_stack, rank_one_stack = message.split("rank 1 (still running) Python stack:")
    assert "in barrier" in rank_zero_stack and "_sleep_forever_on_rank_one" in rank_zero_stack
    assert "_sleep_forever_on_rank_one" in rank_one_stack and "in barrier" not in rank_one_stack
    assert elapsed < 15, f"took {elapsed:.1f}s for a 2s timeout"


def _pid() -> int:
    return os.getpid()


def test_pool_is_reused_and_recreated_after_a_rank_dies():
    first = run_ranks(_pid, 2, timeout=60)
    second = run_ranks(_pid, 2, timeout=60)
    assert first == second, "the same rank processes serve consecutive calls"
    assert os.getpid() not in first
    with pytest.raises(RankError, match=r"rank 1: process exited with code 3 before returning"):
        run_ranks(_exit_abruptly_on_rank_one, 2, timeout=30)
    third = run_ranks(_pid, 2, timeout=60)
    assert set(third).isdisjoint(first), "a failed call's pool is killed and a fresh one started"


def _abort_in_a_named_function_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os.abort()  # as a C++ abort does (gloo's on a collective mismatch): SIGABRT, no Python exception
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_reported_with_the_signal_and_its_python_stack():
    with pytest.raises(RankError) as caught:
        run_ranks(_abort_in_a_named_function_on_rank_one, 2, timeout=30)
    (failure,) = [f for f in caught.value.failures if f.rank == 1]
    assert failure.exception.startswith("process exited with code -6 (SIGABRT) before returning"), failure
    assert "Fatal Python error: Aborted" in failure.traceback, failure.traceback
    assert "in _abort_in_a_named_function_on_rank_one" in failure.traceback, failure.traceback
    assert "rank 1: process exited with code -6 (SIGABRT)" in str(caught.value)
    assert "in _abort_in_a_named_function_on_rank_one" in str(caught.value)


def _parent() -> tuple[int, str, bool]:
    """This rank's parent process: its pid, its command line, and whether it has torch's library mapped."""
    parent = os.getppid()
    with open(f"/proc/{parent}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode()
    with open(f"/proc/{parent}/maps") as f:
        has_torch = "libtorch_cpu" in f.read()
    return parent, cmdline, has_torch


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc (Linux)")
def test_ranks_are_forked_from_a_server_that_imported_torch_once():
    """[Note: ranks forked from a preloaded server]: the ranks are children of multiprocessing's fork server, not of
    this process, and that server has torch loaded, so a rank does not import it again."""
    parents = run_ranks(_parent, 3, timeout=60)
    assert len({pid for pid, _, _ in parents}) == 1 and parents[0][0] != os.getpid()
    _, cmdline, has_torch = parents[0]
    assert "forkserver" in cmdline, cmdline
    assert has_torch


def _exit_abruptly_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def test_functions_that_cannot_be_sent_by_reference_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="must be defined at module level"):
        run_ranks(lambda: 0, 2)
    with pytest.raises(ValueError, match="world_size=0"):
        run_ranks(_pid, 0)


@on_ranks(2, timeout=60)
def test_decorated_test_body_runs_on_every_rank():
    assert dist.get_world_size() == 2
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 2.0


@pytest.mark.parametrize("value", [3])
@on_ranks(2, timeout=60)
def test_decorated_test_body_receives_pytest_parameters(value):
    gathered = [None, None]
    dist.all_gather_object(gathered, value + dist.get_rank())
    assert gathered == [3, 4]


# -- fake_world ---------------------------------------------------------------------------------------------------

def test_fake_world_runs_all_gather_shapes_at_1024_ranks():
    world = 1024
    with fake_world(world, rank=1000) as comm:
        assert (comm.rank, comm.world_size) == (1000, world)
        assert dist.get_backend() == "fake"
        shard = torch.ones(3, dtype=torch.bfloat16)
        full = torch.empty(3 * world, dtype=torch.bfloat16)
        comm.all_gather_into_tensor(full, shard, async_op=True, name="embedding").wait()
        grads = torch.empty(3)
        comm.reduce_scatter_tensor(grads, torch.ones(3 * world), op="avg")
        assert comm.stats()["all_gather"] == {"calls": 1, "bytes": 3 * world * 2}
        assert comm.stats()["reduce_scatter"] == {"calls": 1, "bytes": 3 * world * 4}
    assert not dist.is_initialized(), "fake_world destroys its group on exit"


def test_fake_world_reduce_scatter_writes_this_ranks_slice():
    # torch's fake group leaves the output as it was: on a GPU, uninitialized memory with non-finite values, so every
    # engine step was skipped and a peak measured there missed the optimizer's states
    with fake_world(4, rank=1) as comm:
        out = torch.full((3,), float("nan"))
        comm.reduce_scatter_tensor(out, torch.arange(12.0), op="avg", async_op=True).wait()
        assert out.tolist() == [3.0, 4.0, 5.0]
    from zero_engine.comm import _backend
    assert _backend._reduce_scatter_single in (getattr(dist, "reduce_scatter_single", None),
                                               dist.reduce_scatter_tensor), "the real collective is put back"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run `make gpu-check` on a GPU)")
def test_fake_world_wait_orders_the_consumer_after_a_side_stream_collective():
    # NCCL's work.wait() makes the current stream wait for the collective, and the engine's consumers rely on that
    # (zero/streams.py). torch's fake work returns at once: on an H100, 1 fake world-8 step in 3 read an output before
    # the side stream had written it, and was skipped as non-finite. The side stream sleeps first, so an unordered
    # consumer reads the NaN the output was filled with.
    with fake_world(4, rank=1) as comm:
        side = torch.cuda.Stream()
        for kind, out, inp, expected in (
                ("all_gather", torch.full((12,), float("nan"), device="cuda"), torch.arange(3.0, device="cuda"),
                 [0.0, 1.0, 2.0] * 4),
                ("reduce_scatter", torch.full((3,), float("nan"), device="cuda"), torch.arange(12.0, device="cuda"),
                 [3.0, 4.0, 5.0])):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU time before the collective
                if kind == "all_gather":
                    pending = comm.all_gather_into_tensor(out, inp, async_op=True, name="w")
                else:
                    pending = comm.reduce_scatter_tensor(out, inp, op="avg", async_op=True)
            pending.wait()
            seen = out.clone()  # on the compute stream, ordered only by the wait
            assert seen.tolist() == expected, kind


def test_fake_world_destroys_its_group_even_on_error():
    with pytest.raises(KeyError):
        with fake_world(8):
            raise KeyError("inside")
    assert not dist.is_initialized()


def test_fake_world_refuses_when_a_real_group_exists():
    with tempfile.TemporaryDirectory() as directory:
        dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=0, world_size=1)
        try:
            with pytest.raises(RuntimeError, match="one is initialized .*backend gloo"):
                with fake_world(4):
                    pass
            assert dist.get_backend() == "gloo", "the real group is left alone"
        finally:
            dist.destroy_process_group()


def _leave_unmatched_async_collective() -> int:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1000), async_op=True)  # never issued by rank 1, never waited for
    return dist.get_rank()


def test_unmatched_leftover_collective_fails_its_own_call_not_the_next():
    run_ranks(_pid, 2, timeout=60)  # pool started outside the short timeout below
    with pytest.raises(RankError, match="barrier"):
        run_ranks(_leave_unmatched_async_collective, 2, timeout=3.0)
    assert run_ranks(_rank_and_sum, 2, 0, timeout=60)[1]["sum"] == 1.0
