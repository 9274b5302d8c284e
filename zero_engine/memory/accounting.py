"""Byte counters per category, with peaks, plus process RSS.

The engine reports what it allocates (gather buffers, gradient buckets) here as it happens; standing categories
(shards, masters, optimizer states) are computed from the tensors when asked. RSS comes from the OS: on Linux the
peak (VmHWM) can be reset through /proc/self/clear_refs, so "peak since the last reset" is real, not estimated.
"""

from __future__ import annotations

from collections import defaultdict

import psutil

__all__ = ["MemoryAccounting", "rss_bytes", "rss_peak_bytes", "reset_rss_peak"]


class MemoryAccounting:
    def __init__(self):
        self.current: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)

    def add(self, category: str, nbytes: int) -> None:
        self.current[category] += nbytes
        self.peak[category] = max(self.peak[category], self.current[category])

    def reset_peaks(self) -> None:
        self.peak = defaultdict(int, self.current)


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def rss_peak_bytes() -> int:
    """Peak resident set size since the last ``reset_rss_peak()`` (process lifetime where unsupported)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # not on Windows; fine as a fallback on other Unixes

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_rss_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5" resets the peak RSS counter (VmHWM) to the current RSS
    except OSError:
        pass
