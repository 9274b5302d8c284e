"""Bytes of parameter storage a rank holds for a frozen DPO reference model (a Llama of about 60M parameters):
whole, as Accelerate's prepare_model leaves it, and partitioned by the engine ZeroTrainerMixin now builds for it
(zero_engine/hf/_reference_models.py: stage 3, no optimizer). Storage sizes as the allocator sees them.

    PYTHONPATH=$PWD python bench/results/trl_reference_1208/reference_bytes.py
"""

import torch
import transformers

import zero_engine
from zero_engine.testing import run_ranks


def storage_bytes(tensors) -> int:
    """Each distinct storage once (the shards are views into flat buffers)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def body():
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).requires_grad_(False)
    whole = storage_bytes(model.parameters())
    engine, *_ = zero_engine.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    held = storage_bytes([sp.shard for sp in engine.sharded] + list(model.parameters()))
    with torch.no_grad():
        model(torch.randint(0, 32000, (1, 8)))  # a forward gathers and releases
    after = storage_bytes([sp.shard for sp in engine.sharded] + list(model.parameters()))
    engine.destroy()
    return whole, held, after


if __name__ == "__main__":
    for world in (2, 4):
        results = run_ranks(body, world, timeout=300)
        whole, held, after = results[0]
        print(f"world {world}: whole {whole / 2**20:.1f} MiB per rank; partitioned {held / 2**20:.1f} MiB "
              f"({held / whole:.3f}); after a forward {after / 2**20:.1f} MiB; "
              f"ranks {[round(r[1] / 2**20, 1) for r in results]}")
