"""Expert parallelism at world 4 (issue 25): the same MoE GPT under ZeRO-3 with experts split over ep 2 (edp 2), and
with every expert on every rank (ep 1: experts sharded over the whole world, as before), in one run.

    python bench/expert_parallel.py                    # world 4, 8 experts, 6 steps (first 2 not timed)
    python bench/expert_parallel.py --json out.json

Per rank and per steady step: model-state bytes from ``engine.memory_stats()`` (the gradient shards at their peak)
against the formula 16 Psi / N (fp32
AdamW: 4 param + 4 grad + 8 moments; Psi counts every expert once, N = 4), the peak of gathered parameters, the
engine's collective bytes per group (``comm_stats(by_group=True)``: all-gather = output bytes, reduce-scatter =
input bytes; the MoE layer's own all-to-alls are torch.distributed calls the engine does not count: their bytes are
estimated from the routed tokens), and the median step time (gloo, simulated ranks on this machine's CPUs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zero_engine  # noqa: E402
from zero_engine.moe import MoE, expert_parallel_groups  # noqa: E402
from zero_engine.testing import run_ranks  # noqa: E402
from zero_engine.testing.models import GPT, GPTConfig, make_batches  # noqa: E402

# the gradient shards exist inside an accumulation window only (freed by the step): their peak is counted
MODEL_STATES = ("params_sharded", "master_params", "grads_peak", "optimizer_states")


def _model(ep_size: int, experts: int):
    groups = expert_parallel_groups(ep_size)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=96, n_head=4, vocab_size=256, block_size=64)
    model = GPT(cfg)
    for block in model.blocks:
        block.mlp = MoE(cfg.n_embd, 384, experts, top_k=2, groups=groups)
    return model, cfg


def _rank_body(ep_size: int, experts: int, steps: int, warmup: int, micro: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, cfg = _model(ep_size, experts)
    total_numel = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    total_numel += sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * ep_size
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    times = []
    for i, (x, y) in enumerate(make_batches(cfg, steps, micro * world, seed=1)):
        if i == warmup:
            engine.reset_comm_stats()
        start = time.perf_counter()
        loss = engine(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    stats = engine.memory_stats()
    timed = steps - warmup
    comm = {group: {kind: round(v["bytes"] / timed) for kind, v in kinds.items() if v["calls"]}
            for group, kinds in engine.comm_stats(by_group=True).items()}
    routed_rows = micro * cfg.block_size * 2 * cfg.n_layer  # top-2 choices, each layer
    # each a row of n_embd floats, 4 all-to-alls (forward and backward, there and back); (ep-1)/ep leave the rank
    all_to_all = 0 if ep_size == 1 else round(routed_rows * cfg.n_embd * 4 * 4 * (ep_size - 1) / ep_size)
    result = {"model_states": sum(stats[k] for k in MODEL_STATES), "formula": 16 * total_numel / world,
              "params_gathered_peak": stats["params_gathered_peak"], "comm_per_step": comm,
              "all_to_all_per_step_estimate": all_to_all, "step_s_median": statistics.median(times),
              "params": total_numel}
    engine.destroy()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from zero_engine.ops import OpBuildError, load_op

    try:  # built once here, not by four ranks waiting on one build lock (as tests/conftest.py does)
        load_op("cpu_adam")
    except OpBuildError:
        pass
    report = {}
    for ep in (1, 2):
        ranks = run_ranks(_rank_body, args.world, ep, args.experts, args.steps, args.warmup, args.micro,
                          timeout=600)
        report[f"ep {ep}"] = ranks[0] | {"step_s_median_max_rank": max(r["step_s_median"] for r in ranks)}
    for name, r in report.items():
        print(f"{name}: model states {r['model_states'] / 2**20:.3f} MiB/rank (16 Psi / N = "
              f"{r['formula'] / 2**20:.3f} MiB, Psi = {r['params']}), gathered peak "
              f"{r['params_gathered_peak'] / 2**20:.3f} MiB, step {r['step_s_median_max_rank'] * 1e3:.1f} ms "
              f"(median, slowest rank), per step: {json.dumps(r['comm_per_step'])}, all-to-all ~"
              f"{r['all_to_all_per_step_estimate']} B")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
