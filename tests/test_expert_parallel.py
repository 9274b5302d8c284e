"""Expert parallelism (zero_engine/moe.py, zero/expert.py): experts split across ep ranks with all-to-all dispatch,
expert parameters sharded and reduced over their expert-data-parallel group, dense ones over the whole world.

Bodies named ``_*_body`` run on every rank of the simulated world (module level, so the rank pool imports them).

Tolerances. The reference is one process holding every expert (ep 1) on the full batch. Without ZeRO the only
difference is the order of sums (rank-local losses averaged, gradients all-reduced): within 1e-6. Under ZeRO-3 with
AdamW, as in test_mesh.py: losses within 1e-5 relative, parameters within 2e-4 relative L2 (Adam's division by
sqrt(v) amplifies a 1e-7 difference of a near-zero gradient); with SGD, 1e-5.
"""

from __future__ import annotations

import os

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


def moe_gpt(groups=None, num_experts: int = NUM_EXPERTS, top_k: int = 2, seed: int = 0) -> GPT:
    """The test GPT whose blocks' MLPs are MoE layers (same weights whatever the ep size, for a given seed)."""
    torch.manual_seed(seed)
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


# ---- ZeRO-3 -----------------------------------------------------------------------------------------------------
def ds_config(gas: int = 2, micro: int = 2, optimizer: str = "AdamW", lr: float = 3e-3, **zero) -> dict:
    params = {"lr": lr, "weight_decay": 0.1} if optimizer == "AdamW" else {"lr": lr, "momentum": 0.9}
    zero_section = {"stage": 3, "reduce_bucket_size": 3000, "stage3_prefetch_bucket_size": 3000,
                    "stage3_param_persistence_threshold": 30, "overlap_comm": True, **zero}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": 0.5,
            "optimizer": {"type": optimizer, "params": params}, "zero_optimization": zero_section}


def _zero3_body(ep_size: int, optimizer: str = "AdamW", steps: int = 3, gas: int = 2, micro: int = 2,
                via_mesh: bool = False, zero_init: bool = False, **zero):
    """The MoE GPT under ZeRO-3 with experts on ep ranks, against one process holding every expert on the full
    batch (same clipping, same optimizer). ``via_mesh``: the groups come from a DeviceMesh ("edp", "ep") that
    initialize() is given too."""
    from zero_engine.testing.loop import train_global_batch
    from zero_engine.utils import safe_get_full_fp32_param

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None
    if via_mesh:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
    groups = expert_parallel_groups(ep_size, mesh=mesh)
    config = ds_config(gas, micro, optimizer, **zero)
    with zero_engine.zero.Init(config_dict_or_path=config, enabled=zero_init):  # experts over edp: zero/init.py
        model = moe_gpt(groups)
    reference = moe_gpt()
    engine, *_ = zero_engine.initialize(model=model, config=config, mesh=mesh)
    layout = {sp.fqn: (sp.world_size, sp.shard_numel, sp.numel) for sp in engine.sharded}
    opt_params = config["optimizer"]["params"]
    ref_opt = (torch.optim.AdamW if optimizer == "AdamW" else torch.optim.SGD)(reference.parameters(), **opt_params)
    loss_errors, norm_errors = [], []
    for x, y in make_batches(model.cfg, steps, gas * world * micro, seed=5):
        loss = train_global_batch(engine, x, y, gas, micro)
        ref_opt.zero_grad()
        ref_loss = reference(x, y)
        ref_loss.backward()
        ref_norm = nn.utils.clip_grad_norm_(reference.parameters(), config["gradient_clipping"]).item()
        ref_opt.step()
        loss_errors.append(abs(loss - ref_loss.item()) / ref_loss.item())
        norm_errors.append(abs(engine.get_global_grad_norm() - ref_norm) / ref_norm)
    ref = dict(reference.named_parameters())
    param_errors, squares = {}, torch.zeros(2, dtype=torch.float64)
    for name, p in model.named_parameters():
        expected = _expert_slice(name, ref[name].detach(), groups)
        ours = safe_get_full_fp32_param(p)
        param_errors[name] = ((ours - expected).norm() / expected.norm()).item()
        squares += torch.stack([(ours - expected).double().pow(2).sum(), expected.double().pow(2).sum()])
    dist.all_reduce(squares)  # over the world: every expert counted (ep times each dense parameter, both sums)
    param_errors["(the whole model)"] = (squares[0] / squares[1]).sqrt().item()
    stats = engine.comm_stats()
    if not zero.get("zero_quantized_weights"):  # qwZ gathers int8: the gathered values are not the masters
        with zero_engine.zero.GatheredParameters(list(model.parameters())):  # experts over edp: this rank's experts
            for name, p in model.named_parameters():
                assert torch.equal(p.detach(), safe_get_full_fp32_param(p)), name
    engine.destroy()
    return max(loss_errors), max(norm_errors), param_errors, layout, stats


