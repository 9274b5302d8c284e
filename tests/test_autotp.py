"""AutoTP (zero_engine/autotp.py): the standard tensor-parallel plan on a pure tp mesh of 2, against one process.

Bodies named ``_*_body`` run on every rank of the simulated world (module level, so the rank pool imports them).
Each rank builds the model from the same seed, keeps an unsplit copy as the one-process reference, splits the other
with ``apply_autotp`` and feeds both the same batch (a tp group sees one batch).

Tolerances. A row-wise Linear sums its partial products over the tp ranks (an all-reduce) instead of in one matmul,
and a column-wise Linear's input gradient likewise, so sums run in another order: fp32 results differ by rounding
only, ~5e-7 relative here. Losses and every gradient (split ones gathered with ``DTensor.full_tensor()``) match
within 1e-5 relative (L2 per parameter), and after three steps of torch's own SGD / AdamW on the DTensor and plain
parameters so does the whole model (L2 over every parameter). Per parameter, SGD (linear in the gradient) stays
within 1e-5; AdamW divides by sqrt(v), which turns rounding into an update of up to lr where a gradient is zero in
exact arithmetic: a key projection's bias (softmax ignores a shift that is the same for every key) moves by
rounding noise on both sides, 2e-4..6e-4 relative of its tiny norm. So AdamW is held to 1e-3 per parameter. A
wrong split (the GPT's fused qkv as one plain ColwiseParallel, rank 0 holding all of q and half of k) misses the
gradient bound by more than three orders of magnitude (test_a_wrong_split_is_caught_by_the_parity_bound).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from zero_engine.autotp import KEY, apply_autotp, autotp_mesh, autotp_plan
from zero_engine.config import ConfigError
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPT, GPTConfig, make_batches

transformers = pytest.importorskip("transformers")

TIMEOUT = 120
TP = 2
TOLERANCE = 1e-5
ADAMW_PER_PARAMETER = 1e-3  # see the module docstring: a key bias has no gradient but rounding
TINY_GPT = GPTConfig(vocab_size=61, block_size=12, n_layer=2, n_head=4, n_embd=32, mlp_hidden=72)


def tiny_hf(family: str, attn: str = "sdpa", heads: int = 4, kv_heads: int = 2, intermediate: int = 48,
            hidden: int = 32):
    """A random-init transformers causal LM of the family, about 20k parameters."""
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    config = config_class(vocab_size=64, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64)
    config._attn_implementation = attn
    return model_class(config)


def _model(family: str, attn: str):
    torch.manual_seed(0)
    if family == "gpt":
        return GPT(TINY_GPT)
    return tiny_hf(family, attn)


def _loss(model, family, x, y):
    if family == "gpt":
        return model(x, y)
    return model(input_ids=x, labels=x).loss  # transformers shifts the labels itself


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# ---- parity with one process ----------------------------------------------------------------------------------------
def _parity_body(family, attn, optimizer):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    model = _model(family, attn)
    reference = copy.deepcopy(model)
    apply_autotp(model, init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",)))
    split = {name: (tuple(p.to_local().shape), tuple(p.shape)) for name, p in model.named_parameters()
             if isinstance(p, DTensor)}

    def make_opt(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1) if optimizer == "AdamW" else \
            torch.optim.SGD(params, lr=0.1, momentum=0.9)

    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    ref_params = dict(reference.named_parameters())
    loss_errors, grad_errors = [], {}
    for step, (x, y) in enumerate(make_batches(TINY_GPT, 3, 4, seed=dist.get_rank() * 0)):  # one batch per tp group
        loss, ref_loss = _loss(model, family, x, y), _loss(reference, family, x, y)
        loss.backward()
        ref_loss.backward()
        loss_errors.append(abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        if step == 0:
            grad_errors = {name: _relative(_full(p.grad), ref_params[name].grad)
                           for name, p in model.named_parameters()}
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ours = {name: _full(p.detach()) for name, p in model.named_parameters()}
    param_errors = {name: _relative(ours[name], ref_params[name].detach()) for name in ours}
    whole = _relative(torch.cat([t.flatten() for t in ours.values()]),
                      torch.cat([ref_params[name].detach().flatten() for name in ours]))
    return max(loss_errors), grad_errors, param_errors, whole, split


def _check_parity(results, expected_split, optimizer):
    per_parameter = TOLERANCE if optimizer == "SGD" else ADAMW_PER_PARAMETER
    for loss_error, grad_errors, param_errors, whole, split in results:
        assert loss_error < TOLERANCE, loss_error
        worst_grad = max(grad_errors, key=grad_errors.get)
        assert grad_errors[worst_grad] < TOLERANCE, (worst_grad, grad_errors[worst_grad])
        assert whole < TOLERANCE, whole
        worst_param = max(param_errors, key=param_errors.get)
        assert param_errors[worst_param] < per_parameter, (worst_param, param_errors[worst_param])
        for name, (local, full) in expected_split.items():
            assert split[name] == (local, full), (name, split.get(name))
    assert results[0][-1] == results[1][-1]


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_gpt_matches_one_process(optimizer):
    results = run_ranks(_parity_body, TP, "gpt", None, optimizer, timeout=TIMEOUT)
    _check_parity(results, optimizer=optimizer, expected_split={
        "blocks.0.attn.qkv.weight": ((48, 32), (96, 32)), "blocks.0.attn.qkv.bias": ((48,), (96,)),
        "blocks.0.attn.proj.weight": ((32, 16), (32, 32)), "blocks.0.attn.proj.bias": ((32,), (32,)),
        "blocks.1.mlp.fc.weight": ((36, 32), (72, 32)), "blocks.1.mlp.proj.weight": ((32, 36), (32, 72)),
    })
    split = results[0][-1]
    assert not any(name.startswith(("wte", "wpe", "ln_f")) or ".ln_" in name for name in split)  # replicated


LLAMA_SPLIT = {
    "model.layers.0.self_attn.q_proj.weight": ((16, 32), (32, 32)),  # 4 heads of 8: 2 per rank
    "model.layers.0.self_attn.k_proj.weight": ((8, 32), (16, 32)),  # 2 kv heads: 1 per rank
    "model.layers.1.self_attn.v_proj.weight": ((8, 32), (16, 32)),
    "model.layers.1.self_attn.o_proj.weight": ((32, 16), (32, 32)),
    "model.layers.0.mlp.gate_proj.weight": ((24, 32), (48, 32)),
    "model.layers.0.mlp.up_proj.weight": ((24, 32), (48, 32)),
    "model.layers.1.mlp.down_proj.weight": ((32, 24), (32, 48)),
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llama_matches_one_process(attn):
    results = run_ranks(_parity_body, TP, "llama", attn, "AdamW", timeout=TIMEOUT)
    _check_parity(results, LLAMA_SPLIT, "AdamW")
    split = results[0][-1]
    assert len(split) == 2 * 7  # the seven Linears of each layer (no biases), nothing else
    assert "model.embed_tokens.weight" not in split and "lm_head.weight" not in split


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_llama_shaped_families_match_one_process(family):
    expected = dict(LLAMA_SPLIT)
    if family == "qwen2":  # q/k/v carry biases, split with their rows
        expected["model.layers.0.self_attn.q_proj.bias"] = ((16,), (32,))
        expected["model.layers.0.self_attn.k_proj.bias"] = ((8,), (16,))
    optimizer = "AdamW" if family == "qwen2" else "SGD"
    _check_parity(run_ranks(_parity_body, TP, family, "sdpa", optimizer, timeout=TIMEOUT), expected, optimizer)


def _wrong_plan_body():
    """The test's power: the GPT's fused qkv split as one plain ColwiseParallel hands rank 0 all of q and half of k."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model("gpt", None)
    reference = copy.deepcopy(model)
    plan = {f"blocks.{i}.{name}": style() for i in range(TINY_GPT.n_layer) for name, style in
            (("attn.qkv", ColwiseParallel), ("attn.proj", RowwiseParallel), ("mlp.fc", ColwiseParallel),
             ("mlp.proj", RowwiseParallel))}
    parallelize_module(model, init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",)), plan)
    x, y = make_batches(TINY_GPT, 1, 4)[0]
    model(x, y).backward()
    reference(x, y).backward()
    name = "blocks.0.attn.qkv.weight"
    return _relative(_full(model.get_parameter(name).grad), reference.get_parameter(name).grad)


def test_a_wrong_split_is_caught_by_the_parity_bound():
    assert min(run_ranks(_wrong_plan_body, TP, timeout=TIMEOUT)) > 1e3 * TOLERANCE


# ---- the mesh -------------------------------------------------------------------------------------------------------
def _mesh_body(autotp_size):
    mesh = autotp_mesh(dist.get_world_size(), autotp_size, "cpu")
    return (mesh.mesh_dim_names, tuple(mesh.mesh.shape), dist.get_process_group_ranks(mesh.get_group("tp")),
            dist.get_process_group_ranks(mesh.get_group("dp")))


def test_mesh_puts_consecutive_ranks_in_a_tp_group():
    results = run_ranks(_mesh_body, 4, 2, timeout=TIMEOUT)
    assert [r[:2] for r in results] == [(("dp", "tp"), (2, 2))] * 4
    assert [r[2] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[3] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


@pytest.mark.parametrize(("world", "size", "message"), [
    (4, 3, f"{KEY}: 3 does not divide the world of 4 ranks; use one of 1, 2, 4"),
    (4, -1, f"{KEY}: -1; expected a non-negative integer"),
    (4, True, f"{KEY}: True; expected a non-negative integer"),
])
def test_mesh_refuses_a_size_that_does_not_divide_the_world(world, size, message):
    with pytest.raises(ConfigError) as caught:
        autotp_mesh(world, size, "cpu")
    assert str(caught.value).startswith(message)


# ---- bad input: no ranks needed, the plan is checked before anything is split --------------------------------------
def test_unknown_model_is_refused_by_name():
    with pytest.raises(NotImplementedError) as caught:
        autotp_plan(nn.Sequential(nn.Linear(4, 4)), TP)
    message = str(caught.value)
    assert message.startswith(f"{KEY}: AutoTP has no plan for torch.nn.modules.container.Sequential; supported: ")
    assert "LlamaForCausalLM" in message and "zero_engine.testing.models.GPT" in message
    assert "parallelize_module" in message


def test_transformers_model_outside_the_family_is_refused_by_name():
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4)
    with pytest.raises(NotImplementedError, match=r"no plan for transformers\.models\.gpt2\.modeling_gpt2\."
                                                  r"GPT2LMHeadModel; supported: Hugging Face llama"):
        autotp_plan(transformers.GPT2LMHeadModel(config), TP)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"heads": 3, "kv_heads": 3, "hidden": 24},
     f"{KEY}: 2 does not divide LlamaConfig.num_attention_heads = 3 (each tp rank computes whole query and key/value"
     " heads and a slice of the MLP); use an autotp_size that divides num_attention_heads = 3, num_key_value_heads ="
     " 3, intermediate_size = 48: 1, 3"),
    ({"heads": 4, "kv_heads": 1},
     f"{KEY}: 2 does not divide LlamaConfig.num_key_value_heads = 1 "),
    ({"intermediate": 45}, f"{KEY}: 2 does not divide LlamaConfig.intermediate_size = 45 "),
])
def test_sizes_that_do_not_divide_are_refused_naming_the_attribute(kwargs, message):
    model = tiny_hf("llama", **kwargs)
    with pytest.raises(ConfigError) as caught:
        autotp_plan(model, TP)
    assert str(caught.value).startswith(message)


