"""Idle Casts and Cast pairs that cancel, removed from the plan (``docs/design.md``, the fewest Casts).

Once the plan has retyped tensors and retargeted the model's own Casts, some Casts do nothing:

* **Idle.** A Cast to the type its input has already (the model's ``Cast(to=float32)`` of a
  value the rewrite made low, retargeted to the low type because its readers are low) copies
  its input: its readers read the input.
* **Pairs that cancel.** ``Cast(Cast(h, to=float32), to=low)`` of a low ``h`` is ``h`` bit for
  bit (widening is exact, narrowing an exactly representable value rounds nothing), whoever
  added either Cast: the outer Cast's readers read ``h``.  ``Cast(Cast(x, to=low), to=float32)``
  of a float32 ``x`` rounds and is never removed.

* **Casts of constants.** The model's own Cast of a Constant node that nothing else reads
  (exporters write ``Constant(int32) -> Cast(to=int64)`` for shapes) when every value converts
  exactly (it converts back to itself): the Constant holds the converted values, its readers read
  it.  onnxruntime folds such a Cast at load anyway; written, it is a node fewer to keep.

Idle Casts and pairs are looked at only among Casts to float32 or the low type, and no Cast writing
a name the outside world sees (a graph or body output) is bypassed.  The Casts left unread go in
the writer's dead-node sweep, as does an intermediate Cast nothing else reads.
"""
from __future__ import annotations

import numpy as np
import onnx

from onnxmp.external import constant_node_values
from onnxmp.rewrite.casts import NewCast

FLOAT = onnx.TensorProto.FLOAT
# Widenings that are exact: a value of the first type is representable in the second.
_EXACT_WIDENING = {(onnx.TensorProto.FLOAT16, FLOAT), (onnx.TensorProto.BFLOAT16, FLOAT)}


def remove_idle_casts(rw) -> int:
    """Rewire the readers of idle Casts and of cancelling pairs; the number of Casts bypassed.
    ``rw`` is the plan's ``_Rewriter`` once every Cast is decided (before placement)."""
    wanted = (FLOAT, rw.low_enum)
    casts: dict[str, tuple[str, int]] = {}  # output -> (input, type it makes)
    for nodes in rw.nodes:
        for item, name, ins, outs in zip(nodes.items, nodes.names, nodes.inputs, nodes.outputs):
            if getattr(item, "op_type", None) != "Cast" or type(item) is NewCast or item.domain not in ("", "ai.onnx") \
                    or len(ins) != 1 or len(outs) != 1 or not ins[0] or not outs[0]:
                continue
            to = rw.low_enum if name in rw.edits.retargeted else \
                next((a.i for a in item.attribute if a.name == "to"), None)
            if to in wanted:
                casts[outs[0]] = (ins[0], to)
    for cast in (c for cs in rw.new_nodes.values() for c in cs):
        casts[cast.dst] = (cast.src, cast.to)
    if not casts:
        return 0
    seen = {t.name for scope in rw.graph.scopes for t in scope.graph.output}
    renames: dict[str, str] = {}
    for out, (src, to) in casts.items():
        if out in seen:
            continue  # the outside world reads this name: the Cast writes it
        if rw.dtype(src) == to:
            renames[out] = src
            continue
        inner = casts.get(src)
        if inner is not None and rw.dtype(inner[0]) == to and (to, inner[1]) in _EXACT_WIDENING:
            renames[out] = inner[0]
    if not renames:
        return 0
    for out in renames:  # follow chains: an idle Cast of a bypassed one reads the first source
        target = renames[out]
        while target in renames:
            target = renames[target]
        renames[out] = target
    rw.reread(renames)
    return len(renames)


def fold_constant_casts(rw) -> int:
    """The model's Casts of Constant nodes read by nothing else, whose values convert exactly: the
    Constant makes the Cast's type (``Edits.constant_types``), the Cast's readers read it; how many."""
    seen = {t.name for scope in rw.graph.scopes for t in scope.graph.output}
    constants: dict[str, tuple[int, int]] = {}  # Constant output -> (graph, position)
    for s, nodes in enumerate(rw.nodes):
        for k, (item, outs) in enumerate(zip(nodes.items, nodes.outputs)):
            if type(item) is not NewCast and item.op_type == "Constant" and item.domain in ("", "ai.onnx") \
                    and len(outs) == 1 and nodes.names[k] not in rw.edits.retargeted:
                constants[outs[0]] = (s, k)
    if not constants:
        return 0
    casts = []  # (Cast output, Constant output, type)
    for nodes in rw.nodes:
        for item, name, ins, outs in zip(nodes.items, nodes.names, nodes.inputs, nodes.outputs):
            if type(item) is not NewCast and item.op_type == "Cast" and item.domain in ("", "ai.onnx") \
                    and len(ins) == 1 and ins[0] in constants and len(outs) == 1 and outs[0] not in seen \
                    and name not in rw.edits.retargeted:
                to = next((a.i for a in item.attribute if a.name == "to"), None)
                if to is not None:
                    casts.append((outs[0], ins[0], to))
    if not casts:
        return 0
    reads = rw.read_counts({c for _, c, _ in casts})
    renames: dict[str, str] = {}
    for out, const, to in casts:
        if reads[const] != 1 or const in seen:
            continue  # another reader wants the Constant's own type
        s, k = constants[const]
        values = constant_node_values(rw.nodes[s].items[k])
        if values is None or not _exact(values, to):
            continue
        rw.edits.constant_types[rw.nodes[s].names[k]] = to
        rw.edits.dtypes[const] = to
        renames[out] = const
    if renames:
        rw.reread(renames)
    return len(renames)


def _exact(values: np.ndarray, to: int) -> bool:
    """Every value converts to ``to`` and back to itself (no rounding, wrap or truncation)."""
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(to)
    except (KeyError, ValueError):
        return False
    if values.dtype.kind not in "biuf" or np.dtype(dtype).kind not in "biuf":
        return False
    with np.errstate(all="ignore"):
        converted = values.astype(dtype)
        return bool(np.array_equal(converted.astype(values.dtype), values, equal_nan=values.dtype.kind == "f")
                    and np.all(np.isfinite(converted.astype(np.float64)) | ~np.isfinite(values.astype(np.float64))))
