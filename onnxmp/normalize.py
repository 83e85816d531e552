"""Stage 2: normalize.  Unique names, topological order, dtypes from shape inference.

Everything after this stage keys nodes and tensors by name, so names must be
unique across the main graph and all subgraphs.  The result is the model itself
(edited in place) and its :class:`~onnxmp.graphs.ModelGraph` index.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import onnx

from onnxmp.errors import OnnxMPError, first_line
from onnxmp.external import SKELETON_TENSOR_BYTES, skeleton
from onnxmp.graphs import ModelGraph, holders, iter_graphs, iter_proto_graphs, may_hold_graphs
from onnxmp.passes import PassResult, require

log = logging.getLogger("onnxmp.normalize")
_NAME = attrgetter("name")


@dataclass
class Normalized:
    graph: ModelGraph
    result: PassResult
    inference_error: str | None = None


def infer_types(model: onnx.ModelProto, holding: list[onnx.NodeProto] | None = None
                ) -> tuple[onnx.ModelProto, str | None]:
    """Shape inference, tolerant: unknown ops or opsets leave types unknown rather than fail.

    Vertices with unknown types are simply not painted (spec §1), and the report says why.
    Inference runs on a weightless view of the model (protobuf cannot serialize more
    than 2 GB), and the inferred value_info is copied back into ``model``.  ``holding`` is
    ``holders(model.graph)`` when the caller has it already.
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(_weightless(model, holding), data_prop=True)
    except Exception as exc:  # onnx raises InferenceError, ValidationError or RuntimeError
        message = first_line(exc)
        log.warning("shape inference failed (%s); types not declared in the model stay unknown", message)
        return model, message
    _copy_value_info(inferred.graph, model.graph, holding=holding)
    return model, None


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


def normalize(model: onnx.ModelProto) -> Normalized:
    """Annotate types, give nodes unique names, sort every graph; then index the model once.

    Works on ``model`` in place (callers pass the copy ``load`` made).
    """
    # Each step walks every graph; the main graph's nodes that may hold bodies are found once
    # (a pass over all nodes), since no step before the sort adds, removes or replaces a node.
    holding = holders(model.graph)
    inferred, error = infer_types(model, holding)
    renamed, names = _name_nodes(inferred.graph, holding)
    graph = ModelGraph(inferred, holding, names)
    sorted_changed = False
    if not graph.in_order:  # the index's check is strict; is_sorted decides, and sorting is rare
        sorted_changed = toposort_all(inferred)
        if sorted_changed:
            _check_unique_names(inferred.graph)  # make_node_names_unique checked the unsorted graphs
            graph = ModelGraph(inferred)  # the sorted graphs hold new node protos
    return Normalized(graph, PassResult(bool(renamed) or sorted_changed,
                                        {"renamed_nodes": renamed, "resorted": sorted_changed}),
                      error)


def make_node_names_unique(graph: onnx.GraphProto, holding: list[onnx.NodeProto] | None = None) -> int:
    """Give unnamed and duplicate-named nodes deterministic names ``<op>_onnxmp_<n>``.

    The first node holding a name keeps it, so already-unique models are untouched.
    Returns how many nodes were renamed.  ``holding``: ``holders(graph)`` when the caller has it.
    """
    return _name_nodes(graph, holding)[0]


def _name_nodes(graph: onnx.GraphProto, holding: list[onnx.NodeProto] | None) -> tuple[int, list[str] | None]:
    """``make_node_names_unique``, and ``graph``'s own node names when it renamed none (the index
    reads them otherwise once more)."""
    graphs = [g for _, g, _ in iter_graphs(graph, holding=holding)]
    # The common case, every node named once, reads only the names (no list of node objects).
    main = list(map(_NAME, graph.node))
    taken = set(chain(main, chain.from_iterable(map(_NAME, g.node) for g in graphs[1:])))
    if len(taken) == sum(len(g.node) for g in graphs) and "" not in taken:
        return 0, main
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
    return renamed, None


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
