"""``zero_engine.initialize``: the one entry point, DeepSpeed's signature."""

from __future__ import annotations

from .engine import ZeroEngine

__all__ = ["initialize"]


def initialize(model=None, config=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, collate_fn=None, config_params=None, args=None):
    """Wrap ``model`` for training with partitioned model states.

    Returns ``(engine, optimizer, dataloader, lr_scheduler)``: the optimizer is the partitioned one (its
    ``param_groups`` are the user-visible hyper-parameters), the dataloader is None unless ``training_data`` was
    given (then it is a DataLoader with a DistributedSampler and the micro-batch size), the scheduler is the one
    passed in (an instance, or a callable taking the optimizer) or the one the config's ``scheduler`` block builds.
    ``config_params`` is DeepSpeed's older name for ``config``; ``args`` is accepted for signature compatibility.
    """
    if model is None:
        raise ValueError("initialize: model is required")
    if config is None:
        config = config_params if config_params is not None else getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("initialize: config is required (a dict, a path to ds_config.json, or JSON text)")
    engine = ZeroEngine(model, config, optimizer=optimizer, model_parameters=model_parameters,
                        training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
