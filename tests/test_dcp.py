"""torch.distributed.checkpoint in and out: an FSDP2 run (fully_shard, gloo, CPU) moves to zero_engine at another
world size and back, through DCP directories converted offline (zero_engine.checkpoint.from_dcp / to_dcp and
`zero-engine convert`).

The run: FSDP2 on 2 ranks trains 3 steps and saves (both layouts: the FSDP2 recipe's model/optim, and torchtitan's
top-level model with the flattened optimizer under "optimizer"), then trains 3 more. The converted checkpoint loads
into a ZeRO-3 engine on 3 ranks, which trains the same 3 steps and saves; that converts back to DCP, which FSDP2 on 2
ranks loads and trains the third step from.

Tolerances: conversion copies values, so what a side loads equals what the other saved bitwise (parameters, Adam's
exp_avg, exp_avg_sq and step). Training after the move is the same math over another split of the same global batch
(FSDP2 averages 2 half-batch gradients, the engine 3 third-batch ones) with another Adam implementation (torch's
foreach AdamW, our CPUAdam kernel): losses within 1e-5 relative, parameters within 1e-5 relative + 1e-6 absolute.

Bodies named ``_*_body`` run on every rank (module level, so the rank pool can import them).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

import zero_engine
from zero_engine.checkpoint import CheckpointError, from_dcp, to_dcp
from zero_engine.cli import main as cli
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPT, GPTConfig, make_batches

TIMEOUT = 180
GLOBAL_BATCH = 12  # split evenly over 2 and over 3 ranks
ADAM = {"lr": 0.02, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SAVE_AT, STEPS = 3, 6


class Net(torch.nn.Module):
    """Odd sizes (shards padded at worlds 2 and 3), a LayerNorm, a persistent buffer, and a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(5, 7)
        self.norm = torch.nn.LayerNorm(7)
        self.out = torch.nn.Linear(7, 3)
        self.frozen = torch.nn.Parameter(torch.linspace(-1, 1, 3), requires_grad=False)
        self.register_buffer("scale", torch.tensor([1.5, 0.5, 1.0]))

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x)))) * self.scale + self.frozen


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the global batch of ``step``."""
    generator = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, 5, generator=generator), torch.randn(GLOBAL_BATCH, 3, generator=generator)
    per_rank = GLOBAL_BATCH // dist.get_world_size()
    rows = slice(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank)
    return x[rows], y[rows]


def loss_of(model, step: int) -> torch.Tensor:
    x, y = batch(step)
    return torch.nn.functional.mse_loss(model(x), y)


def global_loss(loss: torch.Tensor) -> float:
    """The loss over the whole global batch: the mean of the ranks' equal-sized parts."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def engine_config() -> dict:
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // 3, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": dict(ADAM, betas=list(ADAM["betas"]))},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


# ---- FSDP2 side ----------------------------------------------------------------------------------------------------
def _fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"],
                                    weight_decay=ADAM["weight_decay"])


