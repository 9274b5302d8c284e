"""``zero_engine.initialize`` and ``add_config_arguments``: the entry points, with DeepSpeed's signatures."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from .engine import ZeroEngine
from .errors import ArgumentError
from .mesh import check_mpu
from .guards import client_optimizer_restorer, undo_failed_initialize
from .zero.optimizer import DataParallelOptimizer

__all__ = ["initialize", "add_config_arguments"]


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None, mesh=None):
    """Wrap ``model`` for training with partitioned model states.

    Returns ``(engine, optimizer, dataloader, lr_scheduler)``, as DeepSpeed: the optimizer is the partitioned one
    (its ``param_groups`` are the user-visible hyper-parameters); at stage 0 without fp16/bf16 it is the torch
    optimizer itself (the one passed in, or built from the config); None when there is no optimizer at all (no
    ``optimizer=`` and no ``optimizer`` block: the engine then runs forward and backward only). The dataloader is
    None unless ``training_data`` was given (then it is a DataLoader with a DistributedSampler and the micro-batch
    size), the scheduler is the one passed in (an instance, or a callable taking the optimizer) or the one the
    config's ``scheduler`` block builds.

    DeepSpeed's arguments, as DeepSpeed reads them:

    * ``config``: a dict, a path to ds_config.json, or JSON text; ``config_params`` is its older name, and
      ``args.deepspeed_config`` (from ``add_config_arguments``) is used when neither is given. Giving both the
      argument and ``args.deepspeed_config`` is an error, as in DeepSpeed.
    * ``args``: an argparse namespace; only ``deepspeed_config`` (and the deprecated ``deepscale_config``) are read.
    * ``dist_init_required``: None starts torch.distributed if needed; False requires it started already; True
      starts it unless it is.
    * ``distributed_port``: the rendezvous port when torch.distributed is started here and ``MASTER_ADDR`` is set
      without ``MASTER_PORT``.
    * ``mpu``: DeepSpeed's model-parallel unit; its data-parallel group becomes ZeRO's group (zero_engine/mesh.py).
      A model-parallel world size above 1 is not supported yet (issue 25). ``mesh_param`` (DeepSpeed's sequence /
      data-parallel mesh sizes) is refused.

    And one of zero_engine's (torchtitan's and FSDP2's way to say it):

    * ``mesh``: a ``torch.distributed.DeviceMesh`` over every rank with dim names ``("dp",)`` (flat ZeRO, the
      default) or ``("dp_replicate", "dp_shard")`` (HSDP / MiCS: model states sharded within each dp_shard group,
      replicated across dp_replicate; the same as ``zero_optimization.mics_shard_size``). See README's "ZeRO across
      a hierarchy".

    The first positional argument is ``args`` as in DeepSpeed; an ``nn.Module`` given there is taken as ``model``.
    """
    if isinstance(args, nn.Module) and model is None:
        args, model = None, args
    if model is None:
        raise ArgumentError("initialize: model is required (model= your torch.nn.Module)")
    if mpu is not None and mesh is not None:
        raise ArgumentError("initialize: give the data-parallel groups once, as mesh= or as mpu=, not both")
    if mpu is not None:
        check_mpu(mpu)  # before any process group is started for it
    if mesh_param is not None:
        raise NotImplementedError("initialize(mesh_param=...): sequence/data-parallel meshes are not supported by "
                                  "zero_engine; pass mesh_param=None")
    config = _config_from(args, config, config_params)
    _init_distributed_if_needed(dist_init_required, distributed_port)
    restore_client_optimizer = client_optimizer_restorer(optimizer)  # before the engine re-points its groups
    engine = ZeroEngine(model, config, optimizer=optimizer, model_parameters=model_parameters, mesh=mesh, mpu=mpu)
    try:
        engine.lr_scheduler = _make_scheduler(engine, lr_scheduler)
        engine.training_dataloader = _make_dataloader(engine, training_data, collate_fn)
    except BaseException:
        undo_failed_initialize(engine, restore_client_optimizer)  # as inside ZeroEngine(): initialize may run again
        raise
    return engine, _returned_optimizer(engine), engine.training_dataloader, engine.lr_scheduler


def _returned_optimizer(engine):
    """What DeepSpeed returns as the optimizer: at stage 0 without fp16/bf16 the torch optimizer itself (the
    client's object when one was passed); otherwise the engine's wrapper (None without an optimizer). At stage 0
    ``engine.optimizer`` stays the wrapper that averages gradients (docs/deepspeed_compat.md)."""
    if isinstance(engine.optimizer, DataParallelOptimizer) and not engine.optimizer.masters:
        return engine.optimizer.optimizer
    return engine.optimizer


def _make_scheduler(engine, lr_scheduler):
    """The scheduler passed in (an instance, or a callable taking the torch optimizer), or the config's."""
    if engine.optimizer is None and (lr_scheduler is not None or engine.config.scheduler is not None):
        raise ValueError("initialize: an LR scheduler (lr_scheduler= or the config's \"scheduler\" block) needs an "
                         "optimizer: pass optimizer= or add an \"optimizer\" block, or drop the scheduler")
    if lr_scheduler is not None:
        return lr_scheduler(engine.optimizer.optimizer) if callable(lr_scheduler) and not hasattr(
            lr_scheduler, "step") else lr_scheduler
    if engine.config.scheduler is None:
        return None
    from .schedulers import build_scheduler

    return build_scheduler(engine.config.scheduler.type, engine.config.scheduler.resolved_params(),
                           engine.optimizer.optimizer)


def _make_dataloader(engine, training_data, collate_fn):
    """DeepSpeed's training dataloader: this rank's part of ``training_data`` in micro-batches."""
    if training_data is None:
        return None
    # the ranks of one tp group read the same rows (tensor parallelism splits the model, not the batch)
    sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=engine.mesh.data_parallel_size,
                                                  rank=engine.mesh.data_parallel_rank)
    return torch.utils.data.DataLoader(training_data, batch_size=engine.config.train_micro_batch_size_per_gpu,
                                       sampler=sampler, collate_fn=collate_fn,
                                       drop_last=engine.config.dataloader_drop_last)


