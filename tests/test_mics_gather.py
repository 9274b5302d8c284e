"""MiCS's two-step parameter gather (``mics_hierarchical_params_gather``, zero_engine/zero/mics.py) at world 4.

"Nodes" are simulated through LOCAL_WORLD_SIZE, set in each rank's body (the rank pool sets it to the world size):
2 ranks per node with one shard group of 4 (2 nodes x 2: both steps and the permutation that restores the flat
layout), and 1 rank per node with 2 replicas x shard groups of 2 (step 1 alone, replicas as MiCS has them).

Tolerances. The two-step gather moves values and combines none, so against the same engine without the key the
losses and every parameter are bitwise equal. Against one process the usual MiCS tolerances apply (test_mesh.py):
losses within 1e-5 relative, parameters within 1e-5 relative L2 (SGD).
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

import zero_engine
from zero_engine.config import ConfigError, load_config
from zero_engine.testing import run_ranks
from zero_engine.testing.loop import train_global_batch
from zero_engine.testing.models import GPT, GPTConfig, make_batches
from zero_engine.testing.shards import whole_from_shards

TIMEOUT = 120
WORLD = 4
KEY = "zero_optimization.mics_hierarchical_params_gather"


def ds_config(stage, k, two_step, seq=False, gas=2, micro=2, lr=0.05, **zero):
    zero_section = {"stage": stage, "stage3_allgather_sequential": seq, "reduce_bucket_size": 700,
                    "stage3_prefetch_bucket_size": 3000, "stage3_param_persistence_threshold": 40,
                    "stage3_max_reuse_distance": 2000, "overlap_comm": True, "mics_shard_size": k,
                    "mics_hierarchical_params_gather": two_step, **zero}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
            "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}}, "zero_optimization": zero_section}


@contextlib.contextmanager
def ranks_per_node(n: int):
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(n)
    try:
        yield
    finally:
        if before is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before




def _train(config, model, batches):
    engine, *_ = zero_engine.initialize(model=model, config=config)
    engine.reset_comm_stats()
    gas, micro = config["gradient_accumulation_steps"], config["train_micro_batch_size_per_gpu"]
    losses = [train_global_batch(engine, x, y, gas, micro) for x, y in batches]
    result = losses, whole_from_shards(engine), engine.comm_stats(by_group=True), engine.mesh.describe()
    engine.destroy()
    return result


# ---- bitwise equal to the flat gather, and to one process within MiCS's tolerance ------------------------------------
def _parity_body(stage, seq, k, node, extra):
    cfg = GPTConfig(frozen_param=True, reuse_block=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    batches = list(make_batches(cfg, 2, WORLD * 2 * 2))
    with ranks_per_node(node):
        flat = _train(ds_config(stage, k, False, seq, **extra), copy.deepcopy(model), batches)
        two_step = _train(ds_config(stage, k, True, seq, **extra), model, batches)
    params = [p for p in reference.parameters() if p.requires_grad]
    ref_opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    ref_losses = []
    for x, y in batches:
        ref_opt.zero_grad()
        loss = reference(x, y)
        loss.backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        ref_opt.step()
        ref_losses.append(loss.item())
    ref = dict(reference.named_parameters())
    ours = two_step[1]
    diff = sum((ours[n] - ref[n].detach()).pow(2).sum() for n in ours).sqrt()
    norm = sum(ref[n].detach().pow(2).sum() for n in ours).sqrt()
    bitwise = flat[0] == two_step[0] and all(torch.equal(flat[1][n], ours[n]) for n in ours)
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(two_step[0], ref_losses))
    return bitwise, worst_loss, (diff / norm).item(), flat[2], two_step[2], two_step[3]


def _gathered_bytes(stats: dict, groups) -> int:
    return sum(stats[g]["all_gather"]["bytes"] for g in groups if g in stats)


CASES = [  # stage, sequential, mics_shard_size, ranks per node, more zero_optimization keys
    (3, False, 4, 2, {}),  # one shard group over 2 nodes x 2 ranks: both steps
    (3, True, 2, 1, {}),  # 2 replicas x shard groups of 2 nodes x 1 rank: step 1 alone
    (2, False, 4, 2, {}),  # stages 1-2: the refresh of the parameters after each step
    (3, False, 4, 2, {"zero_quantized_weights": True}),  # qwZ's int8 gathers in two steps too
]


@pytest.mark.parametrize("stage,seq,k,node,extra", CASES)
def test_two_step_gather_is_bitwise_the_flat_gather(stage, seq, k, node, extra):
    for bitwise, loss_err, param_err, flat, two_step, described in run_ranks(
            _parity_body, WORLD, stage, seq, k, node, extra, timeout=TIMEOUT):
        assert bitwise, "the two-step gather changed a loss or a parameter"
        if not extra:  # qwZ's int8 weights: within its own tolerance, tested in test_zeropp_quant.py
            assert loss_err < 1e-5 and param_err < 1e-5, (loss_err, param_err)
        assert f"two-step gather over {k // node} nodes x {node}" in described
        # Collectives per group: the flat parameter gathers moved, one for one, to the two sub-groups.
        assert set(two_step) >= {"gather_inter", "gather_intra"}
        inter, intra = two_step["gather_inter"]["all_gather"], two_step["gather_intra"]["all_gather"]
        others = [g for g in two_step if not g.startswith("gather_")]
        moved = _gathered_bytes(flat, flat) - _gathered_bytes(two_step, others)  # what the flat gathers carried
        assert moved > 0
        assert inter["bytes"] * node == moved  # what crosses nodes: 1/node of the flat gather's output
        if node > 1:
            assert intra["bytes"] == moved and intra["calls"] == inter["calls"]
        else:
            assert intra["calls"] == 0  # one rank per node: nothing to gather within it


# ---- bad input, and a shard group within one node --------------------------------------------------------------------
def test_config_errors_name_the_key():
    base = {"train_micro_batch_size_per_gpu": 1}
    cases = [({"stage": 3, "mics_hierarchical_params_gather": True}, "true needs zero_optimization.mics_shard_size"),
             ({"stage": 3, "mics_shard_size": 4, "zero_hpz_partition_size": 2, "mics_hierarchical_params_gather": True},
              "true together with zero_hpz_partition_size is not supported yet")]
    for zero, message in cases:
        with pytest.raises(ConfigError, match=f"^{KEY}: ") as caught:
            load_config({**base, "zero_optimization": zero}, world_size=WORLD)
        assert message in str(caught.value), str(caught.value)


def _node_body():
    found = []
    for node, k in (("3", 4), ("", 4), ("4", 2)):
        with ranks_per_node(1):
            if node:
                os.environ["LOCAL_WORLD_SIZE"] = node
            else:
                del os.environ["LOCAL_WORLD_SIZE"]
            try:
                engine, *_ = zero_engine.initialize(model=torch.nn.Linear(4, 4), config=ds_config(3, k, True, gas=1))
            except ConfigError as error:
                found.append(str(error))
            else:
                found.append((engine.mics_gather is None, sorted(engine.communicators()), engine.mesh.describe()))
                engine.destroy()
    return found


def test_node_size_errors_and_a_group_within_a_node():
    for uneven, unset, within in run_ranks(_node_body, WORLD, timeout=TIMEOUT):
        assert uneven.startswith(f"{KEY}: true with mics_shard_size 4 and 3 ranks per node (LOCAL_WORLD_SIZE): a shard "
                                 "group must span whole nodes"), uneven
        assert unset.startswith(f"{KEY}: true needs the ranks per node, from LOCAL_WORLD_SIZE"), unset
        assert within[0] and within[1] == ["dp_replicate", "dp_shard", "world"], within  # one collective, logged