def _full_state(model, optimizer):
    """Whole tensors on every rank: the model's state dict and the optimizer's, keyed by fully qualified name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return ({k: v.detach().clone() for k, v in model_sd.items()},
            {fqn: {k: v.clone() for k, v in s.items()} for fqn, s in optim_sd["state"].items()})


def _fsdp2_train_and_save_body(fsdp2_dir: str, titan_dir: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optimizer = _fsdp2(make_model())
    losses, saved = [], None
    for step in range(STEPS):
        if step == SAVE_AT:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=fsdp2_dir)
            # torchtitan: model at the top level, the optimizer flattened, the step in train_state
            _, flat_optim = get_state_dict(model, optimizer, options=StateDictOptions(
                flatten_optimizer_state_dict=True))
            dcp.save({**model_sd, "optimizer": flat_optim, "train_state": {"step": torch.tensor(SAVE_AT)}},
                     checkpoint_id=titan_dir)
            saved = _full_state(model, optimizer)
        loss = loss_of(model, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_loss(loss))
    return losses, saved, _full_state(model, optimizer)


def _fsdp2_load_body(dcp_dir: str, layout: str, step: int):
    """Load a DCP directory into a fresh FSDP2 model (another seed), return what it holds, then train one step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    torch.manual_seed(1234)
    model, optimizer = _fsdp2(Net())
    loss_of(model, 0).backward()  # Adam's states exist after a first step; load_state_dict replaces them
    optimizer.step()
    optimizer.zero_grad()
    options = StateDictOptions(flatten_optimizer_state_dict=layout == "torchtitan")
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if layout == "fsdp2":
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=dcp_dir)
        model_sd, optim_sd = state["model"], state["optim"]
    else:
        state = {**model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=dcp_dir)
        optim_sd = state.pop("optimizer")
        model_sd = state
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    loaded = _full_state(model, optimizer)
    loss = loss_of(model, step)
    loss.backward()
    optimizer.step()
    return loaded, global_loss(loss), _full_state(model, optimizer)


# ---- zero_engine side ----------------------------------------------------------------------------------------------
def _engine_full_state(engine):
    """Whole fp32 parameters and Adam states, gathered from every rank's shards (stage 0: rank 0's copies)."""
    from zero_engine.checkpoint._views import param_views

    params, states = {}, {}
    optimizer = engine.optimizer.optimizer
    for v in param_views(engine):
        if engine.stage == 0:
            params[v.info.name] = v.param.detach().clone()
            if optimizer.state.get(v.opt_param):
                states[v.info.name] = {k: s.clone() for k, s in optimizer.state[v.opt_param].items()}
            continue
        n = v.stop - v.start
        pieces = {"param": (v.master if v.master is not None else v.shard)[:n]}
        state = optimizer.state.get(v.opt_param, {}) if v.opt_param is not None else {}
        if state:
            pieces.update({k: s.reshape(-1)[:n] for k, s in optimizer.state[v.opt_param].items() if s.dim() > 0})
        for key, piece in pieces.items():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, piece.clone())
            whole = torch.cat(gathered).view(v.info.shape)
            if key == "param":
                params[v.info.name] = whole
            else:
                states.setdefault(v.info.name, {})[key] = whole
        if state:
            states[v.info.name]["step"] = state["step"].clone()
    return params, states


def _engine_load_body(ours_dir: str, config: dict, module_only: bool):
    """Load a converted checkpoint at the config's stage and dtype; what it holds, and its 16-bit shards' fidelity."""
    from zero_engine.checkpoint._views import param_views

    torch.manual_seed(99)
    engine, _, _, _ = zero_engine.initialize(model=Net(), config=config)
    engine.load_checkpoint(ours_dir, load_module_only=module_only)
    compute_is_master_cast = all(torch.equal(v.shard, v.master.to(v.shard.dtype)) for v in param_views(engine)
                                 if v.master is not None)
    loaded = _engine_full_state(engine)
    loss = loss_of(engine, SAVE_AT)
    engine.backward(loss)
    engine.step()
    return loaded, compute_is_master_cast, engine.global_steps, global_loss(loss)


def _engine_refused_body(ours_dir: str) -> str:
    """A full resume that load_checkpoint refuses (on every rank together, leaving the engine usable)."""
    engine, _, _, _ = zero_engine.initialize(model=Net(), config=engine_config())
    with pytest.raises(CheckpointError) as refused:
        engine.load_checkpoint(ours_dir)
    return str(refused.value)


def _engine_resume_body(ours_dir: str, save_dir: str):
    torch.manual_seed(99)  # another initialisation: everything must come from the checkpoint
    engine, _, _, _ = zero_engine.initialize(model=Net(), config=engine_config())
    engine.load_checkpoint(ours_dir)
    loaded = _engine_full_state(engine)
    losses = []
    for step in range(SAVE_AT, STEPS):
        if step == STEPS - 1:
            engine.save_checkpoint(save_dir)
            at_save = _engine_full_state(engine)
        loss = loss_of(engine, step)
        engine.backward(loss)
        engine.step()
        losses.append(global_loss(loss))
    return (engine.global_steps, type(engine.optimizer.optimizer).__name__, loaded, losses, at_save,
            _engine_full_state(engine))


