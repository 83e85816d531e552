"""The vertices the coloring paints: (node, type-constraint parameter) pairs (``docs/coloring.md``).

All inputs and outputs of a node that share a type parameter in the op schema
form one vertex and change dtype together.  Only vertices whose tensors are
float32 take part; edges run producer vertex -> consumer vertex, one per
float32 tensor that links them (a body reading an outer tensor included).

The view follows TF's GraphTypeTopologyView: a vertex is an int, numbered in node
order; what many vertices share (op, type parameter and positions, and the facts
their dtypes, list and block match give) is one shared :class:`Kind`; fan-in and
fan-out are flat int arrays.  :class:`Vertex` reads one id for reports and
callers; the view holds no object per vertex.
"""
from __future__ import annotations

import itertools
import logging
import re
from array import array
from operator import attrgetter
from typing import AbstractSet, Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx

from onnxmp.color.edges import Adjacency, link
from onnxmp.color.fused import FusedUnit, fused_units, fuses_norms, tanh_gelu_cubes
from onnxmp.color.groups import ColorGroup, control_flow_groups
from onnxmp.color.layouts import (CONTROL_FLOW, FLOAT, NOT_A_TENSOR, RETARGETABLE, Group, Kind, OpInfo,
                                  Tied, decide, identity_group, kernel_capability, merge_tied_params, present_groups,
                                  schema_layout)
from onnxmp.fusions import GraphFacts, Lookup
from onnxmp.index import TENSOR_KIND, ModelIndex, keeps_io
from onnxmp.passes import require
from onnxmp.precision import Precision

log = logging.getLogger("onnxmp.color")

# TypeView.list_codes: the list of each vertex's op as a byte (0: on no list), for array masks.
LIST_CODES = {None: 0, "allow": 1, "deny": 2, "infer": 3, "clear": 4}


