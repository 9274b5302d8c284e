"""Expert parallelism (zero_engine/moe.py, zero/expert.py): experts split across ep ranks with all-to-all dispatch,
expert parameters sharded and reduced over their expert-data-parallel group, dense ones over the whole world.

Bodies named ``_*_body`` run on every rank of the simulated world (module level, so the rank pool imports them).

Tolerances. The reference is one process holding every expert (ep 1) on the full batch. Without ZeRO the only
difference is the order of sums (rank-local losses averaged, gradients all-reduced): within 1e-6. Under ZeRO-3 with
AdamW, as in test_mesh.py: losses within 1e-5 relative, parameters within 2e-4 relative L2 (Adam's division by
sqrt(v) amplifies a 1e-7 difference of a near-zero gradient); with SGD, 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero_engine
from zero_engine.moe import MoE, expert_parallel_groups
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPT, GPTConfig, make_batches

TIMEOUT = 120
NUM_EXPERTS = 4


def moe_gpt(groups=None, num_experts: int = NUM_EXPERTS, top_k: int = 2) -> GPT:
    """The test GPT whose blocks' MLPs are MoE layers (same weights whatever the ep size, for a given seed)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=24, n_head=3, vocab_size=61, block_size=8)
    model = GPT(cfg)
    for block in model.blocks:
        block.mlp = MoE(cfg.n_embd, 40, num_experts, top_k=top_k, groups=groups)
    return model


def _expert_slice(name: str, ref: torch.Tensor, groups) -> torch.Tensor:
    if ".experts." not in name:
        return ref
    local = NUM_EXPERTS // groups.ep_size
    return ref[groups.ep_rank * local: (groups.ep_rank + 1) * local]


# ---- the layer alone, without ZeRO ----------------------------------------------------------------------------
def _layer_body(ep_size: int):
    """Plain data parallel by hand: each rank its half of the batch, dense gradients averaged over the world, expert
    gradients summed over the edp group and divided by the world ([Note: gradients of expert weights])."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = expert_parallel_groups(ep_size)
    model, reference = moe_gpt(groups), moe_gpt()
    idx, targets = make_batches(model.cfg, 1, 2 * world, seed=3)[0]
    mine = slice(2 * rank, 2 * rank + 2)
    loss = model(idx[mine], targets[mine])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    for name, p in model.named_parameters():
        if getattr(p, "allreduce", True):
            dist.all_reduce(p.grad)
        else:
            dist.all_reduce(p.grad, group=groups.edp_group)
        p.grad /= world
    ref_loss = reference(idx, targets)
    ref_loss.backward()
    ref = dict(reference.named_parameters())
    errors = {}
    for name, p in model.named_parameters():
        expected = _expert_slice(name, ref[name].grad, groups)
        errors[name] = ((p.grad - expected).abs().max() / expected.abs().max()).item()
    return abs(total.item() / world - ref_loss.item()), errors


def test_moe_layer_at_ep_2_matches_one_process_holding_every_expert():
    for loss_err, errors in run_ranks(_layer_body, 2, 2, timeout=TIMEOUT):
        assert loss_err < 1e-6, loss_err
        assert any("gate" in n for n in errors) and any("experts" in n for n in errors), errors
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-6, (worst, errors[worst])


def test_moe_refuses_an_ep_size_that_does_not_divide_the_experts():
    from zero_engine.moe import ExpertParallelGroups

    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by .*ep_size=4"):
        MoE(8, 16, num_experts=6, groups=ExpertParallelGroups(4, 4, 0))
