"""zero_engine.hf.ZeroTrainer against transformers' plain (DDP) Trainer, and TRL's SFTTrainer through the mixin.

The parity runs are torchrun jobs of tests/hf_trainer_worker.py (2 CPU ranks; Accelerate needs its launcher's
environment for DDP), a few suites per job to pay the start-up once; the worker raises with the values on any
mismatch, and its docstring states the tolerances. The rest runs in this process: what is refused, and how the
zero_config is completed from TrainingArguments.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from session_run import run_in_session

transformers = pytest.importorskip("transformers", reason="zero_engine.hf.ZeroTrainer needs transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "hf_trainer_worker.py")


# Hang bounds, not speed limits: a multi-suite run takes 1-2 minutes here alone, and passed 240 s on a host loaded
# 8 times over its cores (a clean-clone CI beside a combinations round)
def _torchrun(suites: str, tmp_path, timeout: int = 480, **env) -> str:
    run = run_in_session([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          WORKER, suites, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", **env))
    return run.returncode, run.stdout + run.stderr


def _assert_ok(suites: str, tmp_path, **env) -> str:
    code, out = _torchrun(suites, tmp_path, **env)
    errors = [line for line in out.splitlines() if "Error" in line and "[rank1]" not in line]
    assert code == 0, "\n".join(errors[-12:]) + "\n" + out[-4000:]
    for suite in suites.split(","):
        assert f"OK {suite}" in out, out[-3000:]
    assert out.count("OK exit") == 2, out[-3000:]  # each rank destroyed the group, no gloo thread left
    return out


# ---- parity with the plain Trainer (torchrun, 2 ranks) --------------------------------------------------------------
@pytest.mark.timeout(600)
def test_stage3_matches_ddp_trainer_eval_predict_generate_save_resume(tmp_path):
    """Stage 3 (persistence 0): eval before train, GA 4 with an epoch remainder, clipping, warm-up + linear, eval and
    checkpoints every 2 steps, predict, generate with ranks stopping at different lengths (synced_gpus),
    save_model -> from_pretrained, that saved model loaded into the shards by zero_engine.hf.from_pretrained and
    evaluated by a ZeroTrainer before any train(), examples/finetune_trainer.py on it, and a bitwise resume from
    checkpoint-2."""
    _assert_ok("stage3", tmp_path)


@pytest.mark.timeout(600)
def test_stages_1_2_bf16_fp16_overflow_best_model_compile_neftune_lora(tmp_path):
    """Stages 1 and 2; bf16 against the Trainer's bf16 autocast; fp16 whose first steps overflow (the schedule
    stays put); load_best_model_at_end; torch_compile (each decoder layer compiled by the engine); NEFTune at stage 3
    (the same noisy losses as the plain Trainer's, bitwise; its hook removed after train); PEFT LoRA (base weights
    partitioned and frozen, transformers' default non-reentrant activation checkpointing) with the adapter saved and
    reloaded by PEFT."""
    suites = "stages12,precision,best,compile,neftune"
    if importlib.util.find_spec("peft") is not None:
        suites += ",peft"
    _assert_ok(suites, tmp_path)
    if "peft" not in suites:
        pytest.skip("peft is not installed: the LoRA part did not run (pip install peft)")


@pytest.mark.timeout(600)
def test_trl_trainers_through_the_mixin_match_plain_trl(tmp_path):
    """SFTTrainer at stages 2 and 3; at stage 3: DPOTrainer with its reference model partitioned and synced
    (sync_ref_model) after every step, and with a LoRA policy whose reference is the base model (adapters off),
    GRPOTrainer with a partitioned reference and reward model, and DistillationTrainer (the worker's suite_sft,
    suite_dpo, suite_grpo and suite_distill)."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install trl)")
    pytest.importorskip("datasets", reason="TRL's SFTTrainer needs datasets")
    code, out = _torchrun("sft,dpo,grpo,distill", tmp_path, SFT_STAGES="2,3")
    # Stage 3: TRL's fused LM head reads lm_head.weight in the model's forward, outside lm_head.forward; the engine
    # gathers such reads for the forward that makes them (zero/external.py).
    suites = ("sft-stage2", "sft-stage3", "dpo", "grpo", "distill")
    suites += ("dpo-lora",) if importlib.util.find_spec("peft") is not None else ()
    assert all(f"OK {suite}" in out for suite in suites), out[-4000:]
    assert code == 0 and out.count("OK exit") == 2, out[-4000:]


# ---- in this process: refusals and the config ------------------------------------------------------------------------
def _args(tmp_path, **kw):
    return transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


def _tiny():
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    return transformers.LlamaForCausalLM(cfg)


