"""Lowerings of ORT's elementwise gradient ops (``training_ops/cpu/activation``, ``math``): each is
``dX = dY * f'(X)`` in float32, rounded once to dY's type as ORT's CUDA kernels do."""
from __future__ import annotations

import math

from onnx import TensorProto

from onnxmp.training.build.lower._emit import Emit


def _dy_times(e: Emit, derivative: str) -> None:
    dy = e.input(0)
    e.result(e.op("Mul", [e.wide(dy), derivative]), e.dtype(dy), e.output(0))


def gelu_grad(e: Emit) -> None:
    """GeluGrad(dY, X): dY * (Phi(x) + x * phi(x)), the exact (erf) GELU."""
    _dy_times(e, _gelu_derivative(e, e.wide(e.input(1))))


def bias_gelu_grad_dx(e: Emit) -> None:
    """BiasGeluGrad_dX(dY, X, B): GeluGrad at X + B (B broadcast over the last axis)."""
    _dy_times(e, _gelu_derivative(e, e.op("Add", [e.wide(e.input(1)), e.wide(e.input(2))])))


def _gelu_derivative(e: Emit, x: str) -> str:
    cdf = e.op("Mul", [e.scalar(0.5), e.op("Add", [e.scalar(1.0), e.op("Erf", [
        e.op("Mul", [x, e.scalar(math.sqrt(0.5))])])])])
    pdf = e.op("Mul", [e.scalar(1 / math.sqrt(2 * math.pi)),
                       e.op("Exp", [e.op("Mul", [e.scalar(-0.5), e.op("Mul", [x, x])])])])
    return e.op("Add", [cdf, e.op("Mul", [x, pdf])])


_FAST_K = math.sqrt(2 / math.pi)
_FAST_A = 0.044715


def fast_gelu_grad(e: Emit) -> None:
    """FastGeluGrad(dY, X): derivative of 0.5 x (1 + tanh(k (x + a x^3))), k = sqrt(2/pi), a = 0.044715."""
    x = e.wide(e.input(1))
    x2 = e.op("Mul", [x, x])
    inner = e.op("Mul", [e.op("Mul", [x, e.op("Add", [e.scalar(1.0), e.op("Mul", [e.scalar(_FAST_A), x2])])]),
                         e.scalar(_FAST_K)])
    t = e.op("Tanh", [inner])
    d_inner = e.op("Mul", [e.scalar(_FAST_K), e.op("Add", [e.scalar(1.0), e.op("Mul", [e.scalar(3 * _FAST_A), x2])])])
    one_minus_t2 = e.op("Sub", [e.scalar(1.0), e.op("Mul", [t, t])])
    derivative = e.op("Mul", [e.scalar(0.5), e.op("Add", [e.op("Add", [e.scalar(1.0), t]),
                                                         e.op("Mul", [e.op("Mul", [x, one_minus_t2]), d_inner])])])
    _dy_times(e, derivative)


def quick_gelu_grad(e: Emit) -> None:
    """QuickGeluGrad(dY, X; alpha=1.702): derivative of x * sigmoid(alpha x)."""
    x = e.wide(e.input(1))
    alpha = float(e.attr("alpha", 1.702))
    s = e.op("Sigmoid", [e.op("Mul", [x, e.scalar(alpha)])])
    derivative = e.op("Mul", [s, e.op("Add", [e.scalar(1.0), e.op("Mul", [
        e.op("Mul", [x, e.scalar(alpha)]), e.op("Sub", [e.scalar(1.0), s])])])])
    _dy_times(e, derivative)


def tanh_grad(e: Emit) -> None:
    """TanhGrad(dY, Y): dY * (1 - Y^2), Y the Tanh's output."""
    y = e.wide(e.input(1))
    _dy_times(e, e.op("Sub", [e.scalar(1.0), e.op("Mul", [y, y])]))


def sigmoid_grad(e: Emit) -> None:
    """SigmoidGrad(dY, Y): dY * Y * (1 - Y), Y the Sigmoid's output."""
    y = e.wide(e.input(1))
    _dy_times(e, e.op("Mul", [y, e.op("Sub", [e.scalar(1.0), y])]))


def relu_grad(e: Emit) -> None:
    """ReluGrad(dY, X): dY where X > 0, else 0 (X is the Relu's input or output: same sign)."""
    dy, x = e.input(0), e.input(1)
    # A select, not a product: a non-finite dY where X <= 0 gives 0, as ORT's kernel does.
    positive = e.op("Greater", [e.wide(x), e.scalar(0.0)])
    e.result(e.op("Where", [positive, e.wide(dy), e.scalar(0.0)]), e.dtype(dy), e.output(0))


