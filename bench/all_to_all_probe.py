"""gloo: a step's all-gathers, and its reduce-scatters at world 2, as all-to-alls. The measurement behind [Note:
gloo's all-gather as an all-to-all] and [Note: gloo's reduce-scatter at world 2] (zero_engine/comm/_backend.py).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/all_to_all_probe.py      # about 40 s; also try 4

For each size (fp32 elements: the gathered output, or the reduce-scatter's whole input), per call, medians of five
series of 40 calls, alternated: rank 0's wall time, its main thread's CPU, and the CPU of its other threads (gloo's).

All-gather, rank r's shard into row r of the output:
- ``gloo``: ``all_gather_into_tensor``, gloo's own (it gathers into a buffer of its own, then copies that out);
- ``all-to-all`` (the engine's way on gloo): at world 2 each rank sends its shard to the peer only (split sizes
  [0, n] / [n, 0]) straight into the peer's row, and copies its own shard into its own row meanwhile; above world 2
  every rank's chunk of the input is the shard, repeated.

Reduce-scatter (sum), rank r keeping the reduced chunk r, world 2 only (above it the engine's way is unchanged):
- ``all-to-all + sum``: the whole input all-to-all'd and the two received rows summed (the engine's way before);
- ``all-to-all + add``: only the peer's chunk sent and received, added to this rank's own (the engine's way now).
Peer gather (``--peers``), the other ranks' shards into the world - 1 rows of the output, this rank's row left out
(zero_engine's gather since [Note: a gather that leaves this rank's row out]; [Note: gloo's gathers as sends and
receives] in zero_engine/comm/_backend.py):
- ``all-to-all``: nothing sent to this rank itself; above world 2 the input is the shard repeated once a peer;
- ``sends and receives``: a receive of each peer's shard into its row and a send of the shard to each peer.
Large all-gather (``--large``, 2-8M elements: beyond ``ALL_TO_ALL_GATHER_MAX_BYTES`` above world 2, where the engine
ran gloo's own before the sends and receives took over every gather from 1 MiB up):
- ``gloo``: ``all_gather_into_tensor``, gloo's own;
- ``sends and receives``: the peer gather's, into the other ranks' rows (a unit's copy-out reads this rank's rows
  from its own shards; that copy, the same bytes either way, is not timed).
Each result is checked against gloo's own collective before it is timed.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 bench/all_to_all_probe.py --peers
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 bench/all_to_all_probe.py --large      # also try 3
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

# gloo's own, under torch 2.13's names (the old ones warn)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
GATHER_SIZES = [150_000, 800_000, 1_600_000]  # the demo's blocks gather 789k elements
LARGE_GATHER_SIZES = [2_000_000, 4_000_000, 8_000_000]  # 8-32 MB: the 100m model's blocks gather 7.1M
REDUCE_SIZES = [250_000, 500_000, 1_000_000]  # the demo's gradient buckets hold up to 500k
SERIES, CALLS = 5, 40


def _per_call(fn) -> tuple[float, float, float]:
    """(wall, main thread CPU, other threads' CPU) per call, ms."""
    dist.barrier()
    process, thread, wall = time.process_time(), time.thread_time(), time.perf_counter()
    for _ in range(CALLS):
        fn()
    wall, thread, process = time.perf_counter() - wall, time.thread_time() - thread, time.process_time() - process
    return wall / CALLS * 1e3, thread / CALLS * 1e3, (process - thread) / CALLS * 1e3


def _compare(ways: dict) -> dict:
    """Medians over the series, the ways alternated within each."""
    runs: dict = {name: [] for name in ways}
    for _ in range(SERIES):
        for name, fn in ways.items():
            runs[name].append(_per_call(fn))
    return {name: [statistics.median(r[i] for r in rows) for i in range(3)] for name, rows in runs.items()}


def _gather_ways(numel: int, rank: int, world: int) -> dict:
    shard = torch.randn(numel // world)
    out = torch.empty(numel)
    rows = out.view(world, -1)
    sizes = [0, numel // 2] if rank == 0 else [numel // 2, 0]

    def gloo():
        all_gather_single(out, shard)

    def all_to_all():
        if world == 2:
            work = dist.all_to_all_single(rows[1 - rank], shard, sizes, sizes, async_op=True)
            rows[rank].copy_(shard)
            work.wait()
        else:
            dist.all_to_all_single(out, shard.repeat(world))

    expected = torch.empty(numel)
    all_gather_single(expected, shard)
    all_to_all()
    assert torch.equal(out, expected), "the all-to-all gathered something else"
    return {"gloo": gloo, "all-to-all": all_to_all}


def _sends_and_receives(rows: torch.Tensor, shard: torch.Tensor, rank: int, world: int):
    """A peer gather as the engine runs it above world 2: each peer's shard received into its row of ``rows`` (the
    other ranks', in rank order), ``shard`` sent to each peer."""
    peers = [peer for peer in range(world) if peer != rank]

    def sends_and_receives():
        works = [dist.irecv(rows[i], src=peer) for i, peer in enumerate(peers)]
        works += [dist.isend(shard, dst=(rank + step) % world) for step in range(1, world)]
        for work in works:
            work.wait()

    return sends_and_receives


def _peer_gather_ways(numel: int, rank: int, world: int) -> dict:
    n = numel // world
    shard = torch.randn(n)
    out = torch.empty((world - 1) * n)
    rows = out.view(world - 1, -1)
    sizes = [n] * world
    sizes[rank] = 0

    def all_to_all():
        dist.all_to_all_single(out, shard if world == 2 else shard.repeat(world - 1), sizes, sizes)

    sends_and_receives = _sends_and_receives(rows, shard, rank, world)

    full = torch.empty(n * world)
    all_gather_single(full, shard)
    expected = torch.cat([row for r, row in enumerate(full.view(world, -1)) if r != rank])
    for fn in (all_to_all, sends_and_receives):
        out.fill_(float("nan"))
        fn()
        assert torch.equal(out, expected), f"{fn.__name__} gathered something else"
    return {"all-to-all": all_to_all, "sends and receives": sends_and_receives}


def _large_gather_ways(numel: int, rank: int, world: int) -> dict:
    """Above ``ALL_TO_ALL_GATHER_MAX_BYTES``: gloo's all-gather of the whole output against the sends and receives
    of a peer gather into a buffer of the other ranks' rows. A unit's gather copies out of either into its
    parameters (from its own shards for this rank's rows, [Note: a gather that leaves this rank's row out]), the
    same bytes both ways, so neither is timed with that copy."""
    n = numel // world
    shard = torch.randn(n)
    out = torch.empty(numel)
    peers_out = torch.empty((world - 1) * n)
    rows = peers_out.view(world - 1, -1)

    def gloo():
        all_gather_single(out, shard)

    sends_and_receives = _sends_and_receives(rows, shard, rank, world)

    all_gather_single(out, shard)
    peers_out.fill_(float("nan"))
    sends_and_receives()
    expected = torch.cat([row for r, row in enumerate(out.view(world, -1)) if r != rank])
    assert torch.equal(peers_out, expected), "the sends and receives gathered something else"
    return {"gloo": gloo, "sends and receives": sends_and_receives}


def _reduce_ways(numel: int, rank: int, world: int) -> dict:
    data = torch.randn(numel)
    n = numel // 2
    out = torch.empty(n)
    sizes = [0, n] if rank == 0 else [n, 0]

    def all_to_all_sum():
        received = torch.empty_like(data)
        dist.all_to_all_single(received, data)
        torch.sum(received.view(2, -1), 0, out=out)

    def all_to_all_add():
        received = torch.empty(n)
        dist.all_to_all_single(received, data[n:] if rank == 0 else data[:n], sizes, sizes)
        torch.add(*((data[:n], received) if rank == 0 else (received, data[n:])), out=out)

    expected = torch.empty(n)
    reduce_scatter_single(expected, data.clone())
    for fn in (all_to_all_sum, all_to_all_add):
        fn()
        assert torch.equal(out, expected), f"{fn.__name__} reduced to something else"
    return {"all-to-all + sum": all_to_all_sum, "all-to-all + add": all_to_all_add}


def _table(title: str, sizes: list[int], ways_for, rank: int, world: int) -> None:
    if rank == 0:
        print(f"\n{title}, world {world}: ms per call, rank 0 (wall / main thread CPU / other threads' CPU)\n")
    for numel in sizes:
        result = _compare(ways_for(numel, rank, world))
        if rank == 0:
            (before, b), (after, a) = result.items()
            print(f"| {numel:,} | {before}: {b[0]:.2f} / {b[1]:.2f} / {b[2]:.2f} | {after}: {a[0]:.2f} / {a[1]:.2f} / "
                  f"{a[2]:.2f} | wall {a[0] / b[0]:.2f} x, CPU {(a[1] + a[2]) / (b[1] + b[2]):.2f} x |")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if "--large" in sys.argv:
        _table("large all-gather", [n - n % world for n in LARGE_GATHER_SIZES], _large_gather_ways, rank, world)
        dist.destroy_process_group()
        return
    if "--peers" in sys.argv:
        _table("peer gather", [n - n % world for n in GATHER_SIZES], _peer_gather_ways, rank, world)
        dist.destroy_process_group()
        return
    _table("all-gather", [n - n % world for n in GATHER_SIZES], _gather_ways, rank, world)
    if world == 2:
        _table("reduce-scatter", REDUCE_SIZES, _reduce_ways, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
