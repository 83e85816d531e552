"""Opset gaps: a node whose opset has no low-precision kernel while the next opset of the same op,
with the same meaning, has one (issue 30).

A PP-LCNet exported at opset 11 keeps its 18 Clip nodes in float32, with 36 Casts around them:
the CUDA EP registers float16 Clip only from opset 12, and Clip-12 only adds integer types.
ONNX imports one opset per domain for the whole model, so "retargeting" a node means raising the
model's ai.onnx import by one version; that is safe only when every op the model uses means the
same at both versions.  :data:`SAME_MEANING` lists the version bumps, read from onnx's operator
changelog, that only add types, or attributes whose defaults keep the old behaviour; an op whose
schema changes in any other way (Dropout-12 takes ``ratio`` as an input, Squeeze-13 its axes)
leaves the model as it is.  onnx's version converter is not used: it rewrites nodes, and what it
proves safe is its own business, not the kernels'.
"""
from __future__ import annotations

import functools
import logging

import onnx

from onnxmp.domains import is_onnx_domain, onnx_opset
from onnxmp.subgraphs import iter_proto_graphs

log = logging.getLogger("onnxmp.opset_gaps")

# (op, since_version of the newer schema): the newer schema means what the previous one did.
SAME_MEANING = frozenset({
    # 12: types added (Clip, Max, Min, MaxPool, Pow, ReduceMax, ReduceMin), attributes whose
    # defaults keep the old meaning (ArgMax/ArgMin select_last_index=0, GatherND batch_dims=0),
    # Constant's value_* forms.
    ("Clip", 12), ("Max", 12), ("Min", 12), ("MaxPool", 12), ("Pow", 12), ("ReduceMax", 12), ("ReduceMin", 12),
    ("ArgMax", 12), ("ArgMin", 12), ("GatherND", 12), ("Constant", 12),
    # 14: types added (CumSum float16, Add/Sub/Mul/Div/Relu integer types, Identity optionals),
    # Reshape allowzero=0 and the RNNs' layout=0 defaults.
    ("CumSum", 14), ("Add", 14), ("Sub", 14), ("Mul", 14), ("Div", 14), ("Relu", 14), ("Identity", 14),
    ("Reshape", 14), ("GRU", 14), ("LSTM", 14), ("RNN", 14),
    # 20: types added.
    ("IsInf", 20), ("IsNaN", 20), ("ConstantOfShape", 20), ("ReduceMax", 20), ("ReduceMin", 20),
})


@functools.lru_cache(maxsize=None)
def _since(op_type: str, opset: int) -> int | None:
    try:
        return onnx.defs.get_schema(op_type, opset, "").since_version
    except onnx.defs.SchemaError:
        return None


def _ops(model: onnx.ModelProto) -> set[str]:
    return {node.op_type for g in iter_proto_graphs(model.graph) for node in g.node if is_onnx_domain(node.domain)}


def find_retarget(model: onnx.ModelProto, kernels, provider: str, low: str) -> tuple[int, list[str]] | None:
    """(the next opset, the ops it gives a ``low`` kernel on ``provider``) when raising the model's
    ai.onnx import by one keeps every op's meaning and closes a kernel gap; None otherwise."""
    opset = onnx_opset(model)
    if opset is None or opset >= onnx.defs.onnx_opset_version():
        return None
    ops = _ops(model)
    gaps = sorted(op for op in ops
                  if kernels.supports(provider, "", op, opset, None, low) is False
                  and kernels.supports(provider, "", op, opset + 1, None, low))
    if not gaps:
        return None
    for op in ops:
        before, after = _since(op, opset), _since(op, opset + 1)
        if before != after and (op, after) not in SAME_MEANING:
            log.info("opset %d lacks a %s kernel for %s, but %s changes meaning at opset %d: kept at %d",
                     opset, low, ", ".join(gaps), op, opset + 1, opset)
            return None
    return opset + 1, gaps


def retarget(model: onnx.ModelProto, kernels, provider: str, low: str) -> str | None:
    """Raise ``model``'s ai.onnx import where :func:`find_retarget` finds it safe and useful (in
    place: ``model`` is the pipeline's own copy); what was done, in words, or None."""
    found = find_retarget(model, kernels, provider, low)
    if found is None:
        return None
    version, gaps = found
    before = onnx_opset(model)
    for entry in model.opset_import:
        if is_onnx_domain(entry.domain):
            entry.version = version
    note = (f"ai.onnx opset {before} -> {version}: {', '.join(gaps)} {'has' if len(gaps) == 1 else 'have'} a {low} "
            f"{provider} kernel only from opset {version}, with the same meaning")
    log.info("retargeted %s", note)
    return note
