"""DeepSpeed's learning-rate schedules (`scheduler` section of a ds_config), as torch ``LRScheduler`` subclasses.

    from zero_engine.schedulers import build_scheduler
    sched = build_scheduler("WarmupDecayLR", {"total_num_steps": 1000, "warmup_max_lr": 3e-4}, optimizer)
    for batch in data:
        ...; optimizer.step(); sched.step()

The three schedules give, for the same parameters and the same number of ``step()`` calls, the learning rates that
DeepSpeed (``deepspeed/runtime/lr_schedules.py``, checked against 0.19.8) gives. Being ``LRScheduler`` subclasses they
also work with anything written for torch schedulers (``get_last_lr()``, ``state_dict()``, checkpointing).

[Note: DeepSpeed's stepping convention]
DeepSpeed counts ``last_batch_iteration``: -1 at construction, then 0, 1, 2, ... after each ``step()``. Its formulas
are written in that count, and at construction the optimizer already gets the value for iteration -1 (the warmup
minimum, or 0 for WarmupCosineLR). Torch counts ``last_epoch``, which its base class moves from -1 to 0 by calling
``step()`` once inside ``__init__``. So here ``last_batch_iteration == last_epoch - 1`` at all times, and every
formula below is written in DeepSpeed's count. Consequence worth knowing: during warmup the first two learning
rates (construction, and after the first ``step()``) are both the warmup minimum, as in DeepSpeed.

Deliberate differences from DeepSpeed, each where DeepSpeed would silently do something surprising:
- an unknown ``warmup_type`` is a ValueError (DeepSpeed logs a warning and uses "log");
- ``total_num_steps`` must be a positive integer (DeepSpeed does not check it);
- an unknown or misspelled parameter in ``build_scheduler`` is a ValueError naming the closest known one
  (DeepSpeed raises Python's TypeError for an unexpected keyword).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from zero_engine.errors import ConfigError

__all__ = ["build_scheduler", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "WARMUP_TYPES"]

logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")

# The part of the state that says where the schedule is: all that load_state_dict takes from a checkpoint.
# Everything else (the schedule's parameters, base_lrs) stays as constructed: see
# [Note: resuming keeps the configured schedule].
_POSITION_KEYS = ("last_epoch", "_step_count", "_last_lr")


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _auto_hint(value: Any) -> str:
    if value == "auto":
        return "; 'auto' must be resolved to a value before the scheduler is built"
    return ""


def _require_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {_describe(value)}{_auto_hint(value)}")
    return value


def _require_positive_int(name: str, value: Any) -> int:
    # bool is an int subclass; `true` in a JSON config is a mistake, not 1 step.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {_describe(value)}{_auto_hint(value)}")
    return value


def _require_warmup_type(value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {list(WARMUP_TYPES)}, got {_describe(value)}")
    return value


def _per_group(name: str, value: Any, optimizer: torch.optim.Optimizer) -> list[float]:
    """A scalar applies to every param group; a list/tuple gives one value per group (DeepSpeed's rule)."""
    num_groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(
                f"{name} has {len(value)} values but the optimizer has {num_groups} param groups; "
                f"give one value per group or a single number for all"
            )
        return [_require_number(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [_require_number(name, value)] * num_groups


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # e.g. lists of multi-element tensors
        return False


def _warn_if_no_decay_window(cls_name: str, total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        logger.warning(
            "%s: total_num_steps %d is less than warmup_num_steps %d; the schedule jumps to its final value "
            "as soon as warmup ends",
            cls_name, total_num_steps, warmup_num_steps,
        )


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Progress through warmup in [0, 1) for ``0 <= iteration < warmup_num_steps``.

    log:    ln(iteration + 1) / ln(warmup_num_steps)
    linear: iteration / warmup_num_steps
    """
    if warmup_type == "log":
        # Multiplying by the precomputed inverse, as DeepSpeed does, keeps the results bit-identical to its values.
        return (1.0 / math.log(warmup_num_steps)) * math.log(iteration + 1)
    return iteration / warmup_num_steps


class _DeepSpeedStepScheduler(LRScheduler):
    """Maps DeepSpeed's ``last_batch_iteration`` onto torch's ``last_epoch``; see [Note: DeepSpeed's stepping
    convention]. Subclasses implement ``_lrs_at(iteration)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int) -> None:
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int) \
                or last_batch_iteration < -1:
            raise ValueError(
                f"last_batch_iteration must be -1 (start the schedule) or the index of the last batch already "
                f"trained, got {_describe(last_batch_iteration)}"
            )
        if last_batch_iteration != -1 and isinstance(optimizer, torch.optim.Optimizer):
            for index, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise ValueError(
                        f"last_batch_iteration={last_batch_iteration} resumes a schedule, which needs "
                        f"param_groups[{index}]['initial_lr'] (written when the scheduler was first built); load "
                        f"the optimizer's state first, or pass last_batch_iteration=-1 and load_state_dict() instead"
                    )
        # LRScheduler.__init__ steps once, taking last_epoch from last_batch_iteration to last_batch_iteration + 1.
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's count: -1 before the first ``step()``, then the index of the last batch trained."""
        return self.last_epoch - 1

    def _lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self._lrs_at(self.last_batch_iteration)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one batch, or jump to ``last_batch_iteration`` (DeepSpeed's optional argument)."""
        if last_batch_iteration is not None:
            # The base step() adds one to last_epoch, which then equals last_batch_iteration + 1.
            self.last_epoch = last_batch_iteration
        super().step()

    def state_dict(self) -> dict[str, Any]:
        """Torch's full state, plus DeepSpeed's one key (``last_batch_iteration``) so either can read it."""
        state = super().state_dict()
        state["last_batch_iteration"] = self.last_batch_iteration
        return state

    # [Note: resuming keeps the configured schedule]
    # DeepSpeed's scheduler state is only the iteration: on resume, the schedule's parameters come from the
    # config the job was restarted with, so a user can e.g. extend total_num_steps. Torch's default would instead
    # overwrite them with the checkpoint's, silently ignoring the config. We follow DeepSpeed and log what differs.
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the position in the schedule from our own ``state_dict()`` or from DeepSpeed's
        ``{'last_batch_iteration': n}``. The schedule's parameters stay as constructed (DeepSpeed's behaviour); a
        checkpoint whose parameters differ is logged. As in DeepSpeed, the optimizer's lr changes at the next
        ``step()``, or comes from the optimizer's own state."""
        if "last_epoch" in state_dict:
            position = {key: state_dict[key] for key in _POSITION_KEYS if key in state_dict}
        elif "last_batch_iteration" in state_dict:
            position = {"last_epoch": state_dict["last_batch_iteration"] + 1}
        else:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state has neither 'last_epoch' nor "
                f"'last_batch_iteration' (keys: {sorted(state_dict)}); it does not come from a scheduler"
            )
        current = super().state_dict()
        for key, saved in state_dict.items():
            if key in _POSITION_KEYS or key == "last_batch_iteration" or key.startswith("_") \
                    or key not in current or _equal(current[key], saved):
                continue
            logger.warning(
                "%s: checkpoint has %s=%r but this scheduler was built with %r; keeping %r (as DeepSpeed does)",
                type(self).__name__, key, saved, current[key], current[key],
            )
        super().load_state_dict(position)


class WarmupLR(_DeepSpeedStepScheduler):
    """Warm the learning rate up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    With ``i = last_batch_iteration`` (-1 at construction, +1 per ``step()``), ``W = max(2, warmup_num_steps)``:

        lr(i) = warmup_min_lr                                     for i < 0
        lr(i) = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * g(i)
        g(i)  = ln(i + 1) / ln(W)      warmup_type "log"     for 0 <= i < W
              = i / W                  warmup_type "linear"  for 0 <= i < W
              = 1                                            for i >= W

    "log" rises quickly at first and flattens; "linear" is even. ``warmup_min_lr`` and ``warmup_max_lr`` take one
    number for all param groups or a list with one per group; ``warmup_max_lr=None`` uses each group's lr from
    the optimizer. ``warmup_num_steps`` must be a positive integer; 1 acts as 2 (DeepSpeed does the same, since
    ln(1) = 0). ``last_batch_iteration`` is -1 to start, or the last trained batch to resume (the optimizer's
    param groups must then hold ``initial_lr``).
    """

    def __init__(self,
                 optimizer: torch.optim.Optimizer,
                 warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None,
                 warmup_num_steps: int = 1000,
                 warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.warmup_num_steps = max(2, _require_positive_int("warmup_num_steps", warmup_num_steps))
        self.warmup_type = _require_warmup_type(warmup_type)
        self.min_lrs = _per_group("warmup_min_lr", warmup_min_lr, optimizer)
        # None: resolved to the groups' base lrs, which exist only once LRScheduler.__init__ has recorded them.
        self.max_lrs = None if warmup_max_lr is None else _per_group("warmup_max_lr", warmup_max_lr, optimizer)
        super().__init__(optimizer, last_batch_iteration)

    def _warmup_gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._warmup_gamma(iteration)
        max_lrs = self.base_lrs if self.max_lrs is None else self.max_lrs
        return [min_lr + (max_lr - min_lr) * gamma for min_lr, max_lr in zip(self.min_lrs, max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warmup, then a linear decay back to ``warmup_min_lr`` at ``total_num_steps``.

    With ``i``, ``W`` and the warmup ``g(i)`` as in :class:`WarmupLR` and ``T = total_num_steps``:

        lr(i) = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * g(i)
        g(i)  = max(0, (T - i) / max(1, T - W))    for i >= W

    so the rate reaches ``warmup_max_lr`` at i = W, falls linearly, and stays at ``warmup_min_lr`` from i = T on.
    ``total_num_steps`` (required, a positive integer) counts optimizer steps, not micro-batches. Note that
    ``warmup_max_lr`` defaults to 0.001 here, not to the optimizer's lr: DeepSpeed's default, kept so that a config
    that leaves it out trains the same way.
    """

    def __init__(self,
                 optimizer: torch.optim.Optimizer,
                 total_num_steps: int,
                 warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = 0.001,
                 warmup_num_steps: int = 1000,
                 warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _require_positive_int("total_num_steps", total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        _warn_if_no_decay_window(type(self).__name__, self.total_num_steps, self.warmup_num_steps)

    def _warmup_gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        decay_steps = float(max(1.0, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_DeepSpeedStepScheduler):
    """Scale each param group's own lr: warm the ratio up to 1, then cosine-decay it to ``cos_min_ratio``.

    With ``i`` and ``W`` as in :class:`WarmupLR`, ``T = total_num_steps`` and ``base_lr`` the group's lr when the
    scheduler is built:

        lr(i) = base_lr * r(i)
        r(i)  = 0                                                  for i < 0 (at construction)
        r(i)  = warmup_min_ratio + (1 - warmup_min_ratio) * g(i)   for 0 <= i < W, g as in WarmupLR
        r(i)  = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)   for i >= W
        p     = min(1, (i - W + 1) / max(1, T - W))

    so the ratio is close to 1 just after warmup and reaches ``cos_min_ratio`` at i = T - 1, then stays there.
    Unlike WarmupLR there is no absolute lr here: the optimizer's per-group lr is the peak, which makes it the
    natural choice with param groups of different lrs. ``total_num_steps`` is required (positive integer);
    ``warmup_min_ratio`` and ``cos_min_ratio`` are single numbers.
    """

    def __init__(self,
                 optimizer: torch.optim.Optimizer,
                 total_num_steps: int,
                 warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _require_positive_int("total_num_steps", total_num_steps)
        self.warmup_num_steps = max(2, _require_positive_int("warmup_num_steps", warmup_num_steps))
        self.warmup_min_ratio = _require_number("warmup_min_ratio", warmup_min_ratio)
        self.cos_min_ratio = _require_number("cos_min_ratio", cos_min_ratio)
        self.warmup_type = _require_warmup_type(warmup_type)
        _warn_if_no_decay_window(type(self).__name__, self.total_num_steps, self.warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)

    def _ratio_at(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            warmup = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + warmup * (1.0 - self.warmup_min_ratio)
        steps_into_decay = iteration - self.warmup_num_steps + 1
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, steps_into_decay / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return [0.0 for _ in self.base_lrs]
        ratio = self._ratio_at(iteration)
        return [base_lr * ratio for base_lr in self.base_lrs]


_SCHEDULERS: dict[str, type[_DeepSpeedStepScheduler]] = {
    cls.__name__.lower(): cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR)
}
# DeepSpeed has these too; naming them gives "not supported yet" rather than "unknown".
_DEEPSPEED_ONLY = ("LRRangeTest", "OneCycle")


def _unsupported_type_error(type_name: Any) -> ConfigError:
    supported = ", ".join(cls.__name__ for cls in _SCHEDULERS.values())
    if isinstance(type_name, str):
        if type_name.lower() in (name.lower() for name in _DEEPSPEED_ONLY):
            return ConfigError(f"scheduler.type {type_name!r} is not supported yet; supported: {supported}")
        torch_scheduler = getattr(torch.optim.lr_scheduler, type_name, None)
        if inspect.isclass(torch_scheduler) and issubclass(torch_scheduler, LRScheduler):
            return ConfigError(
                f"scheduler.type {type_name!r} (a torch.optim.lr_scheduler class, which DeepSpeed accepts by name) "
                f"is not supported yet in the config; build it yourself and pass it as lr_scheduler=..., or use "
                f"one of: {supported}"
            )
        close = difflib.get_close_matches(type_name.lower(), list(_SCHEDULERS), n=1)
        hint = f"; did you mean {_SCHEDULERS[close[0]].__name__!r}?" if close else ""
        return ConfigError(f"scheduler.type {type_name!r} is not a known scheduler; supported: {supported}{hint}")
    return ConfigError(f"scheduler.type must be a string, got {_describe(type_name)}; supported: {supported}")


def build_scheduler(type_name: str,
                    params: Mapping[str, Any] | None,
                    optimizer: torch.optim.Optimizer) -> _DeepSpeedStepScheduler:
    """Build the ds_config ``scheduler`` section: ``type_name`` (case-insensitive: "WarmupLR", "WarmupDecayLR",
    "WarmupCosineLR") with keyword ``params``, stepping ``optimizer``.

    Raises ConfigError (a ValueError) for an unknown type, naming it and listing the supported ones, and for a
    missing, unknown or invalid parameter, naming ``scheduler.params.<key>``.
    """
    cls = _SCHEDULERS.get(type_name.lower()) if isinstance(type_name, str) else None
    if cls is None:
        raise _unsupported_type_error(type_name)
    params = {} if params is None else params
    if not isinstance(params, Mapping):
        raise ConfigError(f"scheduler.params must be a JSON object for {cls.__name__}, got {_describe(params)}")

    signature = inspect.signature(cls.__init__)
    accepted = [name for name in signature.parameters if name not in ("self", "optimizer")]
    for key in params:
        if key not in accepted:
            close = difflib.get_close_matches(str(key), accepted, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"scheduler.params.{key} is not a parameter of {cls.__name__}; {hint}accepted: {', '.join(accepted)}"
            )
    for name in accepted:
        if signature.parameters[name].default is inspect.Parameter.empty and name not in params:
            raise ConfigError(f"scheduler.params.{name} is required for {cls.__name__}")

    try:
        scheduler = cls(optimizer, **params)
    except ValueError as error:
        raise ConfigError(f"scheduler.params for {cls.__name__}: {error}") from error
    logger.info("lr scheduler: %s(%s)", cls.__name__, ", ".join(f"{k}={v!r}" for k, v in params.items()))
    return scheduler
