"""The values of shape tensors, symbolically: what onnx's data propagation misses in exported graphs.

Exporters compute Reshape and Expand targets from ``Shape`` with Gather, Concat, Where, Equal,
ConstantOfShape, Mul and Div (torch's ``expand`` and head-splitting patterns).  onnx's inference
names each dim it cannot follow with a fresh ``unk__N``, and a gradient builder that cannot tell
two dims equal has to compare them at run time.  :func:`shape_hints` follows those computations
with dims as products of symbols (``batch*sequence``), so ``B*S*768 / 768`` cancels to ``B*S``,
and returns the output shapes of the Reshape, Expand, ConstantOfShape and Tile nodes it could
work out, which :mod:`.info` gives onnx's inference as declared shapes for another pass.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

# A dim: an int, a str (a product of symbols, "a*b", factors sorted), or None (unknown).
Dim = int | str | None


def _factors(d: Dim) -> tuple[int, Counter] | None:
    if isinstance(d, (int, np.integer)):
        return int(d), Counter()
    if isinstance(d, str) and d:
        coefficient, symbols = 1, Counter()
        for f in d.split("*"):
            if f.lstrip("-").isdigit():
                coefficient *= int(f)
            else:
                symbols[f] += 1
        return coefficient, symbols
    return None


def _dim(coefficient: int, symbols: Counter) -> Dim:
    if not symbols:
        return coefficient
    names = sorted(symbols.elements())
    return "*".join(([str(coefficient)] if coefficient != 1 else []) + names)


def multiply(a: Dim, b: Dim) -> Dim:
    fa, fb = _factors(a), _factors(b)
    if fa is None or fb is None:
        return None
    return _dim(fa[0] * fb[0], fa[1] + fb[1])


def divide(a: Dim, b: Dim) -> Dim:
    """a / b when exact (every symbol of b in a, the coefficient dividing), else None."""
    fa, fb = _factors(a), _factors(b)
    if fa is None or fb is None or fb[0] == 0 or fa[0] % fb[0] or fb[1] - fa[1]:
        return None
    return _dim(fa[0] // fb[0], fa[1] - fb[1])


def product(dims) -> Dim:
    total: Dim = 1
    for d in dims:
        total = multiply(total, d)
    return total


class _Values:
    """Values of small integer tensors: a list of dims, or a scalar (``scalar`` names)."""

    def __init__(self):
        self.values: dict[str, list] = {}
        self.scalars: set[str] = set()

    def get(self, name: str) -> list | None:
        return self.values.get(name)

    def set(self, name: str, value, scalar: bool = False) -> None:
        if value is None:
            return
        self.values[name] = list(value)
        if scalar:
            self.scalars.add(name)


def _array_value(array: np.ndarray) -> tuple[list, bool] | None:
    if array.dtype.kind not in "iub" or array.ndim > 1 or array.size > 64:
        return None
    return [bool(v) if array.dtype.kind == "b" else int(v) for v in array.ravel()], array.ndim == 0


def _elementwise(a: list, b: list, fn) -> list | None:
    if len(a) != len(b) and 1 not in (len(a), len(b)):
        return None
    n = max(len(a), len(b))
    a, b = (a * n if len(a) == 1 else a), (b * n if len(b) == 1 else b)
    return [fn(x, y) for x, y in zip(a, b)]


def _equal(x, y):
    if x is None or y is None:
        return None
    if isinstance(x, str) and isinstance(y, str):
        return True if x == y else None
    if isinstance(x, str) or isinstance(y, str):
        other = y if isinstance(x, str) else x
        return False if isinstance(other, int) and other < 0 else None  # a dim is never negative
    return x == y


def _arith(op: str):
    def fn(x, y):
        if isinstance(x, int) and isinstance(y, int) and not isinstance(x, bool):
            if op == "Div":
                return x // y if y else None
            return {"Add": x + y, "Sub": x - y, "Mul": x * y}[op]
        if op == "Sub" and x == y and x is not None:
            return 0
        if op == "Add" and 0 in (x, y) and not isinstance(x, bool):
            return y if x == 0 else x
        if op == "Mul":
            return multiply(x, y)
        if op == "Div":
            return divide(x, y)
        return None
    return fn


def shape_hints(model: onnx.ModelProto, shapes: dict[str, tuple | None],
                values: dict | None = None) -> dict[str, tuple]:
    """Output shapes of shape-consuming nodes (Reshape, Expand, ConstantOfShape, Tile), from the
    symbolic values of their shape inputs and ``shapes`` (the shapes known so far); ``values``, when
    given, receives those symbolic values (lists of dims)."""
    v = _Values()
    for t in model.graph.initializer:
        if t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and np.prod(t.dims) <= 64:
            found = _array_value(numpy_helper.to_array(t))
            if found:
                v.set(t.name, found[0], found[1])
    hints: dict[str, tuple] = {}
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        _value(node, v, shapes)
        hint = _hint(node, v, shapes)
        if hint is not None:
            hints[node.output[0]] = hint
    if values is not None:
        values.update(v.values)
    return hints


def _value(node: onnx.NodeProto, v: _Values, shapes: dict) -> None:
    op, ins, out = node.op_type, list(node.input), node.output[0] if node.output else ""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op == "Constant":
        if "value" in attrs:
            found = _array_value(numpy_helper.to_array(attrs["value"]))
            if found:
                v.set(out, found[0], found[1])
        elif "value_ints" in attrs:
            v.set(out, attrs["value_ints"])
        elif "value_int" in attrs:
            v.set(out, [attrs["value_int"]], scalar=True)
    elif op == "Shape":
        shape = shapes.get(ins[0])
        if shape is not None:
            start, end = attrs.get("start", 0), attrs.get("end", None)
            v.set(out, list(shape)[start:end])
    elif op in ("Cast", "Identity") and v.get(ins[0]) is not None:
        v.set(out, v.get(ins[0]), ins[0] in v.scalars)
    elif op == "Gather" and v.get(ins[0]) is not None and v.get(ins[1]) is not None and attrs.get("axis", 0) == 0:
        data, idx = v.get(ins[0]), v.get(ins[1])
        if all(isinstance(i, int) and -len(data) <= i < len(data) for i in idx):
            v.set(out, [data[i] for i in idx], ins[1] in v.scalars)
    elif op == "Unsqueeze" and v.get(ins[0]) is not None and ins[0] in v.scalars:
        v.set(out, v.get(ins[0]))
    elif op == "Squeeze" and v.get(ins[0]) is not None and len(v.get(ins[0])) == 1:
        v.set(out, v.get(ins[0]), scalar=True)
    elif op == "Concat" and all(v.get(i) is not None for i in ins):
        v.set(out, [d for i in ins for d in v.get(i)])
    elif op == "Slice" and v.get(ins[0]) is not None:
        params = [v.get(i) if len(ins) > k and i else None for k, i in enumerate(ins[1:5], 1)]
        starts, ends, axes, steps = (params + [None] * 4)[:4]
        if starts and ends and (axes is None or axes == [0]) and (steps is None or steps == [1]):
            if all(isinstance(x, int) for x in starts + ends):
                v.set(out, v.get(ins[0])[starts[0]:ends[0]])
    elif op == "Equal" and v.get(ins[0]) is not None and v.get(ins[1]) is not None:
        v.set(out, _elementwise(v.get(ins[0]), v.get(ins[1]), _equal))
    elif op in ("Add", "Sub", "Mul", "Div") and v.get(ins[0]) is not None and v.get(ins[1]) is not None:
        scalar = ins[0] in v.scalars and ins[1] in v.scalars
        v.set(out, _elementwise(v.get(ins[0]), v.get(ins[1]), _arith(op)), scalar)
    elif op == "Where" and all(v.get(i) is not None for i in ins):
        cond, a, b = (v.get(i) for i in ins)
        picked = _elementwise(cond, _elementwise(a, b, lambda x, y: (x, y)) or [], lambda c, p: (
            None if c is None else p[0] if c else p[1]))
        v.set(out, picked)
    elif op == "Reshape" and v.get(ins[0]) is not None and v.get(ins[1]) is not None:
        target = v.get(ins[1])
        if target in ([-1], [len(v.get(ins[0]))]):
            v.set(out, v.get(ins[0]))
        elif target == [] and len(v.get(ins[0])) == 1:
            v.set(out, v.get(ins[0]), scalar=True)
    elif op == "Expand" and v.get(ins[0]) is not None and v.get(ins[1]) is not None:
        value, target = v.get(ins[0]), v.get(ins[1])
        if target == [len(value)]:
            v.set(out, value)
        elif len(value) == 1 and len(target) == 1 and isinstance(target[0], int) and 0 < target[0] <= 64:
            v.set(out, value * target[0])
    elif op == "ConstantOfShape" and v.get(ins[0]) is not None:
        size = v.get(ins[0])
        fill = attrs.get("value")
        found = _array_value(numpy_helper.to_array(fill)) if fill is not None else ([0], False)
        if found and len(size) == 1 and isinstance(size[0], int) and size[0] <= 64:
            v.set(out, found[0] * size[0])


def _expanded(x: Dim, y: Dim) -> Dim:
    """Expand's output dim for input dim ``x`` and target dim ``y``.  An input dim onnx could not
    name (``unk__``) against a symbolic target is taken as the target: Expand needs it to be 1 or
    equal to the target, unless the target is 1 at run time (an Expand that expands nothing)."""
    if x == 1:
        return y
    if y == 1 or x == y:
        return x
    if isinstance(y, str) and (x is None or (isinstance(x, str) and x.startswith("unk__"))):
        return y
    return None


def _hint(node: onnx.NodeProto, v: _Values, shapes: dict) -> tuple | None:
    op, ins = node.op_type, list(node.input)
    if op == "Expand" and len(ins) > 1:
        target, shape = v.get(ins[1]), shapes.get(ins[0])
        if target is None or shape is None:
            return None
        rank = max(len(target), len(shape))
        a = [1] * (rank - len(shape)) + list(shape)
        b = [1] * (rank - len(target)) + list(target)
        return tuple(_expanded(x, y) for x, y in zip(a, b))
    if op == "Reshape" and len(ins) > 1:
        target, shape = v.get(ins[1]), shapes.get(ins[0])
        if target is None or any(d is None for d in target):
            return None
        allowzero = any(a.name == "allowzero" and a.i for a in node.attribute)
        dims = []
        for i, d in enumerate(target):
            if d == 0 and not allowzero:
                d = shape[i] if shape is not None and i < len(shape) else None
            dims.append(d)
        if -1 in dims:
            known = [d for d in dims if d != -1]
            whole = product(shape) if shape is not None else None
            dims[dims.index(-1)] = divide(whole, product(known)) if whole is not None else None
        return tuple(dims)
    if op == "Slice" and len(ins) >= 3:
        shape = shapes.get(ins[0])
        starts, ends = v.get(ins[1]), v.get(ins[2])
        axes = v.get(ins[3]) if len(ins) > 3 and ins[3] else (list(range(len(starts))) if starts else None)
        steps = v.get(ins[4]) if len(ins) > 4 and ins[4] else [1] * len(axes or [])
        if shape is None or not starts or not ends or axes is None or steps is None or any(t != 1 for t in steps):
            return None
        dims = list(shape)
        for axis, start, end in zip(axes, starts, ends):
            if not isinstance(axis, int) or not -len(dims) <= axis < len(dims):
                return None
            # A slice [0:s] of a longer buffer by a symbolic extent s (a sequence length read with
            # Shape) is taken as s long: a graph that adds it to a tensor s long runs only if it is.
            if start == 0 and isinstance(end, str) and (dims[axis] is None or isinstance(dims[axis], int)):
                dims[axis] = end
            else:
                return None
        return tuple(dims)
    if op == "Range" and all(v.get(i) is not None for i in ins):
        start, limit, delta = (v.get(i)[0] for i in ins)
        if start == 0 and delta == 1 and isinstance(limit, str):
            return (limit,)
        return None
    if op == "ConstantOfShape":
        target = v.get(ins[0])
        return tuple(target) if target is not None else None
    if op == "Tile" and len(ins) > 1:
        repeats, shape = v.get(ins[1]), shapes.get(ins[0])
        if repeats is None or shape is None or len(repeats) != len(shape):
            return None
        return tuple(multiply(d, r) for d, r in zip(shape, repeats))
    return None
