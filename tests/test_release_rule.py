"""The one rule that decides whether the coordinator may free a gathered parameter (ShardedParam.releasable).

A parameter is released only when it is available, not persistent, used by no running module and held by no
``GatheredParameters`` block; every release site (end of step, a module's release, making room under
``stage3_max_live_parameters``, a block's exit) asks that one predicate. Parity against one process: every rank
trains on the same micro-batch (SGD, fp32), so at world 2 the averaged gradient is the reference's exactly and losses
and parameters must be bitwise equal.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import zero_engine
from zero_engine.testing import run_ranks
from zero_engine.zero import GatheredParameters
from zero_engine.zero.partition import ParamStatus

from test_zero3 import full_params

TIMEOUT = 120


class _HoldsTiedWeight(nn.Module):
    """Holds the tied embedding weight with GatheredParameters (DeepSpeed's idiom) while its inner Linear is
    fetched, and reads it inside the block after that fetch."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.tied = [embedding.weight]  # a plain list: not read through a module attribute (external.py)
        self.inner = nn.Linear(16, 40)
        self.out = nn.Linear(40, 16)

    def forward(self, h):
        w = self.tied[0]
        with GatheredParameters(w):
            h = self.out(torch.tanh(self.inner(h)))  # fetching inner needs room under the live budget
            with torch.no_grad():
                scale = 1.0 + w.float().square().mean()  # the held weight must still be whole here
        return h * scale


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(120, 16)  # 1920 elements: with inner's 680, more than max_live_parameters
        self.mid = _HoldsTiedWeight(self.emb)
        self.head = nn.Linear(16, 120, bias=False)
        self.head.weight = self.emb.weight  # tied: kept between its uses within the forward

    def forward(self, idx):
        return self.head(self.mid(self.emb(idx))).logsumexp(-1).mean()


def _held_tied_weight_body():
    torch.manual_seed(0)
    model = _TiedLM()
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_live_parameters": 2500, "stage3_prefetch_bucket_size": 100}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(3):
        idx = torch.randint(0, 120, (2, 5), generator=g)
        ref_opt.zero_grad()
        ref_loss = reference(idx)
        ref_loss.backward()
        ref_opt.step()
        loss = engine(idx)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    leaks = [sp.fqn for sp in engine.sharded if sp.status is not ParamStatus.NOT_AVAILABLE]
    ours, ref = full_params(engine), dict(reference.named_parameters())
    same = all(torch.equal(v, ref[n].detach()) for n, v in ours.items())
    return losses, ref_losses, same, leaks


def test_parameter_held_by_gathered_parameters_is_not_freed_to_make_room():
    for losses, ref_losses, same, leaks in run_ranks(_held_tied_weight_body, 2, timeout=TIMEOUT):
        assert losses == ref_losses, (losses, ref_losses)  # bitwise at world 2
        assert same, "parameters differ from the one-process run"
        assert not leaks, f"still gathered after the step: {leaks}"
