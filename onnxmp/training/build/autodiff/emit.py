"""What the gradient rules add to the node builder (:class:`onnxmp.training.nodes.Nodes`): typed,
deduplicated initializers and the element type of every value they emit.

Constants become initializers, deduplicated by value (a graph's hundred ``axes = [-1]`` are one
tensor).  Every emitted value's element type is recorded, so that a rule can ask for the type of
what it built; low-precision constants (float16, bfloat16) are written in that type, since the
rules compute in the type of the forward tensor they differentiate (the AMP coloring's choice).

On a target that runs low precision for real (CUDA), an op emitted in a float16/bfloat16 type the
target's kernel table has no kernel for (CUDA's bfloat16 ``Greater``, ``Pad``) runs in float32
between Casts instead, decided here for every rule: a comparison reads its operands cast up, data
movement casts in and out (exact: every float16/bfloat16 value is a float32).  On an emulated
target (the CPU) low precision computes in float32 anyway, so nothing is cast.
"""
from __future__ import annotations

import numpy as np
from collections import Counter

from onnx import TensorProto, helper, numpy_helper

from onnxmp import targets
from onnxmp.kernels import KernelTable
from onnxmp.naming import FreshNames
from onnxmp.training.build.graph_check import FLOAT_NAMES, float_params
from onnxmp.training.nodes import Nodes

MS_DOMAIN = "com.microsoft"
INT64_MAX = np.iinfo(np.int64).max
# Ops whose output takes its type from a later input than the first (Where's condition is bool).
_VALUE_INPUT = {"Where": 1}
_LOW = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})


class Emitter(Nodes):
    """Appends nodes to ``nodes`` and constants to ``initializers``; ``types`` maps every value
    name it knows to its element type.  ``scope`` prefixes the names of what it emits.

    ``target`` names the execution provider the graph is built for and ``opset`` the model's
    ai.onnx opset: where the target is not emulated, its kernel table decides which low-precision
    ops run in float32 instead (``float32_ops`` counts them by op type)."""

    def __init__(self, names: FreshNames, types: dict[str, int], *, target: str = "cpu", opset: int = 1):
        super().__init__(names, "grad", [], [])
        self.types = types
        self.domains: set[str] = set()
        self._constants: dict[tuple, str] = {}
        self.target, self.opset = target, opset
        self.kernels = None if targets.target(target).emulated else KernelTable.default()
        self.float32_ops: Counter = Counter()
        self._takes: dict[tuple, bool | None] = {}
        # GatherElements' gradient, a scatter-add into zeros: its name -> (indices, values, axis,
        # the indices' shape), for a rule that folds it into its own (LogSoftmax's).
        self.scatters: dict[str, tuple] = {}
        # MaxPool's gradient: its name -> (dY, the pooled output, its scatter as a function of dY),
        # for the ReLU before it to mask the pooled dY instead (elementwise.relu).
        self.pooled: dict[str, tuple] = {}

    def ops(self, op_type: str, inputs: list[str], outputs: list[str], *, elem: int | None = None,
            domain: str = "", **attrs) -> list[str]:
        """A node; "" in ``outputs`` is a fresh name.  Its outputs get type ``elem``, by default
        the type of its first typed input (what every elementwise op and every rule here keeps)."""
        attrs = {k: v for k, v in attrs.items() if v is not None}
        if domain:
            self.domains.add(domain)
            attrs["domain"] = domain
        if elem is None:
            typed = inputs[_VALUE_INPUT.get(op_type, 0):]
            elem = next((self.types[x] for x in typed if x and self.types.get(x)), 0)
        if not domain and self._float32_instead(op_type, inputs, len(outputs), elem, attrs):
            return self._in_float32(op_type, inputs, outputs, elem, attrs)
        outs = super().ops(op_type, inputs, outputs, **attrs)
        for o in outs:
            self.types[o] = elem
        return outs

    def _float32_instead(self, op_type: str, inputs: list[str], n_out: int, elem: int, attrs: dict) -> bool:
        """Whether the target has no kernel for this standard op in its low-precision types but
        one in float32 (no kernel at all, in any type, is left for the build's checks to name)."""
        if self.kernels is None or op_type == "Cast":
            return False
        ins = [self.types.get(x, 0) if x else 0 for x in inputs]
        if not any(t in _LOW for t in ins) and elem not in _LOW:
            return False
        up = [TensorProto.FLOAT if t in _LOW else t for t in ins]
        out32 = TensorProto.FLOAT if elem in _LOW else elem
        return (self._kernel_takes(op_type, ins, [elem] * n_out, attrs) is False
                and self._kernel_takes(op_type, up, [out32] * n_out, attrs) is True)

    def _kernel_takes(self, op_type: str, ins: list[int], outs: list[int], attrs: dict) -> bool | None:
        opset = max(self.opset, self.min_opset)
        key = (op_type, opset, tuple(ins), tuple(outs))
        if key not in self._takes:
            names_in, names_out = [f"i{i}" if t else "" for i, t in enumerate(ins)], [f"o{i}" for i in range(len(outs))]
            node = helper.make_node(op_type, names_in, names_out)
            types = {**dict(zip(names_in, ins)), **dict(zip(names_out, outs))}
            params = float_params(node, "ai.onnx", opset, {n: FLOAT_NAMES.get(t) for n, t in types.items() if n})
            self._takes[key] = self.kernels.accepts(self.target, "ai.onnx", op_type, opset, params)
        return self._takes[key]

    def _in_float32(self, op_type: str, inputs: list[str], outputs: list[str], elem: int, attrs: dict) -> list[str]:
        """The op on float32 casts of its low-precision inputs; its low-precision outputs cast back."""
        self.float32_ops[op_type] += 1
        ins = [self.cast(x, TensorProto.FLOAT) if x and self.types.get(x) in _LOW else x for x in inputs]
        if elem not in _LOW:  # a comparison's bool, say: the outputs are what was asked for
            return self.ops(op_type, ins, outputs, elem=elem, **attrs)
        wide = self.ops(op_type, ins, [""] * len(outputs), elem=TensorProto.FLOAT, **attrs)
        return [self.op("Cast", [w], o or None, to=elem, elem=elem) for w, o in zip(wide, outputs)]

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
