"""Casts moved above data-movement ops where fewer are then needed (``docs/design.md``, the fewest Casts).

A data-movement op (Gather, Reshape, Transpose, Squeeze...) only selects and copies elements, so
``Cast(M(x), to=low) == M(Cast(x, to=low))`` bit for bit.  When the float32 outputs of several
such ops that read one float32 tensor ``x`` are each read only through their own Cast to the low
type (two Gathers of a float32 state input, read by low-precision LSTMs), one shared Cast of ``x``
replaces them all and the ops run in the low type.  Done only where the model gets fewer Casts,
the op has a low-precision kernel (the coloring's capability facts) and no list denies it.

The other way round, low data-movement ops (a Split, chains of Slices) whose final outputs are
each read only through a Cast to float32 run in float32 on one float32 copy of their input.
"""
from __future__ import annotations

import onnx

from onnxmp.rewrite.casts import NewCast

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
    """The other way round: data-movement ops (a Split, Slices, chains of them) that run low on one
    low tensor ``h`` and whose every final output is read only through its Cast to float32 (a low
    Split feeding float32 Sigmoids, an STFT's real and imaginary Slices feeding float32 Pows) run in
    float32 on one float32 copy of ``h`` instead: ``Cast(M(h)) == M(Cast(h))``, and k Casts become
    one (none when the float32 copy of ``h`` exists already).  Done where the model gets fewer."""
    graph_outputs = {t.name for scope in rw.graph.scopes for t in scope.graph.output}
    restored = {low: name for name, low in rw.renamed.items()}  # low tensor -> its float32 name
    trees = _FloatTrees(rw, graph_outputs)
    roots = [t for t in trees.roots()
             if t in restored or (rw.is_low(t) and t not in rw.renamed and t not in rw.constants)]
    if not roots:
        return
    trees.read(roots)
    readers = trees.readers
    roots.sort(key=lambda t: readers[t][0] if t in readers else (len(rw.nodes), 0, 0))  # in the order first read
    done: set[tuple[int, int]] = set()
    for data in roots:
        if not (data in restored or (rw.is_low(data) and data not in rw.renamed and data not in rw.constants)):
            continue
        roots, tree, saved = [], [], 0
        for s, k, i in readers.get(data, ()):
            if (s, k) in done or trees.data_at(s, k) != i:
                continue
            sub: list = []
            count = trees.leaves(s, k, sub)
            if count:
                roots.append((s, k, i))
                tree += sub
                saved += count
        copy = data in restored or (data, FLOAT, None) in rw.shared
        if not roots or saved - (0 if copy else 1) <= 0:
            continue  # no Cast saved
        for s, k in tree:
            done.add((s, k))
            for o in rw.nodes[s].outputs[k]:
                if (o, FLOAT, None) in rw.shared:
                    cast = rw.drop_shared((o, FLOAT, None))
                    rw.reread({cast.dst: o})
                rw.unretype(o)
        for s, k, i in roots:
            nodes = rw.nodes[s]
            inputs = nodes.inputs[k] = list(nodes.inputs[k])
            inputs[i] = restored.get(data) or rw.float_read(s, data)
            rw.edits.inputs[nodes.names[k]] = inputs


