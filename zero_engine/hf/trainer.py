"""ZeroTrainer: transformers' Trainer with the model states partitioned by a zero_engine engine.

    from zero_engine.hf import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                          zero_config={"zero_optimization": {"stage": 3}})      # or a path to ds_config.json
    trainer.train()

and for Trainer subclasses (TRL's SFTTrainer...): ``class ZeroSFTTrainer(ZeroTrainerMixin, SFTTrainer): pass``.
Leave ``TrainingArguments.deepspeed`` unset: Accelerate's DeepSpeed path needs the ``deepspeed`` package itself
(docs/deepspeed_compat.md says why impersonating it is not an option). Instead, this class takes the parts of the
Trainer that DeepSpeed's integration takes:

* The engine is built in ``__init__`` (so ``evaluate()``/``predict()`` work before ``train()``), on the Trainer's
  own optimizer (``create_optimizer``: ``optim``, its arguments and the weight-decay groups), or on the config's
  ``optimizer`` block when there is one. The config's "auto" values come from the TrainingArguments
  (_trainer_config.py). Accelerate never wraps the model (no DDP) and runs no mixed precision: the engine does.
* ``training_step``: the engine's forward, ``engine.backward`` and, at the accumulation boundary the Trainer's loop
  sets (Accelerate's ``sync_gradients``, which includes the short last window of an epoch),
  ``engine.step()``: the engine reduces, clips (``gradient_clipping`` = ``max_grad_norm``), steps the optimizer and
  the LR scheduler. The loop's own ``optimizer.step()`` / ``lr_scheduler.step()`` are then no-ops, so a step the
  engine skips (fp16 overflow) does not advance the schedule. The logged grad norm is the engine's (before clipping).
* Checkpoints: ``checkpoint-N/`` holds the model as ``save_pretrained`` writes it plus the engine's sharded
  checkpoint (weights, optimizer, scheduler, loss scale) under ``zero_engine/``; resuming loads that.
* ``save_model`` gathers the weights with ``zero_engine.hf.save_pretrained`` (every rank takes part); the result
  loads with plain ``from_pretrained``. A PEFT model saves its adapter.
* ``model.generate`` defaults to ``synced_gpus=True`` (transformers does that only for DeepSpeed and FSDP): ranks
  that finish early keep running forwards, so every rank gathers the same parameters.

Several overrides replace private methods of the Trainer; the transformers versions they were checked against are
``TESTED_TRANSFORMERS``, and another version is refused at construction.
"""

from __future__ import annotations

import logging
import os

import torch

from .._instance_methods import install_bound_wrapper, wrapped
from ..zero.gathered import GatheredParameters
from ..zero.partition import sharded_param_of
from ._engine_methods import install_synced_generate
from ._trainer_config import config_for_trainer, scheduler_params_for
from ._transformers import require_transformers

log = logging.getLogger("zero_engine.hf")

__all__ = ["ZeroTrainerMixin", "ZeroTrainer", "TESTED_TRANSFORMERS"]

TESTED_TRANSFORMERS = ((5, 24), (5, 25))  # [lower, upper): the private Trainer methods overridden below
CHECKPOINT_TAG = "zero_engine"  # the engine checkpoint's directory inside checkpoint-N/

# TrainingArguments this class cannot honour, with the reason (checked at construction).
_REFUSED_ARGS = {
    "fsdp": "FSDP and ZeRO both partition the model: use one (zero_config's zero_optimization.stage 3)",
    "auto_find_batch_size": "the engine is built once for one micro-batch size",
    "use_liger_kernel": "Liger's fused kernels read weights outside their modules' forward; not supported yet",
    # TRL's SFTConfig: its offloading context wraps training_step, which ZeroTrainerMixin replaces
    "activation_offloading": "not supported yet with ZeroTrainerMixin (it replaces training_step)",
    # evaluation_loop casts the model (model.to(dtype)) outside the engine, whose shards and fp32 masters stay
    "fp16_full_eval": "the engine computes in the zero_config's precision in evaluation too; set fp16=True instead",
    "bf16_full_eval": "the engine computes in the zero_config's precision in evaluation too; set bf16=True instead",
    "parallelism_config": "Accelerate's tensor/context parallelism wraps the model itself; zero_engine partitions "
                          "over data-parallel ranks only here",
}

# TrainingArguments.optim values (prefixes) whose optimizer cannot run on the engine's flat fp32 shards.
_REFUSED_OPTIMIZERS = {
    "lomo": "LOMO updates the parameters inside backward; the engine updates its fp32 shards in step()",
    "adalomo": "AdaLomo updates the parameters inside backward; the engine updates its fp32 shards in step()",
    "galore_": "GaLore projects each 2-D gradient; the engine's optimizer sees flat 1-D shards",
    "apollo_": "APOLLO projects each 2-D gradient; the engine's optimizer sees flat 1-D shards",
    "adafactor": "Adafactor factors each 2-D parameter's second moment; on the engine's flat 1-D shards it would "
                 "silently run unfactored",
    "schedule_free_": "schedule-free optimizers swap the weights in optimizer.train()/eval(), which the engine's "
                      "shards and the gathered parameters do not follow",
}


