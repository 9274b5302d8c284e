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

``--parts`` also wraps the parts inside the entry points (the gradient copy-in and the reduce-scatter launches of the
reducer, the optimizer's Adam kernel call, its per-parameter bookkeeping, the gradient norm; inside the module hooks,
the coordinator's fetch and release, the gathers' issue and wait, a unit's reshard; every collective's issue) and
gives every label its own time: a wrapped call inside another is taken out of the outer one, so "gradient hook" is
then the hook's own Python and what it calls unwrapped, "module hooks" the hooks' own (their arguments walked, the
autograd function and the gradient hook they install), and the labels still add up to the entry points' total.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402

from _common import SIZES  # noqa: E402
from _worker import import_system, init_process_group, probe_runner  # noqa: E402


# --parts: (module, class, method, label) of each part inside the entry points. The collectives' issue is also called
# by the reducer and the norm, and taken out of their labels too.
PARTS = [
    ("zero_engine.zero.grads", "GradReducer", "_copy_group", "gradient copy-in (_copy_group)"),
    ("zero_engine.zero.grads", "GradReducer", "_launch_ready", "reduce-scatter launches (_launch_ready)"),
    ("zero_engine.zero.optimizer", "ZeroOptimizer", "_global_grad_norm", "gradient norm"),
    ("zero_engine.zero.optimizer", "ZeroOptimizer", "_update_sub_group",
     "optimizer: shard views, masters' grads, refresh"),
    ("zero_engine.ops.adam_base", "OpAdamBase", "step", "optimizer: checks, states, step counts"),
    ("zero_engine.ops.cpu_adam", "CPUAdam", "_update_batch", "optimizer: the Adam kernel call"),
    # inside the module hooks
    ("zero_engine.comm._communicator", "Communicator", "_issue", "collectives: the issue (record, backend call)"),
    ("zero_engine.zero.gather", "CoalescedGather", "issue", "gather: the issue's Python (runs, staging)"),
    ("zero_engine.zero.gather", "GatherWork", "wait", "gather: the wait and copy-out"),
    ("zero_engine.zero.coordinator", "ParamCoordinator", "_prefetch_after", "coordinator: choosing the prefetch"),
    ("zero_engine.zero.unit", "ParamUnit", "reshard", "unit: reshard (the release rule, the release)"),
    ("zero_engine.zero.coordinator", "ParamCoordinator", "fetch", "coordinator: the rest of a fetch"),
    ("zero_engine.zero.coordinator", "ParamCoordinator", "release",
     "coordinator: the rest of a release (trace lookups)"),
]


def _timed(totals: dict[str, float], inner: list[float], cls, name: str, label: str, own: bool = False) -> None:
    """Wrap ``cls.name`` to add its thread CPU time to ``totals[label]``. ``inner``: one slot per wrapped call in
    progress, where a call adds its time to its caller's slot. A call inside another wrapped one counts in the outer
    one, unless ``own``: then each label gets its own time, less that of the wrapped calls it made."""
    original = cls.__dict__[name]

    def timed(*args, **kwargs):
        if inner and not own:  # inside another entry point: counted there
            return original(*args, **kwargs)
        inner.append(0.0)
        start = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            took = time.thread_time() - start
            totals[label] += took - inner.pop()
            if inner:
                inner[-1] += took
    setattr(cls, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="demo", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tree", help="a checkout whose zero_engine to time (default: this one)")
    parser.add_argument("--parts", action="store_true",
                        help="also time the parts inside the entry points, each label its own time")
    args = parser.parse_args()
    if args.tree:  # imported first, so that import_system finds it in sys.modules and does not load this repo's
        sys.path.insert(0, os.path.abspath(args.tree))
        import zero_engine  # noqa: F401
    import_system("zero3")
    import zero_engine.engine as engine_module
    import zero_engine.zero.grads as grads
    import zero_engine.zero.hooks as hooks

    totals: dict[str, float] = collections.defaultdict(float)
    inner: list[float] = []
    own = args.parts

    def timed(cls, name: str, label: str) -> None:
        _timed(totals, inner, cls, name, label, own)

    for name in ("_pre_forward", "_post_forward", "_pre_backward", "_post_backward", "_enter_model", "_leave_model"):
        timed(hooks.ModuleHooks, name, "module hooks")
    timed(hooks.BackwardEndCallback, "_run", "end of backward")
    if "on_grad_ready" in engine_module.ZeroEngine.__dict__:
        timed(engine_module.ZeroEngine, "on_grad_ready", "gradient hook")
    else:
        timed(grads.GradReducer, "add", "gradient hook")
    timed(engine_module.ZeroEngine, "step", "step()")
    if own:
        for module, cls, name, label in PARTS:
            timed(getattr(importlib.import_module(module), cls), name, label)

    rank, world = init_process_group("zero3")
    runner, batches = probe_runner("zero3", SIZES[args.size], args.warmup + args.steps, rank, world)
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
