"""ZeRO partitioning: parameters, gathers, the coordinator, hooks, gradient buckets, the partitioned optimizer."""

from .partition import ParamStatus, ShardedParam

__all__ = ["ParamStatus", "ShardedParam"]
