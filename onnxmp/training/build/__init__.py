"""The training build: an fp32 ONNX model in, a folder of training artifacts out
(:mod:`~onnxmp.training.build.pipeline` runs the stages).  Needs onnxruntime-training 1.19.2;
nothing under :mod:`onnxmp.training.run` imports this package."""
from __future__ import annotations

from onnxmp.training.build.pipeline import PRECISIONS, STAGES, TrainingBuild, build_artifacts, check_trainable_size

__all__ = ["PRECISIONS", "STAGES", "TrainingBuild", "build_artifacts", "check_trainable_size"]
