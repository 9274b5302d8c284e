"""zero_engine: ZeRO-3 memory optimization for PyTorch, configured with DeepSpeed's JSON.

    engine, optimizer, dataloader, lr_scheduler = zero_engine.initialize(model=model, config="ds_config.json")
    loss = engine(batch); engine.backward(loss); engine.step()

A DeepSpeed script runs with one changed import, ``import zero_engine as deepspeed`` (see docs/deepspeed_compat.md).
"""

from . import comm, zero
from .comm import init_distributed
from .errors import ConfigError, DistributedError, RankDivergenceError, RankFailedError, RankLostError
from .initialize import add_config_arguments, initialize
from .memory import estimate_zero3_model_states_mem_needs_all_live

__all__ = ["initialize", "add_config_arguments", "init_distributed", "zero", "comm", "utils", "config", "checkpoint",
           "ConfigError", "DistributedError", "RankDivergenceError", "RankFailedError", "RankLostError",
           "estimate_zero3_model_states_mem_needs_all_live"]

__version__ = "0.1.0"


def __getattr__(name):
    # `zero_engine.config`, `.checkpoint` and `.utils` are subpackages imported on first use.
    if name in ("config", "checkpoint", "utils"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'zero_engine' has no attribute {name!r}")
