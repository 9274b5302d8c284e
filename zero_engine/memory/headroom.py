"""How much more memory this rank may use: the budget behind ``stage3_allgather_sequential: "auto"``.

On GPU the device's free memory (``torch.cuda.mem_get_info``). On CPU, a per-rank limit: ``zero_engine.memory_limit``
when configured, else the cgroup's memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), else physical
memory, the latter two divided by the ranks on this node (they share it); minus this process's RSS.
"""

from __future__ import annotations

import os

import psutil
import torch

from .accounting import rss_bytes

__all__ = ["MemoryBudget", "memory_budget"]

_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


class MemoryBudget:
    def __init__(self, limit: int, used: int, source: str):
        self.limit = limit  # bytes this rank may use in all
        self.used = used  # bytes in use now
        self.source = source  # where the limit came from, for the log line

    @property
    def headroom(self) -> int:
        return self.limit - self.used


def _cgroup_limit() -> int | None:
    for path in _CGROUP_FILES:
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" or a huge number: no limit
            return int(text)
    return None


def memory_budget(device: torch.device, configured_limit: int | None = None) -> MemoryBudget:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return MemoryBudget(total, total - free, f"free memory of {device}")
    used = rss_bytes()
    if configured_limit is not None:
        return MemoryBudget(int(configured_limit), used, "zero_engine.memory_limit")
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    cgroup = _cgroup_limit()
    if cgroup is not None:
        return MemoryBudget(cgroup // local_ranks, used, f"cgroup limit / {local_ranks} local ranks")
    return MemoryBudget(psutil.virtual_memory().total // local_ranks, used, f"physical memory / {local_ranks} "
                        "local ranks")
