"""The low-precision float types onnxmp converts to, described once.

Every stage that needs a type's ONNX enum, numpy dtype, range or name suffix
reads it from :data:`LOW` instead of keeping its own table.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx

from onnxmp.errors import OnnxMPError


@dataclass(frozen=True)
class Precision:
    name: str            # "float16": the API and CLI spelling
    onnx_type: int       # TensorProto enum
    numpy: np.dtype
    suffix: str          # added to the names of tensors and Casts onnxmp makes ("fp16")
    tag: str             # short tag for emulation names ("f16")

    @property
    def type_str(self) -> str:
        """The schema's spelling, as in type constraints: ``tensor(float16)``."""
        return f"tensor({self.name})"

    @property
    def max(self) -> float:
        """Largest finite value."""
        return float(ml_dtypes.finfo(self.numpy).max)


FLOAT16 = Precision("float16", onnx.TensorProto.FLOAT16, np.dtype(np.float16), "fp16", "f16")
BFLOAT16 = Precision("bfloat16", onnx.TensorProto.BFLOAT16, np.dtype(ml_dtypes.bfloat16), "bf16", "bf16")
FLOAT32 = Precision("float32", onnx.TensorProto.FLOAT, np.dtype(np.float32), "fp32", "f32")

LOW: dict[str, Precision] = {p.name: p for p in (FLOAT16, BFLOAT16)}
PRECISIONS = tuple(LOW)  # the choices of --precision / precision=
BY_ONNX_TYPE: dict[int, Precision] = {p.onnx_type: p for p in (FLOAT16, BFLOAT16, FLOAT32)}


def low_precision(name: str) -> Precision:
    """The descriptor of a low-precision type by name; a clear error for anything else."""
    try:
        return LOW[name]
    except KeyError:
        raise OnnxMPError(f"unknown precision {name!r}", hint=f"choose one of: {', '.join(PRECISIONS)}") from None
