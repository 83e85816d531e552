"""If outputs read only in low precision take the low type where that saves Casts
(``docs/design.md``, the fewest Casts).

An If output the coloring left float32 (its branches differ: one computes it in low precision,
the other in float32) whose every reader reads it through the one Cast to the low type costs,
per branch computing it low, a Cast restoring float32 at the branch output, plus that Cast after
the If.  Made low instead, it costs one Cast to the low type at the output of each float32
branch, and nothing else:

    low branch:     L --Cast f32--> out  ... o --Cast low--> readers    becomes    L = out  ... o --> readers
    float32 branch: F = out          ... o --Cast low--> readers    becomes    F --Cast low--> out ... o --> readers

Both are exact (widening to float32 and narrowing back is the identity on a low value; the
float32 value is rounded once either way, only in another graph), and no path a run takes gets
more Casts.  It is done only where the whole model gets fewer.
"""
from __future__ import annotations

import onnx

FLOAT = onnx.TensorProto.FLOAT


def _ifs_innermost_first(rw):
    """(the If's scope, that scope's node table, the If's position in it, its two branch scopes) of
    every If, innermost first, so that what a rule does to an inner If's output is seen by the
    outer If's."""
    branches: dict[str, list[int]] = {}
    for s, scope in enumerate(rw.graph.scopes):
        if scope.parent is not None and scope.parent.op_type == "If":
            branches.setdefault(scope.parent.name, []).append(s)
    ifs = [(s, k) for s, nodes in enumerate(rw.nodes) for k, name in enumerate(nodes.names)
           if len(branches.get(name, ())) == 2]
    for s, k in sorted(ifs, key=lambda sk: -rw.graph_depth(sk[0])):
        nodes = rw.nodes[s]
        yield s, nodes, k, branches[nodes.names[k]]


def lower_if_outputs(rw) -> None:
    """Apply the rule to every If output of the model, innermost Ifs first.  ``rw`` is the
    plan's ``_Rewriter`` after fix_consumers (its shared Casts not yet placed)."""
    graph_outputs = {t.name for scope in rw.graph.scopes for t in scope.graph.output}
    for s, nodes, k, pair in _ifs_innermost_first(rw):
        for j, o in enumerate(nodes.outputs[k]):
            cast = rw.shared.get((o, rw.low_enum, None))
            if not o or cast is None or o in graph_outputs or rw.dtype(o) != FLOAT or rw.is_low(o):
                continue
            plans = [_branch_plan(rw, b, j, graph_outputs) for b in pair]
            if any(p is None for p in plans) or rw.read_counts({o}) != {o: 1}:
                continue  # something other than its Cast to the low type reads o, or a branch can't
            restores = sum(kind == "low" for kind, _, _ in plans)
            narrowings = sum(kind == "float" for kind, _, _ in plans)
            if narrowings >= restores + 1:
                continue  # no Cast saved
            for plan in plans:
                _apply(rw, *plan)
            rw.retype((o,))
            rw.drop_shared((o, rw.low_enum, None))
            rw.reread({cast.dst: o})


