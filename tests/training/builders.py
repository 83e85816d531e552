"""Which gradient builders the tests run here: onnxmp's everywhere, ORT's where onnxruntime-training
imports (Python <= 3.11 with the training build: the reference the other is held to)."""
from __future__ import annotations

import pytest


def training_build() -> bool:
    from onnxmp.errors import OnnxMPError
    from onnxmp.training import _ort

    try:
        _ort.onnxblock()
    except (OnnxMPError, ImportError):
        return False
    return True


HERE = (*(("ort",) if training_build() else ()), "onnxmp")
needs_training_build = pytest.mark.skipif(not training_build(), reason="needs onnxruntime-training (Python <= 3.11)")
