"""Gradients of MatMul, Gemm, com.microsoft FusedMatMul and Einsum.

A MatMul of batched activations by a 2-D weight gets its weight gradient as ONE flattened GEMM
(``Flatten`` both operands to 2-D, ``Gemm`` with ``transA``), never a batched MatMul and a
ReduceSum over the batch."""
from __future__ import annotations

from onnxmp.training.autodiff.context import Vjp
from onnxmp.training.autodiff.info import Shape


def _t(c: Vjp, x: str, rank: int) -> str:
    """``x`` with its last two axes swapped."""
    perm = list(range(rank))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return c.transpose(x, perm)


def _scaled(c: Vjp, x: str, alpha: float) -> str:
    return x if alpha == 1.0 else c.op("Mul", x, c.scalar(alpha, x))


def _mm(c: Vjp, a: str, sa: tuple, b: str, sb: tuple, dy: str, sy: tuple, want_a: bool, want_b: bool,
        alpha: float = 1.0) -> tuple[str | None, str | None]:
    """Gradients of ``alpha * a @ b`` for operands of rank >= 2 shaped ``sa``, ``sb`` (numpy batching)."""
    ra, rb, ry = len(sa), len(sb), len(sy)
    scale = alpha if alpha != 1.0 else None
    da = db = None
    if want_a:
        if ra == 2 and rb == 2:
            da = c.op("Gemm", dy, b, transB=1, alpha=scale)
        else:
            da = _scaled(c, c.op("MatMul", dy, _t(c, b, rb)), alpha)
            if rb > 2 or ra < ry:
                da = c.unbroadcast(da, a, None, target_shape=sa, like_shape=tuple(sy[:-2]) + tuple(sa[-2:]),
                                   peer_shapes=[tuple(sb[:-2]) + tuple(sa[-2:])])
    if want_b:
        if rb == 2:
            if ra > 2:  # the weight of batched activations: one GEMM over the flattened batch
                a, dy = c.op("Flatten", a, axis=ra - 1), c.op("Flatten", dy, axis=ry - 1)
            db = c.op("Gemm", a, dy, transA=1, alpha=scale)
        else:
            db = _scaled(c, c.op("MatMul", _t(c, a, ra), dy), alpha)
            if ra > 2 or rb < ry:
                db = c.unbroadcast(db, b, None, target_shape=sb, like_shape=tuple(sy[:-2]) + tuple(sb[-2:]),
                                   peer_shapes=[tuple(sa[:-2]) + tuple(sb[-2:])])
    return da, db


def _shape(c: Vjp, name: str) -> Shape:
    shape = c.shape(name)
    if shape is None:
        c.fail(f"the rank of {name!r} is unknown", "export the model with static ranks")
    return shape


def matmul(c: Vjp) -> None:
    a, b, dy = c.x(0), c.x(1), c.dy()
    sa, sb, sy = _shape(c, a), _shape(c, b), _shape(c, c.y(0))
    if len(sa) >= 2 and len(sb) >= 2:
        da, db = _mm(c, a, sa, b, sb, dy, sy, c.needs(0), c.needs(1))
    else:
        # 1-D operands as a [1, K] row / [K, 1] column; the gradients squeezed back.
        a2, sa2, b2, sb2 = a, tuple(sa), b, tuple(sb)
        if len(sa) == 1:
            a2, sa2 = c.unsqueeze(a, [0]), (1, sa[0])
        if len(sb) == 1:
            b2, sb2 = c.unsqueeze(b, [1]), (sb[0], 1)
        if len(sa) == 1 and len(sb) == 1:
            dy2, sy2 = c.unsqueeze(dy, [0, 1]), (1, 1)
        elif len(sa) == 1:
            dy2, sy2 = c.unsqueeze(dy, [len(sy) - 1]), tuple(sy[:-1]) + (1, sy[-1])
        else:
            dy2, sy2 = c.unsqueeze(dy, [len(sy)]), tuple(sy) + (1,)
        da, db = _mm(c, a2, sa2, b2, sb2, dy2, sy2, c.needs(0), c.needs(1))
        da = c.squeeze(da, [0]) if da is not None and len(sa) == 1 else da
        db = c.squeeze(db, [1]) if db is not None and len(sb) == 1 else db
    if da is not None:
        c.set(0, da)
    if db is not None:
        c.set(1, db)


