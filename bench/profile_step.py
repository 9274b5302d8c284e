"""Where a training step's time goes, per system, on bench/compare.py's models: cProfile over steady steps.

    python bench/profile_step.py --size demo --world 2 --systems ddp,fsdp2,zero3     # about a minute
    python bench/profile_step.py --size demo --world 2 --systems zero3 --top 30
    python bench/profile_step.py --size demo --world 2 --systems zero3 --clock thread   # CPU time, load-robust
    python bench/profile_step.py --size demo --world 2 --systems fsdp2,zero3 --ops       # tensor ops per step
    PYTHONPATH=<where deepspeed is> DS_ACCELERATOR=cpu python bench/profile_step.py --systems deepspeed,zero3

Each system runs in fresh processes (torchrun, gloo, ``OMP_NUM_THREADS=1``) with bench/compare.py's model, data,
optimizer and ZeRO knobs (bench/_worker.py builds them). After the warm-up steps, rank 0 profiles the timed steps
with cProfile (a barrier before each, as compare.py times them) and the driver prints, per system: the median step
time without the profiler, the profiled step time, and the profiled time per step split by where it is spent:

- ``wait in collectives``: the time inside c10d's ``wait`` (gloo runs collectives on its own threads: this is the
  rank waiting for its peer and for the transfer); ``issuing collectives``: the c10d calls that enqueue them;
- ``waiting on a lock``: thread hand-offs (zero_engine's watchdog waits on a completion event for gloo's
  reduce-scatters, so for zero_engine this is collective waiting too);
- ``torch ops``: the C++ operators called from Python (matmuls, copies, the optimizer's kernels, and autograd's
  ``run_backward``, which includes DDP's all-reduces: DDP issues them from C++ inside the backward);
- ``Python: <package>``: the Python frames' own time, by package (zero_engine's hooks, coordinator and reducer;
  torch.nn's module call machinery; torch.distributed's Python wrappers; autograd's engine entry). The GPT's own
  forward code lives in zero_engine/testing/models.py and is every system's: it has a row of its own, ``Python: the
  model``, outside zero_engine's (docs/benchmarks.md's figures before "Again, with the model's own Python taken out"
  include it in zero_engine's: about 1.1 ms of a demo step).

cProfile adds a cost per Python call, so the split overstates Python time; the profiled step time beside the plain
one says by how much. The row ``Python: zero_engine, profiler's cost removed`` estimates zero_engine's Python without
it: the profiler's cost per call event is measured on this machine and clock first (``_calibrate``, as the
``profile`` module's calibration does) and taken off for each call zero_engine's frames received and made. It is an
estimate, noisier than the raw row, and not part of the split (the raw row is). The row ``the runtime's Python``
sums every ``Python:`` row but the model's and torch.nn's, so that runtimes whose Python lives in different packages
compare (``_runtime_python``); it too has a row with the profiler's cost removed. ``--top N`` also prints the N
functions with the most own time. ``--ops`` runs one more steady step per system and counts the tensor ops it
dispatches (``OpCounter``: the ops Python and autograd call, views excluded; what a GPU would launch, roughly).
``PROFILE_STEP_DUMP=<file>`` in the environment also writes rank 0's raw cProfile stats there, for pstats' callers and
callees views (``pstats.Stats(file).print_callers("grads.py")``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import SIZES  # noqa: E402


def _where(func: tuple) -> str:
    """The bucket of one cProfile entry: (file, line, name)."""
    path, _, name = func
    if path == "~":  # a C function called from Python
        if "_distributed_c10d" in name or "_c10d_functional" in name:
            return "wait in collectives" if "wait" in name else "issuing collectives"
        if "_thread.lock" in name or "_thread.RLock" in name:
            return "waiting on a lock (thread hand-offs)"
        return "torch ops" if ("torch" in name or "Tensor" in name or "_C." in name or "_VariableFunctions" in name
                               or "_ops" in name) else "other C calls"
    if "/zero_engine/testing/" in path:  # the GPT every system trains: the model's Python, not the runtime's
        return "Python: the model (zero_engine.testing)"
    for package in ("zero_engine", "torch/nn", "torch/distributed/fsdp", "torch/distributed", "torch/autograd",
                    "torch/optim", "deepspeed", "torch/_tensor", "torch/utils/hooks"):
        if f"/{package}/" in path or path.endswith(f"/{package}.py"):
            return f"Python: {package.replace('/', '.')}"
    return "Python: other"


def _calibrate(clock: str, n: int = 20000) -> dict[str, float]:
    """cProfile's own cost per call event on this machine and clock, in seconds, by where it lands: in the own time
    of the function called (``callee_py`` for a Python function, ``callee_c`` for a C one) and in the own time of
    its caller (``caller_py`` / ``caller_c``). Measured as the ``profile`` module's calibration does: the same loop
    of n calls run plain and profiled (the medians of three)."""
    def py_noop():
        pass

    items = [0]

    def loop_py():
        for _ in range(n):
            py_noop()

    def loop_c():
        for _ in range(n):
            len(items)

    timer = time.thread_time if clock == "thread" else time.perf_counter
    found: dict[str, list[float]] = {k: [] for k in ("callee_py", "caller_py", "callee_c", "caller_c")}
    for _ in range(3):
        for kind, loop, callee in (("py", loop_py, "py_noop"), ("c", loop_c, "<built-in method builtins.len>")):
            start = timer()
            loop()
            plain = timer() - start
            profiler = cProfile.Profile(timer)
            profiler.enable()
            loop()
            profiler.disable()
            own = {name: tottime for (_, _, name), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items()}
            found[f"callee_{kind}"].append(own[callee] / n)  # a no-op's own time: all of it is the profiler's
            found[f"caller_{kind}"].append(max(0.0, own[loop.__name__] - plain) / n)
    return {k: statistics.median(v) for k, v in found.items()}


class OpCounter(TorchDispatchMode):
    """The aten ops a step dispatches, by name: those called from Python and by autograd's backward (a mode sees the
    top-level ops only, not what an op calls inside), views excluded (metadata, no kernel); collectives are counted
    by bench/_measure.py, not here."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.namespace == "aten":
            name = func.overloadpacket.__name__
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


