"""Helpers for building tiny test graphs with onnx.parser and reading results by node."""
from __future__ import annotations

import numpy as np
import onnx
import onnx.parser

import onnxmp


def parse(text: str, ir_version: int = 8) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    model.ir_version = ir_version
    onnx.checker.check_model(model, full_check=True)
    return model


def named(text: str, ir_version: int = 8) -> onnx.ModelProto:
    """Parse, then name every node after its first output so tests read naturally."""
    model = parse(text, ir_version)
    for node in model.graph.node:
        node.name = node.output[0]
    return model


def header(opset: int = 17, extra: str = "") -> str:
    return f'<ir_version: 8, opset_import: ["" : {opset}{extra}]>'


def node_colors(report) -> dict[str, str]:
    return report.node_colors()


def vertex(report, key: str):
    return next(v for v in report.vertices if v.vertex == key)


def count_op(model: onnx.ModelProto, op: str) -> int:
    total = 0

    def walk(graph):
        nonlocal total
        for n in graph.node:
            total += n.op_type == op
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)

    walk(model.graph)
    return total


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every typed value in the main graph (after shape inference)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    out = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.output) + list(g.value_info)}
    out.update({t.name: t.data_type for t in g.initializer})
    return out


def node_by_name(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def weight(name: str, shape, scale: float = 0.1, seed: int = 0) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return onnx.numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


FLOAT, FLOAT16, BFLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16

__all__ = ["parse", "named", "header", "node_colors", "vertex", "count_op", "tensor_types", "node_by_name", "weight",
           "FLOAT", "FLOAT16", "BFLOAT16", "onnxmp"]


def unsorted_relu_chain() -> onnx.ModelProto:
    """``a = Relu(x); y = Relu(a)`` stored in reverse order, as some exporters write graphs."""
    model = parse(header() + """
    g (float[4] x) => (float[4] y) {
        a = Relu(x)
        y = Relu(a)
    }""")
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    return model
