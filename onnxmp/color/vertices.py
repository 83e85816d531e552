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
import onnx_graphsurgeon as gs

from onnxmp.graphs import is_tensor, iter_graphs, onnx_dtype, opset_of, outer_references
from onnxmp.lists import list_of, op_key

log = logging.getLogger("onnxmp.color")

# Ops that define their float output from an attribute; spec §5.8 may retarget them.
RETARGETABLE = ("Cast", "Constant", "ConstantOfShape")

_WHOLE_NODE = "*"  # param of the single vertex of an op with no known schema
NOT_A_TENSOR = -1  # dtype marker for sequence/optional/map values


@dataclass
class Vertex:
    key: str                 # "<node name>:<param>"
    node: str
    op: str                  # list key: OpType or domain:OpType
    op_type: str
    domain: str
    opset: int
    param: str
    graph: str               # graph id (see onnxmp.graphs.MAIN)
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
    """Vertices of every graph plus fan-in/fan-out over float32 tensors."""

    vertices: dict[str, Vertex]
    fanin: dict[str, list[str]]
    fanout: dict[str, list[str]]
    node_vertices: dict[str, list[str]]       # node name -> its vertex keys (float or not)
    producer_of: dict[str, str]               # tensor name -> producing vertex key
    consumers_of: dict[str, list[str]]        # tensor name -> consuming vertex keys (same graph)
    pinned: dict[str, str]                    # tensor name -> why its dtype may not change
    graph_of_node: dict[str, str]
    unknown_schema: dict[str, str]            # node name -> op key, for the report
    groups: list[ColorGroup] = field(default_factory=list)


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
    graph: gs.Graph,
    lists: Mapping[str, frozenset[str]],
    *,
    low_type: int,
    provider: str,
    kernels,
    block_nodes: Iterable[str] = (),
    keep_io_types: bool = True,
    initializer_inputs: Iterable[str] = (),
) -> TypeView:
    """Build vertices and edges for the main graph and all bodies."""
    block = [re.compile(p) for p in block_nodes]
    low_name = onnx.helper.tensor_dtype_to_np_dtype(low_type).name if low_type != onnx.TensorProto.BFLOAT16 \
        else "bfloat16"
    low_type_str = f"tensor({low_name})"
    vertices: dict[str, Vertex] = {}
    node_vertices: dict[str, list[str]] = {}
    graph_of_node: dict[str, str] = {}
    pinned: dict[str, str] = {}
    unknown_schema: dict[str, str] = {}
    tensor_dtype: dict[str, int | None] = {}
    block_hits: set[str] = set()

    for name in initializer_inputs:
        # IR < 4 style (keep_initializers_as_inputs): callers may feed it, so its type is fixed.
        pinned[name] = "graph input that is also an initializer"
    for graph_id, g, _parent in iter_graphs(graph):
        scope = "graph" if graph_id == "" else f"body {graph_id}"
        if graph_id != "" or keep_io_types:
            for t in g.inputs:
                pinned.setdefault(t.name, f"input of {scope}")
            for t in g.outputs:
                pinned.setdefault(t.name, f"output of {scope}")
        for node in g.nodes:
            for value in node.attrs.values():
                if isinstance(value, gs.Graph):
                    for t in outer_references(value):
                        pinned.setdefault(t.name, f"read by a subgraph of {node.name}")
        for node in g.nodes:
            graph_of_node[node.name] = graph_id
            domain = node.domain or ""
            opset = opset_of(g, domain)
            key = op_key(node.op, domain)
            schema = _schema(node.op, domain, opset)
            if schema is None:
                unknown_schema[node.name] = key
            groups: dict[str, Vertex] = {}
            in_params = _params(schema, schema.inputs if schema else (), len(node.inputs))
            out_params = _params(schema, schema.outputs if schema else (), len(node.outputs))
            for side, tensors, params in (("in", node.inputs, in_params), ("out", node.outputs, out_params)):
                for index, (tensor, param) in enumerate(zip(tensors, params)):
                    if param is None or not tensor.name:
                        continue
                    vertex = groups.get(param)
                    if vertex is None:
                        vertex = groups[param] = Vertex(
                            key=f"{node.name}:{param}", node=node.name, op=key, op_type=node.op,
                            domain=domain, opset=opset, param=param, graph=graph_id)
                    (vertex.inputs if side == "in" else vertex.outputs).append((index, tensor.name))
                    # Sequences/optionals of float are not float32 tensors: they never change type.
                    tensor_dtype[tensor.name] = onnx_dtype(tensor) if is_tensor(tensor) else NOT_A_TENSOR
            hits = [p.pattern for p in block if p.search(node.name)]
            block_hits.update(hits)
            blocked = hits[0] if hits else None
            node_list = list_of(key, lists)
            for vertex in groups.values():
                dtypes = [tensor_dtype[t] for t in vertex.tensors]
                known = [d for d in dtypes if d is not None]
                vertex.type_known = bool(known)
                vertex.float32 = bool(known) and all(d == onnx.TensorProto.FLOAT for d in known)
                if NOT_A_TENSOR in known:
                    vertex.why_not = "a sequence or optional value, not a tensor"
                if schema is None and not vertex.float32:
                    # An op without schema: its float tensors only form the vertex (spec §1).
                    floats = [t for t in vertex.tensors if tensor_dtype[t] == onnx.TensorProto.FLOAT]
                    if floats:
                        vertex.inputs = [(i, t) for i, t in vertex.inputs if t in floats]
                        vertex.outputs = [(i, t) for i, t in vertex.outputs if t in floats]
                        vertex.float32 = True
                vertex.list = node_list
                _decide_processing(vertex, schema, node, node_list, blocked, provider, kernels,
                                   low_name, low_type_str)
                vertices[vertex.key] = vertex
            node_vertices[node.name] = [v.key for v in groups.values()]

    for pattern in block:
        if pattern.pattern not in block_hits:
            log.warning("block pattern %r matches no node name; nothing is blocked by it", pattern.pattern)
    # Dicts serve as ordered sets while edges are collected: a tensor read by every layer
    # (an attention mask) would make list membership tests quadratic.
    producer_of: dict[str, str] = {}
    consumer_sets: dict[str, dict[str, None]] = {}
    for v in vertices.values():
        if v.float32:
            for _, t in v.outputs:
                producer_of[t] = v.key
    for v in vertices.values():
        if v.float32:
            for _, t in v.inputs:
                consumer_sets.setdefault(t, {})[v.key] = None
    fanin_sets: dict[str, dict[str, None]] = {k: {} for k in vertices}
    fanout_sets: dict[str, dict[str, None]] = {k: {} for k in vertices}
    for t, consumers in consumer_sets.items():
        src = producer_of.get(t)
        if src is None:
            continue
        for dst in consumers:
            # Bodies are colored on their own: no edge crosses a graph boundary.
            if vertices[src].graph == vertices[dst].graph:
                fanout_sets[src][dst] = None
                fanin_sets[dst][src] = None
    groups = [g for g in control_flow_groups(graph) if all(tensor_dtype.get(t, _float_of(graph, gid, t))
                                                           == onnx.TensorProto.FLOAT for gid, t in g.members)]
    for group in groups:
        # TF colors one flat graph where NextIteration/Merge edges close the loop; here the
        # group's producers are linked to the group's consumers so the passes see through
        # the boundary (a body Add between this iteration's MatMul and the next one's is
        # "between allow ops").  force_color_match settles the group afterwards.
        producers = [producer_of[t] for t in group.must_allow + group.must_not_deny if t in producer_of]
        consumers = [c for _, t in group.members for c in consumer_sets.get(t, {})
                     if vertices[c].op_type not in ("If", "Loop", "Scan")]
        for src in producers:
            for dst in consumers:
                fanout_sets[src][dst] = None
                fanin_sets[dst][src] = None
    consumers_of = {t: list(c) for t, c in consumer_sets.items()}
    fanin = {k: list(v) for k, v in fanin_sets.items()}
    fanout = {k: list(v) for k, v in fanout_sets.items()}
    return TypeView(vertices, fanin, fanout, node_vertices, producer_of, consumers_of, pinned,
                    graph_of_node, unknown_schema, groups)


