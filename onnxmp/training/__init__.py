"""Mixed-precision training on plain onnxruntime: artifacts built by onnxmp's gradient builder (any
Python) or onnxruntime-training's (1.19.2, the last training build, the reference), trained on
either engine.

``build_artifacts`` (:mod:`onnxmp.training.build`) turns an fp32 ONNX model into training
artifacts whose graph scales the loss, unscales the gradients and checks them for inf/NaN;
``Trainer`` runs them with a ``DynamicLossScaler`` that skips non-finite steps, on the native
engine or the portable one (:mod:`onnxmp.training.engines`).  Importing this package needs no
training build.  See ``docs/training.md``.
"""
from __future__ import annotations

from onnxmp.training.artifacts import Artifacts
from onnxmp.training.build import build_artifacts
from onnxmp.training.optim import SGD, AdamW
from onnxmp.training.scaler import DynamicLossScaler
from onnxmp.training.schedules import Schedule
from onnxmp.training.trainer import History, StepResult, Trainer

__all__ = ["SGD", "AdamW", "Artifacts", "DynamicLossScaler", "History", "Schedule", "StepResult", "Trainer",
           "build_artifacts"]
