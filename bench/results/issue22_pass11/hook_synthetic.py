"""The record of a one-off measurement (2026-11-28): the first parts of GradReducer.add's common path (read
``param.grad``, set it to None, ``detach()``) in a post-accumulate-grad hook of a synthetic backward, one process,
52 parameters of 256 x 256 as GatheredZeroParameter, 50 steps after 10. Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1
python bench/results/issue22_pass11/hook_synthetic.py ("get2" is a second read of the same gradient,
whose Python object then exists; docs/benchmarks.md has the figures)."""
import time

import torch

from zero_engine.zero.partition import GatheredZeroParameter

ps = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(52)]
for p in ps:
    p.__class__ = GatheredZeroParameter
T = {"get": 0, "get2": 0, "set": 0, "detach": 0}
N = [0]


def hook(p):
    t0 = time.perf_counter_ns()
    g = p.grad
    t1 = time.perf_counter_ns()
    p.grad  # noqa: B018 (a second read: the object exists now)
    t2 = time.perf_counter_ns()
    p.grad = None
    t3 = time.perf_counter_ns()
    g.detach()
    t4 = time.perf_counter_ns()
    T["get"] += t1 - t0
    T["get2"] += t2 - t1
    T["set"] += t3 - t2
    T["detach"] += t4 - t3
    N[0] += 1


for p in ps:
    p.register_post_accumulate_grad_hook(hook)
x = torch.randn(64, 256)
for it in range(60):
    if it == 10:
        T = dict.fromkeys(T, 0)
        N[0] = 0
    y = x
    for p in ps:
        y = torch.tanh(y @ p)
    y.sum().backward()
print({k: round(v / N[0] / 1000, 2) for k, v in T.items()}, "us")
