"""What the gradient rules know about the forward graph at build time: element types, symbolic
shapes (onnx's shape inference with data propagation) and constant values.

A dim is an ``int`` (known), a ``str`` (a symbol: two equal symbols are equal at run time) or
``None`` (unknown).  A shape is a tuple of dims, or ``None`` when even the rank is unknown.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxmp.external import constant_node_values
from onnxmp.domains import is_onnx_domain, onnx_opset
from onnxmp.training.build.autodiff.fold import fold_constants, initial_values, small
from onnxmp.training.build.autodiff.symbolic import shape_hints

log = logging.getLogger("onnxmp.training.build.autodiff")

Dim = int | str | None
Shape = tuple[Dim, ...] | None

# Small initializers stay in the skeleton that onnx's inference reads (shapes, axes, pads and
# scales feed data propagation); weights become inputs (a model over 2 GB still infers).
_SMALL = 64
_PASSES = 10
_INT_OUT = {"Shape": TensorProto.INT64, "Size": TensorProto.INT64, "NonZero": TensorProto.INT64,
            "ArgMax": TensorProto.INT64, "ArgMin": TensorProto.INT64}
_BOOL_OUT = frozenset({"Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Not", "And", "Or", "Xor",
                       "IsInf", "IsNaN"})


class GraphInfo:
    def __init__(self, model: onnx.ModelProto):
        graph = model.graph
        self.opset = onnx_opset(model) or 1
        self.initializers = {t.name: t for t in graph.initializer}
        self.constant_nodes = {n.output[0]: n for n in graph.node
                               if n.op_type == "Constant" and is_onnx_domain(n.domain)}
        self.types: dict[str, int] = {}
        self.shapes: dict[str, Shape] = {}
        self._values: dict[str, np.ndarray | None] = {}
        # onnx's inference, then again with the shapes of Reshape/Expand/... outputs that the
        # symbolic values of their shape inputs give (symbolic.py), while that names more dims.
        # Constant-only subgraphs are folded (fold.py) between passes: their values stand as
        # Constants in what the next inference reads.
        hints: dict[str, tuple] = {}
        known: dict[str, int] = {}
        self.folded: dict[str, np.ndarray] = {}
        initial = initial_values(graph)
        for name in self.constant_nodes:
            array = self._read(name)
            if array is not None and small(array):
                initial[name] = array
        for _ in range(_PASSES):
            self.types, self.shapes, self._values = {}, {}, {}  # values read before a fold are stale
            self._load(_infer(model, hints, known, self.folded), graph)
            for name, array in self.folded.items():
                self.shapes[name] = tuple(int(d) for d in array.shape)
            values = fold_constants(graph, model.opset_import, self.shapes, {**initial, **self.folded})
            new = {k: a for k, a in values.items() if k not in initial and k not in self.folded
                   and k not in self.constant_nodes}
            self.symbolic = {}  # the symbolic values of small integer tensors (symbolic.py)
            better = {k: h for k, h in shape_hints(model, self.shapes, self.symbolic).items()
                      if self.types.get(k) and h != self.shapes.get(k) and hints.get(k) != h
                      and (None not in h or _named(h) > _named(self.shapes.get(k)))}
            if not better and not new:
                break
            hints.update(better)
            self.folded.update(new)
            known = dict(self.types)
        self._values = {}

    def _load(self, inferred: onnx.ModelProto, graph: onnx.GraphProto) -> None:
        for value in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output,
                      *graph.input, *graph.output, *graph.value_info):
            if not value.type.HasField("tensor_type"):
                continue
            tensor = value.type.tensor_type
            if tensor.elem_type and not self.types.get(value.name):
                self.types[value.name] = tensor.elem_type
            if tensor.HasField("shape") and self.shapes.get(value.name) is None:
                self.shapes[value.name] = tuple(_dim(d) for d in tensor.shape.dim)
        for t in graph.initializer:
            self.types[t.name] = t.data_type
            self.shapes[t.name] = tuple(int(d) for d in t.dims)
        self._propagate(graph)
        self._fill_shapes(graph)

    def _fill_shapes(self, graph: onnx.GraphProto) -> None:
        """Shapes onnx's inference left out (an op whose inference it skipped): ops whose output is
        shaped like their first input, and numpy broadcasting."""
        for node in graph.node:
            out = node.output[0] if node.output else ""
            if not out or self.shapes.get(out) is not None:
                continue
            if node.op_type in _SAME_SHAPE:
                self.shapes[out] = self.shapes.get(node.input[0])
            elif node.op_type == "Tile" and self.shapes.get(node.input[0]) is not None:
                # Tile keeps its input's rank, whatever the repeats
                repeats = self.ints(node.input[1])
                shape = self.shapes[node.input[0]]
                self.shapes[out] = tuple(d * r if isinstance(d, int) and repeats and len(repeats) == len(shape)
                                         else None for d, r in zip(shape, repeats or [None] * len(shape)))
            elif node.op_type in _BROADCAST:
                shapes = [self.shapes.get(x) for x in node.input if x]
                if node.op_type == "Where":
                    shapes = shapes[1:] + shapes[:1]
                if shapes and all(s is not None for s in shapes):
                    self.shapes[out] = broadcast_shapes(shapes)
            elif node.op_type.startswith("Reduce") and self.shapes.get(node.input[0]) is not None:
                shape = self.shapes[node.input[0]]
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                axes = attrs.get("axes") or (self.ints(node.input[1]) if len(node.input) > 1 else None)
                if axes is None and len(node.input) > 1 and node.input[1]:
                    continue  # computed axes
                if not axes and attrs.get("noop_with_empty_axes", 0):
                    self.shapes[out] = shape
                    continue
                axes = {a % len(shape) for a in axes} if axes else set(range(len(shape)))
                keep = attrs.get("keepdims", 1)
                self.shapes[out] = tuple(1 if i in axes else d for i, d in enumerate(shape) if keep or i not in axes)

    def _propagate(self, graph: onnx.GraphProto) -> None:
        """Element types onnx's inference left out (after an op it has no schema for)."""
        for node in graph.node:
            for i, out in enumerate(node.output):
                if not out or self.types.get(out):
                    continue
                if node.op_type == "Cast":
                    elem = next((a.i for a in node.attribute if a.name == "to"), 0)
                elif node.op_type in _INT_OUT:
                    elem = _INT_OUT[node.op_type]
                elif node.op_type in _BOOL_OUT and i == 0:
                    elem = TensorProto.BOOL
                else:
                    elem = next((self.types[x] for x in node.input if x and self.types.get(x)), 0)
                if elem:
                    self.types[out] = elem

    def shape(self, name: str) -> Shape:
        return self.shapes.get(name)

    def rank(self, name: str) -> int | None:
        shape = self.shapes.get(name)
        return None if shape is None else len(shape)

    def static_shape(self, name: str) -> list[int] | None:
        shape = self.shapes.get(name)
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return list(shape)

    def value(self, name: str) -> np.ndarray | None:
        """The value of ``name`` when an initializer or a Constant node holds it."""
        if not name:
            return None
        if name not in self._values:
            self._values[name] = self._read(name)
        return self._values[name]

    def _read(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.constant_nodes.get(name)
        if node is None:
            # folded values of integer and boolean type only: a float one may come from a trainable
            # parameter, which a rule must not take as a constant
            array = self.folded.get(name)
            return array if array is not None and array.dtype.kind in "iub" else None
        return constant_node_values(node)

    def ints(self, name: str) -> list[int] | None:
        value = self.value(name)
        return None if value is None else [int(v) for v in np.asarray(value).ravel()]


_SAME_SHAPE = frozenset({
    "BatchNormalization", "InstanceNormalization", "GroupNormalization", "LayerNormalization", "Softmax",
    "LogSoftmax", "Dropout", "Cast", "Identity", "Relu", "Sigmoid", "Tanh", "Erf", "Exp", "Log", "Sqrt", "Neg",
    "Abs", "Reciprocal", "Gelu", "FastGelu", "QuickGelu", "BiasGelu", "Clip", "LeakyRelu", "Elu", "Softplus",
    "CumSum", "HardSigmoid", "HardSwish", "Mish", "Selu", "Celu", "Sign", "Floor", "Ceil", "Round", "Not",
})
_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Sum", "Max", "Min", "Mean", "And", "Or",
                        "Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "PRelu"})


def broadcast_shapes(shapes: list[tuple]) -> tuple:
    """numpy broadcasting of symbolic shapes (None where two different symbols meet)."""
    rank = max(len(s) for s in shapes)
    result = []
    for i in range(rank):
        dims = {s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0} - {1}
        result.append(dims.pop() if len(dims) == 1 else (1 if not dims else None))
    return tuple(result)


def _dim(d) -> Dim:
    if d.HasField("dim_value"):
        return int(d.dim_value)
    if d.HasField("dim_param") and d.dim_param:
        return d.dim_param
    return None


def _standins(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``node``, or standard nodes producing outputs of its shapes and types for onnx's inference:
    com.microsoft ops (onnx has no schema for them, and would leave everything after them
    unshaped), and ``Reshape(x, Shape(x))`` (an identity onnx cannot see through)."""
    if node.op_type == "Reshape" and not node.domain and len(node.input) > 1:
        source = producers.get(node.input[1])
        if (source is not None and source.op_type == "Shape" and source.input[0] == node.input[0]
                and not source.attribute):
            return [helper.make_node("Identity", [node.input[0]], [node.output[0]])]
    if node.domain != "com.microsoft":
        return [node]
    ins, out = list(node.input), node.output[0]
    if node.op_type in ("Gelu", "QuickGelu", "FastGelu", "BiasGelu"):
        bias = ins[1] if len(ins) > 1 and ins[1] else ""
        if bias:
            return [helper.make_node("Add", [ins[0], bias], [out])]
        return [helper.make_node("Identity", [ins[0]], [out])]
    if node.op_type == "FusedMatMul":
        attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
        nodes, operands = [], []
        for x, flag in zip(ins[:2], ("transA", "transB")):
            if attrs.get(flag):
                nodes.append(helper.make_node("Einsum", [x], [f"{out}/standin/{flag}"], equation="...ij->...ji"))
                x = f"{out}/standin/{flag}"
            operands.append(x)
        return nodes + [helper.make_node("MatMul", operands, [out])]
    return [node]


def _named(shape) -> int:
    """How many dims of ``shape`` are known: values, or symbols other than onnx's ``unk__``."""
    if shape is None:
        return -1
    return sum(isinstance(d, int) or (isinstance(d, str) and not d.startswith("unk__")) for d in shape)


def _infer(model: onnx.ModelProto, hints: dict[str, tuple], types: dict[str, int],
           folded: dict[str, np.ndarray]) -> onnx.ModelProto:
    skeleton = onnx.ModelProto(ir_version=model.ir_version)
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    graph = skeleton.graph
    producers = {o: n for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        outs = [o for o in node.output if o]
        if outs and all(o in folded for o in outs):
            graph.node.extend(helper.make_node("Constant", [], [o], value=numpy_helper.from_array(folded[o], o))
                              for o in outs)
        else:
            graph.node.extend(_standins(node, producers))
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    # the model's own value_info (onnx's unk__ dims, which an earlier inference wrote, cleared: kept,
    # they would pin dims this inference can name), and the hinted shapes instead of what it says
    for v in model.graph.value_info:
        if v.name not in hints:
            graph.value_info.append(v)
            if v.type.HasField("tensor_type"):
                for dim in v.type.tensor_type.shape.dim:
                    if dim.HasField("dim_param") and dim.dim_param.startswith("unk__"):
                        dim.Clear()
    for name, dims in hints.items():
        if types.get(name):
            value = helper.make_tensor_value_info(name, types[name], [d if d is not None else "" for d in dims])
            for dim in value.type.tensor_type.shape.dim:
                if dim.HasField("dim_param") and not dim.dim_param:
                    dim.Clear()
            graph.value_info.append(value)
    declared = {v.name for v in graph.input}
    for t in model.graph.initializer:
        small = np.prod(t.dims, dtype=np.int64) <= _SMALL  # shapes, axes, pads, scales: read by inference
        if small:
            graph.initializer.append(t)
        elif t.name not in declared:
            graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, t.dims))
    try:
        return onnx.shape_inference.infer_shapes(skeleton, check_type=False, strict_mode=False, data_prop=True)
    except Exception as exc:  # onnx raises assorted types; the declared shapes remain
        log.warning("shape inference failed (%s); the gradient uses the declared shapes only", exc)
        return skeleton
