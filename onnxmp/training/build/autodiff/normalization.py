"""Gradients of the normalizations and softmaxes: LayerNormalization (reusing the forward's
Mean and InvStdDev outputs), BatchNormalization (training mode: batch statistics; inference
mode: the running ones), InstanceNormalization, GroupNormalization, Softmax and LogSoftmax.

Low-precision normalizations compute their gradient in float32 (as onnxruntime's kernels do
inside) and round the results to the forward's types."""
from __future__ import annotations

from onnx import TensorProto

from onnxmp.training.build.autodiff.context import Vjp, normalize_axes

FLOAT = TensorProto.FLOAT
LOW = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})


def _work(c: Vjp, x: str) -> int:
    elem = c.elem(x)
    return FLOAT if elem in LOW else elem


def _dx(c: Vjp, g: str, xhat: str, inv: str, axes: list[int]) -> str:
    """inv * (g - mean(g) - xhat * mean(g * xhat)) over ``axes``: the gradient through the
    normalization of ``xhat`` = (x - mean) * inv, for the gradient ``g`` of ``xhat``."""
    m1 = c.reduce("ReduceMean", g, axes, 1)
    m2 = c.reduce("ReduceMean", c.op("Mul", g, xhat), axes, 1)
    return c.op("Mul", c.op("Sub", c.op("Sub", g, m1), c.op("Mul", xhat, m2)), inv)


def layer_normalization(c: Vjp) -> None:
    x, scale, bias, dy = c.x(0), c.x(1), c.x(2), c.dy()
    shape = c.shape(x)
    if shape is None:
        c.fail(f"the rank of {x!r} is unknown", "export the model with static ranks")
    rank = len(shape)
    axis = normalize_axes([c.attr("axis", -1)], rank)[0]
    stash = int(c.attr("stash_type", 1))
    stats = tuple(shape[:axis]) + (1,) * (rank - axis)
    mean = c.forward_output(1, "Mean", stash, stats)
    inv = c.forward_output(2, "InvStdDev", stash, stats)
    work = _work(c, x)
    xw, dyw = c.cast(x, work), c.cast(dy, work)
    mean, inv = c.cast(mean, work), c.cast(inv, work)
    xhat = c.op("Mul", c.op("Sub", xw, mean), inv)
    lead = list(range(axis))
    normalized = tuple(shape[axis:])

    def over_lead(t: str, target: str) -> str:
        total = c.reduce("ReduceSum", t, lead, 0) if lead else t
        return c.cast(c.unbroadcast(total, target, None, like_shape=normalized), c.elem(target))

    if c.needs(2):
        c.set(2, over_lead(dyw, bias))
    if c.needs(1):
        c.set(1, over_lead(c.op("Mul", dyw, xhat), scale))
    if c.needs(0):
        g = c.op("Mul", dyw, c.cast(scale, work))
        c.set(0, c.cast(_dx(c, g, xhat, inv, list(range(axis, rank))), c.elem(x)))


def _channel(c: Vjp, t: str, rank: int) -> str:
    """A per-channel [C] tensor shaped to broadcast over [N, C, ...]."""
    return c.unsqueeze(t, list(range(1, rank - 1))) if rank > 2 else t


def _affine_grads(c: Vjp, dyw: str, xhat: str, axes: list[int], rank: int, work: int) -> str | None:
    """The per-channel bias (input 2) and scale (input 1) gradients of ``y = scale * xhat + bias``
    over [N, C, ...], summed over ``axes``; returns dy * scale (what dx is made of) when input 0
    wants a gradient, else None."""
    if c.needs(2):
        c.set(2, c.cast(c.reduce("ReduceSum", dyw, axes, 0), c.elem(c.x(2))))
    if c.needs(1):
        c.set(1, c.cast(c.reduce("ReduceSum", c.op("Mul", dyw, xhat), axes, 0), c.elem(c.x(1))))
    if not c.needs(0):
        return None
    return c.op("Mul", dyw, _channel(c, c.cast(c.x(1), work), rank))


def batch_normalization(c: Vjp) -> None:
    x, dy = c.x(0), c.dy()
    rank = c.rank(x)
    eps = float(c.attr("epsilon", 1e-5))
    training = bool(c.attr("training_mode", 0)) or (c.info.opset < 14 and len([o for o in c.node.output if o]) > 1)
    axes = [0, *range(2, rank)]
    work = _work(c, x)
    xw, dyw = c.cast(x, work), c.cast(dy, work)
    if training:
        mean = c.reduce("ReduceMean", xw, axes, 1)
        centered = c.op("Sub", xw, mean)
        var = c.reduce("ReduceMean", c.op("Mul", centered, centered), axes, 1)
    else:
        mean = _channel(c, c.cast(c.x(3), work), rank)
        centered = c.op("Sub", xw, mean)
        var = _channel(c, c.cast(c.x(4), work), rank)
    inv = c.op("Reciprocal", c.op("Sqrt", c.op("Add", var, c.scalar(eps, var))))
    xhat = c.op("Mul", centered, inv)
    g = _affine_grads(c, dyw, xhat, axes, rank, work)
    if g:
        dx = _dx(c, g, xhat, inv, axes) if training else c.op("Mul", g, inv)
        c.set(0, c.cast(dx, c.elem(x)))


