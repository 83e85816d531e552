"""Gradients of the activation zoo: Softplus, Softsign, LeakyRelu, PRelu, Elu, Selu, Celu,
ThresholdedRelu, HardSigmoid, HardSwish, Mish, Gelu (opset 20, both approximations) and
com.microsoft Gelu, FastGelu and BiasGelu (which plain onnxruntime registers on CPU and CUDA).
At the kinks, torch's choice (HardSwish's derivative at +-3, LeakyRelu's at 0...)."""
from __future__ import annotations

import math

from onnx import TensorProto

from onnxmp.training.build.autodiff.context import Vjp

BOOL = TensorProto.BOOL
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_CUBIC = 0.044715


def _positive(c: Vjp, x: str, threshold: float = 0.0) -> str:
    return c.op("Greater", x, c.scalar(threshold, x), elem=BOOL)


def softplus(c: Vjp) -> None:
    c.set(0, c.op("Mul", c.dy(), c.op("Sigmoid", c.x(0))))


def softsign(c: Vjp) -> None:
    x = c.x(0)
    denominator = c.op("Add", c.scalar(1.0, x), c.op("Abs", x))
    c.set(0, c.op("Div", c.dy(), c.op("Mul", denominator, denominator)))


def leaky_relu(c: Vjp) -> None:
    x, dy = c.x(0), c.dy()
    alpha = float(c.attr("alpha", 0.01))
    c.set(0, c.op("Where", _positive(c, x), dy, c.op("Mul", dy, c.scalar(alpha, x))))


def prelu(c: Vjp) -> None:
    x, slope, dy = c.x(0), c.x(1), c.dy()
    positive = _positive(c, x)
    zero = c.scalar(0.0, x)
    if c.needs(0):
        c.set(0, c.op("Where", positive, dy, c.op("Mul", dy, slope)))
    if c.needs(1):
        c.set(1, c.unbroadcast(c.op("Where", positive, zero, c.op("Mul", dy, x)), slope, c.y(0)))


def elu(c: Vjp) -> None:
    x, y, dy = c.x(0), c.y(0), c.dy()
    alpha = float(c.attr("alpha", 1.0))
    c.set(0, c.op("Where", _positive(c, x), dy, c.op("Mul", dy, c.op("Add", y, c.scalar(alpha, y)))))


def selu(c: Vjp) -> None:
    x, y, dy = c.x(0), c.y(0), c.dy()
    alpha = float(c.attr("alpha", 1.67326319217681884765625))
    gamma = float(c.attr("gamma", 1.05070102214813232421875))
    negative = c.op("Mul", dy, c.op("Add", y, c.scalar(gamma * alpha, y)))
    c.set(0, c.op("Where", _positive(c, x), c.op("Mul", dy, c.scalar(gamma, x)), negative))


def celu(c: Vjp) -> None:
    x, y, dy = c.x(0), c.y(0), c.dy()
    alpha = float(c.attr("alpha", 1.0))
    slope = c.op("Add", c.op("Mul", y, c.scalar(1.0 / alpha, y)), c.scalar(1.0, y))  # exp(x / alpha)
    c.set(0, c.op("Where", _positive(c, x), dy, c.op("Mul", dy, slope)))


def thresholded_relu(c: Vjp) -> None:
    x = c.x(0)
    c.set(0, c.op("Where", _positive(c, x, float(c.attr("alpha", 1.0))), c.dy(), c.scalar(0.0, x)))


def hard_sigmoid(c: Vjp) -> None:
    y, dy = c.y(0), c.dy()
    alpha = float(c.attr("alpha", 0.2))
    inside = c.op("And", _positive(c, y), c.op("Less", y, c.scalar(1.0, y), elem=BOOL), elem=BOOL)
    c.set(0, c.op("Where", inside, c.op("Mul", dy, c.scalar(alpha, y)), c.scalar(0.0, y)))