def _config_from(args, config, config_params):
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    deprecated = getattr(args, "deepscale_config", None)
    if deprecated is not None:
        if from_args is not None:
            raise ValueError("initialize: args has both deepscale_config and deepspeed_config; keep "
                             "--deepspeed_config (deepscale_config is its deprecated name)")
        from_args = deprecated
    if from_args is not None:
        if config is not None:
            raise ValueError("initialize: a config was given both as args.deepspeed_config "
                             f"({from_args!r}) and as the config/config_params argument; give one")
        config = from_args
    if config is None:
        raise ValueError("initialize: config is required (config= a dict, a path to ds_config.json, or JSON "
                         "text; or --deepspeed_config through add_config_arguments and args=)")
    return config


def _init_distributed_if_needed(dist_init_required, distributed_port) -> None:
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("initialize(dist_init_required=False): torch.distributed is not initialized; call "
                           "zero_engine.init_distributed() (or torch.distributed.init_process_group) first, or "
                           "leave dist_init_required as None")
    if distributed_port is not None and os.environ.get("MASTER_ADDR") and not os.environ.get("MASTER_PORT"):
        os.environ["MASTER_PORT"] = str(distributed_port)
    # Otherwise the engine starts it with the config's zero_engine.collective_timeout_s.


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags to ``parser`` and return it: ``--deepspeed`` (a flag for the script's own
    use), ``--deepspeed_config PATH`` (read by ``initialize(args=...)``), and their deprecated ``--deepscale*``
    names."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (zero_engine reads the same flags)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for user code; the engine does not read it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated name of --deepspeed_config")
    return parser