def _check_zero3(results, world: int, ep_size: int, param_tol: float, loss_tol: float = 1e-5):
    for loss_err, norm_err, param_errors, layout, _ in results:
        assert loss_err < loss_tol and norm_err < loss_tol, (loss_err, norm_err)
        worst = max(param_errors, key=param_errors.get)
        assert param_errors[worst] < param_tol, (worst, param_errors[worst])
        for name, (shard_world, shard_numel, numel) in layout.items():  # experts: over edp; dense: the world
            expected = world // ep_size if ".experts." in name else world
            assert shard_world == expected and shard_numel == -(-numel // expected), (name, layout[name])


def test_zero3_with_2_expert_groups_matches_one_process():
    """World 4 = ep 2 x edp 2: each rank holds 2 of 4 experts, sharded over the 2 ranks holding the same ones."""
    _check_zero3(run_ranks(_zero3_body, 4, 2, timeout=TIMEOUT), world=4, ep_size=2, param_tol=2e-4)


def test_zero3_with_experts_sgd_sequential_gather_is_exact_to_1e5():
    """SGD (linear in the gradient) bounds the parameters at 1e-5; the sequential gather routes per group too."""
    _check_zero3(run_ranks(_zero3_body, 4, 2, "SGD", 2, 1, 2, stage3_allgather_sequential=True,
                           timeout=TIMEOUT), world=4, ep_size=2, param_tol=1e-5)


def test_zero3_with_an_edp_x_ep_device_mesh_given_to_initialize():
    """The same groups from initialize(mesh=init_device_mesh(..., mesh_dim_names=("edp", "ep")))."""
    _check_zero3(run_ranks(_zero3_body, 4, 2, "SGD", 2, 1, 2, True, timeout=TIMEOUT), world=4, ep_size=2,
                 param_tol=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_to_2_with_2_expert_groups_match_one_process(stage):
    """Stages 0-2 keep every parameter whole, an expert's its ep rank's experts. At stages 1-2 its gradient is
    reduced and its fp32 master and optimizer states sharded over its edp group, and the whole experts refreshed over
    it after the step, as stage 3 does (DeepSpeed's MoE runs at stage 2 mostly); at stage 0 its gradient is averaged
    over that group and the norm summed over the world ([Note: stage 0 with experts]). Against one process as stage
    3 is."""
    _check_zero3(run_ranks(_zero3_body, 4, 2, stage=stage, timeout=TIMEOUT), world=4, ep_size=2, param_tol=2e-4)


def test_zero3_with_experts_built_under_zero_init_trains_as_built_whole():
    """zero.Init shards an expert parameter over its edp group as it is built (each ep rank keeps its own experts,
    broadcast from its edp group's first rank) and the engine takes it as it is: the same errors against one process,
    to the last bit, as the model built whole (SGD, sequential gather: exact to 1e-5)."""
    whole = run_ranks(_zero3_body, 4, 2, "SGD", 2, 1, 2, stage3_allgather_sequential=True, timeout=TIMEOUT)
    built = run_ranks(_zero3_body, 4, 2, "SGD", 2, 1, 2, zero_init=True, stage3_allgather_sequential=True,
                      timeout=TIMEOUT)
    _check_zero3(built, world=4, ep_size=2, param_tol=1e-5)
    for (*errors, _, _), (*expected, _, _) in zip(built, whole):
        assert errors == expected, (errors, expected)


@pytest.mark.parametrize("zero", [{"zero_quantized_weights": True}, {"zero_quantized_gradients": True}],
                         ids=["qwZ", "qgZ"])
def test_zero3_with_experts_and_zeropp_quantization_adds_no_error_to_the_quantizations_own(zero):
    """ZeRO++ qwZ gathers expert shards in int8 over their edp group, and qgZ reduces their gradients in int4 there,
    as both do over the world for dense parameters. Against one process, ep 2 is as close as ep 1 with the same
    quantization (every expert on every rank): losses, the gradient norm and the whole model's weights within 1.5
    times ep 1's difference (the quantization's own; qgZ's blocks follow the gradient buckets, which the expert groups
    cut). And it is quantized: every gradient reduction is qgZ's all-to-all; qwZ's gathers move 0.35 times the exact
    run's bytes (int8 and a scale per 256 elements against fp32, and the persistent parameters' exact refresh after
    each step), 0.69 with the experts' gathers left exact: the bound is 0.45."""
    exact = run_ranks(_zero3_body, 4, 2, timeout=TIMEOUT)
    every_expert = run_ranks(_zero3_body, 4, 1, timeout=TIMEOUT, **zero)
    split = run_ranks(_zero3_body, 4, 2, timeout=TIMEOUT, **zero)
    _check_zero3(every_expert, world=4, ep_size=1, param_tol=float("inf"), loss_tol=float("inf"))
    _check_zero3(split, world=4, ep_size=2, param_tol=float("inf"), loss_tol=float("inf"))  # the layout
    for (loss, norm, params, _, stats), (loss_1, norm_1, params_1, _, _), (*_, exact_stats) in \
            zip(split, every_expert, exact):
        model, model_1 = params["(the whole model)"], params_1["(the whole model)"]
        assert loss <= 1.5 * loss_1 and norm <= 1.5 * norm_1 and model <= 1.5 * model_1, (
            (loss, norm, model), (loss_1, norm_1, model_1))
        assert loss_1 > 1e-5 and model_1 > 1e-4  # each is really another run than the exact one
        if zero.get("zero_quantized_gradients"):
            assert stats["reduce_scatter"]["calls"] == 0 and stats["all_to_all"]["calls"] > 0, stats
        else:
            ratio = stats["all_gather"]["bytes"] / exact_stats["all_gather"]["bytes"]
            assert ratio < 0.45, ratio


# ---- checkpoints --------------------------------------------------------------------------------------------------
GLOBAL_ROWS = 8  # rows per micro-step over all ranks: each rank's micro batch is GLOBAL_ROWS / world


def _micro_steps(engine, batches, steps: range) -> list[float]:
    """Micro-steps ``steps`` of ``batches`` (two micro-steps a batch, rows as train_global_batch takes them); the
    loss of each, averaged over the ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL_ROWS // world
    losses = []
    for step in steps:
        x, y = batches[step // 2]
        lo = (step % 2 * world + rank) * micro
        loss = engine(x[lo: lo + micro], y[lo: lo + micro])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _own_fp32(model) -> dict[str, torch.Tensor]:
    """This rank's whole fp32 values (an expert parameter's: its ep rank's experts). Collective."""
    from zero_engine.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}


def _checkpoint_body(directory: str, runs: list[tuple[int, str, int]], dtype: str = "fp32"):
    """Each run (ep size, tag, ZeRO stage) in turn on this world: "save" trains three batches of two micro-steps,
    saving "boundary" after the first batch and "middle" after the first micro-step of the second, and at the end
    save_16bit_model's "model16.bin"; a tag loads that checkpoint into a model from other initial values and trains
    the micro-steps the saving run trained after it.
    Returns, per run, the losses, this rank's values at the load (or at each save) and at the end, the ep size and
    this rank's ep rank."""
    results = []
    for ep_size, tag, stage in runs:
        groups = expert_parallel_groups(ep_size)
        model = moe_gpt(groups, seed=0 if tag == "save" else 1)
        config = ds_config(micro=GLOBAL_ROWS // dist.get_world_size(), stage3_gather_16bit_weights_on_model_save=True,
                           stage=stage)
        if dtype == "bf16":
            config["bf16"] = {"enabled": True}
        engine, *_ = zero_engine.initialize(model=model, config=config)
        batches = make_batches(model.cfg, 3, 2 * GLOBAL_ROWS, seed=5)
        at = {}
        if tag == "save":
            losses = _micro_steps(engine, batches, range(2))
            engine.save_checkpoint(directory, tag="boundary")
            at["boundary"] = _own_fp32(model)
            losses += _micro_steps(engine, batches, range(2, 3))
            engine.save_checkpoint(directory, tag="middle")
            at["middle"] = _own_fp32(model)
            losses += _micro_steps(engine, batches, range(3, 6))
            assert engine.save_16bit_model(directory, "model16.bin")
        else:
            engine.load_checkpoint(directory, tag=tag)
            at[tag] = _own_fp32(model)
            losses = _micro_steps(engine, batches, range(2 if tag == "boundary" else 3, 6))
        results.append((losses, at, _own_fp32(model), ep_size, groups.ep_rank))
        engine.destroy()
    return results


def _expert_rows(name: str, whole: torch.Tensor, ep_size: int, ep_rank: int) -> torch.Tensor:
    """What ep rank ``ep_rank`` holds of a whole (every expert) tensor of the checkpoint."""
    from zero_engine.moe import ExpertParallelGroups

    return _expert_slice(name, whole, ExpertParallelGroups(ep_size, ep_size, ep_rank))


RESHARDED_LOADS = {  # saved at stage 3 / 0: (world 4 runs, world 2 runs), each (ep size, tag, stage)
    3: ([(4, "middle", 3)], [(2, "boundary", 3), (1, "middle", 3)]),
    0: ([(4, "boundary", 3)], [(2, "boundary", 0), (1, "boundary", 1)]),  # stage 0's mid-window: this world only
}


@pytest.mark.parametrize("dtype, loss_tol, stage", [("fp32", 1e-5, 3), ("bf16", 2e-2, 3), ("fp32", 1e-5, 0)])
def test_a_checkpoint_with_experts_resumes_bitwise_and_reshards_to_another_world_and_ep_size(tmp_path, dtype, loss_tol,
                                                                                              stage):
    """World 4 at ep 2 (experts over their edp pairs at stage 3; each rank's whole at stage 0) saves at a step
    boundary and in the middle of an accumulation window. The files hold each expert weight whole, [num_experts, ...]: the offline state dict has rank r's experts
    in the rows of its ep rank, bitwise, and so does save_16bit_model's file. The same world and ep resume bitwise
    (losses and every rank's values); world 2 at ep 2 and ep 1 (every expert on every rank) and world 4 at ep 4 load
    exactly the saved values and continue within the tolerances of the parity tests above (fp32: 1e-5; bf16: 2e-2,
    two ulps of a bf16 loss near 4: the loss is a bf16 value, computed on other micro-batch sizes). A stage-0
    checkpoint loads at stages 3, 0 and 1 that way (RESHARDED_LOADS)."""
    from zero_engine.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    (saved,) = zip(*run_ranks(_checkpoint_body, 4, str(tmp_path), [(2, "save", stage)], dtype, timeout=TIMEOUT))
    saved_losses = saved[0][0]
    whole = {tag: get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag) for tag in ("boundary", "middle")}
    assert tuple(whole["boundary"]["blocks.0.mlp.experts.w1"].shape) == (NUM_EXPERTS, 24, 40)
    for _, at, _, ep_size, ep_rank in saved:  # every rank's values are in the files, experts in their ep rank's rows
        for tag, values in at.items():
            for name, value in values.items():
                assert torch.equal(value, _expert_rows(name, whole[tag][name], ep_size, ep_rank)), (tag, name)
    model16 = torch.load(tmp_path / "model16.bin")  # the final values in the compute dtype, every expert whole
    for _, _, final, ep_size, ep_rank in saved:
        assert all(torch.equal(final[name].to(model16[name].dtype), _expert_rows(name, model16[name], ep_size, ep_rank))
                   for name in final)
    resumed = list(zip(*run_ranks(_checkpoint_body, 4, str(tmp_path), [(2, "boundary", stage), (2, "middle", stage)],
                                  dtype, timeout=TIMEOUT)))
    for (losses, _, final, _, _), (_, _, saved_final, _, _) in zip(resumed[0] + resumed[1], saved + saved):
        assert losses == saved_losses[-len(losses):], (losses, saved_losses)
        assert all(torch.equal(final[name], saved_final[name]) for name in final)
    on_4, on_2 = RESHARDED_LOADS[stage]
    resharded = run_ranks(_checkpoint_body, 4, str(tmp_path), on_4, dtype, timeout=TIMEOUT) + \
        run_ranks(_checkpoint_body, 2, str(tmp_path), on_2, dtype, timeout=TIMEOUT)
    checked = set()
    for losses, at, _, ep_size, ep_rank in (run for rank_runs in resharded for run in rank_runs):
        for tag, values in at.items():  # the load gives each rank exactly the saved values of its experts
            for name, value in values.items():
                assert torch.equal(value, _expert_rows(name, whole[tag][name], ep_size, ep_rank)), (ep_size, name)
            checked.add((ep_size, tag))
        reference = saved_losses[-len(losses):]
        assert max(abs(a - b) / b for a, b in zip(losses, reference)) < loss_tol, (ep_size, losses, reference)
    assert checked == {(ep_size, tag) for ep_size, tag, _ in on_4 + on_2}


