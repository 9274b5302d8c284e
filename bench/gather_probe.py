"""Where coalescing parameters into one all-gather stops paying: the measurement behind DIRECT_GATHER_NUMEL.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/gather_probe.py      # about 30 s; also try 4
    torchrun --nproc_per_node 1 bench/gather_probe.py --backend nccl         # on a GPU (world 1: NCCL's launches)

For each parameter size, the median time (30 repeats, a barrier before each) to gather 4 parameters of that size
three ways, as zero_engine/zero/gather.py can:

- ``direct``: one all-gather per parameter, straight into its storage (no copy);
- ``grouped``: the same 4 all-gathers issued as one group (torch's coalescing manager: one launch on NCCL), what
  the engine does for large parameters on NCCL ([Note: large parameters gathered as one group]);
- ``coalesced``: one all-gather of the 4 shards, back to back, into a staging buffer, then each parameter's
  ``[world, shard]`` rows copied out into its storage.

Coalescing saves 3 collectives' fixed cost and pays a copy of the gathered bytes plus a staging buffer as large as
the 4 parameters; the size where the columns cross is where a parameter should be gathered on its own.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

SIZES = [1 << 15, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 21]
PARAMS = 4
REPEATS = 30


def _median_ms(fn, sync) -> float:
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args(argv)
    dist.init_process_group(args.backend)
    world = dist.get_world_size()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    sync = lambda: None  # noqa: E731
    if args.backend == "nccl":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
        sync = torch.cuda.synchronize
    if dist.get_rank() == 0:
        print(f"{args.backend}, world {world}, {device.type}")
        print(f"| elements per parameter | direct ({PARAMS} collectives), ms | grouped ({PARAMS} as one group), ms "
              "| coalesced (1 + copy-out), ms |")
        print("|---:|---:|---:|---:|")
    for numel in SIZES:
        shard = numel // world
        shards = [torch.randn(shard, device=device) for _ in range(PARAMS)]
        fulls = [torch.empty(numel, device=device) for _ in range(PARAMS)]
        run = torch.cat(shards)  # adjacent shards in a flat shard bucket: the input as it stands

        def direct():
            works = [dist.all_gather_into_tensor(f, s, async_op=True) for f, s in zip(fulls, shards)]
            for w in works:
                w.wait()

        def grouped():
            with dist.distributed_c10d._coalescing_manager(async_ops=True) as group:
                for f, s in zip(fulls, shards):
                    dist.all_gather_into_tensor(f, s)
            group.wait()

        def coalesced():
            staging = torch.empty(numel * PARAMS, device=device)
            dist.all_gather_into_tensor(staging, run, async_op=True).wait()
            rows = staging.view(world, -1)
            for i, f in enumerate(fulls):
                f.view(world, shard).copy_(rows[:, i * shard: (i + 1) * shard])

        for fn in (direct, grouped, coalesced):  # warm-up: the allocator and the backend's buffers
            fn()
        ms = [min(_median_ms(fn, sync), _median_ms(fn, sync)) for fn in (direct, grouped, coalesced)]
        if dist.get_rank() == 0:
            print(f"| {numel:,} | " + " | ".join(f"{t:.2f}" for t in ms) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