class _FloatTrees:
    """The trees of data-movement ops below a low tensor (:func:`move_casts_above_splits`); methods,
    not closures, so that the recursion leaves no reference cycle behind."""

    def __init__(self, rw, graph_outputs: set[str]):
        self.rw, self.graph_outputs = rw, graph_outputs
        self.readers: dict[str, list[tuple[int, int, int]]] = {}  # tensor -> (graph, position, input index)
        self.all_reads: dict[str, int] = {}  # by nodes and by the added Casts
        self.produced: dict[str, tuple[int, int]] = {}  # output of a data-movement op -> the op

    def read(self, roots: list[str]) -> None:
        """Who reads the roots and the outputs of data-movement ops and Casts (one sweep)."""
        rw = self.rw
        wanted = set(roots).union(self.produced)
        for s, nodes in enumerate(rw.nodes):
            for k, (item, outs) in enumerate(zip(nodes.items, nodes.outputs)):
                if getattr(item, "op_type", None) == "Cast":
                    wanted.update(outs)
        readers, counts = self.readers, self.all_reads
        for s, nodes in enumerate(rw.nodes):
            for k, ins in enumerate(nodes.inputs):
                if wanted.isdisjoint(ins):
                    continue
                for i, t in enumerate(ins):
                    if t in wanted:
                        readers.setdefault(t, []).append((s, k, i))
                        counts[t] = counts.get(t, 0) + 1
        for cast in (*rw.shared.values(), *(c for cs in rw.new_nodes.values() for c in cs)):
            if cast.src in wanted:
                counts[cast.src] = counts.get(cast.src, 0) + 1

    def roots(self) -> list[str]:
        """The tensors worth starting from: those a chain of data-movement ops leads from to a
        Cast to float32 (most tensors of a model lead to none)."""
        rw = self.rw
        ends = {c.src for c in rw.shared.values() if c.to == FLOAT}
        produced = self.produced
        for s, nodes in enumerate(rw.nodes):
            for k, (item, name, ins, outs) in enumerate(zip(nodes.items, nodes.names, nodes.inputs, nodes.outputs)):
                op = getattr(item, "op_type", None)
                if op == "Cast" and ins and _float_cast(rw, item, name):
                    ends.add(ins[0])
                elif op == "Split" or op in MOVERS:
                    for o in outs:
                        produced[o] = (s, k)
        found: dict[str, None] = {}
        for t in ends:
            while t not in found:
                found[t] = None
                at = produced.get(t)
                if at is None:
                    break
                i = self.data_at(*at)
                if i is None or i >= len(rw.nodes[at[0]].inputs[at[1]]):
                    break
                t = rw.nodes[at[0]].inputs[at[1]][i]
        return list(found)

    def data_at(self, s: int, k: int) -> int | None:
        """The data input's position of node k when it is a data-movement op (or a Split)."""
        rw = self.rw
        item = rw.nodes[s].items[k]
        op = getattr(item, "op_type", None)
        at = 0 if op == "Split" else MOVERS.get(op)
        if at is None or item.domain not in ("", "ai.onnx") or op in _GROWING:
            return None
        ins = rw.nodes[s].inputs[k]
        if any(rw.dtype(t) in (FLOAT, rw.low_enum) for j, t in enumerate(ins) if j != at and t):
            return None
        return at

    def dead(self, nodes, k: int) -> bool:
        """A model's Cast whose output nothing reads (the writer's sweep takes it)."""
        return getattr(nodes.items[k], "op_type", None) == "Cast" and type(nodes.items[k]) is not NewCast \
            and all(not o or (self.all_reads.get(o, 0) == 0 and o not in self.graph_outputs) for o in nodes.outputs[k])

    def leaves(self, s: int, k: int, tree: list) -> int | None:
        """Outputs of the mover (s, k) and its mover readers read only through a Cast to float32:
        how many, the movers joining ``tree``; None when some output has another reader."""
        rw, readers = self.rw, self.readers
        found = 0
        for o in rw.nodes[s].outputs[k]:
            if not o or o in self.graph_outputs or not rw.is_low(o) or o in rw.renamed or o in rw.constants:
                return None
            reading = readers.get(o, ())
            below = [r for r in reading if self.data_at(r[0], r[1]) == r[2]]
            # the model's own Casts to float32 of o: idle once o is float32 (rewrite/idle.py)
            own = [r for r in reading if _float_cast(rw, rw.nodes[r[0]].items[r[1]], rw.nodes[r[0]].names[r[1]])]
            dead = [r for r in reading if self.dead(rw.nodes[r[0]], r[1])]
            if len(below) + len(own) + len(dead) != len(reading):
                return None  # a compute node reads o in low precision
            cast = (o, FLOAT, None) in rw.shared
            if self.all_reads.get(o, 0) != len(below) + len(own) + len(dead) + int(cast) \
                    or not (below or own or cast):
                return None  # read by another added Cast too, or by nothing
            found += int(cast) + len(own)
            for r in below:
                more = self.leaves(r[0], r[1], tree)
                if more is None:
                    return None
                found += more
        tree.append((s, k))
        return found


def _float_cast(rw, item, name: str) -> bool:
    """The model's own Cast to float32 (not one the coloring retargeted to the low type)."""
    return type(item) is not NewCast and item.op_type == "Cast" and item.domain in ("", "ai.onnx") \
        and name not in rw.edits.retargeted and any(a.name == "to" and a.i == FLOAT for a in item.attribute)


# Ops whose output has more elements than their input: a Cast is not moved to their input side
# when that would convert more values (it is moved only where it saves Casts, but not at that price).
_GROWING = frozenset({"Expand", "Tile"})


