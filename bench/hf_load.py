"""Peak RSS per rank while zero_engine.hf.from_pretrained loads a ≥200M-parameter Llama at world 2.

    flock /work/locks/bench.lock python bench/hf_load.py            # creates bench/.hf_llama_218m once (~0.9 GB)

The checkpoint is a random Llama (vocab 32000, hidden 1024, 12 layers: 218.1M parameters, 872 MB in fp32) written
as sharded safetensors by streaming one random tensor at a time (nothing holds the whole model while creating it).
Then, each in a fresh process, side by side:
  - zero_engine.hf.from_pretrained at world 2 (torchrun-style ranks over gloo): each rank reports its RSS after the
    imports and process-group set-up (the baseline), its peak RSS during from_pretrained (VmHWM reset just before),
    and the shard bytes it holds;
  - plain transformers AutoModelForCausalLM.from_pretrained in one process, for scale.
RSS tracks live tensors because every process runs with MALLOC_MMAP_THRESHOLD_=65536 (see DESIGN.md "Measure memory
two ways"); the .safetensors pages read are page cache, not RSS (positioned reads, no mmap).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_DIR = os.path.join(HERE, ".hf_llama_218m")
LLAMA = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048, tie_word_embeddings=False)


def make_checkpoint(directory: str, layers: int, hidden: int) -> None:
    """Random weights, written tensor by tensor into 200 MB safetensors shards with an index."""
    import torch
    import transformers

    from zero_engine.hf._writer import SafetensorsWriter, parse_size, plan_shards

    cfg = dict(LLAMA, num_hidden_layers=layers, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
               num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64)
    config = transformers.LlamaConfig(**cfg, dtype=torch.float32)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    names = [(n, torch.float32, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = plan_shards(names, parse_size("200MB"))
    os.makedirs(directory, exist_ok=True)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    gen = torch.Generator().manual_seed(0)
    for fname, entries in zip(plan.filenames(), plan.files):
        writer = SafetensorsWriter(os.path.join(directory, fname), entries)
        for e in entries:
            value = torch.ones(e.shape) if e.name.endswith("norm.weight") else \
                torch.randn(e.shape, generator=gen).mul_(0.02)
            writer.write(e.name, value)
        writer.close()
    if len(plan.files) > 1:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump(plan.index(), f)
    print(f"wrote {directory}: {sum(1 for _ in names)} tensors in {len(plan.files)} files", flush=True)


def warm_imports(directory: str):
    """Import the model's code (transformers imports modeling_llama lazily) so the baseline includes it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(directory))]


def rank_worker(directory: str, out: str, dtype: str) -> None:
    import torch
    import torch.distributed as dist

    import zero_engine
    import zero_engine.hf
    from transformers import AutoModelForCausalLM
    from zero_engine.memory import reset_rss_peak, rss_bytes, rss_peak_bytes
    from zero_engine.zero.partition import sharded_param_of

    zero_engine.init_distributed()
    warm_imports(directory)
    dist.barrier()
    baseline = rss_bytes()
    reset_rss_peak()
    start = time.perf_counter()
    model = zero_engine.hf.from_pretrained(AutoModelForCausalLM, directory, dtype=getattr(torch, dtype))
    seconds = time.perf_counter() - start
    peak = rss_peak_bytes()
    shards = sum(sharded_param_of(p).shard.numel() * sharded_param_of(p).shard.element_size()
                 for p in model.parameters())
    numel = sum(sharded_param_of(p).numel for p in model.parameters())
    result = {"rank": dist.get_rank(), "baseline": baseline, "peak": peak, "after": rss_bytes(), "shards": shards,
              "numel": numel, "seconds": seconds}
    with open(f"{out}.{dtype}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def plain_worker(directory: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from zero_engine.memory import reset_rss_peak, rss_bytes, rss_peak_bytes

    warm_imports(directory)
    baseline = rss_bytes()
    reset_rss_peak()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    seconds = time.perf_counter() - start
    loaded_peak = rss_peak_bytes()
    with torch.no_grad():  # its weights are views of the mmap'd file until read: read each once
        for p in model.parameters():
            p.sum()
    result = {"baseline": baseline, "peak": loaded_peak, "touched": rss_bytes(), "seconds": seconds}
    with open(out, "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=DEFAULT_DIR)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--skip-plain", action="store_true")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes to load as (comma-separated)")
    parser.add_argument("--rank-worker", nargs=3, metavar=("DIR", "OUT", "DTYPE"), help=argparse.SUPPRESS)
    parser.add_argument("--plain-worker", nargs=2, metavar=("DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        return rank_worker(*args.rank_worker)
    if args.plain_worker:
        return plain_worker(*args.plain_worker)

    if not os.path.exists(os.path.join(args.dir, "config.json")):
        make_checkpoint(args.dir, args.layers, args.hidden)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tmp = tempfile.mkdtemp(prefix="hf_load_")
    out = os.path.join(tmp, "zero")
    rows = []
    for dtype in args.dtypes.split(","):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                        str(args.world), __file__, "--rank-worker", args.dir, out, dtype], env=env, check=True)
        rows += [(dtype, json.load(open(f"{out}.{dtype}.rank{r}.json"))) for r in range(args.world)]
    fp32 = rows[0][1]["numel"] * 4
    mib = 2 ** 20
    print(f"\nmodel: {rows[0][1]['numel'] / 1e6:.1f}M parameters, fp32 size {fp32 / mib:.0f} MiB; "
          f"world {args.world}; fp32 checkpoint (sharded safetensors)")
    print("| loaded as | rank | RSS before load | peak RSS during load | peak ÷ fp32 size | growth (peak − before) | "
          "growth ÷ fp32 size | shards held | load time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype, r in rows:
        growth = r["peak"] - r["baseline"]
        print(f"| {dtype} | {r['rank']} | {r['baseline'] / mib:.0f} MiB | {r['peak'] / mib:.0f} MiB | "
              f"{r['peak'] / fp32:.3f} | {growth / mib:.0f} MiB | {growth / fp32:.3f} | "
              f"{r['shards'] / mib:.0f} MiB | {r['seconds']:.1f} s |")
    if not args.skip_plain:
        plain_out = os.path.join(tmp, "plain.json")
        subprocess.run([sys.executable, __file__, "--plain-worker", args.dir, plain_out], env=env, check=True)
        p = json.load(open(plain_out))
        growth = p["peak"] - p["baseline"]
        print(f"| float32, plain transformers | 1 process | {p['baseline'] / mib:.0f} MiB | {p['peak'] / mib:.0f} MiB | "
              f"{p['peak'] / fp32:.3f} | {growth / mib:.0f} MiB | {growth / fp32:.3f} | whole model (mmap'd file; "
              f"{p['touched'] / mib:.0f} MiB RSS once every weight was read) | {p['seconds']:.1f} s |")


if __name__ == "__main__":
    main()
