"""The collectives and launches of one steady ZeRO-3 step, counted on the CPU: what a GPU profile's op counts come from.

    PYTHONPATH=$PWD python bench/step_ops.py                              # gpu_check's 1b config, a 1.1B block's
                                                                          # shapes at n_embd 1024, 2 blocks
    PYTHONPATH=$PWD python bench/step_ops.py --compile eager             # the blocks compiled (engine.compile)
    PYTHONPATH=$PWD python bench/step_ops.py --group-large               # large parameters gathered as one group
    PYTHONPATH=$PWD python bench/step_ops.py --zero-optimization '{"stage3_max_live_parameters": 20000000}'
                                          # too little room to keep the model gathered, as for the 1.1B GPT

One process (world 1, gloo), bf16, bench/gpu_check.py's zero3 config for the 1b size (its buckets and persistence
threshold; ``--zero-optimization`` merges keys into it) on a GPT whose matrices are as large relative to
``DIRECT_GATHER_NUMEL`` as the 1.1B GPT's: every weight matrix is gathered straight into its storage. After three
steps, one more runs under a dispatch mode that counts its ops; printed: the engine's collectives, the all-gather
calls of the backend (a group is one), the gradient copy-ins (``_chunk_cat``), and the fp32 conversions and scalings before the optimizer
(``_to_copy``, ``mul_``). ``--group-large`` sets what NCCL would choose ([Note: large parameters gathered as one
group] in zero_engine/zero/gather.py), which gloo does not; ``--optimizer sgd`` takes the optimizer path FusedAdam
takes on CUDA (fp32 gradients made before the step), where CPUAdam scales 16-bit gradients in its kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COUNTED = {"_chunk_cat": "gradient copy-ins (_chunk_cat)", "_to_copy": "dtype conversions (_to_copy)",
           "mul_": "scalings (mul_)"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--compile", default="", help="a torch.compile backend for engine.compile() (eager: fast)")
    parser.add_argument("--group-large", action="store_true", help="gather large parameters as one group")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--zero-optimization", default="{}", help="JSON merged into zero_optimization")
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import zero_engine
    from gpu_check import _build_model, _zero3_config, batch
    from zero_engine.testing.models import GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=args.layers, n_head=8, n_embd=args.n_embd)
    config = _zero3_config(2, False, "1b", **json.loads(args.zero_optimization))
    if args.optimizer == "sgd":
        config["optimizer"] = {"type": "SGD", "params": {"lr": 1e-3}}
    zero_engine.init_distributed()
    engine, *_ = zero_engine.initialize(model=_build_model(cfg), config=config)
    if args.compile:
        engine.compile(backend=args.compile)
    engine.coordinator.gatherer.group_large = args.group_large
    x, y = batch(cfg, 2, engine.device)

    def step():
        engine.backward(engine(x, y))
        engine.step()

    for _ in range(3):
        step()
    engine.reset_comm_stats()
    with _Count() as count:
        step()
    collectives = {kind: stat["calls"] for kind, stat in engine.comm_stats().items() if stat["calls"]}
    print(f"n_embd {args.n_embd}, {args.layers} blocks, compile {args.compile or 'no'}, group_large "
          f"{args.group_large}, optimizer {args.optimizer}, units {len(engine.coordinator.units)}")
    print(f"collectives a step: {collectives}")
    gathers = {op: n for op, n in count.ops.items() if "allgather" in op}  # one op a call of the backend
    print(f"all-gather calls of the backend: {sum(gathers.values())} {gathers}")
    for op, label in COUNTED.items():
        print(f"{label}: {count.ops[op]}")
    engine.destroy()


if __name__ == "__main__":
    main()