RUNTIME_ROW = "the runtime's Python (every Python row but the model's and torch.nn's)"
MODEL_PYTHON = ("Python: the model (zero_engine.testing)", "Python: torch.nn")


def _runtime_python(bucket: str) -> bool:
    """A row of the system's own Python: every ``Python:`` row but the model's and torch.nn's (the module call
    machinery, which every system runs with or without hooks). Summed, it compares runtimes whose Python lives in
    different packages: FSDP2's in torch.distributed.fsdp, torch.distributed, autograd Functions, torch.optim and
    ``torch.compiler.disable``'s wrappers (``other``); DeepSpeed's in deepspeed; ours in zero_engine."""
    return bucket.startswith("Python: ") and bucket not in MODEL_PYTHON


def _without_profiler_cost(stats: dict, cost: dict[str, float], counted: Callable[[str], bool]) -> float:
    """The own time of the functions whose bucket (``_where``) ``counted`` accepts, less what cProfile itself spent
    there: each call of them costs ``callee_py``, and each call they made costs ``caller_py`` or ``caller_c`` (see
    ``_calibrate``).
    An estimate (the calibration's noop is not every function), but one that removes the cost that grows with the
    number of calls, which dominates the raw own time of short functions (a 0.7 us function reads as ~7 us)."""
    total = 0.0
    for func, (_, calls, tottime, _, _) in stats.items():
        if counted(_where(func)):
            total += tottime - calls * cost["callee_py"]
    for callee, (_, _, _, _, callers) in stats.items():
        per_call = cost["caller_c"] if callee[0] == "~" else cost["caller_py"]
        for caller, (_, calls, _, _) in callers.items():
            if counted(_where(caller)):
                total -= calls * per_call
    return total


