"""Stage 5: verify.  Nothing half-converted leaves onnxmp.

Checks the rewritten model with the full checker, strict type inference, and a
topological-order check of every graph; any failure is an :class:`OnnxMPError`.
"""
from __future__ import annotations

import logging
import tempfile

import onnx

from onnxmp.errors import OnnxMPError
from onnxmp.external import check_skeleton, has_external_data

SKELETON_ABOVE = 1 << 30  # bytes; well under protobuf's 2 GB serialization limit

log = logging.getLogger("onnxmp.verify")

_HINT = ("onnxmp produced an invalid model; please report it. Meanwhile, --block-node REGEX or "
         "--deny-add OP around the named node usually avoids the problem")


def verify(model: onnx.ModelProto, *, original: onnx.ModelProto | None = None, keep_io_types: bool = True) -> None:
    try:
        if has_external_data(model) or model.ByteSize() > SKELETON_ABOVE:
            # Neither the proto nor the weights fit protobuf's 2 GB: check a weightless skeleton by path.
            with tempfile.TemporaryDirectory(prefix="onnxmp-verify-") as folder:
                onnx.checker.check_model(str(check_skeleton(model, folder)), full_check=True)
        else:
            onnx.checker.check_model(model, full_check=True)
    except Exception as exc:  # ValidationError, or InferenceError from full_check
        # full_check runs type inference with check_type and strict mode: a type error lands here too.
        raise OnnxMPError(f"converted model fails onnx.checker / strict type inference: {_first_line(exc)}",
                          hint=_HINT) from None
    check_topological(model.graph, "main")
    if original is not None and keep_io_types:
        check_io_unchanged(original, model)


def _first_line(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:400]


def check_topological(graph: onnx.GraphProto, where: str, outer: frozenset[str] = frozenset()) -> None:
    """Every node reads only tensors defined before it (inputs, initializers, outer scope)."""
    known = set(outer) | {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    known |= {i.name for i in graph.sparse_initializer}
    for node in graph.node:
        for name in node.input:
            if name not in known:
                raise OnnxMPError(
                    f"graph {where!r} is not topologically sorted: node `{node.name}` reads `{name}` "
                    "before it is produced", hint=_HINT)
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subgraphs:
                check_topological(sub, f"{node.name}/{attr.name}", frozenset(known))
        known.update(node.output)


def check_io_unchanged(original: onnx.ModelProto, converted: onnx.ModelProto) -> None:
    def sig(values):
        return [(v.name, v.type.tensor_type.elem_type) for v in values]

    for what, a, b in (("inputs", original.graph.input, converted.graph.input),
                       ("outputs", original.graph.output, converted.graph.output)):
        if sig(a) != sig(b):
            raise OnnxMPError(f"graph {what} changed name or dtype during conversion: {sig(a)} -> {sig(b)}",
                              hint=_HINT)
