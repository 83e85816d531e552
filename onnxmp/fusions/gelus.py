"""The GELUs onnxruntime fuses: ``GeluFusion`` (Erf), ``BiasGeluFusion``'s Add and ``FastGeluFusion``
(tanh), by ORT's own conditions (see :mod:`onnxmp.fusions`)."""
from __future__ import annotations

import numpy as np
import onnx

from onnxmp.fusions.graph_facts import FLOAT, GraphFacts


def _is_value(facts: GraphFacts, name: str, expected: float) -> bool:
    """optimizer_utils::IsInitializerWithExpectedValue: a float32 or float64 scalar within 1e-5
    (relative) of ``expected``, or a float16 one within that of ``expected`` rounded to float16
    (optimizer/utils.cc r19:41-97); any other type, bfloat16 included, never matches."""
    tensor = facts.constants.get(name)
    if tensor is None or int(np.prod(tensor.dims)) != 1:
        return False
    value = float(onnx.numpy_helper.to_array(tensor).reshape(-1)[0])
    if tensor.data_type == onnx.TensorProto.FLOAT16:
        target = float(np.float16(expected))
    elif tensor.data_type in (FLOAT, onnx.TensorProto.DOUBLE):
        target = expected
    else:
        return False
    return np.isfinite(value) and abs(value - target) <= 1e-8 + 1e-5 * abs(expected)


def gelus(facts: GraphFacts) -> list[tuple[str, ...]]:
    """``GeluFusion``: ``Div(x, sqrt(2)) -> Erf -> Add(1) -> Mul(x) -> Mul(0.5)`` (either order of the
    two Muls), each node read only by the next; the node names of each match."""
    if not facts.has("Div", "Erf", "Add", "Mul"):
        return []
    found = []
    for div in range(len(facts.nodes)):
        f, n = facts, facts.nodes
        if not f.op(div, "Div") or not f.check_out_edges(div, 1):
            continue
        root = n[div].input[1] if len(n[div].input) > 1 else ""
        if not (_is_value(f, root, 1.4142099618911743) or _is_value(f, root, float(np.sqrt(2.0)))):
            continue
        erf = f.children(div)[0]
        if not f.op(erf, "Erf") or not f.check_out_edges(erf, 1):
            continue
        add = f.children(erf)[0]
        if not f.op(add, "Add") or not f.check_out_edges(add, 1) or \
                not any(_is_value(f, name, 1.0) for name in n[add].input):
            continue
        mul = f.children(add)[0]
        if not f.op(mul, "Mul"):
            continue
        x = n[div].input[0]
        half = None
        if x in n[mul].input and f.check_out_edges(mul, 1):
            half = f.children(mul)[0]
            if not (f.op(half, "Mul") and any(_is_value(f, name, 0.5) for name in n[half].input)):
                continue
            found.append(tuple(n[k].name for k in (div, erf, add, mul, half)))
            continue
        other = next((f.producer.get(name) for name in n[mul].input if name != n[add].output[0]), None)
        if other is not None and f.op(other, "Mul") and x in n[other].input \
                and any(_is_value(f, name, 0.5) for name in n[other].input):
            found.append(tuple(n[k].name for k in (div, erf, add, other, mul)))
    return found


def bias_gelu_add(facts: GraphFacts, gelu: tuple[str, ...]) -> str | None:
    """``BiasGeluFusion``: the ``Add`` of a 1-D bias feeding a fused GELU (``gelu``: its node names,
    the ``Div`` first), read by nothing else; its name, or None."""
    x = facts.nodes[facts.position[gelu[0]]].input[0]
    k = facts.producer.get(x)
    if k is None or not facts.op(k, "Add") or facts.writes_graph_output(k):
        return None
    # The Gelu reads x twice (Div and Mul): after the fusion one edge is left, the Add's only one.
    if facts.out_edges(k) != 2:
        return None
    inputs = facts.nodes[k].input
    if not any(facts.rank(name) == 1 for name in inputs):
        return None
    return facts.nodes[k].name


_FAST_GELU = {"cube": 0.044715, "cube2": 0.044714998453855515, "root": 0.7978845834732056}


