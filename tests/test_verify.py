"""verify: checker by file, the topological check, and what is left behind."""
from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from onnxmp import verify
from onnxmp.errors import OnnxMPError
from onnxmp.verify import check_topological, full_check
from tests.graphs import header, parse, unsorted_relu_chain


def _sparse_model() -> onnx.ModelProto:
    values = numpy_helper.from_array(np.array([1.0], np.float32), "s")
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([0], np.int64)), [2])
    graph = helper.make_graph([helper.make_node("Add", ["x", "s"], ["y"], name="add")], "g",
                              [helper.make_tensor_value_info("x", TP.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [2])], sparse_initializer=[sparse])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_sparse_initializer_counts_as_defined():
    check_topological(_sparse_model().graph, "main")  # raised AttributeError before


def test_a_node_reading_a_later_output_is_named():
    model = unsorted_relu_chain()
    model.graph.node[0].name = "reads_a"
    with pytest.raises(OnnxMPError, match="node `reads_a` reads `a` before it is produced"):
        check_topological(model.graph, "main")


def _temp_files() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("onnxmp-verify-")}


@pytest.fixture(params=["from a file", "from memory"])
def route(request, monkeypatch):
    if request.param == "from memory":
        monkeypatch.setattr(verify, "CHECK_FILE_BELOW", 0)


def test_full_check_passes_a_valid_model_and_leaves_no_file(route):
    before = _temp_files()
    full_check(parse(header() + "g (float[4] x) => (float[4] y) { y = Relu(x) }"))
    assert _temp_files() == before


def test_full_check_raises_the_checkers_type_error_and_leaves_no_file(route):
    model = parse(header() + "g (float[4] x) => (float[4] y) { y = Relu(x) }")
    model.graph.output[0].type.tensor_type.elem_type = TP.INT64
    before = _temp_files()
    with pytest.raises(Exception, match="elem type differs"):
        full_check(model)
    assert _temp_files() == before
