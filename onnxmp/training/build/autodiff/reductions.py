"""Gradients of the reductions: ReduceSum/Mean/Max/Min/SumSquare/L2/LogSumExp, CumSum, and the
global poolings (a reduction over the spatial axes).

The reduced gradient is broadcast back with ``Expand`` to a shape of 1s except on the reduced
axes, a constant whenever those axes' extents are static (the kept axes need no shape at all)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxmp.training.build.autodiff.context import Vjp, normalize_axes

INT64 = TensorProto.INT64


def _axes(c: Vjp, rank: int) -> list[int] | None:
    """The reduced axes (normalized), [] for a no-op, None when computed at run time."""
    uses_input = c.info.opset >= (13 if c.node.op_type == "ReduceSum" else 18)
    if uses_input and c.x(1):
        axes = c.const_ints(c.x(1))
        if axes is None:
            c.fail("its axes are computed", "export the reduction with constant axes")
    else:
        axes = [] if uses_input else (c.attr("axes") or [])
    if not axes:
        return [] if uses_input and c.attr("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(normalize_axes(axes, rank))


def _kept(c: Vjp, grad: str, axes: list[int]) -> str:
    """The output's gradient with the reduced axes kept (as 1s); a reduction of every axis to a
    scalar needs no Unsqueeze: the scalar broadcasts against the input as the 1s would."""
    if c.attr("keepdims", 1) or len(axes) == c.rank(c.x(0)):
        return grad
    return c.unsqueeze(grad, axes)


def _expanded(c: Vjp, grad: str, x: str, axes: list[int]) -> str:
    shape = c.shape(x)
    dims = [shape[a] for a in axes]
    if all(isinstance(d, int) for d in dims):
        target = [shape[a] if a in axes else 1 for a in range(len(shape))]
        return c.op("Expand", grad, c.ints(target))
    c.runtime(f"extents of the reduced axes of {x}")
    return c.op("Expand", grad, c.op("Shape", x, elem=INT64))


def _count(c: Vjp, x: str, axes: list[int], like: str) -> str:
    """1 / (number of elements reduced), a constant when static."""
    shape = c.shape(x)
    dims = [shape[a] for a in axes]
    if all(isinstance(d, int) for d in dims):
        return c.scalar(1.0 / max(int(np.prod(dims)), 1), like)
    c.runtime(f"element count of the reduced axes of {x}")
    n = c.op("Div", c.op("Size", x, elem=INT64), c.op("Size", c.y(0), elem=INT64), elem=INT64)
    return c.op("Reciprocal", c.cast(n, c.elem(like)))


def reduce_sum(c: Vjp) -> None:
    x = c.x(0)
    axes = _axes(c, c.rank(x))
    if not axes:
        c.set(0, c.dy())
        return
    c.set(0, _expanded(c, _kept(c, c.dy(), axes), x, axes))


def reduce_mean(c: Vjp) -> None:
    x = c.x(0)
    axes = _axes(c, c.rank(x))
    if not axes:
        c.set(0, c.dy())
        return
    c.set(0, _spread_mean(c, _kept(c, c.dy(), axes), x, axes))


# Elements of the constant a mean's gradient broadcasts against (its reduced extents, 1/count each).
SPREAD_LIMIT = 1 << 16


def _spread_mean(c: Vjp, grad: str, x: str, axes: list[int]) -> str:
    """A mean's gradient (``grad`` with the reduced axes kept as 1s) spread over ``x``: with static
    reduced extents, one Mul by a constant of those extents filled with 1/count, which broadcasts as
    the Expand would (the same products, one node where the Mul and Expand were two)."""
    shape = c.shape(x)
    dims = [shape[a] for a in axes]
    if all(isinstance(d, int) for d in dims) and int(np.prod(dims)) <= SPREAD_LIMIT:
        extents = [shape[a] if a in axes else 1 for a in range(len(shape))]
        scale = 1.0 / max(int(np.prod(dims)), 1)
        elem = c.elem(grad)
        fill = np.full(extents, scale, np.float32 if elem == TensorProto.BFLOAT16 else np.float64)
        return c.op("Mul", grad, c.emit.constant(fill, "mean_scale", elem=elem))
    return _expanded(c, c.op("Mul", grad, _count(c, x, axes, grad)), x, axes)


def _extreme(c: Vjp) -> None:
    """torch's amax/amin: the gradient split evenly between the elements that equal the result."""
    x = c.x(0)
    axes = _axes(c, c.rank(x))
    if not axes:
        c.set(0, c.dy())
        return
    y, dy = _kept(c, c.y(0), axes), _kept(c, c.dy(), axes)
    hit = c.op("Equal", x, y, elem=TensorProto.BOOL)
    count = c.reduce("ReduceSum", c.cast(hit, c.elem(x)), axes, 1)
    c.set(0, c.op("Where", hit, c.op("Div", dy, count), c.scalar(0.0, x)))


def reduce_sum_square(c: Vjp) -> None:
    x = c.x(0)
    axes = _axes(c, c.rank(x))
    twice = c.op("Mul", c.op("Mul", _kept(c, c.dy(), axes), c.scalar(2.0, x)), x) if axes else None
    c.set(0, twice if axes else c.op("Mul", c.op("Mul", c.dy(), c.scalar(2.0, x)), x))


def reduce_l2(c: Vjp) -> None:
    x = c.x(0)
    axes = _axes(c, c.rank(x))
    y, dy = (_kept(c, c.y(0), axes), _kept(c, c.dy(), axes)) if axes else (c.y(0), c.dy())
    c.set(0, c.op("Mul", c.op("Div", dy, y), x))


def reduce_log_sum_exp(c: Vjp) -> None:
    x = c.x(0)
    axes = _axes(c, c.rank(x))
    y, dy = (_kept(c, c.y(0), axes), _kept(c, c.dy(), axes)) if axes else (c.y(0), c.dy())
    c.set(0, c.op("Mul", dy, c.op("Exp", c.op("Sub", x, y))))


def cumsum(c: Vjp) -> None:
    exclusive, reverse = int(c.attr("exclusive", 0)), int(c.attr("reverse", 0))
    c.set(0, c.op("CumSum", c.dy(), c.x(1), exclusive=exclusive or None, reverse=1 - reverse or None))


def global_average_pool(c: Vjp) -> None:
    x = c.x(0)
    axes = list(range(2, c.rank(x)))
    c.set(0, _spread_mean(c, c.dy(), x, axes))


def global_max_pool(c: Vjp) -> None:
    x = c.x(0)
    axes = list(range(2, c.rank(x)))
    hit = c.op("Equal", x, c.y(0), elem=TensorProto.BOOL)
    count = c.reduce("ReduceSum", c.cast(hit, c.elem(x)), axes, 1)
    c.set(0, c.op("Where", hit, c.op("Div", c.dy(), count), c.scalar(0.0, x)))


RULES = {
    "ReduceSum": reduce_sum, "ReduceMean": reduce_mean, "ReduceMax": _extreme, "ReduceMin": _extreme,
    "ReduceSumSquare": reduce_sum_square, "ReduceL2": reduce_l2, "ReduceLogSumExp": reduce_log_sum_exp,
    "CumSum": cumsum, "GlobalAveragePool": global_average_pool, "GlobalMaxPool": global_max_pool,
}
