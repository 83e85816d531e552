import sys
from pathlib import Path

# Tests import the model zoo as `models.zoo`, which lives at the repo root and
# is not part of the installed onnxmp package.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