# ---- the tests -----------------------------------------------------------------------------------------------------
PARAMS = ("inp.weight", "inp.bias", "norm.weight", "norm.bias", "out.weight", "out.bias", "frozen")
TRAINABLE = PARAMS[:-1]


def assert_states_equal(actual, expected, what: str, exact: bool = True):
    """Parameters and Adam states (exp_avg, exp_avg_sq, step) of every parameter: bitwise, or within 1e-5."""
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    (params, states), (expected_params, expected_states) = actual, expected
    assert sorted(states) == sorted(expected_states) == sorted(TRAINABLE), (what, sorted(states))
    for name in PARAMS:
        torch.testing.assert_close(params[name].float(), expected_params[name], **tol,
                                   msg=lambda m: f"{what}: {name}: {m}")
    for name, entry in expected_states.items():
        assert sorted(states[name]) == sorted(entry) == ["exp_avg", "exp_avg_sq", "step"], (what, name)
        for key, value in entry.items():
            torch.testing.assert_close(states[name][key].float(), value.float(), **tol,
                                       msg=lambda m: f"{what}: {name} {key}: {m}")


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """FSDP2 on 2 ranks: DCP directories saved after SAVE_AT steps (both layouts), its losses and states."""
    directory = tmp_path_factory.mktemp("fsdp2_run")
    fsdp2_dir, titan_dir = str(directory / "fsdp2"), str(directory / "titan")
    (losses, at_save, final), _ = run_ranks(_fsdp2_train_and_save_body, 2, fsdp2_dir, titan_dir, timeout=TIMEOUT)
    return fsdp2_dir, titan_dir, losses, at_save, final


def test_fsdp2_to_zero_engine_and_back(tmp_path, fsdp2_run):
    fsdp2_dir, titan_dir, fsdp2_losses, at_save, fsdp2_final = fsdp2_run

    # DCP -> ours, offline: the command line with the model (for the buffer), and the Python function for torchtitan
    config_file = tmp_path / "ds_config.json"
    config_file.write_text(json.dumps(engine_config()))
    assert cli(["convert", fsdp2_dir, str(tmp_path / "ours"), "--config", str(config_file),
                "--model", "test_dcp:make_model", "--world-size", "2"]) == 0
    titan_ours = from_dcp(titan_dir, tmp_path / "ours_titan", engine_config(), model=make_model())
    assert titan_ours.endswith(f"global_step{SAVE_AT}")  # the step from torchtitan's train_state

    runs = {}
    for name in ("ours", "ours_titan"):
        runs[name] = run_ranks(_engine_resume_body, 3, str(tmp_path / name), str(tmp_path / f"{name}_next"),
                               timeout=TIMEOUT)[0]
    for name, (global_steps, optimizer, loaded, losses, _, final) in runs.items():
        assert global_steps == STEPS and optimizer == "CPUAdam", (name, global_steps, optimizer)
        assert_states_equal(loaded, at_save, f"{name}: loaded into the engine")
        for ours, theirs in zip(losses, fsdp2_losses[SAVE_AT:]):
            assert math.isclose(ours, theirs, rel_tol=1e-5), (name, losses, fsdp2_losses[SAVE_AT:])
        assert_states_equal(final, fsdp2_final, f"{name}: the engine's steps vs FSDP2's", exact=False)
    _, _, _, engine_losses, engine_at_save, engine_final = runs["ours"]

    # ours -> DCP, both layouts, and FSDP2 (another world size than the engine's) takes the last step from each
    back = str(tmp_path / "back")
    assert cli(["convert", str(tmp_path / "ours_next"), back]) == 0
    titan_back = to_dcp(tmp_path / "ours_titan_next", tmp_path / "titan_back", layout="torchtitan")
    for directory, layout in ((back, "fsdp2"), (titan_back, "torchtitan")):
        (loaded, loss, final), _ = run_ranks(_fsdp2_load_body, 2, directory, layout, STEPS - 1, timeout=TIMEOUT)
        assert_states_equal(loaded, engine_at_save, f"{layout}: loaded into FSDP2")
        # the last step, taken by FSDP2 from the converted checkpoint and by the engine
        assert math.isclose(loss, engine_losses[-1], rel_tol=1e-6), (layout, loss, engine_losses)
        assert_states_equal(final, engine_final, f"{layout}: FSDP2's last step vs the engine's", exact=False)
        assert_states_equal(final, fsdp2_final, f"{layout}: FSDP2 after the round trip vs uninterrupted",
                            exact=False)


