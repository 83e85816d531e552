"""The emitter writes what an onnx-graphsurgeon import/cleanup/export round trip writes.

onnxmp's converted models used to go through GS; :mod:`onnxmp.emit` now writes them
from the proto.  On a graph the rewrite leaves alone the two must agree byte for byte,
including GS's conventions (doc strings dropped, dead nodes removed, unnamed tensors
named "", value_info in GS's tensor order, outer initializers listed in bodies).
``scripts/check_identity.py`` checks whole conversions against an earlier revision.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx_graphsurgeon.logger import G_LOGGER

from models import zoo
from onnxmp.emit import emit
from onnxmp.graphs import ModelGraph
from onnxmp.normalize import normalize
from onnxmp.rewrite import Edits
from tests.graphs import header


def gs_graph(model: onnx.ModelProto) -> bytes:
    with G_LOGGER.suppress(G_LOGGER.ERROR):
        graph = gs.import_onnx(model)
        graph.cleanup(remove_unused_graph_inputs=False, remove_unused_node_outputs=False, recurse_subgraphs=True)
        return gs.export_onnx(graph, do_type_check=False).graph.SerializeToString()


def emitted_graph(model: onnx.ModelProto) -> bytes:
    graph = ModelGraph(model)
    return emit(graph, Edits.unchanged(graph), model).graph.SerializeToString()


def odd_model() -> onnx.ModelProto:
    """Doc strings, a dead node and an unused initializer, an unnamed Constant tensor, a
    value_info with a dim denotation, an If body reading an outer initializer and variable."""
    model = onnx.parser.parse_model(header() + """
    g (float[2,4] x, bool c) => (float[2,4] y) {
        k = Constant <value = float[1] {2.0}> ()
        a = Mul(x, k)
        dead = Relu(x)
        y = If(c) <then_branch = t () => (float[2,4] yt) { yt = Add(a, w) },
                   else_branch = e () => (float[2,4] ye) { ye = Sub(a, w) }>
    }""")
    model.graph.initializer.extend([onnx.numpy_helper.from_array(np.ones((2, 4), np.float32), "w"),
                                    onnx.numpy_helper.from_array(np.ones((3,), np.float32), "unused")])
    onnx.checker.check_model(model, full_check=True)
    for i, node in enumerate(model.graph.node):
        node.name = f"n{i}"
        node.doc_string = "exported from somewhere"
    model.graph.node[0].attribute[0].t.ClearField("name")
    vi = onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [2, 4])
    vi.type.tensor_type.shape.dim[0].denotation = "BATCH"
    model.graph.value_info.append(vi)
    return model


@pytest.mark.parametrize("build", [odd_model, zoo.mlp, zoo.loop_if, zoo.transformer_block, zoo.cnn_bn])
def test_untouched_graph_is_written_as_gs_wrote_it(build):
    model = build()
    normalize(model)  # types from inference, unique names, as the pipeline sees it
    assert emitted_graph(model) == gs_graph(model)


def test_dead_nodes_and_unused_initializers_are_dropped_and_doc_strings_go():
    model = odd_model()
    normalize(model)
    out = onnx.GraphProto()
    out.ParseFromString(emitted_graph(model))
    assert "n2" not in {n.name for n in out.node}  # `dead` feeds no output
    assert "unused" not in {t.name for t in out.initializer}
    assert not any(n.doc_string for n in out.node)
    assert out.node[0].attribute[0].t.HasField("name")  # GS names every tensor it writes
