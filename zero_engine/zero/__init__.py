"""ZeRO partitioning: parameters, gathers, the coordinator, hooks, gradient buckets, the partitioned optimizer.

Public here: ``Init`` (partition while building a model) and ``GatheredParameters`` (full parameters for a block).
"""

from .external import register_external_parameter, unregister_external_parameter
from .gathered import GatheredParameters
from .init import Init
from .partition import ParamStatus, ShardedParam, ZeroParameter

__all__ = ["Init", "GatheredParameters", "ParamStatus", "ShardedParam", "ZeroParameter",
           "register_external_parameter", "unregister_external_parameter"]


_REFUSED = {
    "TiledLinear": "memory-centric tiling is not supported; split the layer into smaller nn.Linear modules",
    "MiCS_Init": "MiCS (partitioning within sub-groups of ranks) is not supported; use zero.Init",
}


def __getattr__(name):
    if name in _REFUSED:
        # AttributeError, so hasattr() probes of the namespace still answer False
        raise AttributeError(f"deepspeed.zero.{name} is not supported by zero_engine: {_REFUSED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
