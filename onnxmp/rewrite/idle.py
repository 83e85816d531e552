"""Idle Casts and Cast pairs that cancel, removed from the plan (``docs/design.md``, the fewest Casts).

Once the plan has retyped tensors and retargeted the model's own Casts, some Casts do nothing:

* **Idle.** A Cast to the type its input has already (the model's ``Cast(to=float32)`` of a
  value the rewrite made low, retargeted to the low type because its readers are low) copies
  its input: its readers read the input.
* **Pairs that cancel.** ``Cast(Cast(h, to=float32), to=low)`` of a low ``h`` is ``h`` bit for
  bit (widening is exact, narrowing an exactly representable value rounds nothing), whoever
  added either Cast: the outer Cast's readers read ``h``.  ``Cast(Cast(x, to=low), to=float32)``
  of a float32 ``x`` rounds and is never removed.

Only Casts to float32 or the low type are looked at (the model's other Casts are its own
business), and never one writing a name the outside world sees (a graph or body output).  The
Casts left unread go in the writer's dead-node sweep, as does an intermediate Cast nothing else
reads.
"""
from __future__ import annotations

import onnx

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
