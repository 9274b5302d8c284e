"""Per-rank model-state bytes against the ZeRO formula 16Ψ/N, for fp32, bf16 and fp16 at several world sizes.

    python bench/model_states.py                  # demo GPT, worlds 2 and 4, fp32/bf16/fp16
    python bench/model_states.py --worlds 2 --precisions bf16

Each (world, precision) runs in fresh processes via torch.distributed.run: ZeRO-3 training steps of the demo GPT
with AdamW until two optimizer steps were taken (fp16 skips steps while its loss scale settles), then
engine.memory_stats(). Model states = params_sharded + master_params + grads +
optimizer_states (exact bytes from the engine's accounting). Ψ counts every parameter once (tied weights once);
N is the world size. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(precision: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import zero_engine
    from zero_engine.testing.models import GPT, GPTConfig, make_batches

    zero_engine.init_distributed()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=8, n_embd=256)
    model = GPT(cfg)
    psi = sum(p.numel() for p in model.parameters())
    config = json.load(open(os.path.join(ROOT, "examples", "configs", "zero3.json")))
    config.pop("scheduler", None)
    config["train_micro_batch_size_per_gpu"] = 2
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    world = dist.get_world_size()
    for x, y in make_batches(cfg, 20, 2 * world):  # fp16 skips steps while the loss scale settles
        r = dist.get_rank()
        loss = engine(x[2 * r: 2 * r + 2], y[2 * r: 2 * r + 2])
        engine.backward(loss)
        engine.step()
        if engine.global_steps - engine.skipped_steps >= 2:  # optimizer states exist once a step was taken
            break
    stats = engine.memory_stats()
    rows = [None] * world
    stats["grads"] = stats["grads_peak"]  # gradient shards exist within a window only: their peak is the state
    dist.all_gather_object(rows, {k: stats[k] for k in ("params_sharded", "master_params", "grads",
                                                           "optimizer_states")})
    if dist.get_rank() == 0:
        json.dump({"psi": psi, "world": world, "precision": precision, "ranks": rows}, open(out, "w"))
    engine.destroy()  # before the group goes: README's shutdown section
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--worker", nargs=2, metavar=("PRECISION", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    print("| world | precision | params | masters | grads | optimizer | model states / rank (max) | ÷ 16Ψ/N |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for world in map(int, args.worlds.split(",")):
        for precision in args.precisions.split(","):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                str(world), __file__, "--worker", precision, out.name], check=True, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                result = json.load(open(out.name))
            worst = max(result["ranks"], key=lambda r: sum(r.values()))
            states = sum(worst.values())
            ideal = 16 * result["psi"] / world
            mib = [f"{worst[k] / 2**20:.2f}" for k in ("params_sharded", "master_params", "grads", "optimizer_states")]
            print(f"| {world} | {precision} | {' | '.join(mib)} | {states / 2**20:.3f} MiB | {states / ideal:.4f} |")


if __name__ == "__main__":
    main()