def _check_transformers_version():
    transformers = require_transformers("zero_engine.hf.ZeroTrainer")
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    low, high = TESTED_TRANSFORMERS
    if not low <= version < high:
        raise ImportError(
            f"zero_engine.hf.ZeroTrainer overrides private methods of transformers' Trainer and is tested with "
            f"transformers>={'.'.join(map(str, low))},<{'.'.join(map(str, high))}; found {transformers.__version__}. "
            f"Install a tested version (pip install 'transformers>={'.'.join(map(str, low))},"
            f"<{'.'.join(map(str, high))}') or use zero_engine.initialize directly")


def _refuse_unsupported(args) -> None:
    if getattr(args, "deepspeed", None):
        raise ValueError(f"TrainingArguments.deepspeed={args.deepspeed!r} with ZeroTrainer: zero_config replaces it "
                         "(Accelerate's DeepSpeed path would start DeepSpeed itself); leave deepspeed unset and pass "
                         "the same file as ZeroTrainer(..., zero_config=...)")
    for name, why in _REFUSED_ARGS.items():
        if getattr(args, name, None):
            raise NotImplementedError(f"TrainingArguments.{name}={getattr(args, name)!r} with ZeroTrainer: {why}")
    optim = getattr(args, "optim", None)
    optim = str(getattr(optim, "value", optim))
    for prefix, why in _REFUSED_OPTIMIZERS.items():
        if optim == prefix or (prefix.endswith("_") and optim.startswith(prefix)):
            raise NotImplementedError(f"TrainingArguments.optim={optim!r} with ZeroTrainer: {why}; use an element-wise "
                                      "optimizer (adamw_torch, adamw_torch_fused, sgd, lion, 8-bit Adam...)")
    schedule = getattr(args, "lr_scheduler_type", None)
    if getattr(schedule, "value", schedule) == "reduce_lr_on_plateau":
        raise NotImplementedError("TrainingArguments.lr_scheduler_type='reduce_lr_on_plateau' with ZeroTrainer: "
                                  "the engine steps the schedule after each applied step; use another schedule")
    if args.save_only_model and args.load_best_model_at_end:
        raise NotImplementedError("TrainingArguments.save_only_model=True with load_best_model_at_end=True: the "
                                  "best model is loaded from the engine checkpoint, which save_only_model omits")


class _EngineOptimizer:
    """The Trainer's ``self.optimizer``: the engine's optimizer, whose step the engine already took in
    ``training_step`` at the boundary; the loop's ``step()`` and ``zero_grad()`` are therefore no-ops."""

    def __init__(self, engine):
        self.engine = engine

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True):
        return None

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    @property
    def state(self):
        return self.engine.optimizer.optimizer.state

    def state_dict(self):
        raise RuntimeError("ZeroTrainer: the optimizer state is partitioned; it is saved and loaded with the engine "
                           "checkpoint (trainer.engine.save_checkpoint / load_checkpoint)")

    load_state_dict = state_dict


