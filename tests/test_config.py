"""zero_engine.config: DeepSpeed defaults, aliases, deprecations, key checking, the batch rule, "auto",
strict numbers, "not supported yet", and the generated schema/reference staying in sync. Pure unit tests."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pydantic
import pytest
import torch

import zero_engine.errors
from zero_engine.config import ConfigError, EngineConfig, config_reference_markdown, json_schema, load_config
from zero_engine.config.fields import auto_rule
from zero_engine.config.schema import SECTIONS

REPO = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO / "zero_engine" / "config_schemas" / "zero_engine.schema.json"
DOCS = REPO / "docs" / "config.md"
LOGGER = "zero_engine.config"
BATCH = {"train_batch_size": 8}


def load(extra: dict, world_size: int = 1, **kwargs) -> EngineConfig:
    return load_config({**BATCH, **extra}, world_size=world_size, **kwargs)


def error_of(config: dict | str, world_size: int = 1, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(config, world_size=world_size, **kwargs)
    return str(caught.value)


# --- DeepSpeed's defaults ------------------------------------------------------------------------------------
# Written out from DeepSpeed's runtime/constants.py, runtime/precision_config.py, runtime/zero/config.py,
# runtime/zero/offload_config.py, runtime/activation_checkpointing/config.py and runtime/lr_schedules.py.
DEEPSPEED_DEFAULTS = {
    "": {
        "gradient_clipping": 0.0, "steps_per_print": None, "wall_clock_breakdown": False,
        "prescale_gradients": False, "gradient_predivide_factor": 1.0, "communication_data_type": None,
        "zero_allow_untested_optimizer": False, "zero_force_ds_cpu_optimizer": True, "dataloader_drop_last": False,
        "optimizer": None, "scheduler": None,
    },
    "fp16": {
        "enabled": False, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
        "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1,
    },
    "bf16": {"enabled": False, "immediate_grad_update": False, "check_grad_overflow": False},
    "zero_optimization": {
        "stage": 0, "contiguous_gradients": True, "reduce_scatter": True, "reduce_bucket_size": 500_000_000,
        "allgather_partitions": True, "allgather_bucket_size": 500_000_000, "overlap_comm": False,
        "offload_param": None, "offload_optimizer": None, "sub_group_size": 1_000_000_000,
        "prefetch_bucket_size": 50_000_000, "param_persistence_threshold": 100_000,
        "model_persistence_threshold": sys.maxsize, "max_live_parameters": 1_000_000_000,
        "max_reuse_distance": 1_000_000_000, "allgather_sequential": False,
        "gather_16bit_weights_on_model_save": False, "round_robin_gradients": False,
        "module_granularity_threshold": 0, "mics_shard_size": -1, "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False, "zero_quantized_gradients": False, "mics_hierarchical_params_gather": False,
    },
    "zero_optimization.leaf_module": {  # deepspeed/runtime/zero/leaf_module_config.py
        "classes": ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"],
        "names": [], "name_suffixes": [],
    },
    "zero_optimization.offload_param": {
        "device": "none", "nvme_path": None, "buffer_count": 5, "buffer_size": 100_000_000,
        "max_in_cpu": 1_000_000_000, "pin_memory": False,
    },
    "zero_optimization.offload_optimizer": {
        "device": "none", "nvme_path": None, "buffer_count": 4, "pin_memory": False, "pipeline_read": False,
        "pipeline_write": False, "fast_init": False, "ratio": 1.0, "super_offload": False,
        "convert_grad_on_cpu": True, "cpuadam_cores_perc": 0.8,
    },
    "aio": {"block_size": 1_048_576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True,
            "checksum": True},  # ours, not DeepSpeed's: a CRC-32 per NVMe swap block (aio.checksum)
    "activation_checkpointing": {
        "partition_activations": False, "contiguous_memory_optimization": False, "cpu_checkpointing": False,
        "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False,
    },
    "checkpoint": {"tag_validation": "WARN"},
    # DeepSpeed's CompileConfig of 0.14 (enabled, backend, kwargs) and the older switch `disable` (null: unset).
    "compile": {"enabled": False, "disable": None, "backend": "inductor", "kwargs": {},
                "traced": False},  # traced: ours, not DeepSpeed's (zero_engine/zero/traced.py)
    "tensor_parallel": {"autotp_size": 0},  # deepspeed/runtime/tensor_parallel/config.py TPTrainingConfig
    # Ours, not DeepSpeed's: the values the brief fixes.
    "zero_engine": {"debug_collectives": False, "collective_timeout_s": None, "memory_limit": None,
                    "max_consecutive_skipped_steps": 10, "stall_timeout_s": 20.0, "step_fingerprint": True},
    "zero_engine.memory_timeline": {"enabled": False, "path": None},
}
SCHEDULER_DEFAULTS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
                 "last_batch_iteration": -1},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
                      "warmup_type": "log", "last_batch_iteration": -1, "total_num_steps": 10},
    "WarmupCosineLR": {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
                       "warmup_type": "log", "last_batch_iteration": -1, "total_num_steps": 10},
}


def section_of(cfg, path: str):
    for part in filter(None, path.split(".")):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("path", list(DEEPSPEED_DEFAULTS))
def test_every_default_is_deepspeeds(path):
    offload = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    cfg = load({"zero_optimization": offload} if path.startswith("zero_optimization.") else {})
    section = section_of(cfg, path)
    actual = {name: getattr(section, name) for name in DEEPSPEED_DEFAULTS[path]}
    expected = dict(DEEPSPEED_DEFAULTS[path])
    if "device" in expected:
        expected["device"] = "cpu"  # the one key given, to make the section exist
    assert actual == expected
    for name, value in expected.items():  # 0 == False in Python; a bool default must stay a bool
        assert isinstance(actual[name], bool) == isinstance(value, bool), name


def test_defaults_table_covers_every_field():
    covered = {path: set(fields) for path, fields in DEEPSPEED_DEFAULTS.items()}
    paths = {"top level": "", "zero_engine": "zero_engine"}
    for title, model in SECTIONS:
        path = paths.get(title, title)
        if path not in covered:
            continue  # optimizer/scheduler sections: tested below
        fields = set(model.file_fields()) - {"train_batch_size", "train_micro_batch_size_per_gpu",
                                             "gradient_accumulation_steps", "fp16", "bf16", "zero_optimization",
                                             "activation_checkpointing", "zero_engine", "memory_timeline", "aio",
                                             "leaf_module", "checkpoint", "compile", "tensor_parallel"}
        assert fields == covered[path], f"{path}: add DeepSpeed's default of each new field to the table"


def test_overlap_comm_defaults_to_true_at_stage_3_only():
    assert load({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert load({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is False
    assert load({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_optimization.overlap_comm is False


@pytest.mark.parametrize("kind", list(SCHEDULER_DEFAULTS))
def test_scheduler_params_get_deepspeeds_defaults(kind):
    params = {"total_num_steps": 10} if "total_num_steps" in SCHEDULER_DEFAULTS[kind] else {}
    cfg = load({"scheduler": {"type": kind, "params": params}})
    assert cfg.scheduler.params == SCHEDULER_DEFAULTS[kind]


def test_optimizer_keeps_only_given_params_and_normalises_type():
    cfg = load({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "torch_adam": True}}})
    assert cfg.optimizer.type == "adamw"
    assert cfg.optimizer.params == {"lr": 1e-4, "betas": (0.9, 0.95)}
    assert (cfg.optimizer.torch_adam, cfg.optimizer.adam_w_mode) == (True, True)
    sgd = load({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}).optimizer
    assert (sgd.type, sgd.params) == ("sgd", {"lr": 0.1, "momentum": 0.9})
    adam = load({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer
    assert (adam.type, adam.adam_w_mode, adam.params) == ("adam", False, {})


# --- aliases and deprecations ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("alias", "field", "value"), [
    ("stage3_prefetch_bucket_size", "prefetch_bucket_size", 123),
    ("stage3_param_persistence_threshold", "param_persistence_threshold", 7),
    ("stage3_model_persistence_threshold", "model_persistence_threshold", 9),
    ("stage3_max_live_parameters", "max_live_parameters", 11),
    ("stage3_max_reuse_distance", "max_reuse_distance", 13),
    ("stage3_allgather_sequential", "allgather_sequential", True),
    ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", True),
])
def test_stage3_aliases_and_short_names(alias, field, value):
    assert getattr(load({"zero_optimization": {alias: value}}).zero_optimization, field) == value
    assert getattr(load({"zero_optimization": {field: value}}).zero_optimization, field) == value
    message = error_of({**BATCH, "zero_optimization": {field: value, alias: value}})
    assert message == (f"zero_optimization.{alias}: same setting as zero_optimization.{field} (alias); "
                       "keep only one of them")


def test_bfloat16_is_an_alias_of_bf16():
    assert load({"bfloat16": {"enabled": True}}).bf16.enabled is True
    assert "same setting as bf16" in error_of({**BATCH, "bf16": {}, "bfloat16": {}})


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


@pytest.mark.parametrize(("old", "section", "pinned"), [
    ({"cpu_offload": True}, "offload_optimizer", False),
    ({"cpu_offload_param": True}, "offload_param", False),
    ({"cpu_offload_params": True}, "offload_param", False),
    ({"cpu_offload": True, "cpu_offload_use_pin_memory": True}, "offload_optimizer", True),
])
def test_deprecated_cpu_offload_keys_map_with_a_warning(caplog, old, section, pinned):
    caplog.set_level(logging.INFO, logger=LOGGER)
    zero = load({"zero_optimization": {"stage": 3, **old}}).zero_optimization
    offload = getattr(zero, section)
    assert (offload.device, offload.pin_memory) == ("cpu", pinned)
    messages = warnings_of(caplog)
    assert any(f"zero_optimization.{next(iter(old))} is deprecated" in m and section in m for m in messages)


def test_deprecated_false_maps_to_nothing_and_conflicts_are_errors(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert load({"zero_optimization": {"cpu_offload": False}}).zero_optimization.offload_optimizer is None
    assert "zero_optimization.cpu_offload is deprecated" in warnings_of(caplog)[0]
    message = error_of({**BATCH, "zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    assert message == ("zero_optimization.cpu_offload: deprecated key given together with "
                       "zero_optimization.offload_optimizer; keep only offload_optimizer")


def test_deprecated_fp16_gather_key(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    zero = load({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}}).zero_optimization
    assert zero.gather_16bit_weights_on_model_save is True
    assert "stage3_gather_fp16_weights_on_model_save is deprecated" in warnings_of(caplog)[0]
    message = error_of({**BATCH, "zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True,
                                                        "gather_16bit_weights_on_model_save": False}})
    assert "deprecated key contradicts zero_optimization.gather_16bit_weights_on_model_save" in message


def test_zero_optimization_as_a_bool_is_the_oldest_format(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert load({"zero_optimization": True}).zero_optimization.stage == 1
    assert "zero_optimization: true is deprecated" in warnings_of(caplog)[0]


def test_offload_false_means_off_and_true_is_an_error():
    zero = load({"zero_optimization": {"offload_param": False, "offload_optimizer": False}}).zero_optimization
    assert (zero.offload_param, zero.offload_optimizer, zero.offloads_params) == (None, None, False)
    assert error_of({**BATCH, "zero_optimization": {"offload_param": True}}) == (
        'zero_optimization.offload_param: invalid value true: expected an object such as {"device": "cpu"}, or false')


def test_cpu_offload_is_accepted_and_offload_param_below_stage3_warns(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    zero = load({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}).zero_optimization
    assert zero.offloads_params
    assert "offload_param only acts at stage 3 (stage is 2)" in warnings_of(caplog)[0]


# --- unknown keys ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("config", "message"), [
    ({"zero_optimization": {"stage3_prefetch_bucket_sze": 1}},
     "zero_optimization.stage3_prefetch_bucket_sze: unknown key; did you mean stage3_prefetch_bucket_size?"),
    ({"zero_optimization": {"offload_param": {"devce": "cpu"}}},
     "zero_optimization.offload_param.devce: unknown key; did you mean device?"),
    ({"fp16": {"loss_scale_windw": 10}}, "fp16.loss_scale_windw: unknown key; did you mean loss_scale_window?"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}},
     "optimizer.params.weight_decy: unknown key; did you mean weight_decay?"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 3}}},
     "scheduler.params.warmup_num_step: unknown key; did you mean warmup_num_steps?"),
    ({"zero_engine": {"memory_timeline": {"enabld": True}}},
     "zero_engine.memory_timeline.enabld: unknown key; did you mean enabled?"),
    ({"bf16": {"xyz": 1}},
     "bf16.xyz: unknown key; known keys here: check_grad_overflow, enabled, immediate_grad_update"),
    ({"optimizer": {"type": "Adamm"}}, 'optimizer.type: unknown optimizer type "Adamm"; did you mean adam?'),
    ({"scheduler": {"type": "warmuplr"}}, 'scheduler.type: unknown scheduler type "warmuplr"; did you mean WarmupLR?'),
])
def test_unknown_key_in_a_section_is_an_error_with_a_suggestion(config, message):
    assert error_of({**BATCH, **config}) == message


def test_top_level_comment_keys_are_silent(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    load({"_comment": "hello", "_note": [1, 2]})
    assert [r for r in caplog.records if r.name == LOGGER] == []


@pytest.mark.parametrize(("key", "suggestion"), [
    ("train_batch_sise", "train_batch_size"), ("gradient_clippping", "gradient_clipping"),
    ("zero_optimisation", "zero_optimization"), ("fp61", "fp16"), ("optimiser", "optimizer"),
    ("schedular", "scheduler"), ("tensorbaord", "tensorboard"),
])
def test_top_level_typo_is_an_error(key, suggestion):
    assert error_of({**BATCH, key: {}}) == f"{key}: unknown key; did you mean {suggestion}?"


def test_other_tools_top_level_keys_are_ignored_with_a_warning(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    load({"cuda_visible_devices": 0, "comms_config": {"verbose": False}, "world_size": 4})
    assert warnings_of(caplog) == [
        f"{key}: unknown top-level key, ignored (not a DeepSpeed key zero_engine knows; another tool's?)"
        for key in ("cuda_visible_devices", "comms_config", "world_size")
    ]


def test_harmless_sections_are_reported_once_as_ignored(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    load({"tensorboard": {"enabled": True}, "flops_profiler": {"enabled": True}, "wandb": {}})
    infos = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]
    assert infos == ["accepted but not acted on (zero_engine does not implement these tools): "
                     "tensorboard, flops_profiler, wandb"]


def test_ignored_legacy_key_inside_a_section_warns(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    load({"fp16": {"enabled": True, "opt_level": "O2"}})
    assert warnings_of(caplog) == [
        "fp16.opt_level is ignored: it is an Apex AMP setting that DeepSpeed's fp16 section never read."]


# --- batch rule ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("given", "world", "expected"), [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3, (24, 4, 2)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
    ({"train_batch_size": 1e2}, 1, (100, 100, 1)),
])
def test_batch_rule_derives_the_missing_sizes(given, world, expected):
    cfg = load_config(given, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected
    assert cfg.world_size == world


@pytest.mark.parametrize(("given", "world", "message"), [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2,
     "batch sizes do not agree: train_batch_size 32 != micro 4 x gas 2 x world 2 = 16"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2,
     "batch sizes do not agree: train_batch_size 30 != micro 4 x gas 3 x world 2 = 24 "
     "(gradient_accumulation_steps derived; train_batch_size must be a multiple of 8)"),
    ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 2,
     "batch sizes do not agree: train_batch_size 30 != micro 3 x gas 4 x world 2 = 24 "
     "(train_micro_batch_size_per_gpu derived; train_batch_size must be a multiple of 8)"),
    ({"train_batch_size": 4}, 8,
     "batch sizes do not agree: train_batch_size 4 != micro 0 x gas 1 x world 8 = 0 "
     "(train_micro_batch_size_per_gpu derived; train_batch_size must be a multiple of 8)"),
    ({"gradient_accumulation_steps": 2}, 1,
     "no batch size: give train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed requires one of them; "
     "gradient_accumulation_steps alone does not determine the batch)"),
    ({}, 1, "no batch size: give train_batch_size or train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 0}, 1, "train_batch_size: invalid value 0: expected a positive integer"),
    ({"train_batch_size": 2.5}, 1, 'train_batch_size: invalid value 2.5: expected a positive integer or "auto"'),
    ({"train_micro_batch_size_per_gpu": "4"}, 1,
     'train_micro_batch_size_per_gpu: invalid value "4": expected a positive integer or "auto"'),
])
def test_batch_rule_errors_show_the_arithmetic(given, world, message):
    assert error_of(given, world_size=world).startswith(message)


@pytest.mark.parametrize(("given", "world", "expected"), [
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
     2, (16, 8, 1)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
     4, (64, 16, 1)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
     2, (16, 2, 4)),
    ({"train_batch_size": "auto", "gradient_accumulation_steps": 3}, 2, (48, 8, 3)),
    ({"train_micro_batch_size_per_gpu": "auto"}, 1, (8, 8, 1)),
])
def test_batch_auto_is_derived_where_possible_else_hf_defaults(given, world, expected):
    cfg = load_config(given, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


def test_world_size_defaults_to_one_without_torch_distributed():
    assert not torch.distributed.is_initialized()
    assert load_config({"train_micro_batch_size_per_gpu": 2}).world_size == 1
    assert error_of(BATCH, world_size=0) == "world_size: invalid value 0: expected a positive integer or None"


# --- "auto" ----------------------------------------------------------------------------------------------------

ALL_AUTO = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": "auto",
                          "stage3_max_reuse_distance": "auto", "offload_param": {"buffer_size": "auto"}},
}


def auto_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.INFO and r.getMessage().startswith('resolved "auto"')]


def test_auto_without_model_takes_hf_and_deepspeed_defaults_in_one_log_line(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    cfg = load_config(ALL_AUTO, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 8, 1)
    assert (cfg.gradient_clipping, cfg.fp16.enabled, cfg.bf16.enabled) == (1.0, False, False)
    assert cfg.optimizer.params == {}
    assert cfg.scheduler.params["warmup_min_lr"] == 0.0 and cfg.scheduler.params["warmup_num_steps"] == 1
    assert cfg.scheduler.params["warmup_max_lr"] is None and cfg.scheduler.params["total_num_steps"] is None
    zero = cfg.zero_optimization
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (
        500_000_000, 50_000_000, 100_000)
    assert (zero.max_live_parameters, zero.max_reuse_distance, zero.offload_param.buffer_size) == (
        1_000_000_000, 1_000_000_000, 100_000_000)
    [line] = auto_lines(caplog)
    for expected in ("train_batch_size=16", "train_micro_batch_size_per_gpu=8", "gradient_accumulation_steps=1",
                     "gradient_clipping=1.0", "fp16.enabled=false", "bf16.enabled=false",
                     "optimizer.params.lr=removed (the optimizer's default)", "optimizer.params.betas=removed",
                     "scheduler.params.total_num_steps=open", "scheduler.params.warmup_max_lr=null",
                     "zero_optimization.reduce_bucket_size=500000000 (DeepSpeed's default; no model given)",
                     "zero_optimization.max_reuse_distance=1000000000",
                     "zero_optimization.offload_param.buffer_size=100000000"):
        assert expected in line
    assert line.count("=") == 20  # every "auto" in ALL_AUTO, once


AUTO_PLACES = {  # where each section sits in a config, to put "auto" into each of its auto-capable keys
    "EngineConfig": lambda key: {key: "auto"},
    "ZeroConfig": lambda key: {"zero_optimization": {key: "auto"}},
    "OffloadParamConfig": lambda key: {"zero_optimization": {"offload_param": {key: "auto"}}},
    "Fp16Config": lambda key: {"fp16": {key: "auto"}},
    "Bf16Config": lambda key: {"bf16": {key: "auto"}},
    "AdamParams": lambda key: {"optimizer": {"type": "AdamW", "params": {key: "auto"}}},
    "SgdParams": lambda key: {"optimizer": {"type": "SGD", "params": {key: "auto"}}},
    "WarmupLRParams": lambda key: {"scheduler": {"type": "WarmupLR", "params": {key: "auto"}}},
    "WarmupDecayLRParams": lambda key: {"scheduler": {"type": "WarmupDecayLR",
                                                      "params": {"total_num_steps": 9, key: "auto"}}},
    "WarmupCosineLRParams": lambda key: {"scheduler": {"type": "WarmupCosineLR",
                                                       "params": {"total_num_steps": 9, key: "auto"}}},
}


def auto_capable_keys():
    for _, model in SECTIONS:
        for name in model.file_fields():
            if auto_rule(model, name) is not None:
                for key in [name, *(alias for alias, field in model.key_aliases.items() if field == name)]:
                    yield model.__name__, key


@pytest.mark.parametrize(("section", "key"), list(auto_capable_keys()))
def test_every_auto_capable_key_resolves(caplog, section, key):
    caplog.set_level(logging.INFO, logger=LOGGER)
    config = AUTO_PLACES[section](key)
    cfg = load_config({**BATCH, **config}, world_size=1)
    assert '"auto"' not in json.dumps(cfg.model_dump())  # no value is still "auto"
    [line] = auto_lines(caplog)
    assert f"{key if section != 'ZeroConfig' else 'zero_optimization.'}" in line


def test_auto_bucket_sizes_from_a_hugging_face_models_hidden_size(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = torch.nn.Linear(4, 4)
    model.config = SimpleNamespace(hidden_size=64)
    zero = load_config(ALL_AUTO, world_size=1, model=model).zero_optimization
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (
        64 * 64, int(0.9 * 64 * 64), 640)
    assert "zero_optimization.reduce_bucket_size=4096 (hidden size 64)" in auto_lines(caplog)[0]


def test_auto_bucket_sizes_from_the_widest_layer_of_a_plain_model():
    # Linear width is min(in, out): the vocabulary projection (32 -> 1000) and MLP (32 -> 128) give 32, not more.
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 32), torch.nn.Linear(32, 128), torch.nn.Linear(128, 32),
                                torch.nn.Linear(32, 1000))
    zero = load_config(ALL_AUTO, world_size=1, model=model).zero_optimization
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (
        1024, 921, 320)


def test_auto_warmup_max_lr_takes_the_configured_lr():
    config = {**ALL_AUTO, "optimizer": {"type": "Adam", "params": {"lr": 3e-4}}}
    assert load_config(config, world_size=1).scheduler.params["warmup_max_lr"] == 3e-4


def test_scheduler_open_values_are_filled_when_building_it():
    scheduler = load_config(ALL_AUTO, world_size=1).scheduler
    params = scheduler.resolved_params(total_num_steps=500)
    assert params == {**scheduler.params, "total_num_steps": 500}
    assert params["warmup_max_lr"] is None  # the schedule takes the optimizer's lr
    with pytest.raises(ConfigError, match=r'scheduler.params.total_num_steps: "auto" cannot be derived'):
        scheduler.resolved_params()
    given = load({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 7}}}).scheduler
    assert given.resolved_params(total_num_steps=500)["total_num_steps"] == 7  # the config's own value wins
    assert error_of({**BATCH, "scheduler": {"type": "WarmupCosineLR"}}) == (
        "scheduler.params.total_num_steps: required key is missing")


@pytest.mark.parametrize("config", [
    {"steps_per_print": "auto"}, {"zero_optimization": {"stage": "auto"}}, {"fp16": {"loss_scale": "auto"}},
    {"zero_optimization": {"allgather_bucket_size": "auto"}},
    {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "cos_min_ratio": "auto"}}},
])
def test_auto_where_nothing_defines_it_is_an_error(config):
    assert '"auto" cannot be resolved for this key; write a value' in error_of({**BATCH, **config})


# --- values ----------------------------------------------------------------------------------------------------

def test_integral_floats_are_accepted_in_integer_fields():
    config = {"zero_optimization": {"stage": 3.0, "reduce_bucket_size": 5e8, "sub_group_size": 1e14}}
    zero = load(config).zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.sub_group_size) == (3, 500_000_000, 10**14)
    assert all(type(v) is int for v in (zero.stage, zero.reduce_bucket_size, zero.sub_group_size))
    assert load({"steps_per_print": 1e5}).steps_per_print == 100_000


@pytest.mark.parametrize(("config", "message"), [
    ({"zero_optimization": {"reduce_bucket_size": 5.5}},
     "zero_optimization.reduce_bucket_size: invalid value 5.5: expected an integer; the number has a fractional part"),
    ({"zero_optimization": {"stage": "3"}}, 'zero_optimization.stage: invalid value "3": expected an integer'),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage: invalid value true: expected an integer"),
    ({"zero_optimization": {"stage": 4}},
     "zero_optimization.stage: invalid value 4: input should be less than or equal to 3"),
    ({"fp16": {"enabled": "yes"}}, 'fp16.enabled: invalid value "yes": expected true or false'),
    ({"gradient_clipping": -1}, "gradient_clipping: invalid value -1: input should be greater than or equal to 0"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     "zero_optimization.offload_optimizer.device: invalid value \"gpu\": input should be 'none', 'cpu' or 'nvme'"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "x"}}},
     'optimizer.params.lr: invalid value "x": expected a number'),
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}},
     "optimizer.params.adam_w_mode: false contradicts type AdamW; use type Adam for L2-style weight decay"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "fp16.enabled: true together with bf16.enabled true; enable at most one"),
    ({"zero_optimization": []}, "zero_optimization: invalid value []: expected an object"),
])
def test_bad_values_name_the_path_the_value_and_what_is_allowed(config, message):
    assert error_of({**BATCH, **config}) == message


def test_several_bad_values_are_reported_together():
    message = error_of({**BATCH, "fp16": {"hysteresis": 0}, "bf16": {"enabled": 1}})
    assert message == ("2 config problems:\n"
                       "  fp16.hysteresis: invalid value 0: input should be greater than or equal to 1\n"
                       "  bf16.enabled: invalid value 1: expected true or false")


# --- not supported yet -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("config", "message"), [
    ({"zero_optimization": {"zero_quantized_nontrainable_weights": True}},
     "zero_optimization.zero_quantized_nontrainable_weights: true is not supported yet (ZeRO++ int8 storage of "
     "frozen weights; zero_quantized_weights quantizes their gathers); accepted: only false"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "zero_optimization.offload_optimizer.ratio: 0.5 is not supported yet (partial optimizer offload)"),
    ({"amp": {"enabled": True}}, 'amp: {"enabled": true} is not supported yet (Apex AMP; use fp16 or bf16)'),
    ({"compile": {"deepcompile": True}}, "compile.deepcompile: true is not supported yet (DeepCompile"),
    ({"tensor_parallel": {"tp_overlap_comm": True}}, "tensor_parallel.tp_overlap_comm: true is not supported yet"),
    ({"sparse_attention": {"mode": "fixed"}}, 'sparse_attention: {"mode": "fixed"} is not supported yet'),
    ({"quantize_training": {"quantize_groups": 16}}, "quantize_training: {\"quantize_groups\": 16} is not"),
    ({"eigenvalue": {"enabled": True}}, 'eigenvalue: {"enabled": true} is not supported yet'),
    ({"data_types": {"grad_accum_dtype": "fp32"}}, 'data_types: {"grad_accum_dtype": "fp32"} is not supported yet'),
    ({"seq_parallel_communication_data_type": "bf16"}, 'seq_parallel_communication_data_type: "bf16" is not'),
    ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal: true is not supported yet"),
    ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads: true is not"),
    ({"bf16": {"bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads: true is not"),
    ({"optimizer": {"type": "Lamb"}}, 'optimizer.type: "Lamb" is not supported yet; supported: Adam, AdamW, SGD'),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}},
     "optimizer.params.bias_correction: false is not supported yet (Adam without bias correction)"),
    ({"scheduler": {"type": "OneCycle"}}, 'scheduler.type: "OneCycle" is not supported yet'),
])
def test_features_we_lack_are_not_supported_yet(config, message):
    assert error_of({**BATCH, **config}).startswith(message)


def test_features_we_lack_are_accepted_while_off():
    cfg = load({
        "zero_optimization": {"stage": 3, "zero_quantized_weights": False, "zero_hpz_partition_size": 1,
                              "mics_shard_size": -1, "mics_hierarchical_params_gather": False, "zenflow": None,
                              "offload_param": {"device": "cpu", "nvme_path": "/unused", "buffer_count": 4}},
        "amp": {"enabled": False}, "compile": {"deepcompile": False}, "tensor_parallel": {"autotp_size": 0},
        "eigenvalue": {"enabled": False}, "data_types": {"grad_accum_dtype": None},
        "seq_parallel_communication_data_type": "fp32", "checkpoint": {"tag_validation": "Warn"},
        "fp16": {"fp16_master_weights_and_grads": False}, "bf16": {"bf16_optimizer_states": False},
        "optimizer": {"type": "Adam", "params": {"bias_correction": True, "amsgrad": False}},
    })
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert cfg.optimizer.params == {}


def test_a_typo_is_reported_before_a_missing_feature():
    message = error_of({**BATCH, "zero_optimization": {"offload_param": {"device": "nvme"},
                                                       "stage3_param_persitence_threshold": 1}})
    assert message == ("zero_optimization.stage3_param_persitence_threshold: unknown key; "
                       "did you mean stage3_param_persistence_threshold?")


# --- sources ---------------------------------------------------------------------------------------------------

def test_sources_dict_path_and_json_text(tmp_path):
    raw = {"train_batch_size": 4, "zero_optimization": {"stage": 3}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(raw))
    for source in (raw, path, str(path), json.dumps(raw), "\n  " + json.dumps(raw)):
        assert load_config(source, world_size=1).zero_optimization.stage == 3
    assert raw == {"train_batch_size": 4, "zero_optimization": {"stage": 3}}  # the caller's dict is not changed


@pytest.mark.parametrize(("source", "message"), [
    ('{"train_batch_size": 1, "train_batch_size": 2}', "train_batch_size: duplicate key in the same object; keep one"),
    ('{"train_batch_size": 1,}', "JSON text: not valid JSON: Expecting property name enclosed in double quotes"),
    ("/nonexistent/ds_config.json", "config file '/nonexistent/ds_config.json' not found"),
    ("[1, 2]", "config file '[1, 2]' not found"),
    (42, "config source: expected a dict, a path or JSON text, got int"),
])
def test_bad_sources(source, message):
    assert error_of(source).startswith(message)


def test_config_is_frozen_and_config_error_is_shared():
    cfg = load({})
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.zero_optimization.stage = 3
    assert ConfigError is zero_engine.errors.ConfigError and issubclass(ConfigError, ValueError)


# --- generated schema and reference ----------------------------------------------------------------------------

REGENERATE = "regenerate it: zero-engine schema > zero_engine/config_schemas/zero_engine.schema.json"
TRANSFORMERS_ZERO3 = {  # huggingface/transformers tests/deepspeed/ds_config_zero3.json (pre-"auto" version)
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e14, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_committed_schema_matches_the_models():
    assert SCHEMA_PATH.is_file(), f"{SCHEMA_PATH} is missing; {REGENERATE}"
    assert json.loads(SCHEMA_PATH.read_text()) == json_schema(), f"{SCHEMA_PATH.name} is out of date; {REGENERATE}"


def test_schema_validates_a_typical_zero3_config_and_rejects_bad_types():
    validator = jsonschema.Draft202012Validator(json_schema())
    validator.check_schema(validator.schema)
    assert list(validator.iter_errors(TRANSFORMERS_ZERO3)) == []
    load_config(TRANSFORMERS_ZERO3, world_size=1)  # and load_config agrees
    for bad in ({"zero_optimization": {"stage": "three"}}, {"zero_optimization": {"stage": 4}},
                {"fp16": {"enabled": "yes"}}, {"zero_optimization": {"stage3_prefetch_bucket_sze": 1}},
                {"zero_optimization": {"zero_quantized_nontrainable_weights": True}}, {"optimizer": {"type": "AdamW",
                                                                                       "params": {"lr": "fast"}}}):
        assert list(validator.iter_errors({**TRANSFORMERS_ZERO3, **bad})), bad


def test_schema_accepts_file_spellings():
    validator = jsonschema.Draft202012Validator(json_schema())
    spellings = {"bfloat16": {"enabled": "auto"}, "optimizer": {"type": "sgd", "params": {"lr": 0.1}},
                 "zero_optimization": {"offload_param": False, "cpu_offload": True, "max_live_parameters": 1e9},
                 "_comment": "x", "another_tools_key": 1}
    assert list(validator.iter_errors({**BATCH, **spellings})) == []


def test_docs_reference_is_generated_from_the_models():
    text = DOCS.read_text()
    begin, end = "<!-- BEGIN GENERATED REFERENCE -->\n", "<!-- END GENERATED REFERENCE -->"
    assert begin in text and end in text
    block = text.split(begin, 1)[1].split(end, 1)[0]
    assert block == config_reference_markdown(), (
        "docs/config.md's reference is out of date; replace the block between the markers with the output of "
        "`python -m zero_engine.config reference`")


def test_nvme_optimizer_offload_loads_and_needs_a_path():
    zero = load({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme",
                                                                          "pipeline_read": True}}}).zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_optimizer.nvme_path, zero.offloads_optimizer) == \
        ("nvme", "/nvme", True)
    message = error_of({**BATCH, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})
    assert message.startswith('zero_optimization.offload_optimizer.nvme_path: device "nvme" needs nvme_path'), message