def softmax_grad_13(e: Emit) -> None:
    """SoftmaxGrad_13(dY, Y; axis=-1): Y * (dY - sum(dY * Y, axis)), the sum along ``axis`` only."""
    _softmax_grad(e, e.ints([e.attr("axis", -1)]), log=False)


def log_softmax_grad_13(e: Emit) -> None:
    """LogSoftmaxGrad_13(dY, Y; axis=-1): dY - exp(Y) * sum(dY, axis), Y the LogSoftmax's output."""
    _softmax_grad(e, e.ints([e.attr("axis", -1)]), log=True)


def softmax_grad(e: Emit) -> None:
    """SoftmaxGrad(dY, Y; axis=1), opset < 13 semantics: the sum runs over every axis from ``axis`` on."""
    _softmax_grad(e, _axes_from(e, e.attr("axis", 1), e.input(1)), log=False)


def log_softmax_grad(e: Emit) -> None:
    """LogSoftmaxGrad(dY, Y; axis=1), opset < 13 semantics (the axes from ``axis`` on)."""
    _softmax_grad(e, _axes_from(e, e.attr("axis", 1), e.input(1)), log=True)


def _axes_from(e: Emit, axis: int, like: str) -> str:
    rank = e.rank(like)
    start = e.ints([axis]) if axis >= 0 else e.op("Add", [rank, e.ints([axis])])
    return e.op("Range", [e.op("Squeeze", [start]), e.op("Squeeze", [rank]), e.ints(1)])


def _softmax_grad(e: Emit, axes: str, log: bool) -> None:
    dy, y = e.wide(e.input(0)), e.wide(e.input(1))
    if log:
        dx = e.op("Sub", [dy, e.op("Mul", [e.op("Exp", [y]), e.sum(dy, axes)])])
    else:
        dx = e.op("Mul", [y, e.op("Sub", [dy, e.sum(e.op("Mul", [dy, y]), axes)])])
    e.result(dx, e.dtype(e.input(0)), e.output(0))


def scale(e: Emit) -> None:
    """Scale(X, scale; scale_down=0): X * scale, or X / scale with scale_down (ORT's kernel
    multiplies by the reciprocal, computed in float)."""
    x = e.input(0)
    factor = e.input(1)  # float, double or an integer type (ORT's ScaleT)
    if e.dtype(factor) != TensorProto.FLOAT:
        factor = e.cast(factor, TensorProto.FLOAT)
    s = e.op("Reshape", [factor, e.ints([])])
    if e.attr("scale_down", 0):
        s = e.op("Reciprocal", [s])
    e.result(e.op("Mul", [e.wide(x), s]), e.dtype(x), e.output(0))


def div_grad(e: Emit) -> None:
    """DivGrad(dY, A, B) -> dA = dY / B, dB = -dY * A / B^2, each summed back over the axes
    its input was broadcast along (ORT's kernel does the same reduction)."""
    from onnxmp.training.build.lower.shapes import sum_to

    dy, a, b = e.wide(e.input(0)), e.wide(e.input(1)), e.wide(e.input(2))
    shape_a, shape_b = e.op("Shape", [e.input(1)]), e.op("Shape", [e.input(2)])
    if e.output(0):
        da = e.op("Div", [dy, b])
        e.result(sum_to(e, da, shape_a, shape_b), e.dtype(e.input(1)), e.output(0))
    if e.output(1):
        db = e.op("Neg", [e.op("Div", [e.op("Div", [e.op("Mul", [dy, a]), b]), b])])
        e.result(sum_to(e, db, shape_b, shape_a), e.dtype(e.input(2)), e.output(1))


def dropout_grad(e: Emit) -> None:
    """DropoutGrad(dY, mask[, ratio=0.5, training_mode]): mask * dY / (1 - ratio), or dY itself
    when ratio is 0.  ORT's kernel ignores training_mode (in eval mode Dropout's mask is all true)
    and multiplies by the mask, so a non-finite dY where the mask is false stays NaN."""
    dy, mask, ratio = e.input(0), e.input(1), e.input(2)
    if ratio:  # float16, float or double (ORT's T1)
        ratio = e.op("Reshape", [ratio if e.dtype(ratio) == TensorProto.FLOAT else e.cast(ratio, TensorProto.FLOAT),
                                 e.ints([])])
    else:
        ratio = e.scalar(0.5)
    grad = e.wide(dy)
    dropped = e.op("Div", [e.op("Mul", [e.cast(mask, TensorProto.FLOAT), grad]),
                           e.op("Sub", [e.scalar(1.0), ratio])])
    none = e.op("Equal", [ratio, e.scalar(0.0)])
    e.result(e.op("Where", [none, grad, dropped]), e.dtype(dy), e.output(0))
