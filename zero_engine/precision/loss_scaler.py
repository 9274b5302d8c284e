"""Loss scaling for fp16 training, with DeepSpeed's semantics and config keys.

fp16 has a narrow exponent range: small gradients underflow to zero. The loss is multiplied by a scale before
backward and the gradients divided by it before the update. With dynamic scaling (``fp16.loss_scale: 0``) the scale
starts at ``2**initial_scale_power``; a step whose gradients contain inf/nan on any rank is skipped and, once
``hysteresis`` overflows have been seen, the scale is halved (never below ``min_loss_scale``); after
``loss_scale_window`` steps without overflow it doubles. ``consecutive_hysteresis`` refills the hysteresis budget
after every good step instead of only when the scale grows.
"""

from __future__ import annotations

import logging

log = logging.getLogger("zero_engine.precision")

__all__ = ["StaticLossScaler", "DynamicLossScaler", "make_loss_scaler"]


class StaticLossScaler:
    """A fixed scale (``fp16.loss_scale > 0``); a step with overflowing gradients is still skipped."""

    is_dynamic = False

    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        if overflow:
            log.warning("fp16 gradient overflow with static loss scale %g: step skipped", self.scale)

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    is_dynamic = True

    def __init__(self, init_scale: float, scale_window: int, hysteresis: int, min_scale: float,
                 consecutive_hysteresis: bool = False, scale_factor: float = 2.0):
        self.scale = float(init_scale)
        self.scale_window = int(scale_window)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.scale_factor = scale_factor
        self.remaining_hysteresis = self.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        """Called once per optimizer step with the overflow decision every rank agreed on."""
        if overflow:
            if self.hysteresis == 1 or self.remaining_hysteresis == 1:
                if self.scale <= self.min_scale:
                    raise RuntimeError(
                        f"fp16 gradients still overflow at the minimum loss scale {self.min_scale:g} "
                        "(fp16.min_loss_scale): training has diverged or the model does not fit fp16's range. "
                        "Lower the learning rate, use bf16, or lower fp16.min_loss_scale.")
                old = self.scale
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
                log.warning("fp16 gradient overflow: step skipped, loss scale %g -> %g", old, self.scale)
            else:
                self.remaining_hysteresis -= 1
                log.warning("fp16 gradient overflow: step skipped, loss scale kept at %g (hysteresis %d left)",
                            self.scale, self.remaining_hysteresis)
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.remaining_hysteresis = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.remaining_hysteresis = self.hysteresis
                self.scale *= self.scale_factor
        self.iteration += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "remaining_hysteresis": self.remaining_hysteresis,
                "iteration": self.iteration, "last_overflow_iteration": self.last_overflow_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.remaining_hysteresis = int(state["remaining_hysteresis"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])


def make_loss_scaler(fp16_config):
    """The scaler for an ``fp16`` config section, or None when fp16 is off."""
    if not fp16_config.enabled:
        return None
    if fp16_config.loss_scale > 0:
        return StaticLossScaler(fp16_config.loss_scale)
    return DynamicLossScaler(init_scale=2.0 ** fp16_config.initial_scale_power,
                             scale_window=fp16_config.loss_scale_window, hysteresis=fp16_config.hysteresis,
                             min_scale=fp16_config.min_loss_scale,
                             consecutive_hysteresis=fp16_config.consecutive_hysteresis)
