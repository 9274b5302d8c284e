"""The record of a one-off measurement (2026-11-28, main at ed34c67), not a maintained tool: GradReducer.add's common
path timed inside the demo's backward at world 2 (bench/_worker.py's zero3 runner, 30 steps after 5), two ways.
"now": add as it was then (copied), with perf_counter_ns between its parts. "lazy": a hook that only counts, and the
unit's gradients read and cleared in one loop when its copy group is complete (only what the demo's path needs: no
irregular parameter, no second gradient, no single-parameter bucket; not a design). Run from the repository root:
PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2
bench/results/issue22_pass11/hook_lines.py now|lazy"""
import sys, time, collections
sys.path.insert(0, "bench")  # run from the repository root
import torch, torch.distributed as dist
from _common import SIZES, load_gpt_module
from _worker import build_runner, import_system, init_process_group
import_system("zero3")
import zero_engine.zero.grads as grads
T = collections.defaultdict(float); N = collections.defaultdict(int)
orig = grads.GradReducer.add
tt = time.perf_counter_ns  # (thread_time_ns costs 0.7 us a call here: a system call)
MODE = sys.argv[1] if len(sys.argv) > 1 else "now"
def add_now(self, p, grad):
    t0 = tt()
    if grad is p.param:
        if not self.backward_end.queued:
            self.backward_end.queue_if_needed()
        grad = grad.grad
        if grad is None:
            return
        t1 = tt(); T["get grad"] += t1 - t0
        p.param.grad = None
        t2 = tt(); T["set grad None"] += t2 - t1
    else:
        t2 = tt()
    n = grad.numel()
    key = id(p)
    bucket, group, i = self._copy_slot[key]
    t3 = tt(); T["checks+lookup"] += t3 - t2
    grad = grad.detach()
    t4 = tt(); T["detach"] += t4 - t3
    group.grads[i] = grad
    group.arrived += 1
    bucket.arrived += 1
    t5 = tt(); T["store"] += t5 - t4
    if group.arrived == len(group.params) and group.chunks:
        self._copy_group(group)
    t6 = tt(); T["copy_group"] += t6 - t5
    if bucket.arrived + bucket.irregular == len(bucket.params):
        self._launch_ready()
    t7 = tt(); T["launch"] += t7 - t6
    N["calls"] += 1
def add_lazy(self, p, grad):
    # the hook only counts; the unit's gradients are read when its copy group is complete, in one loop
    t0 = tt()
    if not self.backward_end.queued:
        self.backward_end.queue_if_needed()
    bucket, group, i = self._copy_slot[id(p)]
    group.arrived += 1
    t1 = tt(); T["hook: count"] += t1 - t0
    if group.arrived == len(group.params):
        taken = []
        for q in group.params:
            g = q.param.grad
            q.param.grad = None
            taken.append(g)
        group.grads = taken
        bucket.arrived += len(group.params)
        t2 = tt(); T["group: read and clear"] += t2 - t1
        if group.chunks:
            self._copy_group(group)
        if bucket.arrived + bucket.irregular == len(bucket.params):
            self._launch_ready()
    N["calls"] += 1
grads.GradReducer.add = add_lazy if MODE == "lazy" else add_now
rank, world = init_process_group("zero3")
gpt = load_gpt_module(); size = SIZES["demo"]; cfg = gpt.GPTConfig(**size.gpt)
torch.manual_seed(0); model = gpt.GPT(cfg)
micro = size.global_batch // world
batches = [(x[rank*micro:(rank+1)*micro], y[rank*micro:(rank+1)*micro]) for x, y in gpt.make_batches(cfg, 35, size.global_batch, seed=1)]
runner = build_runner("zero3", model, size, world)
for i, (x, y) in enumerate(batches):
    if i == 5: T.clear(); N.clear()
    dist.barrier(); loss = runner.step(x, y)
if rank == 0:
    print(MODE, {k: round(v / N["calls"] / 1000, 2) for k, v in T.items()}, "us per hook call;",
          round(sum(v for k, v in T.items() if k not in ("copy_group", "launch")) / 30 / 1e6, 3), "ms a step outside",
          "the copy-in and the launch; last loss", loss.item())
runner.close(); dist.destroy_process_group()
