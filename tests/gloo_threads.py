"""What a test reads to tell that a gloo process group was destroyed: its C++ threads, which only the group's
destruction ends, and which Linux names in /proc (see [Note: clean shutdown] in zero_engine/comm/watchdog.py)."""

from __future__ import annotations

import os

import pytest

needs_thread_names = pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                                        reason="reads thread names from /proc (Linux)")


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads, sorted."""
    return sorted(name for name in (open(f"/proc/self/task/{task}/comm").read().strip()
                                    for task in os.listdir("/proc/self/task")) if "gloo" in name)
