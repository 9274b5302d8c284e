"""Where coalescing parameters into one all-gather stops paying: the measurement behind DIRECT_GATHER_NUMEL.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/gather_probe.py      # about 20 s; also try 4

For each parameter size, the median time (30 repeats, a barrier before each) to gather 4 parameters of that size
two ways, as zero_engine/zero/gather.py can:

- ``direct``: one all-gather per parameter, straight into its storage (no copy);
- ``coalesced``: one all-gather of the 4 shards, back to back, into a staging buffer, then each parameter's
  ``[world, shard]`` rows copied out into its storage.

Coalescing saves 3 collectives' fixed cost and pays a copy of the gathered bytes plus a staging buffer as large as
the 4 parameters; the size where the columns cross is where a parameter should be gathered on its own.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

SIZES = [1 << 15, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 21]
PARAMS = 4
REPEATS = 30


def _median_ms(fn) -> float:
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        print(f"| elements per parameter | direct ({PARAMS} collectives), ms | coalesced (1 + copy-out), ms |")
        print("|---:|---:|---:|")
    for numel in SIZES:
        shard = numel // world
        shards = [torch.randn(shard) for _ in range(PARAMS)]
        fulls = [torch.empty(numel) for _ in range(PARAMS)]
        run = torch.cat(shards)  # adjacent shards in a flat shard bucket: the input as it stands

        def direct():
            works = [dist.all_gather_into_tensor(f, s, async_op=True) for f, s in zip(fulls, shards)]
            for w in works:
                w.wait()

        def coalesced():
            staging = torch.empty(numel * PARAMS)
            dist.all_gather_into_tensor(staging, run, async_op=True).wait()
            rows = staging.view(world, -1)
            for i, f in enumerate(fulls):
                f.view(world, shard).copy_(rows[:, i * shard: (i + 1) * shard])

        for fn in (direct, coalesced):  # warm-up: the allocator and gloo's buffers
            fn()
        direct_ms = min(_median_ms(direct), _median_ms(direct))
        coalesced_ms = min(_median_ms(coalesced), _median_ms(coalesced))
        if dist.get_rank() == 0:
            print(f"| {numel:,} | {direct_ms:.2f} | {coalesced_ms:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
