"""The model as every stage sees it: the ModelProto itself plus one index built in one pass.

Stages read and edit the protobuf directly; what onnx-graphsurgeon would know about
each tensor (initializer or variable, dtype, shape, kind of type) is recorded here
by the same rules GS's importer applies, so that the emitted model is exactly what
a GS import/export round trip wrote (see :mod:`onnxmp.emit`).

Names are unique across the main graph and every subgraph once ``normalize`` ran
(ONNX forbids a subgraph from redefining an outer name), so one name -> tensor map
serves all graphs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, itemgetter
from typing import AbstractSet, Iterator

import onnx

MAIN = ""  # graph id of the main graph; subgraphs are "<node name>/<attribute>"


def keeps_io(keep_io_types: bool | AbstractSet[str], name: str) -> bool:
    """Whether main-graph input or output ``name`` keeps its declared type: ``keep_io_types`` is
    True (all do), False (none: float32 ones take the low-precision type) or the set of names
    that do (as :func:`onnxmp.convert` resolves a list of names and patterns)."""
    if isinstance(keep_io_types, bool):
        return keep_io_types
    return name in keep_io_types
GRAPH = onnx.AttributeProto.GRAPH
GRAPHS = onnx.AttributeProto.GRAPHS
TENSOR_KIND = "tensor_type"
TENSOR_OR_UNTYPED = frozenset({None, TENSOR_KIND})
GS_DEFAULT_OPSET = 11  # what onnx-graphsurgeon assumes for a model without an ai.onnx opset


# ai.onnx ops whose attributes hold graphs; nodes of other domains are checked one by one.
_GRAPH_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})
ONNX_DOMAINS = ("", "ai.onnx")
_NAME = attrgetter("name")
_NAME_OP_DOMAIN = attrgetter("name", "op_type", "domain")


def may_hold_graphs(node: onnx.NodeProto) -> bool:
    """Cheap filter for walks over every node: only these can have graph-valued attributes."""
    return node.op_type in _GRAPH_OPS or (node.domain not in ("", "ai.onnx") and len(node.attribute) > 0)


def holders(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes of ``graph`` (not of its bodies) that may hold graphs: ``may_hold_graphs`` in one
    comprehension, since walks call it on every node of every graph (usually to find none)."""
    return [n for n in graph.node
            if n.op_type in _GRAPH_OPS or (n.domain not in ("", "ai.onnx") and len(n.attribute) > 0)]


@dataclass
class NodeSummary:
    """A graph's own nodes as normalize needs them before the index exists, read in one pass:
    a pass over the nodes costs about 0.3 µs a node in protobuf's wrappers alone, more than
    reading a field or two of each."""

    names: list[str]                 # node names, in node order
    op_types: list[str]              # node op types, in node order
    domains: set[str]                # the domains nodes use
    holding: list[onnx.NodeProto]    # ``holders(graph)``


def summarize(graph: onnx.GraphProto) -> NodeSummary:
    """``graph``'s own nodes (not its bodies') in one pass."""
    rows = list(map(_NAME_OP_DOMAIN, graph.node))
    op_types = list(map(itemgetter(1), rows))
    domains = set(map(itemgetter(2), rows))
    plain = domains.issubset(ONNX_DOMAINS) and _GRAPH_OPS.isdisjoint(op_types)
    return NodeSummary(list(map(itemgetter(0), rows)), op_types, domains, [] if plain else holders(graph))


def iter_graphs(graph: onnx.GraphProto, graph_id: str = MAIN, parent: onnx.NodeProto | None = None,
                holding: list[onnx.NodeProto] | None = None
                ) -> Iterator[tuple[str, onnx.GraphProto, onnx.NodeProto | None]]:
    """The main graph, then every If/Loop/Scan body, depth first (the one subgraph walker).

    ``holding`` is ``holders(graph)`` when the caller has it already (it costs a pass over the nodes)."""
    yield graph_id, graph, parent
    for node in holders(graph) if holding is None else holding:
        for attr in node.attribute:
            if attr.type == GRAPH:
                yield from iter_graphs(attr.g, f"{node.name}/{attr.name}", node)


