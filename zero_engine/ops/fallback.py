"""Pick the fastest Adam that works here: our op when it builds, else torch's fused or foreach AdamW.

The choice is made once per optimizer and logged once per process and reason, as nanoGPT reports
"using fused AdamW": an INFO line when the op is used, one WARNING that says why when it is not.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from .builder import OpBuildError
from .cpu_adam import CPUAdam
from .fused_adam import FusedAdam

logger = logging.getLogger(__name__)

_OPTIMIZER_FOR_DEVICE = {"cpu": CPUAdam, "cuda": FusedAdam}
_logged: set[tuple[str, str]] = set()


def _log_once(level: int, key: tuple[str, str], message: str) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, message)


def _torch_adam(params: list[Any], device_type: str, adam_kwargs: dict[str, Any],
                reason: str) -> tuple[torch.optim.Optimizer, str]:
    kwargs = dict(adam_kwargs)
    adamw_mode = kwargs.pop("adamw_mode", True)
    if not kwargs.pop("bias_correction", True):
        raise NotImplementedError(f"bias_correction=False needs the zero_engine op for device {device_type!r}, "
                                  f"which is unavailable here ({reason}); torch's Adam always corrects bias")
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    try:
        optimizer = torch_class(params, fused=True, **kwargs)
        implementation = "fused=True"
    except (RuntimeError, ValueError):
        # fused is not implemented for this device type or dtype; foreach still batches the math.
        optimizer = torch_class(params, foreach=True, **kwargs)
        implementation = "foreach=True"
    return optimizer, f"torch.optim.{torch_class.__name__}({implementation})"


def make_adam(params: Iterable[Any], device_type: str, **adam_kwargs: Any) -> tuple[torch.optim.Optimizer, str]:
    """An Adam/AdamW optimizer for parameters on ``device_type`` ("cpu" or "cuda"), and a description.

    ``adam_kwargs`` are CPUAdam's (torch.optim.AdamW's names plus ``adamw_mode`` and
    ``bias_correction``). Returns CPUAdam on "cpu" and FusedAdam on "cuda" when the op builds; otherwise
    torch.optim.AdamW (or Adam when ``adamw_mode=False``) with ``fused=True`` where torch supports it,
    else ``foreach=True``, after one WARNING naming the reason. Set ZERO_ENGINE_DISABLE_OPS=1 to force
    the fallback.
    """
    if device_type not in _OPTIMIZER_FOR_DEVICE:
        raise ValueError(f"make_adam: device_type must be one of {sorted(_OPTIMIZER_FOR_DEVICE)}, got {device_type!r}")
    if adam_kwargs.get("amsgrad", False):
        # Refused on every path, so that the same config does not behave differently where the op is missing.
        raise ValueError("make_adam: amsgrad=True is not supported by zero_engine's Adam; set amsgrad to false")
    params = list(params)  # may be a generator, and the fallback needs it a second time
    optimizer_class = _OPTIMIZER_FOR_DEVICE[device_type]
    try:
        optimizer = optimizer_class(params, **adam_kwargs)
    except OpBuildError as err:
        optimizer, description = _torch_adam(params, device_type, adam_kwargs, err.reason)
        _log_once(logging.WARNING, (device_type, err.reason),
                  f"zero_engine op {err.op_name!r} unavailable ({err.reason}); using {description} instead")
        return optimizer, description
    kernel = f", {optimizer.kernel_info}" if isinstance(optimizer, CPUAdam) else ""
    description = f"zero_engine.ops.{optimizer_class.__name__}({optimizer_class.op_name} op{kernel})"
    _log_once(logging.INFO, (device_type, "op"), f"using {description}")
    return optimizer, description
