"""Profiler ranges that cost nothing when no profiler is running.

``torch.profiler.record_function`` enters a dispatcher op on every call, profiler or not (about 0.1 ms of Python
and dispatch on a loaded CPU): at a few ranges per module per pass that was a visible share of a small model's
step. ``profile_range(name)`` checks once whether a profiler is collecting and only then opens the range, so a
profiler trace still explains a step (every hook and collective is named) while a plain run pays one C call.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

__all__ = ["profile_range"]

_NO_RANGE = contextlib.nullcontext()
_profiler_enabled = torch.autograd._profiler_enabled


def profile_range(name: str, detail: str = ""):
    """``record_function(name)`` (``"name detail"`` when a detail is given) while a profiler runs; a shared no-op
    context otherwise. Pass the parts apart on a hot path: they are joined only when a profiler collects."""
    if not _profiler_enabled():
        return _NO_RANGE
    return record_function(f"{name} {detail}" if detail else name)