def fast_gelus(facts: GraphFacts) -> list[tuple[str, ...]]:
    """``FastGeluFusion``: the tanh GELU ``0.5 * x * (1 + tanh(0.79788 * (x + 0.044715 * x**3)))`` as
    exporters write it, with ``Pow(x, 3)`` (GPT-2, ALBERT's gelu_new) or as ``x * (0.79788 * x) *
    (1 + 0.044715 * x * x)``: the node names of each match (fast_gelu_fusion.cc, r19:35-305)."""
    if not facts.has("Tanh", "Mul", "Add"):
        return []
    f, n = facts, facts.nodes
    found = []
    for k in range(len(n)):
        start = _fast_gelu_pow(f, k) or _fast_gelu_muls(f, k)
        if start is None:
            continue
        members, tanh_input, x = start
        tanh = f.children(tanh_input)[0]
        if not f.op(tanh, "Tanh") or not f.check_out_edges(tanh, 1):
            continue
        add2 = f.children(tanh)[0]
        if not f.op(add2, "Add") or not f.check_out_edges(add2, 1) or \
                not any(_is_value(f, name, 1.0) for name in n[add2].input if name != n[tanh].output[0]):
            continue
        mul5 = f.children(add2)[0]
        if not f.op(mul5, "Mul") or f.writes_graph_output(mul5):
            continue
        other = next((f.producer.get(name) for name in n[mul5].input if name != n[add2].output[0]), None)
        if other is None or not f.op(other, "Mul") or f.writes_graph_output(other):
            continue
        half = [name for name in n[other].input if _is_value(f, name, 0.5)]
        if not half or [name for name in n[other].input if name not in half] != [x]:
            continue
        found.append(tuple(n[i].name for i in (*members, tanh, add2, other, mul5)))
    return found


def _fast_gelu_pow(f: GraphFacts, pow_: int):
    """Formula 2: Pow(x, 3) -> Mul(0.044715) -> Add(x) -> Mul(0.79788)."""
    n = f.nodes
    if not f.op(pow_, "Pow") or f.out_edges(pow_) != 1 or len(n[pow_].input) < 2 or \
            not _is_value(f, n[pow_].input[1], 3.0):
        return None
    x = n[pow_].input[0]
    mul1 = f.children(pow_)[0]
    if not f.op(mul1, "Mul") or not f.check_out_edges(mul1, 1) or \
            not any(_is_value(f, t, _FAST_GELU["cube2"]) for t in n[mul1].input if t != n[pow_].output[0]):
        return None
    add1 = f.children(mul1)[0]
    if not f.op(add1, "Add") or not f.check_out_edges(add1, 1) or \
            [t for t in n[add1].input if t != n[mul1].output[0]] != [x]:
        return None
    mul2 = f.children(add1)[0]
    if not f.op(mul2, "Mul") or not f.check_out_edges(mul2, 1) or \
            not any(_is_value(f, t, _FAST_GELU["root"]) for t in n[mul2].input if t != n[add1].output[0]):
        return None
    return [pow_, mul1, add1, mul2], mul2, x


def _fast_gelu_muls(f: GraphFacts, mul1: int):
    """Formula 1: Mul(x, 0.044715) -> Mul(x) -> Add(1) -> Mul(Mul(x, 0.79788))."""
    n = f.nodes
    if not f.op(mul1, "Mul") or f.out_edges(mul1) != 1:
        return None
    constant = [t for t in n[mul1].input if _is_value(f, t, _FAST_GELU["cube"])]
    rest = [t for t in n[mul1].input if t not in constant]
    if not constant or len(rest) != 1:
        return None
    x = rest[0]
    mul2 = f.children(mul1)[0]
    if not f.op(mul2, "Mul") or not f.check_out_edges(mul2, 1) or \
            [t for t in n[mul2].input if t != n[mul1].output[0]] != [x]:
        return None
    add1 = f.children(mul2)[0]
    if not f.op(add1, "Add") or not f.check_out_edges(add1, 1) or \
            not any(_is_value(f, t, 1.0) for t in n[add1].input if t != n[mul2].output[0]):
        return None
    mul3 = f.children(add1)[0]
    if not f.op(mul3, "Mul") or not f.check_out_edges(mul3, 1):
        return None
    mul4 = next((f.producer.get(t) for t in n[mul3].input if t != n[add1].output[0]), None)
    if mul4 is None or not f.op(mul4, "Mul") or not f.check_out_edges(mul4, 1) or \
            not any(_is_value(f, t, _FAST_GELU["root"]) for t in n[mul4].input) or x not in n[mul4].input:
        return None
    return [mul1, mul2, add1, mul4, mul3], mul3, x
