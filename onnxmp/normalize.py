"""Stage 2: normalize.  Unique names, topological order, dtypes from shape inference.

Everything after this stage keys nodes and tensors by name, so names must be
unique across the main graph and all subgraphs.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.logger import G_LOGGER

from onnxmp.errors import OnnxMPError
from onnxmp.external import skeleton, use_external_reader
from onnxmp.graphs import iter_graphs
from onnxmp.passes import PassResult, require

log = logging.getLogger("onnxmp.normalize")


@dataclass
class Normalized:
    graph: gs.Graph
    result: PassResult
    inference_error: str | None = None
    renamed_nodes: list[tuple[str, str]] = field(default_factory=list)


def infer_types(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    """Shape inference, tolerant: unknown ops or opsets leave types unknown rather than fail.

    Vertices with unknown types are simply not painted (spec §1), and the report says why.
    Inference runs on a weightless view of the model (protobuf cannot serialize more
    than 2 GB), and the inferred value_info is copied back into ``model``.
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton(model), data_prop=True)
    except Exception as exc:  # onnx raises InferenceError, ValidationError or RuntimeError
        message = str(exc).splitlines()[0][:300]
        log.warning("shape inference failed (%s); types not declared in the model stay unknown", message)
        return model, message
    _copy_value_info(inferred.graph, model.graph)
    return model, None


def _copy_value_info(src: onnx.GraphProto, dst: onnx.GraphProto, main: bool = True) -> None:
    """Inference keeps the graph's structure, so graphs and subgraphs pair up one to one.

    The main graph's declared input and output types are the model's interface and are kept
    as declared (inference may refine an output's shape, e.g. a sequence's element shape, and
    the converted model would then declare a different type); body I/O takes the inferred types.
    """
    del dst.value_info[:]
    dst.value_info.extend(src.value_info)
    for field in ("input", "output"):
        for a, b in zip(getattr(src, field), getattr(dst, field)):
            if not (main and b.type.WhichOneof("value")):
                b.type.CopyFrom(a.type)
    for n_src, n_dst in zip(src.node, dst.node):
        for a_src, a_dst in zip(n_src.attribute, n_dst.attribute):
            if a_src.type == onnx.AttributeProto.GRAPH:
                _copy_value_info(a_src.g, a_dst.g, main=False)
            elif a_src.type == onnx.AttributeProto.GRAPHS:
                for g_src, g_dst in zip(a_src.graphs, a_dst.graphs):
                    _copy_value_info(g_src, g_dst, main=False)


def normalize(model: onnx.ModelProto) -> Normalized:
    """Import into onnx-graphsurgeon with unique names and topologically sorted graphs."""
    inferred, error = infer_types(model)
    try:
        # GS prints warnings straight to the terminal (e.g. for bfloat16); ours go through logging.
        with G_LOGGER.suppress(G_LOGGER.ERROR):
            graph = gs.import_onnx(inferred)
    except Exception as exc:
        raise OnnxMPError(
            f"onnx-graphsurgeon cannot import the model: {str(exc).splitlines()[0][:300]}",
            hint="run onnx.checker.check_model on it; the model may be malformed",
        ) from None
    use_external_reader(graph)
    _keep_skipped_attributes(inferred.graph, graph)
    renamed = make_node_names_unique(graph)
    sorted_changed = toposort_all(graph)
    _check_unique_names(graph)
    return Normalized(graph, PassResult(bool(renamed) or sorted_changed,
                                        {"renamed_nodes": len(renamed), "resorted": sorted_changed}),
                      error, renamed)


def _keep_skipped_attributes(proto: onnx.GraphProto, graph: gs.Graph) -> None:
    """GS skips attributes of the types it does not model (TYPE_PROTO as in Optional's ``type``,
    SPARSE_TENSOR as in Constant's ``sparse_value``, TENSORS, GRAPHS...), and the exported node
    would lack them.  Keep their proto values: GS hands them to onnx.helper.make_attribute on
    export, which writes them back.  GS imports nodes in proto order, so the two lists pair up."""
    for p_node, g_node in zip(proto.node, graph.nodes):
        for attr in p_node.attribute:
            value = g_node.attrs.get(attr.name)
            if attr.name not in g_node.attrs and not attr.ref_attr_name:
                g_node.attrs[attr.name] = onnx.helper.get_attribute_value(attr)
            elif attr.type == onnx.AttributeProto.GRAPH and isinstance(value, gs.Graph):
                _keep_skipped_attributes(attr.g, value)


def make_node_names_unique(graph: gs.Graph) -> list[tuple[str, str]]:
    """Give unnamed and duplicate-named nodes deterministic names ``<op>_<n>``.

    The first node holding a name keeps it, so already-unique models are untouched.
    """
    all_nodes = [n for _, g, _ in iter_graphs(graph) for n in g.nodes]
    taken = Counter(n.name for n in all_nodes if n.name)
    seen: set[str] = set()
    renamed: list[tuple[str, str]] = []
    counter = 0
    for node in all_nodes:
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        while True:
            candidate = f"{node.op}_onnxmp_{counter}"
            counter += 1
            if candidate not in taken and candidate not in seen:
                break
        renamed.append((node.name, candidate))
        node.name = candidate
        seen.add(candidate)
    if renamed:
        log.info("named %d unnamed or duplicate-named nodes", len(renamed))
    return renamed


def is_sorted(g: gs.Graph, outer: frozenset[str] = frozenset()) -> bool:
    """Linear check; exporters almost always emit sorted graphs, and GS's toposort is costly."""
    known = set(outer) | {t.name for t in g.inputs} | {""}
    for node in g.nodes:
        for t in node.inputs:
            if t.name not in known and not isinstance(t, gs.Constant):
                return False
        for value in node.attrs.values():
            if isinstance(value, gs.Graph) and not is_sorted(value, frozenset(known)):
                return False
        known.update(t.name for t in node.outputs)
    return True


def toposort_all(graph: gs.Graph) -> bool:
    """Sort every graph; True when some graph was out of order."""
    if is_sorted(graph):
        return False
    changed = False
    for graph_id, g, _ in iter_graphs(graph):
        before = [n.name for n in g.nodes]
        try:
            g.toposort(recurse_subgraphs=False)
        except Exception as exc:
            raise OnnxMPError(
                f"graph {graph_id or 'main'!r} cannot be sorted topologically: {str(exc)[:200]}",
                hint="the graph has a cycle or a node reads a tensor nothing produces",
            ) from None
        if [n.name for n in g.nodes] != before:
            changed = True
    return changed


def _check_unique_names(graph: gs.Graph) -> None:
    names = [n.name for _, g, _ in iter_graphs(graph) for n in g.nodes]
    require(len(names) == len(set(names)), "normalize", "node names unique across all graphs")
