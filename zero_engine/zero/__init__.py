"""ZeRO partitioning: parameters, gathers, the coordinator, hooks, gradient buckets, the partitioned optimizer.

Public here: ``Init`` (partition while building a model) and ``GatheredParameters`` (full parameters for a block).
"""

from .gathered import GatheredParameters
from .init import Init
from .partition import ParamStatus, ShardedParam, ZeroParameter

__all__ = ["Init", "GatheredParameters", "ParamStatus", "ShardedParam", "ZeroParameter",
           "register_external_parameter", "unregister_external_parameter"]


def register_external_parameter(module, parameter):
    """DeepSpeed's manual external-parameter registration: refused (the hooks gather a module's own parameters)."""
    raise NotImplementedError(
        "zero.register_external_parameter: not supported by zero_engine. A parameter used outside its own module's "
        "forward must be read inside `with zero_engine.zero.GatheredParameters(param):` (tied weights shared by two "
        "modules need nothing: each module gathers its own)")


def unregister_external_parameter(module, parameter):
    """Refused, as register_external_parameter."""
    register_external_parameter(module, parameter)


_REFUSED = {
    "TiledLinear": "memory-centric tiling is not supported; split the layer into smaller nn.Linear modules",
    "MiCS_Init": "MiCS (partitioning within sub-groups of ranks) is not supported; use zero.Init",
}


def __getattr__(name):
    if name in _REFUSED:
        # AttributeError, so hasattr() probes of the namespace still answer False
        raise AttributeError(f"deepspeed.zero.{name} is not supported by zero_engine: {_REFUSED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
