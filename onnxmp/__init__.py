"""onnxmp: automatic mixed precision for ONNX models.

The conversion pipeline is ``load -> normalize -> color -> rewrite -> verify ->
save``; each stage is a module of this package.  The public entry points are
re-exported here.
"""
from __future__ import annotations

__version__ = "0.1.0"

from onnxmp.errors import OnnxMPError  # noqa: E402
from onnxmp.convert import ConversionResult, convert, explain  # noqa: E402
from onnxmp.report import Report  # noqa: E402
from onnxmp.save import save  # noqa: E402
from onnxmp.load import load  # noqa: E402

__all__ = ["OnnxMPError", "ConversionResult", "Report", "convert", "explain", "load", "save", "__version__"]


def __getattr__(name):
    # emulate/validate pull in onnxruntime; import them only when asked for.
    if name == "emulate":
        from onnxmp.emulate import emulate

        return emulate
    if name == "validate":
        from onnxmp.validate import validate

        return validate
    raise AttributeError(f"module 'onnxmp' has no attribute {name!r}")
