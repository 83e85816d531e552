"""The fewest Casts: where each Cast the rewrite shares stands, and the Casts it need not add
(``docs/design.md``, the rewrite: the fewest Casts).

* **One Cast per value.** A Cast of a tensor is shared by every reader of it in any graph: it
  stands in the innermost graph holding all its readers (both branches of an If read one Cast
  placed beside the If), but never inside a Loop/Scan body when its source comes from outside
  that body (it would run once per iteration), and never above the graph defining its source.
* **Pairs that cancel.** ``Cast(Cast(h, to=float32), to=low)`` of a tensor ``h`` that is of the
  low type is ``h``, bit for bit (widening to float32 is exact, so narrowing back rounds
  nothing): the low reader reads ``h``.  The other order, ``Cast(Cast(x, to=low), to=float32)``,
  rounds ``x`` and is never removed.
* **Constants.** A float32 Constant/ConstantOfShape read only through the one Cast to the low
  type makes the low type itself: the value is the one the Cast would compute.

This module decides only from names and scopes; :mod:`onnxmp.rewrite.plan` applies its answers.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import AbstractSet, Iterable, Sequence

import onnx

from onnxmp.index import ModelIndex, Scope
from onnxmp.passes import require

FLOAT = onnx.TensorProto.FLOAT
# Holders whose bodies run once per execution of the node; any other body (Loop, Scan,
# SequenceMap, a custom op's) may run many times, so a Cast of an outer value is hoisted out.
_RUN_ONCE = frozenset({"If"})
_CONSTANT_OPS = frozenset({"Constant", "ConstantOfShape"})


@dataclass
class NewCast:
    """A Cast the rewrite adds: ``dst = Cast(src, to)``."""

    name: str
    src: str
    dst: str
    to: int


@dataclass
class GraphNodes:
    """One graph's nodes in order, NodeProtos and the NewCasts placed among them, with each
    one's name and its input and output names (the rewired ones where the rewrite changed them).
    The names are the index's (read from the proto once): the rewrite and the emitter both walk
    these lists.  The index's tuples are shared; a rewired node gets a list of its own."""

    items: list                  # onnx.NodeProto | NewCast
    names: list[str]
    inputs: list[Sequence[str]]
    outputs: list[Sequence[str]]

    @classmethod
    def of(cls, scope: Scope) -> GraphNodes:
        return cls(list(scope.graph.node), list(scope.names), list(scope.ins), list(scope.outs))

    def extend(self, other: GraphNodes, start: int, stop: int) -> None:
        """Append ``other``'s nodes ``start:stop``."""
        self.items.extend(other.items[start:stop])
        self.names.extend(other.names[start:stop])
        self.inputs.extend(other.inputs[start:stop])
        self.outputs.extend(other.outputs[start:stop])


class ScopeTree:
    """The graphs of a model as a tree: each body's parent graph, depth and whether it repeats."""

    def __init__(self, index: ModelIndex):
        scopes = index.scopes
        self.parent: list[int | None] = [s.parent_scope for s in scopes]
        self.depth: list[int] = []
        for s in scopes:
            self.depth.append(0 if s.parent_scope is None else self.depth[s.parent_scope] + 1)
        self.repeats: list[bool] = [s.parent is not None and s.parent.op_type not in _RUN_ONCE for s in scopes]

    def common(self, a: int, b: int) -> int:
        """The innermost graph holding both ``a`` and ``b`` (each a graph of itself)."""
        depth, parent = self.depth, self.parent
        while depth[a] > depth[b]:
            a = parent[a]
        while depth[b] > depth[a]:
            b = parent[b]
        while a != b:
            a, b = parent[a], parent[b]
        return a

    def site(self, home: int | None, readers: Iterable[int]) -> int:
        """Where a Cast of a tensor defined in graph ``home`` stands for ``readers`` (graphs
        within ``home``): their innermost common graph, moved out of every repeating body
        between it and ``home``.  ``home`` None (unknown): the common graph itself."""
        readers = iter(readers)
        site = next(readers)
        for r in readers:
            site = self.common(site, r)
        if home is None:
            return site
        place, s = site, site
        while s != home and s is not None:
            if self.repeats[s]:
                place = self.parent[s]
            s = self.parent[s]
        return place if s == home else site


def float_cast_inputs(index: ModelIndex) -> dict[str, str]:
    """Output -> input of every Cast(to=float32) of the model, in any graph."""
    found: dict[str, str] = {}
    for scope in index.scopes:
        for node, ins, outs in zip(scope.graph.node, scope.ins, scope.outs):
            if node.op_type == "Cast" and len(ins) == 1 and len(outs) == 1 and outs[0] and \
                    any(a.name == "to" and a.i == FLOAT for a in node.attribute):
                found[outs[0]] = ins[0]
    return found


