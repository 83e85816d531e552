"""Random valid float32 ONNX graphs (opset 17, IR 8) for fuzzing the conversion.

One builder serves two drivers: the hypothesis strategy :func:`random_graphs`
(tests, with shrinking) and :func:`random_graph` over a plain
``random.Random`` (``scripts/fuzz_convert.py``, thousands of independent
graphs).  Both only make choices through a :class:`Choices` object.

Shape: every tensor in the pool the builder draws from is ``[B, W]`` float32
(``B`` in 1..3, ``W`` in {4, 8, 16}); ops that change shape are used as
sandwiches that return to ``[B, W]`` (Reshape -> Conv -> Reshape, Transpose ->
op -> Transpose, Concat -> Slice, a ``[B, 1]`` reduction broadcast back).
Ops: allow MatMul, Gemm, Conv; infer Add, Sub, Mul, Div, Sigmoid, Tanh, Erf,
Softmax, Log, Sqrt, LayerNormalization; deny Exp, ReduceMean, ReduceSum, Pow;
clear Relu, Neg, Abs, Identity, Transpose, Reshape, Concat, Slice, Max, Min,
Where, Greater/Less, Cast; Sin (on no list); Constant and ConstantOfShape.
Structure: every block reads tensors from the pool (any earlier one, so
tensors fan out and branches form) and binary blocks join two of them;
constants come from a shared pool, so one initializer is read by several nodes
(a weight by two MatMuls, the scalar 2 by Pow (deny) and Div (infer)).  The
graph outputs are the last tensor plus up to two earlier ones.

Numerics: inputs are N(0, 1) and weights N(0, 1/fan_in), so tensors keep a
scale of order 1, far from fp16's range limits.  The error bound of
``tests/test_fuzz.py`` needs ops that do not amplify relative error, so the
forms that would are not built:

* Log, Sqrt and Div only away from their singularities: ``Log(Sigmoid(x))``,
  ``Sqrt(Sigmoid(x))``, ``x / (1 + Sigmoid(y))``;
* Exp, Pow and Softmax only of bounded inputs: ``Exp(Tanh(x))``,
  ``Pow(Tanh(x), 2)``, ``Softmax(Tanh(x))``; products only as gates
  ``x * Sigmoid(y)`` or by constants, so magnitudes cannot square;
* LayerNormalization only of a MatMul/Gemm/Conv output (row mean ~ 0), where
  subtracting the mean cancels nothing systematic;
* comparisons only where a near tie does no harm: ``Where(Greater(a, b), a,
  b)`` is max(a, b), continuous; a 0/1 mask ``Cast(Greater(x, 0))`` tests the
  sign of a graph input, which rounding never flips.

Cancellation by chance (Sub of two similar branches, a MatMul whose output is
small next to its input, Relu keeping only tiny values) cannot be excluded by
construction, so it is measured: :func:`error_gains` tracks, from the fp32
values, how large each output's inherited error can be next to the output
itself, and a graph whose output gain exceeds :data:`MAX_GAIN` is rejected,
as is one whose fp32 run is not finite or leaves ``[-MAX_MAGNITUDE,
MAX_MAGNITUDE]``.  About 3% of graphs are rejected.
"""
from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, TypeVar

import numpy as np
import onnx
from hypothesis import assume
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
WIDTHS = (4, 8, 16)
MAX_MAGNITUDE = 1e3       # far below fp16's 65504, so low precision cannot overflow
MAX_GAIN = 4.0            # error gain (see error_gains) above which a graph is rejected as ill-conditioned
T = TypeVar("T")


class Choices(Protocol):
    def integer(self, lo: int, hi: int) -> int: ...

    def choice(self, options: Sequence[T]) -> T: ...


class HypothesisChoices:
    def __init__(self, draw):
        self.draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def choice(self, options: Sequence[T]) -> T:
        return self.draw(st.sampled_from(options))


class RandomChoices:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return self.rng.choice(options)


@dataclass
class RandomGraph:
    model: onnx.ModelProto
    inputs: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]      # fp32 outputs on onnxruntime CPU
    gain: dict[str, float]               # per output: first-order error gain (error_gains)
    depth: dict[str, int]                # per output: nodes on the longest path from a graph input
    blocks: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"blocks={self.blocks} depth={self.depth}\n{onnx.printer.to_text(self.model.graph)}"


