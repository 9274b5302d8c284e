"""Resolve "auto" values, Hugging Face's convention for "fill this in from the training setup".

Where a value can be derived, it is: batch sizes from each other and the world size (batch.py), ZeRO bucket
sizes from the model's hidden size when a model is given (as Hugging Face's Trainer does). Where it cannot, it
takes what Hugging Face's Trainer uses by default (micro batch 8, accumulation 1, clipping 1.0, fp16/bf16 off),
or, for optimizer hyperparameters, the key is removed so the optimizer's own default applies. Scheduler values
that need the length of the run stay open (None) and are filled by `SchedulerConfig.resolved_params`; an "auto"
warmup_max_lr without a configured lr becomes None, which the schedule reads as the optimizer's lr.
Every resolution is recorded in LoadNotes and logged on one line.
"""
from __future__ import annotations

from typing import Any

from zero_engine.config.batch import resolve_batch_sizes
from zero_engine.config.fields import AUTO
from zero_engine.config.notes import LoadNotes
from zero_engine.config.zero_models import OffloadParamConfig, ZeroConfig

HF_DEFAULT_GRADIENT_CLIPPING = 1.0  # transformers.TrainingArguments.max_grad_norm
_FROM_HIDDEN_SIZE = ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold")


def resolve_auto(config: dict[str, Any], world: int, model: Any, notes: LoadNotes) -> dict[str, Any]:
    config = dict(config)
    sizes = resolve_batch_sizes(config, world, notes)
    config.update(
        train_batch_size=sizes.train, train_micro_batch_size_per_gpu=sizes.micro, gradient_accumulation_steps=sizes.gas
    )
    if config.get("gradient_clipping") == AUTO:
        config["gradient_clipping"] = HF_DEFAULT_GRADIENT_CLIPPING
        notes.auto("gradient_clipping", str(HF_DEFAULT_GRADIENT_CLIPPING))
    for precision in ("fp16", "bf16"):
        section = config.get(precision)
        if isinstance(section, dict) and section.get("enabled") == AUTO:
            config[precision] = {**section, "enabled": False}
            notes.auto(f"{precision}.enabled", "false")
    if isinstance(config.get("zero_optimization"), dict):
        config["zero_optimization"] = _resolve_zero(config["zero_optimization"], model, notes)
    optimizer_lr = None
    if isinstance(config.get("optimizer"), dict):
        config["optimizer"], optimizer_lr = _resolve_optimizer(config["optimizer"], notes)
    if isinstance(config.get("scheduler"), dict):
        config["scheduler"] = _resolve_scheduler(config["scheduler"], optimizer_lr, notes)
    return config


def _resolve_zero(zero: dict[str, Any], model: Any, notes: LoadNotes) -> dict[str, Any]:
    zero = dict(zero)
    hidden = model_hidden_size(model) if model is not None else None
    from_hidden = {}
    if hidden is not None:
        from_hidden = {
            "reduce_bucket_size": hidden * hidden,
            "prefetch_bucket_size": int(0.9 * hidden * hidden),
            "param_persistence_threshold": 10 * hidden,
        }
    for field in ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold",
                  "max_live_parameters", "max_reuse_distance"):
        if zero.get(field) != AUTO:
            continue
        if field in from_hidden:
            zero[field] = from_hidden[field]
            notes.auto(f"zero_optimization.{field}", f"{zero[field]} (hidden size {hidden})")
        else:
            zero[field] = ZeroConfig.model_fields[field].default
            why = ""
            if field in _FROM_HIDDEN_SIZE:
                why = "; no model given" if model is None else "; no hidden size found in the model"
            notes.auto(f"zero_optimization.{field}", f"{zero[field]} (DeepSpeed's default{why})")
    offload = zero.get("offload_param")
    if isinstance(offload, dict) and offload.get("buffer_size") == AUTO:
        default = OffloadParamConfig.model_fields["buffer_size"].default
        zero["offload_param"] = {**offload, "buffer_size": default}
        notes.auto("zero_optimization.offload_param.buffer_size", f"{default} (DeepSpeed's default)")
    return zero


def _resolve_optimizer(optimizer: dict[str, Any], notes: LoadNotes) -> tuple[dict[str, Any], float | None]:
    params = optimizer.get("params")
    if not isinstance(params, dict):
        return optimizer, None
    kept = {}
    for key, value in params.items():
        if value == AUTO:
            notes.auto(f"optimizer.params.{key}", "removed (the optimizer's default)")
        else:
            kept[key] = value
    lr = kept.get("lr")
    configured_lr = float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None
    return {**optimizer, "params": kept}, configured_lr


def _resolve_scheduler(scheduler: dict[str, Any], optimizer_lr: float | None, notes: LoadNotes) -> dict[str, Any]:
    params = scheduler.get("params")
    if not isinstance(params, dict):
        return scheduler
    params = dict(params)
    resolutions = {
        "warmup_min_lr": (0.0, "0"),
        # HF would pass its warmup_steps (default 0); DeepSpeed rejects 0, and treats 1 as its minimum (2 steps).
        "warmup_num_steps": (1, "1 (no warmup asked for; DeepSpeed's shortest warmup)"),
        "total_num_steps": (None, "open (pass total_num_steps when building the scheduler)"),
        "warmup_max_lr": (
            (optimizer_lr, f"{optimizer_lr} (optimizer.params.lr)") if optimizer_lr is not None
            else (None, "null (the built optimizer's lr)")
        ),
    }
    for key, value in params.items():
        if value == AUTO and key in resolutions:
            params[key], described = resolutions[key]
            notes.auto(f"scheduler.params.{key}", described)
    return {**scheduler, "params": params}


def model_hidden_size(model: Any) -> int | None:
    """The hidden size Hugging Face would use for bucket sizes.

    `model.config.hidden_size` (or the largest of `hidden_sizes`) when the model has a Hugging Face config; else
    the widest layer, where a Linear's width is min(in_features, out_features) and an Embedding's is its
    embedding_dim -- so a vocabulary projection or an MLP expansion does not pass for the hidden size.
    """
    hf_config = getattr(model, "config", None)
    if hf_config is not None:
        hidden = getattr(hf_config, "hidden_size", None)
        if isinstance(hidden, int) and hidden > 0:
            return hidden
        sizes = getattr(hf_config, "hidden_sizes", None)
        if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(size, int) for size in sizes):
            return max(sizes)
    import torch  # deferred: loading a config needs no torch otherwise

    widths = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            widths.append(min(module.in_features, module.out_features))
        elif isinstance(module, torch.nn.Embedding):
            widths.append(module.embedding_dim)
    return max(widths) if widths else None