def test_refusals_name_the_argument(tmp_path, monkeypatch):
    from zero_engine.hf import ZeroTrainer

    config = {"zero_optimization": {"stage": 3}}
    args = _args(tmp_path)
    args.deepspeed = "ds_config.json"  # TrainingArguments itself would import deepspeed to set it
    with pytest.raises(ValueError, match=r"TrainingArguments.deepspeed='ds_config.json'.*zero_config"):
        ZeroTrainer(model=_tiny(), args=args, zero_config=config)
    with pytest.raises(NotImplementedError, match="TrainingArguments.auto_find_batch_size"):
        ZeroTrainer(model=_tiny(), args=_args(tmp_path, auto_find_batch_size=True), zero_config=config)
    with pytest.raises(NotImplementedError, match="lr_scheduler_type='reduce_lr_on_plateau'"):
        ZeroTrainer(model=_tiny(), args=_args(tmp_path, lr_scheduler_type="reduce_lr_on_plateau",
                                                   eval_strategy="steps"),
                    zero_config=config)
    # evaluation_loop would cast the model outside the engine (a RuntimeError about to() on a partitioned
    # parameter at the first evaluate, without this refusal)
    with pytest.raises(NotImplementedError, match="TrainingArguments.bf16_full_eval=True.*set bf16=True"):
        ZeroTrainer(model=_tiny(), args=_args(tmp_path, bf16_full_eval=True), zero_config=config)
    for optim in ("adafactor", "galore_adamw", "lomo", "schedule_free_adamw", "apollo_adamw"):
        with pytest.raises(NotImplementedError, match=f"TrainingArguments.optim='{optim}' with ZeroTrainer"):
            ZeroTrainer(model=_tiny(), args=_args(tmp_path, optim=optim), zero_config=config)
    with pytest.raises(NotImplementedError, match="model_init"):
        ZeroTrainer(model_init=_tiny, args=_args(tmp_path), zero_config=config)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.99.0")  # the module the check imports
    with pytest.raises(ImportError, match=r"tested with transformers>=5.24,<5.25; found 5.99.0"):
        ZeroTrainer(model=_tiny(), args=_args(tmp_path), zero_config=config)


def test_zero_config_completed_from_training_arguments(tmp_path):
    from zero_engine.hf._trainer_config import config_for_trainer, scheduler_params_for

    args = _args(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=2, max_grad_norm=0.7,
                 learning_rate=3e-4, weight_decay=0.1, warmup_steps=5)
    config, scheduler = config_for_trainer(
        {"train_batch_size": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3},
         "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}},
         "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}}},
        args, world_size=2)
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 12 and config["gradient_clipping"] == 0.7
    assert config["bf16"] == {"enabled": False} and "fp16" not in config and "scheduler" not in config
    assert config["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.999], "weight_decay": 0.1}
    assert scheduler_params_for(scheduler, args, 40) == ("WarmupDecayLR",
                                                         {"warmup_num_steps": 5, "total_num_steps": 40})
    with pytest.raises(ValueError, match=r"gradient_clipping=1.0 but TrainingArguments gives 0.7 \(max_grad_norm\)"):
        config_for_trainer({"gradient_clipping": 1.0}, args, world_size=2)
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=4 but .* \(per_device_train_batch_size\)"):
        config_for_trainer({"train_micro_batch_size_per_gpu": 4}, args, world_size=2)
    with pytest.raises(ValueError, match=r"bf16.enabled=false but TrainingArguments\(bf16=True\)"):
        config_for_trainer({"bf16": {"enabled": False}}, _args(tmp_path, bf16=True), world_size=1)
    compiled, _ = config_for_trainer({}, _args(tmp_path, torch_compile=True, torch_compile_mode="max-autotune"),
                                     world_size=1)
    assert compiled["compile"] == {"enabled": True, "backend": "inductor", "kwargs": {"mode": "max-autotune"}}
    with pytest.raises(ValueError, match=r"compile.backend='eager' but TrainingArguments gives 'inductor' "
                                         r"\(torch_compile_backend\)"):
        config_for_trainer({"compile": {"backend": "eager"}}, _args(tmp_path, torch_compile=True), world_size=1)
    assert "compile" not in config_for_trainer({}, args, world_size=1)[0]
    with pytest.raises(NotImplementedError, match="tensor_parallel.autotp_size above 1 with ZeroTrainer"):
        config_for_trainer({"tensor_parallel": {"autotp_size": 2}}, args, world_size=2)
    with pytest.raises(ValueError, match="zero_config: required"):
        config_for_trainer(None, args, world_size=1)


def test_hf_extra_pins_the_tested_transformers_range():
    """pip install 'zero_engine[hf]' gets a transformers that ZeroTrainer accepts (and nothing it would refuse)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    from zero_engine.hf.trainer import TESTED_TRANSFORMERS

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        hf = tomllib.load(f)["project"]["optional-dependencies"]["hf"]
    (pin,) = [r for r in hf if r.startswith("transformers")]
    (low, high) = (".".join(map(str, v)) for v in TESTED_TRANSFORMERS)
    assert pin == f"transformers>={low},<{high}", pin


def test_importing_zero_engine_hf_does_not_import_transformers():
    code = "import sys, zero_engine.hf; assert 'transformers' not in sys.modules, 'transformers imported'"
    run_in_session([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120,
                   env=dict(os.environ, PYTHONPATH=REPO))


class _Generator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def generate(self, **kwargs):
        return self, kwargs


def test_the_synced_generate_is_the_copys_in_a_copy_of_the_model():
    """The Trainer's ``synced_gpus`` default and engine.compile()'s ``generate`` wrap the model's generate as methods
    bound to it, in either order: a deepcopy (TRL's reference model) calls its own model, a pickled model loads."""
    import copy
    import io
    import types

    from zero_engine.compile import generate_without_recompiling
    from zero_engine.hf.trainer import ZeroTrainerMixin

    two_ranks = types.SimpleNamespace(args=types.SimpleNamespace(world_size=2))
    for compiled_first in (False, True):
        model = _Generator()
        if compiled_first:
            generate_without_recompiling(model)
        ZeroTrainerMixin._sync_generate(two_ranks, model)
        ZeroTrainerMixin._sync_generate(two_ranks, model)  # once
        if not compiled_first:
            generate_without_recompiling(model)
        copied = copy.deepcopy(model)
        assert copied.generate() == (copied, {"synced_gpus": True})
        assert model.generate(synced_gpus=False) == (model, {"synced_gpus": False})
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert loaded.generate() == (loaded, {})  # the class's: wrappers are set again by whoever trains it
