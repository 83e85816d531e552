"""What the lowerings add to the node builder (:class:`onnxmp.training.nodes.Rewrite`): the element
types the lowered graph knows (low-precision math runs in float32)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxmp.errors import OnnxMPError
from onnxmp.naming import FreshNames
from onnxmp.precision import LOW
from onnxmp.training.nodes import Rewrite, node_input, node_output

LOW_TYPES = frozenset(p.onnx_type for p in LOW.values())
# Opset of ScatterElements/ScatterND with reduction="add", which the scatter lowerings need.
SCATTER_ADD_OPSET = 16


def int64_fill(value: int) -> onnx.TensorProto:
    """ConstantOfShape's ``value`` for an int64 fill."""
    return numpy_helper.from_array(np.full(1, value, np.int64))


class Emit(Rewrite):
    """Emits the standard nodes replacing ``node``.  ``types`` maps value names to element types
    (extended as nodes are emitted); ``retyped`` collects outputs whose type the lowering changed
    (name -> TypeProto); ``min_opset`` the ai.onnx opset the emitted nodes need."""

    def __init__(self, names: FreshNames, node: onnx.NodeProto, types: dict[str, int],
                 shapes: dict[str, onnx.TypeProto]):
        super().__init__(names, node)
        self.types, self.shapes = types, shapes
        self.retyped: dict[str, onnx.TypeProto] = {}

    def input(self, i: int) -> str:
        return node_input(self.node, i)

    def output(self, i: int) -> str:
        return node_output(self.node, i)

    def dtype(self, name: str) -> int:
        """The element type of ``name``; an error naming the node when the graph does not say."""
        elem = self.types.get(name, 0)
        if not elem:
            raise OnnxMPError(f"cannot lower {self.node.op_type} (node {self.scope!r}): the type of {name!r} is unknown",
                              "the training graph lost its value types; rebuild the artifacts")
        return elem

    def constant(self, array: np.ndarray, what: str = "const") -> str:
        out = super().constant(array, what)
        self.types[out] = helper.np_dtype_to_tensor_dtype(np.asarray(array).dtype)
        return out

    def scalar(self, value: float, elem: int = TensorProto.FLOAT) -> str:
        if elem == TensorProto.BFLOAT16:  # numpy has no bfloat16: the Cast rounds it
            return self.cast(self.scalar(value), elem)
        return self.constant(np.array(value, dtype=helper.tensor_dtype_to_np_dtype(elem)))

    def cast(self, name: str, elem: int, output: str | None = None) -> str:
        out = self.op("Cast", [name], output, to=elem)
        self.types[out] = elem
        return out

    def wide(self, name: str) -> str:
        """``name`` in float32: the lowerings do their arithmetic there, as ORT's CUDA kernels do
        for float16 and bfloat16 (and the CPU has no low-precision kernels for most ops)."""
        return self.cast(name, TensorProto.FLOAT) if self.dtype(name) in LOW_TYPES else name

    def result(self, value: str, elem: int, output: str) -> str:
        """Write ``value`` (float32 unless ``types`` says otherwise) to ``output`` in type ``elem``."""
        if self.types.get(value, TensorProto.FLOAT) != elem:
            return self.cast(value, elem, output)
        out = self.op("Identity", [value], output)
        self.types[out] = elem
        return out

    def zeros(self, shape: str, elem: int) -> str:
        """A tensor of zeros of ``elem`` with the shape held in ``shape`` (int64 1-D)."""
        if elem == TensorProto.BFLOAT16:
            return self.cast(self.zeros(shape, TensorProto.FLOAT), elem)
        value = numpy_helper.from_array(np.zeros(1, helper.tensor_dtype_to_np_dtype(elem)))
        out = self.op("ConstantOfShape", [shape], value=value)
        self.types[out] = elem
        return out

    def rank(self, name: str) -> str:
        """The rank of ``name`` as an int64 1-D tensor of one element."""
        return self.op("Shape", [self.op("Shape", [name])])

    def sum(self, x: str, axes: str, keepdims: int = 1) -> str:
        """ReduceSum over the axes in ``axes`` (1-D int64, possibly empty: nothing reduced)."""
        return self.op("ReduceSum", [x, axes], keepdims=keepdims, noop_with_empty_axes=1)
