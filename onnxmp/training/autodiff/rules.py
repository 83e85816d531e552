"""The table of gradient rules: ``VJP_RULES[(domain, op_type)]`` is the function that writes one
node's vector-Jacobian product (``rule(ctx: Vjp) -> None``), as ``LOWERINGS`` is the table of
lowerings.  A ``None`` entry is an op whose gradient is zero almost everywhere (Sign, Floor...):
no gradient path goes through it.  Ops whose outputs are integers or booleans (Shape, Equal,
ArgMax...) need no entry: no gradient path can go through them.
"""
from __future__ import annotations

from typing import Callable

from onnxmp.training.autodiff import activations, conv, elementwise, indexing, linalg, normalization, reductions
from onnxmp.training.autodiff import resize, shapes
from onnxmp.training.autodiff.context import Vjp
from onnxmp.training.autodiff.emit import MS_DOMAIN

Rule = Callable[[Vjp], None]

VJP_RULES: dict[tuple[str, str], Rule | None] = {}
for _family in (elementwise, activations, linalg, normalization, shapes, indexing, reductions, conv, resize):
    VJP_RULES.update((("", op), rule) for op, rule in _family.RULES.items())
    VJP_RULES.update(((MS_DOMAIN, op), rule) for op, rule in getattr(_family, "MS_RULES", {}).items())
VJP_RULES.update((("", op), None) for op in elementwise.ZERO)

__all__ = ["VJP_RULES", "Rule"]
