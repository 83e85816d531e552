"""Stage 2: normalize.  Unique names, topological order, dtypes from shape inference.

Everything after this stage keys nodes and tensors by name, so names must be
unique across the main graph and all subgraphs.  The result is the model itself
(edited in place) and its :class:`~onnxmp.index.ModelIndex`.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from itertools import chain, compress
from operator import attrgetter

import onnx
from onnx import helper

from onnxmp.errors import OnnxMPError, first_line
from onnxmp.external import SKELETON_TENSOR_BYTES, skeleton
from onnxmp.contrib_types import has_foreign_ops, type_foreign_outputs
from onnxmp.domains import ONNX_DOMAINS, is_onnx_domain, opsets
from onnxmp.index import ModelIndex
from onnxmp.passes import require
from onnxmp.subgraphs import GRAPH, GRAPHS, bodies, holders, iter_graphs, iter_proto_graphs, may_hold_graphs

log = logging.getLogger("onnxmp.normalize")
_NAME = attrgetter("name")
_DOMAIN = attrgetter("domain")
_NAME_OP_DOMAIN = attrgetter("name", "op_type", "domain")
_GRAPH_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})

# The inputs whose propagated value onnx's own inference functions read: getShapeInput, the one
# caller of InferenceContext::getSymbolicInput in onnx 1.23's sources (these ops have called it
# since before 1.16, the oldest onnx pyproject allows).  tests/test_normalize_data_prop.py checks
# the rule against the installed onnx's own operator cases.
_SHAPE_INPUT = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0, "Resize": 3, "AffineGrid": 1}
_BUILTIN_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training"})


@dataclass
class NodeSummary:
    """A graph's own nodes as normalize needs them before the index exists, read in one pass
    (a pass over the nodes costs about 0.3 µs a node in protobuf's wrappers alone)."""

    names: list[str]                 # node names, in node order
    op_types: list[str]              # node op types, in node order
    domains: set[str]                # the domains nodes use
    holding: list[onnx.NodeProto]    # ``holders(graph)``


def summarize(graph: onnx.GraphProto) -> NodeSummary:
    """``graph``'s own nodes (not its bodies') in one pass."""
    rows = list(map(_NAME_OP_DOMAIN, graph.node))
    op_types = [row[1] for row in rows]
    domains = {row[2] for row in rows}
    plain = domains.issubset(ONNX_DOMAINS) and _GRAPH_OPS.isdisjoint(op_types)
    return NodeSummary([row[0] for row in rows], op_types, domains, [] if plain else holders(graph))


@dataclass
class Normalized:
    index: ModelIndex
    renamed_nodes: int                # nodes given a (unique) name
    resorted: bool                    # some graph was out of topological order
    inference_error: str | None = None
    foreign: bool = False             # some node is of an op onnx does not define (contrib_types typed it)

    @property
    def modified(self) -> bool:
        return bool(self.renamed_nodes) or self.resorted


def infer_types(model: onnx.ModelProto, nodes: NodeSummary | None = None
                ) -> tuple[onnx.ModelProto, str | None]:
    """Shape inference, tolerant: unknown ops or opsets leave types unknown rather than fail.

    Vertices with unknown types are simply not painted (docs/coloring.md), and the report says why.
    Inference runs on a weightless view of the model (protobuf cannot serialize more
    than 2 GB), and the inferred value_info is copied back into ``model``.  ``nodes`` is
    ``summarize(model.graph)`` when the caller has it already.
    """
    if nodes is None:
        nodes = summarize(model.graph)
    try:
        inferred = onnx.shape_inference.infer_shapes(_weightless(model, nodes.holding),
                                                     data_prop=data_propagation_matters(model, nodes))
    except Exception as exc:  # onnx raises InferenceError, ValidationError or RuntimeError
        message = first_line(exc)
        log.warning("shape inference failed (%s); types not declared in the model stay unknown", message)
        return model, message
    _copy_value_info(inferred.graph, model.graph, holding=nodes.holding)
    return model, None


def infer_tensor_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Type of every tensor, from ONNX type inference on a weightless copy of the model.

    Initializers are declared as graph inputs instead of copied, so models over
    protobuf's 2 GB limit (or with external data) still infer; types never
    depend on weight values.
    """
    weightless = onnx.ModelProto(ir_version=model.ir_version)
    weightless.opset_import.extend(model.opset_import)
    weightless.functions.extend(model.functions)
    graph = weightless.graph
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    graph.value_info.extend(model.graph.value_info)
    declared = {v.name for v in graph.input}
    for init in model.graph.initializer:
        if init.name not in declared:
            graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, init.dims))
    for sparse in model.graph.sparse_initializer:
        if sparse.values.name not in declared:
            graph.input.append(helper.make_tensor_value_info(sparse.values.name, sparse.values.data_type,
                                                             sparse.dims))
    try:
        inferred = onnx.shape_inference.infer_shapes(weightless, check_type=False, strict_mode=False)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        log.warning("type inference failed (%s); using declared types only", exc)
        inferred = weightless
    inferred = _type_runtime_ops(inferred)

    types: dict[str, onnx.TypeProto] = {}

    def collect(g: onnx.GraphProto) -> None:
        for v in [*g.input, *g.output, *g.value_info]:
            if v.type.WhichOneof("value") is not None and v.name not in types:
                types[v.name] = onnx.TypeProto()
                types[v.name].CopyFrom(v.type)  # the rewrite retypes the originals in place
        for t in g.initializer:
            types.setdefault(t.name, helper.make_tensor_type_proto(t.data_type, None))
        for node in g.node:
            for sub in bodies(node):
                collect(sub)

    collect(model.graph)  # declared types win over inferred ones
    collect(inferred.graph)
    return types


def _needs_runtime_schemas(model: onnx.ModelProto) -> bool:
    ops = {(n.op_type, n.domain) for g in iter_proto_graphs(model.graph) for n in g.node}
    return any(not is_onnx_domain(domain) or not onnx.defs.has(op, domain or "") for op, domain in ops)


def _type_runtime_ops(inferred: onnx.ModelProto, rounds: int = 8) -> onnx.ModelProto:
    """Type the outputs of onnxruntime's own ops (com.microsoft, SimplifiedLayerNormalization, ...).

    onnx's inference leaves them, and everything computed from them, untyped; an untyped float16
    tensor gets no rounding pair, so a model whose writer declared no value_info (onnxruntime's own
    converter declares none) would be emulated as if most of it ran in float32.  Each round types the
    runtime ops' outputs from their schemas and lets onnx's inference carry the types on.
    """
    if not _needs_runtime_schemas(inferred):
        return inferred
    for _ in range(rounds):
        try:
            added = type_foreign_outputs(inferred, opsets(inferred))
        except OnnxMPError as exc:
            log.warning("cannot type every op of onnxruntime's domains (%s); tensors they write "
                        "are emulated at the precision declared, if any", first_line(str(exc)))
            return inferred
        if not added:
            break
        try:
            inferred = onnx.shape_inference.infer_shapes(inferred, check_type=False, strict_mode=False)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
            log.warning("type inference failed after typing onnxruntime's ops (%s)", exc)
            break
    return inferred


def data_propagation_matters(model: onnx.ModelProto, nodes: NodeSummary) -> bool:
    """Whether ``infer_shapes(data_prop=True)`` may infer other types than ``data_prop=False``;
    when not, inference skips propagation (some 6% of inference on the linear-occ bench graph).

    How onnx propagates (``shape_inference/implementation.{h,cc}``, ``defs/shape_inference.cc``):
    after a node's type inference, if the schema inference resolves for it (node domain, model
    opset) has a data-propagation function, that function may record a value (a
    TensorShapeProto) for inputs it reads -- an int32/int64 initializer or Constant of rank 0 or
    1, or any tensor of known 1-D shape -- and for its outputs.  The records are read back only
    by later propagation functions; by type inference through ``getShapeInput``, for the inputs
    in ``_SHAPE_INPUT`` and only when the input is no initializer (initializer data comes
    first); by inference through a function body (a model-local function, or a schema with a
    body but no inference function); and by subgraph inference.  So propagation cannot change
    the result when the model has no subgraph and no local function, no node is inferred
    through a body or through a schema registered outside onnx's domains (code onnx cannot
    see into), and no node with a propagation function reads or writes a ``_SHAPE_INPUT``
    input that is no initializer.  Names only (types are not known yet), so conservative.
    ``nodes``: ``summarize(model.graph)``.
    """
    if model.functions or any(a.type in (GRAPH, GRAPHS) for node in nodes.holding for a in node.attribute):
        return True
    versions = {o.domain: o.version for o in model.opset_import}
    graph_nodes = model.graph.node
    op_types = nodes.op_types
    if nodes.domains.issubset(ONNX_DOMAINS):
        domains = None  # every node is ai.onnx: op types alone decide
        kinds = {("", op) for op in set(op_types)}
    else:
        domains = ["" if d == "ai.onnx" else d for d in map(_DOMAIN, graph_nodes)]
        kinds = set(zip(domains, op_types))
    propagating: set[tuple[str, str]] = set()
    for domain, op in kinds:
        version = versions.get(domain) or (versions.get("ai.onnx") if domain == "" else None)
        propagates, opaque = _schema_traits(op, version, domain) if version else (False, False)
        if opaque:
            return True
        if propagates:
            propagating.add((domain, op))
    if not propagating or all(op not in _SHAPE_INPUT for _, op in kinds):
        return False
    # Node indices found by C-level iteration: these lists are as long as the graph.
    everywhere = range(len(op_types))
    read = set()  # the shape inputs' names
    for i in compress(everywhere, map(_SHAPE_INPUT.__contains__, op_types)):
        if domains is None or domains[i] == "":
            inputs, k = graph_nodes[i].input, _SHAPE_INPUT[op_types[i]]
            if len(inputs) > k:
                read.add(inputs[k])
    read.discard("")
    for init in model.graph.initializer if read else ():
        read.discard(init.name)
        if not read:
            break
    if not read:
        return False
    if domains is None:
        candidates = map({op for _, op in propagating}.__contains__, op_types)
    else:
        candidates = map(propagating.__contains__, zip(domains, op_types))
    return any(not read.isdisjoint(graph_nodes[i].input) or not read.isdisjoint(graph_nodes[i].output)
               for i in compress(everywhere, candidates))


@functools.lru_cache(maxsize=None)
def _schema_traits(op_type: str, version: int, domain: str) -> tuple[bool, bool]:
    """(has a data-propagation function, is inferred out of propagation's sight: through a
    function body, or by a schema registered outside onnx's own domains) for the schema
    inference resolves."""
    try:
        schema = onnx.defs.get_schema(op_type, version, domain)
    except onnx.defs.SchemaError:
        return False, False  # inference leaves the node's outputs unknown
    opaque = domain not in _BUILTIN_DOMAINS or (
        not schema.has_type_and_shape_inference_function
        and (schema.has_function or schema.has_context_dependent_function))
    return schema.has_data_propagation_function, opaque


def _weightless(model: onnx.ModelProto, holding: list[onnx.NodeProto] | None = None) -> onnx.ModelProto:
    """The skeleton only when some initializer is big (or external): otherwise it would be a copy."""
    for g in iter_proto_graphs(model.graph, holding):
        for t in g.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL or len(t.raw_data) > SKELETON_TENSOR_BYTES:
                return skeleton(model, holding)
    return model


def _copy_value_info(src: onnx.GraphProto, dst: onnx.GraphProto, main: bool = True,
                     holding: list[onnx.NodeProto] | None = None) -> None:
    """Inference keeps the graph's structure, so graphs and subgraphs pair up one to one.

    The main graph's declared input and output types are the model's interface and are kept
    as declared (inference may refine an output's shape, e.g. a sequence's element shape, and
    the converted model would then declare a different type); body I/O takes the inferred types.
    ``src``, inference's throwaway result, is emptied on the way.  ``holding``: ``holders(dst)``
    when the caller has it.
    """
    for field in ("input", "output"):
        for a, b in zip(getattr(src, field), getattr(dst, field)):
            if not main or _refines(a.type, b.type):
                b.type.CopyFrom(a.type)
    if (holders(dst) if holding is None else holding):
        for n_src, n_dst in zip(src.node, dst.node):
            if not may_hold_graphs(n_dst):
                continue
            for a_src, a_dst in zip(n_src.attribute, n_dst.attribute):
                if a_src.type == onnx.AttributeProto.GRAPH:
                    _copy_value_info(a_src.g, a_dst.g, main=False)
                elif a_src.type == onnx.AttributeProto.GRAPHS:
                    for g_src, g_dst in zip(a_src.graphs, a_dst.graphs):
                        _copy_value_info(g_src, g_dst, main=False)
    # The declarations move over as bytes: protobuf parses them in C, several times faster than
    # copying them one message at a time.
    del dst.value_info[:]
    for descriptor, _ in src.ListFields():
        if descriptor.name != "value_info":
            src.ClearField(descriptor.name)
    dst.MergeFromString(src.SerializeToString())


def _refines(inferred: onnx.TypeProto, declared: onnx.TypeProto) -> bool:
    """The inferred type may replace a main-graph declaration: there is none, or it is a tensor
    declared without a shape (onnx.helper's ``shape=None``, which the checker refuses) and
    inference found the same element type with a shape."""
    if not declared.WhichOneof("value"):
        return True
    return (declared.WhichOneof("value") == "tensor_type" and not declared.tensor_type.HasField("shape")
            and inferred.WhichOneof("value") == "tensor_type" and inferred.tensor_type.HasField("shape")
            and inferred.tensor_type.elem_type == declared.tensor_type.elem_type)


def _foreign(nodes: NodeSummary) -> bool:
    """Whether the main graph holds an op onnx's inference cannot type: one of another domain, or
    one onnxruntime adds to the default domain (SimplifiedLayerNormalization)."""
    if not nodes.domains.issubset(_BUILTIN_DOMAINS):
        return True
    return not all(map(_onnx_knows, set(nodes.op_types))) if nodes.domains.issubset(ONNX_DOMAINS) else False


@functools.lru_cache(maxsize=None)
def _onnx_knows(op_type: str) -> bool:
    return onnx.defs.has(op_type)


def normalize(model: onnx.ModelProto) -> Normalized:
    """Annotate types, give nodes unique names, sort every graph; then index the model once.

    Works on ``model`` in place (callers pass the copy ``load`` made).
    """
    # Each step walks every graph; the main graph's nodes are read once (which may hold bodies,
    # names, op types), since no step before the sort adds, removes or replaces a node.
    nodes = summarize(model.graph)
    inferred, error = infer_types(model, nodes)
    foreign = _foreign(nodes) or bool(nodes.holding and has_foreign_ops(inferred))
    if foreign:
        # Only models holding ops of other domains pay for this (docs/coloring.md, onnxruntime's own ops).
        type_foreign_outputs(inferred, opsets(inferred), nodes.holding)
    renamed = make_node_names_unique(inferred.graph, nodes.holding, nodes.names)
    index = ModelIndex(inferred, nodes.holding)
    resorted = False
    if not index.in_order:  # the index's check is strict; is_sorted decides, and sorting is rare
        resorted = toposort_all(inferred)
        if resorted:
            _check_unique_names(inferred.graph)  # make_node_names_unique checked the unsorted graphs
            index = ModelIndex(inferred)  # the sorted graphs hold new node protos
    return Normalized(index, renamed, resorted, error, foreign)


def make_node_names_unique(graph: onnx.GraphProto, holding: list[onnx.NodeProto] | None = None,
                           names: list[str] | None = None) -> int:
    """Give unnamed and duplicate-named nodes deterministic names ``<op>_onnxmp_<n>``.

    The first node holding a name keeps it, so already-unique models are untouched.
    Returns how many nodes were renamed.  ``holding`` (``holders(graph)``) and ``names``
    (``graph``'s own node names) when the caller has read them.
    """
    graphs = [g for _, g, _ in iter_graphs(graph, holding=holding)]
    # The common case, every node named once, reads only the names (no list of node objects).
    if names is None:
        names = list(map(_NAME, graph.node))
    taken = set(chain(names, chain.from_iterable(map(_NAME, g.node) for g in graphs[1:])))
    if len(taken) == sum(len(g.node) for g in graphs) and "" not in taken:
        return 0
    all_nodes = [n for g in graphs for n in g.node]
    seen: set[str] = set()
    renamed = 0
    counter = 0
    for node in all_nodes:
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        while True:
            candidate = f"{node.op_type}_onnxmp_{counter}"
            counter += 1
            if candidate not in taken and candidate not in seen:
                break
        renamed += 1
        node.name = candidate
        seen.add(candidate)
    require(len(seen) == len(all_nodes), "normalize", "node names unique across all graphs")
    if renamed:
        log.info("named %d unnamed or duplicate-named nodes", renamed)
    return renamed


def is_sorted(g: onnx.GraphProto, constants: set[str], outer: frozenset[str] = frozenset()) -> bool:
    """Linear check; exporters almost always emit sorted graphs."""
    known = set(outer) | {t.name for t in g.input} | {""} | constants
    has_bodies = bool(holders(g))
    for node in g.node:
        if not known.issuperset(node.input[:]):  # lists: iterating the fields themselves is slower
            return False
        if has_bodies and may_hold_graphs(node):
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH and not is_sorted(attr.g, constants, frozenset(known)):
                    return False
        known.update(node.output[:])
    return True


def toposort_all(model: onnx.ModelProto) -> bool:
    """Sort every graph; True when some graph was out of order.

    Sorting is rare (exporters emit sorted graphs), so it is left to onnx-graphsurgeon,
    whose order the rest of the pipeline has always seen; only the resulting node
    order is taken back into the proto.
    """
    constants = {t.name for g in iter_proto_graphs(model.graph) for t in g.initializer}
    if is_sorted(model.graph, constants):
        return False
    import onnx_graphsurgeon as gs
    from onnx_graphsurgeon.logger import G_LOGGER

    try:
        with G_LOGGER.suppress(G_LOGGER.ERROR):
            graph = gs.import_onnx(model)
    except Exception as exc:
        raise OnnxMPError(
            f"onnx-graphsurgeon cannot import the model: {first_line(exc)}",
            hint="run onnx.checker.check_model on it; the model may be malformed",
        ) from None
    protos = {node.name: node for _, g, _ in iter_graphs(model.graph) for node in g.node}
    changed = False
    for graph_id, g in _gs_graphs(graph):
        before = [n.name for n in g.nodes]
        try:
            g.toposort(recurse_subgraphs=False)
        except Exception as exc:
            raise OnnxMPError(
                f"graph {graph_id or 'main'!r} cannot be sorted topologically: {first_line(exc)}",
                hint="the graph has a cycle or a node reads a tensor nothing produces",
            ) from None
        after = [n.name for n in g.nodes]
        if after != before:
            changed = True
            target = model.graph if graph_id == "" else _body(protos, graph_id)
            ordered = [protos[name] for name in after]
            copies = [onnx.NodeProto() for _ in ordered]
            for copy, node in zip(copies, ordered):
                copy.CopyFrom(node)
            del target.node[:]
            target.node.extend(copies)
            protos.update({n.name: n for _, sub, _ in iter_graphs(target) for n in sub.node})
    return changed


def _gs_graphs(graph, graph_id: str = ""):
    yield graph_id, graph
    for node in graph.nodes:
        for attr, value in node.attrs.items():
            if hasattr(value, "toposort"):
                yield from _gs_graphs(value, f"{node.name}/{attr}")


def _body(protos: dict[str, onnx.NodeProto], graph_id: str) -> onnx.GraphProto:
    node_name, attr_name = graph_id.rsplit("/", 1)
    return next(a.g for a in protos[node_name].attribute if a.name == attr_name)


def _check_unique_names(graph: onnx.GraphProto) -> None:
    names = [n.name for _, g, _ in iter_graphs(graph) for n in g.node]
    require(len(names) == len(set(names)), "normalize", "node names unique across all graphs")
