"""Dynamic loss scaling with ``torch.amp.GradScaler``'s settings, defaults and update rule.

``DynamicLossScaler(init_scale=2**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
enabled=True)`` are GradScaler's names and defaults: users compare a mixed-precision run with
torch's, so the scale trajectory is torch's step for step (tests/training/data/scaler_references.json).
Before GradScaler parity the defaults were Keras' ``LossScaleOptimizer`` ones (initial scale 2**15); the
Keras-style names ``initial_scale`` and ``growth_steps`` still work as aliases.

Two bounds torch does not have: the scale never grows past ``max_scale`` (2**24, or the initial
scale when larger; torch stops only at float32's overflow) and never backs off below ``min_scale``
(1: below it the scale would shrink gradients that already overflow float16 unscaled).  A
non-finite update is skipped at any scale, even with ``enabled=False`` (torch would apply it), so a
NaN batch cannot poison the weights.

No silent no-op: :meth:`DynamicLossScaler.update` logs a WARNING after ``warn_after_skips``
updates skipped in a row (and at every further multiple), and
:meth:`DynamicLossScaler.check_progress`, called after it, raises :class:`OnnxMPError` where no
loss scale can help: a non-finite loss in float32 / bfloat16 (or with a static scale), or
non-finite gradients with the scale already at its floor.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Mapping

from onnxmp.errors import OnnxMPError

log = logging.getLogger("onnxmp.training.run.loss_scaler")

MAX_SCALE = 2.0**24
# 2**24 down to 2**4 is 20 halvings: a streak that long is no longer the scale finding its level.
WARN_AFTER_SKIPS = 20
_NO_OVERFLOW = ("float32", "bfloat16")  # float32's range: a non-finite loss there is no scaling matter


class DynamicLossScaler:
    """Loss scale that backs off on non-finite gradients and grows after a run of finite ones.

    ``update(all_finite)`` is called once per effective batch and returns whether the optimizer
    should step.  On a finite step it counts a good step, and after ``growth_interval``
    consecutive good steps multiplies the scale by ``growth_factor`` (capped at ``max_scale``).
    On a non-finite step it multiplies the scale by ``backoff_factor`` (floored at ``min_scale``)
    and resets the count.

    A static scaler (``dynamic=False``, :meth:`static`, or ``enabled=False``, which means a
    static scale of 1 as in torch) never changes its scale, but non-finite steps are still
    skipped, so a NaN batch cannot poison the weights.
    """

    def __init__(self, init_scale: float | None = None, *, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int | None = None, enabled: bool = True, min_scale: float = 1.0,
                 max_scale: float | None = None, dynamic: bool = True, warn_after_skips: int = WARN_AFTER_SKIPS,
                 initial_scale: float | None = None, growth_steps: int | None = None):
        init_scale = _alias("init_scale", init_scale, "initial_scale", initial_scale, 2.0**16)
        growth_interval = _alias("growth_interval", growth_interval, "growth_steps", growth_steps, 2000)
        if not enabled:
            init_scale, dynamic = 1.0, False
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise OnnxMPError(f"init_scale must be a positive finite number, got {init_scale}")
        if max_scale is None:
            max_scale = max(MAX_SCALE, float(init_scale))
        if dynamic:
            if int(growth_interval) != growth_interval or growth_interval < 1:
                raise OnnxMPError(f"growth_interval must be a positive integer, got {growth_interval}")
            if not growth_factor >= 1:
                raise OnnxMPError(f"growth_factor must be >= 1, got {growth_factor}")
            if not 0 < backoff_factor <= 1:
                raise OnnxMPError(f"backoff_factor must be in (0, 1], got {backoff_factor}")
            if not 0 < min_scale <= init_scale <= max_scale:
                raise OnnxMPError(f"need 0 < min_scale <= init_scale <= max_scale, got "
                                  f"{min_scale}, {init_scale}, {max_scale}")
        if int(warn_after_skips) != warn_after_skips or warn_after_skips < 0:
            raise OnnxMPError(f"warn_after_skips must be a non-negative integer (0: never), got {warn_after_skips}")
        self.init_scale = float(init_scale)
        self.growth_interval = int(growth_interval)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.dynamic = bool(dynamic)
        self.warn_after_skips = int(warn_after_skips)
        self.scale = self.init_scale
        self.good_steps = 0
        self.skipped_in_row = 0  # updates skipped since the last applied one
        self.last_finite = True  # the last update()'s all_finite
        self.overflow_at_floor = False  # the last update() was not finite with the scale already at min_scale

    # Keras-style names of the same settings (onnxmp's API before GradScaler parity).
    @property
    def initial_scale(self) -> float:
        return self.init_scale

    @property
    def growth_steps(self) -> int:
        return self.growth_interval

    @property
    def enabled(self) -> bool:
        """False for a static scale of 1: no scaling at all, as torch's ``enabled=False``."""
        return self.dynamic or self.init_scale != 1.0

    @classmethod
    def static(cls, scale: float = 1.0) -> "DynamicLossScaler":
        return cls(scale, dynamic=False)

    @classmethod
    def of(cls, scaler: "DynamicLossScaler | Mapping | None", precision: str) -> "DynamicLossScaler":
        """The Trainer's ``scaler`` argument: a scaler, a mapping of its settings, or None: dynamic for
        float16, a static scale of 1 otherwise (bfloat16 and float32 have float32's range)."""
        if scaler is None:
            return cls() if precision == "float16" else cls.static(1.0)
        return cls(**scaler) if isinstance(scaler, Mapping) else scaler

    def update(self, all_finite: bool) -> bool:
        """Record one effective batch; True when its update should be applied."""
        self.last_finite = bool(all_finite)
        if all_finite:
            if self.dynamic:
                self.good_steps += 1
                if self.good_steps >= self.growth_interval:
                    self.scale = min(self.scale * self.growth_factor, self.max_scale)
                    self.good_steps = 0
            self.skipped_in_row = 0
            self.overflow_at_floor = False
            return True
        self.overflow_at_floor = self.dynamic and self.scale <= self.min_scale
        if self.dynamic:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        self.good_steps = 0
        self.skipped_in_row += 1
        if self.warn_after_skips and self.skipped_in_row % self.warn_after_skips == 0:
            log.warning("%d updates in a row skipped: the gradients were not finite each time (loss scale now %g); "
                        "the weights have not changed since", self.skipped_in_row, self.scale)
        return False

    def check_progress(self, losses: float | Iterable[float | None] | None, *, precision: str) -> None:
        """After :meth:`update`: raise :class:`OnnxMPError` where no loss scale can make the run progress.

        ``losses`` are the unscaled losses of the effective batch just decided (``None`` for a
        padding micro-step), ``precision`` the artifacts' (``float16``, ``bfloat16``, ``float32``).
        Nothing to say when the update was applied: a NaN loss with finite gradients (every
        label ignored, as torch gives) still trains.  With float16 and a dynamic scale an
        overflow is expected now and then: the scale backs off, and only the floor is an error.
        """
        if self.last_finite:
            return
        values = [losses] if isinstance(losses, (int, float)) else [v for v in (losses or ()) if v is not None]
        bad = next((float(v) for v in values if not math.isfinite(v)), None)
        if bad is not None and (precision in _NO_OVERFLOW or not self.dynamic):
            where = f"in {precision}" if precision in _NO_OVERFLOW else f"with a static loss scale of {self.scale:g}"
            raise OnnxMPError(f"the loss is {bad} {where}, and so are the gradients: no loss scale can help, "
                              "every such update would be skipped",
                              "check the batch for NaN/inf, the learning rate (a diverged run) and the loss "
                              "(log of 0, division by 0); resume from the last good state")
        if self.overflow_at_floor:
            raise OnnxMPError(f"the gradients are not finite with the loss scale at its floor (min_scale="
                              f"{self.min_scale:g}): backing off further cannot help, the run would skip "
                              "every update from here",
                              "the model overflows float16 even unscaled: train in bfloat16 or float32, "
                              "lower the learning rate, or check the data")

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "initial_scale": self.init_scale,
            "growth_steps": self.growth_interval,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "dynamic": self.dynamic,
            "skipped_in_row": self.skipped_in_row,
            "warn_after_skips": self.warn_after_skips,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.init_scale = float(state["initial_scale"])
            self.growth_interval = int(state["growth_steps"])
            self.growth_factor = float(state["growth_factor"])
            self.backoff_factor = float(state["backoff_factor"])
            self.min_scale = float(state["min_scale"])
            self.max_scale = float(state["max_scale"])
            self.dynamic = bool(state["dynamic"])
            self.scale = float(state["scale"])
            self.good_steps = int(state["good_steps"])
            # Absent from states saved before the skip streak was kept.
            self.skipped_in_row = int(state.get("skipped_in_row", 0))
            self.warn_after_skips = int(state.get("warn_after_skips", WARN_AFTER_SKIPS))
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


def _alias(name: str, value, old_name: str, old_value, default):
    if value is not None and old_value is not None and value != old_value:
        raise OnnxMPError(f"{name}={value} and {old_name}={old_value} name the same setting",
                          f"pass {name} (torch's name) only")
    chosen = value if value is not None else old_value
    return default if chosen is None else chosen
