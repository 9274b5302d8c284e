"""The zero_config of a ZeroTrainer, completed from its TrainingArguments.

The Trainer's arguments decide the run (batch size, accumulation, clipping, precision, learning rate...); the
zero_config adds what only the engine knows (ZeRO stage, buckets, offload). A key the config leaves out or writes as
"auto" (Hugging Face's convention) takes the Trainer's value; a key written with another value than the Trainer's
is an error naming both, since one of them would silently not act:

    micro batch       train_micro_batch_size_per_gpu   <- per_device_train_batch_size
    accumulation      gradient_accumulation_steps      <- gradient_accumulation_steps
    global batch      train_batch_size                 <- micro x accumulation x world
    clipping          gradient_clipping                <- max_grad_norm
    precision         bf16.enabled / fp16.enabled      <- bf16 / fp16 (the config may turn one on by itself:
                                                          the engine, not Accelerate, runs the precision)
    optimizer block   params.lr / betas / eps / weight_decay "auto" <- learning_rate, adam_beta1/2,
                                                          adam_epsilon, weight_decay
    scheduler block   params "auto" <- filled when the run's length is known (scheduler_params_for)
    compile section   enabled / backend / kwargs.mode <- torch_compile / torch_compile_backend / torch_compile_mode
                                                          (only when torch_compile is on: the engine compiles each
                                                          block, one graph per block, instead of Accelerate
                                                          compiling the whole model)
"""

from __future__ import annotations

import copy

from ..config import load_config
from ..config.loader import read_config_source
from ..config.tp_models import requested_autotp_size

__all__ = ["config_for_trainer", "scheduler_params_for"]

AUTO = "auto"


def config_for_trainer(zero_config, args, world_size: int) -> tuple[dict, dict | None]:
    """(engine config dict, scheduler block or None): see the module docstring. The scheduler block is taken out
    of the engine's config because its "auto" values need the number of training steps, known only in train()."""
    if zero_config is None:
        raise ValueError("zero_config: required (a path to a ds_config.json or a dict), e.g. "
                         "ZeroTrainer(..., zero_config={'zero_optimization': {'stage': 3}})")
    config = copy.deepcopy(read_config_source(zero_config))
    if requested_autotp_size(config) > 1:
        raise NotImplementedError("zero_config tensor_parallel.autotp_size above 1 with ZeroTrainer is not supported "
                                  "yet: the Trainer gives every rank its own rows of the batch, while the ranks of a "
                                  "tp group must read the same; use zero_engine.initialize (its training_data "
                                  "loader shards over the data-parallel ranks)")
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    _fill(config, ("train_micro_batch_size_per_gpu",), micro, "per_device_train_batch_size")
    _fill(config, ("gradient_accumulation_steps",), gas, "gradient_accumulation_steps")
    _fill(config, ("train_batch_size",), micro * gas * world_size,
          f"per_device_train_batch_size x gradient_accumulation_steps x world size {world_size}")
    _fill(config, ("gradient_clipping",), float(args.max_grad_norm or 0.0), "max_grad_norm")
    for precision in ("bf16", "fp16"):
        _fill_precision(config, precision, bool(getattr(args, precision)))
    if isinstance(config.get("optimizer"), dict):
        params = config["optimizer"].setdefault("params", {})
        for key, value, name in (("lr", args.learning_rate, "learning_rate"),
                                 ("betas", [args.adam_beta1, args.adam_beta2], "adam_beta1, adam_beta2"),
                                 ("eps", args.adam_epsilon, "adam_epsilon"),
                                 ("weight_decay", args.weight_decay, "weight_decay")):
            if params.get(key) == AUTO:
                params[key] = value
    if getattr(args, "torch_compile", False):
        _fill(config, ("compile", "enabled"), True, "torch_compile")
        _fill(config, ("compile", "backend"), args.torch_compile_backend or "inductor", "torch_compile_backend")
        if args.torch_compile_mode is not None:
            _fill(config, ("compile", "kwargs", "mode"), args.torch_compile_mode, "torch_compile_mode")
    scheduler = config.pop("scheduler", None)
    load_config(config, world_size=world_size)  # every mistake reported now, not at the first step
    return config, scheduler


def scheduler_params_for(scheduler: dict, args, num_training_steps: int) -> tuple[str, dict]:
    """The config's scheduler block with its "auto" values filled for a run of ``num_training_steps``."""
    if not isinstance(scheduler, dict) or not isinstance(scheduler.get("type"), str):
        raise ValueError(f"zero_config scheduler: expected {{'type': ..., 'params': {{...}}}}, got {scheduler!r}")
    fills = {"warmup_min_lr": 0.0, "warmup_max_lr": args.learning_rate,
             "warmup_num_steps": args.get_warmup_steps(num_training_steps), "total_num_steps": num_training_steps}
    params = dict(scheduler.get("params") or {})
    for key, value in params.items():
        if value == AUTO:
            if key not in fills:
                raise ValueError(f'zero_config scheduler.params.{key}: "auto" cannot be filled from '
                                 f"TrainingArguments (fillable: {', '.join(sorted(fills))}); write a value")
            params[key] = fills[key]
    return scheduler["type"], params


def _fill(config: dict, path: tuple[str, ...], value, arg_name: str) -> None:
    *sections, key = path
    node = config
    for section in sections:
        node = node.setdefault(section, {})
    current = node.get(key, AUTO)
    if current == AUTO:
        node[key] = value
    elif current != value:
        raise ValueError(f"zero_config {'.'.join(path)}={current!r} but TrainingArguments gives {value!r} "
                         f"({arg_name}): write \"auto\" (or leave the key out) in the config, or make them equal")


def _fill_precision(config: dict, precision: str, requested: bool) -> None:
    section = config.get(precision)
    if section is None:
        if requested:
            config[precision] = {"enabled": True}
        return
    if not isinstance(section, dict):
        return  # load_config reports the wrong type
    enabled = section.get("enabled", AUTO)
    if enabled == AUTO:
        section["enabled"] = requested
    elif requested and enabled is False:
        raise ValueError(f"zero_config {precision}.enabled=false but TrainingArguments({precision}=True): write "
                         "\"auto\" or true in the config, or drop the argument")
