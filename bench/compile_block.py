"""What torch.compile (Inductor) buys on this machine's CPU for the 100m GPT's blocks alone, with no ZeRO and no
collectives: forward + backward of a few blocks, eager against each block's ``compile()``, in one process.

It separates what the compiler does for the model's math from what a runtime adds around it: if the compiled
blocks are no faster here, no ZeRO-3 (or FSDP2) composition can make a compiled step faster on this machine.

    OMP_NUM_THREADS=1 python bench/compile_block.py            # the 100m block (MLP width 4 x 768 + 1 = 3073)
    OMP_NUM_THREADS=1 python bench/compile_block.py --even     # MLP width 3072
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zero_engine.testing.models import Block, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4, help="sequences per step (100m at world 2: 8 / 2 = 4)")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--even", action="store_true", help="MLP width 3072 instead of the test GPT's 3073")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=16384, block_size=64, n_layer=12, n_head=12, n_embd=768,
                    mlp_hidden=3072 if args.even else None)
    blocks = [Block(cfg) for _ in range(args.blocks)]
    x0 = torch.randn(args.rows, cfg.block_size, cfg.n_embd)

    def step() -> float:
        start = time.perf_counter()
        y = x0.clone().requires_grad_()
        for block in blocks:
            y = block(y)
        y.sum().backward()
        return time.perf_counter() - start

    medians = {}
    for mode in ("eager", "compiled"):
        if mode == "compiled":
            for block in blocks:
                block.compile(backend=args.backend)
        first = step()
        step()
        medians[mode] = statistics.median(step() for _ in range(args.steps))
        print(f"{mode:9s} first step {first:7.2f} s   median {medians[mode] * 1e3:8.1f} ms "
              f"({args.blocks} blocks, {args.rows} x {cfg.block_size} tokens, threads {torch.get_num_threads()})")
    print(f"compiled / eager: {medians['compiled'] / medians['eager']:.3f}")


if __name__ == "__main__":
    main()
