"""One rank of the CUDA check of the user-facing paths that meet a parameter's copies on different devices (launched
by tests/test_cuda.py with torchrun; not collected by pytest).

    torchrun --standalone --nproc_per_node 1 tests/cuda_offload_api_worker.py BACKEND MODEL_DIR SAVE_DIR OUT.json

A tiny Llama loaded with ``zero_engine.hf.from_pretrained`` (its shards must land on this rank's device), trained in
bf16 with the fp32 masters and the compute shards on the host (offload_optimizer and offload_param "cpu"), two steps;
then ``safe_get_full_fp32_param`` (the host masters, gathered on the device: NCCL takes no host tensor, even at world
1), an edit in ``GatheredParameters(modifier_rank=0)`` and ``save_pretrained(dtype=torch.float32)``. Rank 0 writes
what tests/test_cuda.py checks to OUT.json.
"""

import json
import sys

import torch
import torch.distributed as dist
import transformers

import zero_engine
import zero_engine.hf as zhf
from zero_engine.utils import safe_get_full_fp32_param
from zero_engine.zero import GatheredParameters
from zero_engine.zero.partition import sharded_param_of


def main(backend: str, model_dir: str, save_dir: str, out: str) -> None:
    zero_engine.init_distributed(backend=backend, timeout_s=120)
    model = zhf.from_pretrained(transformers.AutoModelForCausalLM, model_dir)
    loaded_on = sorted({sharded_param_of(p).shard.device.type for p in model.parameters()})
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    losses = []
    for seed in range(2):
        x = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
        x = x.to(engine.device)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weight = model.lm_head.weight
    with GatheredParameters(weight, modifier_rank=0), torch.no_grad():
        weight[3].fill_(2.0)
    master = safe_get_full_fp32_param(weight)
    zhf.save_pretrained(engine, save_dir, dtype=torch.float32)
    result = {"loaded_on": loaded_on, "engine_device": engine.device.type, "losses": losses,
              "master_row3": master[3].tolist(), "master_row0": master[0].tolist(),
              "masters_on": sorted({sp.master.device.type for sp in engine.sharded if sp.master is not None}),
              "shards_on": sorted({sp.shard.device.type for sp in engine.sharded})}
    engine.destroy()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
