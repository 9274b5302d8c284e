"""zero_engine: ZeRO-3 memory optimization for PyTorch, configured with DeepSpeed's JSON.

    engine, optimizer, dataloader, lr_scheduler = zero_engine.initialize(model=model, config="ds_config.json")
    loss = engine(batch); engine.backward(loss); engine.step()

A DeepSpeed script runs with one changed import, ``import zero_engine as deepspeed`` (see docs/deepspeed_compat.md).
"""

from . import _version, comm, zero
from .comm import init_distributed
from .errors import (ArgumentError, ConfigError, DistributedError, RankDivergenceError, RankFailedError,
                     RankLostError, UsageError)
from .initialize import add_config_arguments, initialize
from .memory import estimate_zero3_model_states_mem_needs_all_live

__all__ = ["initialize", "add_config_arguments", "init_distributed", "zero", "comm", "utils", "config", "checkpoint",
           "ConfigError", "DeepSpeedConfigError", "DistributedError", "RankDivergenceError", "RankFailedError",
           "RankLostError", "UsageError", "ArgumentError",
           "estimate_zero3_model_states_mem_needs_all_live"]

DeepSpeedConfigError = ConfigError  # DeepSpeed's name (deepspeed.DeepSpeedConfigError) for the same errors

# DeepSpeed's version names; see _version.py for where each comes from.
__version__ = _version.installed_version()
__version_major__, __version_minor__, __version_patch__ = _version.parse_version(__version__)
__git_hash__, __git_branch__ = _version.git_info()


def __getattr__(name):
    # `zero_engine.config`, `.checkpoint` and `.utils` are subpackages imported on first use.
    if name in ("config", "checkpoint", "utils"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'zero_engine' has no attribute {name!r}")
