"""Lightning: ``Trainer(strategy="zero_engine")`` trains a LightningModule with partitioned model states.

    import zero_engine.lightning            # registers "zero_engine" (stage 3) and "zero_engine_stage_{1,2,3}"
    trainer = Trainer(strategy=ZeroEngineStrategy(config="ds_config.json"), accelerator="cpu", devices=2)

Lightning's documented extension point, a ``Strategy`` (here a DDPStrategy: its launchers, process group and
collectives), with the engine in place of the DDP wrapper. How Lightning's pieces map onto the engine:

* setup: ``configure_optimizers``' torch optimizer goes to ``zero_engine.initialize(optimizer=...)``, which re-points
  its param groups at the fp32 master shards; Lightning's optimizer list holds the engine's partitioned optimizer,
  and the scheduler stays Lightning's (it was built on that same torch optimizer; Lightning steps it, also after a
  step the engine skipped on an fp16 overflow, as with Lightning's own fp16 AMP).
* training: Lightning's backward is ``engine.backward`` (the loss arrives divided by ``accumulate_grad_batches``
  already) and ``optimizer.step(closure)`` is the closure, then ``engine.step()`` at a boundary set just for it. So
  the engine updates exactly when Lightning's loop steps, the epoch's remainder micro-batches included, and in
  manual optimization whenever ``opt.step()`` is called.
* Trainer flags become config keys: ``accumulate_grad_batches`` -> ``gradient_accumulation_steps``,
  ``gradient_clip_val`` -> ``gradient_clipping`` (clipped by the engine over all shards; by value is refused),
  ``precision`` "bf16-mixed"/"bf16-true" -> ``bf16``, "16-mixed"/"16-true" -> ``fp16`` (the engine keeps fp32
  master weights in both, so "-mixed" and "-true" train alike). A key set in the config and differently by the
  Trainer is an error; set it in one place.
* ``configure_model`` runs under ``zero_engine.zero.Init`` at stage 3, so each layer is partitioned as it is built.
* checkpoints: a directory written by ``engine.save_checkpoint`` (every rank its shards; Lightning's own state as
  client state), resumed with ``Trainer.fit(ckpt_path=dir)``. ``save_weights_only`` checkpoints are one ordinary
  ``.ckpt`` file with the full state dict, gathered onto rank 0 (``lightning_module_state_dict``).
* validation, test and predict run through the engine's forward (stage 3 gathers the weights layer by layer); without
  a fit first, the engine has no optimizer (``initialize(optimizer=None)``: no fp32 masters or optimizer states).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from contextlib import contextmanager
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError as error:  # an optional dependency: say how to get it
    raise ImportError("zero_engine.lightning needs Lightning: pip install 'lightning>=2.6,<3' "
                      "(or zero_engine's [lightning] extra)") from error

from .utils import safe_get_full_fp32_param
from .zero import GatheredParameters, Init
from .zero.partition import sharded_param_of

log = logging.getLogger("zero_engine.lightning")

__all__ = ["ZeroEngineStrategy", "convert_checkpoint"]

_TESTED = ((2, 6), (3, 0))  # lightning versions this module is tested with: [2.6, 3.0)
_CHECKPOINT_TAG = "checkpoint"  # the engine's tag inside a Lightning checkpoint directory
# Trainer(precision=...) -> the config section that enables it (None: the config decides, fp32 by default)
_PRECISION_SECTIONS = {"32-true": None, "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16",
                       "16-true": "fp16"}


def _check_lightning_version() -> None:
    version = tuple(int(part) for part in pl.__version__.split(".")[:2])
    low, high = _TESTED
    if not low <= version < high:
        raise ImportError(f"zero_engine.lightning is tested with lightning >={low[0]}.{low[1]},<{high[0]}.{high[1]}; "
                          f"found {pl.__version__}. Install a version in that range")


_check_lightning_version()


class ZeroEngineStrategy(DDPStrategy):
    """Train a LightningModule under ZeRO stages 1-3 (see the module docstring for what maps where).

    Args:
        config: the ds_config (a dict, a path to a JSON file, or JSON text). ``gradient_accumulation_steps``,
            ``gradient_clipping``, the batch size and the precision sections may be left out (or "auto"): they come
            from the Trainer. The optimizer and scheduler come from ``configure_optimizers``, so ``optimizer`` and
            ``scheduler`` blocks are refused. Default: ``{"zero_optimization": {"stage": 3}}``.
        stage: a shortcut for ``zero_optimization.stage`` (an error if the config names another stage).
        Other arguments are DDPStrategy's. ``process_group_backend`` defaults to gloo on CPU, nccl on CUDA. The
        launcher is Lightning's subprocess script launcher (``start_method="popen"``: the script re-runs once per
        rank, or torchrun/SLURM start the ranks); "spawn"/"fork" are refused: their launcher sends the weights
        back to the parent with ``module.state_dict()``, which holds shards only at stage 3.
    """

    strategy_name = "zero_engine"

    def __init__(self, config: dict | str | os.PathLike | None = None, stage: int | None = None, accelerator=None,
                 parallel_devices=None, cluster_environment=None, checkpoint_io=None, precision_plugin=None,
                 process_group_backend: str | None = None, timeout=None, start_method: str = "popen") -> None:
        if start_method != "popen":
            raise NotImplementedError(f"ZeroEngineStrategy(start_method={start_method!r}) is not supported: that "
                                      "launcher returns the trained weights to the parent process through "
                                      "module.state_dict(), which holds only shards under ZeRO-3; use the default "
                                      "start_method='popen' (or start the ranks with torchrun)")
        kwargs = {} if timeout is None else {"timeout": timeout}
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         start_method=start_method, **kwargs)
        self.config = _user_config(config, stage)
        self.engine = None  # the ZeroEngine, from setup() on
        self._engine_trains = False  # False: built for evaluation only (no configure_optimizers optimizer)

    # ---- precision: the engine's dtype policy replaces Lightning's autocast / module conversion ---------------------
    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else _EnginePrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning hands over the plugin it built from Trainer(precision=...); keep its choice, drop its mechanism.
        if plugin is not None and not isinstance(plugin, _EnginePrecision):
            if type(plugin) not in (Precision, MixedPrecision, HalfPrecision):
                precision = getattr(plugin, "precision", None)
                asked = f"Trainer(precision={precision!r})" if isinstance(precision, str) else \
                    f"the precision plugin {type(plugin).__name__}"
                raise NotImplementedError(f"ZeroEngineStrategy: {asked} is not supported (the engine sets the "
                                          "dtypes); use Trainer(precision=...) with one of "
                                          + ", ".join(_PRECISION_SECTIONS))
            plugin = _EnginePrecision(plugin.precision)
        self._precision_plugin = plugin

    # ---- the engine ----------------------------------------------------------------------------------------------
    def engine_config(self, trainer: pl.Trainer) -> dict:
        """The config the engine gets: the user's, completed from the Trainer's flags (see the class docstring)."""
        return _complete_config(self.config, trainer, self.precision_plugin.precision)

    @contextmanager
    def model_sharded_context(self):
        """``configure_model`` builds the model under zero.Init at stage 3: each submodule partitioned when built."""
        config = self.engine_config(self.lightning_module.trainer)
        with Init(config_dict_or_path=config, enabled=_stage_of(config) == 3):
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.engine is not None and fitting:
            raise RuntimeError(
                f"ZeroEngineStrategy (rank {self.global_rank}): this strategy's engine already holds the model "
                f"({'trained' if self._engine_trains else 'evaluated'} by an earlier Trainer call); fit with a new "
                "Trainer, strategy and LightningModule (resume with fit(ckpt_path=...) to continue training)")
        if self.engine is None:
            self._build_engine(trainer, fitting)
        elif self.engine.module is not self.lightning_module:
            raise RuntimeError(f"ZeroEngineStrategy (rank {self.global_rank}): this strategy's engine holds another "
                               f"{type(self.engine.module).__name__} (from an earlier Trainer call); use a new Trainer "
                               "and strategy for another module")
        self.model = self.engine
        plugin = self.precision_plugin
        plugin.engine = self.engine
        self.precision_plugin = plugin
        self.setup_precision_plugin()

    def _build_engine(self, trainer: pl.Trainer, fitting: bool) -> None:
        from . import initialize

        config = self.engine_config(trainer)
        if fitting:
            self.setup_optimizers(trainer)  # configure_optimizers: Lightning's checks and scheduler configs
            if len(self.optimizers) != 1:
                raise NotImplementedError(f"ZeroEngineStrategy: configure_optimizers returned {len(self.optimizers)} "
                                          "optimizers; the engine drives one (put several models' parameters in "
                                          "param groups of one optimizer)")
            optimizer = self.optimizers[0]
            if isinstance(optimizer, torch.optim.LBFGS):
                raise NotImplementedError("ZeroEngineStrategy: LBFGS re-evaluates the closure inside step(), which "
                                          "the engine's accumulate-then-step cycle does not support")
        else:
            optimizer = None  # evaluation only: an engine for forward passes, without fp32 masters or states
        self.engine, engine_optimizer, _, _ = initialize(model=self.lightning_module, optimizer=optimizer,
                                                         config=config, dist_init_required=False)
        self.engine.set_gradient_accumulation_boundary(False)  # only optimizer_step() opens a boundary
        self._engine_trains = fitting
        if fitting:
            self.optimizers = [engine_optimizer]  # schedulers keep their torch optimizer: the same object inside

    def model_to_device(self) -> None:
        pass  # the engine places the module on this rank's device (zero_engine/device.py), shards included

    def on_train_start(self) -> None:
        # The micro-batch size is the loader's; it is known only now (the engine's sample counts and batch sizes).
        loader = self.lightning_module.trainer.train_dataloader
        size = getattr(loader, "batch_size", None)
        if _is_auto(self.config, "train_micro_batch_size_per_gpu") and _is_auto(self.config, "train_batch_size") \
                and isinstance(size, int) and size != self.engine.train_micro_batch_size_per_gpu():
            self.engine.set_train_micro_batch_size(size)

    @contextmanager
    def block_backward_sync(self):
        # Lightning's accumulating micro-batches: no boundary is open, so the engine accumulates (stage 1 reduces at
        # the step, stages 2-3 reduce-scatter every backward); the engine's no_sync() would not count them.
        yield

    def optimizer_state(self, optimizer) -> dict:
        return {}  # the engine's checkpoint holds each rank's shard of it (see save_checkpoint)

    def teardown(self) -> None:
        # Not DDPStrategy.teardown: it moves the module and the optimizer states to the CPU, and the engine keeps
        # both where it placed them (validate/test/predict after fit reuse it). The engine lives as long as the
        # strategy; the rest of Lightning's teardown is done here.
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine loads into its shards: it must exist first

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restores its optimizer shards itself

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Collective: the full state dict (fp32 master weights) on rank 0, an empty dict on the other ranks.
        Gathered one parameter at a time, so the other ranks hold one whole parameter at most."""
        if self.engine is None:
            return super().lightning_module_state_dict()
        return _gathered_state_dict(self.lightning_module, self.engine.comm.rank == 0)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any | None = None) -> None:
        """A directory ``filepath`` written by every rank (``engine.save_checkpoint``; Lightning's trainer state as
        its client state); with ``weights_only`` (no optimizer states in ``checkpoint``), or from an evaluation-only
        engine (validate/test/predict without fit: no optimizer), one ordinary file written by rank 0 from the
        gathered state dict. Lightning builds ``checkpoint`` with lightning_module_state_dict() before every save, so
        a directory checkpoint also costs that gather (the whole fp32 model in rank 0's host memory for the moment,
        as FSDPStrategy's default full state dict); the directory does not keep it, since the shards hold the
        weights."""
        if storage_options is not None:
            raise TypeError("ZeroEngineStrategy.save_checkpoint(storage_options=...): the engine writes the "
                            "checkpoint itself, without Lightning's CheckpointIO; pass storage_options=None")
        filepath = self.broadcast(os.fspath(filepath))  # one path for all ranks
        # Trainer.save_checkpoint(weights_only=True), or after validate/test/predict only: the weights are all there is
        if "optimizer_states" not in checkpoint or self.engine.optimizer is None:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath)
            return
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag=_CHECKPOINT_TAG, client_state=client_state)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """A checkpoint directory written by save_checkpoint: fitting restores weights, optimizer shards and
        Lightning's state; validate/test/predict load the weights only. A single-file checkpoint (weights only, or
        one written by another strategy) loads its state dict into the shards (see load_model_state_dict)."""
        path = self.broadcast(os.fspath(checkpoint_path))
        if os.path.isfile(path):
            checkpoint = super().load_checkpoint(path, weights_only)
            if checkpoint.get("optimizer_states") and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
                rank_zero_warn(f"ZeroEngineStrategy: resuming from the single-file checkpoint {path}: the weights, "
                               "the loops and the schedulers are restored, the optimizer state is not (it is another "
                               "strategy's, unpartitioned); the optimizer starts afresh. A checkpoint directory "
                               "written by ZeroEngineStrategy restores it")
            return checkpoint
        if not os.path.isdir(os.path.join(path, _CHECKPOINT_TAG)):
            raise FileNotFoundError(f"ZeroEngineStrategy (rank {self.global_rank}): {path} is not a checkpoint "
                                    f"directory written by ZeroEngineStrategy (no {_CHECKPOINT_TAG}/ inside) nor a "
                                    "checkpoint file")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = self.engine.load_checkpoint(path, tag=_CHECKPOINT_TAG, load_optimizer_states=fitting,
                                                      load_lr_scheduler_states=False, load_module_only=not fitting)
        return client_state

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if "state_dict" not in checkpoint:
            return  # a checkpoint directory: the engine loaded the weights in load_checkpoint()
        _load_full_state_dict(self.lightning_module, checkpoint["state_dict"], strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # the engine loaded its optimizer shards in load_checkpoint(); never called for a single file

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("zero_engine", cls, description="zero_engine ZeRO stage 3", stage=3)
        for stage in (1, 2, 3):
            strategy_registry.register(f"zero_engine_stage_{stage}", cls,
                                       description=f"zero_engine ZeRO stage {stage}", stage=stage)


class _EnginePrecision(Precision):
    """Lightning's precision hooks over the engine: backward and step are the engine's, and so are the dtypes
    (``precision`` only picks the config's bf16/fp16 section) and clipping."""

    def __init__(self, precision: str) -> None:
        if precision not in _PRECISION_SECTIONS:
            raise NotImplementedError(f"ZeroEngineStrategy: Trainer(precision={precision!r}) is not supported; use "
                                      "one of " + ", ".join(_PRECISION_SECTIONS))
        self.precision = precision
        self.engine = None  # set by ZeroEngineStrategy.setup()

    def _engine(self):
        if self.engine is None:
            raise RuntimeError("ZeroEngineStrategy: backward/step before the strategy's setup() built the engine")
        return self.engine

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        # Lightning divided the loss by accumulate_grad_batches already: the engine must not divide again.
        self._engine().backward(tensor, *args, scale_wrt_gas=False, **kwargs)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        engine = self._engine()
        engine.set_gradient_accumulation_boundary(True)  # Lightning steps now: so does the engine
        try:
            closure_result = closure()
            self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clip_gradients()
            if model.automatic_optimization and closure_result is None:
                raise RuntimeError("ZeroEngineStrategy: training_step returned None (skip the step), which the "
                                   "engine's collective step does not support; return a loss on every rank")
            engine.step(**kwargs)
        finally:
            engine.set_gradient_accumulation_boundary(False)
        return closure_result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        # The engine clips inside step() by the global norm over all shards, at the config's gradient_clipping
        # (set from Trainer(gradient_clip_val)); another value asked for here could not be honoured.
        if not clip_val or clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise NotImplementedError(_CLIP_BY_VALUE)
        configured = self._engine().gradient_clipping()
        if float(clip_val) != float(configured):
            raise ValueError(f"ZeroEngineStrategy: clip_gradients(gradient_clip_val={clip_val}) but the engine clips "
                             f"at gradient_clipping={configured} inside its step; set Trainer(gradient_clip_val=...) "
                             "or the config's gradient_clipping to the value you want")


_CLIP_BY_VALUE = ("ZeroEngineStrategy: Trainer(gradient_clip_algorithm='value') is not supported: the engine clips "
                  "by the global gradient norm (over all shards) inside its step; use gradient_clip_algorithm='norm'")


def convert_checkpoint(checkpoint_dir, output_file) -> str:
    """Offline (no ranks, any machine): a checkpoint directory written by ZeroEngineStrategy -> one ordinary
    Lightning checkpoint file: Lightning's trainer state plus the full fp32 state dict, consolidated one parameter
    at a time from the shards. ``LightningModule.load_from_checkpoint(output_file)`` loads it, and so does any
    strategy's ``fit(ckpt_path=...)`` (without the optimizer state). Returns ``output_file``.

    The state dict alone, without Lightning: ``zero_engine.checkpoint.get_fp32_state_dict_from_zero_checkpoint``."""
    from .checkpoint import get_fp32_state_dict_from_zero_checkpoint
    from .checkpoint._metadata import CLIENT_STATE_FILE

    tagged = os.path.join(os.fspath(checkpoint_dir), _CHECKPOINT_TAG)
    if not os.path.isfile(os.path.join(tagged, CLIENT_STATE_FILE)):
        raise FileNotFoundError(f"convert_checkpoint: {checkpoint_dir} is not a checkpoint directory written by "
                                f"ZeroEngineStrategy (no {_CHECKPOINT_TAG}/{CLIENT_STATE_FILE} inside)")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=_CHECKPOINT_TAG)
    # Lightning's own objects (loops, callbacks' states): the full pickle, as Lightning itself loads them
    checkpoint = torch.load(os.path.join(tagged, CLIENT_STATE_FILE), weights_only=False)
    checkpoint["state_dict"] = state_dict
    torch.save(checkpoint, output_file)
    return output_file


