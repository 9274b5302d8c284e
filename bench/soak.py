"""A long run of the demo's GPT, watching what each rank holds: does anything grow with the number of steps?

    MALLOC_MMAP_THRESHOLD_=65536 PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \
        --nproc_per_node 2 bench/soak.py --config examples/configs/zero3.json [--steps 3000] [--every 250] \
        [--eval-every 20] [--save-every 50 --save-dir DIR] [--set '{"gradient_accumulation_steps": 2}']

Trains a small GPT (2 layers, 64 wide: the step is short, so a long run is minutes) and, every ``--every`` steps,
rank 0 prints one line: the Python heap traced by ``tracemalloc``, the garbage collector's tracked objects, threads,
open files and RSS. The last line is the change per 100 steps from the first quarter of the run to its end (after
the warm-up: the trace recorded, optimizer states made). ``--set`` overrides config keys (dotted paths for nested
ones, a JSON object); ``--eval-every`` / ``--save-every`` interleave an evaluation forward and a checkpoint save (three
tags in turn), as a real run does. ``MALLOC_MMAP_THRESHOLD_`` makes RSS follow the live tensors (see DESIGN.md,
"Measure memory two ways"). tests/test_long_run.py is the short version that CI runs.
"""

from __future__ import annotations

import argparse
import json
import os
import tracemalloc

import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing.long_run import held, run_steps
from zero_engine.testing.models import GPT, GPTConfig, make_batches


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="examples/configs/zero3.json")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=250, help="print a line every this many steps")
    parser.add_argument("--eval-every", type=int, default=0, help="an evaluation forward every this many steps")
    parser.add_argument("--save-every", type=int, default=0, help="a checkpoint save every this many steps")
    parser.add_argument("--save-dir", default="/tmp/zero_engine_soak")
    parser.add_argument("--set", default="{}", help='config overrides, e.g. \'{"bf16.enabled": true}\'')
    return parser.parse_args()


def load_config(path: str, overrides: dict) -> dict:
    with open(path) as f:
        config = json.load(f)
    for key, value in overrides.items():
        *parents, last = key.split(".")
        section = config
        for parent in parents:
            section = section.setdefault(parent, {})
        section[last] = value
    return config


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_embd=64, n_head=4)
    config = load_config(args.config, json.loads(args.set))
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=config)
    batches = make_batches(cfg, 8, engine.train_micro_batch_size_per_gpu(), seed=rank)
    tracemalloc.start()
    samples = {}
    for step in range(args.steps + 1):
        run_steps(engine, batches, step, 1, args.eval_every, args.save_every, args.save_dir)
        if step % args.every == 0 or step == args.steps // 4:
            samples[step] = held()
            if rank == 0 and step % args.every == 0:
                heap, objects, threads, files, rss = samples[step]
                print(f"step {step:6d}  heap {heap / 1024:8.1f} KiB  objects {objects:7d}  threads {threads}  "
                      f"files {files}  rss {rss / 2**20:8.1f} MiB", flush=True)
    first, last = samples[args.steps // 4], samples[args.steps]
    per = 100 / (args.steps - args.steps // 4)
    if rank == 0:
        heap, objects, threads, files, rss = ((b - a) * per for a, b in zip(first, last))
        print(json.dumps({"config": os.path.basename(args.config), "set": json.loads(args.set),
                          "steps": args.steps, "from_step": args.steps // 4,
                          "per_100_steps": {"heap_kib": round(heap / 1024, 2), "objects": round(objects, 2),
                                            "threads": round(threads, 2), "files": round(files, 2),
                                            "rss_mib": round(rss / 2**20, 3)}}), flush=True)
    tracemalloc.stop()
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