def homes_and_producers(index: ModelIndex, outputs: Sequence[Sequence[Sequence[str]]],
                        cast_dsts: Sequence[Iterable[str]], names: AbstractSet[str]
                        ) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """For each tensor in ``names``: the graph defining it (an input, an initializer, a node's
    output, or the output of a Cast placed in that graph already) and, for a node's output, that
    node (graph, position).  ``outputs``: each graph's node outputs as the rewrite has them."""
    homes: dict[str, int] = {}
    producers: dict[str, tuple[int, int]] = {}
    for s, scope in enumerate(index.scopes):
        g = scope.graph
        for t in chain(scope.inputs, (i.name for i in g.initializer), (i.values.name for i in g.sparse_initializer),
                       cast_dsts[s]):
            if t in names:
                homes.setdefault(t, s)
        for k, outs in enumerate(outputs[s]):
            if not names.isdisjoint(outs):
                for t in outs:
                    if t in names:
                        homes.setdefault(t, s)
                        producers.setdefault(t, (s, k))
    return homes, producers


def foldable_constant(node, output: str) -> bool:
    """A Constant/ConstantOfShape the writer can retarget (``write._retarget``) whose output is
    ``output``: its value is then computed in the low type, as the Cast of it would be."""
    if not isinstance(node, onnx.NodeProto) or node.op_type not in _CONSTANT_OPS or node.domain not in ("", "ai.onnx"):
        return False
    if list(node.output) != [output]:
        return False
    attrs = {a.name for a in node.attribute}
    if node.op_type == "Constant":
        return bool(attrs & {"value", "sparse_value", "value_float", "value_floats"})
    return True


def read_counts(inputs: Iterable[Sequence[Sequence[str]]], extra: Iterable[str], names: AbstractSet[str]
                ) -> dict[str, int]:
    """How often each tensor of ``names`` is read: by the nodes (each graph's input lists) and
    by ``extra`` (Cast sources, graph outputs)."""
    counts = dict.fromkeys(names, 0)
    for graph_inputs in inputs:
        for ins in graph_inputs:
            if not names.isdisjoint(ins):
                for t in ins:
                    if t in counts:
                        counts[t] += 1
    for t in extra:
        if t in counts:
            counts[t] += 1
    return counts


def place_after_producers(nodes: GraphNodes, casts: list[NewCast]) -> GraphNodes:
    """Put each inserted Cast right after the node producing its input (docs/design.md, the rewrite).

    Casts of graph inputs, initializers and outer-scope tensors go first.  A Cast may
    read another inserted Cast (a restored output cast again), so placement follows
    chains; this keeps the sorted order ``normalize`` established without a full sort.
    Only the nodes that produce a Cast's input are looked at; the runs of nodes between
    them are copied as slices.
    """
    if not casts:
        return nodes
    sources = {c.src for c in casts}
    cast_outputs = {c.dst for c in casts}
    producer: dict[str, int] = {}  # Cast source -> the first node writing it
    for k, outs in enumerate(nodes.outputs):
        if not sources.isdisjoint(outs):
            for t in outs:
                producer.setdefault(t, k)
    after: dict[str, list[NewCast]] = {}
    head: list[NewCast] = []
    for cast in casts:
        if cast.src in producer or cast.src in cast_outputs:
            after.setdefault(cast.src, []).append(cast)
        else:
            head.append(cast)
    placed = GraphNodes([], [], [], [])
    _add_casts(placed, head, after)
    start = 0
    for k in sorted(set(producer.values())):
        placed.extend(nodes, start, k + 1)
        start = k + 1
        _add_casts(placed, [f for out in nodes.outputs[k] for f in after.pop(out, ())], after)
    placed.extend(nodes, start, len(nodes.items))
    require(not after, "rewrite", "every inserted Cast found its producer")
    return placed


def _add_casts(placed: GraphNodes, first: list[NewCast], after: dict[str, list[NewCast]]) -> None:
    """Depth first, each Cast then the Casts reading it.  A loop, not recursion: a long Cast
    chain would hit the recursion limit."""
    stack = list(reversed(first))
    while stack:
        cast = stack.pop()
        placed.items.append(cast)
        placed.names.append(cast.name)
        placed.inputs.append([cast.src])
        placed.outputs.append([cast.dst])
        stack.extend(reversed(after.pop(cast.dst, ())))
