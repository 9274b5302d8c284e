"""ZeRO-3 with frozen parameters (a PEFT-style base model) under torch's non-reentrant activation checkpointing.

The recomputation in backward saves a frozen weight as the Parameter itself, not an alias; it must still be gathered
when backward reads it (see [Note: frozen parameters in recomputation] in zero_engine/zero/hooks.py), and released
again once its module's backward is done, also when torch stops the recomputation inside a module's forward (see
[Note: recomputation stopped early]).

Tolerances, as in test_zero3: each rank sees a different micro-batch and gradients are averaged by reduce-scatter,
so sums run in another order than in the single-process full-batch reference: losses and trainable parameters agree
to 1e-5 relative (SGD: the update is linear in the gradient). Frozen parameters never change: bitwise equal.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint

import zero_engine
from test_zero3 import full_params
from zero_engine.testing import run_ranks
from zero_engine.zero import external
from zero_engine.zero.partition import ParamStatus

TIMEOUT = 120
DIM, BLOCKS, MICRO, GAS, STEPS = 16, 3, 2, 2, 3


class Block(nn.Module):
    """A frozen LayerNorm and Linears (the base model) and a trainable adapter Linear (LoRA-like). The block's last
    saved tensor is fc_out's: torch stops its recomputation inside fc_out's forward."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc_in = nn.Linear(DIM, DIM)
        self.adapter = nn.Linear(DIM, DIM, bias=False)
        self.fc_out = nn.Linear(DIM, DIM)

    def forward(self, x):
        h = self.ln(x)
        return x + self.fc_out(torch.tanh(self.fc_in(h) + self.adapter(h)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, DIM)  # frozen: the first block's input needs no gradient
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)
        self.on_block_input = None  # called with (block index, block input) in forward

    def forward(self, x, y):
        x = self.embed(x)
        for i, block in enumerate(self.blocks):
            if self.on_block_input is not None:
                self.on_block_input(i, x)
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()


def make_model() -> Net:
    torch.manual_seed(0)
    model = Net()
    for name, p in model.named_parameters():
        p.requires_grad_(".adapter." in name or name.startswith("head."))
    return model


def config(**zero) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


CONFIGS = {"per_module": {}, "sequential": {"stage3_allgather_sequential": True},
           "leaf_blocks": {"leaf_module": {"classes": ["Block"]}}}


def _still_gathered(shards) -> list[str]:
    """Names of parameters gathered, or with storage left behind."""
    return [sp.fqn for sp in shards if sp.status is not ParamStatus.NOT_AVAILABLE or sp.param.numel() != 0
            or sp.full.untyped_storage().size() != 0]


def _parity_body(zero: dict):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    engine, *_ = zero_engine.initialize(model=model, config=config(**zero))
    by_param = {id(sp.param): sp for sp in engine.sharded}
    in_backward: list[str] = []  # a block's parameters still gathered once its backward is done

    def on_block_input(i, x):
        if x.requires_grad:  # a hook on a block's input fires after the block's backward (not the first block's)
            shards = [by_param[id(p)] for p in model.blocks[i].parameters()]
            x.register_hook(lambda _grad: in_backward.extend(_still_gathered(shards)))

    model.on_block_input = on_block_input
    g = torch.Generator().manual_seed(1)
    worst_loss, after_backward = 0.0, []
    for _ in range(STEPS):  # the first step records the trace, the next ones prefetch along it
        x, y = torch.randn(world * MICRO * GAS, 8, generator=g), torch.randn(world * MICRO * GAS, generator=g)
        ref_opt.zero_grad()
        ref_loss = reference(x, y)
        ref_loss.backward()
        ref_opt.step()
        total = torch.zeros(())
        for m in range(GAS):
            lo = (m * world + rank) * MICRO
            loss = engine(x[lo: lo + MICRO], y[lo: lo + MICRO])
            engine.backward(loss)
            after_backward += _still_gathered(engine.sharded)
            after_backward += [f"forward of {type(m).__name__} left open" for _, m, *_ in external._IN_FORWARD]
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        worst_loss = max(worst_loss, abs(total.item() / (world * GAS) - ref_loss.item()) / abs(ref_loss.item()))
    ours, ref = full_params(engine), dict(reference.named_parameters())
    trainable = [n for n, p in ref.items() if p.requires_grad]
    diff = sum((ours[n] - ref[n].detach()).pow(2).sum() for n in trainable).sqrt()
    norm = sum(ref[n].detach().pow(2).sum() for n in trainable).sqrt()
    frozen_unchanged = all(torch.equal(ours[n], ref[n].detach()) for n in ref if n not in trainable)
    return worst_loss, (diff / norm).item(), frozen_unchanged, sorted(set(in_backward)), sorted(set(after_backward))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_frozen_params_with_nonreentrant_checkpointing(name):
    """Parity with single-process torch; every parameter (frozen ones included) released once its block's backward
    is done (not kept to the end of backward), and none left gathered, nor any forward scope left open, after
    backward."""
    for loss_err, param_err, frozen_unchanged, in_backward, after_backward in run_ranks(
            _parity_body, 2, CONFIGS[name], timeout=TIMEOUT):
        assert loss_err < 1e-5 and param_err < 1e-5, (loss_err, param_err)
        assert frozen_unchanged
        assert in_backward == [], f"still gathered after their block's backward: {in_backward}"
        assert after_backward == [], f"still gathered after backward: {after_backward}"
