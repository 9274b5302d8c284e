"""Checkpoint save/load time and bytes per rank, and the memory of the offline fp32 consolidation, in one run.

    python bench/checkpoint.py                          # demo and 100m models at world 2 (about two minutes)
    python bench/checkpoint.py --sizes demo --repeats 5

For each model size (bench/_common.py: the demo model and the ~100M-parameter GPT) the script launches
``python -m torch.distributed.run --standalone --nproc_per_node W bench/checkpoint.py --worker ...`` (gloo on CPU,
``OMP_NUM_THREADS=1`` per rank). The worker trains one step (so AdamW's moments exist), then per repeat:

- save: ``engine.save_checkpoint`` between two barriers (every rank writes its file, fsync, rename, ``latest``),
  under a new tag each time, as ``global_step<N>`` is during training;
- load: a new engine built from another seed, ``engine.load_checkpoint`` between two barriers (verification of
  every file's SHA-256 included), and separately the verification alone;

and reports the median over repeats and the bytes each rank wrote, next to a reference taken in the same repeat:
the same number of bytes per rank written raw (one buffer, no hashing) and fsynced, between the same barriers.

Then, per output format, a fresh process runs the offline consolidation (``convert_zero_checkpoint_to_fp32_...``)
with ``MALLOC_MMAP_THRESHOLD_=65536`` so that RSS follows live tensors (see bench/_measure.py), and reports its
peak RSS above its RSS before the conversion, relative to the fp32 size of the model.

Files go to --dir (default: a temporary directory under /tmp, removed at the end); the page cache is warm, as it
is right after training saved them. The disk is whatever the machine has: compare save with the raw reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import MODEL_SEED, SIZES, SYSTEMS, zero_engine_config  # noqa: E402


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _write_raw(path: str, data) -> None:
    with open(path, "xb", buffering=0) as f:
        f.write(memoryview(data))
        os.fsync(f.fileno())


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zero_engine
    from zero_engine.checkpoint._metadata import read_metadata
    from zero_engine.checkpoint._reader import verify_files
    from zero_engine.testing.models import GPT, GPTConfig, make_batches

    zero_engine.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    size = SIZES[args.size]
    config = zero_engine_config(size, SYSTEMS["zero3"], world)
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}

    def build(seed):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(**size.gpt))
        return zero_engine.initialize(model=model, config=config)[0]

    engine = build(MODEL_SEED)
    micro = size.micro_batch(world)
    x, y = make_batches(engine.module.cfg, 1, micro * world)[0]
    loss = engine(x[rank * micro: (rank + 1) * micro], y[rank * micro: (rank + 1) * micro])
    engine.backward(loss)
    engine.step()
    params = sum(sp.numel for sp in engine.sharded)
    fresh = build(MODEL_SEED + 1)
    saves, loads, verifies, raw_writes = [], [], [], []
    raw = None
    for repeat in range(args.repeats):
        tag = f"bench{repeat}"  # a new tag each time, as global_step<N> is during training
        saves.append(_timed(lambda: engine.save_checkpoint(args.dir, tag=tag)))
        path = os.path.join(args.dir, tag)
        meta = read_metadata(path)
        verifies.append(_timed(lambda: verify_files(path, meta, sorted(meta.files)[rank::world])))
        loads.append(_timed(lambda: fresh.load_checkpoint(args.dir)))
        # The floor, interleaved so that both see the same disk: the same bytes per rank written raw, fsynced.
        if raw is None:
            raw = torch.zeros(meta.files[f"rank_{rank:05d}.safetensors"]["bytes"], dtype=torch.uint8).numpy()
        raw_writes.append(_timed(lambda: _write_raw(os.path.join(args.dir, f"raw{rank}"), raw)))
        os.remove(os.path.join(args.dir, f"raw{rank}"))
        if rank == 0 and repeat:
            shutil.rmtree(os.path.join(args.dir, f"bench{repeat - 1}"))
        dist.barrier()
    files = meta.files
    if rank == 0:
        per_rank = [files[f"rank_{r:05d}.safetensors"]["bytes"] for r in range(world)]
        extra = sum(v["bytes"] for k, v in files.items() if not k.startswith("rank_"))
        result = {"size": args.size, "precision": args.precision, "world": world, "params": params,
                  "save_s": statistics.median(saves), "load_s": statistics.median(loads),
                  "verify_s": statistics.median(verifies), "raw_write_s": statistics.median(raw_writes),
                  "bytes_per_rank": per_rank, "rank0_extra_bytes": extra,
                  "save_all_s": saves, "load_all_s": loads, "raw_write_all_s": raw_writes}
        Path(args.out).write_text(json.dumps(result))


def consolidate(args) -> None:
    """Runs in its own process: peak RSS of one conversion (see [Note: two peak-RSS figures] in _measure.py)."""
    import torch  # noqa: F401 -- imported before the baseline: its own memory is not the conversion's

    from _measure import reset_rss_peak, rss_bytes, rss_peak_bytes
    from zero_engine.checkpoint import convert_zero_checkpoint_to_fp32_state_dict

    baseline = rss_bytes()
    reset_rss_peak()
    start = time.perf_counter()
    result = convert_zero_checkpoint_to_fp32_state_dict(args.dir, args.out, fmt=args.format)
    seconds = time.perf_counter() - start
    print(json.dumps({"format": args.format, "seconds": seconds, "fp32_bytes": result.nbytes,
                      "peak_above_baseline": rss_peak_bytes() - baseline, "baseline": baseline}))


def run_size(args, size: str, root: Path) -> dict:
    directory = root / f"ckpt-{size}-{args.precision}"
    out = root / f"{size}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.world),
           __file__, "--worker", "--size", size, "--dir", str(directory), "--out", str(out), "--repeats",
           str(args.repeats), "--precision", args.precision]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    result["consolidation"] = []
    for fmt, name in (("torch", "model.pt"), ("safetensors", "model.safetensors")):
        proc = subprocess.run([sys.executable, __file__, "--consolidate", "--dir", str(directory), "--out",
                               str(root / name), "--format", fmt],
                              env={**env, "MALLOC_MMAP_THRESHOLD_": "65536"}, check=True, capture_output=True,
                              text=True)
        result["consolidation"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        os.remove(root / name)
    shutil.rmtree(directory)
    return result


def table(results: list[dict]) -> str:
    mib = 2**20
    lines = ["| model | params | dtype | world | bytes written per rank | save | same bytes raw + fsync | "
             "load (of which verify) | to-fp32 torch: peak RSS / fp32 size | "
             "to-fp32 safetensors: peak RSS / fp32 size |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        per_rank = " + ".join(f"{b / mib:.1f}" for b in r["bytes_per_rank"])
        cons = {c["format"]: c for c in r["consolidation"]}
        cells = [f"{cons[f]['peak_above_baseline'] / mib:.0f} MiB / {cons[f]['fp32_bytes'] / mib:.0f} MiB = "
                 f"{cons[f]['peak_above_baseline'] / cons[f]['fp32_bytes']:.2f}x ({cons[f]['seconds']:.2f}s)"
                 for f in ("torch", "safetensors")]
        lines.append(f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['precision']} | {r['world']} | {per_rank} MiB "
                     f"(+{r['rank0_extra_bytes'] / 1024:.0f} KiB on rank 0) | {r['save_s']:.2f}s | "
                     f"{r['raw_write_s']:.2f}s | "
                     f"{r['load_s']:.2f}s ({r['verify_s']:.2f}s) | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="demo,100m")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--dir", help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out", help="(internal) result file")
    parser.add_argument("--size", help="(internal) one size")
    parser.add_argument("--format", help="(internal) consolidation output format")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--consolidate", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.consolidate:
        return consolidate(args)
    root = Path(args.dir or tempfile.mkdtemp(prefix="zero_engine_ckpt_bench_"))
    try:
        results = [run_size(args, size, root) for size in args.sizes.split(",")]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"command: python bench/checkpoint.py --sizes {args.sizes} --world {args.world} --repeats "
          f"{args.repeats} --precision {args.precision}\n")
    print(table(results))
    print("\nraw: " + json.dumps(results))


if __name__ == "__main__":
    main()
