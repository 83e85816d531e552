import sys
from pathlib import Path

# Tests import the model zoo as `models.zoo`, which lives at the repo root and
# is not part of the installed onnxmp package.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# onnxruntime-training 1.19.2 has wheels up to Python 3.11 only (pyproject's markers leave it out
# above). There, onnxmp's gradient builder builds the artifacts (builder="auto") and the portable engine
# trains them, so the training tests run; the files below need the training build throughout (the
# native engine, ORT's builder as the reference, MPI ranks from the train-cpu extra) and are left out.
NEEDS_TRAINING_BUILD = {
    "test_training_distributed.py",  # MPI ranks: mpi4py comes with train-cpu on Python <= 3.11
    "test_lowering.py", "test_lowering_matrix.py",  # the lowering of ORT's gradient ops, against ORT's kernels
    "test_training_engines.py",  # the native engine against the portable one
    "test_training_prepare.py",  # what ORT's gradient builder needs prepared, checked on its graphs
}
collect_ignore = ([f"training/{name}" for name in sorted(NEEDS_TRAINING_BUILD)]
                  if sys.version_info >= (3, 12) else [])
