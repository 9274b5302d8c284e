"""DeepSpeed ZeRO with a layer skipped on every rank each step (LayerDrop), against torch on one process.

    PYTHONPATH=<deepspeed 0.19.8> DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python deepspeed_layerdrop.py zeros|skip

"zeros": the reference fills missing gradients with zeros; "skip": torch's own optimizer step, which leaves a
parameter whose .grad is None as it is. Prints each parameter that differs (max abs difference), per stage.
2026-12-07: zeros: none at stages 0 and 1, up to 1.3e-2 at stage 3; skip: up to 1.8e-2 (stages 0, 1), 2.1e-2 (3).
"""
import copy, os, sys
import torch, torch.nn as nn
import torch.multiprocessing as mp

class Drop(nn.Module):
    def __init__(self, vocab=64, dim=16, n=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))
        self.head = nn.Linear(dim, vocab)
        self.skip = set()
    def forward(self, idx):
        h = self.emb(idx)
        for i, l in enumerate(self.layers):
            if i not in self.skip:
                h = h + torch.tanh(l(h))
        return self.head(h).logsumexp(-1).mean()

def worker(rank, stage, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Drop(); ref = copy.deepcopy(model)
    params = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    opt = torch.optim.SGD(model.parameters(), **params)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    ref_opt = torch.optim.SGD(ref.parameters(), **params)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        model.skip = ref.skip = {step % 3}
        idx = torch.randint(0, 64, (2, 5), generator=g)
        ref_opt.zero_grad(set_to_none=True); ref(idx).backward()
        for q in ref.parameters():
            if sys.argv[1] == "zeros":
                q.grad = torch.zeros_like(q) if q.grad is None else q.grad
        ref_opt.step()
        engine.backward(engine(idx)); engine.step()
    from deepspeed.utils import safe_get_full_fp32_param
    diffs = []
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        full = safe_get_full_fp32_param(p) if stage == 3 else (safe_get_full_fp32_param(p) if stage else p.detach())
        diffs.append((n, (full - q.detach()).abs().max().item()))
    if rank == 0:
        print("stage", stage, f"vs torch, missing gradients as {sys.argv[1]}:",
              [(n, f"{d:.1e}") for n, d in diffs if d > 0], flush=True)

if __name__ == "__main__":
    import random
    for stage in (0, 1, 3):
        mp.spawn(worker, args=(stage, random.randint(20000, 40000)), nprocs=2)
