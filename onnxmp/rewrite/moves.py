"""Casts moved above data-movement ops where fewer are then needed (``docs/design.md``, the fewest Casts).

A data-movement op (Gather, Reshape, Transpose, Squeeze...) only selects and copies elements, so
``Cast(M(x), to=low) == M(Cast(x, to=low))`` bit for bit.  When the float32 outputs of several
such ops that read one float32 tensor ``x`` are each read only through their own Cast to the low
type (two Gathers of a float32 state input, read by low-precision LSTMs), one shared Cast of ``x``
replaces them all and the ops run in the low type.  Done only where the model gets fewer Casts,
the op has a low-precision kernel (the coloring's capability facts) and no list denies it.
"""
from __future__ import annotations

import onnx

FLOAT = onnx.TensorProto.FLOAT
# op -> position of the data input; every other input is an int64 index, shape or axes tensor.
MOVERS = {"Gather": 0, "GatherElements": 0, "GatherND": 0, "Reshape": 0, "Transpose": 0, "Squeeze": 0,
          "Unsqueeze": 0, "Slice": 0, "Identity": 0, "Flatten": 0, "Expand": 0, "Tile": 0,
          "DepthToSpace": 0, "SpaceToDepth": 0}


def move_casts_up(rw) -> None:
    """``rw``: the plan's ``_Rewriter`` after fix_consumers (its shared Casts not yet placed)."""
    low = rw.low_enum
    graph_outputs = {t.name for scope in rw.graph.scopes for t in scope.graph.output}
    candidates: dict[str, list[tuple[int, int, str]]] = {}  # data input -> (graph, position, output)
    for s, nodes in enumerate(rw.nodes):
        for k, (item, ins, outs) in enumerate(zip(nodes.items, nodes.inputs, nodes.outputs)):
            at = MOVERS.get(getattr(item, "op_type", None))
            if at is None or item.domain not in ("", "ai.onnx") or len(outs) != 1 or len(ins) <= at:
                continue
            data, out = ins[at], outs[0]
            if (out, low, None) not in rw.shared or out in graph_outputs or rw.is_low(out) \
                    or rw.dtype(out) != FLOAT or rw.dtype(data) != FLOAT \
                    or (rw.is_low(data) and data not in rw.renamed) \
                    or any(rw.dtype(t) in (FLOAT, low) for i, t in enumerate(ins) if i != at and t) \
                    or not _capable(rw, nodes.names[k], out):
                continue
            candidates.setdefault(data, []).append((s, k, out))
    if not candidates:
        return
    reads = rw.read_counts({out for movers in candidates.values() for _, _, out in movers})
    for data, movers in candidates.items():
        movers = [m for m in movers if reads[m[2]] == 1]  # read by nothing but its Cast to the low type
        if len(movers) - (0 if (data, low, None) in rw.shared or data in rw.renamed else 1) <= 0:
            continue  # no Cast saved
        for s, k, out in movers:
            nodes = rw.nodes[s]
            cast = rw.drop_shared((out, low, None))
            inputs = nodes.inputs[k] = list(nodes.inputs[k])
            inputs[MOVERS[nodes.items[k].op_type]] = rw.low_read(s, data)
            rw.edits.inputs[nodes.names[k]] = inputs
            rw.retype((out,))
            rw.reread({cast.dst: out})


def _capable(rw, node: str, out: str) -> bool:
    """The node's vertex writing ``out`` has a low-precision kernel and no list denies it."""
    view = rw.view
    for vid in view.ids_of_node(node):
        if out in view.output_names(vid):
            return bool(view.ok[vid]) and view.lst[vid] != "deny"
    return False


def move_casts_above_splits(rw) -> None:
    """A Split whose every output is read only through its Cast to float32 (a low-precision Split
    feeding float32 Sigmoids) reads one float32 copy of its input instead and runs in float32:
    ``Cast(Split(h)[i]) == Split(Cast(h))[i]``, and k Casts become one (none when the input's
    float32 copy exists already)."""
    graph_outputs = {t.name for scope in rw.graph.scopes for t in scope.graph.output}
    restored = {low: name for name, low in rw.renamed.items()}  # low tensor -> its float32 name
    found = []
    for s, nodes in enumerate(rw.nodes):
        for k, (item, ins, outs) in enumerate(zip(nodes.items, nodes.inputs, nodes.outputs)):
            if getattr(item, "op_type", None) != "Split" or item.domain not in ("", "ai.onnx") or not ins \
                    or len(outs) < 2 or not all(outs) or not graph_outputs.isdisjoint(outs):
                continue
            data = ins[0]
            if not (data in restored or (rw.is_low(data) and data not in rw.renamed and data not in rw.constants)):
                continue
            if all((o, FLOAT, None) in rw.shared and rw.is_low(o) and o not in rw.renamed for o in outs):
                found.append((s, k))
    if not found:
        return
    reads = rw.read_counts({o for s, k in found for o in rw.nodes[s].outputs[k]})
    for s, k in found:
        nodes = rw.nodes[s]
        outs, data = nodes.outputs[k], nodes.inputs[k][0]
        if any(reads[o] != 1 for o in outs):
            continue  # an output is read in low precision too
        for o in outs:
            cast = rw.drop_shared((o, FLOAT, None))
            rw.unretype(o)
            rw.reread({cast.dst: o})
        inputs = nodes.inputs[k] = list(nodes.inputs[k])
        inputs[0] = restored.get(data) or rw.float_read(s, data)
        rw.edits.inputs[nodes.names[k]] = inputs
