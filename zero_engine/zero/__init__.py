"""ZeRO partitioning: parameters, gathers, the coordinator, hooks, gradient buckets, the partitioned optimizer.

Public here: ``Init`` (partition while building a model) and ``GatheredParameters`` (full parameters for a block).
"""

from .gathered import GatheredParameters
from .init import Init
from .partition import ParamStatus, ShardedParam, ZeroParameter

__all__ = ["Init", "GatheredParameters", "ParamStatus", "ShardedParam", "ZeroParameter"]