# ---- Hugging Face save_pretrained ---------------------------------------------------------------------------------
def _hf_moe_llama(groups=None):
    """A tiny transformers Llama whose MLPs are MoE layers (the same weights whatever the ep size)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        layer.mlp = MoE(cfg.hidden_size, cfg.intermediate_size, NUM_EXPERTS, groups=groups)
    return model


def _hf_save_body(out_dir: str, stage: int):
    """A step of the MoE Llama at ep 2 in bf16, then save_pretrained in bf16 (sharded into several files) and from
    the fp32 masters. Returns this rank's fp32 and compute-dtype values (experts: its ep rank's) and its ep rank."""
    import zero_engine.hf as zhf

    groups = expert_parallel_groups(2)
    model = _hf_moe_llama(groups)
    config = {**ds_config(gas=1, stage=stage), "bf16": {"enabled": True}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    x = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    zhf.save_pretrained(engine, out_dir + "/bf16", max_shard_size="20KB")
    zhf.save_pretrained(engine, out_dir + "/fp32", dtype=torch.float32)
    fp32 = _own_fp32(model)
    with zero_engine.zero.GatheredParameters(list(model.parameters())):  # experts over edp: this rank's experts
        compute = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine.destroy()
    return fp32, compute, groups.ep_rank


@pytest.mark.parametrize("stage", [3, 0])
def test_save_pretrained_writes_every_expert_whole_and_loads_into_one_process_holding_every_expert(tmp_path, stage):
    """World 4 at ep 2 (each expert sharded over its edp pair at stage 3; whole on each rank at stage 0): the
    directory holds each expert weight whole, [num_experts, ...], with every rank's experts in its ep rank's rows,
    bitwise (bf16: the compute values; fp32: the masters), and loads strictly into the model built on one process with
    every expert (ep 1)."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    results = run_ranks(_hf_save_body, 4, str(tmp_path), stage, timeout=TIMEOUT)
    for kind, dtype, index in (("bf16", torch.bfloat16, 1), ("fp32", torch.float32, 0)):
        directory = tmp_path / kind
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        assert (kind == "bf16") == (len(files) > 1), files  # bf16: split by max_shard_size
        saved = {}
        for name in files:
            saved.update(load_file(str(directory / name)))
        assert saved["model.layers.0.mlp.experts.w1"].shape == (NUM_EXPERTS, 24, 40)
        for result in results:
            values, ep_rank = result[index], result[2]
            assert set(values) == set(saved)
            for name, value in values.items():
                assert saved[name].dtype == dtype and torch.equal(value, _expert_rows(name, saved[name], 2, ep_rank)), \
                    (kind, name)
        whole = _hf_moe_llama().to(dtype)
        whole.load_state_dict(saved, strict=True)  # every name and shape of the one-process model


