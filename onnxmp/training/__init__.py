"""Mixed-precision training on plain onnxruntime: artifacts built by onnxmp's gradient builder (any
Python) or onnxruntime-training's (1.19.2, the last training build, the reference), trained on
either engine.

``build_artifacts`` (:mod:`onnxmp.training.build`) turns an fp32 ONNX model into training
artifacts whose graph scales the loss, unscales the gradients and checks them for inf/NaN;
``Trainer`` runs them with a ``DynamicLossScaler`` that skips non-finite steps, on the native
engine or the portable one (:mod:`onnxmp.training.run.engines`).  Importing this package needs no
training build.  See ``docs/training.md``.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Lazy, so that a run (onnxmp.training.run) loads no build stage: each name is imported from its
# home on first use.
_HOMES = {
    "Artifacts": "onnxmp.training.artifacts",
    "build_artifacts": "onnxmp.training.build",
    "SGD": "onnxmp.training.optimizer_settings",
    "AdamW": "onnxmp.training.optimizer_settings",
    "DynamicLossScaler": "onnxmp.training.run.loss_scaler",
    "Schedule": "onnxmp.training.run.schedules",
    "History": "onnxmp.training.run.metrics",
    "StepResult": "onnxmp.training.run.metrics",
    "Trainer": "onnxmp.training.run.trainer",
}

if TYPE_CHECKING:
    from onnxmp.training.artifacts import Artifacts
    from onnxmp.training.build import build_artifacts
    from onnxmp.training.optimizer_settings import SGD, AdamW
    from onnxmp.training.run.loss_scaler import DynamicLossScaler
    from onnxmp.training.run.metrics import History, StepResult
    from onnxmp.training.run.schedules import Schedule
    from onnxmp.training.run.trainer import Trainer


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'onnxmp.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


__all__ = ["SGD", "AdamW", "Artifacts", "DynamicLossScaler", "History", "Schedule", "StepResult", "Trainer",
           "build_artifacts"]
