"""verify: checker by file, topological order (the checker's), and what is left behind."""
from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import onnxmp
from onnxmp import verify
from onnxmp.errors import OnnxMPError
from onnxmp.verify import full_check
from tests.graphs import header, parse, unsorted_relu_chain


def _sparse_model(reads: str = "s") -> onnx.ModelProto:
    """A node reading ``reads``; ``s`` is a sparse initializer.  The node is a custom op: no standard
    op takes a sparse tensor, and strict type inference would refuse it for that."""
    values = numpy_helper.from_array(np.array([1.0], np.float32), "s")
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([0], np.int64)), [2])
    graph = helper.make_graph([helper.make_node("Foo", [reads], ["y"], name="foo", domain="my.dom")], "g", [],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [2])], sparse_initializer=[sparse])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.dom", 1)],
                             ir_version=8)


def test_a_sparse_initializer_counts_as_defined():
    verify.verify(_sparse_model())  # onnxmp's own topological check raised AttributeError on it once
    with pytest.raises(OnnxMPError, match="input 'nope' of node: name: foo"):
        verify.verify(_sparse_model("nope"))


def test_a_node_reading_a_later_output_is_rejected_and_named():
    model = unsorted_relu_chain()
    model.graph.node[0].name = "reads_a"
    with pytest.raises(OnnxMPError, match="topologically sorted.*input 'a' of node: name: reads_a"):
        verify.verify(model)


def _if_model(reads: str, late: bool) -> onnx.ModelProto:
    """An If whose then-branch reads ``reads`` from the main graph; with ``late`` the main graph
    computes ``late`` only after the If, so the body reads it before it exists."""
    out = lambda name: helper.make_tensor_value_info(name, TP.FLOAT, [2])  # noqa: E731
    then = helper.make_graph([helper.make_node("Identity", [reads], ["t"], name="then_id")], "then", [], [out("t")])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"], name="else_id")], "else", [], [out("e")])
    late_node = helper.make_node("Relu", ["x"], ["late"], name="late")
    nodes = [helper.make_node("Constant", [], ["c"], name="c", value=helper.make_tensor("cv", TP.BOOL, [], [True])),
             helper.make_node("If", ["c"], ["o"], name="if", then_branch=then, else_branch=other),
             helper.make_node("Add", ["o", "late"], ["y"], name="add")]
    nodes.insert(2 if late else 0, late_node)
    graph = helper.make_graph(nodes, "g", [out("x")], [out("y")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_body_may_read_an_outer_name_defined_before_its_node():
    verify.verify(_if_model("late", late=False))
    verify.verify(_if_model("x", late=True))


def test_a_body_reading_an_outer_name_defined_after_its_node_is_rejected():
    with pytest.raises(OnnxMPError, match="topologically sorted.*input 'late' of node: name: then_id"):
        verify.verify(_if_model("late", late=True))


def test_convert_rejects_a_written_model_out_of_order(monkeypatch):
    """The converted model's order is checked, not only the input's (the input here is sorted)."""
    import onnxmp.rewrite as rewrite_module

    write = rewrite_module.write

    def reversed_write(*args, **kwargs):
        model, casts = write(*args, **kwargs)
        nodes = list(model.graph.node)
        del model.graph.node[:]
        model.graph.node.extend(reversed(nodes))
        return model, casts

    monkeypatch.setattr(rewrite_module, "write", reversed_write)
    model = parse(header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        a = MatMul(x, w)
        y = Relu(a)
    }""")
    with pytest.raises(OnnxMPError, match="converted model fails onnx.checker.*topologically sorted") as info:
        onnxmp.convert(model)
    assert "please report" in info.value.hint


def _temp_files() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("onnxmp-verify-")}


@pytest.fixture(params=["from a file", "from memory"])
def route(request, monkeypatch, tmp_path):
    # A temp folder of this test's own: another process converting at the same time must not
    # make its files look like ours.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
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


def test_compact_bytes_are_the_models_bytes_for_a_graph_of_nodes():
    model = parse(header() + "g (float[4] x) => (float[4] y) { y = Relu(x) }")
    assert verify.compact_bytes(model) == model.SerializeToString()


def test_compact_bytes_leave_external_data_and_weight_heavy_models_alone(monkeypatch):
    model = parse(header() + "g (float[4] x) => (float[4] y) { y = Relu(x) }")
    weight = numpy_helper.from_array(np.zeros(4, np.float32), "w")
    weight.data_location = TP.EXTERNAL
    weight.ClearField("raw_data")
    weight.external_data.add(key="location", value="w.bin")
    model.graph.initializer.append(weight)
    assert verify.compact_bytes(model) is None  # its bytes are not the model: the weights are elsewhere
    model.graph.ClearField("initializer")
    monkeypatch.setattr(verify, "CHECK_FILE_BELOW", 8)
    assert verify.compact_bytes(model) is None  # over the size where structure, not weights, fills memory


def test_the_compacted_conversion_is_the_written_model(monkeypatch):
    from onnxmp import pipeline

    model = parse(header() + "g (float[2,4] x, float[4,4] w) => (float[2,4] y) { a = MatMul(x, w) y = Softmax(a) }")
    compacted = onnxmp.convert(model).model
    monkeypatch.setattr(pipeline, "compact_bytes", lambda m: None)
    written = onnxmp.convert(model).model
    assert any(n.op_type == "Cast" for n in written.graph.node)
    assert compacted.SerializeToString() == written.SerializeToString()


def test_verify_checks_bytes_and_returns_them_parsed(route):
    model = parse(header() + "g (float[4] x) => (float[4] y) { y = Relu(x) }")
    before = _temp_files()
    assert verify.verify(model.SerializeToString()) == model
    assert _temp_files() == before


def test_verify_of_bad_bytes_is_the_one_line_error():
    model = parse(header() + "g (float[4] x) => (float[4] y) { y = Relu(x) }")
    model.graph.output[0].type.tensor_type.elem_type = TP.INT64
    with pytest.raises(OnnxMPError, match="converted model fails onnx.checker.*elem type differs"):
        verify.verify(model.SerializeToString())
