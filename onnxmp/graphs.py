"""Small helpers over onnx-graphsurgeon graphs shared by every stage.

GS nodes and tensors are not hashable (tensors compare by name), so everything
here is keyed by name; ``normalize`` guarantees names are unique.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs

MAIN = ""  # graph id of the main graph; subgraphs are "<node name>/<attribute>"


def iter_graphs(graph: gs.Graph, graph_id: str = MAIN, parent: gs.Node | None = None
                ) -> Iterator[tuple[str, gs.Graph, gs.Node | None]]:
    """The main graph, then every If/Loop/Scan body, depth first."""
    yield graph_id, graph, parent
    for node in graph.nodes:
        for attr, value in node.attrs.items():
            if isinstance(value, gs.Graph):
                yield from iter_graphs(value, f"{node.name}/{attr}", node)


def iter_proto_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph in it (node attributes of type GRAPH or GRAPHS), depth first."""
    yield graph
    for node in graph.node:
        for sub in proto_subgraphs(node):
            yield from iter_proto_graphs(sub)


def proto_subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The bodies of an If/Loop/Scan NodeProto (GRAPH and GRAPHS attributes)."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def proto_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every NodeProto of ``graph`` and its bodies, each node before its bodies' nodes."""
    for node in graph.node:
        yield node
        for sub in proto_subgraphs(node):
            yield from proto_nodes(sub)


def is_tensor(tensor: gs.Tensor) -> bool:
    """False for sequence, optional, map and sparse values: GS keeps their kind in ``type``."""
    return getattr(tensor, "type", "tensor_type") == "tensor_type"


def onnx_dtype(tensor: gs.Tensor) -> int | None:
    """The tensor's ONNX element type; None when unknown or when the value is not a plain tensor
    (GS gives a sequence its element's dtype and an optional a whole TypeProto)."""
    if not is_tensor(tensor):
        return None
    if isinstance(tensor, gs.Constant):
        dtype = tensor.export_dtype if getattr(tensor, "export_dtype", None) is not None else tensor.dtype
    else:
        dtype = tensor.dtype
    if dtype is None:
        return None
    if isinstance(dtype, (int, np.integer)):
        return int(dtype)
    cached = _DTYPES.get(dtype)
    if cached is None:
        try:
            cached = int(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
        except (TypeError, KeyError, ValueError):
            from onnx_graphsurgeon.exporters.onnx_exporter import dtype_to_onnx

            cached = int(dtype_to_onnx(dtype))
        _DTYPES[dtype] = cached
    return cached


_DTYPES: dict = {}  # numpy dtype -> ONNX enum; the conversion is slow and called per tensor


def is_float32(tensor: gs.Tensor) -> bool:
    return onnx_dtype(tensor) == onnx.TensorProto.FLOAT


def producer(tensor: gs.Tensor) -> gs.Node | None:
    return tensor.inputs[0] if isinstance(tensor, gs.Variable) and tensor.inputs else None


def opset_of(graph: gs.Graph, domain: str) -> int:
    if domain in ("", "ai.onnx"):
        return int(graph.opset)
    for entry in graph.import_domains or []:
        if entry.domain == domain:
            return int(entry.version)
    return 1


def outer_references(body: gs.Graph) -> list[gs.Tensor]:
    """Tensors a body reads from enclosing scopes (``body._foreign_tensors`` in GS)."""
    local = {t.name for t in body.inputs}
    for node in body.nodes:
        local.update(t.name for t in node.outputs)
    seen: dict[str, gs.Tensor] = {}
    for node in body.nodes:
        for tensor in node.inputs:
            if tensor.name and tensor.name not in local and not isinstance(tensor, gs.Constant):
                seen.setdefault(tensor.name, tensor)
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):
                for tensor in outer_references(value):
                    if tensor.name not in local:
                        seen.setdefault(tensor.name, tensor)
    return list(seen.values())

