"""The node builder the gradient rules write with: fresh names, typed constants, one node list.

Constants become initializers, deduplicated by value (a graph's hundred ``axes = [-1]`` are one
tensor).  Every emitted value's element type is recorded, so that a rule can ask for the type of
what it built; low-precision constants (float16, bfloat16) are written in that type, since the
rules compute in the type of the forward tensor they differentiate (the AMP coloring's choice).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxmp.naming import FreshNames

MS_DOMAIN = "com.microsoft"
FLOATS = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})
INT64_MAX = np.iinfo(np.int64).max
# Ops whose output takes its type from a later input than the first (Where's condition is bool).
_VALUE_INPUT = {"Where": 1}


class Emitter:
    """Appends nodes to ``nodes`` and constants to ``initializers``; ``types`` maps every value
    name it knows to its element type.  ``scope`` prefixes the names of what it emits."""

    def __init__(self, names: FreshNames, types: dict[str, int]):
        self.names = names
        self.types = types
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.scope = "grad"
        self.min_opset = 0
        self.domains: set[str] = set()
        self._constants: dict[tuple, str] = {}

    def op(self, op_type: str, inputs: list[str], output: str | None = None, *, elem: int | None = None,
           domain: str = "", **attrs) -> str:
        return self.ops(op_type, inputs, [output or ""], elem=elem, domain=domain, **attrs)[0]

    def ops(self, op_type: str, inputs: list[str], outputs: list[str], *, elem: int | None = None,
            domain: str = "", **attrs) -> list[str]:
        """A node; "" in ``outputs`` is a fresh name.  Its outputs get type ``elem``, by default
        the type of its first typed input (what every elementwise op and every rule here keeps)."""
        outs = [o or self.names(f"{self.scope}/{op_type}_out") for o in outputs]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.names(f"{self.scope}/{op_type}"),
                                           domain=domain or None, **attrs))
        if domain:
            self.domains.add(domain)
        if elem is None:
            typed = inputs[_VALUE_INPUT.get(op_type, 0):]
            elem = next((self.types[x] for x in typed if x and self.types.get(x)), 0)
        for o in outs:
            self.types[o] = elem
        return outs

    def constant(self, array: np.ndarray, elem: int | None = None) -> str:
        """An initializer holding ``array`` (in ``elem`` when given: bfloat16 too)."""
        array = np.asarray(array)
        elem = elem or helper.np_dtype_to_tensor_dtype(array.dtype)
        key = (elem, array.shape, array.tobytes(), str(array.dtype))
        if key in self._constants:
            return self._constants[key]
        name = self.names(f"{self.scope}/const")
        if elem == TensorProto.BFLOAT16:
            tensor = helper.make_tensor(name, elem, array.shape, array.astype(np.float32).ravel().tolist())
        else:
            tensor = numpy_helper.from_array(array.astype(helper.tensor_dtype_to_np_dtype(elem)), name)
        self.initializers.append(tensor)
        self.types[name] = elem
        self._constants[key] = name
        return name

    def ints(self, values) -> str:
        """An int64 constant: a scalar for an int, 1-D for a list."""
        return self.constant(np.array(values, dtype=np.int64))

    def scalar(self, value: float, elem: int) -> str:
        return self.constant(np.array(value, dtype=np.float32 if elem == TensorProto.BFLOAT16 else
                                      helper.tensor_dtype_to_np_dtype(elem)), elem)

    def cast(self, name: str, elem: int) -> str:
        if self.types.get(name) == elem:
            return name
        return self.op("Cast", [name], to=elem, elem=elem)

    def zeros(self, shape, elem: int) -> str:
        """Zeros of ``elem`` shaped ``shape``: a list of ints (a constant shape) or the name of an
        int64 1-D tensor."""
        if not isinstance(shape, str):
            shape = self.ints(list(shape))
        fill = numpy_helper.from_array(np.zeros(1, np.float32 if elem == TensorProto.BFLOAT16 else
                                                helper.tensor_dtype_to_np_dtype(elem)))
        if elem == TensorProto.BFLOAT16:
            return self.cast(self.op("ConstantOfShape", [shape], value=fill, elem=TensorProto.FLOAT), elem)
        return self.op("ConstantOfShape", [shape], value=fill, elem=elem)

    def needs_opset(self, version: int) -> None:
        self.min_opset = max(self.min_opset, version)
