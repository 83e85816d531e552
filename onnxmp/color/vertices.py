"""The vertices the coloring paints: (node, type-constraint parameter) pairs (spec §1).

All inputs and outputs of a node that share a type parameter in the op schema
form one vertex and change dtype together.  Only vertices whose tensors are
float32 take part; edges run producer vertex -> consumer vertex, one per
float32 tensor that links them inside the same graph.
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import onnx

from onnxmp.graphs import GRAPH, TENSOR_KIND, ModelGraph, may_hold_graphs
from onnxmp.lists import list_of, op_key
from onnxmp.precision import Precision

log = logging.getLogger("onnxmp.color")

# Ops that define their float output from an attribute; spec §5.8 may retarget them.
RETARGETABLE = ("Cast", "Constant", "ConstantOfShape")

_WHOLE_NODE = "*"  # param of the single vertex of an op with no known schema
NOT_A_TENSOR = -1  # dtype marker for sequence/optional/map values


@dataclass(slots=True)
class Vertex:
    key: str                 # "<node name>:<param>"
    node: str
    op: str                  # list key: OpType or domain:OpType
    op_type: str
    domain: str
    opset: int
    param: str
    graph: str               # graph id (see onnxmp.graphs.MAIN)
    id: int = -1             # index into TypeView.by_id; the passes work on these
    inputs: list[tuple[int, str]] = field(default_factory=list)   # (input index, tensor name)
    outputs: list[tuple[int, str]] = field(default_factory=list)  # (output index, tensor name)
    float32: bool = False
    type_known: bool = False
    list: str | None = None
    processed: bool = False
    capable: bool = False    # schema and kernel accept the low-precision type
    why_not: str = ""        # why not processed / not capable

    @property
    def tensors(self) -> list[str]:
        return [t for _, t in self.inputs] + [t for _, t in self.outputs]  # small; callers don't loop on it


@dataclass
class ColorGroup:
    """Tensors bound across a control-flow boundary that must share one type (spec §5.7).

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
class TypeView:
    """Vertices of every graph plus fan-in/fan-out over float32 tensors.

    TF's GraphTypeTopologyView: vertices are ints (``Vertex.id``), fan-in and fan-out
    int lists, control-flow groups add explicit edges.  ``vertices`` maps the
    readable key to the same records for reports and callers.
    """

    by_id: list[Vertex]
    fanin: list[list[int]]
    fanout: list[list[int]]
    node_vertices: dict[str, list[str]]       # node name -> its vertex keys (float or not)
    producer_of: dict[str, int]               # tensor name -> producing float32 vertex id
    consumers_of: dict[str, list[int]]        # tensor name -> consuming float32 vertex ids (same graph)
    pinned: dict[str, str]                    # tensor name -> why its dtype may not change
    graph_of_node: dict[str, str]
    unknown_schema: dict[str, str]            # node name -> op key, for the report
    groups: list[ColorGroup] = field(default_factory=list)
    vertices: dict[str, Vertex] = field(default_factory=dict)

    def __post_init__(self):
        if not self.vertices:
            self.vertices = {v.key: v for v in self.by_id}


