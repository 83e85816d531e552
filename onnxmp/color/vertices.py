"""The vertices the coloring paints: (node, type-constraint parameter) pairs (``docs/coloring.md``).

All inputs and outputs of a node that share a type parameter in the op schema
form one vertex and change dtype together.  Only vertices whose tensors are
float32 take part; edges run producer vertex -> consumer vertex, one per
float32 tensor that links them inside the same graph.

The view follows TF's GraphTypeTopologyView: a vertex is an int, numbered in node
order; what many vertices share (op, type parameter and positions, and the facts
their dtypes, list and block match give) is one shared :class:`_Kind`; fan-in and
fan-out are flat int arrays.  :class:`Vertex` reads one id for reports and
callers; the view holds no object per vertex.
"""
from __future__ import annotations

import functools
import itertools
import logging
import re
from array import array
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import AbstractSet, Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx

from onnxmp.contrib_types import runtime_schema
from onnxmp.domains import op_key
from onnxmp.fusions import FusedNorm, GraphFacts, Lookup, fast_gelus, fused_norms
from onnxmp.index import TENSOR_KIND, ModelIndex, keeps_io
from onnxmp.lists import list_of
from onnxmp.passes import require
from onnxmp.precision import Precision
from onnxmp.subgraphs import GRAPH

log = logging.getLogger("onnxmp.color")

# Ops that define their float output from an attribute; make_casts_allow_if_all_outputs_allow may retarget them.
RETARGETABLE = ("Cast", "Constant", "ConstantOfShape")
CONTROL_FLOW = ("If", "Loop", "Scan")

# TypeView.list_codes: the list of each vertex's op as a byte (0: on no list), for array masks.
LIST_CODES = {None: 0, "allow": 1, "deny": 2, "infer": 3, "clear": 4}

_WHOLE_NODE = "*"  # param of the single vertex of an op with no known schema
NOT_A_TENSOR = -1  # dtype marker for sequence/optional/map values
FLOAT = onnx.TensorProto.FLOAT