def proto_subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The bodies of an If/Loop/Scan NodeProto (GRAPH and GRAPHS attributes)."""
    if not may_hold_graphs(node):
        return
    for attr in node.attribute:
        if attr.type == GRAPH:
            yield attr.g
        elif attr.type == GRAPHS:
            yield from attr.graphs


def proto_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every NodeProto of ``graph`` and its bodies, each node before its bodies' nodes."""
    for node in graph.node:
        yield node
        for sub in proto_subgraphs(node):
            yield from proto_nodes(sub)


def iter_proto_graphs(graph: onnx.GraphProto, holding: list[onnx.NodeProto] | None = None
                      ) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph in it (node attributes of type GRAPH or GRAPHS), depth first;
    ``holding`` as in :func:`iter_graphs`."""
    yield graph
    for node in holders(graph) if holding is None else holding:
        for sub in proto_subgraphs(node):
            yield from iter_proto_graphs(sub)


_UNPARSED = object()


class TensorInfo:
    """What GS's importer would know about one tensor (first declaration wins, as in GS).

    ``shape`` is ints, dim_param strings and None for unknown dims (None when unknown);
    it is read from the declaration (or the initializer's dims) only when asked for: most
    tensors never need it.
    """

    __slots__ = ("name", "init", "dtype", "kind", "decl", "merged", "_shape")

    def __init__(self, name: str, init: onnx.TensorProto | None = None, dtype=None, shape=None,
                 kind: str | None = TENSOR_KIND, decl: onnx.ValueInfoProto | None = None):
        self.name = name
        self.init = init          # an initializer (a GS Constant)
        self.dtype = dtype        # ONNX element type (int), or None when unknown
        self.kind = kind          # TypeProto field: tensor_type, sequence_type, ...
        self.decl = decl          # the declaration the type came from
        self.merged = False       # True when several declarations were merged (GS overwrite rules)
        self._shape = shape

    @property
    def shape(self):
        if self._shape is _UNPARSED:
            self._shape = _shape_of(self.decl) if self.decl is not None else self.init.dims[:]  # [:]: 2x list()
        return self._shape

    @shape.setter
    def shape(self, value):
        self._shape = value

    def rank_and_dim(self, axis: int) -> tuple[int, int | str | None]:
        """``(len(shape), shape[axis])``: rank 0 for an unknown shape, None for a missing axis.
        A declaration's other dims are not parsed: the report reads one dim of thousands of
        activations whose shape nothing else reads."""
        if self._shape is _UNPARSED and self.decl is not None:
            dims = self.decl.type.tensor_type.shape.dim  # reading leaves an unset shape unset
            rank = len(dims)
            if not -rank <= axis < rank:
                return rank, None
            d = dims[axis]
            return rank, d.dim_value or d.dim_param or _dim(d)  # as _shape_of: WhichOneof only for 0 or unset
        shape = self.shape or ()
        rank = len(shape)
        return (rank, shape[axis]) if -rank <= axis < rank else (rank, None)


@dataclass
class Scope:
    """One graph: the main graph or a body, with the node owning it."""

    gid: str
    graph: onnx.GraphProto
    parent: onnx.NodeProto | None
    parent_scope: int | None
    # Each node's name and input and output names, in node order, read from the proto once (each
    # read of a field makes new strs): the view, the rewrite and the emitter all walk these.
    # An input is the very str its producer's output holds, so the names exist once.
    names: list[str] = field(default_factory=list)
    ins: list[tuple[str, ...]] = field(default_factory=list)
    outs: list[tuple[str, ...]] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # graph inputs that are no (dense) initializer of it
    non_tensor: bool = False  # some input, output or value_info is a sequence, optional, map...


class ModelGraph:
    """The normalized model and its tensor index; built once, in one pass per graph."""

    def __init__(self, model: onnx.ModelProto, holding: list[onnx.NodeProto] | None = None,
                 names: list[str] | None = None):
        """``holding`` (``holders(model.graph)``) and ``names`` (the main graph's node names, in
        order) when the caller has read them already."""
        self.model = model
        self.tensors: dict[str, TensorInfo] = {}
        self.scopes: list[Scope] = []
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
        self.domains = {o.domain: o.version for o in model.opset_import}
        # Every node reads only graph inputs, initializers of its own or an enclosing graph, and
        # outputs of earlier nodes.  Checked during the import, which reads each node's names anyway;
        # False may be a false alarm (normalize.is_sorted then decides), True is certain.
        self.in_order = True
        self._import(model.graph, MAIN, None, None, {}, holding, names)

    # -- GS importer rules ------------------------------------------------------------------
    def _import(self, g: onnx.GraphProto, gid: str, parent: onnx.NodeProto | None, parent_scope: int | None,
                outer: dict[str, str], holding: list[onnx.NodeProto] | None = None,
                names: list[str] | None = None) -> None:
        index = len(self.scopes)
        scope = Scope(gid, g, parent, parent_scope)
        self.scopes.append(scope)
        tensors = self.tensors
        local = set()  # names GS registers in this graph's own map (only the import reads them)
        # Into an empty map (the main graph) every declaration below is this graph's own: the set
        # is then made at once from the map after them instead of name by name.
        own = not tensors
        dense = set()
        for init in g.initializer:
            name = init.name
            dense.add(name)
            if name not in tensors:
                tensors[name] = TensorInfo(name, init, init.data_type, _UNPARSED)
                if not own:
                    local.add(name)
        for sparse in g.sparse_initializer:
            name = sparse.values.name
            if name not in tensors:
                tensors[name] = TensorInfo(name, init=sparse.values, dtype=sparse.values.data_type,
                                           shape=list(sparse.dims), kind="sparse_initializer")
                if not own:
                    local.add(name)
        kinds = set()  # the kinds of type the declarations have
        for vi in g.value_info:
            name = vi.name
            info = tensors.get(name)
            if info is None:
                # Most are tensors with an element type: _from_value_info's first case, inlined
                # (a set element type means the tensor_type field is the one set).
                elem = vi.type.tensor_type.elem_type
                if elem:
                    tensors[name] = TensorInfo(name, None, elem, _UNPARSED, TENSOR_KIND, vi)
                    if not own:
                        local.add(name)
                    continue
                info = tensors[name] = _from_value_info(vi, name)
                if not own:
                    local.add(name)
                kinds.add(info.kind)
            elif info.init is None and (own or name in local):
                # GS overwrites with more information: falsy dtype/shape (None, 0, []) are replaced.
                new = _from_value_info(vi, name)
                info.dtype = info.dtype or new.dtype
                info.shape = info.shape or new.shape
                info.merged = True
                kinds.add(new.kind)
            else:
                kinds.add(vi.type.WhichOneof("value"))
        if own:
            local = set(tensors)
        kinds.update(vi.type.WhichOneof("value") for vi in chain(g.input, g.output))
        scope.non_tensor = not kinds <= TENSOR_OR_UNTYPED
        init_names = dense | {t.values.name for t in g.sparse_initializer} if g.sparse_initializer else dense
        scope.inputs = [vi.name for vi in g.input if vi.name not in dense]
        for vi in g.input:
            name = vi.name
            if name not in init_names and name not in local:
                tensors[name] = _from_value_info(vi, name)
                local.add(name)
        for vi in g.output:
            name = vi.name
            if name not in local:
                tensors[name] = _from_value_info(vi, name)
                local.add(name)
        # Bodies are imported where their node stands (GS's first-declaration rule depends on it);
        # most graphs have none, and then the per-node check is skipped.
        has_bodies = bool(holders(g) if holding is None else holding)
        # Defined so far (in_order; once out of order, only what the tuples share): name -> its first str.
        known = dict(outer)
        for name in chain(dense, [""], [vi.name for vi in g.input]):
            known.setdefault(name, name)
        get = known.get
        add_ins, add_outs = scope.ins.append, scope.outs.append
        defined = self.in_order
        for node in g.node:
            read = node.input[:]  # a plain list: each read of a field makes new strs
            inputs = tuple(map(get, read))
            # Everything in `known` is indexed already: in order, the inputs need no look-up.
            if defined and None in inputs:
                defined = self.in_order = False
            if not defined:
                inputs = tuple(map(get, read, read))
            outputs = tuple(node.output[:])
            add_ins(inputs)
            add_outs(outputs)
            if has_bodies and may_hold_graphs(node):
                for attr in node.attribute:
                    if attr.type == GRAPH:
                        self._import(attr.g, f"{node.name}/{attr.name}", node, index, dict(known))
                defined = self.in_order
            if not defined:
                for name in inputs:
                    if name not in tensors and name:
                        tensors[name] = TensorInfo(name)
                        local.add(name)
            if not local.issuperset(outputs):  # usually every output is declared (inferred value_info)
                for name in outputs:
                    if name not in local and name:
                        tensors[name] = TensorInfo(name)
                        local.add(name)
            for name in outputs:  # also out of order: it still shares the strs (a loop beats update(zip()))
                known[name] = name
        scope.names = list(map(_NAME, g.node)) if names is None else names

    # -- queries ---------------------------------------------------------------------------------
    def opset_of(self, domain: str) -> int:
        if domain in ("", "ai.onnx"):
            return int(self.opset) if self.opset is not None else GS_DEFAULT_OPSET
        return int(self.domains.get(domain, 1))

    def dtype(self, name: str) -> int | None:
        """The element type of a plain tensor; None when unknown or for a sequence, optional, map or
        sparse value (such values never change type)."""
        info = self.tensors.get(name)
        if info is None or (info.init is None and info.kind != TENSOR_KIND):
            return None
        return info.dtype

    def node_count(self) -> int:
        return sum(len(s.graph.node) for s in self.scopes)

    def outer_references(self, scope_index: int) -> list[str]:
        """Variables a body (and its own bodies) reads from enclosing graphs."""
        scope = self.scopes[scope_index]
        defined = {vi.name for vi in scope.graph.input}
        for node in scope.graph.node:
            defined.update(node.output)
        seen: dict[str, None] = {}
        for node in scope.graph.node:
            for name in node.input:
                if name and name not in defined and not self._is_constant(name):
                    seen[name] = None
            for attr in node.attribute:
                if attr.type == GRAPH:
                    child = self.scope_of_graph(attr.g)
                    for name in self.outer_references(child):
                        if name not in defined:
                            seen[name] = None
        return list(seen)

    @functools.cached_property
    def constants(self) -> frozenset[str]:
        """Names of every initializer (dense or sparse) of every graph; read by several stages."""
        return frozenset(name for name, info in self.tensors.items() if info.init is not None)

    def _is_constant(self, name: str) -> bool:
        info = self.tensors.get(name)
        return info is not None and info.init is not None

    def scope_of_graph(self, g: onnx.GraphProto) -> int:
        if not hasattr(self, "_by_graph"):
            self._by_graph = {id(s.graph): i for i, s in enumerate(self.scopes)}
        return self._by_graph[id(g)]


def _from_value_info(vi: onnx.ValueInfoProto, name: str) -> TensorInfo:
    t = vi.type
    kind = t.WhichOneof("value")
    if kind == "tensor_type":  # the common case first
        return TensorInfo(name, None, t.tensor_type.elem_type, _UNPARSED, kind, vi)
    info = TensorInfo(name, decl=vi)
    if kind is None and t.ByteSize() == 0:  # a set oneof field always serializes to some bytes
        return info
    info.kind = kind
    if kind == "sequence_type":
        info.dtype = t.sequence_type.elem_type.tensor_type.elem_type
    elif kind == "map_type":
        info.dtype = t.map_type.value_type
    elif kind == "optional_type":
        info.dtype = t.optional_type.elem_type
    elif kind == "sparse_tensor_type":
        info.dtype = t.sparse_tensor_type.elem_type
    else:
        info.dtype = t.opaque_type
    info.shape = _UNPARSED
    return info


def _shape_of(vi: onnx.ValueInfoProto) -> list | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    # Most dims are a positive dim_value or a dim_param: read those without WhichOneof.
    return [d.dim_value or d.dim_param or _dim(d) for d in t.shape.dim]


def _dim(d: onnx.TensorShapeProto.Dimension):
    """An int, a dim_param string, or None when unset."""
    which = d.WhichOneof("value")
    return d.dim_value if which == "dim_value" else (d.dim_param if which else None)