# ---- GatheredParameters(modifier_rank=...) ---------------------------------------------------------------------
def _modifier_body(stage: int):
    """Every rank writes its world rank + 1 into a dense weight and an expert weight inside GatheredParameters
    (modifier_rank=0), then trains a step. Returns, after the block and after the step, this rank's fp32 values."""
    from zero_engine.utils import safe_get_full_fp32_param

    rank = dist.get_rank()
    model = moe_gpt(expert_parallel_groups(2))
    engine, *_ = zero_engine.initialize(model=model, config=ds_config(gas=1, stage=stage))
    dense, expert = model.blocks[0].attn.qkv.weight, model.blocks[0].mlp.experts.w1
    with zero_engine.zero.GatheredParameters([dense, expert], modifier_rank=0):
        with torch.no_grad():
            dense.fill_(rank + 1)
            expert.fill_(rank + 1)
    after = [safe_get_full_fp32_param(p).clone() for p in (dense, expert)]
    with zero_engine.zero.GatheredParameters([dense, expert]):  # what a forward gathers
        gathered = [p.detach().clone() for p in (dense, expert)]
    x, y = make_batches(model.cfg, 1, 2, seed=rank)[0]
    engine.backward(engine(x, y))
    engine.step()
    stepped = safe_get_full_fp32_param(expert)
    engine.destroy()
    return after, gathered, bool(torch.isfinite(stepped).all())


