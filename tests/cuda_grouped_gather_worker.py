"""One rank of the CUDA check of grouped gathers (launched by tests/test_cuda.py with torchrun; not collected).

    torchrun --standalone --nproc_per_node 1 tests/cuda_grouped_gather_worker.py OUT.json

Trains a GPT whose attention and MLP matrices are gathered straight into their storage (at least
``DIRECT_GATHER_NUMEL`` elements) twice on this rank's CUDA device over NCCL: with the large parameters of a gather
as one group (the engine's choice on NCCL: [Note: large parameters gathered as one group] in zero/gather.py), and
with each one its own all-gather. Writes both runs' losses, whether the final parameters are bitwise equal, and
the all-gathers of a step, to OUT.json.
"""

import json
import sys

import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing.models import GPT, GPTConfig, make_batches

STEPS, MICRO = 3, 2


def train(group_large: bool) -> tuple[list[float], dict[str, torch.Tensor], int, bool]:
    cfg = GPTConfig(n_embd=512, n_head=8, vocab_size=64)  # attn.qkv 786k and mlp.fc 1.05M elements
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": MICRO, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 4 * 10**6, "overlap_comm": True,
                                    "stage3_param_persistence_threshold": 10**4,
                                    "leaf_module": {"classes": ["Block"]}}}
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=config)
    chosen = engine.coordinator.gatherer.group_large  # what the engine decided for this backend
    engine.coordinator.gatherer.group_large = group_large
    losses, gathers = [], 0
    for x, y in make_batches(cfg, STEPS, MICRO):
        engine.reset_comm_stats()
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        gathers = engine.comm_stats()["all_gather"]["calls"]
    params = {sp.fqn: sp.master.detach().clone() for sp in engine.sharded}
    engine.destroy()
    return losses, params, gathers, chosen


def main(out: str) -> None:
    zero_engine.init_distributed(backend="nccl", timeout_s=120)
    grouped, separate = train(True), train(False)
    with open(out, "w") as f:
        json.dump({"losses": [grouped[0], separate[0]], "params_equal": all(
            torch.equal(grouped[1][n], separate[1][n]) for n in grouped[1]), "gathers": [grouped[2], separate[2]],
            "engine_groups_on_nccl": grouped[3], "backend": dist.get_backend()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