class _Builder:
    def __init__(self, choices: Choices, batch: int, width: int, seed: int, naming: str):
        self.c = choices
        self.B, self.W = batch, width
        self.rng = np.random.default_rng(seed)
        self.naming = naming
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.shared: dict[str, list[str]] = defaultdict(list)  # constant kind -> names, for reuse
        self.inputs: list[str] = []
        self.pool: list[str] = []                # [B, W] float32 tensors
        self.centered: set[str] = set()          # outputs of MatMul/Gemm/Conv: row mean ~ 0
        self.count = 0

    # -- helpers ---------------------------------------------------------------

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def node(self, op: str, inputs: Sequence[str], **attrs) -> str:
        out = self.fresh("t")
        name = self.fresh(f"{op.lower()}_") if self.naming == "unique" else ""
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=name, **attrs))
        return out

    def pick(self) -> str:
        """A pool tensor; 0 (the latest) is what shrinking prefers, giving a chain."""
        return self.pool[-1 - self.c.integer(0, len(self.pool) - 1)]

    def constant(self, kind: str, make: Callable[[], np.ndarray]) -> str:
        """A new constant, or (when one of ``kind`` exists) possibly a shared one."""
        existing = self.shared[kind]
        reuse = self.c.integer(0, len(existing))  # len(existing) means: make a new one
        if reuse < len(existing):
            return existing[reuse]
        name = self.fresh(kind)
        self.initializers[name] = numpy_helper.from_array(np.asarray(make()), name)
        existing.append(name)
        return name

    def int64(self, values: Sequence[int]) -> str:
        name = "i64_" + "_".join(str(v).replace("-", "m") for v in values)
        if name not in self.initializers:
            self.initializers[name] = numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)
        return name

    def scalar(self, value: float) -> str:
        """A shared initializer, or now and then a Constant node (``value_float``)."""
        if not self.c.integer(0, 4):
            return self.node("Constant", [], value_float=value)
        name = {0.5: "half", 1.0: "one", 2.0: "two"}[value]
        if name not in self.initializers:
            self.initializers[name] = numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)
        return name

    def normal(self, shape, std: float) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def matrix(self) -> str:
        return self.constant("w", lambda: self.normal((self.W, self.W), self.W ** -0.5))

    def bias(self) -> str:
        """A ``[1, W]`` shared initializer, a Constant node, or a ConstantOfShape."""
        kind = self.c.integer(0, 5)
        if kind < 4:
            return self.constant("b", lambda: self.normal((1, self.W), 0.5))
        if kind == 4:
            out = self.node("Constant", [], value=numpy_helper.from_array(self.normal((1, self.W), 0.5)))
        else:
            out = self.node("ConstantOfShape", [self.int64([1, self.W])],
                            value=numpy_helper.from_array(self.normal((1,), 0.5)))
        self.shared["b"].append(out)  # later biases may share it, as initializers are shared
        return out

    def vector(self, center: float) -> str:
        return self.constant(f"v{int(center)}_", lambda: center + self.normal((self.W,), 0.2))

    def unary(self, x: str) -> str:
        op = self.c.choice(["Relu", "Neg", "Abs", "Identity", "Tanh", "Sigmoid", "Erf", "Sin"])
        return self.node(op, [x])

    # -- blocks: each reads pool tensors and returns one [B, W] tensor ----------

    def matmul(self) -> str:
        return self.node("MatMul", [self.pick(), self.matrix()])

    def gemm(self) -> str:
        bias = self.constant("c", lambda: self.normal((self.W,), 0.5))
        return self.node("Gemm", [self.pick(), self.matrix(), bias], transB=self.c.integer(0, 1))

    def conv(self) -> str:
        x = self.node("Reshape", [self.pick(), self.int64([self.B, 1, self.W])])
        kernel = self.constant("k", lambda: self.normal((1, 1, 3), 3 ** -0.5))
        y = self.node("Conv", [x, kernel], kernel_shape=[3], pads=[1, 1])
        return self.node("Reshape", [y, self.int64([self.B, self.W])])

    def add_bias(self) -> str:
        return self.node(self.c.choice(["Add", "Sub"]), [self.pick(), self.bias()])

    def add(self) -> str:
        return self.node(self.c.choice(["Add", "Sub"]), [self.pick(), self.pick()])

    def gate(self) -> str:
        x = self.pick()
        return self.node("Mul", [x, self.node(self.c.choice(["Sigmoid", "Tanh"]), [self.pick()])])

    def scale(self) -> str:
        if self.c.integer(0, 1):
            return self.node("Mul", [self.pick(), self.scalar(0.5)])
        return self.node("Div", [self.pick(), self.scalar(2.0)])

    def divide(self) -> str:
        x = self.pick()
        denominator = self.node("Add", [self.node("Sigmoid", [self.pick()]), self.scalar(1.0)])
        return self.node("Div", [x, denominator])

    def activation(self) -> str:
        return self.node(self.c.choice(["Tanh", "Sigmoid", "Erf"]), [self.pick()])

    def softmax(self) -> str:
        return self.node("Softmax", [self.node("Tanh", [self.pick()])], axis=-1)

    def log(self) -> str:
        return self.node("Log", [self.node("Sigmoid", [self.pick()])])

    def sqrt(self) -> str:
        return self.node("Sqrt", [self.node("Sigmoid", [self.pick()])])

    def layernorm(self) -> str:
        centered = [t for t in self.pool if t in self.centered]
        x = centered[-1 - self.c.integer(0, len(centered) - 1)] if centered else self.matmul()
        return self.node("LayerNormalization", [x, self.vector(1.0), self.vector(0.0)], axis=-1,
                         epsilon=1e-5)

    def exp(self) -> str:
        return self.node("Exp", [self.node("Tanh", [self.pick()])])

    def reduce_mean(self) -> str:
        x = self.pick()
        return self.node("Add", [x, self.node("ReduceMean", [x], axes=[1], keepdims=1)])

    def reduce_sum(self) -> str:
        x = self.pick()
        total = self.node("ReduceSum", [x, self.int64([1])], keepdims=1)
        return self.node("Mul", [x, self.node("Sigmoid", [total])])

    def pow(self) -> str:
        return self.node("Pow", [self.node("Tanh", [self.pick()]), self.scalar(2.0)])

    def clear(self) -> str:
        return self.node(self.c.choice(["Relu", "Neg", "Abs", "Identity"]), [self.pick()])

    def transpose(self) -> str:
        y = self.unary(self.node("Transpose", [self.pick()], perm=[1, 0]))
        return self.node("Transpose", [y], perm=[1, 0])

    def reshape(self) -> str:
        y = self.unary(self.node("Reshape", [self.pick(), self.int64([self.B * self.W])]))
        return self.node("Reshape", [y, self.int64([self.B, self.W])])

    def concat_slice(self) -> str:
        axis = self.c.integer(0, 1)
        joined = self.node("Concat", [self.pick(), self.pick()], axis=axis)
        size = (self.B, self.W)[axis]
        start = self.c.integer(0, size)
        return self.node("Slice", [joined, self.int64([start]), self.int64([start + size]), self.int64([axis])])

    def extremum(self) -> str:
        arity = self.c.integer(2, 3)
        return self.node(self.c.choice(["Max", "Min"]), [self.pick() for _ in range(arity)])

    def mask(self) -> str:
        # A 0/1 mask jumps where its comparison ties, so it compares what rounding
        # cannot move across the threshold: the sign of a graph input.
        x = self.c.choice(self.inputs)
        if "zero" not in self.initializers:
            self.initializers["zero"] = numpy_helper.from_array(np.zeros((1,), dtype=np.float32), "zero")
        ones = self.node("Cast", [self.node(self.c.choice(["Greater", "Less"]), [x, "zero"])],
                         to=TensorProto.FLOAT)
        return self.node("Mul", [self.pick(), ones])

    def where(self) -> str:
        a, b = self.pick(), self.pick()
        return self.node("Where", [self.node(self.c.choice(["Greater", "Less"]), [a, b]), a, b])

    def other(self) -> str:
        return self.node("Sin", [self.pick()])

    BLOCKS = {
        "allow": ("matmul", "gemm", "conv"),
        "infer": ("add_bias", "add", "gate", "scale", "divide", "activation", "softmax", "log", "sqrt",
                  "layernorm"),
        "deny": ("exp", "reduce_mean", "reduce_sum", "pow"),
        "clear": ("clear", "transpose", "reshape", "concat_slice", "extremum", "where", "mask"),
        "other": ("other",),
    }
    # Allow blocks twice as likely: without one there is nothing to convert.
    CATEGORIES = ("allow", "infer", "clear", "allow", "deny", "infer", "clear", "other")

    def block(self) -> str:
        kind = self.c.choice(self.BLOCKS[self.c.choice(self.CATEGORIES)])
        out = getattr(self, kind)()
        if kind in ("matmul", "gemm", "conv"):
            self.centered.add(out)
        self.pool.append(out)
        return kind


