"""Step time and peak RSS per rank with and without NVMe (and CPU) optimizer offload, on a small GPT, one run.

    python bench/offload.py                               # ZeRO-3 bf16, world 2: none / nvme (about 2 minutes)
    python bench/offload.py --variants none cpu nvme --nvme-path /local_nvme --steps 8
    python bench/offload.py --variants nvme nvme_sequential        # what the read/write pipeline hides
    python bench/offload.py --variants none nvme nvme_params       # parameter shards on NVMe too

Each variant runs in fresh processes (``python -m torch.distributed.run --standalone --nproc_per_node N``, CPU,
gloo, ``OMP_NUM_THREADS=1`` per rank), twice, as bench/compare.py does: a time pass with the default glibc allocator
(median step time over the steps after the first two; the slowest rank counts) and a memory pass with
``MALLOC_MMAP_THRESHOLD_=65536`` so that RSS follows the live tensors (peak RSS over the measured steps, after
``reset_memory_peaks()`` following the warm-up). Both passes check that every variant's losses are bitwise those of
"none" (offload changes where states live, not the arithmetic). The NVMe variant puts the fp32 masters and the Adam
moments in files under ``--nvme-path`` (``sub_group_size`` 500k elements, 4 buffers, both pipelines on);
``nvme_params`` adds ``offload_param`` nvme (the 16-bit shards in files too: buckets of ``buffer_size`` 500k
elements, 4 read ahead, ``max_in_cpu`` 2M elements per rank).
Prints a markdown table; ``--json`` writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUB_GROUP = 500_000


def config(variant: str, nvme_path: str) -> dict:
    zero = {"stage": 3, "sub_group_size": SUB_GROUP, "overlap_comm": True}
    if variant == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif variant in ("nvme", "nvme_params"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4,
                                     "pipeline_read": True, "pipeline_write": True}
        if variant == "nvme_params":
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_size": SUB_GROUP,
                                     "buffer_count": 4, "max_in_cpu": 4 * SUB_GROUP}
    elif variant == "nvme_sequential":  # the same without overlap: what the pipeline hides
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 1,
                                     "pipeline_read": False, "pipeline_write": False}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
            "zero_optimization": zero}


def worker(variant: str, nvme_path: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import zero_engine
    from zero_engine.testing.models import GPT, GPTConfig, make_batches

    zero_engine.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512)
    model = GPT(cfg)
    psi = sum(p.numel() for p in model.parameters())
    engine, *_ = zero_engine.initialize(model=model, config=config(variant, nvme_path))
    times, losses = [], []
    swapper = getattr(engine.optimizer, "swapper", None)
    io_before = {}
    for i, (x, y) in enumerate(make_batches(cfg, steps, 4 * world)):
        if i == 2:
            engine.reset_memory_peaks()
            io_before = dict(swapper.io_stats) if swapper is not None else {}
        start = time.perf_counter()
        loss = engine(x[rank * 4: rank * 4 + 4], y[rank * 4: rank * 4 + 4])
        engine.backward(loss)
        engine.step()
        took = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(took.item())
        losses.append(loss.float().item())
    io = {k: v - io_before.get(k, 0) for k, v in swapper.io_stats.items()} if swapper is not None else None
    stats = engine.memory_stats()
    rss_peak = torch.tensor(float(stats["rss_peak"]))
    dist.all_reduce(rss_peak, op=dist.ReduceOp.MAX)
    engine.destroy()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"variant": variant, "psi": psi, "world": world, "times": times, "losses": losses,
                       "rss_peak_max_rank": rss_peak.item(), "by_location": stats["by_location"],
                       "model_states": engine.model_state_bytes(stats), "io": io}, f)
    dist.destroy_process_group()


def launch(variant: str, world: int, steps: int, nvme_path: str, memory_pass: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if memory_pass:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               os.path.abspath(__file__), "--worker", variant, "--nvme-path", nvme_path, "--steps", str(steps),
               "--out", out]
        subprocess.run(cmd, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def _io_text(io: dict | None) -> str:
    if not io or not io["step_seconds"]:
        return "-"
    rate = (io["read_bytes"] + io["write_bytes"]) / io["step_seconds"] / 2**20
    return f"{rate:.0f} ({io['read_bytes'] / 2**20:.0f} MiB read + {io['write_bytes'] / 2**20:.0f} written), " \
           f"{io['io_wait_seconds'] / io['step_seconds']:.0%}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=["none", "nvme"], choices=["none", "cpu", "nvme", "nvme_sequential", "nvme_params"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nvme-path", default=os.path.join(tempfile.gettempdir(), "zero_engine_nvme"))
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.makedirs(args.nvme_path, exist_ok=True)
    if args.worker:
        worker(args.worker, args.nvme_path, args.steps, args.out)
        return 0
    results = {}
    for variant in args.variants:
        results[variant] = {"time": launch(variant, args.world, args.steps, args.nvme_path, False),
                            "memory": launch(variant, args.world, args.steps, args.nvme_path, True)}
    base = results[args.variants[0]]
    print(f"ZeRO-3 bf16 GPT, {base['time']['psi'] / 1e6:.1f}M parameters, world {args.world}, CPU/gloo, "
          f"{args.steps} steps; step time = median of steps 3.. (slowest rank); peak RSS = max over ranks "
          "(MALLOC_MMAP_THRESHOLD_=65536); optimizer-step I/O of rank 0 over steps 3..: MiB/s = bytes read + "
          "written / optimizer-step time, and the share of that time spent waiting for I/O\n")
    print("| variant | step time (s) | ÷ none | peak RSS per rank (MiB) | ÷ none | model states device / "
          "host / nvme per rank (MiB) | losses bitwise = none | optimizer-step I/O MiB/s, I/O wait share |")
    print("|---|---|---|---|---|---|---|---|")
    t0 = statistics.median(base["time"]["times"][2:])
    r0 = base["memory"]["rss_peak_max_rank"]
    for variant, r in results.items():
        t = statistics.median(r["time"]["times"][2:])
        rss = r["memory"]["rss_peak_max_rank"]
        where = r["memory"]["by_location"]
        same = r["time"]["losses"] == base["time"]["losses"] and r["memory"]["losses"] == base["memory"]["losses"]
        print(f"| {variant} | {t:.3f} | {t / t0:.2f} | {rss / 2**20:.0f} | {rss / r0:.2f} | "
              f"{where['device']['total'] / 2**20:.0f} / {where['host']['total'] / 2**20:.0f} / "
              f"{where['nvme']['total'] / 2**20:.0f} | {'yes' if same else 'NO'} | {_io_text(r['time']['io'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
