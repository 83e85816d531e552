"""Gradients of the elementwise ops: arithmetic with broadcasting, unary math, Where, Max/Min,
Clip, Cast, Identity, Dropout.  Each rule computes in the type of the tensor it differentiates."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxmp.training.build.autodiff.context import Vjp

BOOL = TensorProto.BOOL
# Where a mask's gradient is multiplied by the mask rather than picked by Where: onnxruntime's CPU
# Where is about 5x slower than Cast+Mul (131k float32: 600 us against 100 us, 1.19 and 1.32)
_MASK_BY_MUL = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE})


def masked(c: Vjp, mask: str, dy: str) -> str:
    """``dy`` where ``mask`` holds, else 0.  In float32/64, ``dy * Cast(mask)``: equal for finite
    ``dy`` (a -0.0 where dy < 0 is masked), while a non-finite ``dy`` at a masked position gives NaN
    instead of 0.  In float16/bfloat16 (loss-scaled, where an overflowed upstream gradient that the
    mask drops must stay dropped, as in ORT's kernels, for the finite check to decide as ORT's does)
    and other types, Where."""
    elem = c.elem(dy)
    if elem in _MASK_BY_MUL:
        return c.op("Mul", dy, c.cast(mask, elem))
    return c.op("Where", mask, dy, c.scalar(0.0, dy))


def _each(c: Vjp, full) -> None:
    """Give each needed input ``full(i)`` (shaped like the output) summed back to its shape."""
    for i in range(len(c.node.input)):
        if c.needs(i):
            c.set(i, c.unbroadcast(full(i), c.x(i), c.y(0)))


def add(c: Vjp) -> None:
    _each(c, lambda i: c.dy())


def sub(c: Vjp) -> None:
    if c.needs(0):
        c.set(0, c.unbroadcast(c.dy(), c.x(0), c.y(0)))
    if c.needs(1):
        c.set(1, c.op("Neg", c.unbroadcast(c.dy(), c.x(1), c.y(0))))


def mul(c: Vjp) -> None:
    _each(c, lambda i: c.op("Mul", c.dy(), c.x(1 - i)))


def div(c: Vjp) -> None:
    scaled = c.op("Div", c.dy(), c.x(1))
    if c.needs(0):
        c.set(0, c.unbroadcast(scaled, c.x(0), c.y(0)))
    if c.needs(1):
        c.set(1, c.op("Neg", c.unbroadcast(c.op("Mul", scaled, c.y(0)), c.x(1), c.y(0))))


def pow_(c: Vjp) -> None:
    x, e, y, dy = c.x(0), c.x(1), c.y(0), c.dy()
    if c.needs(0):
        value = c.info.value(e)
        if value is not None and value.size == 1:
            k = float(value.ravel()[0])
            if k == 1.0:
                full = dy
            elif k == 2.0:
                full = c.op("Mul", dy, c.op("Mul", x, c.scalar(2.0, x)))
            elif k == 0.5:
                full = c.op("Div", c.op("Mul", dy, c.scalar(0.5, x)), y)
            else:
                full = c.op("Mul", dy, c.op("Mul", c.op("Pow", x, c.scalar(k - 1.0, e)), c.scalar(k, x)))
        else:
            exponent = c.cast(e, c.elem(x))
            power = c.op("Pow", x, c.op("Sub", e, c.scalar(1.0, e)))
            full = c.op("Mul", dy, c.op("Mul", power, exponent))
        c.set(0, c.unbroadcast(full, x, y))
    if c.needs(1):
        full = c.op("Mul", c.op("Mul", dy, y), c.op("Log", x))
        c.set(1, c.unbroadcast(c.cast(full, c.elem(e)), e, y))


def _unary(c: Vjp, grad: str) -> None:
    c.set(0, grad)


def neg(c: Vjp) -> None:
    _unary(c, c.op("Neg", c.dy()))


def identity(c: Vjp) -> None:
    _unary(c, c.dy())


def sqrt(c: Vjp) -> None:
    _unary(c, c.op("Div", c.op("Mul", c.dy(), c.scalar(0.5, c.y(0))), c.y(0)))


def exp(c: Vjp) -> None:
    _unary(c, c.op("Mul", c.dy(), c.y(0)))


def log(c: Vjp) -> None:
    _unary(c, c.op("Div", c.dy(), c.x(0)))


def tanh(c: Vjp) -> None:
    y = c.y(0)
    _unary(c, c.op("Mul", c.dy(), c.op("Sub", c.scalar(1.0, y), c.op("Mul", y, y))))


def sigmoid(c: Vjp) -> None:
    y = c.y(0)
    _unary(c, c.op("Mul", c.dy(), c.op("Mul", y, c.op("Sub", c.scalar(1.0, y), y))))


def relu(c: Vjp) -> None:
    y = c.y(0)
    if c.elem(y) in _MASK_BY_MUL:
        pooled = c.emit.pooled.get(c.dy())
        if pooled is not None:
            # Only a MaxPool reads y: each value its gradient scatters lands where its window's
            # maximum is, so the mask there is the sign of the pooled maximum.  Masked before the
            # scatter, the Sign and Mul run over the pooled extents (a quarter, stride 2), the same sums.
            grad, maxima, scatter = pooled
            _unary(c, scatter(c.op("Mul", grad, c.op("Sign", maxima))))
            return
        # y >= 0, so Sign(y) is the mask itself, 1 where x > 0 and 0 elsewhere: two nodes, not a
        # compare, a Cast and a Mul (the same numbers, with masked()'s non-finite-dy caveat)
        _unary(c, c.op("Mul", c.dy(), c.op("Sign", y)))
        return
    _unary(c, masked(c, c.op("Greater", y, c.scalar(0.0, y), elem=BOOL), c.dy()))


def erf(c: Vjp) -> None:
    x = c.x(0)
    gauss = c.op("Exp", c.op("Neg", c.op("Mul", x, x)))
    _unary(c, c.op("Mul", c.dy(), c.op("Mul", gauss, c.scalar(2.0 / np.sqrt(np.pi), x))))


def abs_(c: Vjp) -> None:
    _unary(c, c.op("Mul", c.dy(), c.op("Sign", c.x(0))))


def reciprocal(c: Vjp) -> None:
    y = c.y(0)
    _unary(c, c.op("Neg", c.op("Mul", c.dy(), c.op("Mul", y, y))))


def sin(c: Vjp) -> None:
    _unary(c, c.op("Mul", c.dy(), c.op("Cos", c.x(0))))


def cos(c: Vjp) -> None:
    _unary(c, c.op("Neg", c.op("Mul", c.dy(), c.op("Sin", c.x(0)))))


def cast(c: Vjp) -> None:
    _unary(c, c.cast(c.dy(), c.elem(c.x(0))))


def where(c: Vjp) -> None:
    cond, dy, y = c.x(0), c.dy(), c.y(0)
    zero = c.scalar(0.0, y)
    if c.needs(1):
        c.set(1, c.unbroadcast(c.op("Where", cond, dy, zero), c.x(1), y))
    if c.needs(2):
        c.set(2, c.unbroadcast(c.op("Where", cond, zero, dy), c.x(2), y))


def _extremum(c: Vjp, beats: str) -> None:
    """torch's subgradient of maximum/minimum: the gradient to the winning input, split evenly
    between inputs that tie (``beats`` is Greater for Max, Less for Min)."""
    inputs, y, dy = list(c.node.input), c.y(0), c.dy()
    if len(inputs) == 1:
        c.set(0, dy)
        return
    zero = c.scalar(0.0, y)
    if len(inputs) == 2:
        a, b = inputs
        tie = c.op("Equal", a, b, elem=BOOL)
        half = c.op("Mul", dy, c.scalar(0.5, y))
        for i, (mine, other) in enumerate(((a, b), (b, a))):
            if c.needs(i):
                wins = c.op(beats, mine, other, elem=BOOL)
                full = c.op("Where", tie, half, c.op("Where", wins, dy, zero))
                c.set(i, c.unbroadcast(full, mine, y))
        return
    hits = [c.op("Equal", x, y, elem=BOOL) for x in inputs]
    count = c.op("Sum", *[c.cast(h, c.elem(y)) for h in hits])
    share = c.op("Div", dy, count)
    for i, x in enumerate(inputs):
        if c.needs(i):
            c.set(i, c.unbroadcast(c.op("Where", hits[i], share, zero), x, y))


def max_(c: Vjp) -> None:
    _extremum(c, "Greater")


def min_(c: Vjp) -> None:
    _extremum(c, "Less")


def sum_(c: Vjp) -> None:
    _each(c, lambda i: c.dy())


def mean(c: Vjp) -> None:
    share = c.op("Mul", c.dy(), c.scalar(1.0 / len(c.node.input), c.y(0)))
    _each(c, lambda i: share)


def clip(c: Vjp) -> None:
    """torch.clamp's: the gradient where min <= x <= max (bounds get none, as in ORT); with both
    bounds constant, where the output equals the input."""
    x, dy = c.x(0), c.dy()
    if c.info.opset < 11:
        bounds = [(c.attr("min"), "GreaterOrEqual"), (c.attr("max"), "LessOrEqual")]
        values = [np.asarray(v) for v, _ in bounds if v is not None]
        bounds = [(c.scalar(v, x), op) for v, op in bounds if v is not None]
    else:
        bounds = [(c.x(i), op) for i, op in ((1, "GreaterOrEqual"), (2, "LessOrEqual")) if c.x(i)]
        values = [c.info.value(bound) for bound, _ in bounds]
    if not bounds:
        c.set(0, dy)
        return
    if (len(bounds) == 2 and c.elem(x) in _MASK_BY_MUL and all(v is not None and v.size == 1 for v in values)
            and values[0] <= values[1]):
        # min <= x <= max exactly where the output is x (NaN: neither): one Equal for two
        # comparisons and an And (ReLU6's gradient); with min > max the output is max everywhere
        # and the comparisons hold nowhere, so the shortcut needs the bounds' values
        mask = c.op("Equal", x, c.y(0), elem=BOOL)
    else:
        masks = [c.op(op, x, bound, elem=BOOL) for bound, op in bounds]
        mask = masks[0] if len(masks) == 1 else c.op("And", *masks, elem=BOOL)
    c.set(0, masked(c, mask, dy))


def dropout(c: Vjp) -> None:
    """The forward's own mask (added as its output when absent), scaled by 1 / (1 - ratio) in
    training mode; identity otherwise."""
    dy, x = c.dy(), c.x(0)
    if c.info.opset < 12:
        training = not c.attr("is_test", 0) if c.info.opset < 7 else False
        ratio = c.attr("ratio", 0.5)
    else:
        mode = c.x(2)
        value = c.info.value(mode) if mode else np.array(False)
        if value is None:
            c.fail("its training_mode is computed", "give Dropout a constant training_mode")
        training = bool(np.asarray(value).ravel()[0])
        ratio = c.info.value(c.x(1)) if c.x(1) else np.array(0.5)
        if ratio is None:
            c.fail("its ratio is computed", "give Dropout a constant ratio")
        ratio = float(np.asarray(ratio).ravel()[0])
    if not training or ratio == 0.0:
        c.set(0, dy)
        return
    mask = c.forward_output(1, "mask", BOOL, c.shape(x))
    kept = c.op("Where", mask, dy, c.scalar(0.0, x))
    c.set(0, c.op("Mul", kept, c.scalar(1.0 / (1.0 - ratio), x)))


RULES = {
    "Add": add, "Sub": sub, "Mul": mul, "Div": div, "Pow": pow_, "Neg": neg, "Identity": identity,
    "Sqrt": sqrt, "Exp": exp, "Log": log, "Tanh": tanh, "Sigmoid": sigmoid, "Relu": relu, "Erf": erf,
    "Abs": abs_, "Reciprocal": reciprocal, "Sin": sin, "Cos": cos, "Cast": cast, "Where": where,
    "Max": max_, "Min": min_, "Sum": sum_, "Mean": mean, "Clip": clip, "Dropout": dropout,
}
# Zero almost everywhere (torch's gradient of these is zeros): no path goes through them.
ZERO = ("Sign", "Floor", "Ceil", "Round")
