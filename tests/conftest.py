import sys
from pathlib import Path

# Tests import the model zoo as `models.zoo`, which lives at the repo root and
# is not part of the installed onnxmp package.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# onnxruntime-training 1.19.2 has wheels up to Python 3.11 only (pyproject's markers leave it
# out above): there the tests that build artifacts cannot run; tests/test_packaging.py covers
# the message.  The portable engine's tests need only plain onnxruntime and run everywhere.
PORTABLE_TESTS = {"test_training_portable.py", "test_training_portable_committed.py"}
collect_ignore = ([f"training/{p.name}" for p in (Path(__file__).parent / "training").glob("test_*.py")
                   if p.name not in PORTABLE_TESTS] if sys.version_info >= (3, 12) else [])
