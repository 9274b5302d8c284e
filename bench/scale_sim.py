"""Scale simulation: ZeRO-3 partitioning of a 7B-parameter model at 8 to 1024 ranks, without the ranks or the memory.

    python bench/scale_sim.py                          # LLaMA-7B shape, world sizes 8, 16, ..., 1024
    python bench/scale_sim.py --worlds 8 1000 --json out.json

For each world size, in this one process, on torch's fake process group (``zero_engine.testing.fake_world``) and
with the model built on the meta device (shapes only, no bytes):

1. *Partitioning.* A ``ShardedParam`` for every parameter, as rank 0 and as the last rank (the one that holds the
   padding), checked against the rule: shard = ceil(numel / N) elements on every rank, rank r owns
   [r * shard, (r + 1) * shard) of the flattened parameter, the ranks' slices tile it exactly and only the tail is
   padding.
2. *A training step.* ``zero_engine.initialize`` and one forward/backward/step of the real engine on meta tensors:
   the gathers, reduce-scatters and the optimizer run their real code paths on shapes, so ``memory_stats()``
   reports what a rank of this world would hold (shards, gradient shards, Adam moments, gathered peak).
3. *The estimator* (``zero_engine.memory.estimator``) for the same model and config must agree: model-state
   categories exactly, the measured gathered peak between the estimator's minimum and its peak.

This is how we reason about sizes we cannot run here: it checks arithmetic and call sequences at scale, never
numerics (the fake group moves no data). The step runs in fp32 (the engine's only precision today); the 16-bit
rows come from the estimator alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

import zero_engine  # noqa: E402
from zero_engine.memory.estimator import (  # noqa: E402
    PRECISIONS,
    GatherPolicy,
    ModelCounts,
    count_model_params,
    estimate_rank_memory,
    format_bytes,
)
from zero_engine.testing import fake_world  # noqa: E402
from zero_engine.zero.partition import ShardedParam  # noqa: E402

log = logging.getLogger("zero_engine.bench.scale_sim")

DEFAULT_WORLDS = tuple(2**k for k in range(3, 11))  # 8 .. 1024
# The engine's defaults are DeepSpeed's; a persistence threshold of 1e5 keeps the 4096-element norms whole.
DEFAULT_ZERO = {"stage": 3}
MODEL_STATE_KEYS = ("params_sharded", "master_params", "grads", "optimizer_states")


# ---- a LLaMA-shaped model (shapes as in LLaMA-7B; enough forward to drive the engine's hooks) -----------------------
@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    tie_embeddings: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        h = shape.hidden_size
        self.num_heads = shape.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(h, h, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (proj(x).view(b, t, self.num_heads, c // self.num_heads).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # rotary embeddings change no shapes
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        h, m = shape.hidden_size, shape.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, m, bias=False), nn.Linear(h, m, bias=False)
        self.down_proj = nn.Linear(m, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size)
        self.mlp = SwiGLU(shape)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaShaped(nn.Module):
    def __init__(self, shape: LlamaShape = LlamaShape()):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def llama_7b_on_meta() -> nn.Module:
    """LLaMA-7B's module tree (6,738,415,616 parameters) on the meta device: no memory is allocated."""
    with torch.device("meta"):
        return LlamaShaped(LlamaShape())


# ---- the simulation ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorldResult:
    world_size: int
    total_params: int
    padding_numel: int  # over all ranks: sum(ceil(numel / N) * N - numel)
    padding_percent: float  # of the unpadded parameters: how much every sharded category exceeds Psi/N
    per_rank_shard_numel: int  # elements of parameter shards on every rank (the same on every rank)
    measured: dict  # memory_stats() of the simulated rank after one step (bytes)
    estimated: dict  # the estimator's RankMemory for stage 3, fp32 (bytes)
    estimated_bf16: dict
    seconds: float


class SimulationMismatch(AssertionError):
    """The partitioning, the engine's accounting and the estimator disagree (a broken invariant, not user error)."""


def check_partitioning(model: nn.Module, world: int) -> tuple[int, int]:
    """Build ShardedParam metadata for every parameter as rank 0 and as the last rank; check the partition rule.

    Returns (per-rank shard elements, padding elements over all ranks). Raises ``SimulationMismatch``.
    """
    shard_total = padding_total = 0
    for index, (name, param) in enumerate(model.named_parameters()):
        numel = param.numel()
        first = ShardedParam(param, name, index, 0, world)
        last = ShardedParam(param, name, index, world - 1, world)
        expected = max(1, math.ceil(numel / world))  # the rule, restated here rather than imported
        for sp in (first, last):
            if sp.shard.numel() != expected or sp.shard_numel != expected or sp.padded_numel != expected * world:
                raise SimulationMismatch(f"{name}: rank {sp.rank} of {world} holds a shard of {sp.shard.numel()} "
                                         f"elements (metadata {sp.shard_numel}), expected ceil({numel}/{world}) = "
                                         f"{expected}")
        if first.local_slice().start != 0:
            raise SimulationMismatch(f"{name}: rank 0's slice starts at {first.local_slice().start}, not 0")
        # The ranks' slices tile [0, numel) in order, so the last rank owns what is left after the others (possibly
        # nothing) and all padding sits at the end.
        tail = last.local_slice()
        tail_start = min((world - 1) * expected, numel)
        if (tail.start, tail.stop) != (tail_start, numel):
            raise SimulationMismatch(f"{name}: the last rank's slice is [{tail.start}, {tail.stop}) of {numel} "
                                     f"elements over {world} ranks of {expected}; expected [{tail_start}, {numel})")
        padding = expected * world - numel
        if not 0 <= padding < world:
            raise SimulationMismatch(f"{name}: {padding} padding elements at world {world}; the ceiling rule pads "
                                     "fewer than one element per rank")
        shard_total += expected
        padding_total += padding
    return shard_total, padding_total


