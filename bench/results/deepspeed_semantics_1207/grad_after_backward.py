"""What DeepSpeed leaves in param.grad after backward() (a different micro-batch on each of 2 ranks), per stage.

    PYTHONPATH=<deepspeed 0.19.8> DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python grad_after_backward.py

2026-12-07: stage 0: the averaged gradient in param.grad; stages 1-3: None; safe_get_full_grad: the average at
every stage (zero_engine: the rank's own gradient at stages 0-1, None at 2-3; docs/deepspeed_compat.md).
"""
import os, random
import torch, torch.nn as nn
import torch.multiprocessing as mp

def worker(rank, stage, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage}}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    idx = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1 + rank))
    engine.backward(engine(idx).logsumexp(-1).mean())
    desc = [None if p.grad is None else round(float(p.grad.norm()), 6) for p in model.parameters()]
    from deepspeed.utils import safe_get_full_grad
    full = [None if safe_get_full_grad(p) is None else round(float(safe_get_full_grad(p).norm()), 6)
            for p in model.parameters()]
    print("DS stage", stage, "rank", rank, "p.grad norms", desc, "safe_get_full_grad", full, flush=True)

if __name__ == "__main__":
    for stage in (0, 1, 2, 3):
        mp.spawn(worker, args=(stage, random.randint(20000, 40000)), nprocs=2)
