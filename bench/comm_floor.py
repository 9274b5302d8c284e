"""What a step's collectives cost alone, ours against DDP's: the floor they put under the step-time ratio on CPU.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/comm_floor.py [--size demo] [--steps 20] [--replays 30]

Each rank builds bench/compare.py's model twice, as DDP and as our ZeRO-3 (bench/_worker.py's runners), and times
their steps, taking turns. It then replays each system's collectives of one steady step without the model, many
times: for ZeRO-3 the collectives its communicator issued in that step (same calls, sizes and paths, the
reduce-scatter's all-to-all and local sum included); for DDP one all-reduce per gradient bucket (the sizes DDP
reports after it rebuilt its buckets), each divided by the world size first, as DDP's default hook does. Each replay issues all of a step's
collectives, then waits for them.

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


def _timed_steps(runner, batches) -> tuple[float, float]:
    """Median wall and process-CPU seconds of ``runner``'s steps (a barrier before each, as compare.py times)."""
    walls, cpus = [], []
    for x, y in batches:
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        runner.step(x, y)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def _record_engine_collectives(engine, step) -> list:
    """The communicator calls one ``step()`` makes: (communicator, method, output, input, kwargs) with fresh
    buffers of the same shapes and dtypes, to be issued again."""
    from zero_engine.comm._communicator import Communicator

    calls = []
    originals = {name: getattr(Communicator, name) for name in ("all_gather_into_tensor", "reduce_scatter_tensor")}

    def recorder(name):
        def record(self, output, input, **kwargs):
            calls.append((self, name, torch.empty_like(output), torch.randn_like(input), kwargs))
            return originals[name](self, output, input, **kwargs)
        return record

    original_all_reduce = Communicator.all_reduce

    def record_all_reduce(self, tensor, op="sum", async_op=False, name=""):
        calls.append((self, "all_reduce", None, torch.zeros_like(tensor), {"op": op, "name": name}))
        return original_all_reduce(self, tensor, op=op, async_op=async_op, name=name)

    try:
        for name in originals:
            setattr(Communicator, name, recorder(name))
        Communicator.all_reduce = record_all_reduce
        step()
    finally:
        for name, fn in originals.items():
            setattr(Communicator, name, fn)
        Communicator.all_reduce = original_all_reduce
    return calls


def _replay_engine(calls) -> None:
    pending = []
    for comm, name, output, input, kwargs in calls:
        kwargs = dict(kwargs, async_op=True)
        if name == "all_reduce":
            pending.append(comm.all_reduce(input, **kwargs))
        else:  # an input all-reduced in place (input_is_scratch) keeps finite values: averaged again each time
            pending.append(getattr(comm, name)(output, input, **kwargs))
    for p in pending:
        p.wait()


def _replay_ddp(buckets: list[torch.Tensor], world: int) -> None:
    works = []
    for bucket in buckets:
        bucket.div_(world)  # DDP's default hook divides before it all-reduces
        works.append(dist.all_reduce(bucket, async_op=True))
    for work in works:
        work.wait()


def _time_replays(replay, n: int) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(n):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        replay()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def _fixed_cost_ms(comm, n: int) -> float:
    """Median process CPU of one all-gather of 1 KiB through ``comm``: what a collective costs whatever its size."""
    inp = torch.zeros(256)
    out = torch.empty(256 * comm.world_size)
    return _time_replays(lambda: comm.all_gather_into_tensor(out, inp, name="fixed cost probe"), n)[1] * 1e3


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
            steps[system].append(_timed_steps(runner, part))
    result = {}
    for system, halves in steps.items():
        result[f"{system}_step_ms"] = round(statistics.mean(w for w, _ in halves) * 1e3, 1)
        result[f"{system}_step_cpu_ms"] = round(statistics.mean(c for _, c in halves) * 1e3, 1)

    x, y = batches[-1]
    calls = _record_engine_collectives(runners["zero3"].engine, lambda: runners["zero3"].step(x, y))
    logged = runners["ddp"].wrapped._get_ddp_logging_data()  # after its first step DDP rebuilds its buckets
    bucket_bytes = [int(b) for b in logged.get("rebuilt_bucket_sizes", logged["bucket_sizes"]).split(",")]
    buckets = [torch.randn(nbytes // 4) for nbytes in bucket_bytes]  # fp32 gradients
    for system, replay in (("ddp", lambda: _replay_ddp(buckets, world)), ("zero3", lambda: _replay_engine(calls)),
                           ("ddp", lambda: _replay_ddp(buckets, world)), ("zero3", lambda: _replay_engine(calls))):
        wall, cpu = _time_replays(replay, args.replays // 2)
        result.setdefault(f"{system}_comm_ms", []).append(wall * 1e3)
        result.setdefault(f"{system}_comm_cpu_ms", []).append(cpu * 1e3)
    for key in [k for k in result if k.endswith(("comm_ms", "comm_cpu_ms"))]:
        result[key] = round(statistics.mean(result[key]), 1)
    result["zero3_collectives"] = len(calls)
    result["fixed_cpu_ms_per_collective"] = round(_fixed_cost_ms(runners["zero3"].engine.comm, args.replays), 3)
    result["ddp_collectives"] = len(buckets)
    cores = len(os.sched_getaffinity(0))
    for system in runners:
        result[f"{system}_busy"] = round(result[f"{system}_step_cpu_ms"] * world / (result[f"{system}_step_ms"] * cores), 2)
    extra = result["zero3_comm_cpu_ms"] - result["ddp_comm_cpu_ms"]
    result["comm_floor_ratio"] = round(1 + extra / result["ddp_step_cpu_ms"], 3)
    result["step_ratio"] = round(result["zero3_step_ms"] / result["ddp_step_ms"], 3)
    result["step_cpu_ratio"] = round(result["zero3_step_cpu_ms"] / result["ddp_step_cpu_ms"], 3)
    if rank == 0:
        print(json.dumps({"world": world, "size": args.size, "cores": cores, **result}))
    runners["zero3"].close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