@pytest.mark.parametrize("stage, dtype", [(0, "fp32"), (1, "bf16"), (3, "fp16")])
def test_converted_checkpoint_loads_at_other_stages_and_dtypes(tmp_path, fsdp2_run, stage, dtype):
    """16-bit runs get fp32 masters equal to the DCP values and compute shards cast from them; stage 0 replicates."""
    fsdp2_dir, _, fsdp2_losses, at_save, _ = fsdp2_run
    config = dict(engine_config(), train_micro_batch_size_per_gpu=GLOBAL_BATCH // 2,
                  zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0})
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    from_dcp(fsdp2_dir, tmp_path / "ours", config, model=make_model(), world_size=3)
    loaded, cast, global_steps, loss = run_ranks(_engine_load_body, 2, str(tmp_path / "ours"), config, False,
                                                 timeout=TIMEOUT)[0]
    # a frozen parameter has no fp32 master in 16-bit training: it is kept in the compute dtype
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    expected = (dict(at_save[0], frozen=at_save[0]["frozen"].to(compute).float()), at_save[1])
    assert_states_equal(loaded, expected, f"stage {stage} {dtype}")
    assert cast and global_steps == SAVE_AT + 1
    # the forward runs in the compute dtype: 16-bit rounding of the parameters and activations
    assert math.isclose(loss, fsdp2_losses[SAVE_AT], rel_tol=1e-5 if dtype == "fp32" else 2e-2), (loss, fsdp2_losses)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in this one process, as intended
def test_weights_only_dcp_loads_with_load_module_only(tmp_path, fsdp2_run):
    """torchtitan's last checkpoint (model_weights_only) has no optimizer: the weights load, the optimizer is fresh;
    a full resume from it is refused."""
    import torch.distributed.checkpoint as dcp

    fsdp2_dir, _, fsdp2_losses, at_save, _ = fsdp2_run
    model_sd = {k: v.clone() for k, v in at_save[0].items()}
    dcp.save(model_sd, checkpoint_id=str(tmp_path / "weights"), no_dist=True)  # top level, as torchtitan's
    from_dcp(tmp_path / "weights", tmp_path / "ours", engine_config(), model=make_model())
    loaded, _, _, loss = run_ranks(_engine_load_body, 2, str(tmp_path / "ours"), engine_config(), True,
                                   timeout=TIMEOUT)[0]
    for name in PARAMS:
        assert torch.equal(loaded[0][name], at_save[0][name]), name
    assert loaded[1] == {}  # no optimizer state loaded: it starts fresh at the next step
    assert math.isclose(loss, fsdp2_losses[SAVE_AT], rel_tol=1e-5)
    refusals = run_ranks(_engine_refused_body, 2, str(tmp_path / "ours"), timeout=TIMEOUT)
    assert all("the optimizer had 0 param groups; this one has 1" in message for message in refusals), refusals


