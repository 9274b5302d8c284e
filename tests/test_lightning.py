"""zero_engine.lightning.ZeroEngineStrategy against Lightning's DDP strategy (issue 21, item 3).

One launch of tests/lightning_worker.py: Lightning's own subprocess launcher starts 2 CPU ranks (gloo) and every
scenario runs there; the tests below read what rank 0 saved. Tolerances, and why:

* no accumulation, no clipping, fp32: bitwise. The engine averages gradients as (g0 + g1) / 2 and DDP as
  g0 / 2 + g1 / 2, equal in floating point for 2 ranks (halving is exact), and the same torch AdamW runs
  element-wise on the same values (fp32 master shards).
* accumulation with clipping: 1e-6 relative. The engine computes the global norm from per-bucket shard norms in
  float64 and clip_grad_norm_ from per-tensor norms, so the clipping coefficient differs in its last bits, and at
  stages 2-3 the micro-batches' gradients are summed after the reduction instead of before.
* bf16 / fp16: the engine computes in 16 bits from fp32 masters and DDP in fp32: bf16 2e-2 and fp16 2e-3 on the
  losses (8 and 11 mantissa bits over 10 steps).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from session_run import run_in_session

pytest.importorskip("lightning", reason="Lightning is not installed (zero_engine[lightning] extra)")

REPO = Path(__file__).resolve().parents[1]
STAGES = ("zero1", "zero2", "zero3", "zero_registered")


def launch(args, cwd, timeout):
    """Run a script that makes a 2-rank Lightning Trainer (Lightning starts rank 1); its output, checked rc 0."""
    env = {k: v for k, v in os.environ.items()  # this run launches its own ranks: no inherited rank variables
           if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("PL_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    try:  # rank 1 is in the script's session: killed with it
        done = run_in_session([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as timed_out:
        pytest.fail(f"{args[0]} did not finish in {timeout} s:\n{(timed_out.output or '')[-4000:]}")
    assert done.returncode == 0, done.stdout[-6000:]
    return done.stdout


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    launch([str(REPO / "tests" / "lightning_worker.py"), str(out)], cwd=out, timeout=240)
    return dict(torch.load(out / "results.pt", weights_only=False), out=out)


def assert_state_equal(state, reference, rtol=0.0, atol=0.0):
    assert state.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(state[key].float(), reference[key].float(), rtol=rtol, atol=atol, msg=key)


def assert_losses_close(run, reference, rtol=0.0, atol=0.0):
    for rank, (losses, expected) in enumerate(zip(run["losses"], reference["losses"])):
        expected = expected[-len(losses):]  # a resumed run has the last epoch's only
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=rtol, atol=atol,
                                   msg=f"rank {rank}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", STAGES)
def test_stages_1_to_3_train_bitwise_like_ddp(results, run):
    """Stages 1-3 (and strategy="zero_engine") against DDP, 2 epochs of 5 micro-batches per rank: every rank's
    losses, the final parameters (gathered by lightning_module_state_dict) and the validation loss."""
    got, ddp = results[run], results["ddp"]
    assert_losses_close(got, ddp)
    assert_state_equal(got["state"], ddp["state"])
    assert got["val_loss"] == ddp["val_loss"]
    assert got["global_step"] == got["engine_steps"] == ddp["global_step"] == 10
    assert got["dtypes"] == ["torch.float32"]


@pytest.mark.timeout(300)
def test_configure_model_runs_under_zero_init_at_stage_3(results):
    assert results["zero3"]["built_partitioned"] == [True, True]  # each layer a shard once built
    assert results["zero1"]["built_partitioned"] == [False, False]  # stages 1-2 keep whole parameters


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", ["zero1_ga", "zero3_ga"])
def test_accumulation_with_an_epoch_remainder_and_clipping_match_ddp(results, run):
    """accumulate_grad_batches=2 over 5 micro-batches: Lightning steps after micro-batches 2, 4 and 5 of each epoch,
    and so does the engine (6 steps, not 5 as counting micro-batches modulo 2 across epochs would give)."""
    got, ddp = results[run], results["ddp_ga"]
    assert got["global_step"] == got["engine_steps"] == ddp["global_step"] == 6
    assert_losses_close(got, ddp, rtol=1e-6, atol=1e-7)
    assert_state_equal(got["state"], ddp["state"], rtol=1e-6, atol=1e-7)
    assert got["grad_norm"] > 0.05  # the last step was clipped (gradient_clip_val=0.05)


@pytest.mark.timeout(300)
def test_bf16_and_fp16_compute_in_16_bits_close_to_fp32_ddp(results):
    bf16, fp16, ddp = results["zero3_bf16"], results["zero2_fp16"], results["ddp"]
    assert bf16["dtypes"] == ["torch.bfloat16"] and fp16["dtypes"] == ["torch.float16"]
    assert fp16["skipped_steps"] == 0
    assert_losses_close(bf16, ddp, rtol=2e-2, atol=2e-2)
    assert_losses_close(fp16, ddp, rtol=2e-3, atol=2e-3)
    assert_state_equal(bf16["state"], ddp["state"], atol=2e-2)  # the gathered fp32 masters
    assert_state_equal(fp16["state"], ddp["state"], atol=2e-3)
    assert bf16["losses"] != ddp["losses"]  # 16-bit compute, not fp32


@pytest.mark.timeout(300)
def test_manual_optimization_steps_when_opt_step_is_called(results):
    got, ddp = results["zero3_manual"], results["ddp_manual"]
    assert got["global_step"] == got["engine_steps"] == ddp["global_step"] == 10
    assert_losses_close(got, ddp)
    assert_state_equal(got["state"], ddp["state"])


@pytest.mark.timeout(300)
def test_checkpoint_directory_resume_equals_the_uninterrupted_run(results):
    """ModelCheckpoint saves a directory per epoch of the 2-epoch run (accumulation with a remainder); a new Trainer
    and module resume from epoch 1's with fit(ckpt_path=...): epoch 2's losses and the final parameters equal the
    uninterrupted run's bitwise. save_top_k=1 removes the directory it replaces."""
    assert results["checkpoints"] == {"every_epoch": ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"],
                                      "best": ["epoch=1-step=6.ckpt"]}
    resumed, straight = results["zero3_resumed"], results["zero3_ga"]
    assert len(resumed["losses"][0]) == 5
    assert_losses_close(resumed, straight)
    assert_state_equal(resumed["state"], straight["state"])
    assert resumed["global_step"] == resumed["engine_steps"] == 6


