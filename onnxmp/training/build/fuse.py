"""Fusions of the forward graph for onnxmp's gradient builder: exported subgraphs become the one
op that plain onnxruntime registers for them, before differentiation.

:func:`fuse_gelus`: torch exports GELU as its formula, ``0.5 x (1 + erf(x / sqrt 2))`` (five
nodes) or, for the tanh approximation (GPT-2's ``NewGELU``), ``0.5 x (1 + tanh(sqrt(2/pi)
(x + 0.044715 x^3)))`` (eight).  onnxruntime fuses them itself (GeluFusion) only where nothing
else reads their intermediate values, and a gradient graph reads them all, so the formula would
run in the training graph node by node, forward and backward.  As one com.microsoft ``Gelu`` or
``FastGelu`` (registered by plain onnxruntime's CPU and CUDA builds, :mod:`onnxmp.kernels`) the
forward is one kernel, and its gradient one rule
(:mod:`~onnxmp.training.build.autodiff.activation_zoo`).

ORT's builder is the reference and gets the graph as exported: these run for onnxmp's only
(``prepare_for_gradient(..., ort_builder=False)``).  A subgraph is fused only where every value
inside it is read inside it alone (not a graph output, not read by another node), and its
constants are the formula's, within float32 rounding.

These are not :mod:`onnxmp.fusions.gelus`: that module predicts what onnxruntime's GeluFusion and
FastGeluFusion will fuse, by their exact conditions, so the coloring and the emulation see the
kernels ORT runs; this one is onnxmp's own rewrite, broader on purpose (dynamo's Mul forms, either
association of the halves), because what it fuses is what the gradient builder differentiates.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxmp.domains import is_onnx_domain
from onnxmp.external import constant_node_values
from onnxmp.naming import FreshNames, proto_names

log = logging.getLogger("onnxmp.training.build.fuse")

MS_DOMAIN = "com.microsoft"
_SQRT2 = float(np.sqrt(2.0))
_SQRT_2_OVER_PI = float(np.sqrt(2.0 / np.pi))
_CUBIC = 0.044715


class _Graph:
    """The producers, consumers and small constant values of one graph."""

    def __init__(self, graph: onnx.GraphProto, nodes: list[onnx.NodeProto], trainable: frozenset[str]):
        self.producer = {o: n for n in nodes for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in nodes:
            for name in dict.fromkeys(node.input):
                self.consumers[name].append(node)
        self.outputs = {v.name for v in graph.output}
        # a trainable constant is a parameter of the model, not the formula's
        self.initializers = {t.name: t for t in graph.initializer if np.prod(t.dims) == 1 and t.name not in trainable}

    def value(self, name: str) -> float | None:
        """The scalar (or one-element) float constant ``name`` holds, else None."""
        if name in self.initializers:
            array = numpy_helper.to_array(self.initializers[name])
        else:
            node = self.producer.get(name)
            if node is None or node.op_type != "Constant" or not is_onnx_domain(node.domain):
                return None
            array = constant_node_values(node)
            if array is None:
                return None
        return float(array.ravel()[0]) if array.size == 1 and array.dtype.kind == "f" else None

    def is_(self, name: str, want: float) -> bool:
        value = self.value(name)
        return value is not None and abs(value - want) <= 1e-4 * abs(want)

    def op(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type and is_onnx_domain(node.domain) else None

    def only_consumer(self, name: str) -> onnx.NodeProto | None:
        """The single node reading ``name``, when that is all that reads it."""
        readers = self.consumers.get(name, [])
        return readers[0] if len(readers) == 1 and name not in self.outputs else None

    def other(self, node: onnx.NodeProto, name: str) -> str | None:
        """The input of binary ``node`` that is not ``name``."""
        inputs = list(node.input)
        if len(inputs) != 2 or name not in inputs:
            return None
        return inputs[1] if inputs[0] == name else inputs[0]


def _scaled(g: _Graph, name: str, factor: float, *, divide_by: float | None = None) -> str | None:
    """``x`` where ``name`` is ``x * factor`` (or ``x / divide_by``), else None."""
    mul = g.op(name, "Mul")
    if mul is not None:
        for a, b in (mul.input, reversed(mul.input)):
            if g.is_(b, factor):
                return a
    div = g.op(name, "Div")
    if div is not None and divide_by is not None and g.is_(div.input[1], divide_by):
        return div.input[0]
    return None


def _half_x_times(g: _Graph, t: str, x: str) -> tuple[str, list[onnx.NodeProto]] | None:
    """(the output of ``0.5 * x * t`` in any association, the Mul nodes it takes)."""
    m1 = g.only_consumer(t)
    if m1 is None or m1.op_type != "Mul":
        return None
    a = g.other(m1, t)
    if a is None:
        return None
    if a == x or g.is_(a, 0.5):  # (x * t) * 0.5 or (0.5 * t) * x
        m2 = g.only_consumer(m1.output[0])
        if m2 is None or m2.op_type != "Mul" or g.other(m2, m1.output[0]) is None:
            return None
        b = g.other(m2, m1.output[0])
        if (a == x and g.is_(b, 0.5)) or (a != x and b == x):
            return m2.output[0], [m1, m2]
        return None
    if _scaled(g, a, 0.5) == x:  # (0.5 * x) * t, the half also read elsewhere or not
        half = g.producer[a]
        return m1.output[0], [m1] + ([half] if g.only_consumer(a) is m1 else [])
    return None


def _one_plus(g: _Graph, name: str) -> tuple[str, onnx.NodeProto] | None:
    """(``1 + name``'s output, its Add) where ``name`` is read only by that Add."""
    add = g.only_consumer(name)
    if add is None or add.op_type != "Add" or not g.is_(g.other(add, name) or "", 1.0):
        return None
    return add.output[0], add


def _erf_gelu(g: _Graph, erf: onnx.NodeProto):
    arg = erf.input[0]
    x = _scaled(g, arg, 1.0 / _SQRT2, divide_by=_SQRT2)
    if x is None or g.only_consumer(arg) is not erf:
        return None
    plus = _one_plus(g, erf.output[0])
    if plus is None:
        return None
    product = _half_x_times(g, plus[0], x)
    if product is None:
        return None
    return "Gelu", x, product[0], [g.producer[arg], erf, plus[1], *product[1]]


def _cube_of(g: _Graph, name: str, x: str) -> list[onnx.NodeProto] | None:
    """The nodes computing ``x^3`` as ``name`` (Pow(x, 3) or x * (x * x)), else None."""
    pow_ = g.op(name, "Pow")
    if pow_ is not None:
        return [pow_] if pow_.input[0] == x and g.is_(pow_.input[1], 3.0) else None
    mul = g.op(name, "Mul")
    if mul is None or x not in mul.input:
        return None
    square = g.op(g.other(mul, x) or "", "Mul")
    if square is None or list(square.input) != [x, x] or g.only_consumer(square.output[0]) is not mul:
        return None
    return [mul, square]


def _tanh_gelu(g: _Graph, tanh: onnx.NodeProto):
    u = tanh.input[0]
    inner = _scaled(g, u, _SQRT_2_OVER_PI)
    add = g.op(inner or "", "Add")
    if add is None or g.only_consumer(u) is not tanh or g.only_consumer(inner) is not g.producer[u]:
        return None
    for x, cubic in (add.input, reversed(add.input)):
        cube = _scaled(g, cubic, _CUBIC)
        if cube is None or g.only_consumer(cubic) is not add or g.only_consumer(cube) is not g.producer[cubic]:
            continue
        cube_nodes = _cube_of(g, cube, x)
        if cube_nodes is None:
            continue
        plus = _one_plus(g, tanh.output[0])
        product = _half_x_times(g, plus[0], x) if plus else None
        if product is None:
            return None
        nodes = [*cube_nodes, g.producer[cubic], add, g.producer[u], tanh, plus[1], *product[1]]
        return "FastGelu", x, product[0], nodes
    return None


_MATCHERS = {"Erf": _erf_gelu, "Tanh": _tanh_gelu}


def fuse_gelus(model: onnx.ModelProto, requires_grad: Iterable[str] = ()) -> list[tuple[str, str]]:
    """Replace, in place, each exported GELU subgraph of ``model``'s main graph by one com.microsoft
    ``Gelu`` (erf form) or ``FastGelu`` (tanh form).  Returns (op type, name) of each fused node.
    A subgraph whose constant is one of ``requires_grad`` (dynamo exports store them as
    initializers; training them all trains that 0.5 too) is not the formula and stays."""
    graph = model.graph
    nodes_in_order = list(graph.node)  # one wrapper per node: identities hold while this list does
    position = {id(n): i for i, n in enumerate(nodes_in_order)}
    g = _Graph(graph, nodes_in_order, frozenset(requires_grad))
    names = FreshNames(proto_names(graph))
    removed: set[int] = set()
    fused: dict[int, onnx.NodeProto] = {}  # at the position of the subgraph's last node
    for node in nodes_in_order:
        matcher = _MATCHERS.get(node.op_type) if is_onnx_domain(node.domain) else None
        found = matcher(g, node) if matcher else None
        if found is None or any(id(n) in removed for n in found[3]):
            continue
        op_type, x, out, nodes = found
        removed.update(id(n) for n in nodes)
        last = max(nodes, key=lambda n: position[id(n)])
        fused[id(last)] = helper.make_node(op_type, [x], [out], name=names(f"{node.name or out}/{op_type}"),
                                           domain=MS_DOMAIN)
    if not fused:
        return []
    kept = [fused.get(id(n), n) for n in nodes_in_order if id(n) not in removed or id(n) in fused]
    # the formula's Constant nodes, now read by nothing
    read = {name for n in kept for name in n.input} | g.outputs
    kept = [n for n in kept if not (n.op_type == "Constant" and is_onnx_domain(n.domain) and n.output[0] not in read)]
    graph.ClearField("node")
    graph.node.extend(kept)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    log.info("fused %d exported GELU subgraph(s) into com.microsoft Gelu/FastGelu", len(fused))
    return [(n.op_type, n.name) for n in fused.values()]