@pytest.mark.parametrize("stage", [3, 2])
def test_gathered_parameters_with_a_modifier_rank_edits_experts_within_their_edp_group(stage):
    """World 4 at ep 2: rank 0's edit of a dense weight reaches every rank; an expert weight's edp group (ranks 0 and
    2 hold ep rank 0's experts, 1 and 3 ep rank 1's) takes its member 0's: rank 0's edit for ep rank 0's experts, rank
    1's for ep rank 1's. Shards, fp32 masters and what the next gather gives agree, and a step trains on them."""
    results = run_ranks(_modifier_body, 4, stage, timeout=TIMEOUT)
    for rank, (after, gathered, finite) in enumerate(results):
        ep_rank = rank % 2
        for values in (after, gathered):
            assert torch.equal(values[0], torch.full_like(values[0], 1.0)), (rank, "dense")
            assert torch.equal(values[1], torch.full_like(values[1], ep_rank + 1.0)), (rank, "expert")
        assert finite


# ---- parameter offload -----------------------------------------------------------------------------------------
def _offload_body(scratch: str, offload: str | None, precision: str):
    """The MoE GPT at ep 2 (world 4), 3 steps of 2 micro-steps, its parameters' shards on the device, on the host or
    on NVMe; then save_16bit_model into ``scratch``."""
    import os

    from zero_engine.testing.loop import train_global_batch
    from zero_engine.testing.shards import gathered_params
    from zero_engine.utils import safe_get_full_fp32_param

    zero = {}
    if offload == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": scratch, "buffer_size": 4000, "buffer_count": 5,
                                 "max_in_cpu": 6000}  # a few buckets in memory at a time: read in step after step
    elif offload == "cpu":
        zero["offload_param"] = {"device": "cpu"}
    config = ds_config(stage3_gather_16bit_weights_on_model_save=True, **zero)
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    model = moe_gpt(expert_parallel_groups(2))
    engine, *_ = zero_engine.initialize(model=model, config=config)
    losses = [train_global_batch(engine, x, y, 2, 2) for x, y in make_batches(model.cfg, 3, 16, seed=5)]
    whole = gathered_params(engine)  # reads the shards in from wherever they are; experts: this rank's
    whole.update({f"fp32/{name}": safe_get_full_fp32_param(p) for name, p in model.named_parameters()})
    reads = engine.param_swapper.reads if engine.param_swapper is not None else 0
    engine.save_16bit_model(scratch, "model16.bin")  # reads an expert's shards in for its gather over the world
    if dist.get_rank() == 0:
        whole.update({f"16bit/{k}": v for k, v in torch.load(os.path.join(scratch, "model16.bin")).items()})
    engine.destroy()
    return losses, whole, reads


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_experts_with_parameter_offload_train_bitwise_as_without(tmp_path, precision):
    """Offload moves the shards, not their values, dense and expert alike (an expert's shard is its edp group's):
    the losses, weights and fp32 masters are those with every shard on the device, also with the shards read from
    their files step after step; so is what save_16bit_model writes."""
    (tmp_path / "device").mkdir()
    on_device = run_ranks(_offload_body, 4, str(tmp_path / "device"), None, precision, timeout=TIMEOUT)
    assert any(name.startswith("16bit/") for name in on_device[0][1])
    for offload in ("cpu", "nvme"):
        scratch = tmp_path / offload
        scratch.mkdir()
        offloaded = run_ranks(_offload_body, 4, str(scratch), offload, precision, timeout=TIMEOUT)
        for (losses, whole, reads), (expected_losses, expected, _) in zip(offloaded, on_device):
            assert reads > 20 or offload == "cpu", reads
            assert losses == expected_losses, (offload, losses, expected_losses)
            assert all(torch.equal(whole[n], expected[n]) for n in expected), offload


