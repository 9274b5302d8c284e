"""Does DeepSpeed keep an in-place edit of a parameter made after initialize() (nn.init.constant_), per stage?

    PYTHONPATH=<deepspeed 0.19.8> DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python direct_edit.py

2026-12-07 (fp32, 2 CPU ranks, a step at lr 0 after the edit): stage 0 keeps it; stages 1 and 2 write the fp32
masters back over it (zero_engine: the same at stages 0-2; refused by name at 3; docs/deepspeed_compat.md).
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
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    with torch.no_grad():
        nn.init.constant_(model[1].weight, 0.5)
    idx = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(idx).logsumexp(-1).mean()); engine.step()
    if rank == 0:
        print("DS stage", stage, "edit kept after a step:", bool((model[1].weight == 0.5).all()), flush=True)

if __name__ == "__main__":
    for stage in (0, 1, 2):
        mp.spawn(worker, args=(stage, random.randint(20000, 40000)), nprocs=2)
