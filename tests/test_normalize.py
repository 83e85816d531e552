"""normalize and its index: the order check made during the import, unique names, external data."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from onnxmp.external import has_external_data
from onnxmp.index import ModelIndex
from onnxmp.normalize import is_sorted, make_node_names_unique, normalize
from tests.graphs import header, parse, unsorted_relu_chain


def _if_model(body_reads: str) -> onnx.ModelProto:
    """An If whose then-branch reads ``body_reads`` from the main graph; ``late`` is produced after the If."""
    then = helper.make_graph([helper.make_node("Relu", [body_reads], ["t"], name="then_relu")], "then", [],
                             [helper.make_tensor_value_info("t", TP.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Relu", ["x"], ["e"], name="else_relu")], "else", [],
                              [helper.make_tensor_value_info("e", TP.FLOAT, [2])])
    nodes = [helper.make_node("Identity", ["x"], ["early"], name="early"),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other),
             helper.make_node("Identity", ["x"], ["late"], name="late")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("c", TP.BOOL, []),
                                           helper.make_tensor_value_info("x", TP.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [2]),
                               helper.make_tensor_value_info("late", TP.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_index_sees_a_sorted_graph_with_bodies_in_order():
    model = _if_model("early")
    assert ModelIndex(model).in_order
    assert is_sorted(model.graph, set())


def test_index_flags_a_body_reading_a_value_produced_after_its_node():
    model = _if_model("late")
    assert not ModelIndex(model).in_order
    assert not is_sorted(model.graph, set())


def test_index_flags_a_node_reading_a_later_output_and_normalize_sorts_it():
    model = unsorted_relu_chain()
    assert not ModelIndex(model).in_order
    normalized = normalize(model)
    assert normalized.resorted and normalized.index.in_order
    assert [n.output[0] for n in normalized.index.model.graph.node] == ["a", "y"]


def test_unique_names_are_left_alone_and_duplicates_renamed():
    model = parse(header() + """
    g (float[4] x) => (float[4] y) {
        a = Relu(x)
        y = Relu(a)
    }""")
    model.graph.node[0].name, model.graph.node[1].name = "first", "second"
    assert make_node_names_unique(model.graph) == 0
    model.graph.node[1].name = "first"
    assert make_node_names_unique(model.graph) == 1
    assert [n.name for n in model.graph.node] == ["first", "Relu_onnxmp_0"]


def test_the_index_holds_the_node_names_normalize_leaves():
    """normalize hands the names it read to the index when it renamed nothing."""
    for first, second, expected in (("first", "second", ["first", "second"]),
                                    ("first", "first", ["first", "Relu_onnxmp_0"]), ("", "", None)):
        model = parse(header() + """
        g (float[4] x) => (float[4] y) {
            a = Relu(x)
            y = Relu(a)
        }""")
        model.graph.node[0].name, model.graph.node[1].name = first, second
        names = normalize(model).index.scopes[0].names
        assert names == [n.name for n in model.graph.node] and len(set(names)) == 2 and "" not in names
        assert expected is None or names == expected


def _external(tensor: onnx.TensorProto) -> onnx.TensorProto:
    tensor.ClearField("raw_data")
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "weights.bin"
    tensor.data_location = TP.EXTERNAL
    return tensor


def _has_external_data(model: onnx.ModelProto) -> bool:
    """has_external_data, checked to say the same with the model's bytes at hand."""
    found = has_external_data(model)
    assert has_external_data(model, model.SerializeToString()) == found
    return found


def test_external_data_is_found_in_bodies_and_attributes_only_when_there():
    model = _if_model("early")
    assert not _has_external_data(model)
    then = model.graph.node[1].attribute[0].g
    value = numpy_helper.from_array(np.ones(2, np.float32), "k")
    then.node.append(helper.make_node("Constant", [], ["k"], name="k", value=value))
    assert not _has_external_data(model)
    _external(then.node[-1].attribute[0].t)
    assert _has_external_data(model)
    del then.node[-1]
    then.initializer.append(_external(numpy_helper.from_array(np.ones(2, np.float32), "w")))
    assert _has_external_data(model)


def test_weights_that_hold_the_external_fields_bytes_are_not_external_data():
    model = _if_model("early")
    # 0x70 0x01 is how data_location = EXTERNAL serializes; here it is only weight bytes.
    model.graph.initializer.append(numpy_helper.from_array(np.frombuffer(b"\x70\x01" * 4, np.float32), "w"))
    data = model.SerializeToString()
    assert bytes([0x70, 0x01]) in data
    assert not has_external_data(model, data)


