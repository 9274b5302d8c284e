"""The main thread's CPU time per step inside zero_engine's entry points, without a profiler.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \
        bench/engine_cpu.py [--size demo] [--steps 30] [--warmup 5]

bench/compare.py's zero3 configuration (bench/_worker.py builds it). The module hooks, the gradient hook, the
end-of-backward callback and ``step()`` are each wrapped in ``time.thread_time()`` (a call inside another wrapped one
is counted once, in the outer one), so the figure is what the engine spends on the CPU, including the torch work it
issues (staging copies, the gradient copy-in, the optimizer's kernel), and not the model's own compute. cProfile
(bench/profile_step.py) says where the time goes but adds its own cost to every call; this does not. Rank 0 prints
one JSON line, ms per step, with the path of the ``zero_engine`` that ran. ``--tree PATH`` times another checkout's
``zero_engine`` with this script, to compare trees (a tree from before the gradient hook became ``GradReducer.add``
wraps ``ZeroEngine.on_grad_ready`` instead). PYTHONPATH cannot do it: the bench workers put this repository first
on ``sys.path``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import SIZES, load_gpt_module  # noqa: E402
from _worker import build_runner, import_system, init_process_group  # noqa: E402


def _timed(totals: dict[str, float], depth: list[int], cls, name: str, label: str) -> None:
    original = cls.__dict__[name]

    def timed(*args, **kwargs):
        if depth[0]:  # inside another entry point: counted there
            return original(*args, **kwargs)
        depth[0] += 1
        start = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] += time.thread_time() - start
            depth[0] -= 1
    setattr(cls, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="demo", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tree", help="a checkout whose zero_engine to time (default: this one)")
    args = parser.parse_args()
    if args.tree:  # imported first, so that import_system finds it in sys.modules and does not load this repo's
        sys.path.insert(0, os.path.abspath(args.tree))
        import zero_engine  # noqa: F401
    import_system("zero3")
    import zero_engine.engine as engine_module
    import zero_engine.zero.grads as grads
    import zero_engine.zero.hooks as hooks

    totals: dict[str, float] = collections.defaultdict(float)
    depth = [0]
    for name in ("_pre_forward", "_post_forward", "_pre_backward", "_post_backward", "_enter_model", "_leave_model"):
        _timed(totals, depth, hooks.ModuleHooks, name, "module hooks")
    _timed(totals, depth, hooks.BackwardEndCallback, "_run", "end of backward")
    if "on_grad_ready" in engine_module.ZeroEngine.__dict__:
        _timed(totals, depth, engine_module.ZeroEngine, "on_grad_ready", "gradient hook")
    else:
        _timed(totals, depth, grads.GradReducer, "add", "gradient hook")
    _timed(totals, depth, engine_module.ZeroEngine, "step", "step()")

    rank, world = init_process_group("zero3")
    gpt = load_gpt_module()
    size = SIZES[args.size]
    cfg = gpt.GPTConfig(**size.gpt)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    micro = size.global_batch // world
    batches = [(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
               for x, y in gpt.make_batches(cfg, args.warmup + args.steps, size.global_batch, seed=1)]
    runner = build_runner("zero3", model, size, world)
    whole = []
    for i, (x, y) in enumerate(batches):
        if i == args.warmup:
            totals.clear()
        dist.barrier()
        start = time.thread_time()
        runner.step(x, y)
        if i >= args.warmup:
            whole.append(time.thread_time() - start)
    if rank == 0:
        result = {label: seconds / args.steps * 1e3 for label, seconds in totals.items()}
        result["all entry points"] = sum(totals.values()) / args.steps * 1e3
        result["main thread, whole step (median)"] = sorted(whole)[len(whole) // 2] * 1e3
        result = {k: round(v, 2) for k, v in result.items()}
        print(json.dumps({**result, "zero_engine": os.path.dirname(sys.modules["zero_engine"].__file__)}))
    runner.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
