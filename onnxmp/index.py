"""The index every stage shares: the normalized ModelProto plus what is known of each tensor.

Built once, in one pass over each graph, after ``normalize`` made node names unique and
sorted every graph.  Tensor names are unique across the main graph and its bodies (ONNX
forbids a body from redefining an outer name), so one name -> :class:`TensorInfo` map serves
all graphs.  Each graph is a :class:`Scope` holding its node names and input/output name
tuples, read from the proto once: the coloring view, the rewrite and the writer walk these.
See ``docs/design.md`` (the index).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from itertools import chain
from typing import AbstractSet

import onnx

from onnxmp.domains import ASSUMED_ONNX_OPSET, is_onnx_domain, onnx_opset, opsets
from onnxmp.subgraphs import GRAPH, MAIN, holders, may_hold_graphs

TENSOR_KIND = "tensor_type"
_TENSOR_OR_UNTYPED = (TENSOR_KIND, None)  # None: declared without a type, or not at all


def keeps_io(keep_io_types: bool | AbstractSet[str], name: str) -> bool:
    """Whether main-graph input or output ``name`` keeps its declared type: ``keep_io_types`` is
    True (all do), False (none: float32 ones take the low-precision type) or the set of names
    that do (:class:`onnxmp.options.Options` resolves a list of names and patterns)."""
    if isinstance(keep_io_types, bool):
        return keep_io_types
    return name in keep_io_types


_UNPARSED = object()


class TensorInfo:
    """What the index knows of one tensor: the initializer holding it, its element type and the
    kind of its type (``tensor_type``, ``sequence_type``...), and the declaration it came from.

    ``shape`` is ints, dim_param strings and None for unknown dims (None when unknown); it is
    parsed from the declaration (or the initializer's dims) only when asked for.
    """

    __slots__ = ("name", "init", "dtype", "kind", "decl", "_shape")

    def __init__(self, name: str, init: onnx.TensorProto | None = None, dtype: int | None = None,
                 kind: str | None = TENSOR_KIND, decl: onnx.ValueInfoProto | None = None, shape=_UNPARSED):
        self.name = name
        self.init = init          # an initializer (dense, or a sparse one's values)
        self.dtype = dtype        # ONNX element type, or None when unknown
        self.kind = kind          # TypeProto field: tensor_type, sequence_type, ...; None when untyped
        self.decl = decl          # the declaration the type came from
        self._shape = shape

    @property
    def shape(self):
        if self._shape is _UNPARSED:
            if self.decl is not None:
                self._shape = _shape_of(self.decl)
            else:
                self._shape = list(self.init.dims) if self.init is not None else None
        return self._shape

    def rank_and_dim(self, axis: int) -> tuple[int, int | str | None]:
        """``(len(shape), shape[axis])``: rank 0 for an unknown shape, None for a missing axis."""
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
    names: list[str] = field(default_factory=list)                # node names, in node order
    ins: list[tuple[str, ...]] = field(default_factory=list)      # each node's input names
    outs: list[tuple[str, ...]] = field(default_factory=list)     # each node's output names
    inputs: list[str] = field(default_factory=list)  # graph inputs that are no initializer of the graph


class ModelIndex:
    """The normalized model and its tensor index; built once, in one pass per graph."""

    def __init__(self, model: onnx.ModelProto, holding: list[onnx.NodeProto] | None = None):
        """``holding``: ``holders(model.graph)`` when the caller has read it already."""
        self.model = model
        self.tensors: dict[str, TensorInfo] = {}
        self.scopes: list[Scope] = []
        self.opset = onnx_opset(model)
        self.domains = opsets(model)
        # Every node reads only graph inputs, initializers of its own or an enclosing graph, and
        # outputs of earlier nodes (checked on the way, as each node's names are read anyway).
        self.in_order = True
        self._index(model.graph, MAIN, None, None, frozenset(), holding)

    def _index(self, g: onnx.GraphProto, gid: str, parent: onnx.NodeProto | None, parent_scope: int | None,
               outer: AbstractSet[str], holding: list[onnx.NodeProto] | None = None) -> None:
        index = len(self.scopes)
        scope = Scope(gid, g, parent, parent_scope)
        self.scopes.append(scope)
        tensors = self.tensors
        dense = set()
        for init in g.initializer:
            dense.add(init.name)
            tensors.setdefault(init.name, TensorInfo(init.name, init, init.data_type))
        for sparse in g.sparse_initializer:
            values = sparse.values
            tensors.setdefault(values.name, TensorInfo(values.name, values, values.data_type, "sparse_initializer",
                                                       shape=list(sparse.dims)))
        scope.inputs = [vi.name for vi in g.input if vi.name not in dense]
        # The first declaration with a type wins; an initializer's own type wins over any.
        for vi in chain(g.input, g.value_info, g.output):
            info = tensors.get(vi.name)
            if info is None or (info.init is None and info.kind is None):
                tensors[vi.name] = _declared(vi)
        known = set(outer)
        known.update(dense, scope.inputs, [""])
        has_bodies = bool(holders(g) if holding is None else holding)
        for node in g.node:
            inputs = tuple(node.input)
            outputs = tuple(node.output)
            scope.ins.append(inputs)
            scope.outs.append(outputs)
            if self.in_order and not known.issuperset(inputs):
                self.in_order = False
            if has_bodies and may_hold_graphs(node):
                for attr in node.attribute:
                    if attr.type == GRAPH:
                        self._index(attr.g, f"{node.name}/{attr.name}", node, index, frozenset(known))
            known.update(outputs)
            for name in chain(inputs, outputs):
                if name and name not in tensors:
                    tensors[name] = TensorInfo(name, kind=None)  # read or written, declared nowhere
        scope.names = [node.name for node in g.node]

    # -- queries ---------------------------------------------------------------------------------
    def opset_of(self, domain: str) -> int:
        """The opset a node of ``domain`` is read at."""
        if is_onnx_domain(domain):
            return self.opset if self.opset is not None else ASSUMED_ONNX_OPSET
        return self.domains.get(domain, 1)

    def dtype(self, name: str) -> int | None:
        """The element type of a plain tensor; None when unknown or for a sequence, optional, map or
        sparse value (such values never change type)."""
        info = self.tensors.get(name)
        if info is None or (info.init is None and info.kind not in _TENSOR_OR_UNTYPED):
            return None
        return info.dtype

    def dims(self, name: str) -> tuple | None:
        """A tensor's shape as a tuple with None for each unknown dim (an empty dim_param too);
        None when the shape is unknown."""
        info = self.tensors.get(name)
        shape = None if info is None else info.shape
        return None if shape is None else tuple(None if d == "" else d for d in shape)

    def node_count(self) -> int:
        return sum(len(s.graph.node) for s in self.scopes)

    @functools.cached_property
    def constants(self) -> frozenset[str]:
        """Names of every initializer (dense or sparse) of every graph."""
        return frozenset(name for name, info in self.tensors.items() if info.init is not None)

    @functools.cached_property
    def initializer_inputs(self) -> tuple[str, ...]:
        """Main-graph inputs that are also main-graph initializers (exports with
        keep_initializers_as_inputs), in input order: callers may feed them."""
        dense = {t.name for t in self.model.graph.initializer}
        return tuple(vi.name for vi in self.model.graph.input if vi.name in dense)

    def outer_references(self, scope_index: int) -> list[str]:
        """Variables a body (and its own bodies) reads from enclosing graphs."""
        scope = self.scopes[scope_index]
        defined = set(scope.inputs)
        for outs in scope.outs:
            defined.update(outs)
        seen: dict[str, None] = {}
        for name in chain.from_iterable(scope.ins):
            if name and name not in defined and name not in self.constants:
                seen[name] = None
        for child, body in enumerate(self.scopes):
            if body.parent_scope == scope_index:
                for name in self.outer_references(child):
                    if name not in defined:
                        seen[name] = None
        return list(seen)


def _declared(vi: onnx.ValueInfoProto) -> TensorInfo:
    """A tensor as a declaration describes it; only plain and sparse tensors get an element type
    (sequences, optionals and maps never change type)."""
    t = vi.type
    kind = t.WhichOneof("value")
    dtype = None
    if kind in ("tensor_type", "sparse_tensor_type"):
        dtype = getattr(t, kind).elem_type or None
    return TensorInfo(vi.name, None, dtype, kind, vi)


def _shape_of(vi: onnx.ValueInfoProto) -> list | None:
    t = vi.type.tensor_type
    if vi.type.WhichOneof("value") != "tensor_type" or not t.HasField("shape"):
        return None
    return [_dim(d) for d in t.shape.dim]


def _dim(d: onnx.TensorShapeProto.Dimension) -> int | str | None:
    """An int, a dim_param string (a set but empty one stays ""), or None when unset."""
    which = d.WhichOneof("value")
    return d.dim_value if which == "dim_value" else (d.dim_param if which else None)