class _EngineScheduler:
    """The Trainer's ``self.lr_scheduler``: the real schedule, stepped by the engine after each applied step only
    (not after an fp16 step skipped on overflow); the loop's ``step()`` is a no-op. Everything else is the real
    scheduler's (``get_last_lr``, ``state_dict``...)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def step(self, *args, **kwargs):
        return None

    def __getattr__(self, name):
        return getattr(self.__dict__["scheduler"], name)


class ZeroTrainerMixin:
    """Put before a ``transformers.Trainer`` subclass: ``class MyTrainer(ZeroTrainerMixin, SomeTrainer)``.

    ``zero_config``: the DeepSpeed-style config (dict or path to JSON) for the engine; its "auto" and missing
    batch/clipping/precision keys come from ``args`` (see _trainer_config.py). After construction ``self.engine``
    is the ZeroEngine. Everything else is the Trainer's constructor.
    """

    engine = None

    def __init__(self, *args, zero_config=None, **kwargs):
        _check_transformers_version()
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            _refuse_unsupported(training_args)  # before Accelerate sees `deepspeed` or `fsdp`
        if kwargs.get("model_init") is not None:
            raise NotImplementedError("model_init with ZeroTrainer: not supported yet; pass model= (the engine is "
                                      "built around it at construction)")
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self.args)  # a subclass may have built args itself
        config = self._build_engine(zero_config)
        # TRL's reference and reward models: partitioned too (_reference_models.py; a distillation teacher stays whole)
        self.reference_engines = partition_reference_models(self, config)
        self._sync_generate(self.model)

    # ---- construction --------------------------------------------------------------------------------------------
    def _build_accelerator_args(self, **kwargs):
        accelerator_args = super()._build_accelerator_args(**kwargs)
        accelerator_args["mixed_precision"] = "no"  # the engine casts and scales (bf16/fp16 in zero_config)
        # torch_compile: the engine compiles each block (zero_config's compile section, filled from the arguments);
        # Accelerate's plugin would compile the whole model again when evaluation prepares it
        accelerator_args.pop("dynamo_plugin", None)
        return accelerator_args

    def _move_model_to_device(self, model, device) -> None:
        """Nothing: ``initialize`` places the model on the rank's device (``zero_engine.device.place_module``). The
        Trainer's ``model.to(device)`` would touch every parameter, which fails on one already partitioned by
        ``zero_engine.hf.from_pretrained`` or ``zero.Init`` (its data is an empty placeholder)."""
        return None

    def _build_engine(self, zero_config) -> dict:
        """The engine around ``self.model``; returns its config."""
        import zero_engine

        config, self._zero_scheduler = config_for_trainer(zero_config, self.args, self.args.world_size)
        optimizer = None
        if config.get("optimizer") is not None:
            if self.optimizer is not None:
                raise ValueError("ZeroTrainer: optimizers=(optimizer, ...) and an 'optimizer' block in zero_config "
                                 "both define the optimizer; keep one")
        else:
            optimizer = super().create_optimizer()  # the Trainer's choice, arguments and weight-decay groups
        if self._zero_scheduler is not None and self.lr_scheduler is not None:
            raise ValueError("ZeroTrainer: optimizers=(..., lr_scheduler) and a 'scheduler' block in zero_config "
                             "both define the schedule; keep one")
        self.engine, *_ = zero_engine.initialize(model=self.model, optimizer=optimizer, config=config)
        self.optimizer = _EngineOptimizer(self.engine)
        if self.lr_scheduler is not None:  # the user's, built on their optimizer: re-pointed to the masters
            self._attach_scheduler(self.lr_scheduler)
        self.model_wrapped = self.engine
        self.callback_handler.optimizer = self.optimizer
        return config

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Accelerate knows DDP, FSDP and DeepSpeed's engine, not ours: see unwrap_model and prepare_model below
        install_bound_wrapper(self.accelerator, "unwrap_model", unwrap_model)
        install_bound_wrapper(self.accelerator, "prepare_model", prepare_model)

    def _attach_scheduler(self, scheduler) -> None:
        scheduler = scheduler.scheduler if isinstance(scheduler, _EngineScheduler) else scheduler
        self.engine.lr_scheduler = scheduler
        self.lr_scheduler = _EngineScheduler(scheduler)

    def _sync_generate(self, model) -> None:
        """``generate`` with ``synced_gpus=True`` by default on several ranks; see the module docstring."""
        inner = _unwrap_peft(model)
        if callable(getattr(inner, "generate", None)) and self.args.world_size > 1:
            install_synced_generate(inner)

    def create_optimizer(self, model=None):
        if self.engine is None:
            return super().create_optimizer(model)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            inner = self.engine.optimizer.optimizer
            if self._zero_scheduler is not None:
                from ..schedulers import build_scheduler

                name, params = scheduler_params_for(self._zero_scheduler, self.args, num_training_steps)
                self.lr_scheduler = build_scheduler(name, params, inner)
                self._created_lr_scheduler = True
            else:
                super().create_scheduler(num_training_steps, optimizer=inner)
        self._attach_scheduler(self.lr_scheduler)
        return self.lr_scheduler

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self.engine  # never DDP: the engine reduces the gradients

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """The Trainer's, minus Accelerate's prepare: the engine exists; the schedule needs ``max_steps``."""
        if self._created_lr_scheduler:  # rebuilt for this run's length, as the Trainer does
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.engine
        # The engine decides when gradients are reduced (every backward at stages 2-3, at the boundary at stage
        # 1): the loop must not enter Accelerate's no_sync(), which would call the engine's. (Accelerate's gradient
        # state is shared by all its instances, so this is set here, when the loop starts.)
        self.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.engine, train_dataloader

    # ---- the training step -----------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        engine = self.engine
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        # As Trainer.training_step: a per-batch mean is divided by the window's length here (the engine's own
        # division by gradient_accumulation_steps is turned off, so the short last window of an epoch is right).
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        boundary = self.accelerator.sync_gradients  # set by the loop for this micro-batch
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss, scale_wrt_gas=False)
        if boundary:
            self._zero_step_lr = engine.get_lr()[0]  # what this step uses; the loop logs it after the step
            engine.step()
        return loss.detach()

    def _get_learning_rate(self):
        lr = getattr(self, "_zero_step_lr", None)
        return lr if lr is not None else super()._get_learning_rate()

    def _clip_grad_norm(self, model):
        return self._get_grad_norm(model)  # the engine clipped in step(); this is the norm before clipping

    def _get_grad_norm(self, model, grad_norm=None):
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else None

    def floating_point_ops(self, inputs) -> int:
        """The Trainer's estimate (6 x input tokens x non-embedding parameters) with the parameters' full sizes:
        a partitioned parameter's own ``numel()`` is its empty placeholder's."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return super().floating_point_ops(inputs)
        model = self.model
        embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
        params = sum(sp.numel if (sp := sharded_param_of(p)) is not None else p.numel()
                     for p in model.parameters() if id(p) not in embeddings)
        return 6 * inputs[main_input].numel() * params

    # ---- saving and loading ---------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective (every rank calls it, as the Trainer does): weights that ``from_pretrained`` loads."""
        from . import save_pretrained

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _is_peft(self.model):
            self._save_adapter(output_dir)
        else:
            dtype = getattr(getattr(self.model, "config", None), "dtype", None)
            save_pretrained(self.engine, output_dir, dtype=dtype if isinstance(dtype, torch.dtype) else None)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            from transformers.trainer import TRAINING_ARGS_NAME

            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_adapter(self, output_dir: str) -> None:
        """A PEFT model: its trainable (adapter) weights, gathered, saved by PEFT on rank 0."""
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        params = [p for p in self.model.parameters() if p.requires_grad]
        with GatheredParameters(params):
            state = {n: p.detach().to("cpu", copy=True) for n, p in zip(names, params)} \
                if self.args.should_save else None
        if self.args.should_save:
            self.model.save_pretrained(output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Collective: the engine writes its shards (weights, optimizer, scheduler, loss scale) from every rank.
        self.engine.save_checkpoint(output_dir, tag=CHECKPOINT_TAG, save_latest=False)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self._check_engine_checkpoint(checkpoint)
        self.engine.load_checkpoint(checkpoint, tag=CHECKPOINT_TAG)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # Called by train() before the loop: the weights come with the engine state in _prepare_for_training.
        self._check_engine_checkpoint(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        log.info("loading the best model from %s (score %s)", best, self.state.best_metric)
        self._check_engine_checkpoint(best)
        self.engine.load_checkpoint(best, tag=CHECKPOINT_TAG, load_module_only=True)

    @staticmethod
    def _check_engine_checkpoint(checkpoint: str) -> None:
        if not os.path.isdir(os.path.join(checkpoint, CHECKPOINT_TAG)):
            raise ValueError(f"resume_from_checkpoint={checkpoint!r}: no zero_engine checkpoint in it (expected "
                             f"{os.path.join(checkpoint, CHECKPOINT_TAG)}, which ZeroTrainer writes in every "
                             "checkpoint-N/ unless save_only_model=True)")

    def hyperparameter_search(self, *args, **kwargs):
        raise NotImplementedError("hyperparameter_search with ZeroTrainer: not supported yet (it rebuilds the "
                                  "model with model_init for each trial)")




def unwrap_model(self, model, *args, **kwargs):
    """Accelerate's ``unwrap_model`` (installed on the Trainer's Accelerator), which also takes an engine off, as it
    takes off DDP, FSDP and DeepSpeed's engine. The Trainer and TRL unwrap ``model_wrapped`` (the engine) to reach
    the model: TRL's ``_forward_redirection`` (DistillationTrainer, GKD) patches the unwrapped model's ``forward``
    and calls the wrapper, whose forward must then call that model."""
    from ..engine import ZeroEngine

    if isinstance(model, ZeroEngine):
        model = model.module
    return wrapped(self, unwrap_model, "unwrap_model")(model, *args, **kwargs)


def prepare_model(self, model, *args, **kwargs):
    """Accelerate's ``prepare_model`` (installed on the Trainer's Accelerator), which leaves a model with partitioned
    parameters as it is: TRL prepares its reference model so, and the ``model.to(device)`` in it would touch every
    parameter, which fails on one partitioned by ``zero_engine.hf.from_pretrained`` or ``zero.Init`` (an empty
    placeholder). Its engine places it, as for the trained model (``_move_model_to_device``)."""
    if is_partitioned(model):
        return model
    return wrapped(self, prepare_model, "prepare_model")(model, *args, **kwargs)


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _unwrap_peft(model):
    return model.get_base_model() if _is_peft(model) else model


_check_transformers_version()
from transformers import Trainer  # noqa: E402 -- after the version check, which explains a mismatch

from ._reference_models import is_partitioned, partition_reference_models  # noqa: E402 -- needs transformers


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """transformers.Trainer on a zero_engine engine; see the module docstring."""