class TypeView:
    """Vertices of every graph plus fan-in/fan-out over float32 tensors (built by :func:`build_type_view`).

    Per vertex (index = vertex id): ``v_node`` (node index), ``v_kind`` (shared :class:`Kind`:
    op, param, positions, facts), and the arrays the passes read: ``lst`` (list name),
    ``list_codes`` (the same as bytes, see LIST_CODES), ``f32`` and ``ok`` (processed, float32
    and low-precision capable).
    Per node (index = node index, scopes in order, nodes in graph order): ``node_names``,
    ``node_scope``, ``node_ins``/``node_outs`` (tensor names) and ``node_first`` (its first
    vertex id; the node's vertices are ``node_first[k]:node_first[k + 1]``).
    """

    def __init__(self):
        self.scope_gids: list[str] = []
        self.node_names: list[str] = []
        self.node_index: dict[str, int] = {}
        self.node_scope = array("i")
        self.node_ins: list[tuple[str, ...]] = []
        self.node_outs: list[tuple[str, ...]] = []
        self.node_first = array("i")
        self.v_node = array("i")
        self.v_kind: list[Kind] = []
        self.lst: list[str | None] = []
        self.list_codes = b""
        self.f32 = bytearray()
        self.ok = bytearray()
        self.float_io: dict[int, tuple[list, list]] = {}  # schema-less vertices cut down to float tensors
        self.retargetable: list[int] = []  # Cast/Constant/ConstantOfShape vertices with outputs only
        self.control_flow: list[int] = []  # node indices of the If/Loop/Scan nodes (of any domain)
        self.constant_at: dict[str, tuple[int, int]] = {}  # tensor -> (scope, position) of its Constant node
        self.fanin = self.fanout = Adjacency(array("i", [0]), array("i"))
        self.producer_of: Mapping[str, int] = {}    # tensor name -> producing float32 vertex id
        # tensor name -> consuming float32 vertex ids (any graph), for the outputs of capable
        # retargetable vertices and the control-flow group members: the tensors the passes ask about
        self.consumers_of: dict[str, list[int]] = {}
        self.pinned: dict[str, str] = {}            # tensor name -> why its dtype may not change
        self.groups: list[ColorGroup] = []
        self.fused: list[FusedUnit] = []            # normalizations ORT fuses into float32 kernels
        self.identity_casts: dict[str, str] = {}    # output -> input of each float32-to-float32 Cast
        self.constants: AbstractSet[str] = frozenset()  # initializer names (of every graph)
        self.notes: dict[int, str] = {}              # vertex -> why its list is not its op's (reports)

    # -- readable views for reports and callers (made on access: a stored one would be a cycle) --
    @property
    def by_id(self) -> Sequence[Vertex]:
        return _ById(self)

    @property
    def vertices(self) -> Mapping[str, Vertex]:
        """Readable "node:param" key -> :class:`Vertex`."""
        return _Vertices(self)

    @property
    def node_vertices(self) -> Mapping[str, list[str]]:
        """Node name -> its vertex keys (float or not)."""
        return _NodeVertices(self)

    @property
    def graph_of_node(self) -> Mapping[str, str]:
        return _GraphOfNode(self)

    # -- fast accessors by id ------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.lst)

    def node_of(self, vid: int) -> str:
        return self.node_names[self.v_node[vid]]

    def op_of(self, vid: int) -> str:
        return self.v_kind[vid].group.op.key

    def key(self, vid: int) -> str:
        return f"{self.node_names[self.v_node[vid]]}:{self.v_kind[vid].group.param}"

    def inputs(self, vid: int) -> list[tuple[int, str]]:
        """(input index, tensor name) of the vertex."""
        cut = self.float_io.get(vid)
        if cut is not None:
            return list(cut[0])
        names = self.node_ins[self.v_node[vid]]
        return [(i, names[i]) for i in self.v_kind[vid].group.in_idx]

    def input_names(self, vid: int) -> tuple[str, ...]:
        """The tensors the vertex reads, in input order."""
        cut = self.float_io.get(vid)
        if cut is not None:
            return tuple(t for _, t in cut[0])
        return self.v_kind[vid].group.pick_in(self.node_ins[self.v_node[vid]])

    def output_names(self, vid: int) -> tuple[str, ...]:
        """The tensors the vertex writes, in output order."""
        cut = self.float_io.get(vid)
        if cut is not None:
            return tuple(t for _, t in cut[1])
        return self.v_kind[vid].group.pick_out(self.node_outs[self.v_node[vid]])

    def outputs(self, vid: int) -> list[tuple[int, str]]:
        """(output index, tensor name) of the vertex."""
        cut = self.float_io.get(vid)
        if cut is not None:
            return list(cut[1])
        names = self.node_outs[self.v_node[vid]]
        return [(i, names[i]) for i in self.v_kind[vid].group.out_idx]

    def ids_of_node(self, name: str) -> range:
        """Vertex ids of a node (float or not); empty for an unknown name."""
        k = self.node_index.get(name)
        if k is None:
            return range(0)
        return range(self.node_first[k], self.node_first[k + 1])

    def id_of(self, key: str) -> int:
        """The id of a readable "node:param" key (KeyError when there is no such vertex)."""
        node, _, param = key.rpartition(":")
        for vid in self.ids_of_node(node):
            if self.v_kind[vid].group.param == param:
                return vid
        raise KeyError(key)

    def set_facts(self, vid: int, **facts) -> None:
        """Change one vertex's facts (its shared kind is copied first)."""
        kind = self.v_kind[vid].copy()
        for name, value in facts.items():
            setattr(kind, name, value)
        self.v_kind[vid] = kind.settle()
        self.f32[vid] = kind.float32
        self.ok[vid] = kind.ok


def _fact(name: str) -> property:
    def get(self: Vertex):
        return getattr(self.view.v_kind[self.id], name)

    def set_(self: Vertex, value) -> None:
        self.view.set_facts(self.id, **{name: value})
    return property(get, set_)