def raise_if_outputs(rw) -> None:
    """The other way round: an If output left float32 whose branches compute it low and restore
    float32 at each branch output (a Cast per branch) is written low by the If and restored once
    after it, where that saves Casts:

        low branch:     L --Cast f32--> out  ...  o --> readers    becomes    L = out  ...  o --Cast f32--> readers
        float32 branch: F = out          ...                        becomes    F --Cast low--> out

    A low reader of ``o`` then reads the If's low output, without its Cast.  Innermost Ifs first:
    an If output that is a branch output of an outer If is then restored in that branch, where the
    rule applies again to the outer If (silero-vad's LSTM state through nested Ifs).  Exact, as
    :func:`lower_if_outputs` is: a low value widened once, the float32 value rounded once."""
    graph_outputs = {t.name for scope in rw.graph.scopes for t in scope.graph.output}
    for s, nodes, k, pair in _ifs_innermost_first(rw):
        for j, o in enumerate(nodes.outputs[k]):
            if not o or rw.dtype(o) != FLOAT or rw.is_low(o) or o in rw.renamed:
                continue
            plans = [_branch_plan(rw, b, j, graph_outputs) for b in pair]
            if any(p is None or p[0] == "as is" for p in plans):
                continue
            restores = sum(kind == "low" for kind, _, _ in plans)
            narrowings = sum(kind == "float" for kind, _, _ in plans)
            shared = rw.shared.get((o, rw.low_enum, None))
            float_reads = rw.read_counts({o})[o] - (shared is not None)
            after = 1 if float_reads or o in graph_outputs else 0
            if narrowings + after >= restores + (shared is not None):
                continue  # no Cast saved
            for plan in plans:
                _apply(rw, *plan)
            low = rw.names(f"{o}_onnxmp_{rw.low_sfx}")
            rw.edits.new_tensors[low] = rw.like(o, low, rw.low_enum)
            outputs = nodes.outputs[k] = [low if t == o else t for t in nodes.outputs[k]]
            rw.edits.outputs[nodes.names[k]] = outputs
            rw.retype((low,))
            if after:
                rw.add_cast(rw.graph.scopes[s].gid, low, o, FLOAT)
                rw.renamed[o] = low
            else:
                rw.reread({o: low})
            if shared is not None:
                rw.drop_shared((o, rw.low_enum, None))
                rw.reread({shared.dst: low})


def _branch_plan(rw, s: int, j: int, graph_outputs: set[str]):
    """How branch ``s`` makes its output ``j`` low: ("low", name, (graph, position of the restore
    Cast)), ("float", name, (graph, position of its producer)), ("as is", name, None); None when
    the rule does not apply (something else reads the output, or no node of the branch writes it)."""
    scope = rw.graph.scopes[s]
    if j >= len(scope.graph.output):
        return None
    name = scope.graph.output[j].name
    if sum(t.name == name for other in rw.graph.scopes for t in other.graph.output) > 1:
        return None  # the name is another graph output too
    if any(rw.read_counts({name}).values()):
        return None  # a float32 reader of the output: it keeps its restore Cast
    if name in rw.renamed:
        at = next((i for i, c in enumerate(rw.new_nodes[scope.gid]) if c.dst == name), None)
        return None if at is None else ("low", name, (s, at))
    if rw.is_low(name):
        return "as is", name, None
    if rw.dtype(name) != FLOAT:
        return None
    nodes = rw.nodes[s]
    k = next((k for k, outs in enumerate(nodes.outputs) if name in outs), None)
    if k is None:
        return None  # an input, an initializer or an outer name passed through
    return "float", name, (s, k)


def _apply(rw, kind: str, name: str, where) -> None:
    if kind == "as is":
        return
    s, at = where
    scope, nodes = rw.graph.scopes[s], rw.nodes[s]
    if kind == "low":
        restore = rw.new_nodes[scope.gid].pop(at)
        rw.stats.casts.remove(restore.name)
        low = rw.renamed.pop(name)
        for k, outs in enumerate(nodes.outputs):
            if low in outs:
                outputs = nodes.outputs[k] = [name if t == low else t for t in outs]
                rw.edits.outputs[nodes.names[k]] = outputs
        rw.retype((name,))
        rw.reread({low: name})  # the branch's low readers of the renamed tensor
        return
    # float: the producer writes a renamed float32 tensor, and a Cast to the low type the output
    fp32 = rw.names(f"{name}_onnxmp_fp32")
    rw.edits.new_tensors[fp32] = rw.like(name, fp32, FLOAT)
    outputs = nodes.outputs[at] = [fp32 if t == name else t for t in nodes.outputs[at]]
    rw.edits.outputs[nodes.names[at]] = outputs
    rw.add_cast(scope.gid, fp32, name, rw.low_enum)
    rw.retype((name,))