def test_gpt_sizes_that_do_not_divide_are_refused_naming_the_attribute_or_parameter():
    with pytest.raises(ConfigError, match=rf"^{KEY}: 2 does not divide GPTConfig.n_head = 3 "):
        autotp_plan(GPT(GPTConfig()), TP)  # the default test GPT: 3 heads, odd on purpose
    with pytest.raises(ConfigError, match=rf"^{KEY}: 2 does not divide the 129 output features \(column-wise split\)"
                                          r" of blocks.0.mlp.fc.weight \(129, 32\); use an autotp_size that divides "
                                          "129"):
        autotp_plan(GPT(GPTConfig(n_head=4, n_embd=32)), TP)  # MLP width 4 * 32 + 1


def test_plan_names_every_split_linear_and_only_those():
    plan = autotp_plan(tiny_hf("llama"), TP)
    assert sorted(plan) == sorted(f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"))
    base = autotp_plan(tiny_hf("llama").model, TP)  # the base model: no "model." prefix
    assert sorted(base) == sorted(name.removeprefix("model.") for name in plan)
    assert len({id(style) for style in plan.values()}) == len(plan)  # one style object per module


# ---- the config section ---------------------------------------------------------------------------------------------
BATCH = {"train_batch_size": 4}


def test_config_section_loads_deepspeeds_off_values():
    from zero_engine.config import load_config

    cfg = load_config({**BATCH, "tensor_parallel": {
        "autotp_size": 1, "tp_overlap_comm": False, "tp": {"tp_size": 1, "tp_grain_size": 1},
        "keep_module_on_host": False, "partition_config": None, "preset_model": None}}, world_size=1)
    assert (cfg.tensor_parallel.autotp_size, cfg.tensor_parallel.size) == (1, 1)
    assert load_config(BATCH, world_size=1).tensor_parallel.size == 1  # DeepSpeed's default 0: off


@pytest.mark.parametrize(("section", "message"), [
    ({"autotp_size": -1}, f"{KEY}: invalid value -1: input should be greater than or equal to 0"),
    ({"autotp_size": "2"}, f'{KEY}: invalid value "2": expected an integer'),
    ({"autotp_sise": 2}, "tensor_parallel.autotp_sise: unknown key; did you mean autotp_size?"),
    ({"autotp_size": 1, "partition_config": {"use_default_specs": False}},
     'tensor_parallel.partition_config: {"use_default_specs": false} is not supported yet (custom AutoTP partition'),
    ({"tp": {"tp_size": 2}}, 'tensor_parallel.tp: {"tp_size": 2} is not supported yet'),
])
def test_config_section_refuses_what_it_cannot_do(section, message):
    from zero_engine.config import load_config

    with pytest.raises(ConfigError) as caught:
        load_config({**BATCH, "tensor_parallel": section}, world_size=1)
    assert str(caught.value).startswith(message)


def test_config_section_takes_autotp_size_and_the_batch_rule_counts_data_parallel_ranks():
    from zero_engine.config import load_config

    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                       "tensor_parallel": {"autotp_size": 2}}, world_size=2)  # world 4 / tp 2
    assert cfg.tensor_parallel.size == 2 and cfg.train_batch_size == 4


