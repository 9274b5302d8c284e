"""On paper (issue 25 item 2): what AutoTP's plan leaves on one rank, for 7B Llama-family shapes at tp 1-8.

    PYTHONPATH=$PWD python bench/autotp_sim.py                 # Llama-2-7B (MHA) and Mistral-7B (GQA 32/8)
    PYTHONPATH=$PWD python bench/autotp_sim.py --world 64 --json out.json

Each model is built by transformers on the meta device and split by ``zero_engine.autotp.apply_autotp`` over a
1-D tp mesh of the fake process group (this process as rank 0; shapes only). "per rank" counts the local elements
of every parameter (``DTensor.to_local()`` for split ones). The plan splits the blocks' Linears and leaves the
embeddings, the norms and the LM head whole, so a rank holds Ψ_whole + Ψ_split / tp, not Ψ / tp; with ZeRO over the
remaining dp = world / tp ranks the model states per rank are 16 (Ψ_whole + Ψ_split / tp) / dp bytes (bf16 params
and grads, fp32 master, momentum and variance), against 16 Ψ / (tp · dp) = 16 Ψ / world if everything were split.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from zero_engine.autotp import apply_autotp  # noqa: E402
from zero_engine.testing import fake_world  # noqa: E402

SHAPES = {
    "Llama-2-7B": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=32)),
    "Mistral-7B": (transformers.MistralConfig, transformers.MistralForCausalLM,
                   dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8)),
}


def per_rank(name: str, tp: int) -> dict:
    config_class, model_class, sizes = SHAPES[name]
    with fake_world(tp):
        with torch.device("meta"):
            model = model_class(config_class(**sizes))
        total = sum(p.numel() for p in model.parameters())
        apply_autotp(model, init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)))
        split = [p for p in model.parameters() if isinstance(p, DTensor)]
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        split_total = sum(p.numel() for p in split)
    return {"model": name, "tp": tp, "params": total, "split": split_total, "whole": total - split_total,
            "per_rank": local, "formula": total - split_total + split_total // tp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=64, help="ranks in all: dp = world / tp")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    print("| model | tp | dp | params per rank (measured) | Ψ_whole + Ψ_split / tp | ÷ Ψ | model states per rank "
          "16 (Ψ_whole + Ψ_split/tp) / dp | 16 Ψ / world |")
    print("|---|---|---|---|---|---|---|---|")
    for name in SHAPES:
        for tp in (1, 2, 4, 8):
            row = per_rank(name, tp)
            dp = args.world // tp
            row.update(dp=dp, states_gb=16 * row["per_rank"] / dp / 1e9, all_split_gb=16 * row["params"] / args.world
                       / 1e9)
            rows.append(row)
            print(f"| {name} | {tp} | {dp} | {row['per_rank'] / 1e9:.3f} B | {row['formula'] / 1e9:.3f} B | "
                  f"{row['per_rank'] / row['params']:.3f} | {row['states_gb']:.2f} GB | {row['all_split_gb']:.2f} GB |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
