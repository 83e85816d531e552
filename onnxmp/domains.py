"""ONNX operator domains and opset versions: one home for both.

The default domain has two spellings in the wild (``""`` and ``"ai.onnx"``); every
comparison goes through :func:`is_onnx_domain`, and every "which ai.onnx opset does this
model import" through :func:`onnx_opset`.
"""
from __future__ import annotations

import onnx

ONNX_DOMAINS = ("", "ai.onnx")
# What a model that imports no ai.onnx opset is read as (onnx-graphsurgeon's choice, kept so that
# such models color as they always did; onnx's checker refuses them anyway when they use ai.onnx ops).
ASSUMED_ONNX_OPSET = 11


def is_onnx_domain(domain: str) -> bool:
    """The default (ai.onnx) domain, in either spelling."""
    return domain in ONNX_DOMAINS


def onnx_opset(model: onnx.ModelProto) -> int | None:
    """The ai.onnx opset ``model`` imports; None when it imports none."""
    return next((int(o.version) for o in model.opset_import if is_onnx_domain(o.domain)), None)


def opsets(model: onnx.ModelProto) -> dict[str, int]:
    """Domain -> imported version, with the default domain spelled ``""``."""
    return {("" if is_onnx_domain(o.domain) else o.domain): int(o.version) for o in model.opset_import}


def op_key(op_type: str, domain: str) -> str:
    """How lists and reports name an op: ``OpType`` in ai.onnx, ``domain:OpType`` elsewhere."""
    return op_type if is_onnx_domain(domain) else f"{domain}:{op_type}"