def _float_of(graph: gs.Graph, graph_id: str, name: str) -> int | None:
    for gid, g, _ in iter_graphs(graph):
        if gid == graph_id:
            for t in g.inputs + g.outputs:
                if t.name == name:
                    return onnx_dtype(t)
    return None


def control_flow_groups(graph: gs.Graph) -> list[ColorGroup]:
    """Loop carried values and scan outputs, If outputs, Scan state and scan outputs."""
    groups: list[ColorGroup] = []
    for graph_id, g, _ in iter_graphs(graph):
        for node in g.nodes:
            if node.op == "If" and isinstance(node.attrs.get("then_branch"), gs.Graph):
                then_g, else_g = node.attrs["then_branch"], node.attrs["else_branch"]
                for i, out in enumerate(node.outputs):
                    if i >= len(then_g.outputs) or i >= len(else_g.outputs):
                        continue
                    t, e = then_g.outputs[i].name, else_g.outputs[i].name
                    groups.append(ColorGroup("If output", node.name, i, out.name,
                                             [(graph_id, out.name), (f"{node.name}/then_branch", t),
                                              (f"{node.name}/else_branch", e)], must_allow=[t, e]))
            elif node.op in ("Loop", "Scan") and isinstance(node.attrs.get("body"), gs.Graph):
                groups += _loop_or_scan_groups(graph_id, node)
    return groups