def build(choices: Choices, max_blocks: int = 10) -> RandomGraph | None:
    """Build one graph from ``choices``; None when its fp32 run is out of range (see module doc)."""
    batch = choices.integer(1, 3)
    width = choices.choice(WIDTHS)
    seed = choices.integer(0, 2**32 - 1)
    b = _Builder(choices, batch, width, seed, naming=choices.choice(["unique", "unique", "unique", "empty"]))
    inputs = b.inputs = [f"x{i}" for i in range(choices.integer(1, 2))]
    b.pool.extend(inputs)
    blocks = [b.block() for _ in range(choices.integer(1, max_blocks))]
    computed = [t for t in b.pool if t not in inputs]
    outputs = [computed[-1]]
    for _ in range(choices.integer(0, 2)):
        extra = computed[-1 - choices.integer(0, len(computed) - 1)]
        if extra not in outputs:
            outputs.append(extra)

    shape = [batch, width]
    graph = helper.make_graph(
        b.nodes, "fuzz",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape) for x in inputs],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, shape) for y in outputs],
        initializer=list(b.initializers.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    if choices.integer(0, 1):  # exported models often carry value_info for every tensor
        model = onnx.shape_inference.infer_shapes(model)
    onnx.checker.check_model(model, full_check=True)  # a failure here is a generator bug

    feeds = {x: b.normal(shape, 1.0) for x in inputs}
    reference = _reference(model, feeds)
    if reference is None:
        return None
    return RandomGraph(model, feeds, *reference, depths(model), blocks)


def _reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]
               ) -> tuple[dict[str, np.ndarray], dict[str, float]] | None:
    """The fp32 outputs and their error gains, or None when the graph is out of range."""
    from onnxmp.calibrate import run_with_intermediates

    values = run_with_intermediates(model, [feeds])[0]
    if not all(np.isfinite(v).all() and np.abs(v).max() <= MAX_MAGNITUDE for v in values.values()):
        return None
    values.update(feeds)
    values.update({t.name: numpy_helper.to_array(t) for t in model.graph.initializer})
    gains = error_gains(model, values)
    outputs = [o.name for o in model.graph.output]
    if max(gains[o] for o in outputs) > MAX_GAIN:
        return None
    return {o: values[o] for o in outputs}, {o: gains[o] for o in outputs}


