"""Train a small GPT with zero_engine on CPU ranks (generated data, no downloads).

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --config examples/configs/zero3.json

Prints the loss curve, the median step time, and per-rank memory next to what the same model would need on one
rank without sharding (fp32 AdamW: 16 bytes per parameter for parameters, gradients and Adam's two moments).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing.loop import train_global_batch
from zero_engine.testing.models import GPT, GPTConfig, make_batches


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="examples/configs/zero3.json", help="a DeepSpeed-style JSON config")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--losses", default=None, help="rank 0 writes the per-step losses to this JSON file")
    parser.add_argument("--timeline", default=None,
                        help="record a memory timeline to TIMELINE.rankN.jsonl (draw it with `zero-engine plot`)")
    return parser.parse_args()


def progress(step: int, total: int, loss: float, seconds: float) -> None:
    """A redrawn bar on a terminal; one line every 10 steps when the output goes to a file or a pipe."""
    width = 30
    done = int(width * step / total)
    line = f"[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.3f}  {seconds:.2f}s/step"
    if sys.stdout.isatty():
        sys.stdout.write("\r" + line)
    elif step % 10 == 0 or step == total:
        sys.stdout.write(line + "\n")
    sys.stdout.flush()


def sparkline(values: list[float]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    return "".join(bars[int((v - lo) / (hi - lo + 1e-12) * (len(bars) - 1))] for v in values)


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


def main() -> None:
    args = parse_args()
    zero_engine.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(name)s: %(message)s")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    config = json.load(open(args.config))
    for section in ("offload_optimizer", "offload_param"):  # the example's NVMe directory (a real one: your drive)
        nvme_path = (config.get("zero_optimization", {}).get(section) or {}).get("nvme_path")
        if nvme_path:
            os.makedirs(nvme_path, exist_ok=True)
    if args.timeline:
        config.setdefault("zero_engine", {})["memory_timeline"] = {"enabled": True, "path": args.timeline}
    engine, optimizer, _, _ = zero_engine.initialize(model=model, config=config)
    micro = engine.config.train_micro_batch_size_per_gpu
    gas = engine.gradient_accumulation_steps()
    batches = make_batches(cfg, args.steps, micro * gas * world, seed=1)

    losses, times = [], []
    for step, (x, y) in enumerate(batches, start=1):
        start = time.perf_counter()
        loss = train_global_batch(engine, x, y, gas, micro)  # this rank's rows, gas micro-steps, one step
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if rank == 0:
            progress(step, args.steps, losses[-1], times[-1])
    if rank == 0 and sys.stdout.isatty():
        print()
    if rank == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f)

    stats = engine.memory_stats()
    states = engine.model_state_bytes(stats)
    all_stats = [None] * world
    if engine.stage in (1, 2):  # parameters are whole on every rank, besides the partitioned states
        states += stats["params_gathered"]
    dist.all_gather_object(all_stats, (states, stats["params_gathered_peak"], stats["rss_peak"]))
    if rank == 0:
        stage = engine.stage
        gather = getattr(getattr(engine.coordinator, "gatherer", None), "name", "-")
        print(f"\nzero_engine stage {stage} ({gather} gather) on {world} ranks, GPT with {n_params / 1e6:.2f}M params")
        print(f"loss   {losses[0]:.3f} -> {losses[-1]:.3f}   {sparkline(losses)}")
        warm = times[3:] or times
        print(f"step   median {statistics.median(warm) * 1e3:.1f} ms (after 3 warm-up steps)")
        print(f"unsharded model states (fp32 AdamW, 16 B/param, one rank): {mib(16 * n_params)}")
        for r, (s, gathered, rss_peak) in enumerate(all_stats):
            print(f"rank {r}: model states {mib(s)} ({s / (16 * n_params):.3f} of unsharded), "
                  f"gathered params peak {mib(gathered)}, peak RSS {mib(rss_peak)}")
        comm = engine.comm_stats()
        print("communication: " + ", ".join(f"{k} {v['calls']} calls {mib(v['bytes']).strip()}"
                                            for k, v in comm.items() if v["calls"]))
    # Every rank done, nothing in flight, watchdog stopped; only then the group goes (see engine.destroy()).
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
