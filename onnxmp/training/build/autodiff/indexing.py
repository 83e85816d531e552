"""Gradients of the indexing ops: Gather, GatherElements, GatherND (scatter-adds, in float32),
ScatterND and ScatterElements (the data's gradient with the scattered positions zeroed, the
updates' gradient gathered)."""
from __future__ import annotations

from onnx import TensorProto

from onnxmp.training.build.autodiff.context import Vjp, normalize_axes

INT64 = TensorProto.INT64
# ScatterND / ScatterElements take reduction="add" from opset 16.
SCATTER_ADD_OPSET = 16
_WIDE = {TensorProto.DOUBLE: TensorProto.DOUBLE}


def _wide(c: Vjp, x: str) -> int:
    """Scatter-adds accumulate in float32 (double stays double)."""
    return _WIDE.get(c.elem(x), TensorProto.FLOAT)


def _zeros(c: Vjp, x: str, elem: int, perm: list[int] | None = None) -> str:
    """Zeros of ``elem`` shaped like ``x`` (its axes permuted by ``perm``)."""
    shape = c.info.static_shape(x)
    if shape is not None:
        return c.emit.zeros([shape[p] for p in perm] if perm else shape, elem)
    c.runtime(f"zeros shaped like {x}")
    dims = c.op("Shape", x, elem=INT64)
    if perm:
        dims = c.op("Gather", dims, c.ints(perm), elem=INT64)
    return c.emit.zeros(dims, elem)


def _int64(c: Vjp, idx: str) -> str:
    return c.cast(idx, INT64)


def gather(c: Vjp) -> None:
    x, idx, dy = c.x(0), c.x(1), c.dy()
    rank = c.rank(x)
    axis = normalize_axes([c.attr("axis", 0)], rank)[0]
    index_rank = c.rank(idx)
    wide = _wide(c, x)
    grad = c.cast(dy, wide)
    idx = _int64(c, idx)
    if index_rank == 0:
        idx, grad, index_rank = c.unsqueeze(idx, [0]), c.unsqueeze(grad, [axis]), 1
    c.emit.needs_opset(SCATTER_ADD_OPSET)
    if axis == 0:
        result = c.op("ScatterND", _zeros(c, x, wide), c.unsqueeze(idx, [index_rank]), grad, reduction="add")
    else:
        # The gathered axis first in x, the index axes first in the gradient.
        perm = [axis] + [i for i in range(rank) if i != axis]
        grad_perm = (list(range(axis, axis + index_rank)) + list(range(axis))
                     + list(range(axis + index_rank, rank - 1 + index_rank)))
        moved = c.op("ScatterND", _zeros(c, x, wide, perm), c.unsqueeze(idx, [index_rank]),
                     c.transpose(grad, grad_perm), reduction="add")
        inverse = [0] * rank
        for i, p in enumerate(perm):
            inverse[p] = i
        result = c.transpose(moved, inverse)
    c.set(0, c.cast(result, c.elem(x)))


def gather_elements(c: Vjp) -> None:
    x, idx, dy = c.x(0), c.x(1), c.dy()
    axis = normalize_axes([c.attr("axis", 0)], c.rank(x))[0]
    wide = _wide(c, x)
    c.emit.needs_opset(SCATTER_ADD_OPSET)
    idx, dy = _int64(c, idx), c.cast(dy, wide)
    result = c.op("ScatterElements", _zeros(c, x, wide), idx, dy, axis=axis, reduction="add")
    if wide == c.elem(x):
        c.emit.scatters[result] = (idx, dy, axis, c.shape(c.x(1)))
    c.set(0, c.cast(result, c.elem(x)))


def gather_nd(c: Vjp) -> None:
    x, idx, dy = c.x(0), c.x(1), c.dy()
    if c.attr("batch_dims", 0):
        c.fail("GatherND with batch_dims", "export the gather without batch_dims")
    wide = _wide(c, x)
    c.emit.needs_opset(SCATTER_ADD_OPSET)
    result = c.op("ScatterND", _zeros(c, x, wide), _int64(c, idx), c.cast(dy, wide), reduction="add")
    c.set(0, c.cast(result, c.elem(x)))


def scatter_nd(c: Vjp) -> None:
    idx, updates, dy = c.x(1), c.x(2), c.dy()
    reduction = c.attr("reduction", "none")
    if reduction not in ("none", "add"):
        c.fail(f"ScatterND with reduction {reduction!r}")
    if c.needs(0):
        if reduction == "add":
            c.set(0, dy)
        else:
            c.set(0, c.op("ScatterND", dy, idx, _zeros(c, updates, c.elem(dy))))
    if c.needs(2):
        c.set(2, c.op("GatherND", dy, idx))


def scatter_elements(c: Vjp) -> None:
    data, idx, updates, dy = c.x(0), c.x(1), c.x(2), c.dy()
    reduction = c.attr("reduction", "none")
    if reduction not in ("none", "add"):
        c.fail(f"ScatterElements with reduction {reduction!r}")
    axis = normalize_axes([c.attr("axis", 0)], c.rank(data))[0]
    if c.needs(0):
        if reduction == "add":
            c.set(0, dy)
        else:
            c.set(0, c.op("ScatterElements", dy, idx, _zeros(c, updates, c.elem(dy)), axis=axis))
    if c.needs(2):
        c.set(2, c.op("GatherElements", dy, idx, axis=axis))


RULES = {
    "Gather": gather, "GatherElements": gather_elements, "GatherND": gather_nd,
    "ScatterND": scatter_nd, "ScatterElements": scatter_elements,
}
