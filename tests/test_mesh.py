"""ZeRO across a hierarchy (zero_engine/mesh.py): MiCS / HSDP at world 4 as 2 replicas x shard groups of 2.

Bodies named ``_*_body`` run on every rank of the simulated world (module level, so the rank pool imports them).

Tolerances. Parity is against one process training on the full batch, as in test_zero3.py: every rank sees its own
micro-batch and gradients are averaged by a reduce-scatter over the shard group, then an all-reduce over the
replicas, so sums run in another order than the reference: losses within 1e-5 relative, parameters within 1e-5
relative L2 with SGD (linear in the gradient) and 2e-4 with AdamW (its division by sqrt(v) amplifies a 1e-7
difference of a near-zero gradient). Checkpoint round trips are bitwise: they move values, they compute nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero_engine
from zero_engine.config import ConfigError, load_config
from zero_engine.testing import run_ranks
from zero_engine.testing.loop import train_global_batch
from zero_engine.testing.models import GPT, GPTConfig, make_batches
from zero_engine.testing.shards import gathered_params, whole_from_shards

TIMEOUT = 120
WORLD = 4
K = 2  # ranks per shard group: world 4 = dp_replicate 2 x dp_shard 2


def ds_config(stage, seq=False, gas=2, micro=2, optimizer="AdamW", lr=1e-3, mics=K, bf16=False, **zero):
    zero_section = {"stage": stage, "stage3_allgather_sequential": seq, "reduce_bucket_size": 700,
                    "stage3_prefetch_bucket_size": 3000, "stage3_param_persistence_threshold": 40,
                    "stage3_max_reuse_distance": 2000, "overlap_comm": True, "mics_shard_size": mics}
    zero_section.update(zero)
    params = {"lr": lr, "weight_decay": 0.1} if optimizer == "AdamW" else {"lr": lr, "momentum": 0.9}
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
              "optimizer": {"type": optimizer, "params": params}, "zero_optimization": zero_section}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


shard_group_gather = whole_from_shards  # every parameter's whole value, gathered by the test over the shard group


class DataParallelOnly:
    """DeepSpeed's mpu as Megatron-style code passes it: model-parallel size 1, data parallel over every rank."""

    def get_data_parallel_group(self):
        return dist.group.WORLD

    def get_data_parallel_world_size(self):
        return dist.get_world_size()

    def get_data_parallel_rank(self):
        return dist.get_rank()

    def get_model_parallel_world_size(self):
        return 1


class TensorParallel2(DataParallelOnly):
    def get_model_parallel_world_size(self):
        return 2