class Vertex:
    """One vertex of a :class:`TypeView`, read through its id."""

    __slots__ = ("view", "id", "_k", "_group")

    def __init__(self, view: TypeView, vid: int):
        self.view, self.id = view, vid
        self._k = view.v_node[vid]              # node index
        self._group = view.v_kind[vid].group    # never changes (set_facts keeps it)

    key = property(lambda self: f"{self.view.node_names[self._k]}:{self._group.param}")  # "<node>:<param>"
    node = property(lambda self: self.view.node_names[self._k])
    op = property(lambda self: self._group.op.key)  # list key: OpType or domain:OpType
    op_type = property(lambda self: self._group.op.op_type)
    domain = property(lambda self: self._group.op.domain)
    opset = property(lambda self: self._group.op.opset)
    param = property(lambda self: self._group.param)
    graph = property(lambda self: self.view.scope_gids[self.view.node_scope[self._k]])
    @property
    def inputs(self) -> list[tuple[int, str]]:
        """(input index, tensor name)."""
        if self.id in self.view.float_io:
            return self.view.inputs(self.id)
        names = self.view.node_ins[self._k]
        return [(i, names[i]) for i in self._group.in_idx]

    @property
    def outputs(self) -> list[tuple[int, str]]:
        """(output index, tensor name)."""
        if self.id in self.view.float_io:
            return self.view.outputs(self.id)
        names = self.view.node_outs[self._k]
        return [(i, names[i]) for i in self._group.out_idx]

    list = property(lambda self: self._group.op.list)
    float32 = _fact("float32")
    type_known = _fact("type_known")
    processed = _fact("processed")
    capable = _fact("capable")      # schema and kernel accept the low-precision type
    why_not = _fact("why_not")      # why not processed / not capable

    @property
    def tensors(self) -> list[str]:
        view = self.view
        if self.id in view.float_io:
            return [t for _, t in self.inputs] + [t for _, t in self.outputs]
        return [*self._group.pick_in(view.node_ins[self._k]), *self._group.pick_out(view.node_outs[self._k])]


class _ById(Sequence):
    def __init__(self, view: TypeView):
        self._view = view

    def __len__(self) -> int:
        return len(self._view.lst)

    def __getitem__(self, vid):
        if isinstance(vid, slice):
            return [Vertex(self._view, i) for i in range(len(self))[vid]]
        if vid < 0:
            vid += len(self._view.lst)
            if vid < 0:
                raise IndexError(vid)
        return Vertex(self._view, vid)  # the view's arrays raise IndexError past the end

    def __iter__(self) -> Iterator[Vertex]:
        view = self._view
        return (Vertex(view, i) for i in range(len(view.lst)))


class _Vertices(Mapping):
    """Readable "node:param" key -> :class:`Vertex`, resolved through the node index."""

    def __init__(self, view: TypeView):
        self._view = view

    def __getitem__(self, key: str) -> Vertex:
        return Vertex(self._view, self._view.id_of(key))

    def __iter__(self) -> Iterator[str]:
        view = self._view
        return (view.key(i) for i in range(len(view.lst)))

    def __len__(self) -> int:
        return len(self._view.lst)


