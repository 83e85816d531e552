"""Mixed-precision training on onnxruntime-training (1.19.2, the last training build).

``build_artifacts`` (:mod:`onnxmp.training.build`) turns an fp32 ONNX model into training
artifacts whose graph scales the loss, unscales the gradients and checks them for inf/NaN;
``Trainer`` runs them with a ``DynamicLossScaler`` that skips non-finite steps.  See
``docs/training.md``.
"""
from __future__ import annotations

from onnxmp.training.artifacts import Artifacts
from onnxmp.training.build import build_artifacts
from onnxmp.training.optim import SGD, AdamW
from onnxmp.training.scaler import DynamicLossScaler
from onnxmp.training.trainer import History, StepResult, Trainer

__all__ = ["SGD", "AdamW", "Artifacts", "DynamicLossScaler", "History", "StepResult", "Trainer", "build_artifacts"]
