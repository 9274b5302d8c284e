"""Step time and peak RSS per rank with and without NVMe (and CPU) optimizer offload, on a small GPT, one run.

    python bench/offload.py                               # ZeRO-3 bf16, world 2: none / nvme (about 2 minutes)
    python bench/offload.py --variants none cpu nvme --nvme-path /local_nvme --steps 8
    python bench/offload.py --variants nvme nvme_sequential        # what the read/write pipeline hides
    python bench/offload.py --variants none nvme nvme_params       # parameter shards on NVMe too
    python bench/offload.py --model 100m --variants none nvme_params --steps 5     # bench/compare.py's 100m GPT
    python bench/offload.py --model 1.8b --variants nvme_params --steps 3          # states 2x what half the RAM holds
    python bench/offload.py --variants nvme_params_nocrc nvme_params --passes time # cost of the swap checksums
    python bench/offload.py --variants cpu_fp32_grads cpu --sub-group-size 1000000000  # 16-bit grads into CPUAdam

Each variant runs in fresh processes (``python -m torch.distributed.run --standalone --nproc_per_node N``, CPU,
gloo, ``OMP_NUM_THREADS=1`` per rank), twice, as bench/compare.py does: a time pass with the default glibc allocator
(median step time over the steps after the first two; the slowest rank counts) and a memory pass with
``MALLOC_MMAP_THRESHOLD_=65536`` so that RSS follows the live tensors (peak RSS over the measured steps, after
``reset_memory_peaks()`` following the warm-up). Both passes check that every variant's losses are bitwise those of
"none" (offload changes where states live, not the arithmetic). The NVMe variant puts the fp32 masters and the Adam
moments in files under ``--nvme-path`` (``sub_group_size`` 500k elements, 4 buffers, both pipelines on);
``nvme_params`` adds ``offload_param`` nvme (the 16-bit shards in files too: buckets of ``buffer_size`` 500k
elements, 4 read ahead, ``max_in_cpu`` 2M elements per rank). A ``_nocrc`` suffix (``nvme_nocrc``,
``nvme_params_nocrc``) runs the same with ``aio.checksum`` off: no CRC of the swap blocks (see [Note: swap
checksums] in zero_engine/offload/nvme.py). ``cpu_fp32_grads`` is ``cpu`` with the optimizer's earlier path: each
sub-group's bf16 gradient shards converted to fp32 copies before CPUAdam, instead of going into its kernel as they
are; ``--sub-group-size`` overrides the model's (DeepSpeed's default, 1e9, converts the whole shard at once).
``--model`` picks the GPT: ``small`` (23.2M, the default), ``100m`` (97.7M, bench/compare.py's) or ``1.8b``
(1.83B, built under ``zero_engine.zero.Init`` so that no rank ever holds the whole model; its model states, 16 bytes
a parameter, are 13.6 GiB per rank at world 2, more than half of a 24 GiB machine, so only ``nvme_params`` fits).
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
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
AIO_THREADS = 1  # aio.thread_count (--aio-threads)

class Model(NamedTuple):
    gpt: dict  # GPTConfig keywords
    micro_batch: int  # sequences per rank per step
    zero_init: bool  # built under zero_engine.zero.Init
    sub_group: int  # sub_group_size, and offload_param.buffer_size
    # ZeRO knobs. Without them the defaults (DeepSpeed's) hold: 5e8-element reduce buckets and 1e9 live parameters,
    # i.e. the whole model's gradient in one fp32 send buffer and the whole model gathered at once, which a model
    # too big for memory cannot afford; 100m takes bench/compare.py's knobs, 1.8b the same scaled to its blocks.
    knobs: dict


MODELS = {
    "small": Model(dict(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512), 4, False, 500_000, {}),
    "100m": Model(dict(vocab_size=16384, block_size=64, n_layer=12, n_head=12, n_embd=768), 4, False, 5_000_000,
                  {"reduce_bucket_size": 5_000_000, "stage3_prefetch_bucket_size": 5_000_000,
                   "stage3_param_persistence_threshold": 10_000, "stage3_max_live_parameters": 20_000_000}),
    "1.8b": Model(dict(vocab_size=8192, block_size=64, n_layer=36, n_head=16, n_embd=2048), 1, True, 10_000_000,
                  {"reduce_bucket_size": 50_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                   "stage3_param_persistence_threshold": 100_000, "stage3_max_live_parameters": 100_000_000}),
}


SUB_GROUP = None  # --sub-group-size: overrides the model's sub_group_size


def config(variant: str, nvme_path: str, model: str = "small") -> dict:
    checksum = not variant.endswith("_nocrc")
    variant = variant.removesuffix("_nocrc").removesuffix("_fp32_grads")
    sub_group = SUB_GROUP or MODELS[model].sub_group
    zero = {"stage": 3, "sub_group_size": sub_group, "overlap_comm": True, **MODELS[model].knobs}
    if variant == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif variant in ("nvme", "nvme_params"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4,
                                     "pipeline_read": True, "pipeline_write": True}
        if variant == "nvme_params":
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_size": sub_group,
                                     "buffer_count": 4, "max_in_cpu": 4 * sub_group}
    elif variant == "nvme_sequential":  # the same without overlap: what the pipeline hides
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 1,
                                     "pipeline_read": False, "pipeline_write": False}
    extra = {"aio": {"thread_count": AIO_THREADS, "checksum": checksum}} if variant.startswith("nvme") else {}
    return {**extra, "train_micro_batch_size_per_gpu": MODELS[model].micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
            "zero_optimization": zero}


def worker(variant: str, nvme_path: str, steps: int, out: str, model_name: str) -> None:
    import torch
    import torch.distributed as dist

    import zero_engine
    from zero_engine.testing.models import GPT, GPTConfig, make_batches

    zero_engine.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    spec = MODELS[model_name]
    micro = spec.micro_batch
    cfg = GPTConfig(**spec.gpt)
    ds_config = config(variant, nvme_path, model_name)
    start = time.perf_counter()
    if spec.zero_init:  # each rank builds and keeps its shards only
        with zero_engine.zero.Init(config_dict_or_path=ds_config):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    engine, *_ = zero_engine.initialize(model=model, config=ds_config)
    if variant.endswith("_fp32_grads"):  # the path before 16-bit gradients went into CPUAdam's kernel
        engine.optimizer.grads_in_kernel = False
        for master in engine.optimizer.masters.values():
            master.grad_dtype = torch.float32
    init_seconds = time.perf_counter() - start
    psi = sum(sp.numel for sp in engine.sharded)
    from zero_engine.memory import reset_rss_peak, rss_bytes, rss_peak_bytes

    times, losses, opt_times, opt_rss_rise = [], [], [], []
    peak = 0  # the run's peak RSS, kept across the per-step resets below
    swapper = getattr(engine.optimizer, "swapper", None)
    io_before = {}
    for i, (x, y) in enumerate(make_batches(cfg, steps, micro * world)):
        if i == min(2, steps - 1):
            engine.reset_memory_peaks()
            peak = 0
            io_before = dict(swapper.io_stats) if swapper is not None else {}
        start = time.perf_counter()
        loss = engine(x[rank * micro: (rank + 1) * micro], y[rank * micro: (rank + 1) * micro])
        engine.backward(loss)
        peak = max(peak, rss_peak_bytes())
        rss_before, opt_start = rss_bytes(), time.perf_counter()
        reset_rss_peak()
        engine.step()  # the optimizer step alone: its time and how far RSS rises above where it started
        opt_times.append(time.perf_counter() - opt_start)
        opt_rss_rise.append(rss_peak_bytes() - rss_before)
        took = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(took.item())
        losses.append(loss.float().item())
    io = {k: v - io_before.get(k, 0) for k, v in swapper.io_stats.items()} if swapper is not None else None
    stats = engine.memory_stats()
    rss_peak = torch.tensor(float(max(peak, rss_peak_bytes())))
    dist.all_reduce(rss_peak, op=dist.ReduceOp.MAX)
    engine.destroy()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"variant": variant, "model": model_name, "psi": psi, "world": world, "times": times,
                       "opt_times": opt_times, "opt_rss_rise": opt_rss_rise,
                       "losses": losses, "init_seconds": init_seconds,
                       "rss_peak_max_rank": rss_peak.item(), "by_location": stats["by_location"],
                       "model_states": engine.model_state_bytes(stats), "io": io}, f)
    dist.destroy_process_group()


def launch(variant: str, world: int, steps: int, nvme_path: str, memory_pass: bool, model: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if memory_pass:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               os.path.abspath(__file__), "--worker", variant, "--nvme-path", nvme_path, "--steps", str(steps),
               "--aio-threads", str(AIO_THREADS), "--model", model, "--out", out]
        if SUB_GROUP:
            cmd += ["--sub-group-size", str(SUB_GROUP)]
        subprocess.run(cmd, env=env, check=True, timeout=3600, stdout=subprocess.DEVNULL)
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
    parser.add_argument("--variants", nargs="+", default=["none", "nvme"], choices=["none", "cpu", "cpu_fp32_grads", "nvme", "nvme_sequential", "nvme_params", "nvme_nocrc", "nvme_params_nocrc"])
    parser.add_argument("--model", default="small", choices=list(MODELS))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--passes", default="time,memory",
                        help="time (default allocator), memory (MALLOC_MMAP_THRESHOLD_), or both")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nvme-path", default=os.path.join(tempfile.gettempdir(), "zero_engine_nvme"))
    parser.add_argument("--aio-threads", type=int, default=1, help="aio.thread_count of the nvme variants")
    parser.add_argument("--sub-group-size", type=int, help="zero_optimization.sub_group_size (default: the model's)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the variants this many times, interleaved (a, b, a, b...); step times pool the "
                             "measured steps of every repeat (a noisy machine hits each variant alike)")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.makedirs(args.nvme_path, exist_ok=True)
    global AIO_THREADS, SUB_GROUP
    AIO_THREADS = args.aio_threads
    SUB_GROUP = args.sub_group_size
    if args.worker:
        worker(args.worker, args.nvme_path, args.steps, args.out, args.model)
        return 0
    passes = args.passes.split(",")
    results = {}
    timed = slice(min(2, args.steps - 1), None)
    for repeat in range(args.repeats):
        for variant in args.variants:
            ran = {p: launch(variant, args.world, args.steps, args.nvme_path, p == "memory", args.model)
                   for p in passes}
            if variant in results:  # pool the measured steps; the first repeat's other numbers are kept
                results[variant]["time"]["measured"] += ran.get("time", ran.get("memory"))["times"][timed]
                results[variant]["time"]["opt_measured"] += ran.get("time", ran.get("memory"))["opt_times"][timed]
                continue
            results[variant] = {"time": ran.get("time", ran.get("memory")),
                                "memory": ran.get("memory", ran.get("time"))}
            results[variant]["time"]["measured"] = list(results[variant]["time"]["times"][timed])
            results[variant]["time"]["opt_measured"] = list(results[variant]["time"]["opt_times"][timed])
    base = results[args.variants[0]]
    psi = base["time"]["psi"]
    states = 16 * psi / args.world  # 2 (bf16 param) + 2 (grad) + 12 (fp32 master, two moments) bytes a parameter
    print(f"ZeRO-3 bf16 GPT ({args.model}), {psi / 1e6:.1f}M parameters, world {args.world}, CPU/gloo, "
          f"model states 16Ψ/N = {states / 2**30:.2f} GiB per rank (machine: "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB); "
          f"build + initialize {base['time']['init_seconds']:.0f} s; "
          f"{args.steps} steps x {args.repeats} interleaved run(s); step time = median of steps 3.. (slowest rank); peak RSS = max over ranks "
          "(MALLOC_MMAP_THRESHOLD_=65536); optimizer-step I/O of rank 0 over steps 3..: MiB/s = bytes read + "
          "written / optimizer-step time, and the share of that time spent waiting for I/O\n")
    print(f"| variant | step time (s) | ÷ {args.variants[0]} | peak RSS per rank (MiB) | ÷ {args.variants[0]} | "
          "÷ 16Ψ/N | model states device / host / nvme per rank (MiB) | losses bitwise = "
          f"{args.variants[0]} | optimizer-step I/O MiB/s, I/O wait share | engine.step() (s, rank 0) | "
          "RSS rise during engine.step() (MiB, rank 0) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    t0 = statistics.median(base["time"]["measured"])
    r0 = base["memory"]["rss_peak_max_rank"]
    for variant, r in results.items():
        t = statistics.median(r["time"]["measured"])
        rss = r["memory"]["rss_peak_max_rank"]
        where = r["memory"]["by_location"]
        same = r["time"]["losses"] == base["time"]["losses"] and r["memory"]["losses"] == base["memory"]["losses"]
        print(f"| {variant} | {t:.3f} | {t / t0:.2f} | {rss / 2**20:.0f} | {rss / r0:.2f} | {rss / states:.2f} | "
              f"{where['device']['total'] / 2**20:.0f} / {where['host']['total'] / 2**20:.0f} / "
              f"{where['nvme']['total'] / 2**20:.0f} | {'yes' if same else 'NO'} | {_io_text(r['time']['io'])} | "
              f"{statistics.median(r['time']['opt_measured']):.3f} | "
              f"{max(r['memory']['opt_rss_rise'][timed]) / 2**20:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