class _NodeVertices(Mapping):
    """Node name -> its vertex keys (float or not)."""

    def __init__(self, view: TypeView):
        self._view = view

    def __getitem__(self, name: str) -> list[str]:
        view = self._view
        if name not in view.node_index:
            raise KeyError(name)
        return [view.key(i) for i in view.ids_of_node(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._view.node_index)

    def __len__(self) -> int:
        return len(self._view.node_index)


class _GraphOfNode(Mapping):
    """Node name -> graph id of the graph holding it."""

    def __init__(self, view: TypeView):
        self._view = view

    def __getitem__(self, name: str) -> str:
        view = self._view
        return view.scope_gids[view.node_scope[view.node_index[name]]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._view.node_index)

    def __len__(self) -> int:
        return len(self._view.node_index)


def build_type_view(
    graph: ModelIndex,
    lists: Mapping[str, frozenset[str]],
    *,
    low: Precision,
    provider: str,
    kernels,
    block_nodes: Iterable[str] = (),
    keep_io_types: bool | AbstractSet[str] = True,
    initializer_inputs: Iterable[str] = (),
    ort_version: str | None = None,
) -> TypeView:
    """Build vertices and edges for the main graph and all bodies, in one pass over the nodes."""
    block = [re.compile(p) for p in block_nodes]
    view = TypeView()
    view.constants = graph.constants
    pinned = view.pinned
    tensors = graph.tensors
    # Element type of every tensor, as the vertices see it: sequences/optionals of float are not
    # float32 tensors (they never change type); None when unknown.
    codes = {name: (NOT_A_TENSOR if info.init is None and info.kind not in (TENSOR_KIND, None) else info.dtype)
             for name, info in tensors.items()}
    floats = frozenset(name for name, code in codes.items() if code == FLOAT)
    float_kinds: dict[Group, Kind] = {}  # the kind of a group's unblocked vertex on float32 tensors only
    ops: dict[tuple[str, str], OpInfo] = {}
    layouts: dict[tuple[str, str, int, int], tuple[OpInfo, list[Group], Tied | None]] = {}
    kinds: dict[tuple, Kind] = {}
    capable_cache: dict[tuple, tuple[bool, str]] = {}
    identity_casts: dict[OpInfo, list[Group]] = {}
    block_hits: set[str] = set()
    control_flow: list[tuple[str, onnx.NodeProto]] = []

    def capability(op: OpInfo, param: str) -> tuple[bool, str]:
        key = (op.op_type, op.domain, param)
        found = capable_cache.get(key)
        if found is None:
            found = capable_cache[key] = kernel_capability(op, param, provider, kernels, low.name, low.type_str)
        return found

    def layout(op_type: str, domain: str, n_in: int, n_out: int) -> tuple[OpInfo, list[Group], Tied | None]:
        op = ops.get((op_type, domain))
        if op is None:
            op = ops[(op_type, domain)] = OpInfo(op_type, domain, graph.opset_of(domain), lists, ort_version)
        groups = [Group(op, *g) for g in schema_layout(op_type, domain, op.opset, n_in, n_out, ort_version)]
        ties = kernels.tied_params(provider, domain, op_type, op.opset) if op.schema is not None else ()
        return op, groups, merge_tied_params(groups, ties)

    for name in initializer_inputs:
        # IR < 4 style (keep_initializers_as_inputs): callers may feed it, so its type is fixed.
        pinned[name] = "graph input that is also an initializer"
    node_index, node_scope = view.node_index, view.node_scope
    v_node, v_kind = view.v_node, view.v_kind
    add_node, add_kind, code_of = v_node.append, v_kind.append, codes.__getitem__
    # The tensors each float32 vertex reads and writes, in id order: link makes the edges from them.
    reads: list[Sequence[str]] = []
    writes: list[Sequence[str]] = []
    add_reads, add_writes = reads.append, writes.append
    for scope_index, scope in enumerate(graph.scopes):
        graph_id, g = scope.gid, scope.graph
        view.scope_gids.append(graph_id)
        node_scope.extend(array("i", [scope_index]) * len(g.node))
        scope_name = "graph" if graph_id == "" else f"body {graph_id}"
        # Main-graph I/O that keeps its type is pinned; the rest the rewrite lowers at the interface.
        for name in scope.inputs:
            if graph_id != "" or keeps_io(keep_io_types, name):
                pinned.setdefault(name, f"input of {scope_name}")
        for t in g.output:
            if graph_id != "" or keeps_io(keep_io_types, t.name):
                pinned.setdefault(t.name, f"output of {scope_name}")
        # An outer tensor a body reads is not pinned: the read is an edge like any other (link), so
        # a body reads the outer value in the type its producer writes, or one Cast of it made in
        # the outer graph (rewrite/casts.py), never a Cast per branch.
        # The index read every node's names once; the view shares its lists' tuples.
        first = len(view.node_ins)
        node_index.update(zip(scope.names, itertools.count(first)))  # normalize made node names unique
        view.node_ins += scope.ins
        view.node_outs += scope.outs
        for k, node, ins, outs in zip(itertools.count(first), g.node, scope.ins, scope.outs):
            op_type = node.op_type
            lkey = (op_type, node.domain, len(ins), len(outs))
            found = layouts.get(lkey)
            if found is None:
                found = layouts[lkey] = layout(op_type, node.domain or "", len(ins), len(outs))
            op, groups, tied = found
            if tied is not None:
                groups = tied.for_node(ins, outs, code_of)
            if op_type == "Cast" and _identity_cast(node, ins, code_of):
                view.identity_casts[outs[0]] = ins[0]
                groups = identity_casts.get(op)
                if groups is None:
                    groups = identity_casts[op] = [identity_group(op, lists)]
            if op.special:
                if op_type == "Constant":
                    for out in outs:
                        view.constant_at[out] = (scope_index, k - first)
                elif op_type in CONTROL_FLOW:
                    control_flow.append((graph_id, node))
                    view.control_flow.append(k)
            if "" in ins or "" in outs:
                groups = present_groups(groups, ins, outs)
            blocked = None
            if block:
                node_name = scope.names[k - first]
                hits = [p.pattern for p in block if p.search(node_name)]
                block_hits.update(hits)
                blocked = hits[0] if hits else None
            for group in groups:
                in_names, out_names = group.pick_in(ins), group.pick_out(outs)
                # Most vertices read and write float32 tensors only: their kind is known by group,
                # with no tuple of dtypes to build.
                all_float = blocked is None and floats.issuperset(in_names) and floats.issuperset(out_names)
                kind = float_kinds.get(group) if all_float else None
                if kind is None:
                    signature = (group, blocked, *map(code_of, in_names), *map(code_of, out_names))
                    kind = kinds.get(signature)
                    if kind is None:
                        kind = kinds[signature] = decide(group, signature[2:], len(in_names), blocked, capability)
                    if all_float:
                        float_kinds[group] = kind
                add_node(k)
                add_kind(kind)
                if kind.special:
                    vid = len(v_kind) - 1
                    if kind.float_only:
                        in_names, out_names = _cut_to_floats(view, vid, group, ins, outs, codes)
                    if op_type in RETARGETABLE and out_names and not in_names:
                        view.retargetable.append(vid)
                if kind.float32:
                    add_reads(in_names)
                    add_writes(out_names)
    del codes
    require(len(node_index) == len(view.node_ins), "color", "node names unique across all graphs (normalize)")
    view.node_names = list(node_index)
    nodes = np.frombuffer(v_node, dtype=np.intc) if v_node else np.zeros(0, np.intc)
    view.node_first = array("i", np.searchsorted(nodes, np.arange(len(node_index) + 1)).astype(np.intc).tobytes())
    # One matcher view per graph, built lazily, reading the index's types and shapes.
    types, shapes = Lookup(graph.dtype), Lookup(graph.dims)
    facts = [GraphFacts(scope.graph, types, shapes) for scope in graph.scopes]
    if fuses_norms(graph, kernels, provider, low):
        view.fused = fused_units(view, graph, facts, kernels, provider, low)
    tanh_gelu_cubes(view, graph, facts)
    view.lst = list(map(attrgetter("list"), v_kind))
    view.list_codes = bytes(map(LIST_CODES.__getitem__, view.lst))
    view.f32 = bytearray(map(attrgetter("float32"), v_kind))
    view.ok = bytearray(map(attrgetter("ok"), v_kind))

    for pattern in block:
        if pattern.pattern not in block_hits:
            log.warning("block pattern %r matches no node name; nothing is blocked by it", pattern.pattern)

    view.groups = [g for g in control_flow_groups(control_flow) if all(graph.dtype(t) == FLOAT for _, t in g.members)]
    link(view, list(itertools.chain.from_iterable(reads)), array("i", map(len, reads)),
          list(itertools.chain.from_iterable(writes)), array("i", map(len, writes)))
    return view


def _identity_cast(node: onnx.NodeProto, ins: Sequence[str], code_of) -> bool:
    """A Cast from float32 to float32: exporters write them (torch's ``.to(torch.float32)`` of a
    float32 tensor), and ORT drops them at load (CastElimination)."""
    if not ins or code_of(ins[0]) != FLOAT:
        return False
    return any(a.name == "to" and a.i == FLOAT for a in node.attribute)


def _cut_to_floats(view: TypeView, vid: int, group: Group, ins, outs, codes) -> tuple[list[str], list[str]]:
    """An op without schema: its float tensors only form the vertex."""
    inputs = [(i, ins[i]) for i in group.in_idx if codes[ins[i]] == FLOAT]
    outputs = [(i, outs[i]) for i in group.out_idx if codes[outs[i]] == FLOAT]
    view.float_io[vid] = (inputs, outputs)
    return [t for _, t in inputs], [t for _, t in outputs]


