"""Learning-rate schedules with Hugging Face's semantics (``transformers/optimization.py``).

``Schedule(name, warmup_steps, total_steps).lr_at(step, base_lr)`` is the learning rate of the
update number ``step`` (0 for the first), exactly what the optimizer uses under
``get_constant_schedule`` / ``get_constant_schedule_with_warmup`` (``constant``),
``get_linear_schedule_with_warmup`` (``linear``) and ``get_cosine_schedule_with_warmup``
(``cosine``, ``num_cycles`` 0.5) when the ``LambdaLR`` is stepped after every optimizer step:

- warmup: ``step / max(1, warmup_steps)`` for ``step < warmup_steps`` (so the first update of a
  warmup uses lr 0, as in Hugging Face);
- ``linear``: then ``max(0, (total_steps - step) / max(1, total_steps - warmup_steps))``;
- ``cosine``: then ``max(0, 0.5 * (1 + cos(pi * num_cycles * 2 * progress)))``, ``progress =
  (step - warmup_steps) / max(1, total_steps - warmup_steps)``; past ``total_steps`` it rises
  again, as Hugging Face's does;
- ``constant``: 1 after the warmup.

``step`` counts applied updates (the effective steps, after gradient accumulation): an update
the loss scaler skips does not advance the schedule, as the Hugging Face Trainer does not step its
scheduler when the GradScaler skipped the optimizer.  Pure functions, no state but the settings
(:meth:`Schedule.to_dict` / :meth:`Schedule.from_dict` save them with a trainer's state).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from onnxmp.errors import OnnxMPError

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Schedule:
    name: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None  # needed by linear and cosine: the number of updates of the run
    num_cycles: float = 0.5  # cosine only: Hugging Face's default, a half cosine from 1 down to 0

    def __post_init__(self):
        if self.name not in SCHEDULES:
            raise OnnxMPError(f"unknown schedule {self.name!r}", f"use one of: {', '.join(SCHEDULES)}")
        if isinstance(self.warmup_steps, bool) or int(self.warmup_steps) != self.warmup_steps \
                or self.warmup_steps < 0:
            raise OnnxMPError(f"warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
        object.__setattr__(self, "warmup_steps", int(self.warmup_steps))
        if self.name != "constant":
            if self.total_steps is None:
                raise OnnxMPError(f"the {self.name} schedule needs total_steps (the number of updates)",
                                  "onnxmp train computes it from --epochs, the batches and --grad-accum-steps")
            if isinstance(self.total_steps, bool) or int(self.total_steps) != self.total_steps \
                    or self.total_steps < 1:
                raise OnnxMPError(f"total_steps must be a positive integer, got {self.total_steps!r}")
        if self.total_steps is not None:
            object.__setattr__(self, "total_steps", int(self.total_steps))
        if not (isinstance(self.num_cycles, (int, float)) and math.isfinite(self.num_cycles)):
            raise OnnxMPError(f"num_cycles must be a finite number, got {self.num_cycles!r}")

    def multiplier(self, step: int) -> float:
        """The factor of the base learning rate for update number ``step`` (0 for the first)."""
        if step < 0:
            raise OnnxMPError(f"a schedule's step counts updates from 0, got {step}")
        if step < self.warmup_steps:
            return float(step) / float(max(1, self.warmup_steps))
        if self.name == "constant":
            return 1.0
        span = float(max(1, self.total_steps - self.warmup_steps))
        if self.name == "linear":
            return max(0.0, float(self.total_steps - step) / span)
        progress = float(step - self.warmup_steps) / span
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(self.num_cycles) * 2.0 * progress)))

    def lr_at(self, step: int, base_lr: float) -> float:
        """The learning rate of update number ``step``."""
        return base_lr * self.multiplier(step)

    @classmethod
    def of(cls, schedule: "Schedule | str | None", warmup_steps: int = 0, total_steps: int | None = None,
           function=None) -> "Schedule | None":
        """The Trainer's ``schedule`` argument: a Schedule, one of its names, or None; ``function``
        (an ``lr_schedule``) may not be given with it."""
        if isinstance(schedule, str):
            schedule = cls(schedule, warmup_steps, total_steps)
        elif schedule is not None and not isinstance(schedule, Schedule):
            raise OnnxMPError(f"schedule must be a Schedule or one of its names, got {type(schedule).__name__}",
                              "pass schedule='linear' with warmup_steps and total_steps, or a Schedule")
        if schedule is not None and function is not None:
            raise OnnxMPError("schedule and lr_schedule both set the learning rate", "pass one of them")
        return schedule

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # A schedule's state is its settings (the update count it is called with is the trainer's), as
    # torch's LambdaLR saves none of its function.
    def state_dict(self) -> dict[str, Any]:
        return self.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in asdict(Schedule.from_dict(state)).items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> "Schedule":
        try:
            return cls(**state)
        except TypeError as exc:
            raise OnnxMPError(f"not a schedule's settings: {exc}", "was it saved by onnxmp?") from None