def worker(system: str, size_name: str, steps: int, warmup: int, out: str, top: int, clock: str = "wall",
           ops: bool = False) -> None:
    import torch.distributed as dist

    from _worker import import_system, init_process_group, probe_runner

    import_system(system)
    rank, world = init_process_group(system)
    runner, batches = probe_runner(system, SIZES[size_name], warmup + 2 * steps + ops, rank, world)
    plain, profiled = [], []
    # "thread": the main thread's CPU time (time.thread_time), which other processes' load on a shared machine does
    # not inflate; waits then cost nothing, so the split shows the CPU each part spends, Python's above all.
    profiler = cProfile.Profile(time.thread_time) if clock == "thread" else cProfile.Profile()
    counter = OpCounter()
    for i, (x, y) in enumerate(batches):
        dist.barrier()
        if i == warmup + 2 * steps:  # --ops: one more steady step, its ops counted
            with counter:
                runner.step(x, y)
            continue
        on = i >= warmup + steps and rank == 0
        start = time.perf_counter()
        if on:
            profiler.enable()
        runner.step(x, y)
        if on:
            profiler.disable()
        took = time.perf_counter() - start
        if warmup <= i < warmup + steps:
            plain.append(took)
        elif on:
            profiled.append(took)
    if rank == 0:
        stats = pstats.Stats(profiler)
        if os.environ.get("PROFILE_STEP_DUMP"):  # the raw stats, for pstats' callers and callees views
            stats.dump_stats(os.environ["PROFILE_STEP_DUMP"])
        split: dict[str, float] = {}
        for func, (_, _, tottime, _, _) in stats.stats.items():
            split[_where(func)] = split.get(_where(func), 0.0) + tottime / steps
        cost = _calibrate(clock)
        runtime = sum(ms for bucket, ms in split.items() if _runtime_python(bucket))
        split["Python: zero_engine, profiler's cost removed"] = _without_profiler_cost(
            stats.stats, cost, lambda bucket: bucket == "Python: zero_engine") / steps
        split[RUNTIME_ROW] = runtime
        split[RUNTIME_ROW + ", profiler's cost removed"] = _without_profiler_cost(stats.stats, cost,
                                                                                  _runtime_python) / steps
        heavy = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
        with open(out, "w") as f:
            json.dump({"system": system, "plain": plain, "profiled": profiled, "split": split, "ops": counter.counts,
                       "top": [(f"{os.path.relpath(p) if p != '~' else ''}:{line}({name})", calls / steps,
                                tottime / steps) for (p, line, name), (_, calls, tottime, _, _) in heavy]}, f)
    runner.close()
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="demo", choices=sorted(SIZES))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--systems", default="ddp,fsdp2,zero3")
    parser.add_argument("--steps", type=int, default=10, help="steps timed plain, then as many profiled")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=0, help="also list the N functions with the most own time")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="what cProfile measures: wall time, or the main thread's CPU time (robust to other "
                             "processes' load; waits count zero)")
    parser.add_argument("--ops", action="store_true", help="also count the tensor ops of one steady step")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.size, args.steps, args.warmup, args.out, args.top, args.clock, args.ops)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = []
    for system in args.systems.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "profile.json")
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={args.world}", os.path.abspath(__file__), "--worker", system,
                            "--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup),
                            "--top", str(args.top), "--clock", args.clock, "--out", out] + ["--ops"] * args.ops,
                           env=env, check=True, timeout=1800, stdout=subprocess.DEVNULL)
            with open(out) as f:
                results.append(json.load(f))
    buckets = sorted({b for r in results for b in r["split"]}, key=lambda b: -max(r["split"].get(b, 0) for r in results))
    print(f"{args.size} model, world {args.world}, rank 0, {args.steps} steps each way; ms per step"
          f"{' (profiled rows: main-thread CPU time)' if args.clock == 'thread' else ''}\n")
    print("| | " + " | ".join(r["system"] for r in results) + " |")
    print("|---|" + "---|" * len(results))
    print("| step, plain (median) | " + " | ".join(f"{statistics.median(r['plain']) * 1e3:.1f}" for r in results) + " |")
    print("| step, under cProfile (median) | " + " | ".join(
        f"{statistics.median(r['profiled']) * 1e3:.1f}" for r in results) + " |")
    for b in buckets:
        print(f"| {b} | " + " | ".join(f"{r['split'].get(b, 0.0) * 1e3:.1f}" for r in results) + " |")
    if args.ops:
        print("| tensor ops, one steady step (views excluded) | " + " | ".join(
            str(sum(r["ops"].values())) for r in results) + " |")
        for r in results:
            common = sorted(r["ops"].items(), key=lambda kv: -kv[1])
            print(f"\n{r['system']}: ops per step: " + ", ".join(f"{name} {n}" for name, n in common))
    for r in results:
        if r["top"]:
            print(f"\n{r['system']}: functions with the most own time (calls per step, ms per step)")
            for name, calls, ms in r["top"]:
                print(f"  {ms * 1e3:7.2f} ms  {calls:7.0f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