# ---- config -------------------------------------------------------------------------------------------------------
def _user_config(config, stage: int | None) -> dict:
    if config is None:
        config = {"zero_optimization": {"stage": 3 if stage is None else stage}}
    elif isinstance(config, (str, os.PathLike)):
        text = os.fspath(config)
        if os.path.isfile(text):
            with open(text) as f:
                config = json.load(f)
        elif text.lstrip().startswith("{"):
            config = json.loads(text)
        else:
            raise FileNotFoundError(f"ZeroEngineStrategy(config={text!r}): no such file (give a dict, a path to a "
                                    "JSON file, or JSON text)")
    elif not isinstance(config, dict):
        raise ValueError(f"ZeroEngineStrategy(config=...): expected a dict, a path or JSON text, got "
                         f"{type(config).__name__}")
    config = copy.deepcopy(config)
    for key, where in (("optimizer", "configure_optimizers"), ("scheduler", "configure_optimizers (lr_scheduler)")):
        if key in config:
            raise ValueError(f"ZeroEngineStrategy: the config's {key!r} block is not used under Lightning; return the "
                             f"{key} from the LightningModule's {where} and remove config[{key!r}]")
    if stage is not None:
        zero = config.setdefault("zero_optimization", {})
        if zero.get("stage", stage) != stage:
            raise ValueError(f"ZeroEngineStrategy(stage={stage}) but the config has zero_optimization.stage="
                             f"{zero['stage']}; give one")
        zero["stage"] = stage
    return config


