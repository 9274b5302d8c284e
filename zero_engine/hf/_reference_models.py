"""The frozen models a TRL trainer keeps beside the one it trains (the ``ref_model`` of DPO, KTO and GRPO, GRPO's
reward models), partitioned at stage 3 as TRL's ``prepare_deepspeed`` partitions them (and given an engine at any
stage when they come partitioned already, from ``zero_engine.hf.from_pretrained`` or ``zero.Init``).

Without this, Accelerate's ``prepare_model(evaluation_mode=True)`` leaves such a model whole on every rank: at stage
3 a DPO run would hold a whole reference model per rank beside a partitioned policy. Each frozen model gets an
engine of its own, built from the trainer's config without its optimizer, scheduler and optimizer offload; the model
object stays in its attribute, so TRL's calls reach it as before, and its forwards gather what they use. Below stage
3 it stays whole, as with DeepSpeed (TRL builds a stage-0 engine there).

A distillation ``teacher_model`` stays whole: TRL's DistillationTrainer projects the teacher's hidden states with the
teacher's ``lm_head.weight`` inside the student's forward, outside every forward of the teacher, where a partitioned
teacher has nothing to gather it (zero/external.py: reads are gathered for the model whose forward makes them).

TRL's ``SyncRefModelCallback`` (``sync_ref_model=True``) reads ``.data`` of both models, which at stage 3 is an empty
placeholder on both. It is replaced by ``SyncPartitionedRefModel``, which mixes each parameter pair gathered.
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import TrainerCallback

from ..zero.gathered import GatheredParameters
from ..zero.partition import sharded_param_of

__all__ = ["partition_reference_models", "is_partitioned", "SyncPartitionedRefModel", "REFERENCE_MODEL_ATTRIBUTES"]

REFERENCE_MODEL_ATTRIBUTES = ("ref_model",)  # and the nn.Module entries of ``reward_funcs``


def partition_reference_models(trainer, config: dict) -> dict:
    """An engine for each frozen model ``trainer`` holds (by attribute name, ``reward_funcs[i]``) at stage 3, and
    below it for one already partitioned (``zero_engine.hf.from_pretrained``, ``zero.Init``), which needs its engine
    to be gathered; ``config``: the trainer's engine config. Returns ``{name: engine}``."""
    stage3 = config.get("zero_optimization", {}).get("stage", 0) == 3
    models = {name: getattr(trainer, name, None) for name in REFERENCE_MODEL_ATTRIBUTES}
    models.update({f"reward_funcs[{i}]": f for i, f in enumerate(getattr(trainer, "reward_funcs", None) or [])})
    engines = {}
    for name, model in models.items():
        if isinstance(model, nn.Module) and model is not trainer.model and (stage3 or is_partitioned(model)):
            engines[name] = _inference_engine(model, config)
    if engines.get("ref_model") is not None:
        _replace_sync_callbacks(trainer)
    return engines


def is_partitioned(model: nn.Module) -> bool:
    return any(sharded_param_of(p) is not None for p in model.parameters())


def _inference_engine(model: nn.Module, config: dict):
    import zero_engine

    frozen = copy.deepcopy(config)
    for key in ("optimizer", "scheduler"):
        frozen.pop(key, None)
    frozen.get("zero_optimization", {}).pop("offload_optimizer", None)
    engine, *_ = zero_engine.initialize(model=model, config=frozen)
    model.eval()
    return engine


def _replace_sync_callbacks(trainer) -> None:
    handler = trainer.callback_handler
    for i, callback in enumerate(handler.callbacks):
        if type(callback).__name__ == "SyncRefModelCallback":
            handler.callbacks[i] = SyncPartitionedRefModel(callback.ref_model)


class SyncPartitionedRefModel(TrainerCallback):
    """TRL's ``sync_ref_model`` on partitioned models: every ``ref_model_sync_steps`` steps, each reference
    parameter becomes ``(1 - alpha) * ref + alpha * policy`` (``ref_model_mixup_alpha``), as TRL's callback does.
    Collective: one parameter pair gathered at a time, the result partitioned again."""

    def __init__(self, ref_model: nn.Module):
        self.ref_model = ref_model

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % args.ref_model_sync_steps != 0:
            return
        alpha = args.ref_model_mixup_alpha
        pairs = zip(self.ref_model.parameters(), model.parameters(), strict=True)
        for ref, policy in pairs:
            # Every rank holds the same gathered values and computes the same mix; rank 0's is written back.
            with GatheredParameters([ref, policy], modifier_rank=0):
                ref.data.mul_(1.0 - alpha).add_(policy.data, alpha=alpha)
