"""One rank of the CUDA parity check (launched by tests/test_cuda.py with torchrun; not collected by pytest).

    torchrun --standalone --nproc_per_node N tests/cuda_parity_worker.py BACKEND PRECISION OUT.json

Trains the test GPT under the engine on this rank's CUDA device and, in the same process, a single-process
reference (the same initial weights, the full batch, torch AdamW, fp32) on the same device; rank 0 writes the worst
relative loss error and the final relative parameter error to OUT.json. The comparison of the two numbers with
their tolerances is the test's (see tests/test_cuda.py).
"""

import copy
import json
import sys

import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing.models import GPT, GPTConfig, make_batches

STEPS, MICRO, LR, CLIP = 5, 2, 1e-3, 1.0


def main(backend: str, precision: str, out: str) -> None:
    zero_engine.init_distributed(backend=backend, timeout_s=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(frozen_param=True, reuse_block=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 700, "stage3_prefetch_bucket_size": 3000,
                                    "stage3_param_persistence_threshold": 40, "overlap_comm": True}}
    if precision != "fp32":
        config[precision] = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}
    engine, *_ = zero_engine.initialize(model=copy.deepcopy(model), config=config)
    device = engine.device
    if device.type != "cuda" or any(not sp.shard.is_cuda for sp in engine.sharded):
        raise AssertionError(f"rank {rank}: engine on {device}, expected this rank's CUDA device")
    reference = model.to(device)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    worst = 0.0
    for x, y in make_batches(cfg, STEPS, world * MICRO):
        x, y = x.to(device), y.to(device)
        ref_opt.zero_grad()
        ref_loss = reference(x, y)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        ref_opt.step()
        loss = engine(x[rank * MICRO: (rank + 1) * MICRO], y[rank * MICRO: (rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        worst = max(worst, abs(mean.item() / world - ref_loss.item()) / abs(ref_loss.item()))
    diff = norm = 0.0
    ref = dict(reference.named_parameters())
    for sp in engine.sharded:
        source = sp.master if sp.master is not None else sp.shard.float()
        full = torch.empty(sp.padded_numel, dtype=source.dtype, device=device)
        dist.all_gather(list(full.chunk(world)), source.contiguous())  # list form: gloo takes CUDA tensors
        diff += (full[: sp.numel].view(sp.shape) - ref[sp.fqn].detach().float()).pow(2).sum().item()
        norm += ref[sp.fqn].detach().float().pow(2).sum().item()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"loss_rel_err": worst, "param_rel_err": (diff / norm) ** 0.5, "world": world,
                       "backend": dist.get_backend(), "device": torch.cuda.get_device_name(device)}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