def _is_auto(config: dict, key: str) -> bool:
    return config.get(key, "auto") == "auto"


def _stage_of(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def _complete_config(user: dict, trainer: pl.Trainer, precision: str) -> dict:
    """The user's config with what the Trainer decides filled in; a conflict is an error naming both."""
    config = copy.deepcopy(user)
    gas = trainer.accumulate_grad_batches
    if not _is_auto(config, "gradient_accumulation_steps") and config["gradient_accumulation_steps"] != gas:
        raise ValueError(f"ZeroEngineStrategy: config gradient_accumulation_steps="
                         f"{config['gradient_accumulation_steps']} but Trainer(accumulate_grad_batches={gas}); set "
                         "it in one place (Lightning decides the accumulation boundaries)")
    config["gradient_accumulation_steps"] = gas
    if _is_auto(config, "train_micro_batch_size_per_gpu"):
        config.pop("train_micro_batch_size_per_gpu", None)
        if _is_auto(config, "train_batch_size"):
            config.pop("train_batch_size", None)
            config["train_micro_batch_size_per_gpu"] = 1  # the loader's size replaces it at on_train_start
    if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        raise NotImplementedError(_CLIP_BY_VALUE)
    clip = trainer.gradient_clip_val
    if _is_auto(config, "gradient_clipping"):
        config["gradient_clipping"] = float(clip or 0.0)
    elif clip is not None and float(clip) != float(config["gradient_clipping"]):
        raise ValueError(f"ZeroEngineStrategy: config gradient_clipping={config['gradient_clipping']} but "
                         f"Trainer(gradient_clip_val={clip}); set it in one place")
    section = _PRECISION_SECTIONS[precision]
    if section is not None:
        other = "fp16" if section == "bf16" else "bf16"
        for name, conflicting in ((other, True), (section, False)):
            if config.get(name, {}).get("enabled", "auto") is conflicting:
                raise ValueError(f"ZeroEngineStrategy: Trainer(precision={precision!r}) but the config has "
                                 f"{name}.enabled={conflicting}; set the precision in one place")
        config[section] = dict(config.get(section, {}), enabled=True)
    for name in ("bf16", "fp16"):
        if config.get(name, {}).get("enabled") == "auto":
            config[name] = dict(config[name], enabled=False)
    return config


# ---- whole state dicts ----------------------------------------------------------------------------------------------
def _gathered_state_dict(module: torch.nn.Module, keep: bool) -> dict[str, Any]:
    """``module.state_dict()`` with every parameter whole, in fp32 (the master weights of trained parameters); the
    values are kept (on the CPU) only where ``keep``. Collective: every rank calls it."""
    full: dict[int, torch.Tensor] = {}
    for _, param in module.named_parameters():  # each tied parameter once
        if param.requires_grad:
            value = safe_get_full_fp32_param(param)
        else:
            with GatheredParameters([param]):
                value = param.detach().clone()
        if keep:
            full[id(param)] = value.cpu()
    if not keep:
        return {}
    return {key: full[id(value)] if id(value) in full else (value.detach().cpu() if isinstance(value, torch.Tensor)
                                                             else value)
            for key, value in module.state_dict(keep_vars=True).items()}


def _load_full_state_dict(module: torch.nn.Module, state_dict: dict, strict: bool) -> None:
    """Load a whole state dict (every rank reads the same file) into the partitioned parameters; fp32 masters
    included. Collective."""
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers())
    missing = [name for name in params if name not in state_dict]
    unexpected = [key for key in state_dict if key not in params and key not in buffers]
    if strict and (missing or unexpected):
        raise RuntimeError(f"ZeroEngineStrategy: the checkpoint's state_dict does not match the model: missing "
                           f"{missing[:5]}, unexpected {unexpected[:5]} (pass strict_loading=False to skip them)")
    seen = set()
    for name, param in params.items():
        if name not in state_dict or id(param) in seen:
            continue
        seen.add(id(param))
        value = state_dict[name].to(param.device)
        if param.requires_grad and sharded_param_of(param) is not None:
            from .utils import safe_set_full_fp32_param

            safe_set_full_fp32_param(param, value)
        else:
            with GatheredParameters([param], modifier_rank=0), torch.no_grad():
                param.copy_(value.reshape(param.shape))
    with torch.no_grad():
        for name, buffer in buffers.items():
            if name in state_dict:
                buffer.copy_(state_dict[name])


ZeroEngineStrategy.register_strategies(StrategyRegistry)
