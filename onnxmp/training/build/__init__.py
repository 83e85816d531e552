"""The training build: an fp32 ONNX model in, a folder of training artifacts out
(:mod:`~onnxmp.training.build.pipeline` runs the stages).  The gradient comes from onnxmp's own
builder (:mod:`~onnxmp.training.build.autodiff`, any Python, plain onnxruntime) or from
onnxruntime-training 1.19.2's (:mod:`~onnxmp.training.build.gradient`, Python <= 3.11);
nothing under :mod:`onnxmp.training.run` imports this package."""
from __future__ import annotations

from onnxmp.training.build.pipeline import (BUILDERS, PRECISIONS, STAGES, TrainingBuild, build_artifacts,
                                            check_trainable_size, resolve_builder)

__all__ = ["BUILDERS", "PRECISIONS", "STAGES", "TrainingBuild", "build_artifacts", "check_trainable_size",
           "resolve_builder"]
