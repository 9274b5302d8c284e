"""Whose Python holds the GIL during training steps, from py-spy samples: the engine's, the model's or torch's.

    pip install py-spy                                   # a separate tool, not a dependency of zero_engine
    OMP_NUM_THREADS=1 py-spy record --gil --subprocesses -r 400 -f raw -o spy.txt -- \\
        python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        examples/train_gpt.py --config examples/configs/zero3.json --steps 120
    python bench/gil_split.py spy.txt --rate 400 --steps 120 --ranks 2

cProfile (bench/profile_step.py) charges a cost to every Python call, which is most of a short function's time, so
it overstates the engine's Python, and by how much depends on how many calls a tree makes: profile_step.py's
correction for it is an estimate. A sampler adds no cost per call. ``--gil`` keeps only the samples where a thread
holds the GIL, that is, where it runs Python (a torch kernel, a collective or a wait releases it); each sample is
charged to the innermost Python frame of its stack. Only the samples inside ``ZeroEngine.forward``, ``backward``
and ``step`` count (initialize, data and logging are left out). Milliseconds are per step and per rank: samples ÷
rate ÷ steps ÷ ranks; py-spy stops the processes to sample them, which slows the run, so compare trees by runs
made the same way, alternated, rather than read these as the plain step's milliseconds.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

_PY_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*\.py):(?P<line>\d+)\)$")
_IN_STEP = re.compile(r"\b(forward|backward|step) \((?:[^()]*/)?zero_engine/engine\.py:\d+\)$")


def _bucket(file: str) -> str:
    if "zero_engine/testing/" in file:
        return "the model (zero_engine.testing)"
    if "zero_engine/" in file:
        return "zero_engine"
    if "torch/" in file:
        return "torch"
    return "other"


def split(lines, rate: float, steps: int, ranks: int) -> tuple[Counter, Counter]:
    """(ms per step and rank by bucket, ms per step and rank of each zero_engine function) from py-spy's raw lines
    (``frame;frame;... count``, outermost frame first)."""
    per_step = 1000.0 / rate / steps / ranks
    buckets: Counter = Counter()
    functions: Counter = Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if not any(_IN_STEP.search(frame) for frame in frames):
            continue
        # the step's own frame is a Python frame: there is always one
        innermost = next(m for m in map(_PY_FRAME.match, reversed(frames)) if m)
        where = _bucket(innermost["file"])
        buckets[where] += int(count)
        if where == "zero_engine":
            functions[f"{innermost['file'].split('zero_engine/')[-1]}:{innermost['func']}"] += int(count)
    return (Counter({k: v * per_step for k, v in buckets.items()}),
            Counter({k: v * per_step for k, v in functions.items()}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("raw", nargs="+", help="py-spy record -f raw outputs")
    parser.add_argument("--rate", type=float, default=400, help="py-spy's -r")
    parser.add_argument("--steps", type=int, default=120, help="training steps of the run")
    parser.add_argument("--ranks", type=int, default=2, help="ranks sampled (--subprocesses)")
    parser.add_argument("--top", type=int, default=15, help="zero_engine functions listed per file")
    args = parser.parse_args(argv)
    for path in args.raw:
        with open(path) as f:
            buckets, functions = split(f, args.rate, args.steps, args.ranks)
        total = sum(buckets.values())
        print(f"{path}: GIL held in training steps {total:.2f} ms per step and rank: "
              + ", ".join(f"{k} {v:.2f}" for k, v in buckets.most_common()))
        for name, ms in functions.most_common(args.top):
            print(f"    {ms:6.2f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