# ---- ZeRO++ hpZ ------------------------------------------------------------------------------------------------
def _hpz_body():
    """World 8 at ep 2 (edp groups of 4), bf16, flat ZeRO-3 and hpZ 2: an expert's secondary over 2 ranks of its edp
    group ([Note: hpZ of experts] in zero/expert.py), a dense one's over 2 consecutive ranks."""
    from zero_engine.testing.loop import train_global_batch
    from zero_engine.testing.shards import gathered_params

    runs = {}
    for hpz in (1, 2):
        model = moe_gpt(expert_parallel_groups(2))
        config = dict(ds_config(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=10**6,
                                zero_hpz_partition_size=hpz), bf16={"enabled": True})
        engine, *_ = zero_engine.initialize(model=model, config=config)
        losses = []
        for x, y in make_batches(model.cfg, 3, 8 * 2 * 2, seed=5):
            engine.reset_comm_stats()
            losses.append(train_global_batch(engine, x, y, 2, 2))
        group = engine.shard_groups[id(model.blocks[0].mlp.experts.w1)]
        members = dist.get_process_group_ranks(group.hpz_comm.group) if group.hpz_comm is not None else None
        runs[hpz] = losses, gathered_params(engine), engine.comm_stats(by_group=True), members
        engine.destroy()
    (flat_losses, flat_values, _, _), (losses, values, stats, members) = runs[1], runs[2]
    same = losses == flat_losses and all(torch.equal(values[n], flat_values[n]) for n in values)
    return same, members, {name: group["all_gather"]["bytes"] for name, group in stats.items()}


