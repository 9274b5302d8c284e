"""Where a rank's CPU goes per step: its main thread against its other threads (gloo's), by system.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/cpu_split.py --system zero3 [--size demo] [--steps 20] [--warmup 5] [--waits]

bench/compare.py's configurations (bench/_worker.py builds them). Around each step (a barrier before it), rank 0
reads its wall clock, its process's CPU time (``getrusage``: every thread, user and system), its main thread's CPU
time (``time.thread_time``) and its minor page faults, and prints the medians as one JSON line. When the ranks share
the cores, as on a 2-core machine at world 2, a step can only be as short as the CPU all of them spend in it: the
split says whether a system's extra time is its main thread's work (the engine's Python, its copies) or its
collectives' threads (gloo moves and reduces the bytes there). bench/engine_cpu.py then splits the main thread's
part by the engine's entry points. ``--waits`` (zero3 only) also times, in wall-clock time, each of the engine's
collective waits by its name (``Pending.wait``, with what runs when the work completes: gloo's reduce-scatter sums
its rows there): where the main thread waits for a collective instead of computing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402

from _common import SIZES  # noqa: E402
from _worker import import_system, init_process_group, probe_runner  # noqa: E402


class _WaitTimes:
    """Wall-clock time in the engine's collective waits, by the collective's kind and name."""

    def __init__(self):
        self.on = False
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def per_step(self, steps: int) -> dict[str, float]:
        ranked = sorted(self.seconds.items(), key=lambda item: -item[1])
        return {name: round(seconds / steps * 1e3, 2) for name, seconds in ranked}


def _time_waits() -> _WaitTimes:
    from zero_engine.comm._communicator import Pending

    times, wait = _WaitTimes(), Pending.wait

    def timed_wait(pending):
        start = time.perf_counter()
        try:
            return wait(pending)
        finally:
            if times.on:
                record = pending.record
                name = f"{record.kind}: {record.name}" if record is not None else "unrecorded"
                times.seconds[name] += time.perf_counter() - start

    Pending.wait = timed_wait
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--system", default="zero3", help="a bench/_worker.py system: ddp, zero3, fsdp2, ...")
    parser.add_argument("--size", default="demo", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--waits", action="store_true", help="time the engine's collective waits by name (zero3)")
    args = parser.parse_args()

    import_system(args.system)
    waits = _time_waits() if args.waits else None
    rank, world = init_process_group(args.system)
    runner, batches = probe_runner(args.system, SIZES[args.size], args.warmup + args.steps, rank, world)

    samples: dict[str, list[float]] = {"wall": [], "process": [], "main thread": [], "minor faults": []}
    for i, (x, y) in enumerate(batches):
        dist.barrier()
        if waits is not None:
            waits.on = i >= args.warmup
        before, main_before, start = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
        runner.step(x, y)
        wall, main_cpu = time.perf_counter() - start, time.thread_time() - main_before
        after = resource.getrusage(resource.RUSAGE_SELF)
        if i < args.warmup:
            continue
        samples["wall"].append(wall)
        samples["process"].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        samples["main thread"].append(main_cpu)
        samples["minor faults"].append(after.ru_minflt - before.ru_minflt)

    if rank == 0:
        medians = {k: statistics.median(v) for k, v in samples.items()}
        # the other threads' CPU, step by step (a median of differences, not a difference of medians)
        others = statistics.median(p - m for p, m in zip(samples["process"], samples["main thread"]))
        print(json.dumps({"system": args.system, "size": args.size, "world": world, "rank": rank,
                          "step_ms": round(medians["wall"] * 1e3, 1),
                          "process_cpu_ms": round(medians["process"] * 1e3, 1),
                          "main_thread_cpu_ms": round(medians["main thread"] * 1e3, 1),
                          "other_threads_cpu_ms": round(others * 1e3, 1),
                          "minor_faults": int(medians["minor faults"]),
                          **({"waits_ms": waits.per_step(args.steps)} if waits is not None else {})}))
    runner.close()  # before destroy_process_group(): see [Note: the group's last holder] in _worker.py
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
