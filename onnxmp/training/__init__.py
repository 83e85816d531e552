"""Mixed-precision training: artifacts built on onnxruntime-training (1.19.2, the last training
build), trained there or on plain onnxruntime.

``build_artifacts`` (:mod:`onnxmp.training.build`) turns an fp32 ONNX model into training
artifacts whose graph scales the loss, unscales the gradients and checks them for inf/NaN;
``Trainer`` runs them with a ``DynamicLossScaler`` that skips non-finite steps, on the native
engine or the portable one (:mod:`onnxmp.training.run.engines`).  Importing this package needs no
training build.  See ``docs/training.md``.
"""
from __future__ import annotations

from onnxmp.training.artifacts import Artifacts
from onnxmp.training.build import build_artifacts
from onnxmp.training.optimizer_settings import SGD, AdamW
from onnxmp.training.run.loss_scaler import DynamicLossScaler
from onnxmp.training.run.schedules import Schedule
from onnxmp.training.run.trainer import History, StepResult, Trainer

__all__ = ["SGD", "AdamW", "Artifacts", "DynamicLossScaler", "History", "Schedule", "StepResult", "Trainer",
           "build_artifacts"]