def instance_normalization(c: Vjp) -> None:
    x, dy = c.x(0), c.dy()
    rank = c.rank(x)
    eps = float(c.attr("epsilon", 1e-5))
    spatial = list(range(2, rank))
    work = _work(c, x)
    xw, dyw = c.cast(x, work), c.cast(dy, work)
    mean = c.reduce("ReduceMean", xw, spatial, 1)
    centered = c.op("Sub", xw, mean)
    var = c.reduce("ReduceMean", c.op("Mul", centered, centered), spatial, 1)
    inv = c.op("Reciprocal", c.op("Sqrt", c.op("Add", var, c.scalar(eps, var))))
    xhat = c.op("Mul", centered, inv)
    g = _affine_grads(c, dyw, xhat, [0, *spatial], rank, work)
    if g:
        c.set(0, c.cast(_dx(c, g, xhat, inv, spatial), c.elem(x)))


def group_normalization(c: Vjp) -> None:
    """GroupNormalization-18 (scale and bias per group) and -21 (per channel)."""
    x, scale, bias, dy = c.x(0), c.x(1), c.x(2), c.dy()
    shape = c.shape(x)
    if shape is None or not isinstance(shape[1], int):
        c.fail("its channel count is not static", "export the model with a static channel dim")
    rank, channels = len(shape), shape[1]
    groups = int(c.attr("num_groups"))
    eps = float(c.attr("epsilon", 1e-5))
    per_channel = c.info.opset >= 21
    work = _work(c, x)
    xw, dyw = c.cast(x, work), c.cast(dy, work)
    grouped = c.op("Reshape", xw, c.ints([0, groups, -1]))  # [N, G, C/G * spatial]
    mean = c.reduce("ReduceMean", grouped, [2], 1)
    centered = c.op("Sub", grouped, mean)
    var = c.reduce("ReduceMean", c.op("Mul", centered, centered), [2], 1)
    inv = c.op("Reciprocal", c.op("Sqrt", c.op("Add", var, c.scalar(eps, var))))
    xhat = c.reshape_like(c.op("Mul", centered, inv), x)
    sums = [0, *range(2, rank)]
    if per_channel:
        weight = _channel(c, c.cast(scale, work), rank)
    else:
        # scale[g] for each channel of group g, as a [C] tensor
        weight = _channel(c, c.op("Reshape", c.op("Expand", c.unsqueeze(c.cast(scale, work), [1]),
                                                  c.ints([groups, channels // groups])), c.ints([channels])), rank)

    def per_param(t: str, target: str) -> str:
        total = c.reduce("ReduceSum", t, sums, 0)  # [C]
        if not per_channel:
            total = c.reduce("ReduceSum", c.op("Reshape", total, c.ints([groups, channels // groups])), [1], 0)
        return c.cast(total, c.elem(target))

    if c.needs(2):
        c.set(2, per_param(dyw, bias))
    if c.needs(1):
        c.set(1, per_param(c.op("Mul", dyw, xhat), scale))
    if c.needs(0):
        g = c.op("Reshape", c.op("Mul", dyw, weight), c.ints([0, groups, -1]))
        xg = c.op("Reshape", xhat, c.ints([0, groups, -1]))
        c.set(0, c.cast(c.reshape_like(_dx(c, g, xg, inv, [2]), x), c.elem(x)))


def _softmax_axes(c: Vjp, y: str) -> list[int]:
    rank = c.rank(y)
    if c.info.opset >= 13:
        return normalize_axes([c.attr("axis", -1)], rank)
    # Softmax-1/11 flatten the input to 2-D at ``axis``: normalized over every axis from it on.
    return list(range(normalize_axes([c.attr("axis", 1)], rank)[0], rank))


def softmax(c: Vjp) -> None:
    y, dy = c.y(0), c.dy()
    dot = c.reduce("ReduceSum", c.op("Mul", dy, y), _softmax_axes(c, y), 1)
    c.set(0, c.op("Mul", y, c.op("Sub", dy, dot)))


def log_softmax(c: Vjp) -> None:
    y, dy = c.y(0), c.dy()
    axes = _softmax_axes(c, y)
    scatter = c.emit.scatters.get(dy)
    if scatter is not None and [scatter[2]] == axes:
        c.set(0, _picked_log_softmax(c, y, *scatter))
        return
    total = c.reduce("ReduceSum", dy, axes, 1)
    c.set(0, c.op("Sub", dy, c.op("Mul", c.op("Exp", y), total)))


def _picked_log_softmax(c: Vjp, y: str, idx: str, picked: str, axis: int, idx_shape) -> str:
    """A cross-entropy's gradient: dY is GatherElements' scatter of the picked values g into
    zeros along the softmax axis, so dY's sum over the axis is g's and dX = scatter-add of g into
    -softmax * sum(g): one scatter (the zeros and the first scatter, left unread, are pruned), and
    no sum where the indices are one per row (5 nodes where 7 were, 4 with one per row)."""
    total = picked if idx_shape is not None and idx_shape[axis] == 1 else c.reduce("ReduceSum", picked, [axis], 1)
    spread = c.op("Mul", c.op("Exp", y), c.op("Neg", total))
    return c.op("ScatterElements", spread, idx, picked, axis=axis, reduction="add")


RULES = {
    "LayerNormalization": layer_normalization, "BatchNormalization": batch_normalization,
    "InstanceNormalization": instance_normalization, "GroupNormalization": group_normalization,
    "Softmax": softmax, "LogSoftmax": log_softmax,
}
