import sys
from pathlib import Path

import pytest

# Tests import the model zoo as `models.zoo`, which lives at the repo root and
# is not part of the installed onnxmp package.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# onnxruntime-training 1.19.2 has wheels up to Python 3.11 only (pyproject's markers leave it out
# above). There, onnxmp's gradient builder builds the artifacts (builder="auto") and the portable engine
# trains them, so the training tests run; the files below need the training build throughout (the
# native engine, ORT's builder as the reference, MPI ranks from the train-cpu extra). Without it their
# tests are collected and skipped with the reason, so a run that names one says why nothing ran.
NEEDS_TRAINING_BUILD = {
    "test_training_distributed.py",  # MPI ranks: mpi4py comes with train-cpu on Python <= 3.11
    "test_lowering.py", "test_lowering_matrix.py",  # the lowering of ORT's gradient ops, against ORT's kernels
    "test_training_engines.py",  # the native engine against the portable one
    "test_training_prepare.py",  # what ORT's gradient builder needs prepared, checked on its graphs
}


def pytest_collection_modifyitems(config, items):
    from onnxmp.training import _ort

    if _ort.available():
        return
    skip = pytest.mark.skip(reason="needs onnxruntime-training 1.19.2, which has wheels for Python <= 3.11 "
                                   "only: pip install -e \".[train-cpu]\" there")
    for item in items:
        if item.path.name in NEEDS_TRAINING_BUILD and item.path.parent.name == "training":
            item.add_marker(skip)
