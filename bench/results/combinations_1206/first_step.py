"""The first (recording) step's time and the next three, demo model (examples/configs/zero3.json), world 2.

Run from the root of the tree to time: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python first_step.py 1 (prints ms per step)."""
import json, sys, time
import torch, torch.distributed as dist
import zero_engine
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPT, GPTConfig, make_batches

def body():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=8, n_embd=256)
    config = json.load(open("examples/configs/zero3.json"))
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=config)
    batches = make_batches(cfg, 4, 8, seed=dist.get_rank())
    times = []
    for x, y in batches:
        dist.barrier()
        t = time.perf_counter()
        engine.backward(engine(x, y)); engine.step()
        times.append(time.perf_counter() - t)
    engine.destroy()
    return times

if __name__ == "__main__":
    for _ in range(int(sys.argv[1])):
        r = run_ranks(body, 2, timeout=300)
        print(" ".join(f"{max(a, b) * 1000:.0f}" for a, b in zip(*r)))