# ---- tensor_parallel.autotp_size through initialize(): ZeRO over dp, AutoTP over tp ---------------------------------
# World 4 = dp 2 x tp 2 (consecutive ranks one tp group). The reference is one process on the whole batch; each dp
# rank trains on its rows, both ranks of its tp group on the same ones. Tolerances as tests/test_tensor_parallel.py:
# losses and the clipped gradient norm within 1e-5, parameters within 1e-5 (SGD) / 2e-4 (AdamW: a zero gradient's
# rounding becomes an update, see the module docstring) relative L2 over the model.
ENGINE_WORLD, ENGINE_DP = 4, 2


def _engine_body(family, stage, optimizer, zero_extra=None):
    """``optimizer`` "SGD" / "AdamW": the config's; "client SGD" / "client AdamW": a torch optimizer built on the model
    before initialize(), so over the parameters AutoTP then replaces with split ones. ``zero_extra``: more
    zero_optimization keys."""
    import zero_engine
    from zero_engine.utils import safe_get_full_fp32_param, tp_full_tensor

    client, optimizer = optimizer.startswith("client "), optimizer.removeprefix("client ")
    lr = 1e-3 if optimizer == "AdamW" else 0.05
    params_cfg = {"lr": lr, "weight_decay": 0.1} if optimizer == "AdamW" else {"lr": lr, "momentum": 0.9}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
              "optimizer": {"type": optimizer, "params": params_cfg}, "tensor_parallel": {"autotp_size": TP},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "reduce_bucket_size": 500, **(zero_extra or {})}}
    torch.manual_seed(dist.get_rank())  # different on every rank: the engine makes them equal before the split
    model = _model(family, "eager") if family != "gpt" else GPT(TINY_GPT)
    torch.manual_seed(0)
    reference = _model(family, "eager")
    rows = torch.utils.data.TensorDataset(torch.arange(16))
    client_optimizer = None
    if client:
        kind = getattr(torch.optim, config.pop("optimizer")["type"])
        client_optimizer = kind(model.parameters(), **params_cfg)
    engine, _, loader, _ = zero_engine.initialize(model=model, optimizer=client_optimizer, config=config,
                                                  training_data=rows)
    first_rows = next(iter(loader))[0].tolist()  # the ranks of a tp group read the same rows
    ref_params = [p for p in reference.parameters()]
    ref_opt = torch.optim.AdamW(ref_params, lr=lr, weight_decay=0.1) if optimizer == "AdamW" else \
        torch.optim.SGD(ref_params, lr=lr, momentum=0.9)
    dp_rank, micro, gas = dist.get_rank() // TP, 2, 2
    cfg = TINY_GPT if family == "gpt" else reference.config
    worst_loss = worst_norm = 0.0
    vocab = cfg.vocab_size
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, vocab, (ENGINE_DP * micro * gas, 12), generator=g)
        y = torch.randint(0, vocab, (ENGINE_DP * micro * gas, 12), generator=g)
        ref_opt.zero_grad()
        ref_loss = _loss(reference, family, x, y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.5).item()
        ref_opt.step()
        total = torch.zeros(())
        for m in range(gas):
            lo = (m * ENGINE_DP + dp_rank) * micro
            loss = _loss(engine, family, x[lo: lo + micro], y[lo: lo + micro])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        ours = total.item() / (ENGINE_WORLD * gas)
        worst_loss = max(worst_loss, abs(ours - ref_loss.item()) / ref_loss.item())
        worst_norm = max(worst_norm, abs(engine.get_global_grad_norm() - ref_norm) / ref_norm)
    ref = dict(reference.named_parameters())
    diff = total_sq = 0.0
    for name, p in engine.module.named_parameters():
        whole = tp_full_tensor(p, safe_get_full_fp32_param(p))
        diff += (whole - ref[name].detach()).pow(2).sum().item()
        total_sq += ref[name].detach().pow(2).sum().item()
    split = sorted(n for n, p in engine.module.named_parameters() if type(p).__name__ == "DTensor")
    where = (engine.mesh.data_parallel_size, engine.mesh.tp_size, engine.dp_world_size, engine.mp_world_size,
             engine.train_batch_size(), engine.get_data_parallel_rank(), engine.get_tensor_parallel_rank())
    engine.destroy()
    return worst_loss, worst_norm, (diff / total_sq) ** 0.5, len(split), where, first_rows


