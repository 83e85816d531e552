"""The one subgraph walker: the graphs held in If/Loop/Scan (and custom ops') attributes.

Graph ids name a body by its node and attribute (``"<node name>/<attribute>"``; the main
graph is :data:`MAIN`), which is unique once ``normalize`` gave every node a unique name.
"""
from __future__ import annotations

from typing import Iterator

import onnx

from onnxmp.domains import is_onnx_domain

MAIN = ""  # graph id of the main graph
GRAPH = onnx.AttributeProto.GRAPH
GRAPHS = onnx.AttributeProto.GRAPHS

# ai.onnx ops whose attributes hold graphs; nodes of other domains are checked one by one.
_GRAPH_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def may_hold_graphs(node: onnx.NodeProto) -> bool:
    """Cheap filter for walks over every node: only these can have graph-valued attributes."""
    return node.op_type in _GRAPH_OPS or (not is_onnx_domain(node.domain) and len(node.attribute) > 0)


def holders(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes of ``graph`` (not of its bodies) that may hold graphs."""
    return [n for n in graph.node if may_hold_graphs(n)]


def bodies(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs of ``node``'s GRAPH and GRAPHS attributes."""
    if not may_hold_graphs(node):
        return
    for attr in node.attribute:
        if attr.type == GRAPH:
            yield attr.g
        elif attr.type == GRAPHS:
            yield from attr.graphs


def iter_graphs(graph: onnx.GraphProto, graph_id: str = MAIN, parent: onnx.NodeProto | None = None,
                holding: list[onnx.NodeProto] | None = None
                ) -> Iterator[tuple[str, onnx.GraphProto, onnx.NodeProto | None]]:
    """(graph id, graph, node holding it) of the main graph, then of every If/Loop/Scan body
    (GRAPH attributes), depth first.  ``holding`` is ``holders(graph)`` when the caller has it."""
    yield graph_id, graph, parent
    for node in holders(graph) if holding is None else holding:
        for attr in node.attribute:
            if attr.type == GRAPH:
                yield from iter_graphs(attr.g, f"{node.name}/{attr.name}", node)


def iter_proto_graphs(graph: onnx.GraphProto, holding: list[onnx.NodeProto] | None = None
                      ) -> Iterator[onnx.GraphProto]:
    """``graph`` and every graph in it, GRAPHS attributes included, depth first."""
    yield graph
    for node in holders(graph) if holding is None else holding:
        for body in bodies(node):
            yield from iter_proto_graphs(body)


def proto_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every NodeProto of ``graph`` and its bodies, each node before its bodies' nodes."""
    for node in graph.node:
        yield node
        for body in bodies(node):
            yield from proto_nodes(body)
