"""How a gradient reduce-scatter should run on gloo: the measurement behind [Note: gloo's reduce-scatter as an
all-to-all] (zero_engine/comm/_backend.py).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/reduce_scatter_probe.py      # about 20 s; also try 4

For each bucket size (fp32 elements, the whole input of one reduce-scatter), the median time (15 repeats, a barrier
before each, the best of two series) of three ways to leave this rank's reduced slice in ``out``:

- ``reduce_scatter_tensor``: gloo's own (torch 2.13 runs it as an all-reduce of a copy of the input);
- ``all-reduce in place``: the input all-reduced where it is (a scratch gradient buffer), this rank's slice copied
  out (the engine's way before);
- ``all-to-all + sum``: every rank's chunk r sent to rank r, the received rows summed into ``out`` (the engine's way
  now): the reduce half of the all-reduce without its gather half, for one more buffer of the input's size.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

SIZES = [1 << 18, 1 << 20, 1 << 22]
REPEATS = 15


def _median_ms(fn, data: torch.Tensor) -> float:
    times = []
    for _ in range(REPEATS):
        scratch = data.clone()  # each way may consume its input
        dist.barrier()
        start = time.perf_counter()
        fn(scratch)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if rank == 0:
        print(f"world {world}, fp32, ms (median of {REPEATS})\n")
        print("| input (MiB) | reduce_scatter_tensor | all-reduce in place | all-to-all + sum | ÷ all-reduce |")
        print("|---:|---:|---:|---:|---:|")
    for numel in SIZES:
        data = torch.randn(numel)
        out = torch.empty(numel // world)

        def native(inp):
            dist.reduce_scatter_tensor(out, inp)

        def all_reduce(inp):
            dist.all_reduce(inp)
            out.copy_(inp.view(world, -1)[rank])

        def all_to_all(inp):
            received = torch.empty_like(inp)
            dist.all_to_all_single(received, inp)
            torch.sum(received.view(world, -1), 0, out=out)

        ms = {}
        for fn in (native, all_reduce, all_to_all):
            fn(data.clone())  # warm-up: the allocator and gloo's buffers
            ms[fn.__name__] = min(_median_ms(fn, data), _median_ms(fn, data))
        if rank == 0:
            print(f"| {numel * 4 / 2**20:g} | {ms['native']:.2f} | {ms['all_reduce']:.2f} | {ms['all_to_all']:.2f} "
                  f"| {ms['all_to_all'] / ms['all_reduce']:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