def run_engine_step(model_factory: Callable[[], nn.Module], world: int, zero: dict, seq_len: int) -> dict:
    """One training step of the real engine on meta tensors in a fake world; its memory_stats() after the step."""
    model = model_factory()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
              "zero_optimization": dict(zero)}
    with fake_world(world):
        engine, *_ = zero_engine.initialize(model=model, config=config)
        vocab = model_vocab(model)
        idx = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
        for _ in range(2):  # the first step records the module trace; the second prefetches along it
            engine.reset_memory_peaks()
            loss = engine(idx % vocab, idx)
            engine.backward(loss)
            engine.step()
        stats = engine.memory_stats()
        stats["grads"] = stats["grads_peak"]  # gradient shards live within a window (freed by the step): their peak
        return stats


def model_vocab(model: nn.Module) -> int:
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    raise ValueError(f"{type(model).__name__}: no nn.Embedding, cannot make token inputs for the simulated step")


def simulate_world(model_factory: Callable[[], nn.Module], world: int, zero: dict | None = None,
                   seq_len: int = 8, step: bool = True) -> WorldResult:
    """Partition, (optionally) step and estimate ``model_factory()`` at ``world`` ranks; check that they agree."""
    zero = dict(DEFAULT_ZERO if zero is None else zero)
    started = time.perf_counter()
    model = model_factory()
    counts: ModelCounts = count_model_params(model)
    shard_numel, padding = check_partitioning(model, world)
    from zero_engine.config import load_config

    zero_config = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero},
                              world_size=world).zero_optimization
    policy = GatherPolicy.from_zero_config(zero_config)
    est = estimate_rank_memory(counts, world, 3, PRECISIONS["fp32"], policy)
    est16 = estimate_rank_memory(counts, world, 3, PRECISIONS["bf16"], policy)
    if est.params_sharded != shard_numel * 4 or est.padding_numel != padding:
        raise SimulationMismatch(f"world {world}: estimator says {est.params_sharded} shard bytes and {est.padding_numel} "
                                 f"padding elements; partitioning has {shard_numel * 4} and {padding}")
    measured = run_engine_step(model_factory, world, zero, seq_len) if step else {}
    if measured:
        for key in MODEL_STATE_KEYS:
            if measured[key] != getattr(est, key):
                raise SimulationMismatch(f"world {world}: {key} is {measured[key]} bytes in the engine, "
                                         f"{getattr(est, key)} in the estimator")
        if not est.params_gathered_min <= measured["params_gathered_peak"] <= est.params_gathered_peak:
            raise SimulationMismatch(
                f"world {world}: gathered peak {measured['params_gathered_peak']} bytes is outside the estimator's "
                f"[{est.params_gathered_min}, {est.params_gathered_peak}]")
    measured = {k: v for k, v in measured.items() if not k.startswith("rss")}  # this process's RSS: meaningless
    return WorldResult(world, counts.total_params, padding, 100.0 * padding / counts.total_params, shard_numel,
                       measured, est.as_dict(), est16.as_dict(), time.perf_counter() - started)


def simulate(model_factory: Callable[[], nn.Module] = llama_7b_on_meta, worlds=DEFAULT_WORLDS,
             zero: dict | None = None, step: bool = True) -> list[WorldResult]:
    return [simulate_world(model_factory, w, zero, step=step) for w in worlds]


# ---- report -----------------------------------------------------------------------------------------------------------
def table(results: list[WorldResult]) -> str:
    """Markdown: world size -> per-rank bytes per category (fp32 measured = estimated), padding, bf16 estimate."""
    head = ("| world | params (shard) | grads | optimizer | model states | ÷ 16Ψ/N | gathered peak (step) "
            "| gathered peak (estimate) | padding (elements) | padding | bf16 model states (est.) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        e = r.estimated
        states = e["model_states"]
        ideal = 16 * r.total_params / r.world_size
        gathered = format_bytes(r.measured["params_gathered_peak"]) if r.measured else "-"
        lines.append(f"| {r.world_size} | {format_bytes(e['params_sharded'])} | {format_bytes(e['grads'])} | "
                     f"{format_bytes(e['optimizer_states'])} | {format_bytes(states)} | {states / ideal:.4f} | "
                     f"{gathered} | {format_bytes(e['params_gathered_peak'])} | {r.padding_numel:,} | "
                     f"{r.padding_percent:.4f}% | "
                     f"{format_bytes(r.estimated_bf16['model_states'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULT_WORLDS), help="world sizes")
    parser.add_argument("--no-step", action="store_true", help="partition and estimate only; skip the engine step")
    parser.add_argument("--zero", type=json.loads, default=DEFAULT_ZERO,
                        help='the zero_optimization section as JSON (default: {"stage": 3}, DeepSpeed\'s defaults)')
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model = llama_7b_on_meta()
    total = sum(p.numel() for p in model.parameters())
    results = simulate(llama_7b_on_meta, args.worlds, zero=args.zero, step=not args.no_step)
    print(f"LLaMA-7B shape ({total:,} parameters), ZeRO-3 fp32 AdamW, zero_optimization {json.dumps(args.zero)}: "
          "per-rank bytes. Model states measured on the fake process group equal the estimate exactly at every "
          "world size; the measured gathered peak lies between the estimator's minimum and peak.\n")
    print(table(results))
    print(f"\n{sum(r.seconds for r in results):.1f} s for {len(results)} world sizes")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
