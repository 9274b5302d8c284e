"""What a test reads to tell that a gloo process group was destroyed: its C++ threads, which only the group's
destruction ends, and which Linux names in /proc (see [Note: clean shutdown] in zero_engine/comm/watchdog.py)."""

from __future__ import annotations

import gc
import os

import pytest
import torch.distributed as dist

needs_thread_names = pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                                        reason="reads thread names from /proc (Linux)")


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads, sorted."""
    return sorted(name for name in (open(f"/proc/self/task/{task}/comm").read().strip()
                                    for task in os.listdir("/proc/self/task")) if "gloo" in name)


def destroy_group_and_check() -> None:
    """End a launched script's rank as torch asks, destroying the group before the interpreter ends, and check that it
    was destroyed: no gloo thread left. A group left to interpreter exit can abort the rank ("terminate called without
    an active exception"): a gloo thread letting go of the last collective's tensors then needs the GIL that
    finalization holds (docs/benchmarks.md, "A gloo group left to interpreter exit"). Garbage is collected first, so
    that engines dropped with their trainers let go of the group."""
    gc.collect()
    dist.destroy_process_group()
    left = gloo_threads()
    if left:
        raise RuntimeError(f"gloo threads still running after destroy_process_group(): {left}; something still holds "
                           "the process group")