@pytest.mark.timeout(300)
def test_convert_checkpoint_writes_a_file_lightning_loads(results, tmp_path):
    """Offline: the last epoch's checkpoint directory -> one .ckpt file; load_from_checkpoint gives the gathered
    final weights bitwise."""
    from zero_engine.lightning import convert_checkpoint

    sys.path.insert(0, str(REPO / "tests"))
    from lightning_worker import Regressor

    out = convert_checkpoint(results["out"] / "every_epoch" / "epoch=1-step=6.ckpt", tmp_path / "model.ckpt")
    model = Regressor.load_from_checkpoint(out)
    assert_state_equal(model.state_dict(), results["zero3_ga"]["state"])
    assert torch.load(out, weights_only=False)["global_step"] == 6
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory written by ZeroEngineStrategy"):
        convert_checkpoint(tmp_path, tmp_path / "other.ckpt")


@pytest.mark.timeout(300)
def test_resume_from_another_strategys_file_restores_weights_and_loops_and_warns(results):
    from_ddp = results["zero3_from_ddp"]
    assert from_ddp["global_step"] == 15 and from_ddp["engine_steps"] == 5  # DDP's 10 steps, then epoch 3
    assert len(results["from_ddp_warnings"]) == 1 and "optimizer starts afresh" in results["from_ddp_warnings"][0]


@pytest.mark.timeout(300)
def test_engine_batch_sizes_and_strategy_collectives(results):
    # (train, micro, accumulation): the micro-batch from the train loader, the accumulation from the Trainer
    assert results["zero3"]["batch_sizes"] == (4, 2, 1) and results["zero3_ga"]["batch_sizes"] == (8, 2, 2)
    assert results["collectives"] == [(3.0, 7), (3.0, 7)]  # reduce(sum) of 1 and 2; rank 0's broadcast


