"""Which gradient builders the tests run here: onnxmp's everywhere, ORT's where onnxruntime-training
imports (Python <= 3.11 with the training build: the reference the other is held to)."""
from __future__ import annotations

import pytest


from onnxmp.training._ort import available as training_build


HERE = (*(("ort",) if training_build() else ()), "onnxmp")
needs_training_build = pytest.mark.skipif(not training_build(), reason="needs onnxruntime-training (Python <= 3.11)")
