"""onnxmp: automatic mixed precision for ONNX models.

The conversion pipeline is ``load -> normalize -> color -> rewrite -> verify ->
save``; each stage is a module of this package.  The public entry points are
re-exported here.
"""
from __future__ import annotations

__version__ = "0.1.0"

from onnxmp.errors import OnnxMPError  # noqa: E402
from onnxmp.options import Options  # noqa: E402
from onnxmp.convert import ConversionResult, convert, explain  # noqa: E402
from onnxmp.report import Report  # noqa: E402
from onnxmp.save import save  # noqa: E402
from onnxmp.load import load  # noqa: E402
from onnxmp.tensordata import trust_external_data  # noqa: E402
# onnxruntime itself is imported only when a model runs.
from onnxmp.parity.emulate import emulate  # noqa: E402
from onnxmp.parity.validate import validate  # noqa: E402

__all__ = ["OnnxMPError", "ConversionResult", "Options", "Report", "convert", "explain", "emulate", "validate",
           "load", "save", "trust_external_data", "__version__"]
