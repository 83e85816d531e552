"""The one node builder of the training graphs: fresh names under a scope, nodes appended to a list,
constants as Constant nodes or initializers.

Every stage that writes nodes writes them with :class:`Nodes`:

* the rewrites of one node (:class:`Rewrite`: ``prepare``'s rewrites, and the lowerings, whose
  ``Emit`` adds the element types it tracks), in the list style ``b.op("Mul", [x, y], out)``;
* the gradient rules (``autodiff``'s ``Emitter``, which adds typed, deduplicated initializers), in the
  list style too;
* the graph writers (:class:`Writer`: the losses as :class:`LossGraph`, and torch's update),
  in the argument style ``g.op("Mul", x, y, out=...)``, which reads as the formula it writes.
"""
from __future__ import annotations

from typing import MutableSequence, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxmp.naming import FreshNames, proto_names

FLOATS = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})


class Nodes:
    """Appends nodes named ``<scope>/<op_type>`` (outputs ``<scope>/<op_type>_output``), fresh in ``names``.

    ``nodes`` is where they go (a list, or a graph's ``node`` field); ``initializers`` (a graph's
    ``initializer`` field), when given, takes the constants instead of Constant nodes."""

    def __init__(self, names: FreshNames, scope: str, nodes: MutableSequence | None = None,
                 initializers: MutableSequence | None = None):
        self.names, self.scope = names, scope
        self.nodes = [] if nodes is None else nodes
        self.initializers = initializers
        self.min_opset = 0  # the ai.onnx opset the nodes need (0: any)

    def fresh(self, what: str) -> str:
        return self.names(f"{self.scope}/{what}")

    def ops(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], *, name: str | None = None,
            **attrs) -> list[str]:
        """A node with several outputs ("" in ``outputs``: a fresh name)."""
        outs = [o or self.fresh(f"{op_type}_output") for o in outputs]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name or self.fresh(op_type), **attrs))
        return outs

    def op(self, op_type: str, inputs: Sequence[str], output: str | None = None, **attrs) -> str:
        return self.ops(op_type, inputs, [output or ""], **attrs)[0]

    def constant(self, array, what: str = "const") -> str:
        array = np.asarray(array)
        out = self.fresh(what)
        tensor = numpy_helper.from_array(array, out)
        if self.initializers is not None:
            self.initializers.append(tensor)
        else:
            self.nodes.append(helper.make_node("Constant", [], [out], name=self.fresh("Constant"), value=tensor))
        return out

    def ints(self, values) -> str:
        """An int64 constant: a scalar for an int, a 1-D tensor for a list."""
        return self.constant(np.array(values, dtype=np.int64))

    def needs_opset(self, version: int) -> None:
        self.min_opset = max(self.min_opset, version)


class Rewrite(Nodes):
    """The nodes replacing one node, scoped by its name.  ``elem`` is the float type of its first
    input (float32 when unknown); ``trainable`` the tensors that depend on a trainable parameter."""

    def __init__(self, names: FreshNames, node: onnx.NodeProto, elem: int = TensorProto.FLOAT,
                 trainable: frozenset[str] = frozenset()):
        super().__init__(names, node.name or f"{node.op_type}_{node.output[0]}")
        self.node, self.trainable = node, trainable
        self.elem = elem if elem in FLOATS else TensorProto.FLOAT

    @classmethod
    def of(cls, names: FreshNames, node: onnx.NodeProto, types: dict[str, onnx.TypeProto],
           trainable: frozenset[str] = frozenset()) -> "Rewrite":
        """A rewrite of ``node`` whose ``elem`` is read from ``types`` (value name -> TypeProto)."""
        tp = types.get(node.input[0]) if node.input else None
        elem = tp.tensor_type.elem_type if tp is not None and tp.HasField("tensor_type") else 0
        return cls(names, node, elem, trainable)

    def const(self, value: float) -> str:
        """A scalar Constant node of the input's float type."""
        return self.constant(np.array(value, dtype=helper.tensor_dtype_to_np_dtype(self.elem)))

    def attr(self, name: str, default):
        value = attribute(self.node, name, default)
        return value.decode() if isinstance(value, bytes) else value


def attribute(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def node_input(node: onnx.NodeProto, i: int) -> str:
    """Input ``i`` of ``node``, or "" when absent."""
    return node.input[i] if len(node.input) > i else ""


def node_output(node: onnx.NodeProto, i: int) -> str:
    """Output ``i`` of ``node``, or "" when the graph does not use it."""
    return node.output[i] if len(node.output) > i else ""


class Writer(Nodes):
    """A graph writer's nodes, in the argument style: ``op(op_type, *inputs, out=..., what=...)``
    (``what``: the fresh output's name under the scope; ``out``: an exact name)."""

    def op(self, op_type: str, *inputs: str, out: str | None = None, what: str | None = None, **attrs) -> str:
        out = out or (self.fresh(what) if what else None)
        return self.ops(op_type, inputs, [out or ""], **attrs)[0]

    def name(self, what: str) -> str:
        return self.fresh(what)

    def const(self, what: str, value, dtype=np.float32) -> str:
        return self.constant(np.asarray(value, dtype=dtype), what)


class LossGraph(Writer):
    """What a loss writer adds to (the table's losses and custom ones): nodes with unique
    ``onnxmp/loss/<prefix>/...`` names (a node is named as its output), constants as initializers."""

    def __init__(self, graph: onnx.GraphProto, prefix: str):
        super().__init__(FreshNames(proto_names(graph)), f"onnxmp/loss/{prefix}", graph.node, graph.initializer)
        self.graph, self.prefix = graph, prefix

    def op(self, op_type: str, *inputs: str, what: str | None = None, **attrs) -> str:
        out = self.fresh(what or op_type.lower())
        return self.ops(op_type, inputs, [out], name=out, **attrs)[0]