def hard_swish(c: Vjp) -> None:
    """torch's hardswish_backward: 0 below -3, x/3 + 1/2 up to 3 (inclusive), 1 above."""
    x, dy = c.x(0), c.dy()
    middle = c.op("Mul", dy, c.op("Add", c.op("Mul", x, c.scalar(1.0 / 3.0, x)), c.scalar(0.5, x)))
    upper = c.op("Where", c.op("LessOrEqual", x, c.scalar(3.0, x), elem=BOOL), middle, dy)
    c.set(0, c.op("Where", c.op("Less", x, c.scalar(-3.0, x), elem=BOOL), c.scalar(0.0, x), upper))


def mish(c: Vjp) -> None:
    x, dy = c.x(0), c.dy()
    t = c.op("Tanh", c.op("Softplus", x))
    sech2 = c.op("Sub", c.scalar(1.0, x), c.op("Mul", t, t))
    slope = c.op("Add", t, c.op("Mul", c.op("Mul", x, c.op("Sigmoid", x)), sech2))
    c.set(0, c.op("Mul", dy, slope))


def _gelu_erf_slope(c: Vjp, x: str) -> str:
    """d/dx x * Phi(x) = Phi(x) + x * phi(x)."""
    cdf = c.op("Mul", c.op("Add", c.op("Erf", c.op("Mul", x, c.scalar(1.0 / math.sqrt(2.0), x))),
                           c.scalar(1.0, x)), c.scalar(0.5, x))
    pdf = c.op("Mul", c.op("Exp", c.op("Mul", c.op("Mul", x, x), c.scalar(-0.5, x))), c.scalar(_INV_SQRT_2PI, x))
    return c.op("Add", cdf, c.op("Mul", x, pdf))


def _gelu_tanh_slope(c: Vjp, x: str) -> str:
    """d/dx 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)."""
    x2 = c.op("Mul", x, x)
    u = c.op("Mul", c.op("Mul", x, c.op("Add", c.op("Mul", x2, c.scalar(_GELU_CUBIC, x)), c.scalar(1.0, x))),
             c.scalar(_SQRT_2_OVER_PI, x))
    t = c.op("Tanh", u)
    du = c.op("Mul", c.op("Add", c.op("Mul", x2, c.scalar(3 * _GELU_CUBIC, x)), c.scalar(1.0, x)),
              c.scalar(_SQRT_2_OVER_PI, x))
    half_x = c.op("Mul", x, c.scalar(0.5, x))
    sech2 = c.op("Sub", c.scalar(1.0, x), c.op("Mul", t, t))
    return c.op("Add", c.op("Mul", c.op("Add", t, c.scalar(1.0, x)), c.scalar(0.5, x)),
                c.op("Mul", half_x, c.op("Mul", sech2, du)))


def gelu(c: Vjp) -> None:
    x = c.x(0)
    slope = _gelu_tanh_slope(c, x) if c.attr("approximate", "none") == "tanh" else _gelu_erf_slope(c, x)
    c.set(0, c.op("Mul", c.dy(), slope))


def _biased(c: Vjp, slope_of) -> None:
    """com.microsoft FastGelu / BiasGelu: gelu(x + bias), bias optional."""
    x, bias, dy = c.x(0), c.x(1), c.dy()
    z = c.op("Add", x, bias) if bias else x
    full = c.op("Mul", dy, slope_of(c, z))
    if c.needs(0):
        c.set(0, full)
    if c.needs(1):
        c.set(1, c.unbroadcast(full, bias, c.y(0)))


def ms_gelu(c: Vjp) -> None:
    c.set(0, c.op("Mul", c.dy(), _gelu_erf_slope(c, c.x(0))))


def fast_gelu(c: Vjp) -> None:
    _biased(c, _gelu_tanh_slope)


def bias_gelu(c: Vjp) -> None:
    _biased(c, _gelu_erf_slope)


RULES = {
    "Softplus": softplus, "Softsign": softsign, "LeakyRelu": leaky_relu, "PRelu": prelu, "Elu": elu,
    "Selu": selu, "Celu": celu, "ThresholdedRelu": thresholded_relu, "HardSigmoid": hard_sigmoid,
    "HardSwish": hard_swish, "Mish": mish, "Gelu": gelu,
}
MS_RULES = {"Gelu": ms_gelu, "FastGelu": fast_gelu, "BiasGelu": bias_gelu}