def _init_kwargs(how: str) -> dict:
    if how == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        return {"mesh": init_device_mesh("cpu", (WORLD // K, K), mesh_dim_names=("dp_replicate", "dp_shard"))}
    if how == "mpu":
        return {"mpu": DataParallelOnly()}
    return {}


# ---- parity with one process ----------------------------------------------------------------------------------------
def _parity_body(stage, seq, optimizer, how):
    world = dist.get_world_size()
    cfg = GPTConfig(frozen_param=True, reuse_block=True)
    lr = 1e-3 if optimizer == "AdamW" else 0.05
    config = ds_config(stage, seq, optimizer=optimizer, lr=lr, mics=K if how == "config" else -1)
    torch.manual_seed(0)
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    engine, *_ = zero_engine.initialize(model=model, config=config, **_init_kwargs(how))
    params = [p for p in reference.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1) if optimizer == "AdamW" else \
        torch.optim.SGD(params, lr=lr, momentum=0.9)
    gas, micro = config["gradient_accumulation_steps"], config["train_micro_batch_size_per_gpu"]
    worst_loss, norms = 0.0, []
    for x, y in make_batches(cfg, 4, world * micro * gas):
        ref_opt.zero_grad()
        ref_loss = reference(x, y)
        ref_loss.backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ref_norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        ref_opt.step()
        ours = train_global_batch(engine, x, y, gas, micro)
        worst_loss = max(worst_loss, abs(ours - ref_loss.item()) / abs(ref_loss.item()))
        norms.append(abs(engine.get_global_grad_norm() - ref_norm) / ref_norm)  # replicas not counted twice
    ours = shard_group_gather(engine, lambda sp: sp.shard)
    ref = dict(reference.named_parameters())
    diff = sum((ours[n] - ref[n].detach()).pow(2).sum() for n in ours).sqrt()
    norm = sum(ref[n].detach().pow(2).sum() for n in ours).sqrt()
    shapes = (engine.mesh.shard_size, engine.mesh.replicate_size,
              all(sp.shard_numel == -(-sp.numel // engine.mesh.shard_size) for sp in engine.sharded))
    engine.destroy()
    return worst_loss, (diff / norm).item(), max(norms), shapes


PARITY = [(1, False, "AdamW", "config"), (2, False, "SGD", "config"), (3, False, "AdamW", "config"),
          (3, True, "SGD", "config"), (3, False, "SGD", "mesh"), (2, False, "AdamW", "mpu")]


@pytest.mark.parametrize("stage,seq,optimizer,how", PARITY)
def test_parity_with_one_process(stage, seq, optimizer, how):
    tolerance = 2e-4 if optimizer == "AdamW" else 1e-5
    for loss_err, param_err, norm_err, (shard, replicas, one_over_k) in run_ranks(
            _parity_body, WORLD, stage, seq, optimizer, how, timeout=TIMEOUT):
        assert loss_err < 1e-5 and param_err < tolerance and norm_err < 1e-5, (loss_err, param_err, norm_err)
        assert (shard, replicas) == ((K, WORLD // K) if how != "mpu" else (WORLD, 1))
        assert one_over_k  # each parameter cut into shard_size pieces, not world pieces


def _zero_init_body(precision):
    config = ds_config(3, bf16=precision == "bf16")
    cfg = GPTConfig(frozen_param=True)
    runs = []
    for use_init in (False, True):
        torch.manual_seed(0)
        with zero_engine.zero.Init(config_dict_or_path=config, enabled=use_init):
            model = GPT(cfg)
        engine, *_ = zero_engine.initialize(model=model, config=config)
        losses = [train_global_batch(engine, x, y, 2, 2)
                  for x, y in make_batches(cfg, 3, dist.get_world_size() * 4, seed=dist.get_rank())]
        masters = shard_group_gather(engine, lambda sp: sp.master if sp.master is not None else sp.shard.float())
        runs.append((losses, masters, {sp.shard_numel == -(-sp.numel // K) for sp in engine.sharded}))
        engine.destroy()
    (losses, masters, _), (init_losses, init_masters, one_over_k) = runs
    return losses == init_losses, [n for n in masters if not torch.equal(masters[n], init_masters[n])], one_over_k


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_model_built_under_zero_init_trains_as_one_built_without_it(precision):
    """zero.Init partitions over the world; MiCS shards over groups of K: the engine gathers each parameter whole
    again at initialize (its fp32 values, in bf16 too) and shards it over its group. Losses and masters bitwise."""
    for same_losses, differ, one_over_k in run_ranks(_zero_init_body, WORLD, precision, timeout=TIMEOUT):
        assert same_losses and differ == [] and one_over_k == {True}, differ


def _one_rank_branch_body(stage):
    """Only rank 0 (of shard group 0, replica 0) uses ``head.extra``: its gradient exists on one rank of four and is
    reduced on its own at the end of backward (see [Note: a gradient on some ranks only] in zero/presence.py), within
    the shard group and then across replicas like any bucket."""
    from test_reliability import _TwoHeads

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _TwoHeads()
    reference = copy.deepcopy(model)
    engine, *_ = zero_engine.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20, "stage3_param_persistence_threshold": 0,
                              "mics_shard_size": K}})
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(world, 4, 8, generator=g)
        engine.backward(engine(x[rank], use_extra=rank == 0))
        engine.step()
        ref_opt.zero_grad()
        torch.stack([reference(x[r], use_extra=r == 0) for r in range(world)]).mean().backward()
        ref_opt.step()
    ours, ref = shard_group_gather(engine, lambda sp: sp.shard), dict(reference.named_parameters())
    engine.destroy()
    return {n: (ours[n] - ref[n].detach()).abs().max().item() for n in ours}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_gradient_on_one_rank_only_is_averaged_across_replicas_too(stage):
    # The same sums in another order than the reference: fp32 rounding, 1e-6 absolute on values of order 0.1.
    for diffs in run_ranks(_one_rank_branch_body, WORLD, stage, timeout=TIMEOUT):
        assert max(diffs.values()) < 1e-6, diffs


# ---- collectives per group -------------------------------------------------------------------------------------------
def _comm_body(gas=1):
    torch.manual_seed(0)
    sizes = [(37, 29), (29, 41), (41, 23)]
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in sizes])
    config = ds_config(3, gas=gas, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                       stage3_prefetch_bucket_size=10**6)
    engine, *_ = zero_engine.initialize(model=model, config=config)
    per_step = []
    for _ in range(2):
        engine.reset_comm_stats()
        for _ in range(gas):
            out = engine(torch.randn(4, 37))
            engine.backward(out.pow(2).mean())
            engine.step()
        per_step.append(engine.comm_stats(by_group=True))
    total = engine.comm_stats()
    padded_bytes = sum(sp.padded_numel * 4 for sp in engine.sharded)  # padded over the shard group of K
    buckets = len(engine.reducer.buckets)
    engine.destroy()
    return per_step, total, padded_bytes, buckets


@pytest.mark.parametrize("gas", [1, 3])
def test_collectives_per_group_match_the_formula(gas):
    """Per step, with Psi the padded parameter bytes over a shard group of k: dp_shard all-gathers 2 Psi (forward and
    backward) and reduce-scatters Psi per micro-step, as flat ZeRO-3 over k ranks; dp_replicate all-reduces each
    bucket's shard once per step whatever the accumulation (Psi / k bytes, one call per bucket, in the window's last
    pass: [Note: gradients across replicas]); the world carries only the step fingerprint (and the gradient presence
    in the step that records the trace); the grad norm is one all-reduce on dp_shard."""
    for per_step, total, psi, buckets in run_ranks(_comm_body, WORLD, gas, timeout=TIMEOUT):
        for step, groups in enumerate(per_step):
            shard, replicate, world = groups["dp_shard"], groups["dp_replicate"], groups["world"]
            assert shard["all_gather"]["bytes"] == 2 * psi * gas
            assert shard["reduce_scatter"]["bytes"] == psi * gas
            assert shard["reduce_scatter"]["calls"] == buckets * gas
            assert (shard["all_reduce"]["calls"], shard["all_reduce"]["bytes"]) == (1, 8)  # the fp64 grad norm
            assert replicate["all_reduce"]["calls"] == buckets
            assert replicate["all_reduce"]["bytes"] == psi // K
            assert replicate["all_gather"]["calls"] == replicate["reduce_scatter"]["calls"] == 0
            assert world["all_gather"]["calls"] == world["reduce_scatter"]["calls"] == 0
            assert world["all_reduce"]["calls"] == (2 if step == 0 else 1)  # + presence while recording
        assert total["all_gather"]["bytes"] == 2 * psi * gas  # comm_stats() sums the groups


# ---- checkpoints: saved flat, loaded hierarchical, and back ----------------------------------------------------------
def _whole_states(engine) -> dict[str, torch.Tensor]:
    """Compute-dtype parameters, fp32 masters and Adam moments, whole, gathered by the test over the shard group."""
    optimizer = engine.optimizer.optimizer
    out = {}
    for kind, tensor_of in (("param", lambda sp: sp.shard), ("master", lambda sp: sp.master),
                            ("exp_avg", lambda sp: optimizer.state[engine.optimizer.masters[id(sp.param)]]
                             ["exp_avg"].reshape(-1)),
                            ("exp_avg_sq", lambda sp: optimizer.state[engine.optimizer.masters[id(sp.param)]]
                             ["exp_avg_sq"].reshape(-1))):
        params = [sp for sp in engine.sharded if sp.param.requires_grad or kind == "param"]
        out.update({f"{kind}/{name}": value for name, value in shard_group_gather(engine, tensor_of, params).items()})
    return out


def _train(engine, cfg, steps, seed):
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for x, y in make_batches(cfg, steps, world * 2, seed=seed):
        loss = engine(x[rank * 2: rank * 2 + 2], y[rank * 2: rank * 2 + 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _checkpoint_body(directory):
    cfg = GPTConfig()
    results = {}
    torch.manual_seed(0)
    flat, *_ = zero_engine.initialize(model=GPT(cfg), config=ds_config(3, gas=1, mics=-1, bf16=True))
    _train(flat, cfg, 2, seed=1)
    flat.save_checkpoint(directory, tag="flat")
    saved_flat = _whole_states(flat)
    next_flat = _train(flat, cfg, 1, seed=2)
    flat.destroy()

    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    mics, *_ = zero_engine.initialize(model=GPT(cfg), config=ds_config(3, gas=1, mics=K, bf16=True))
    mics.load_checkpoint(directory, tag="flat")
    loaded = _whole_states(mics)
    results["flat->mics equal"] = saved_flat.keys() == loaded.keys() and all(
        torch.equal(saved_flat[k], loaded[k]) for k in saved_flat)
    results["next loss equal"] = _train(mics, cfg, 1, seed=2) == next_flat  # same parameters, same micro-batch
    results["global_steps"] = mics.global_steps
    mics.save_checkpoint(directory, tag="mics")
    saved_mics = _whole_states(mics)
    mics.destroy()

    torch.manual_seed(2)
    back, *_ = zero_engine.initialize(model=GPT(cfg), config=ds_config(3, gas=1, mics=-1, bf16=True))
    back.load_checkpoint(directory, tag="mics")
    loaded = _whole_states(back)
    results["mics->flat equal"] = all(torch.equal(saved_mics[k], loaded[k]) for k in saved_mics)
    back.destroy()
    masters = {k.removeprefix("master/"): v for k, v in saved_mics.items() if k.startswith("master/")}
    return results, masters


def test_checkpoint_saved_flat_loads_hierarchical_and_back(tmp_path):
    from zero_engine.checkpoint import get_fp32_state_dict_from_zero_checkpoint
    from zero_engine.checkpoint._metadata import read_metadata

    outcomes = run_ranks(_checkpoint_body, WORLD, str(tmp_path), timeout=TIMEOUT)
    for results, _ in outcomes:
        assert results == {"flat->mics equal": True, "next loss equal": True, "global_steps": 3,
                           "mics->flat equal": True}, results
    meta = read_metadata(str(tmp_path / "mics"))
    # written by every rank (RNG states), model states by replica 0 only, partitioned over its K ranks
    assert (meta.world_size, meta.partition_world_size) == (WORLD, K)
    assert all(p.shard_numel == -(-p.numel // K) for p in meta.params)
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="mics")  # offline, no ranks
    masters = outcomes[0][1]
    assert all(torch.equal(consolidated[name].reshape(-1), value.reshape(-1)) for name, value in masters.items())


# ---- memory: 16 Psi / k per rank, and the estimator agrees -----------------------------------------------------------
def _memory_body(directory):
    from zero_engine.memory.estimator import estimate_zero3_model_states_mem_needs_all_live

    cfg = GPTConfig()
    torch.manual_seed(0)
    config = ds_config(3, gas=1, stage3_gather_16bit_weights_on_model_save=True)
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=config)
    _train(engine, cfg, 1, seed=0)
    stats = engine.memory_stats()
    elements = sum(-(-sp.numel // K) for sp in engine.sharded)
    zc = load_config(config, world_size=WORLD).zero_optimization
    with torch.device("meta"):
        estimate = estimate_zero3_model_states_mem_needs_all_live(GPT(cfg), num_ranks_per_node=WORLD,
                                                                  zero_config=zc, print_table=False,
                                                                  stages=(3,), precisions=("fp32",))
    row = estimate.get(3, "fp32")
    # GatheredParameters, safe_get_full_fp32_param and save_16bit_model gather over the shard group
    from zero_engine.utils import safe_get_full_fp32_param

    weight = max(engine.sharded, key=lambda sp: sp.numel).param  # partitioned (not persistent)
    with zero_engine.zero.GatheredParameters([weight]):
        gathered = weight.detach().clone()
    full = safe_get_full_fp32_param(weight)
    whole = shard_group_gather(engine, lambda sp: sp.shard)
    engine.save_16bit_model(directory)  # each shard group gathers, world rank 0 writes
    saved = torch.load(f"{directory}/pytorch_model.bin") if dist.get_rank() == 0 else whole
    engine.destroy()
    return (stats["params_sharded"], stats["optimizer_states"], elements, row.params_sharded, row.optimizer_states,
            estimate.partition_size, torch.equal(gathered, full) and all(torch.equal(saved[n], whole[n]) for n in whole))


def test_model_states_are_one_over_k_and_the_estimator_agrees(tmp_path):
    for sharded, states, elements, est_sharded, est_states, partition, same in run_ranks(
            _memory_body, WORLD, str(tmp_path), timeout=TIMEOUT):
        assert sharded == 4 * elements and states == 8 * elements  # fp32 AdamW: 4 + 8 bytes a shard element
        assert (est_sharded, est_states, partition) == (sharded, states, K)
        assert same


# ---- the corpus MiCS config ------------------------------------------------------------------------------------------
from test_dsconfigs import DSCONFIGS  # noqa: E402  ../shared/dsconfigs

VILA = "NVlabs__VILA__scripts__zero3_mics_tiny_fixed.json"


def _vila_body(path):
    import json

    raw = json.loads(open(path).read())
    raw["zero_optimization"]["mics_shard_size"] = K  # the file's 16 needs 16 ranks; the same config at world 4
    cfg = GPTConfig()
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=raw,
                                        optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-3))
    micro = engine.train_micro_batch_size_per_gpu()
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for x, y in make_batches(cfg, 6, world * micro):
        loss = engine(x[rank * micro: (rank + 1) * micro], y[rank * micro: (rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    shape = (engine.mesh.shard_size, engine.mesh.replicate_size)
    engine.destroy()
    return losses, shape


def test_vila_mics_config_trains():
    if not (DSCONFIGS / VILA).is_file():
        pytest.skip(f"{VILA} not present")
    with pytest.raises(ConfigError, match=r"^zero_optimization.mics_shard_size: 16 does not divide the data-parallel "
                                          r"world of 4 ranks; use one of 1, 2, 4"):
        load_config(DSCONFIGS / VILA, world_size=4)
    for losses, shape in run_ranks(_vila_body, WORLD, str(DSCONFIGS / VILA), timeout=TIMEOUT):
        assert shape == (K, WORLD // K)
        assert losses[-1] < losses[0], losses  # it learns


# ---- bad input -------------------------------------------------------------------------------------------------------
def test_bad_config_input_names_the_key_and_the_fix():
    base = {"train_micro_batch_size_per_gpu": 1}
    cases = [({"stage": 3, "mics_shard_size": 3}, "3 does not divide the data-parallel world of 4 ranks; use one of "
                                                  "1, 2, 4"),
             ({"stage": 0, "mics_shard_size": 2}, "needs zero_optimization.stage 1, 2 or 3"),
             ({"stage": 3, "mics_shard_size": 0}, "0 ranks per shard group"),
             ({"stage": 3, "mics_hierarchical_params_gather": True}, "true needs zero_optimization.mics_shard_size"),
             ({"stage": 2, "zero_hpz_partition_size": 2}, "2 needs zero_optimization.stage 3"),
             ({"stage": 3, "zero_hpz_partition_size": 3}, "3 does not divide the data-parallel world of 4 ranks; use "
                                                          "one of 2, 4 (the ranks per node), or 1 (off)"),
             ({"stage": 3, "zero_hpz_partition_size": 2, "mics_shard_size": 2}, "not supported yet"),
             ({"stage": 2, "zero_quantized_weights": True}, "true needs zero_optimization.stage 3"),
             ({"stage": 1, "zero_quantized_gradients": True}, "true needs zero_optimization.stage 3")]
    for zero, message in cases:
        with pytest.raises(ConfigError, match="zero_optimization.") as caught:
            load_config({**base, "zero_optimization": zero}, world_size=WORLD)
        assert message in str(caught.value), (zero, str(caught.value))
    with pytest.raises(ConfigError) as caught:  # a data-parallel world of one rank (AutoTP over every rank)
        load_config({**base, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, world_size=1)
    assert str(caught.value).endswith("2 does not divide the data-parallel world of 1 rank, which has nothing to "
                                      "partition; set 1 (off)"), str(caught.value)
    with pytest.raises(NotImplementedError, match="model-parallel world size of 2 is not supported yet"):
        zero_engine.initialize(model=nn.Linear(2, 2), config={**base}, mpu=TensorParallel2())
    with pytest.raises(ValueError, match="has no get_data_parallel_rank"):
        zero_engine.initialize(model=nn.Linear(2, 2), config={**base}, mpu=type("Half", (), {
            "get_data_parallel_group": lambda self: None, "get_data_parallel_world_size": lambda self: 1})())


def _mesh_check_body():
    """resolve_mesh's own checks, against the process group: a config resolved for 3 data-parallel ranks (what
    initialize(config=EngineConfig) or an mpu can hand it) met on 2."""
    from zero_engine.mesh import resolve_mesh
    messages = []
    for zero in ({"stage": 3, "mics_shard_size": 3}, {"stage": 3, "zero_hpz_partition_size": 3}):
        zc = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world_size=3)
        with pytest.raises(ConfigError) as caught:
            resolve_mesh(zc.zero_optimization, "cpu")
        messages.append(str(caught.value))
    return messages


def test_the_mesh_checks_word_the_fix_as_the_config_does():
    """The same fix as the config's check (the sizes that divide, then the off value), not "a divisor"."""
    for messages in run_ranks(_mesh_check_body, 2, timeout=TIMEOUT):
        assert messages == [
            "zero_optimization.mics_shard_size: 3 does not divide the data-parallel world of 2 ranks; use one of 1, 2 "
            "(the ranks per shard group, e.g. GPUs per node), or -1 (off)",
            "zero_optimization.zero_hpz_partition_size: 3 does not divide the data-parallel world of 2 ranks; use 2 "
            "(the ranks per node), or 1 (off)"], messages


def _bad_mesh_body():
    from torch.distributed.device_mesh import init_device_mesh

    config = ds_config(3, gas=1, mics=-1)
    errors = []

    def attempt(**kwargs):
        try:
            zero_engine.initialize(model=nn.Linear(4, 4), config=kwargs.pop("config", config), **kwargs)
        except Exception as error:  # noqa: BLE001 -- the test compares the types and messages
            errors.append((type(error).__name__, str(error)))
        else:
            errors.append(("no error", ""))

    attempt(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep")))  # tp: test_tensor_parallel.py
    attempt(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "dp_replicate")))
    attempt(mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)), config=ds_config(3, gas=1, mics=K))
    attempt(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))["dp_shard"])
    import os

    before = os.environ.get("LOCAL_WORLD_SIZE")  # the rank pool sets it to the world size
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one rank per node: an hpZ group of 2 would span nodes
    try:
        attempt(config=ds_config(3, gas=1, mics=-1, zero_hpz_partition_size=K))
    finally:
        if before is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before
    return errors


def test_bad_mesh_input_is_refused_clearly():
    for errors in run_ranks(_bad_mesh_body, WORLD, timeout=TIMEOUT):
        (ep_kind, ep), (order_kind, order), (both_kind, both), (size_kind, size), (node_kind, node) = errors
        assert ep_kind == "NotImplementedError" and "'ep' (expert parallelism) is not supported yet" in ep
        assert order_kind == "ValueError" and "(\"dp_replicate\", \"dp_shard\") for HSDP / MiCS, in that order" in order
        assert both_kind == "ConfigError" and both.startswith("zero_optimization.mics_shard_size: 2 given together "
                                                              "with initialize(mesh=...)")
        assert size_kind == "ValueError" and "multiply to 2 ranks, the world has 4" in size
        assert node_kind == "ConfigError" and node.startswith("zero_optimization.zero_hpz_partition_size: 2 is larger "
                                                              "than a node (LOCAL_WORLD_SIZE=1)")


# ---- the step fingerprint sees sub-group collectives -----------------------------------------------------------------
def _fingerprint_body():
    cfg = GPTConfig()
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=ds_config(3, gas=1))
    _train(engine, cfg, 1, seed=0)
    x, y = make_batches(cfg, 1, 8)[0]
    rank = dist.get_rank()
    engine.backward(engine(x[rank * 2: rank * 2 + 2], y[rank * 2: rank * 2 + 2]))
    # Both ranks of each shard group all-reduce one element (it completes), but under different names: what a
    # diverging code path looks like. The records are the world's (shared), so the world fingerprint disagrees.
    engine.shard_comm.all_reduce(torch.zeros(1), name=f"probe {engine.mesh.shard_rank}")
    try:
        engine.step()
    except zero_engine.RankDivergenceError as error:
        return str(error)
    finally:
        engine.destroy()
    return "no error"


def test_step_fingerprint_covers_sub_group_collectives():
    for message in run_ranks(_fingerprint_body, WORLD, timeout=TIMEOUT):
        assert "probe 0" in message and "probe 1" in message, message


# ---- ZeRO++ hpZ: the secondary partition -----------------------------------------------------------------------------
def _hpz_body(seq):
    """The same run under flat ZeRO-3 and under hpZ (secondary within K ranks): bitwise equal, since backward gathers
    the same bits from the secondary as forward from the primary shards, and the reductions are the same."""
    cfg = GPTConfig(frozen_param=True)
    runs = {}
    for hpz in (1, K):
        torch.manual_seed(0)  # no reuse distance: every parameter gathered once in forward, once in backward
        config = ds_config(3, seq, gas=2, mics=-1, bf16=True, zero_hpz_partition_size=hpz,
                           stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=10**6)  # a unit's in one run
        engine, *_ = zero_engine.initialize(model=GPT(cfg), config=config)
        losses, stats = [], []
        for step in range(3):
            engine.reset_comm_stats()
            losses += _train(engine, cfg, 2, seed=step)  # two micro-steps: one optimizer step
            stats.append(engine.comm_stats(by_group=True))
        psi = sum(sp.padded_numel * 2 for sp in engine.sharded if not sp.is_persistent)  # bf16 bytes gathered
        persistent = sum(sp.padded_numel * 2 for sp in engine.sharded if sp.is_persistent)
        gathered = sum(1 for sp in engine.sharded if not sp.is_persistent)  # parameters gathered in backward
        runs[hpz] = (losses, shard_group_gather(engine, lambda sp: sp.shard), stats, (psi, persistent, gathered),
                     engine.memory_stats()["params_secondary"])
        engine.destroy()
    (flat_losses, flat_params, flat_stats, (psi, persistent, gathered), none), (losses, params, stats, _, secondary) = \
        runs[1], runs[K]
    same = losses == flat_losses and all(torch.equal(params[n], flat_params[n]) for n in params)
    return same, psi, persistent, gathered, none, secondary, flat_stats[-1], stats[-1]


@pytest.mark.parametrize("seq", [False, True])
def test_hpz_is_bitwise_flat_zero3_with_backward_gathers_within_the_group(seq):
    for same, psi, persistent, gathered, none, secondary, flat, hpz in run_ranks(_hpz_body, WORLD, seq,
                                                                                 timeout=TIMEOUT):
        assert same  # losses and parameters bitwise those of flat ZeRO-3
        # backward's gathers from the secondary, 2 micro-steps: one a parameter when sequential; coalesced, the small
        # parameters of a unit share one ([Note: gathers from the secondary] in zero/hpz.py)
        calls = hpz["hpz"]["all_gather"]["calls"]
        assert calls == 2 * gathered if seq else calls < gathered, (calls, gathered)
        assert (none, secondary) == (0, psi // K)  # 2 Psi / k bytes more per rank (bf16)
        # per optimizer step (2 micro-steps): flat gathers 2 Psi per micro-step over the world; hpZ gathers Psi over
        # the world (forward) and Psi within its group (backward) -- the cross-group all-gather bytes halve
        # (+ P: the persistent parameters, whole on every rank, re-gathered over the world after the step)
        assert flat["world"]["all_gather"]["bytes"] == 2 * 2 * psi + persistent
        assert hpz["world"]["all_gather"]["bytes"] == 2 * psi + persistent
        assert hpz["hpz"]["all_gather"]["bytes"] == 2 * psi
        assert hpz["world"]["reduce_scatter"] == flat["world"]["reduce_scatter"]


def _hpz_offload_body(scratch, offload):
    """hpZ over K ranks, bf16, 3 steps of 2 micro-steps, the primary shards on the device or on NVMe."""
    cfg = GPTConfig(frozen_param=True)
    extra = {"offload_param": {"device": "nvme", "nvme_path": scratch, "buffer_size": 4000, "buffer_count": 5,
                               "max_in_cpu": 20000}} if offload else {}  # a few buckets in memory at a time
    torch.manual_seed(0)
    config = ds_config(3, gas=2, mics=-1, bf16=True, zero_hpz_partition_size=K, **extra)
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=config)
    losses = []
    for step in range(3):
        engine.reset_comm_stats()
        losses += _train(engine, cfg, 2, seed=step)
    hpz_bytes = engine.comm_stats(by_group=True)["hpz"]["all_gather"]["bytes"]
    reads = engine.param_swapper.reads if engine.param_swapper is not None else 0
    whole = gathered_params(engine)
    engine.destroy()
    return losses, whole, hpz_bytes, reads


def test_hpz_with_nvme_parameter_offload_trains_bitwise_as_without(tmp_path):
    """Offload moves the primary shards, not their values, nor what backward gathers within the hpZ group."""
    on_device = run_ranks(_hpz_offload_body, WORLD, "", False, timeout=TIMEOUT)
    offloaded = run_ranks(_hpz_offload_body, WORLD, str(tmp_path), True, timeout=TIMEOUT)
    for (losses, whole, hpz_bytes, reads), (expected_losses, expected, expected_bytes, _) in zip(offloaded, on_device):
        assert reads > 20  # the shards really came from the files, step after step
        assert losses == expected_losses
        assert all(torch.equal(whole[n], expected[n]) for n in expected)
        assert hpz_bytes == expected_bytes > 0  # backward still gathers within the group


def test_hpz_estimate_adds_two_psi_over_k():
    from zero_engine.memory.estimator import estimate_from_counts

    base = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}
    zero = load_config({**base, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
                       world_size=512).zero_optimization
    hpz = load_config({**base, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                     "zero_hpz_partition_size": 8}}, world_size=512).zero_optimization
    flat, secondary = (estimate_from_counts(7 * 2**30, 2**27, num_ranks_per_node=8, num_nodes=64, zero_config=z,
                                            print_table=False, stages=(3,), precisions=("bf16",)).get(3, "bf16")
                       for z in (zero, hpz))
    assert secondary.params_secondary == 2 * 7 * 2**30 // 8  # 2 Psi / k in bf16 (the flat tensor pads to 512)
    assert secondary.model_states == flat.model_states + secondary.params_secondary
    assert secondary.by_location()["device"]["params_secondary"] == secondary.params_secondary


# ---- shape-only at scale: 8 x 8 and 64 x 8 on the fake process group ------------------------------------------------
@pytest.mark.parametrize("world,zero", [(64, {"mics_shard_size": 8}), (512, {"mics_shard_size": 8}),
                                        (512, {"zero_hpz_partition_size": 8})])
def test_per_group_bytes_and_states_at_scale_shape_only(world, zero):
    """A step of a bf16 GPT (meta tensors, no values) as rank 9 of 64 or 512. With Psi the padded bf16 parameter
    bytes: MiCS gathers 2 Psi within its group of 8, reduce-scatters the fp32 gradients (2 Psi bytes) there and
    all-reduces 2 Psi / 8 across replicas, whatever the number of replicas; hpZ gathers Psi over the world (forward)
    and Psi within its group of 8 (backward)."""
    from zero_engine.testing import fake_world

    cfg = GPTConfig()
    with torch.device("meta"):
        model = GPT(cfg)
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0, **zero}}
    with fake_world(world, rank=9):
        engine, *_ = zero_engine.initialize(model=model, config=config)
        idx = torch.zeros(1, cfg.block_size, dtype=torch.long, device="meta")
        for _ in range(2):  # the second step follows the recorded trace
            engine.reset_comm_stats()
            engine.backward(engine(idx, idx))
            engine.step()
        stats, memory = engine.comm_stats(by_group=True), engine.memory_stats()
        psi = sum(sp.padded_numel * 2 for sp in engine.sharded)
        numels = [sp.numel for sp in engine.sharded]
        engine.destroy()
    if "mics_shard_size" in zero:
        assert set(stats) == {"world", "dp_shard", "dp_replicate"}
        assert stats["dp_shard"]["all_gather"]["bytes"] == 2 * psi
        assert stats["dp_shard"]["reduce_scatter"]["bytes"] == 2 * psi  # fp32 reduction of the bf16 gradients
        assert stats["dp_replicate"]["all_reduce"]["bytes"] == 2 * psi // 8
        assert stats["world"]["all_gather"]["calls"] == stats["world"]["reduce_scatter"]["calls"] == 0
        assert memory["params_sharded"] == 2 * sum(-(-n // 8) for n in numels)  # 2 Psi / k
    else:
        assert stats["world"]["all_gather"]["bytes"] == psi
        assert stats["hpz"]["all_gather"]["bytes"] == psi
        assert memory["params_sharded"] == 2 * sum(-(-n // world) for n in numels)  # 2 Psi / N
        assert memory["params_secondary"] == psi // 8  # 2 Psi / k