@pytest.mark.timeout(300)
def test_validate_predict_and_weights_only_export(results):
    """After fit: validate and predict through the engine; save_checkpoint(weights_only=True) writes one ordinary
    file with the gathered state dict; a new Trainer validates from that file (loaded into the shards) with an
    engine that has no optimizer, and its save_checkpoint writes the same weights in one file."""
    sys.path.insert(0, str(REPO / "tests"))
    from lightning_worker import Regressor, dataset

    exported = results["exported"]
    assert_state_equal(exported, results["eval_run"]["state"])
    model = Regressor()
    model.configure_model()
    model.load_state_dict(exported)
    x, y = dataset().tensors
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(torch.tensor(results["validate"]), F.mse_loss(expected, y), rtol=1e-6, atol=0)
    assert results["validate_from_file3"] == results["validate_from_file1"] == results["validate"]
    for stage in (1, 3):  # evaluation only: an engine without optimizer (no fp32 masters); a save writes the weights
        no_optimizer, master_bytes, saved = results[f"eval_engine{stage}"]
        assert no_optimizer and master_bytes == 0, (stage, no_optimizer, master_bytes)
        assert_state_equal(saved, exported)
    for rank, predictions in enumerate(results["predict"]):  # DistributedSampler: rank r gets samples r, r+2, ...
        torch.testing.assert_close(predictions, expected[rank::2], rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(300)
def test_refusals_name_the_argument(results):
    assert results["err_precision"].startswith("NotImplementedError") and "precision='64-true'" in \
        results["err_precision"]
    assert results["err_clip_value"].startswith("NotImplementedError") and \
        "gradient_clip_algorithm='value'" in results["err_clip_value"]
    assert "gradient_accumulation_steps=4" in results["err_accumulation"] and \
        "accumulate_grad_batches=2" in results["err_accumulation"]
    assert "configure_optimizers" in results["err_optimizer_block"]
    assert results["err_clip_mismatch"].startswith("ValueError") and "clip_gradients(gradient_clip_val=1.0)" in \
        results["err_clip_mismatch"]
    assert results["err_spawn"].startswith("NotImplementedError") and "start_method='spawn'" in results["err_spawn"]
    assert results["err_other_module"].startswith("RuntimeError") and "holds another Regressor" in \
        results["err_other_module"]
    assert results["err_second_fit"].startswith("RuntimeError") and "ckpt_path" in results["err_second_fit"]


@pytest.mark.timeout(300)
def test_test_gpt_matches_ddp_and_the_example_runs(results):
    """The test GPT (tied embeddings, a parameter read by the root's forward, re-initialised after construction)
    built in configure_model under zero.Init: bitwise as DDP. And examples/train_lightning.py's main(), run in the
    same ranks: accumulation 2, a checkpoint directory."""
    assert_losses_close(results["gpt_zero3"], results["gpt_ddp"])
    assert_state_equal(results["gpt_zero3"]["state"], results["gpt_ddp"]["state"])
    output = results["example_output"]
    assert "zero_engine stage 3 under Lightning, 2 ranks" in output and "3 steps (engine: 3)" in output, output
    assert (results["out"] / "example_ckpt" / "checkpoint").is_dir()


# ---- the Trainer's flags as config keys, without ranks ----------------------------------------------------------------
def _trainer(**kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_trainer_flags_complete_the_config():
    from zero_engine.lightning import _complete_config

    config = _complete_config({"zero_optimization": {"stage": 3}}, _trainer(accumulate_grad_batches=3,
                                                                          gradient_clip_val=0.7), "bf16-true")
    assert config["gradient_accumulation_steps"] == 3 and config["gradient_clipping"] == 0.7
    assert config["bf16"] == {"enabled": True} and config["train_micro_batch_size_per_gpu"] == 1
    kept = _complete_config({"train_batch_size": 8, "gradient_clipping": 1.0, "fp16": {"enabled": True},
                             "bf16": {"enabled": "auto"}}, _trainer(), "32-true")
    assert "train_micro_batch_size_per_gpu" not in kept and kept["gradient_clipping"] == 1.0
    assert kept["fp16"] == {"enabled": True} and kept["bf16"] == {"enabled": False}  # the config decides at 32-true
    assert _complete_config({}, _trainer(), "16-mixed")["fp16"] == {"enabled": True}


def test_conflicting_settings_are_errors():
    from zero_engine.lightning import ZeroEngineStrategy, _complete_config

    with pytest.raises(ValueError, match=r"bf16.enabled=True; set the precision in one place"):
        _complete_config({"bf16": {"enabled": True}}, _trainer(), "16-mixed")
    with pytest.raises(ValueError, match=r"gradient_clipping=1.0 but Trainer\(gradient_clip_val=0.5\)"):
        _complete_config({"gradient_clipping": 1.0}, _trainer(gradient_clip_val=0.5), "32-true")
    with pytest.raises(ValueError, match=r"ZeroEngineStrategy\(stage=2\) but the config has zero_optimization.stage=3"):
        ZeroEngineStrategy(config={"zero_optimization": {"stage": 3}}, stage=2)
    with pytest.raises(ValueError, match="'scheduler' block"):
        ZeroEngineStrategy(config={"scheduler": {"type": "WarmupLR"}})
    with pytest.raises(FileNotFoundError, match="no such file"):
        ZeroEngineStrategy(config="missing.json")


def test_registered_names_build_the_strategy_with_their_stage():
    from lightning.pytorch.strategies import StrategyRegistry

    from zero_engine.lightning import ZeroEngineStrategy

    for name, stage in (("zero_engine", 3), ("zero_engine_stage_1", 1), ("zero_engine_stage_2", 2)):
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, ZeroEngineStrategy) and strategy.config["zero_optimization"]["stage"] == stage
