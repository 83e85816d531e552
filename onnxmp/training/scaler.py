"""Dynamic loss scaling, with Keras ``LossScaleOptimizer`` defaults and semantics."""
from __future__ import annotations

import math
from typing import Any

from onnxmp.errors import OnnxMPError


class DynamicLossScaler:
    """Loss scale that backs off on non-finite gradients and grows after a run of finite ones.

    ``update(all_finite)`` is called once per effective batch and returns
    whether the optimizer should step.  On a finite step it counts a good
    step, and after ``growth_steps`` consecutive good steps multiplies the
    scale by ``growth_factor`` (capped at ``max_scale``).  On a non-finite step
    it multiplies the scale by ``backoff_factor`` (floored at ``min_scale``)
    and resets the count.

    A static scaler (``dynamic=False`` or :meth:`static`) never changes its
    scale, but non-finite steps are still skipped, so a NaN batch cannot
    poison the weights.
    """

    def __init__(self, initial_scale: float = 2.0**15, *, growth_steps: int = 2000, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, min_scale: float = 1.0, max_scale: float = 2.0**24,
                 dynamic: bool = True):
        if not (math.isfinite(initial_scale) and initial_scale > 0):
            raise OnnxMPError(f"initial_scale must be a positive finite number, got {initial_scale}")
        if dynamic:
            if int(growth_steps) != growth_steps or growth_steps < 1:
                raise OnnxMPError(f"growth_steps must be a positive integer, got {growth_steps}")
            if not growth_factor >= 1:
                raise OnnxMPError(f"growth_factor must be >= 1, got {growth_factor}")
            if not 0 < backoff_factor <= 1:
                raise OnnxMPError(f"backoff_factor must be in (0, 1], got {backoff_factor}")
            if not 0 < min_scale <= initial_scale <= max_scale:
                raise OnnxMPError(f"need 0 < min_scale <= initial_scale <= max_scale, got "
                                  f"{min_scale}, {initial_scale}, {max_scale}")
        self.initial_scale = float(initial_scale)
        self.growth_steps = int(growth_steps)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.dynamic = bool(dynamic)
        self.scale = self.initial_scale
        self.good_steps = 0

    @classmethod
    def static(cls, scale: float = 1.0) -> "DynamicLossScaler":
        return cls(scale, dynamic=False)

    def update(self, all_finite: bool) -> bool:
        """Record one effective batch; True when its update should be applied."""
        if all_finite:
            if self.dynamic:
                self.good_steps += 1
                if self.good_steps >= self.growth_steps:
                    self.scale = min(self.scale * self.growth_factor, self.max_scale)
                    self.good_steps = 0
            return True
        if self.dynamic:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        self.good_steps = 0
        return False

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "initial_scale": self.initial_scale,
            "growth_steps": self.growth_steps,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.initial_scale = float(state["initial_scale"])
            self.growth_steps = int(state["growth_steps"])
            self.growth_factor = float(state["growth_factor"])
            self.backoff_factor = float(state["backoff_factor"])
            self.min_scale = float(state["min_scale"])
            self.max_scale = float(state["max_scale"])
            self.dynamic = bool(state["dynamic"])
            self.scale = float(state["scale"])
            self.good_steps = int(state["good_steps"])
        except (KeyError, TypeError, ValueError) as exc:
            raise OnnxMPError(f"not a loss scaler state: {exc}", "was it saved by onnxmp?") from None

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "DynamicLossScaler":
        scaler = cls()
        scaler.load_state_dict(state)
        return scaler

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"DynamicLossScaler({kind}, scale={self.scale:g}, good_steps={self.good_steps})"