def _loop_or_scan_groups(graph_id: str, node: gs.Node) -> list[ColorGroup]:
    body: gs.Graph = node.attrs["body"]
    body_id = f"{node.name}/body"
    if node.op == "Loop":
        n_state = len(node.inputs) - 2
        first_in, first_body_in, first_body_out = 2, 2, 1
    else:
        # Scan-8 reads a leading sequence_lens (possibly "") that its body does not see; Scan-9+ has none.
        first_in = max(0, len(node.inputs) - len(body.inputs))
        n_state = len(node.inputs) - first_in - int(node.attrs.get("num_scan_inputs", 0))
        first_body_in, first_body_out = 0, 0
    groups = []
    for i in range(n_state):
        outer_in = node.inputs[first_in + i]
        body_in = body.inputs[first_body_in + i]
        body_out = body.outputs[first_body_out + i]
        if not outer_in.name or i >= len(node.outputs):
            continue
        groups.append(ColorGroup(f"{node.op} carried value", node.name, i, node.outputs[i].name,
                                 [(graph_id, outer_in.name), (body_id, body_in.name), (body_id, body_out.name),
                                  (graph_id, node.outputs[i].name)],
                                 must_allow=[body_out.name], must_not_deny=[outer_in.name],
                                 low_inputs=[(node.name, first_in + i)]))
    for k, body_out in enumerate(body.outputs[first_body_out + n_state:]):
        out_index = n_state + k
        if out_index >= len(node.outputs):
            break
        groups.append(ColorGroup(f"{node.op} scan output", node.name, out_index, node.outputs[out_index].name,
                                 [(body_id, body_out.name), (graph_id, node.outputs[out_index].name)],
                                 must_allow=[body_out.name]))
    return groups


def _decide_processing(vertex: Vertex, schema, node: gs.Node, node_list: str | None, blocked: str | None,
                       provider: str, kernels, low_name: str, low_type_str: str) -> None:
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
    retargetable = node.op in RETARGETABLE and any(True for _ in vertex.outputs) and not vertex.inputs
    if node_list is None and not retargetable:
        vertex.why_not = f"op {vertex.op} is on no list"
        return
    vertex.processed = True
    if schema is not None and allows_type(schema, vertex.param, low_type_str) is False:
        vertex.why_not = f"the ONNX schema of {vertex.op} (opset {vertex.opset}) does not allow {low_name} for {vertex.param}"
        return
    if node.op == "Constant":
        vertex.capable = True  # folded at session creation; needs no kernel
        return
    param = None if vertex.param == _WHOLE_NODE else vertex.param.split("#")[0]
    supported = kernels.supports(provider, vertex.domain, node.op, vertex.opset, param, low_name)
    if supported is None:
        vertex.why_not = f"no {provider} kernel for {vertex.op} at opset {vertex.opset}"
    elif not supported:
        vertex.why_not = f"no {provider} {low_name} kernel for {vertex.op} ({vertex.param}) at opset {vertex.opset}"
    else:
        vertex.capable = True