def test_conversion_refusals(tmp_path, fsdp2_run):
    fsdp2_dir = fsdp2_run[0]
    with pytest.raises(CheckpointError, match="not a torch.distributed.checkpoint directory"):
        from_dcp(tmp_path, tmp_path / "ours", engine_config())
    other = torch.nn.Sequential(torch.nn.Linear(5, 7))
    with pytest.raises(CheckpointError, match=r"does not fit the model: missing \['0.weight', '0.bias'\]"):
        from_dcp(fsdp2_dir, tmp_path / "ours", engine_config(), model=other)
    wider = make_model()
    wider.out = torch.nn.Linear(7, 4)
    with pytest.raises(CheckpointError, match=r"out.weight: \[3, 7\] in the checkpoint, \[4, 7\] in the model"):
        from_dcp(fsdp2_dir, tmp_path / "ours", engine_config(), model=wider)
    with pytest.raises(SystemExit, match="needs --config"):
        cli(["convert", fsdp2_dir, str(tmp_path / "ours")])
    ours = from_dcp(fsdp2_dir, tmp_path / "ours", engine_config(), model=make_model())
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        to_dcp(ours, tmp_path / "taken")


# ---- tied weights: a GPT whose lm_head is its embedding ------------------------------------------------------------
GPT_CFG = GPTConfig(n_layer=1, n_embd=12, n_head=2, vocab_size=23, block_size=8)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_CFG)


def _engine_gpt_body(ours_dir: str, save_dir: str, batches):
    torch.manual_seed(7)
    engine, _, _, _ = zero_engine.initialize(model=GPT(GPT_CFG), config=dict(
        engine_config(), train_micro_batch_size_per_gpu=2))
    engine.load_checkpoint(ours_dir)
    losses = []
    for idx, targets in batches:
        half = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
        loss = engine(idx[half], targets[half])
        engine.backward(loss)
        engine.step()
        losses.append(global_loss(loss))
    engine.save_checkpoint(save_dir)
    return losses, _engine_full_state(engine)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in this one process, as intended
def test_tied_weights_round_trip(tmp_path):
    """A checkpoint of a plain (one-process) training run with tied embeddings: both names in DCP, one parameter in
    the engine, both names again on the way back; training continues as the one-process run does (losses 1e-5)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"],
                                  weight_decay=ADAM["weight_decay"])
    batches = make_batches(GPT_CFG, 4, 4)
    losses = []
    for step, (idx, targets) in enumerate(batches):
        if step == 2:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            assert "lm_head.weight" in model_sd and "wte.weight" in model_sd
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    from_dcp(tmp_path / "dcp", tmp_path / "ours", dict(engine_config(), train_micro_batch_size_per_gpu=2),
             model=GPT(GPT_CFG))
    engine_losses, (params, _) = run_ranks(_engine_gpt_body, 2, str(tmp_path / "ours"), str(tmp_path / "next"),
                                           batches[2:], timeout=TIMEOUT)[0]
    for ours, theirs in zip(engine_losses, losses[2:]):
        assert math.isclose(ours, theirs, rel_tol=1e-5), (engine_losses, losses[2:])
    # Relative L2 over all parameters, as test_checkpoint.py at another world size: the key bias of attention has a
    # zero gradient in exact arithmetic, and Adam scales its rounding noise (another split, another kernel) up to lr.
    names = [name for name, _ in model.named_parameters()]
    ours, theirs = (torch.cat([p.reshape(-1) for p in ps]) for ps in (
        [params[n] for n in names], [p.detach() for _, p in model.named_parameters()]))
    assert (ours - theirs).norm() <= 2e-4 * theirs.norm(), ((ours - theirs).norm() / theirs.norm()).item()

    to_dcp(tmp_path / "next", tmp_path / "back")
    back = {"model.wte.weight": torch.empty(23, 12), "model.lm_head.weight": torch.empty(23, 12)}
    dcp.load(back, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    assert torch.equal(back["model.wte.weight"], params["wte.weight"])
    assert torch.equal(back["model.lm_head.weight"], params["wte.weight"])
