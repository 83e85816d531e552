"""What the gradient rules add to the node builder (:class:`onnxmp.training.nodes.Nodes`): typed,
deduplicated initializers and the element type of every value they emit.

Constants become initializers, deduplicated by value (a graph's hundred ``axes = [-1]`` are one
tensor).  Every emitted value's element type is recorded, so that a rule can ask for the type of
what it built; low-precision constants (float16, bfloat16) are written in that type, since the
rules compute in the type of the forward tensor they differentiate (the AMP coloring's choice).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxmp.naming import FreshNames
from onnxmp.training.nodes import FLOATS, Nodes

MS_DOMAIN = "com.microsoft"
INT64_MAX = np.iinfo(np.int64).max
# Ops whose output takes its type from a later input than the first (Where's condition is bool).
_VALUE_INPUT = {"Where": 1}


class Emitter(Nodes):
    """Appends nodes to ``nodes`` and constants to ``initializers``; ``types`` maps every value
    name it knows to its element type.  ``scope`` prefixes the names of what it emits."""

    def __init__(self, names: FreshNames, types: dict[str, int]):
        super().__init__(names, "grad", [], [])
        self.types = types
        self.domains: set[str] = set()
        self._constants: dict[tuple, str] = {}

    def ops(self, op_type: str, inputs: list[str], outputs: list[str], *, elem: int | None = None,
            domain: str = "", **attrs) -> list[str]:
        """A node; "" in ``outputs`` is a fresh name.  Its outputs get type ``elem``, by default
        the type of its first typed input (what every elementwise op and every rule here keeps)."""
        attrs = {k: v for k, v in attrs.items() if v is not None}
        if domain:
            self.domains.add(domain)
            attrs["domain"] = domain
        outs = super().ops(op_type, inputs, outputs, **attrs)
        if elem is None:
            typed = inputs[_VALUE_INPUT.get(op_type, 0):]
            elem = next((self.types[x] for x in typed if x and self.types.get(x)), 0)
        for o in outs:
            self.types[o] = elem
        return outs

    def constant(self, array: np.ndarray, what: str = "const", *, elem: int | None = None) -> str:
        """An initializer holding ``array`` (in ``elem`` when given: bfloat16 too), one per value."""
        array = np.asarray(array)
        elem = elem or helper.np_dtype_to_tensor_dtype(array.dtype)
        key = (elem, array.shape, array.tobytes(), str(array.dtype))
        if key in self._constants:
            return self._constants[key]
        if elem == TensorProto.BFLOAT16:  # numpy has no bfloat16: make_tensor rounds the float32 values
            name = self.fresh(what)
            self.initializers.append(helper.make_tensor(name, elem, array.shape,
                                                        array.astype(np.float32).ravel().tolist()))
        else:
            name = super().constant(array.astype(helper.tensor_dtype_to_np_dtype(elem)), what)
        self.types[name] = elem
        self._constants[key] = name
        return name

    def scalar(self, value: float, elem: int) -> str:
        return self.constant(np.array(value, dtype=np.float32 if elem == TensorProto.BFLOAT16 else
                                      helper.tensor_dtype_to_np_dtype(elem)), elem=elem)

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
