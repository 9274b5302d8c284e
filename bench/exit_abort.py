"""How often a gloo rank aborts at interpreter exit, by how the script ends (README, "End the script").

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/exit_abort.py [--runs 16] [--parallel 5] [--modes ...]

Runs a small two-rank torchrun job ``--runs`` times per ending, ``--parallel`` jobs at once (the abort is a race at
exit, and load widens it), and counts the jobs whose output has "terminate called without an active exception".
The endings: ``plain-none`` (plain torch: 50 all-reduces, nothing destroyed), ``plain-destroy`` (the same, then
``destroy_process_group()``), ``zero-none`` (five ZeRO-3 steps of a 4-layer MLP, nothing destroyed, as a Trainer
script ends), ``zero-pg`` (then ``destroy_process_group()`` only), ``zero-both`` (``engine.destroy()``, then
``destroy_process_group()``). Prints one JSON line: per ending, jobs, aborted, other failures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys

MODES = ("plain-none", "plain-destroy", "zero-none", "zero-pg", "zero-both")
ABORT = "terminate called without an active exception"


def rank(mode: str) -> None:
    """One rank of one job."""
    import torch
    import torch.distributed as dist

    if mode.startswith("zero"):
        import zero_engine  # before init_process_group, as README asks
    dist.init_process_group("gloo")
    if mode.startswith("plain"):
        for _ in range(50):
            t = torch.ones(1000) * dist.get_rank()
            dist.all_reduce(t)
            del t
    else:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        engine, *_ = zero_engine.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
        for _ in range(5):
            engine.backward(engine(torch.randn(2, 64)).pow(2).mean())
            engine.step()
        if mode == "zero-both":
            engine.destroy()
    if mode in ("plain-destroy", "zero-pg", "zero-both"):
        dist.destroy_process_group()


def job(mode: str) -> str:
    """One two-rank job: "ok", "aborted" or "failed"."""
    env = dict(os.environ, EXIT_ABORT_MODE=mode, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return "ok"
    return "aborted" if ABORT in done.stdout + done.stderr else "failed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=16, help="jobs per ending")
    parser.add_argument("--parallel", type=int, default=5, help="jobs at once")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    jobs = [mode for _ in range(args.runs) for mode in modes]  # interleaved: every ending sees the same load
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        outcomes = list(pool.map(job, jobs))
    counts = {mode: {"jobs": 0, "aborted": 0, "failed": 0} for mode in modes}
    for mode, outcome in zip(jobs, outcomes):
        counts[mode]["jobs"] += 1
        if outcome != "ok":
            counts[mode][outcome] += 1
    print(json.dumps(counts))


if __name__ == "__main__":
    if "EXIT_ABORT_MODE" in os.environ:
        rank(os.environ["EXIT_ABORT_MODE"])
    else:
        main()