def gemm(c: Vjp) -> None:
    a, b, dy = c.x(0), c.x(1), c.dy()
    alpha, beta = float(c.attr("alpha", 1.0)), float(c.attr("beta", 1.0))
    ta, tb = int(c.attr("transA", 0)), int(c.attr("transB", 0))
    scale = alpha if alpha != 1.0 else None
    if c.needs(0):
        if not ta:
            c.set(0, c.op("Gemm", dy, b, transB=1 - tb, alpha=scale))
        else:
            c.set(0, c.op("Gemm", b, dy, transA=tb, transB=1, alpha=scale))
    if c.needs(1):
        if not tb:
            c.set(1, c.op("Gemm", a, dy, transA=1 - ta, alpha=scale))
        else:
            c.set(1, c.op("Gemm", dy, a, transA=1, transB=ta, alpha=scale))
    if c.needs(2):
        grad = dy if beta == 1.0 else c.op("Mul", dy, c.scalar(beta, dy))
        c.set(2, c.unbroadcast(grad, c.x(2), c.y(0)))


def fused_matmul(c: Vjp) -> None:
    """com.microsoft FusedMatMul: alpha * op(A) @ op(B), op transposing the last two axes."""
    a, b, dy = c.x(0), c.x(1), c.dy()
    if c.attr("transBatchA", 0) or c.attr("transBatchB", 0):
        c.fail("transBatchA/transBatchB are not supported")
    ta, tb, alpha = int(c.attr("transA", 0)), int(c.attr("transB", 0)), float(c.attr("alpha", 1.0))
    sa, sb, sy = _shape(c, a), _shape(c, b), _shape(c, c.y(0))
    if len(sa) < 2 or len(sb) < 2:
        c.fail("a 1-D operand")

    def swap(s):
        return tuple(s[:-2]) + (s[-1], s[-2])

    a_eff, sa_eff = (_t(c, a, len(sa)), swap(sa)) if ta else (a, tuple(sa))
    b_eff, sb_eff = (_t(c, b, len(sb)), swap(sb)) if tb else (b, tuple(sb))
    da, db = _mm(c, a_eff, sa_eff, b_eff, sb_eff, dy, tuple(sy), c.needs(0), c.needs(1), alpha)
    if da is not None:
        c.set(0, _t(c, da, len(sa)) if ta else da)
    if db is not None:
        c.set(1, _t(c, db, len(sb)) if tb else db)


def einsum(c: Vjp) -> None:
    """Each operand's gradient is an Einsum of the output's gradient with the other operands:
    equations without an ellipsis, repeated indices within an operand, or an index that only the
    differentiated operand holds (that one would need an Expand: not supported)."""
    equation = c.attr("equation", "").replace(" ", "")
    if "..." in equation or "->" not in equation:
        c.fail("an Einsum with an ellipsis or an implicit output", "write the equation with '->' and explicit axes")
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    for i, term in enumerate(terms):
        if not c.needs(i):
            continue
        others = [t for j, t in enumerate(terms) if j != i]
        available = set(out).union(*others)
        if len(set(term)) != len(term) or not set(term) <= available:
            c.fail(f"operand {i} ({term!r}) repeats an index or sums one no other operand holds")
        inputs = [c.dy()] + [c.x(j) for j in range(len(terms)) if j != i]
        c.set(i, c.op("Einsum", *inputs, equation=",".join([out, *others]) + "->" + term))


RULES = {"MatMul": matmul, "Gemm": gemm, "Einsum": einsum}
MS_RULES = {"FusedMatMul": fused_matmul}
