"""What a training run reports: per-step results, the history of a fit, and eval metrics."""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from onnxmp.errors import OnnxMPError
from onnxmp.training.contract import IGNORE_INDEX

Metric = Callable[[np.ndarray, np.ndarray], float]




def accuracy(labels: np.ndarray, predictions: np.ndarray, *, ignore_index: int | None = IGNORE_INDEX) -> float:
    """Share of the labelled positions whose arg-max over the last axis equals the integer label.

    Positions labelled ``ignore_index`` (-100, as the losses ignore them) do not count; NaN
    when a batch has none."""
    labels = np.asarray(labels)
    hits = np.argmax(predictions, axis=-1) == labels
    if ignore_index is not None:
        keep = labels != ignore_index
        return float(np.mean(hits[keep])) if keep.any() else float("nan")
    return float(np.mean(hits))


def token_accuracy(labels: np.ndarray, predictions: np.ndarray, *, ignore_index: int | None = IGNORE_INDEX) -> float:
    """The causal-LM accuracy: logits at position ``t`` predict the label at ``t + 1``, as the
    ``causal_lm`` loss shifts them; ``ignore_index`` positions do not count."""
    return accuracy(np.asarray(labels)[:, 1:], np.asarray(predictions)[:, :-1], ignore_index=ignore_index)


def binary_accuracy(labels: np.ndarray, predictions: np.ndarray) -> float:
    """For logits: share where ``logit > 0`` matches ``label > 0.5``."""
    return float(np.mean((predictions > 0) == (labels > 0.5)))


METRICS: dict[str, Metric] = {"accuracy": accuracy, "token_accuracy": token_accuracy,
                              "binary_accuracy": binary_accuracy}
_MASKED = ("accuracy", "token_accuracy")  # the ones that take the loss's ignore_index


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

    def record_batch(self, losses: Sequence[float], loss_scale: float, skipped: bool, full: bool) -> None:
        """The micro-batches of one effective batch, in the global order: a skip is marked on the one
        that ends a ``full`` effective batch (a short last one, decided by ``flush()``, records none)."""
        for i, loss in enumerate(losses):
            self.step_loss.append(loss)
            self.step_loss_scale.append(loss_scale)
            self.step_skipped.append(skipped and full and i == len(losses) - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RunningMean:
    """The running mean of the finite losses, added in the order they came."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    def add(self, losses: Sequence[float]) -> None:
        for loss in losses:
            if math.isfinite(loss):
                self.total, self.count = self.total + loss, self.count + 1

    @property
    def value(self) -> float:
        return self.total / self.count if self.count else math.nan


def weighted_means(rows: Sequence[Sequence[float]], names: Sequence[str]) -> dict[str, float]:
    """Per name, the sum of its column over the sum of the last (the rows each batch counts)."""
    totals = dict.fromkeys(names, 0.0)
    count = 0
    for row in rows:
        for name, value in zip(names, row):
            totals[name] += value
        count += row[-1]
    if not count:
        raise OnnxMPError("evaluate() got no batches")
    return {name: value / count for name, value in totals.items()}


def metric_functions(metrics: Sequence[str | tuple[str, Metric]], *,
                     ignore_index: int | None = IGNORE_INDEX) -> list[tuple[str, Metric]]:
    """``(name, fn)`` pairs; the named class-id metrics skip ``ignore_index`` (the loss's)."""
    result = []
    for metric in metrics:
        if isinstance(metric, str):
            if metric not in METRICS:
                raise OnnxMPError(f"unknown metric {metric!r}", f"use one of {', '.join(METRICS)} "
                                                                "or a (name, function) pair")
            fn = METRICS[metric]
            if metric in _MASKED:
                fn = functools.partial(fn, ignore_index=ignore_index)
            result.append((metric, fn))
        else:
            result.append(tuple(metric))
    return result