@functools.lru_cache(maxsize=None)
def _schema(op_type: str, domain: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None


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


def allows_type(schema: onnx.defs.OpSchema | None, param: str, type_str: str) -> bool | None:
    if schema is None:
        return None
    base = param.split("#")[0]
    for tc in schema.type_constraints:
        if tc.type_param_str == base:
            return type_str in tc.allowed_type_strs
    return None


def build_type_view(
    graph: ModelGraph,
    lists: Mapping[str, frozenset[str]],
    *,
    low: Precision,
    provider: str,
    kernels,
    block_nodes: Iterable[str] = (),
    keep_io_types: bool = True,
    initializer_inputs: Iterable[str] = (),
) -> TypeView:
    """Build vertices and edges for the main graph and all bodies, in one pass over the nodes."""
    block = [re.compile(p) for p in block_nodes]
    low_name, low_type_str = low.name, low.type_str
    by_id: list[Vertex] = []
    node_vertices: dict[str, list[str]] = {}
    graph_of_node: dict[str, str] = {}
    pinned: dict[str, str] = {}
    unknown_schema: dict[str, str] = {}
    tensor_dtype: dict[str, object] = {}
    tensors = graph.tensors
    FLOAT = onnx.TensorProto.FLOAT
    ops: dict[tuple[str, str], _OpInfo] = {}
    block_hits: set[str] = set()
    capable_cache: dict[tuple, tuple[bool, str]] = {}

    def capability(vertex: Vertex, op: _OpInfo) -> tuple[bool, str]:
        key = (op.op_type, op.domain, vertex.param)
        found = capable_cache.get(key)
        if found is None:
            found = capable_cache[key] = _capability(vertex, op, provider, kernels, low_name, low_type_str)
        return found

    def dtype_of(name: str):
        info = tensors[name]
        # Sequences/optionals of float are not float32 tensors: they never change type.
        if info.init is None and info.kind != TENSOR_KIND:
            return NOT_A_TENSOR
        return info.dtype

    for name in initializer_inputs:
        # IR < 4 style (keep_initializers_as_inputs): callers may feed it, so its type is fixed.
        pinned[name] = "graph input that is also an initializer"
    bodies_of: dict[int, list[int]] = {}
    for body_index, body in enumerate(graph.scopes):
        if body.parent_scope is not None:
            bodies_of.setdefault(body.parent_scope, []).append(body_index)
    for scope_index, scope in enumerate(graph.scopes):
        graph_id, g = scope.gid, scope.graph
        scope_name = "graph" if graph_id == "" else f"body {graph_id}"
        if graph_id != "" or keep_io_types:
            init_names = {t.name for t in g.initializer}
            for t in g.input:
                if t.name not in init_names:
                    pinned.setdefault(t.name, f"input of {scope_name}")
            for t in g.output:
                pinned.setdefault(t.name, f"output of {scope_name}")
        # Bodies are scopes too, listed in node and attribute order: no need to walk every node here.
        for body_index in bodies_of.get(scope_index, ()):
            for t in graph.outer_references(body_index):
                pinned.setdefault(t, f"read by a subgraph of {graph.scopes[body_index].parent.name}")
        for node in g.node:
            node_name, op_type, domain = node.name, node.op_type, node.domain or ""
            graph_of_node[node_name] = graph_id
            op = ops.get((op_type, domain))
            if op is None:
                op = ops[(op_type, domain)] = _OpInfo(op_type, domain, graph.opset_of(domain), lists)
            if op.schema is None:
                unknown_schema[node_name] = op.key
            groups: dict[str, Vertex] = {}
            node_inputs, node_outputs = node.input, node.output
            in_params, out_params = op.params(len(node_inputs), len(node_outputs))
            for side, names, params in ((False, node_inputs, in_params), (True, node_outputs, out_params)):
                for index, (tensor, param) in enumerate(zip(names, params)):
                    if param is None or not tensor:
                        continue
                    vertex = groups.get(param)
                    if vertex is None:
                        vertex = groups[param] = Vertex(f"{node_name}:{param}", node_name, op.key, op_type, domain,
                                                        op.opset, param, graph_id)
                    (vertex.outputs if side else vertex.inputs).append((index, tensor))
                    if tensor not in tensor_dtype:
                        tensor_dtype[tensor] = dtype_of(tensor)
            blocked = None
            if block:
                hits = [p.pattern for p in block if p.search(node_name)]
                block_hits.update(hits)
                blocked = hits[0] if hits else None
            keys = []
            for vertex in groups.values():
                dtypes = [tensor_dtype[t] for _, t in vertex.inputs]
                dtypes += [tensor_dtype[t] for _, t in vertex.outputs]
                if None in dtypes:
                    dtypes = [d for d in dtypes if d is not None]
                if dtypes:
                    vertex.type_known = True
                    vertex.float32 = dtypes.count(FLOAT) == len(dtypes)
                    if NOT_A_TENSOR in dtypes:
                        vertex.why_not = "a sequence or optional value, not a tensor"
                if op.schema is None and not vertex.float32:
                    # An op without schema: its float tensors only form the vertex (spec §1).
                    floats = [t for t in vertex.tensors if tensor_dtype[t] == FLOAT]
                    if floats:
                        vertex.inputs = [(i, t) for i, t in vertex.inputs if t in floats]
                        vertex.outputs = [(i, t) for i, t in vertex.outputs if t in floats]
                        vertex.float32 = True
                vertex.list = op.list
                _decide_processing(vertex, op, blocked, capability)
                vertex.id = len(by_id)
                by_id.append(vertex)
                keys.append(vertex.key)
            node_vertices[node_name] = keys

    for pattern in block:
        if pattern.pattern not in block_hits:
            log.warning("block pattern %r matches no node name; nothing is blocked by it", pattern.pattern)
    # Edges run producer -> consumer over float32 tensors; dicts serve as ordered sets while
    # they are collected (a tensor read by every layer would make list membership quadratic).
    producer_of: dict[str, int] = {}
    consumer_sets: dict[str, dict[int, None]] = {}
    for v in by_id:
        if v.float32:
            for _, t in v.outputs:
                producer_of[t] = v.id
    for v in by_id:
        if v.float32:
            for _, t in v.inputs:
                consumer_sets.setdefault(t, {})[v.id] = None
    # Edge lists in first-link order; one set of src * n + dst keys dedupes them (a dict per
    # vertex and side cost more memory than the lists themselves).
    fanin: list[list[int]] = [[] for _ in by_id]
    fanout: list[list[int]] = [[] for _ in by_id]
    n_vertices = len(by_id)
    linked: set[int] = set()
    for t, consumers in consumer_sets.items():
        src = producer_of.get(t)
        if src is None:
            continue
        src_graph = by_id[src].graph
        for dst in consumers:
            # Bodies are colored on their own: no edge crosses a graph boundary.
            if by_id[dst].graph == src_graph:
                key = src * n_vertices + dst
                if key not in linked:
                    linked.add(key)
                    fanout[src].append(dst)
                    fanin[dst].append(src)

    def member_dtype(name: str):
        return tensor_dtype[name] if name in tensor_dtype else graph.dtype(name)

    groups = [g for g in control_flow_groups(graph) if all(member_dtype(t) == FLOAT for _, t in g.members)]
    for group in groups:
        # TF colors one flat graph where NextIteration/Merge edges close the loop; here the
        # group's producers are linked to the group's consumers (ephemeral edges) so the passes
        # see through the boundary (a body Add between this iteration's MatMul and the next
        # one's is "between allow ops").  force_color_match settles the group afterwards.
        producers = [producer_of[t] for t in group.must_allow + group.must_not_deny if t in producer_of]
        consumers = [c for _, t in group.members for c in consumer_sets.get(t, {})
                     if by_id[c].op_type not in ("If", "Loop", "Scan")]
        for src in producers:
            for dst in consumers:
                key = src * n_vertices + dst
                if key not in linked:
                    linked.add(key)
                    fanout[src].append(dst)
                    fanin[dst].append(src)
    consumers_of = {t: list(c) for t, c in consumer_sets.items()}
    return TypeView(by_id, fanin, fanout, node_vertices, producer_of, consumers_of, pinned, graph_of_node,
                    unknown_schema, groups)


class _OpInfo:
    """What every node of one (op type, domain) shares: schema, list, type parameters by arity."""

    __slots__ = ("op_type", "domain", "opset", "key", "schema", "list", "_params")

    def __init__(self, op_type: str, domain: str, opset: int, lists: Mapping[str, frozenset[str]]):
        self.op_type, self.domain, self.opset = op_type, domain, opset
        self.key = op_key(op_type, domain)
        self.schema = _schema(op_type, domain, opset)
        self.list = list_of(self.key, lists)
        self._params: dict[tuple[int, int], tuple[list, list]] = {}

    def params(self, n_in: int, n_out: int) -> tuple[list, list]:
        found = self._params.get((n_in, n_out))
        if found is None:
            schema = self.schema
            found = self._params[(n_in, n_out)] = (_params(schema, schema.inputs if schema else (), n_in),
                                                   _params(schema, schema.outputs if schema else (), n_out))
        return found


def control_flow_groups(graph: ModelGraph) -> list[ColorGroup]:
    """Loop carried values and scan outputs, If outputs, Scan state and scan outputs."""
    groups: list[ColorGroup] = []
    for scope in graph.scopes:
        for node in scope.graph.node:
            if not may_hold_graphs(node):
                continue
            bodies = {a.name: a.g for a in node.attribute if a.type == GRAPH}
            if node.op_type == "If" and "then_branch" in bodies and "else_branch" in bodies:
                then_g, else_g = bodies["then_branch"], bodies["else_branch"]
                for i, out in enumerate(node.output):
                    if i >= len(then_g.output) or i >= len(else_g.output):
                        continue
                    t, e = then_g.output[i].name, else_g.output[i].name
                    groups.append(ColorGroup("If output", node.name, i, out,
                                             [(scope.gid, out), (f"{node.name}/then_branch", t),
                                              (f"{node.name}/else_branch", e)], must_allow=[t, e]))
            elif node.op_type in ("Loop", "Scan") and "body" in bodies:
                groups += _loop_or_scan_groups(scope.gid, node, bodies["body"])
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


def _decide_processing(vertex: Vertex, op: _OpInfo, blocked: str | None, capability) -> None:
    """TF's ShouldProcess (node level) and SupportsF16 (vertex level)."""
    if not vertex.type_known:
        vertex.why_not = "type unknown (shape inference could not type its tensors)"
        return
    if not vertex.float32:
        vertex.why_not = vertex.why_not or "not float32"
        return
    if blocked is not None:
        vertex.why_not = f"node name matches block pattern {blocked!r}"
        return
    retargetable = op.op_type in RETARGETABLE and bool(vertex.outputs) and not vertex.inputs
    if op.list is None and not retargetable:
        vertex.why_not = f"op {vertex.op} is on no list"
        return
    vertex.processed = True
    vertex.capable, why_not = capability(vertex, op)
    if why_not:
        vertex.why_not = why_not


def _capability(vertex: Vertex, op: _OpInfo, provider: str, kernels, low_name: str, low_type_str: str
                ) -> tuple[bool, str]:
    """Whether the schema and the provider's kernel take the low-precision type (same for every
    vertex of one op type and type parameter)."""
    if op.schema is not None and allows_type(op.schema, vertex.param, low_type_str) is False:
        return False, (f"the ONNX schema of {vertex.op} (opset {vertex.opset}) does not allow {low_name} "
                       f"for {vertex.param}")
    if op.op_type == "Constant":
        return True, ""  # folded at session creation; needs no kernel
    param = None if vertex.param == _WHOLE_NODE else vertex.param.split("#")[0]
    supported = kernels.supports(provider, vertex.domain, op.op_type, vertex.opset, param, low_name)
    if supported is None:
        return False, f"no {provider} kernel for {vertex.op} at opset {vertex.opset}"
    if not supported:
        return False, f"no {provider} {low_name} kernel for {vertex.op} ({vertex.param}) at opset {vertex.opset}"
    return True, ""