@dataclass
class ColorGroup:
    """Tensors bound across a control-flow boundary that must share one type (TF's force_color_match).

    ``members`` are (graph id, tensor name); ``must_allow`` are the tensors whose
    producer vertex must be ALLOW (values computed in a body), ``must_not_deny``
    those whose producer may be anything but DENY (an outer initial value: one
    Cast outside the loop is cheap).  ``low_inputs`` are (node, input index)
    positions of the control-flow node that then read the low-precision value.
    """

    kind: str
    node: str
    index: int
    output: str              # the control-flow node's output bound to the group
    members: list[tuple[str, str]]
    must_allow: list[str]
    must_not_deny: list[str] = field(default_factory=list)
    low_inputs: list[tuple[str, int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.kind} `{self.node}` #{self.index}"


@dataclass
class FusedUnit:
    """A subgraph ORT runs as one normalization kernel that computes in float32 (``onnxmp.fusions``).

    Colored as the kernel it becomes: its ``statistics`` nodes are on no list (the kernel computes
    them in float32 whatever precision surrounds them), and its ``affine`` vertices (the scale
    ``Mul`` and bias ``Add``) take the precision of its ``input`` (see
    ``follow_input_in_fused_normalizations``)."""

    norm: FusedNorm
    graph: str
    affine: list[int]                       # vertex ids of the scale Mul and the bias Add
    readers: list[tuple[str, str]] = field(default_factory=list)  # (statistics node, input) reading ``input``


class _OpInfo:
    """What every node of one (op type, domain) shares: schema and list."""

    __slots__ = ("op_type", "domain", "opset", "key", "schema", "list", "special")

    def __init__(self, op_type: str, domain: str, opset: int, lists: Mapping[str, frozenset[str]],
                 ort_version: str | None = None):
        self.op_type, self.domain, self.opset = op_type, domain, opset
        self.key = op_key(op_type, domain)
        self.schema = _schema(op_type, domain, opset, ort_version)
        self.list = list_of(self.key, lists)
        self.special = op_type in RETARGETABLE or op_type in CONTROL_FLOW  # the view records these nodes


class _Group:
    """One type parameter of one (op, arity): the input and output positions that share it."""

    __slots__ = ("op", "param", "in_idx", "out_idx", "pick_in", "pick_out", "in_mask")

    def __init__(self, op: _OpInfo, param: str, in_idx: tuple[int, ...], out_idx: tuple[int, ...]):
        self.op, self.param, self.in_idx, self.out_idx = op, param, in_idx, out_idx
        self.pick_in, self.pick_out = _picker(in_idx), _picker(out_idx)
        self.in_mask = sum(1 << i for i in in_idx)  # bit i for input i (the rewrite's low inputs)


def _picker(positions: tuple[int, ...]):
    """A C-level function that takes these positions of a tuple, as a tuple."""
    if not positions:
        return itemgetter(slice(0, 0))
    if positions == tuple(range(positions[0], positions[-1] + 1)):
        return itemgetter(slice(positions[0], positions[-1] + 1))
    return itemgetter(*positions)  # two or more positions here: itemgetter gives a tuple


class _Kind:
    """What a vertex is: its op's type-parameter group and the facts its dtypes, list and block
    match give.  Shared by every vertex with the same group, dtypes and block match."""

    __slots__ = ("group", "list", "type_known", "float32", "processed", "capable", "why_not", "float_only",
                 "ok", "special")

    def __init__(self, group: _Group):
        self.group, self.list = group, group.op.list
        self.type_known = self.float32 = self.processed = self.capable = False
        self.why_not = ""
        self.float_only = False  # an op without schema: only its float tensors form the vertex
        self.ok = False          # processed, float32 and low-precision capable: may join ALLOW
        self.special = False     # float_only, or an op the passes look up by id (RETARGETABLE)

    def settle(self) -> _Kind:
        self.ok = bool(self.processed and self.float32 and self.capable)
        self.special = self.float_only or self.group.op.op_type in RETARGETABLE
        return self

    def copy(self) -> _Kind:
        new = _Kind(self.group)
        for name in _Kind.__slots__:
            setattr(new, name, getattr(self, name))
        return new


class Adjacency:
    """Fan-in or fan-out of every vertex as one flat int array (CSR): ``adj[v]`` is v's list."""

    __slots__ = ("start", "flat")

    def __init__(self, start: array, flat: array):
        self.start, self.flat = start, flat

    def __getitem__(self, vid: int) -> array:
        return self.flat[self.start[vid]:self.start[vid + 1]]

    def __len__(self) -> int:
        return len(self.start) - 1


class TypeView:
    """Vertices of every graph plus fan-in/fan-out over float32 tensors (built by :func:`build_type_view`).

    Per vertex (index = vertex id): ``v_node`` (node index), ``v_kind`` (shared :class:`_Kind`:
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
        self.v_kind: list[_Kind] = []
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


def _schema(op_type: str, domain: str, opset: int, ort_version: str | None = None):
    """onnx's schema, or onnxruntime's (``ort_version``'s) for the domains it registers; None for
    an op no schema knows."""
    return runtime_schema(op_type, domain, opset, ort_version)


def _params(schema: onnx.defs.OpSchema | None, formals: Sequence, count: int) -> list[str | None]:
    """Type parameter of each actual input/output; None for fixed types like tensor(int64)."""
    if schema is None:
        return [_WHOLE_NODE] * count
    type_params = {tc.type_param_str for tc in schema.type_constraints}
    out: list[str | None] = []
    for i in range(count):
        if not formals:
            out.append(None)
            continue
        formal = formals[min(i, len(formals) - 1)]
        if i >= len(formals) and formal.option != onnx.defs.OpSchema.FormalParameterOption.Variadic:
            out.append(None)
            continue
        param = formal.type_str if formal.type_str in type_params else None
        # Heterogeneous variadics (Loop/If/Scan "V") give each position its own type.
        if param and formal.option == onnx.defs.OpSchema.FormalParameterOption.Variadic \
                and not formal.is_homogeneous:
            param = f"{param}#{i}"
        out.append(param)
    return out


@functools.lru_cache(maxsize=None)
def _layout(op_type: str, domain: str, opset: int, n_in: int, n_out: int, ort_version: str | None = None
            ) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]:
    """The vertices of one (op, arity) in the order their first position appears (inputs, then
    outputs): (param, input positions, output positions)."""
    schema = _schema(op_type, domain, opset, ort_version)
    positions: dict[str, tuple[list[int], list[int]]] = {}
    for side, formals, count in ((0, schema.inputs if schema else (), n_in),
                                 (1, schema.outputs if schema else (), n_out)):
        for i, param in enumerate(_params(schema, formals, count)):
            if param is not None:
                positions.setdefault(param, ([], []))[side].append(i)
    return tuple((param, tuple(ins), tuple(outs)) for param, (ins, outs) in positions.items())


class _Tied:
    """An op's vertices with the kernel's tied type parameters merged (see merge_tied_params)."""

    __slots__ = ("plain", "ties", "groups")

    def __init__(self, plain: list[_Group], ties: tuple[frozenset[str], ...], groups: list[_Group]):
        self.plain, self.ties, self.groups = plain, ties, groups

    def for_node(self, ins: Sequence[str], outs: Sequence[str], code_of) -> list[_Group]:
        """The node's vertices: the cached merge when every tied tensor is float32 (or of unknown
        type), else a merge of only the parameters whose tensors are."""
        def floats(g: _Group) -> bool:
            return all(code_of(ins[i]) in _FLOAT_OR_UNKNOWN for i in g.in_idx if ins[i]) and \
                all(code_of(outs[i]) in _FLOAT_OR_UNKNOWN for i in g.out_idx if outs[i])

        if all(map(floats, self.plain)):
            return self.groups
        merged = merge_tied_params(self.plain, self.ties, floats)
        return merged.groups if merged is not None else self.plain


_FLOAT_OR_UNKNOWN = (onnx.TensorProto.FLOAT, None)


def merge_tied_params(groups: list[_Group], ties: tuple[frozenset[str], ...], floats=None) -> _Tied | None:
    """One vertex for the type parameters the target's kernel binds to one type.

    ONNX lets BatchNormalization-15 type X (T) apart from scale/B (T1) and mean/var (T2), but
    ORT's CUDA kernel is registered for T1 = T2 = T: a node with float16 X and float32 scale
    has no CUDA kernel, and ORT runs it on the CPU with copies around it (ResNet-50 on an
    H200: 801 ms a batch instead of 7.3 ms).  Merged, the tied parameters are painted as one
    vertex and keep one type.  The merged vertex is named after the tied parameter that comes
    first.  ``floats(group)`` says whether a group may join: a parameter holding a bool mask
    is no float tensor, and the kernel does not bind it to one.  None when nothing merges.
    """
    merged, changed = list(groups), False
    for tie in ties:
        members = [g for g in merged if g.param.split("#")[0] in tie and (floats is None or floats(g))]
        if len(members) < 2:
            continue
        head = members[0]
        in_idx = tuple(sorted(i for g in members for i in g.in_idx))
        out_idx = tuple(sorted(i for g in members for i in g.out_idx))
        merged = [_Group(head.op, head.param, in_idx, out_idx) if g is head else g
                  for g in merged if g is head or g not in members]
        changed = True
    return _Tied(list(groups), tuple(ties), merged) if changed else None


def _present(groups: list[_Group], ins: Sequence[str], outs: Sequence[str]) -> list[_Group]:
    """A node with empty (omitted) optional names: its vertices cover named positions only, in the
    order their first named position appears."""
    found = []
    for g in groups:
        in_idx = tuple(i for i in g.in_idx if ins[i])
        out_idx = tuple(i for i in g.out_idx if outs[i])
        if in_idx or out_idx:
            first = in_idx[0] if in_idx else len(ins) + out_idx[0]
            found.append((first, _Group(g.op, g.param, in_idx, out_idx)))
    found.sort(key=lambda item: item[0])
    return [g for _, g in found]


def allows_type(schema: onnx.defs.OpSchema | None, param: str, type_str: str) -> bool | None:
    if schema is None:
        return None
    base = param.split("#")[0]
    for tc in schema.type_constraints:
        if tc.type_param_str == base:
            return type_str in tc.allowed_type_strs
    return None


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
    float_kinds: dict[_Group, _Kind] = {}  # the kind of a group's unblocked vertex on float32 tensors only
    ops: dict[tuple[str, str], _OpInfo] = {}
    layouts: dict[tuple[str, str, int, int], tuple[_OpInfo, list[_Group], _Tied | None]] = {}
    kinds: dict[tuple, _Kind] = {}
    capable_cache: dict[tuple, tuple[bool, str]] = {}
    identity_casts: dict[_OpInfo, list[_Group]] = {}
    block_hits: set[str] = set()
    control_flow: list[tuple[str, onnx.NodeProto]] = []

    def capability(op: _OpInfo, param: str) -> tuple[bool, str]:
        key = (op.op_type, op.domain, param)
        found = capable_cache.get(key)
        if found is None:
            found = capable_cache[key] = _capability(op, param, provider, kernels, low.name, low.type_str)
        return found

    def layout(op_type: str, domain: str, n_in: int, n_out: int) -> tuple[_OpInfo, list[_Group], _Tied | None]:
        op = ops.get((op_type, domain))
        if op is None:
            op = ops[(op_type, domain)] = _OpInfo(op_type, domain, graph.opset_of(domain), lists, ort_version)
        groups = [_Group(op, *g) for g in _layout(op_type, domain, op.opset, n_in, n_out, ort_version)]
        ties = kernels.tied_params(provider, domain, op_type, op.opset) if op.schema is not None else ()
        return op, groups, merge_tied_params(groups, ties)

    for name in initializer_inputs:
        # IR < 4 style (keep_initializers_as_inputs): callers may feed it, so its type is fixed.
        pinned[name] = "graph input that is also an initializer"
    bodies_of: dict[int, list[int]] = {}
    for body_index, body in enumerate(graph.scopes):
        if body.parent_scope is not None:
            bodies_of.setdefault(body.parent_scope, []).append(body_index)

    node_index, node_scope = view.node_index, view.node_scope
    v_node, v_kind = view.v_node, view.v_kind
    add_node, add_kind, code_of = v_node.append, v_kind.append, codes.__getitem__
    # The tensors each float32 vertex reads and writes, in id order: _link makes the edges from them.
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
        # Bodies are scopes too, listed in node and attribute order: no need to walk every node here.
        for body_index in bodies_of.get(scope_index, ()):
            for t in graph.outer_references(body_index):
                pinned.setdefault(t, f"read by a subgraph of {graph.scopes[body_index].parent.name}")
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
                    groups = identity_casts[op] = [_identity_group(op, lists)]
            if op.special:
                if op_type == "Constant":
                    for out in outs:
                        view.constant_at[out] = (scope_index, k - first)
                elif op_type in CONTROL_FLOW:
                    control_flow.append((graph_id, node))
                    view.control_flow.append(k)
            if "" in ins or "" in outs:
                groups = _present(groups, ins, outs)
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
                        kind = kinds[signature] = _decide(group, signature[2:], len(in_names), blocked, capability)
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
    if _fuses_norms(graph, kernels, provider, low):
        view.fused = _fused_units(view, graph, facts, kernels, provider, low)
    _tanh_gelu_cubes(view, graph, facts)
    view.lst = list(map(attrgetter("list"), v_kind))
    view.list_codes = bytes(map(LIST_CODES.__getitem__, view.lst))
    view.f32 = bytearray(map(attrgetter("float32"), v_kind))
    view.ok = bytearray(map(attrgetter("ok"), v_kind))

    for pattern in block:
        if pattern.pattern not in block_hits:
            log.warning("block pattern %r matches no node name; nothing is blocked by it", pattern.pattern)

    view.groups = [g for g in _control_flow_groups(control_flow) if all(graph.dtype(t) == FLOAT for _, t in g.members)]
    _link(view, list(itertools.chain.from_iterable(reads)), array("i", map(len, reads)),
          list(itertools.chain.from_iterable(writes)), array("i", map(len, writes)))
    return view


def _fuses_norms(graph: ModelIndex, kernels, provider: str, low: Precision) -> bool:
    """The target's fused normalization kernels compute in float32 for ``low`` (CUDA: yes)."""
    opset = graph.opset_of("")
    return all(kernels.computes_in_float32(provider, "", op, opset, low.name)
               for op in ("LayerNormalization", "SimplifiedLayerNormalization"))


def _fused_units(view: TypeView, graph: ModelIndex, facts: list[GraphFacts], kernels, provider: str,
                 low: Precision) -> list[FusedUnit]:
    """The normalizations ORT fuses, colored as the kernels they become: statistics on no list."""
    units = []
    for scope, scope_facts in zip(graph.scopes, facts):
        for norm in fused_norms(scope_facts, strict=False):
            numerics = kernels.numerics(provider, "", norm.kind, graph.opset_of(""), low.name)
            why = (f"computed in float32 inside the {norm.kind} kernel ORT fuses this subgraph into "
                   f"({numerics['file'].split(' ')[0]})")
            for name in (*norm.statistics, *norm.casts):
                for vid in view.ids_of_node(name):
                    kind = view.v_kind[vid].copy()
                    kind.list, kind.processed, kind.why_not = None, False, why
                    view.v_kind[vid] = kind.settle()
            affine = [vid for name in norm.affine for vid in view.ids_of_node(name) if view.v_kind[vid].float32]
            readers = [(name, norm.input) for name in norm.statistics
                       if norm.input in view.node_ins[view.node_index[name]]]
            units.append(FusedUnit(norm, scope.gid, affine, readers))
    return units


def _identity_cast(node: onnx.NodeProto, ins: Sequence[str], code_of) -> bool:
    """A Cast from float32 to float32: exporters write them (torch's ``.to(torch.float32)`` of a
    float32 tensor), and ORT drops them at load (CastElimination)."""
    if not ins or code_of(ins[0]) != FLOAT:
        return False
    return any(a.name == "to" and a.i == FLOAT for a in node.attribute)


def _identity_group(op: _OpInfo, lists: Mapping[str, frozenset[str]]) -> _Group:
    """An identity Cast as one clear vertex over its input and output (as Identity), so colors
    pass through it; a low-precision one is retargeted to a low-to-low Cast, which ORT drops."""
    identity = _OpInfo(op.op_type, op.domain, op.opset, lists)
    identity.list = "clear"
    return _Group(identity, "T1", (0,), (0,))


def _tanh_gelu_cubes(view: TypeView, graph: ModelIndex, facts: list[GraphFacts]) -> None:
    """The ``Pow(x, 3)`` of a tanh GELU (``onnxmp.fusions.fast_gelus``) is no deny op: where ``x**3``
    overflows, ``tanh`` has reached +-1 and the GELU its limits (x or 0), fused by ORT or not."""
    for scope_facts in facts:
        for match in fast_gelus(scope_facts):
            for vid in view.ids_of_node(match[0]):
                kind = view.v_kind[vid]
                if kind.list == "deny":
                    kind = kind.copy()
                    kind.list = "infer"
                    view.v_kind[vid] = kind.settle()
                    view.notes[vid] = "the cube of a tanh GELU: overflow gives the GELU's limits"


def _cut_to_floats(view: TypeView, vid: int, group: _Group, ins, outs, codes) -> tuple[list[str], list[str]]:
    """An op without schema: its float tensors only form the vertex."""
    inputs = [(i, ins[i]) for i in group.in_idx if codes[ins[i]] == FLOAT]
    outputs = [(i, outs[i]) for i in group.out_idx if codes[outs[i]] == FLOAT]
    view.float_io[vid] = (inputs, outputs)
    return [t for _, t in inputs], [t for _, t in outputs]


def _link(view: TypeView, read: list[str], n_read: array, written: list[str], n_written: array) -> None:
    """Edges producer -> consumer over float32 tensors, in first-link order: tensors in the order
    they are first read, each tensor's readers in id order; no edge crosses a graph boundary
    (bodies are colored on their own) except the control-flow groups' ephemeral ones.

    ``read``/``written`` are the tensors each float32 vertex reads/writes, in id order, and
    ``n_read``/``n_written`` how many per vertex.  Also records ``producer_of`` and the readers
    of the tensors the passes ask about (retargetable outputs, group members)."""
    n = len(view.v_kind)
    floats = np.flatnonzero(np.frombuffer(view.f32, dtype=np.uint8))
    # A produced tensor is known by its (last) position in ``written``: no second name map.
    position = dict(zip(written, itertools.count()))
    writer = np.repeat(floats, n_written).astype(np.intc)
    view.producer_of = _Producers(position, array("i", writer.tobytes()))
    source = np.fromiter(map(position.get, read, itertools.repeat(-1)), dtype=np.int64, count=len(read))
    reader = np.repeat(floats, n_read).astype(np.intc)
    linked = np.flatnonzero(source >= 0)
    # Edges grouped by tensor in the order tensors are first read, then in read (= id) order.
    tensor = source[linked]
    first_read = np.zeros(len(written), dtype=np.int64)
    unique, first = np.unique(tensor, return_index=True)
    first_read[unique] = linked[first]
    order = np.argsort(first_read[tensor], kind="stable")
    src_np, dst_np = writer[tensor[order]], reader[linked[order]]
    view.consumers_of = _readers_of(view, read, source, reader, position)

    if len(view.scope_gids) > 1 and len(src_np):
        scope = np.frombuffer(view.node_scope, dtype=np.intc)[np.frombuffer(view.v_node, dtype=np.intc)]
        same = scope[src_np] == scope[dst_np]
        src_np, dst_np = src_np[same], dst_np[same]
    extra_src, extra_dst = [], []
    for group in view.groups:
        # TF colors one flat graph where NextIteration/Merge edges close the loop; here the
        # group's producers are linked to the group's consumers (ephemeral edges) so the passes
        # see through the boundary (a body Add between this iteration's MatMul and the next
        # one's is "between allow ops").  force_color_match settles the group afterwards.
        producers = [view.producer_of[t] for t in group.must_allow + group.must_not_deny if t in view.producer_of]
        consumers = [c for _, t in group.members for c in view.consumers_of[t]
                     if view.v_kind[c].group.op.op_type not in CONTROL_FLOW]
        for p in producers:
            extra_src.extend([p] * len(consumers))
            extra_dst.extend(consumers)
    for unit in view.fused:
        # The kernel reads the input and writes the affine output: the passes see it as one op
        # between the input's producer and the readers of its output.
        producer = view.producer_of.get(unit.norm.input)
        if producer is not None and unit.affine:
            extra_src.append(producer)
            extra_dst.append(unit.affine[0])
    if extra_src:
        src_np = np.concatenate([src_np, np.asarray(extra_src, dtype=np.intc)])
        dst_np = np.concatenate([dst_np, np.asarray(extra_dst, dtype=np.intc)])
    # One edge per (producer, consumer): a consumer may read several outputs of one vertex, or
    # one tensor twice.
    pair = src_np.astype(np.int64) * n + dst_np
    _, first = np.unique(pair, return_index=True)
    if len(first) < len(pair):
        first.sort()
        src_np, dst_np = src_np[first], dst_np[first]
    view.fanout = _adjacency(src_np, dst_np, n)
    view.fanin = _adjacency(dst_np, src_np, n)


def _readers_of(view: TypeView, read: list[str], source: np.ndarray, reader: np.ndarray,
                position: dict[str, int]) -> dict[str, list[int]]:
    """The float32 vertices reading each tensor the passes ask about (outputs of capable
    retargetable vertices, control-flow group members), in id order, across graphs."""
    ok = view.ok
    asked = [t for vid in view.retargetable if ok[vid] for t in view.output_names(vid)]
    asked += [t for group in view.groups for _, t in group.members]
    if not asked:
        return {}
    by_source = np.argsort(source, kind="stable")
    sorted_source, sorted_reader = source[by_source], reader[by_source]
    found: dict[str, list[int]] = {}
    unproduced = set()
    produced = []
    for t in asked:
        if t in position:
            produced.append(t)
        else:
            unproduced.add(t)
    # Each produced tensor's readers are one run of the readers sorted by what they read.
    written_at = np.fromiter(map(position.__getitem__, produced), dtype=np.int64, count=len(produced))
    low = np.searchsorted(sorted_source, written_at).tolist()
    high = np.searchsorted(sorted_source, written_at + 1).tolist()
    for t, lo, hi in zip(produced, low, high):
        found[t] = list(dict.fromkeys(sorted_reader[lo:hi].tolist()))  # read order; one may read t twice
    if unproduced:  # graph and body inputs in groups: found by name
        for t in unproduced:
            found[t] = []
        for i, t in enumerate(read):
            if t in unproduced:
                found[t].append(int(reader[i]))
        for t in unproduced:
            found[t] = list(dict.fromkeys(found[t]))
    return found


class _Producers(Mapping):
    """Tensor name -> the float32 vertex id writing it (the last one, as a dict would keep)."""

    def __init__(self, position: dict[str, int], writer: array):
        self._position, self._writer = position, writer

    def __getitem__(self, name: str) -> int:
        return self._writer[self._position[name]]

    def __contains__(self, name) -> bool:
        return name in self._position

    def __iter__(self) -> Iterator[str]:
        return iter(self._position)

    def __len__(self) -> int:
        return len(self._position)


def _adjacency(keys: np.ndarray, values: np.ndarray, n: int) -> Adjacency:
    order = np.argsort(keys, kind="stable")  # stable: each list keeps first-link order
    start = np.zeros(n + 1, dtype=np.intc)
    np.cumsum(np.bincount(keys, minlength=n), out=start[1:])
    return Adjacency(array("i", start.tobytes()), array("i", values[order].astype(np.intc).tobytes()))


def _control_flow_groups(nodes: Iterable[tuple[str, onnx.NodeProto]]) -> list[ColorGroup]:
    """Loop carried values and scan outputs, If outputs, Scan state and scan outputs of the
    If/Loop/Scan ``nodes`` (graph id, node)."""
    groups: list[ColorGroup] = []
    for graph_id, node in nodes:
        bodies = {a.name: a.g for a in node.attribute if a.type == GRAPH}
        if node.op_type == "If" and "then_branch" in bodies and "else_branch" in bodies:
            then_g, else_g = bodies["then_branch"], bodies["else_branch"]
            for i, out in enumerate(node.output):
                if i >= len(then_g.output) or i >= len(else_g.output):
                    continue
                t, e = then_g.output[i].name, else_g.output[i].name
                groups.append(ColorGroup("If output", node.name, i, out,
                                         [(graph_id, out), (f"{node.name}/then_branch", t),
                                          (f"{node.name}/else_branch", e)], must_allow=[t, e]))
        elif node.op_type in ("Loop", "Scan") and "body" in bodies:
            groups += _loop_or_scan_groups(graph_id, node, bodies["body"])
    return groups


def _loop_or_scan_groups(graph_id: str, node: onnx.NodeProto, body: onnx.GraphProto) -> list[ColorGroup]:
    body_id = f"{node.name}/body"
    inputs, outputs = list(node.input), list(node.output)
    inits = {t.name for t in body.initializer}
    body_inputs = [t.name for t in body.input if t.name not in inits]  # GS's graph inputs
    if node.op_type == "Loop":
        n_state = len(inputs) - 2
        first_in, first_body_in, first_body_out = 2, 2, 1
    else:
        # Scan-8 reads a leading sequence_lens (possibly "") that its body does not see; Scan-9+ has none.
        scan_inputs = next((a.i for a in node.attribute if a.name == "num_scan_inputs"), 0)
        first_in = max(0, len(inputs) - len(body_inputs))
        n_state = len(inputs) - first_in - int(scan_inputs)
        first_body_in, first_body_out = 0, 0
    groups = []
    for i in range(n_state):
        outer_in = inputs[first_in + i]
        body_in = body_inputs[first_body_in + i]
        body_out = body.output[first_body_out + i].name
        if not outer_in or i >= len(outputs):
            continue
        groups.append(ColorGroup(f"{node.op_type} carried value", node.name, i, outputs[i],
                                 [(graph_id, outer_in), (body_id, body_in), (body_id, body_out),
                                  (graph_id, outputs[i])],
                                 must_allow=[body_out], must_not_deny=[outer_in],
                                 low_inputs=[(node.name, first_in + i)]))
    for k, body_out in enumerate(body.output[first_body_out + n_state:]):
        out_index = n_state + k
        if out_index >= len(outputs):
            break
        groups.append(ColorGroup(f"{node.op_type} scan output", node.name, out_index, outputs[out_index],
                                 [(body_id, body_out.name), (graph_id, outputs[out_index])],
                                 must_allow=[body_out.name]))
    return groups


def _decide(group: _Group, dtypes: Sequence, n_in: int, blocked: str | None, capability) -> _Kind:
    """The facts of a vertex from its tensors' dtypes (inputs first, ``n_in`` of them), then TF's
    ShouldProcess (node level) and SupportsF16 (vertex level)."""
    op = group.op
    kind = _Kind(group)
    known = [d for d in dtypes if d is not None]
    has_in, has_out = n_in > 0, len(dtypes) > n_in
    if known:
        kind.type_known = True
        kind.float32 = known.count(FLOAT) == len(known)
        if NOT_A_TENSOR in known:
            kind.why_not = "a sequence or optional value, not a tensor"
    if op.schema is None and not kind.float32:
        floats = [i for i, d in enumerate(dtypes) if d == FLOAT]
        if floats:
            kind.float_only = kind.float32 = True
            has_in, has_out = floats[0] < n_in, floats[-1] >= n_in
    if not kind.type_known:
        kind.why_not = "type unknown (shape inference could not type its tensors)"
    elif not kind.float32:
        kind.why_not = kind.why_not or "not float32"
    elif blocked is not None:
        kind.why_not = f"node name matches block pattern {blocked!r}"
    elif op.list is None and not (op.op_type in RETARGETABLE and has_out and not has_in):
        kind.why_not = f"op {op.key} is on no list"
    else:
        kind.processed = True
        kind.capable, why_not = capability(op, group.param)
        if why_not:
            kind.why_not = why_not
    return kind.settle()


def _capability(op: _OpInfo, param: str, provider: str, kernels, low_name: str, low_type_str: str
                ) -> tuple[bool, str]:
    """Whether the schema and the provider's kernel take the low-precision type (same for every
    vertex of one op type and type parameter)."""
    if op.schema is not None and allows_type(op.schema, param, low_type_str) is False:
        return False, (f"the ONNX schema of {op.key} (opset {op.opset}) does not allow {low_name} "
                       f"for {param}")
    if op.op_type == "Constant":
        return True, ""  # folded at session creation; needs no kernel
    base = None if param == _WHOLE_NODE else param.split("#")[0]
    if base is not None and base in kernels.float32_params(provider, op.domain, op.op_type, op.opset):
        return False, f"the {provider} kernel of {op.key} reads {base} as float32 (kernel facts)"
    supported = kernels.supports(provider, op.domain, op.op_type, op.opset, base, low_name)
    if supported is None:
        return False, f"no {provider} kernel for {op.key} at opset {op.opset}"
    if not supported:
        return False, f"no {provider} {low_name} kernel for {op.key} ({param}) at opset {op.opset}"
    return True, ""
