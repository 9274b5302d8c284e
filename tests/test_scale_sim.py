"""bench/scale_sim.py on a fast subset: the LLaMA-7B shape partitioned at 8..1024 ranks on the fake process group,
one real engine step on meta tensors at the extremes, and the estimator agreeing with both.

The full table (every power of two with a step) is ``python bench/scale_sim.py``; here the engine step runs at two
world sizes of the 7B model and at awkward ones for a small model whose sizes are not multiples of the world size
(LLaMA-7B's tensors all have a dimension of 4096, so powers of two up to 4096 never pad them).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from zero_engine.testing.models import GPT, GPTConfig

pytestmark = pytest.mark.timeout(120)

_PATH = Path(__file__).resolve().parents[1] / "bench" / "scale_sim.py"
_spec = importlib.util.spec_from_file_location("bench_scale_sim", _PATH)
scale_sim = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = scale_sim  # dataclasses look their module up while the file executes
_spec.loader.exec_module(scale_sim)

LLAMA_7B_PARAMS = 6_738_415_616


def small_gpt_on_meta():
    with torch.device("meta"):
        return GPT(GPTConfig(frozen_param=True))


def test_llama_7b_shape_on_meta_costs_no_memory():
    model = scale_sim.llama_7b_on_meta()
    assert sum(p.numel() for p in model.parameters()) == LLAMA_7B_PARAMS
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_partitioning_and_estimate_at_every_power_of_two():
    results = scale_sim.simulate(worlds=scale_sim.DEFAULT_WORLDS, step=False)
    assert [r.world_size for r in results] == [8, 16, 32, 64, 128, 256, 512, 1024]
    for r in results:
        assert r.padding_numel == 0  # see the module docstring
        assert r.per_rank_shard_numel * r.world_size == LLAMA_7B_PARAMS
        assert r.estimated["model_states"] == 16 * LLAMA_7B_PARAMS // r.world_size
        assert r.estimated_bf16["model_states"] == 16 * LLAMA_7B_PARAMS // r.world_size
    table = scale_sim.table(results)
    assert table.count("\n") == len(results) + 1 and "| 1024 | 25.10 MiB |" in table


@pytest.mark.parametrize("world", [8, 1024])
def test_engine_step_on_fake_world_agrees_with_estimator_7b(world):
    # simulate_world raises SimulationMismatch on any disagreement; also check the numbers directly.
    result = scale_sim.simulate_world(scale_sim.llama_7b_on_meta, world,
                                      zero={"stage": 3, "stage3_max_reuse_distance": 0})
    for key in scale_sim.MODEL_STATE_KEYS:
        assert result.measured[key] == result.estimated[key], key
    assert result.measured["grads"] == 4 * LLAMA_7B_PARAMS // world
    gathered, est = result.measured["params_gathered_peak"], result.estimated
    assert est["params_gathered_min"] <= gathered <= est["params_gathered_peak"] <= 1.05 * gathered


@pytest.mark.parametrize("world", [24, 1000])
def test_engine_step_pads_odd_sizes_and_agrees_with_estimator(world):
    result = scale_sim.simulate_world(small_gpt_on_meta, world,
                                      zero={"stage": 3, "stage3_param_persistence_threshold": 40,
                                            "stage3_prefetch_bucket_size": 3000, "stage3_max_reuse_distance": 0})
    assert result.padding_numel > 0 and result.estimated["padding_numel"] == result.padding_numel
    numels = [p.numel() for p in small_gpt_on_meta().parameters()]
    assert result.per_rank_shard_numel == sum(-(-n // world) for n in numels)
    assert result.measured["params_sharded"] == 4 * result.per_rank_shard_numel


def test_a_wrong_partition_rule_is_caught(monkeypatch):
    """The check restates the rule itself; a partitioner that pads a whole extra element per rank whenever the size
    divides evenly (numel // world + 1) must fail it."""
    import zero_engine.zero.partition as partition

    monkeypatch.setattr(partition, "shard_numel_for", lambda numel, world: numel // world + 1)
    with pytest.raises(scale_sim.SimulationMismatch, match="ceil"):
        scale_sim.simulate_world(small_gpt_on_meta, 8, step=False)


def test_a_wrong_estimate_is_caught(monkeypatch):
    real = scale_sim.estimate_rank_memory

    def no_padding(counts, world, *args, **kwargs):  # a flat-count estimate of the same model: padding ignored
        flat = scale_sim.ModelCounts((counts.total_params,), (True,), counts.layers, counts.largest_layer_params)
        return real(flat, world, *args, **kwargs)

    monkeypatch.setattr(scale_sim, "estimate_rank_memory", no_padding)
    with pytest.raises(scale_sim.SimulationMismatch, match="estimator"):
        scale_sim.simulate_world(small_gpt_on_meta, 24, step=False)


def test_script_prints_the_table(capsys):
    assert scale_sim.main(["--worlds", "8", "1024", "--no-step"]) == 0
    out = capsys.readouterr().out
    assert "6,738,415,616 parameters" in out and "| 8 | 3.14 GiB |" in out
