"""A small GPT for tests, the demo and benchmarks: no downloads, generated data.

It deliberately carries the shapes that break partitioning code: tied input/output embeddings, a parameter used
directly by the root's forward (positional embedding), odd sizes (not divisible by 2, 3 or 4), LayerNorms,
optionally a frozen parameter, a block reused twice in one forward, and a branch taken only on some steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "make_batches"]


@dataclass
class GPTConfig:
    vocab_size: int = 97
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 3
    n_embd: int = 33
    frozen_param: bool = False  # a LayerNorm-like gain that does not train
    reuse_block: bool = False  # apply the last block twice per forward
    optional_branch: bool = False  # a module used only when forward(..., use_branch=True)
    checkpoint_blocks: bool = False  # torch.utils.checkpoint around each block (use_reentrant=False)
    mlp_hidden: int | None = None  # the MLP's width; None: 4 * n_embd + 1 (odd on purpose; tensor parallelism
    # needs a width the tp size divides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        # Head count taken from qkv's output, not n_head: under tensor parallelism (zero_engine/autotp.py) qkv
        # yields this rank's slice of q, k and v, i.e. n_head / tp whole heads. Counted, not view(-1): an empty
        # batch (0 rows) leaves -1 ambiguous.
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(B, T, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = 4 * cfg.n_embd + 1 if cfg.mlp_hidden is None else cfg.mlp_hidden
        self.fc = nn.Linear(cfg.n_embd, hidden)
        self.proj = nn.Linear(hidden, cfg.n_embd)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Parameter(torch.randn(cfg.block_size, cfg.n_embd) * 0.02)  # used by GPT.forward itself
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        if cfg.frozen_param:
            self.frozen_gain = nn.Parameter(torch.linspace(0.9, 1.1, cfg.n_embd), requires_grad=False)
        if cfg.optional_branch:
            self.branch = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)

    def forward(self, idx, targets=None, use_branch: bool = False):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe[:T]
        blocks = list(self.blocks) + ([self.blocks[-1]] if self.cfg.reuse_block else [])
        for block in blocks:
            if self.cfg.checkpoint_blocks and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if use_branch:
            x = x + self.branch(x)
        x = self.ln_f(x)
        if self.cfg.frozen_param:
            x = x * self.frozen_gain
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_batches(cfg: GPTConfig, n_batches: int, batch_size: int, seed: int = 0):
    """Deterministic (idx, targets) pairs: a noisy shifted-sequence task the model can actually learn."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=g)
        idx = (start + torch.arange(cfg.block_size + 1)) % cfg.vocab_size
        noise = torch.randint(0, cfg.vocab_size, idx.shape, generator=g)
        idx = torch.where(torch.rand(idx.shape, generator=g) < 0.1, noise, idx)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out