def test_hpz_with_experts_is_bitwise_flat_zero3_with_expert_gathers_within_their_secondary_group():
    """hpZ 2 at world 8, ep 2: losses and weights bitwise those of flat ZeRO-3; an expert's secondary group is 2
    ranks of its edp group (ep apart: ranks r and r + 2), and backward gathers the experts there."""
    from zero_engine.testing._pool import discard_pool, get_pool

    results = run_ranks(_hpz_body, 8, timeout=TIMEOUT)
    discard_pool(8, get_pool(8))  # its ranks' memory back now, not at exit
    for rank, (same, members, gathered) in enumerate(results):
        assert same
        base = rank % 2 + rank // 4 * 4  # ep rank + the first world rank of its block of 2 edp ranks
        assert members == [base, base + 2], (rank, members)
        assert gathered["hpz ep_size_2"] > 0 and gathered["hpz"] > 0, gathered


# ---- bad input and what is not supported yet --------------------------------------------------------------------
def _refusal_body(case: str):
    try:
        with zero_engine.zero.Init(enabled=case.startswith("zero.Init")):
            model = moe_gpt(expert_parallel_groups(2)) if case != "ep_size_3" else moe_gpt()
            if case == "zero.Init re-init":  # as a parent's post_init would
                torch.nn.init.zeros_(model.blocks[0].mlp.experts.w1)
    except NotImplementedError as err:
        return type(err).__name__, str(err)
    config = ds_config()
    if case == "MiCS":
        config["zero_optimization"]["mics_shard_size"] = 1  # 2 replicas of a 1-rank shard group
    elif case in ("ep_size_3", "bad name"):
        for p in model.blocks[0].mlp.experts.parameters():
            p.allreduce, p.group_name = False, "ep_size_3" if case == "ep_size_3" else "experts"
    try:
        engine, *_ = zero_engine.initialize(model=model, config=config)
    except (ValueError, NotImplementedError) as err:
        return type(err).__name__, str(err)
    engine.destroy()
    return None


@pytest.mark.parametrize("case, kind, message", [
    ("MiCS", "NotImplementedError", r"blocks\.0\.mlp\.experts\.w1 is an expert parameter .*a hierarchical mesh "
                                    r".*not supported yet"),
    ("ep_size_3", "ValueError", r"blocks\.0\.mlp\.experts\.w1: group_name 'ep_size_3': ep size 3 does not divide the "
                                r"data-parallel world of 2 ranks"),
    ("bad name", "ValueError", r"blocks\.0\.mlp\.experts\.w1: group_name 'experts' is not understood"),
    ("zero.Init re-init", "NotImplementedError", r"zero\.Init: zero_ on w1, an MoE expert parameter \(ep_size_2\) "
                                                 r"partitioned over .* not supported yet"),
])
def test_expert_parallel_refuses_what_it_cannot_do_naming_the_parameter(case, kind, message):
    import re

    for result in run_ranks(_refusal_body, 2, case, timeout=TIMEOUT):
        assert result is not None and result[0] == kind and re.search(message, result[1]), result
