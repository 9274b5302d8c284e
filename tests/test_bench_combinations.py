"""bench/combinations.py draws configurations that say what they test: every value of its grid reaches the config
it builds (or is turned off where its stage and world do not use it), and a short run of draws judges them."""

import sys
from pathlib import Path

import pytest
import torch

from zero_engine.config.loader import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import combinations  # noqa: E402

BASE = {name: values[0] for name, values in combinations.GRID.items()}


@pytest.mark.parametrize("name", sorted(combinations.GRID))
def test_every_value_of_the_grid_loads_as_a_config_of_its_own(name, tmp_path):
    for value in combinations.GRID[name]:
        for world in (2, 4):
            draw = combinations.effective({**BASE, "stage": 3, "world": world, name: value})
            config = load_config(combinations.ds_config(draw, str(tmp_path)), world_size=world)
            zero = config.zero_optimization
            if name == "offload_param" and value:
                assert zero.offload_param.device == value
            if name == "zeropp" and value == "hpZ":
                assert zero.zero_hpz_partition_size == (2 if world == 4 else 1)
            if name == "compile":
                assert config.compile.enabled == (value is not None)
                assert config.compile.traced == (value == "traced")
            if name == "optimizer":
                assert (config.optimizer is None) == (value == "client")
                if value != "client":
                    assert config.optimizer.type == value.split()[0].lower()
                    assert config.optimizer.adam_w_mode == (value != "Adam (L2)")
            if name == "torch_adam":
                assert config.optimizer.torch_adam == value
            if name == "scheduler":
                assert (config.scheduler is None) == (value is None)
                if value:
                    assert config.scheduler.type.lower() == value.lower()
            if name == "fp16_scale_power":
                fp16 = load_config(combinations.ds_config(combinations.effective(
                    {**BASE, "precision": "fp16", name: value}), str(tmp_path)), world_size=world).fp16
                assert fp16.initial_scale_power == value


def test_what_a_stage_does_not_use_is_turned_off():
    draw = combinations.effective(dict(BASE, stage=2, offload_param="nvme", zeropp="qwZ", leaf=True, zero_init=True,
                                       compile="traced", precision="bf16", fp16_scale_power=16))
    assert draw["offload_param"] is None and draw["zeropp"] is None and draw["leaf"] is None
    assert draw["zero_init"] is None and draw["compile"] is None and draw["fp16_scale_power"] is None
    assert combinations.effective(dict(BASE, world=2, tp=True))["tp"] is None  # tp 2 needs dp 2: world 4
    assert combinations.effective(dict(BASE, world=4, tp=True, stage=0))["tp"] is None
    assert combinations.effective(dict(BASE, world=4, tp=True, stage=3, zero_init=True))["zero_init"] is None
    assert "offload_param" not in combinations.ds_config(draw, "/tmp")["zero_optimization"]
    llama = combinations.effective(dict(BASE, model="llama", world=4, tp="parallelize_module", block_twice=True,
                                        branch="some ranks"))
    assert (llama["tp"], llama["block_twice"], llama["branch"]) == ("autotp", None, None)
    assert combinations.ds_config(llama, "/tmp")["tensor_parallel"] == {"autotp_size": combinations.TP}
    gpt = combinations.effective(dict(BASE, world=4, tp="autotp"))  # its 3 heads: the MLPs alone are split
    assert gpt["tp"] == "parallelize_module" and "tensor_parallel" not in combinations.ds_config(gpt, "/tmp")
    for tp in ("parallelize_module", "autotp"):
        assert combinations.effective(dict(BASE, model="llama", stage=3, world=4, tp=tp, zeropp="MiCS"))["zeropp"] \
            is None
    assert combinations.effective(dict(BASE, stage=2, world=4, experts=2))["experts"] == 2  # at every stage
    assert combinations.effective(dict(BASE, stage=2, world=4, experts=2, load_stage=0))["load_stage"] == 0
    assert combinations.effective(dict(BASE, stage=3, world=3, experts=2))["experts"] == 1  # ep 2 divides the world
    assert combinations.effective(dict(BASE, stage=3, world=4, experts=2))["experts"] == 2
    assert combinations.effective(dict(BASE, world=4, experts=2, tp="parallelize_module"))["experts"] is None
    assert combinations.effective(dict(BASE, model="llama", experts=1))["experts"] is None
    assert combinations.effective(dict(BASE, world=4, tp="autotp", frozen_copy=True))["frozen_copy"] is None
    for stage, frozen_stage in ((1, 0), (2, 0), (3, 3)):  # as TRL prepares a DPO reference model
        config = combinations.ds_config(dict(BASE, stage=stage, offload_optimizer="cpu"), "/tmp")
        frozen = combinations.frozen_copy_config(config)
        assert "optimizer" not in frozen and frozen["zero_optimization"]["stage"] == frozen_stage
        assert "offload_optimizer" not in frozen["zero_optimization"]
        assert "offload_optimizer" in config["zero_optimization"]  # the trained model's config is left as it was
    for optimizer in ("SGD", "client"):  # torch_adam picks the kernel of an Adam from the config
        assert combinations.effective(dict(BASE, optimizer=optimizer, torch_adam=True))["torch_adam"] is None
    assert combinations.effective(dict(BASE, world=1, branch="some ranks"))["branch"] == "some steps"
    assert combinations.effective(dict(BASE, world=2, branch="some ranks"))["branch"] == "some ranks"
    assert set(combinations.GRID["world"]) <= set(combinations.RESHARD_TO)  # every world is loaded on another
    for world in (2, 4):  # experts over ep 2: on another world that 2 divides
        ep_draw = combinations.effective(dict(BASE, stage=3, world=world, experts=2))
        assert combinations.reshard_world(ep_draw) not in (world, 3) and combinations.reshard_world(ep_draw) % 2 == 0
    assert combinations.effective(dict(BASE, model="gpt", generate=True))["generate"] is None  # Hugging Face's
    assert combinations.effective(dict(BASE, model="llama", generate=True))["generate"] is True