def move_restores_down(rw) -> None:
    """Casts to float32 of low values moved below the data-movement ops (and Concats) that read
    them, where that needs fewer: ``M(Cast(h1), Cast(h2)) == Cast(M(h1, h2))`` bit for bit, so a
    Concat of two restored values (silero-vad's LSTM states, Unsqueezed and concatenated) runs low
    and one Cast restores its output.  An op whose output is an If branch's output moves its
    Cast below it at no gain: the branch output then comes from a restore, which
    ``raise_if_outputs`` can make one Cast after the If."""
    graph_outputs = {t.name for scope in rw.graph.scopes for t in scope.graph.output}
    branch_outputs = {t.name for scope in rw.graph.scopes[1:] if scope.parent.op_type == "If"
                      for t in scope.graph.output}
    low_of = dict(rw.renamed)  # float32 copy -> the low value it restores
    for cast in (*rw.shared.values(), *(c for cs in rw.new_nodes.values() for c in cs)):
        if cast.to == FLOAT and rw.dtype(cast.src) == rw.low_enum:
            low_of[cast.dst] = cast.src
    if not low_of:
        return
    for s, nodes in enumerate(rw.nodes):
        # The ops a restore reaches through other such ops (a cheap forward sweep: most reach none).
        reach: list[int] = []
        reached: set[str] = set(low_of)
        for k, (item, ins) in enumerate(zip(nodes.items, nodes.inputs)):
            op = getattr(item, "op_type", None)
            if (op == "Concat" or op in MOVERS) and not reached.isdisjoint(ins) and _sink_data(rw, s, k) is not None:
                reach.append(k)
                reached.update(nodes.outputs[k])
        if not reach:
            continue
        producer = {nodes.outputs[k][0]: k for k in reach}
        # how often each output of a candidate op is read, counted once: a region's inner outputs
        # keep their one reader when it sinks
        counts = rw.read_counts(set(producer))
        for k in reach:
            region = _sink_region(rw, s, k, producer, low_of, counts)
            if region is not None:
                freed = _freed(rw, s, region, low_of, graph_outputs)
                out = nodes.outputs[k][0]
                if len(freed) > 1 or (len(freed) == 1 and out in branch_outputs):
                    _sink(rw, s, region, low_of)


def _sink_data(rw, s: int, k: int) -> list[int] | None:
    """Positions of the data inputs of node k when it is an op a restore Cast moves below: a
    data-movement op that does not grow its input, or a Concat, with one output, a low kernel
    and float inputs only at its data positions; else None."""
    nodes = rw.nodes[s]
    item = nodes.items[k]
    op = getattr(item, "op_type", None)
    if type(item) is NewCast or item.domain not in ("", "ai.onnx") or len(nodes.outputs[k]) != 1 or op in _GROWING:
        return None
    ins = nodes.inputs[k]
    if op == "Concat":
        data = [i for i, t in enumerate(ins) if t]
    elif op in MOVERS and len(ins) > MOVERS[op]:
        data = [MOVERS[op]]
    else:
        return None
    out = nodes.outputs[k][0]
    if not out or rw.dtype(out) != FLOAT or rw.is_low(out) or out in rw.constants \
            or not _capable(rw, nodes.names[k], out):
        return None
    if any(rw.dtype(t) in (FLOAT, rw.low_enum) for i, t in enumerate(ins) if i not in data and t):
        return None
    return data


def _sink_region(rw, s: int, k: int, producer: dict[str, int], low_of: dict[str, str],
                 counts: dict[str, int]) -> list | None:
    """Node k and the sinkable ops above it whose every data input is a restored value or the
    output of another such op read only by the region: [(position, data positions)], producers
    first; None when some data input is neither."""
    data = _sink_data(rw, s, k)
    if data is None:
        return None
    region = []
    for i in data:
        t = rw.nodes[s].inputs[k][i]
        if t in low_of:
            continue
        above = producer.get(t)
        if above is None or counts.get(t) != 1:
            return None
        sub = _sink_region(rw, s, above, producer, low_of, counts)
        if sub is None:
            return None
        region += sub
    return region + [(k, data)]


def _freed(rw, s: int, region: list, low_of: dict[str, str], graph_outputs: set[str]) -> set[str]:
    """The restored copies nothing but the region reads (their Casts go once it reads the low values)."""
    reads: dict[str, int] = {}
    for k, data in region:
        for i in data:
            t = rw.nodes[s].inputs[k][i]
            if t in low_of:
                reads[t] = reads.get(t, 0) + 1
    if not reads:
        return set()
    total = rw.read_counts(set(reads))
    return {t for t, n in reads.items() if total[t] == n and t not in graph_outputs}


def _sink(rw, s: int, region: list, low_of: dict[str, str]) -> None:
    """The region reads the low values and runs low; one Cast restores its last output."""
    nodes, gid = rw.nodes[s], rw.graph.scopes[s].gid
    for n, (k, data) in enumerate(region):
        inputs = nodes.inputs[k] = list(nodes.inputs[k])
        for i in data:
            inputs[i] = low_of.get(inputs[i], inputs[i])
        rw.edits.inputs[nodes.names[k]] = inputs
        if n < len(region) - 1:
            rw.retype(tuple(nodes.outputs[k]))  # read by the region alone
    k = region[-1][0]
    out = nodes.outputs[k][0]
    low = rw.names(f"{out}_onnxmp_{rw.low_sfx}")
    rw.edits.new_tensors[low] = rw.like(out, low, rw.low_enum)
    outputs = nodes.outputs[k] = [low]
    rw.edits.outputs[nodes.names[k]] = outputs
    rw.retype((low,))
    rw.add_cast(gid, low, out, FLOAT)
    rw.renamed[out] = low
    low_of[out] = low
    shared = rw.shared.get((out, rw.low_enum, None))
    if shared is not None:  # a low reader of the output reads the low value itself
        rw.drop_shared((out, rw.low_enum, None))
        rw.reread({shared.dst: low})
