"""What a step's collectives cost alone, ours against DDP's: the floor they put under the step-time ratio on CPU.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/comm_floor.py [--size demo] [--steps 20] [--replays 30]

Each rank builds bench/compare.py's model twice, as DDP and as our ZeRO-3 (bench/_worker.py's runners), and times
their steps, taking turns. It then replays each system's collectives of one steady step without the model, many
times: for ZeRO-3 the collectives its communicator issued in that step (same calls, sizes and paths, the
reduce-scatter's all-to-all and local sum included); for DDP one all-reduce per gradient bucket (the sizes DDP
reports after it rebuilt its buckets), each divided by the world size first, as DDP's default hook does. Each
replay issues all of a step's collectives, then waits for them.

Rank 0 prints one JSON line: per system, the step's wall time and the CPU time of the whole process (every thread:
gloo's threads move the bytes), medians, and the replay's wall and process CPU per step. ``busy``: the share of the
machine's cores the ranks kept busy during a step (CPU of all ranks ÷ (wall × cores)), rank 0's figures for every
rank. When the ranks keep the cores busy (``busy`` near 1: the ranks share the cores they compute on, as on this
2-core machine), step time follows CPU time, and a collective's CPU is taken from the compute however well it
overlaps. Then the extra CPU of ZeRO-3's collectives over DDP's, as a fraction of DDP's step CPU, is about the
least by which ZeRO-3's step can exceed DDP's (``comm_floor_ratio``). Copies around the collectives (DDP's bucket
copies, our gather's copy-out and gradient copy-in) are not in the replay. ``fixed_cpu_ms_per_collective``: the
process CPU of an all-gather of 1 KiB, the part of every collective's cost that does not depend on its size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import SIZES, load_gpt_module  # noqa: E402
from _worker import build_runner, import_system  # noqa: E402


def _medians(calls) -> tuple[float, float]:
    """Median wall and process-CPU seconds of each of ``calls`` (zero-argument callables), a barrier before each, as
    compare.py times steps."""
    walls, cpus = [], []
    for call in calls:
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        call()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


_RECORDED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def _record_engine_collectives(step) -> list:
    """The communicator calls one ``step()`` makes, each as (communicator, method, tensors, options), the tensors
    fresh ones of the same shapes and dtypes, to be issued again. The engine passes tensors by position and options
    by keyword."""
    from zero_engine.comm._communicator import Communicator

    calls = []
    originals = {name: getattr(Communicator, name) for name in _RECORDED}

    def recorder(name):
        def record(self, *tensors, **options):
            fresh = [torch.randn_like(t) if t.is_floating_point() else torch.zeros_like(t) for t in tensors]
            calls.append((self, name, fresh, options))
            return originals[name](self, *tensors, **options)
        return record

    try:
        for name in originals:
            setattr(Communicator, name, recorder(name))
        step()
    finally:
        for name, fn in originals.items():
            setattr(Communicator, name, fn)
    return calls


def _replay_engine(calls) -> None:
    # an input all-reduced in place (input_is_scratch) keeps finite values: it is averaged again each time
    pending = [getattr(comm, name)(*tensors, **dict(options, async_op=True)) for comm, name, tensors, options in calls]
    for p in pending:
        p.wait()


def _replay_ddp(buckets: list[torch.Tensor], world: int) -> None:
    works = []
    for bucket in buckets:
        bucket.div_(world)  # DDP's default hook divides before it all-reduces
        works.append(dist.all_reduce(bucket, async_op=True))
    for work in works:
        work.wait()


def _fixed_cost_ms(comm, n: int) -> float:
    """Median process CPU of one all-gather of 1 KiB through ``comm``: what a collective costs whatever its size."""
    inp = torch.zeros(256)
    out = torch.empty(256 * comm.world_size)
    return _medians([lambda: comm.all_gather_into_tensor(out, inp, name="fixed cost probe")] * n)[1] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="demo", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--replays", type=int, default=30)
    args = parser.parse_args()
    import_system("ddp")
    import_system("zero3")
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gpt = load_gpt_module()
    size = SIZES[args.size]
    cfg = gpt.GPTConfig(**size.gpt)
    micro = size.global_batch // world
    batches = [(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
               for x, y in gpt.make_batches(cfg, args.warmup + args.steps + 1, size.global_batch, seed=1)]
    runners = {}
    for system in ("ddp", "zero3"):
        torch.manual_seed(0)
        runners[system] = build_runner(system, gpt.GPT(cfg), size, world)
        for x, y in batches[:args.warmup]:
            runners[system].step(x, y)
    timed = batches[args.warmup:args.warmup + args.steps]
    half = len(timed) // 2  # the systems take turns: two halves each
    steps = {system: [] for system in runners}
    for part in (timed[:half], timed[half:]):
        for system, runner in runners.items():
            steps[system].append(_medians([lambda x=x, y=y, step=runner.step: step(x, y) for x, y in part]))
    result = {}
    for system, halves in steps.items():
        result[f"{system}_step_ms"] = round(statistics.mean(w for w, _ in halves) * 1e3, 1)
        result[f"{system}_step_cpu_ms"] = round(statistics.mean(c for _, c in halves) * 1e3, 1)

    x, y = batches[-1]
    calls = _record_engine_collectives(lambda: runners["zero3"].step(x, y))
    logged = runners["ddp"].wrapped._get_ddp_logging_data()  # after its first step DDP rebuilds its buckets
    bucket_bytes = [int(b) for b in logged.get("rebuilt_bucket_sizes", logged["bucket_sizes"]).split(",")]
    buckets = [torch.randn(nbytes // 4) for nbytes in bucket_bytes]  # fp32 gradients
    for system, replay in (("ddp", lambda: _replay_ddp(buckets, world)), ("zero3", lambda: _replay_engine(calls)),
                           ("ddp", lambda: _replay_ddp(buckets, world)), ("zero3", lambda: _replay_engine(calls))):
        wall, cpu = _medians([replay] * (args.replays // 2))
        result.setdefault(f"{system}_comm_ms", []).append(wall * 1e3)
        result.setdefault(f"{system}_comm_cpu_ms", []).append(cpu * 1e3)
    for key in [k for k in result if k.endswith(("comm_ms", "comm_cpu_ms"))]:
        result[key] = round(statistics.mean(result[key]), 1)
    result["zero3_collectives"] = len(calls)
    result["fixed_cpu_ms_per_collective"] = round(_fixed_cost_ms(runners["zero3"].engine.comm, args.replays), 3)
    result["ddp_collectives"] = len(buckets)
    cores = len(os.sched_getaffinity(0))
    for system in runners:
        cpu, wall = result[f"{system}_step_cpu_ms"], result[f"{system}_step_ms"]
        result[f"{system}_busy"] = round(cpu * world / (wall * cores), 2)
    extra = result["zero3_comm_cpu_ms"] - result["ddp_comm_cpu_ms"]
    result["comm_floor_ratio"] = round(1 + extra / result["ddp_step_cpu_ms"], 3)
    result["step_ratio"] = round(result["zero3_step_ms"] / result["ddp_step_ms"], 3)
    result["step_cpu_ratio"] = round(result["zero3_step_cpu_ms"] / result["ddp_step_cpu_ms"], 3)
    if rank == 0:
        print(json.dumps({"world": world, "size": args.size, "cores": cores, **result}))
    for runner in runners.values():  # DDP's too: see [Note: the group's last holder] in _worker.py
        runner.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
