"""cuda_syncs: the host synchronisations a call makes on CUDA, each with the Python line that made it."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import torch


def cuda_syncs(run: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``run()``'s result and, for each synchronising CUDA call it made, ``"file.py:line"`` of the Python frame that
    made it. torch.cuda.set_sync_debug_mode("warn") turns each sync into a warning (a ``.item()`` of a device tensor,
    a blocking copy, a stream or device synchronize); ``"error"`` would stop at the first."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()]