@pytest.mark.parametrize(("family", "stage", "optimizer"), [("gpt", 3, "SGD"), ("gpt", 2, "AdamW"),
                                                             ("llama", 3, "AdamW"), ("llama", 1, "SGD"),
                                                             ("llama", 2, "client SGD"), ("gpt", 3, "client AdamW")])
def test_initialize_with_autotp_size_matches_one_process(family, stage, optimizer):
    """A client optimizer (built before the split) updates the split weights too: before, its groups kept the
    replaced parameters, which the engine dropped, and the split weights never moved (losses 0.7% off)."""
    tolerance = 2e-4 if optimizer.endswith("AdamW") else 1e-5
    results = run_ranks(_engine_body, ENGINE_WORLD, family, stage, optimizer, timeout=TIMEOUT)
    for rank, (loss_err, norm_err, param_err, n_split, where, _) in enumerate(results):
        # micro x gas x dp; the dp and tp coordinates of consecutive ranks in one tp group
        assert where == (ENGINE_DP, TP, ENGINE_DP, TP, 2 * 2 * ENGINE_DP, rank // TP, rank % TP)
        assert n_split > 0
        assert loss_err < 1e-5 and norm_err < 1e-5 and param_err < tolerance, (loss_err, norm_err, param_err)
    rows = [result[-1] for result in results]
    assert rows[0] == rows[1] and rows[2] == rows[3] and rows[0] != rows[2], rows


def test_mics_shard_size_of_every_dp_rank_is_flat_with_autotp():
    """mics_shard_size equal to the dp ranks (the world over tp) is flat ZeRO, as mics_shard_size equal to the world
    is without tp: the same run bitwise. Before, AutoTP's own mesh made it a ConfigError blaming an
    initialize(mesh=...) the user never passed (bench/combinations.py, seed 43)."""
    flat = run_ranks(_engine_body, ENGINE_WORLD, "llama", 3, "SGD", timeout=TIMEOUT)
    mics = run_ranks(_engine_body, ENGINE_WORLD, "llama", 3, "SGD", {"mics_shard_size": ENGINE_DP}, timeout=TIMEOUT)
    assert mics == flat


def _corpus_body(path):
    import json

    import zero_engine

    config = json.loads(Path(path).read_text())
    # what transformers' Trainer integration fills for "auto": micro 2, accumulation 1, clipping 1.0, no fp16/bf16
    config.update(train_batch_size=2 * ENGINE_DP, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
                  gradient_clipping=1.0)
    config["fp16"]["enabled"] = config["bf16"]["enabled"] = False
    torch.manual_seed(0)
    model = tiny_hf("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = zero_engine.initialize(model=model, optimizer=optimizer, config=config)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(dist.get_rank() // TP))
    losses = []
    for _ in range(3):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    stage, tp = engine.stage, engine.mesh.tp_size
    engine.destroy()
    return stage, tp, losses


def test_llama_factory_autotp_corpus_config_trains():
    path = Path(__file__).resolve().parents[2] / "shared" / "dsconfigs" / \
        "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z2_autotp_config.json"
    if not path.is_file():
        pytest.skip(f"{path} is not here (the corpus lives beside the checkout)")
    for stage, tp, losses in run_ranks(_corpus_body, ENGINE_WORLD, str(path), timeout=TIMEOUT):
        assert (stage, tp) == (2, 2)
        assert losses[-1] < losses[0], losses  # the same batch three times: the loss goes down


def _refusal_body(case):
    import zero_engine
    from torch.distributed.device_mesh import init_device_mesh

    config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": TP},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 3}}
    model = GPT(TINY_GPT)
    try:
        if case == "mesh":
            zero_engine.initialize(model=model, config=config,
                                   mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
        elif case == "heads":
            zero_engine.initialize(model=GPT(GPTConfig(vocab_size=61, block_size=12, n_layer=1, n_head=3, n_embd=24,
                                                       mlp_hidden=72)), config=config)
        elif case == "mics":
            config["zero_optimization"]["mics_shard_size"] = 1
            zero_engine.initialize(model=model, config=config)
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize(("case", "message"), [
    ("mesh", "ValueError: tensor_parallel.autotp_size: 2 together with initialize(mesh=...): give one of the two"),
    ("heads", "tensor_parallel.autotp_size: 2 does not divide"),
    ("mics", "NotImplementedError: tensor_parallel.autotp_size with zero_optimization.mics_shard_size"),
])
def test_initialize_refuses_what_autotp_cannot_do(case, message):
    for result in run_ranks(_refusal_body, ENGINE_WORLD, case, timeout=TIMEOUT):
        assert message in result, result


# ---- bench/autotp_sim.py (docs/benchmarks.md's figures) -------------------------------------------------------------
def test_bench_per_rank_count_is_the_formula_on_a_7b_shape():
    path = Path(__file__).resolve().parents[1] / "bench" / "autotp_sim.py"
    spec = importlib.util.spec_from_file_location("bench_autotp_sim", path)
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    row = sim.per_rank("Mistral-7B", 8)  # GQA: 8 key/value heads, one per rank
    assert row["per_rank"] == row["formula"] == 1_134_825_472
    assert row["whole"] == 2 * 32000 * 4096 + 4096 * (2 * 32 + 1)  # embeddings, LM head, norms