@pytest.mark.parametrize("window", [3, 4, 1 << 20])
def test_the_two_byte_search_finds_the_pair_anywhere_and_nowhere_else(window, monkeypatch):
    import onnxmp.external as external
    monkeypatch.setattr(external, "_SEARCH_WINDOW", window)
    pair = bytes([0x70, 0x01])
    for data in (b"", b"\x70", b"\x70\x70\x02\x01", b"\x70\x00" * 5 + b"\x01"):
        assert not external._holds(data, pair)
    for at in range(9):  # every place, across the window borders too
        data = bytearray(b"\x70\x00" * 5)
        data[at:at + 2] = pair
        assert external._holds(bytes(data), pair)


def test_index_reads_each_nodes_names_once():
    model = _if_model("early")
    model.graph.initializer.append(numpy_helper.from_array(np.ones(2, np.float32), "x"))  # an input that is one
    graph = ModelIndex(model)
    main, then = graph.scopes[0], next(s for s in graph.scopes if s.gid == "if/then_branch")
    assert main.names == ["early", "if", "late"] and then.names == ["then_relu"]
    assert main.ins == [("x",), ("c",), ("x",)] and main.outs == [("early",), ("y",), ("late",)]
    assert main.inputs == ["c"]  # `x` is an initializer: not among the graph's own inputs
    out_of_order = ModelIndex(_if_model("late"))
    assert [s.ins for s in out_of_order.scopes if s.gid == "if/then_branch"] == [[("late",)]]  # out of order too


def test_rank_and_dim_reads_one_dim_as_the_parsed_shape_has_it():
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["u"], ["v"])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, ["N", 0, 8]),
         helper.make_tensor_value_info("u", TP.FLOAT, None)],
        [helper.make_tensor_value_info("y", TP.FLOAT, ["N", 0, 8]),
         helper.make_tensor_value_info("v", TP.FLOAT, None)],
        [numpy_helper.from_array(np.zeros((3, 5), np.float32), "w")]))
    tensors = ModelIndex(model).tensors
    x, u, w = tensors["x"], tensors["u"], tensors["w"]
    assert [x.rank_and_dim(axis) for axis in (0, 1, -1, 3, -4)] == [(3, "N"), (3, 0), (3, 8), (3, None), (3, None)]
    assert u.rank_and_dim(0) == (0, None)
    assert w.rank_and_dim(-1) == (2, 5)
    assert x.shape == ["N", 0, 8] and u.shape is None  # the parsed shape agrees
    assert x.rank_and_dim(2) == (3, 8)  # once parsed, read from the list


def test_rank_and_dim_reads_an_unset_dim_as_none():
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [None, 4, "", 0])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)]))
    x = ModelIndex(model).tensors["x"]
    dims = [x.rank_and_dim(axis) for axis in range(4)]
    assert dims == [(4, None), (4, 4), (4, ""), (4, 0)]  # a set but empty dim_param stays ""
    assert [dim for _, dim in dims] == x.shape  # the parsed shape agrees


def _with_initializer(tensor: onnx.TensorProto, in_body: bool = False) -> onnx.ModelProto:
    """Identity of `x`, with ``tensor`` as an initializer of the main graph or of an If body."""
    x = helper.make_tensor_value_info("x", TP.FLOAT, [2])
    if not in_body:
        return helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                                                   [helper.make_tensor_value_info("y", TP.FLOAT, [2])], [tensor]))
    body = helper.make_graph([helper.make_node("Identity", ["x"], ["b"])], "body", [],
                             [helper.make_tensor_value_info("b", TP.FLOAT, [2])], [tensor])
    cond = numpy_helper.from_array(np.array(True), "c")
    node = helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=body)
    return helper.make_model(helper.make_graph([node], "g", [x], [helper.make_tensor_value_info("y", TP.FLOAT, [2])],
                                               [cond]))


@pytest.mark.parametrize("in_body", [False, True])
def test_weightless_takes_the_skeleton_only_past_the_raw_byte_threshold(in_body):
    from onnxmp.external import SKELETON_TENSOR_BYTES
    from onnxmp.normalize import _weightless
    at = numpy_helper.from_array(np.zeros(SKELETON_TENSOR_BYTES // 4, np.float32), "w")
    past = numpy_helper.from_array(np.zeros(SKELETON_TENSOR_BYTES // 4 + 1, np.float32), "w")
    typed = helper.make_tensor("w", TP.FLOAT, [1000], np.zeros(1000, np.float32).tolist())  # float_data
    assert len(at.raw_data) == SKELETON_TENSOR_BYTES and not typed.raw_data
    for tensor in (at, typed):  # at the threshold, and data outside raw_data: the model itself
        model = _with_initializer(tensor, in_body)
        assert _weightless(model) is model
    model = _with_initializer(past, in_body)
    assert _weightless(model) is not model
    external = onnx.TensorProto(name="w", data_type=TP.FLOAT, dims=[1], data_location=TP.EXTERNAL)
    model = _with_initializer(external, in_body)
    assert _weightless(model) is not model