def error_gains(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> dict[str, float]:
    """First-order error gain of every float tensor: max(reach) / max|tensor|.

    ``reach`` is, element by element, the magnitude relative to which a
    tensor's absolute error is of order ``depth * u``: for a graph input or
    constant its own ``|value|`` (rounding), for a node output the larger of
    ``|value|`` and its inputs' reaches carried through the node's local
    derivatives, evaluated at the fp32 values.  Sums (MatMul, Gemm, Conv,
    reductions) carry reaches in the 2-norm: independent rounding errors do
    not line up with the weights' signs.  A gain well above 1 means the
    tensor is small next to the errors it inherits: cancellation.
    """
    reach = {name: np.abs(v).astype(np.float64) for name, v in values.items() if v.dtype == np.float32}
    gains: dict[str, float] = {}
    for node in model.graph.node:
        out = node.output[0]
        if out not in reach:  # a bool comparison
            continue
        if any(i in reach for i in node.input):  # not Constant, nor Cast of a bool
            through = _carry(node, [values.get(i) for i in node.input], [reach.get(i) for i in node.input],
                             values[out])
            reach[out] = np.maximum(reach[out], through)
        peak, size = float(reach[out].max()), float(np.abs(values[out]).max())
        gains[out] = peak / size if size else (1.0 if peak == 0 else math.inf)
    return gains


def _attr(node: onnx.NodeProto, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _carry(node: onnx.NodeProto, x: list, r: list, y: np.ndarray) -> np.ndarray:
    """Reach of ``node``'s output carried from its inputs' reaches ``r`` (values ``x``, output ``y``)."""
    op = node.op_type

    def rms_matmul(a, b):  # sqrt(a^2 @ b^2): a sum of independent errors
        return np.sqrt(np.square(a) @ np.square(b))

    if op in ("MatMul", "Gemm"):
        w, rw = (x[1].T, r[1].T) if _attr(node, "transB", 0) else (x[1], r[1])
        carried = np.maximum(rms_matmul(r[0], w), rms_matmul(x[0], rw))
        return np.maximum(carried, r[2]) if len(r) > 2 else carried
    if op == "Conv":  # [B, 1, W] with a [1, 1, 3] kernel, pads 1
        def conv(a, k):
            padded = np.pad(a, ((0, 0), (0, 0), (1, 1)))
            return sum(np.square(padded[..., i:i + a.shape[-1]]) * k[0, 0, i] ** 2 for i in range(3))
        return np.sqrt(np.maximum(conv(r[0], x[1]), conv(x[0], r[1])))
    if op in ("Add", "Sub", "Max", "Min", "Where"):
        return np.maximum.reduce(np.broadcast_arrays(*[a for a in r if a is not None]))
    if op == "Mul":
        return np.maximum(np.abs(x[1]) * r[0], np.abs(x[0]) * r[1])
    if op == "Div":
        return np.maximum(r[0] / np.abs(x[1]), np.abs(x[0]) / np.square(x[1]) * r[1])
    if op == "Softmax":  # d s_i = s_i (d x_i - sum_j s_j d x_j)
        return 2 * np.abs(y) * r[0].max(axis=-1, keepdims=True)
    if op == "LayerNormalization":  # dz_i = (dx_i - mean(dx) - z_i mean(z dx)) / std
        std = np.sqrt(x[0].var(axis=-1, keepdims=True) + _attr(node, "epsilon", 1e-5))
        z = (x[0] - x[0].mean(axis=-1, keepdims=True)) / std
        means = np.sqrt(np.square(r[0]).mean(axis=-1, keepdims=True) / r[0].shape[-1])  # both means
        spread = (r[0] + (1 + np.abs(z)) * means) / std
        return np.maximum.reduce([np.abs(x[1]) * spread, np.abs(z) * r[1], np.broadcast_to(r[2], y.shape)])
    if op in ("ReduceSum", "ReduceMean"):
        total = np.sqrt(np.square(r[0]).sum(axis=-1, keepdims=True))
        return total / r[0].shape[-1] if op == "ReduceMean" else total
    if op in _SLOPE:
        return np.abs(_SLOPE[op](x[0], y)) * r[0]
    if op == "Transpose":
        return r[0].T
    if op == "Reshape":
        return r[0].reshape(y.shape)
    if op == "Concat":
        return np.concatenate(r, axis=_attr(node, "axis"))
    if op == "Slice":
        start, end, axis = int(x[1][0]), int(x[2][0]), int(x[3][0])
        return np.take(r[0], np.arange(start, end), axis=axis)
    return r[0]  # Relu, Abs, Neg, Identity: slope at most 1


# |f'(x)| of elementwise ops, from input x and output y.
_SLOPE = {
    "Sigmoid": lambda x, y: y * (1 - y),
    "Tanh": lambda x, y: 1 - y * y,
    "Erf": lambda x, y: 2 / np.sqrt(np.pi) * np.exp(-x * x),
    "Sin": lambda x, y: np.cos(x),
    "Exp": lambda x, y: y,
    "Log": lambda x, y: 1 / x,
    "Sqrt": lambda x, y: 0.5 / y,
    "Pow": lambda x, y: 2 * x,  # the generator only squares
}


def depths(model: onnx.ModelProto) -> dict[str, int]:
    """Per graph output: the number of nodes on the longest path from a graph input to it."""
    depth = {i.name: 0 for i in model.graph.input}
    for node in model.graph.node:  # built in topological order
        depth.update({o: 1 + max((depth.get(i, 0) for i in node.input), default=0) for o in node.output})
    return {o.name: depth[o.name] for o in model.graph.output}


@st.composite
def random_graphs(draw, max_blocks: int = 10) -> RandomGraph:
    graph = build(HypothesisChoices(draw), max_blocks)
    assume(graph is not None)
    return graph


def random_graph(rng: random.Random, max_blocks: int = 10, attempts: int = 100) -> tuple[RandomGraph, int]:
    """A graph from a plain RNG, and how many out-of-range graphs were skipped first."""
    for skipped in range(attempts):
        graph = build(RandomChoices(rng), max_blocks)
        if graph is not None:
            return graph, skipped
    raise RuntimeError(f"{attempts} random graphs in a row were out of range; the generator drifted")