def test_a_given_draw_is_the_grids_first_values_with_those_given():
    draw = combinations.given_draw('{"model": "llama", "world": 4, "tp": "parallelize_module", "generate": true}')
    assert draw == combinations.effective(dict(BASE, model="llama", world=4, tp="parallelize_module", generate=True))
    assert draw["tp"] == "autotp"  # and turned into what runs, as a random draw is
    with pytest.raises(SystemExit, match=r"\['modle'\] are not dimensions of the grid"):
        combinations.given_draw('{"modle": "llama"}')


def test_the_resharded_load_runs_at_the_draws_load_stage():
    up = combinations.effective(dict(BASE, stage=1, load_stage=3, offload_optimizer="cpu"))
    loading = combinations.loading_draw(up, 2)
    assert loading["stage"] == 3 and loading["load_stage"] is None and loading["offload_optimizer"] == "cpu"
    assert all(loading[name] == combinations.GRID[name][0] for name in combinations.STAGE_3_ONLY)
    down = combinations.loading_draw(combinations.effective(dict(BASE, stage=3, load_stage=2, offload_param="cpu",
                                                                  zeropp="qwZ", compile="traced")), 2)
    assert down["stage"] == 2 and down["offload_param"] is None and down["zeropp"] is None and not down["compile"]
    same = combinations.effective(dict(BASE, stage=3, load_stage=3))
    assert same["load_stage"] is None and combinations.loading_draw(same, 2) is same
    tp = combinations.effective(dict(BASE, world=4, stage=2, tp="parallelize_module", load_stage=0))
    assert tp["load_stage"] is None  # stage 0 with tp is not supported
    hpz = combinations.effective(dict(BASE, world=4, stage=3, zeropp="hpZ", tp="parallelize_module"))
    assert hpz["zeropp"] == "hpZ" and combinations.loading_draw(hpz, 4) is hpz
    assert combinations.loading_draw(hpz, 2) == {**hpz, "zeropp": None}  # tp 2 of 2 ranks: a data-parallel world of 1


def test_stage_0_runs_a_tp_draw_on_its_dp_ranks_and_each_tp_rank_compares_with_its_dp_rank():
    assert combinations.per_rank([[1.0], [2.0]], dict(BASE, tp=True)) == [[1.0], [1.0], [2.0], [2.0]]
    assert combinations.per_rank([[1.0], [2.0]], dict(BASE, tp=False)) == [[1.0], [2.0]]


def test_a_few_draws_train_to_stage_0s_losses_and_resume_bitwise(capsys, monkeypatch):
    # seed 11: a Llama with AutoTP, qgZ and generate at world 4, resumed and loaded at stage 1 on 2 ranks; the GPT
    # with MoE layers and a frozen copy at stage 1, world 4; a branch on some ranks at stage 3 (diverged, as it must)
    # (23 s; no compile, whose first step costs the most)
    monkeypatch.setattr(sys, "argv", ["combinations.py", "--draws", "3", "--seed", "11", "--steps", "4"])
    assert combinations.main() == 0
    out = capsys.readouterr().out
    assert "outcomes:" in out and "BAD" not in out and "ERROR" not in out


def test_the_weights_compared_with_tp_and_adam_leave_out_the_key_bias_alone():
    weights = {"blocks.0.attn.qkv.bias": torch.arange(6.0), "blocks.0.attn.qkv.weight": torch.ones(6, 2),
               "blocks.0.mlp.fc.bias": torch.arange(3.0)}
    kept = combinations.seen_by_the_loss(weights)
    assert kept.keys() == weights.keys()
    assert kept["blocks.0.attn.qkv.bias"].tolist() == [0.0, 1.0, 4.0, 5.0]  # q's and v's thirds: k's is left out
    assert kept["blocks.0.attn.qkv.weight"] is weights["blocks.0.attn.qkv.weight"]
    assert kept["blocks.0.mlp.fc.bias"] is weights["blocks.0.mlp.fc.bias"]
    assert combinations.seen_by_the_loss("refused") == "refused"
