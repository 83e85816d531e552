"""What a training run reports: per-step results, the history of a fit, and eval metrics."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from onnxmp.errors import OnnxMPError

Metric = Callable[[np.ndarray, np.ndarray], float]


def accuracy(labels: np.ndarray, predictions: np.ndarray) -> float:
    """Share of rows whose arg-max over the last axis equals the integer label."""
    return float(np.mean(np.argmax(predictions, axis=-1) == labels))


def binary_accuracy(labels: np.ndarray, predictions: np.ndarray) -> float:
    """For logits: share where ``logit > 0`` matches ``label > 0.5``."""
    return float(np.mean((predictions > 0) == (labels > 0.5)))


METRICS: dict[str, Metric] = {"accuracy": accuracy, "binary_accuracy": binary_accuracy}


@dataclass(frozen=True)
class StepResult:
    """Outcome of one micro-batch.

    ``loss`` is unscaled; ``all_finite`` is this micro-batch's check;
    ``stepped`` says the optimizer applied an update on this call and
    ``skipped`` that an effective batch ended here without one.
    ``loss_scale`` is the scale this micro-batch ran with.
    """

    loss: float
    all_finite: bool
    stepped: bool
    loss_scale: float
    skipped: bool = False


@dataclass
class History:
    """Per-micro-step curves and per-epoch summaries of :meth:`Trainer.fit`."""

    step_loss: list[float] = field(default_factory=list)
    step_loss_scale: list[float] = field(default_factory=list)
    step_skipped: list[bool] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def metric_functions(metrics: Sequence[str | tuple[str, Metric]]) -> list[tuple[str, Metric]]:
    result = []
    for metric in metrics:
        if isinstance(metric, str):
            if metric not in METRICS:
                raise OnnxMPError(f"unknown metric {metric!r}", f"use one of {', '.join(METRICS)} "
                                                                "or a (name, function) pair")
            result.append((metric, METRICS[metric]))
        else:
            result.append(tuple(metric))
    return result
