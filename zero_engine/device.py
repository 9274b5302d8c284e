"""Which device this rank computes on, and putting the model there before it is partitioned (as DeepSpeed does).

[Note: one device per rank]
A rank computes on ``cuda:LOCAL_RANK`` when CUDA is available (torchrun sets LOCAL_RANK; ``init_distributed`` makes
that device current), else on the CPU. ``LOCAL_RANK`` is taken modulo the visible device count, so several ranks
can share one GPU in tests (gloo only: NCCL refuses two ranks on one device). ``initialize()`` moves a model that
is still whole onto that device before sharding it, so every buffer the engine derives from a parameter (shards,
full buffers, flat gather buffers, gradient buckets, fp32 masters) is created on the rank's device. A model built
under ``zero.Init`` was placed parameter by parameter while it was built (zero.Init moves each parameter to
``local_device()`` before sharding it) and is left where it is; one on the meta device (shape-only runs on the fake
process group) stays there.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.nn as nn

log = logging.getLogger("zero_engine.device")

__all__ = ["device_for", "local_device", "place_module"]


def device_for(local_rank: Optional[int], cuda_device_count: int) -> torch.device:
    """The device of the rank with ``local_rank`` on a host with ``cuda_device_count`` visible GPUs."""
    if cuda_device_count <= 0:
        return torch.device("cpu")
    if local_rank is None:
        local_rank = torch.cuda.current_device()
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK={local_rank} must be >= 0")
    return torch.device("cuda", local_rank % cuda_device_count)


def local_device() -> torch.device:
    """This rank's compute device (see [Note: one device per rank])."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    value = os.environ.get("LOCAL_RANK", "")
    try:
        local_rank = int(value) if value else None
    except ValueError:
        raise ValueError(f"environment variable LOCAL_RANK={value!r} is not an integer") from None
    return device_for(local_rank, count)


def place_module(module: nn.Module, device: torch.device, is_partitioned) -> torch.device:
    """Move ``module``'s parameters and buffers to ``device`` unless they are partitioned or on meta.

    ``is_partitioned(param)`` says whether zero.Init already sharded a parameter. Returns the device the module's
    parameters are on afterwards (the one every engine buffer is allocated on).
    """
    params = list(module.parameters())
    if not params:
        return device
    partitioned = [p for p in params if is_partitioned(p)]
    if any(p.device.type == "meta" for p in params):
        return torch.device("meta")
    if partitioned:
        if len(partitioned) != len(params):
            raise ValueError(f"model: {len(partitioned)} of {len(params)} parameters were partitioned by zero.Init and "
                             "the others were not; build the whole model inside one `with zero.Init():` block")
        placed = {p.device for p in params}
        if len(placed) > 1:
            raise ValueError(f"model: zero.Init partitioned its parameters onto several devices "
                             f"({', '.join(sorted(map(str, placed)))}); build it on one")
        where = placed.pop()
        if where != device:
            log.warning("model was partitioned by zero.Init on %s while this rank computes on %s: it stays on %s "
                        "(build it under zero.Init after init_distributed() so it lands on %s)", where, device,
                        where, device)
        return where
    if any(p.device != device for p in params) or any(b.device != device for b in module.buffers()):
        module.to(device)
        log.info("moved the model to %s", device)
    return device
