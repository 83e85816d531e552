"""onnxmp: automatic mixed precision for ONNX models.

The conversion pipeline is ``load -> normalize -> color -> rewrite -> verify ->
save``; each stage is a module of this package.  The public entry points are
re-exported here.
"""
from __future__ import annotations

__version__ = "0.1.0"

from onnxmp.errors import OnnxMPError  # noqa: E402

__all__ = ["OnnxMPError", "__version__"]
