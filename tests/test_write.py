"""The writer applies the rewrite's edits to the normalized model and changes nothing else
(``onnxmp/rewrite/write.py``; ``scripts/check_equivalence.py`` compares whole conversions
with an earlier revision's)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from models import zoo
from onnxmp.index import ModelIndex
from onnxmp.normalize import normalize
from onnxmp.precision import BFLOAT16, FLOAT16
from onnxmp.rewrite import Edits, write
from onnxmp.rewrite.plan import GraphNodes, NewCast, place_after_producers
from tests.graphs import header

FLOAT = onnx.TensorProto.FLOAT


def written(model: onnx.ModelProto, edit=None) -> tuple[onnx.ModelProto, set[str]]:
    index = normalize(model).index
    edits = Edits.unchanged(index)
    if edit is not None:
        edit(index, edits)
    return write(index, edits)


def odd_model() -> onnx.ModelProto:
    """Doc strings, a dead node and an unused initializer, an unnamed Constant tensor, an If body
    reading an outer initializer and variable."""
    model = onnx.parser.parse_model(header() + """
    g (float[2,4] x, bool c) => (float[2,4] y) {
        k = Constant <value = float[1] {2.0}> ()
        a = Mul(x, k)
        dead = Relu(x)
        y = If(c) <then_branch = t () => (float[2,4] yt) { yt = Add(a, w) },
                   else_branch = e () => (float[2,4] ye) { ye = Sub(a, w) }>
    }""")
    model.graph.initializer.extend([numpy_helper.from_array(np.ones((2, 4), np.float32), "w"),
                                    numpy_helper.from_array(np.ones((3,), np.float32), "unused")])
    onnx.checker.check_model(model, full_check=True)
    for i, node in enumerate(model.graph.node):
        node.name = f"n{i}"
        node.doc_string = "exported from somewhere"
    model.graph.node[0].attribute[0].t.ClearField("name")
    return model


@pytest.mark.parametrize("build", [zoo.mlp, zoo.loop_if, zoo.transformer_block, zoo.cnn_bn, zoo.kv_decoder])
def test_a_model_without_edits_or_dead_nodes_is_written_as_it_came(build):
    model = build()
    normalize(model)  # types from inference, unique names, as the pipeline sees it
    expected = model.SerializeToString()
    out, casts = written(model)
    assert out.SerializeToString() == expected and not casts


def test_dead_nodes_their_declarations_and_unused_initializers_go_and_the_rest_stays_as_it_was():
    out, _ = written(odd_model())
    assert [n.name for n in out.graph.node] == ["n0", "n1", "n3"]  # `dead` feeds no output
    assert "dead" not in {vi.name for vi in out.graph.value_info}
    assert [t.name for t in out.graph.initializer] == ["w"]  # read by the If's bodies, so kept
    assert all(n.doc_string == "exported from somewhere" for n in out.graph.node)
    assert not out.graph.node[0].attribute[0].t.HasField("name")
    onnx.checker.check_model(out, full_check=True)


def dead_chains_model() -> onnx.ModelProto:
    """Dead nodes before, between and after used ones; a dead node reading a used one; two outputs."""
    return onnx.parser.parse_model(header() + """
    g (float[2] x) => (float[2] y, float[2] z) {
        d0 = Relu(x)
        a = Abs(x)
        d1 = Neg(d0)
        b = Exp(a)
        d2 = Sin(b)
        y = Identity(b)
        z = Cos(a)
        d3 = Tan(z)
    }""")


def test_the_sweep_keeps_exactly_what_the_outputs_depend_on():
    out, _ = written(dead_chains_model())
    assert [n.output[0] for n in out.graph.node] == ["a", "b", "y", "z"]


def test_initializers_at_the_interface_stay_though_no_node_reads_them():
    model = onnx.parser.parse_model(header() + """
    g (float[2] x, float[2] w_in) => (float[2] y, float[2] w_out)
      <float[2] w_in = {1.0, 2.0}, float[2] w_out = {3.0, 4.0}, float[2] w = {5.0, 6.0}, float[2] gone = {0.0, 0.0}> {
        y = Mul(x, w)
    }""")
    out, _ = written(model)
    assert [t.name for t in out.graph.initializer] == ["w_in", "w_out", "w"]


def listed_graph_model(kept: bool) -> onnx.ModelProto:
    """`s` is a float sequence; a custom op holds a graph (a GRAPHS attribute) that declares it too.
    The custom op's output is a graph output when ``kept``, else the node is dead."""
    held = helper.make_graph([], "held", [], [helper.make_tensor_sequence_value_info("s", onnx.TensorProto.INT64, [2])])
    nodes = [helper.make_node("SequenceConstruct", ["x"], ["s"], name="n0"),
             helper.make_node("Op", ["x"], ["z"], name="n1", domain="custom", bodies=[held])]
    outputs = [helper.make_tensor_sequence_value_info("s", FLOAT, [2])]
    if kept:
        outputs.append(helper.make_tensor_value_info("z", FLOAT, [2]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", FLOAT, [2])], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)])


@pytest.mark.parametrize("kept", [True, False])
def test_sequences_keep_their_declared_types(kept):
    out, _ = written(listed_graph_model(kept))
    assert out.graph.output[0].type.sequence_type.elem_type.tensor_type.elem_type == FLOAT
    assert [n.name for n in out.graph.node] == (["n0", "n1"] if kept else ["n0"])


def convert_every_initializer(index: ModelIndex, edits: Edits) -> None:
    """Every float32 initializer to float16, as the plan records it."""
    for name, info in index.tensors.items():
        if info.init is not None and info.dtype == FLOAT:
            edits.converted.add(name)
            edits.dtypes[name] = onnx.TensorProto.FLOAT16


def test_converted_initializers_keep_their_order_and_hold_the_low_precision_values():
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(50):
        if i % 20 == 10:
            inits.append(numpy_helper.from_array(np.array([1, 4], np.int64), f"shape{i}"))
            nodes.append(helper.make_node("Reshape", [prev, f"shape{i}"], [f"r{i}"], name=f"r{i}"))
            prev = f"r{i}"
        inits.append(numpy_helper.from_array(rng.standard_normal((1, 4)).astype(np.float32), f"b{i}"))
        nodes.append(helper.make_node("Add", [prev, f"b{i}"], [f"a{i}"], name=f"a{i}"))
        prev = f"a{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", FLOAT, [1, 4])],
                              [helper.make_tensor_value_info(prev, FLOAT, None)], list(reversed(inits)))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out, _ = written(model, convert_every_initializer)
    assert [t.name for t in out.graph.initializer] == [t.name for t in reversed(inits)]
    for tensor, source in zip(out.graph.initializer, reversed(inits)):
        values = numpy_helper.to_array(source)
        expected = values.astype(np.float16) if values.dtype == np.float32 else values
        assert tensor.data_type == onnx.helper.np_dtype_to_tensor_dtype(expected.dtype)
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), expected)


def test_a_twin_sits_beside_its_source_and_a_cast_declares_its_output():
    model = onnx.parser.parse_model(header() + """
    g (float[2,2] x) => (float[2,2] y) <float[2,2] w = {1.0, 2.0, 3.0, 4.0}> {
        a = Add(x, w)
        y = MatMul(a, w)
    }""")

    def edit(index: ModelIndex, edits: Edits) -> None:
        edits.twins["w_fp16"] = "w"
        nodes = edits.graphs[""]
        nodes.inputs[1] = edits.inputs["MatMul_onnxmp_1"] = ["a16", "w_fp16"]  # rewired, as the plan does
        cast = NewCast("a_cast", "a", "a16", onnx.TensorProto.FLOAT16)
        edits.graphs[""] = place_after_producers(nodes, [cast])
        from onnxmp.index import TensorInfo
        edits.new_tensors["a16"] = TensorInfo("a16", dtype=onnx.TensorProto.FLOAT16, shape=[2, 2])
        edits.dtypes["y"] = onnx.TensorProto.FLOAT16
    model.graph.node[0].name, model.graph.node[1].name = "Add_onnxmp_0", "MatMul_onnxmp_1"
    out, casts = written(model, edit)
    assert casts == {"a_cast"}
    assert [n.name for n in out.graph.node] == ["Add_onnxmp_0", "a_cast", "MatMul_onnxmp_1"]
    assert [(t.name, t.data_type) for t in out.graph.initializer] == [("w", FLOAT), ("w_fp16", onnx.TensorProto.FLOAT16)]
    declared = {vi.name: vi.type.tensor_type for vi in out.graph.value_info}
    assert declared["a16"].elem_type == onnx.TensorProto.FLOAT16
    assert [d.dim_value for d in declared["a16"].shape.dim] == [2, 2]
    assert out.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16


def test_casts_are_placed_after_their_producers_following_chains():
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["a"], name="A"),
                           helper.make_node("Split", ["a"], ["b", "c"], name="B", num_outputs=2),
                           helper.make_node("Add", ["b", "c"], ["d"], name="C")], "g", [], [])
    casts = [NewCast("c_on_c", "c", "c16", 10), NewCast("x_in", "x", "x16", 10), NewCast("b_on_b", "b", "b16", 10),
             NewCast("again", "c16", "c32", 1), NewCast("d_out", "d", "d16", 10)]
    scope = ModelIndex(helper.make_model(g)).scopes[0]
    placed = place_after_producers(GraphNodes.of(scope), casts)
    # Graph inputs first; then each node's followers by output, each Cast followed by those reading it.
    assert placed.names == ["x_in", "A", "B", "b_on_b", "c_on_c", "again", "C", "d_out"]
    assert placed.inputs[placed.names.index("again")] == ["c16"]
    assert place_after_producers(GraphNodes.of(scope), []).names == ["A", "B", "C"]


@pytest.mark.parametrize("low", [FLOAT16, BFLOAT16], ids=lambda p: p.name)
@pytest.mark.parametrize("constant", ["value", "value_float", "value_floats", "sparse_value", "ConstantOfShape",
                                      "ConstantOfShape default", "Cast"])
def test_retargeted_nodes_make_the_low_precision_type_with_the_same_values(constant, low):
    values = np.array([1.5, -2.25, 3.0], np.float32)
    if constant == "value":
        node = helper.make_node("Constant", [], ["y"], name="n", value=numpy_helper.from_array(values))
    elif constant == "value_float":
        node, values = helper.make_node("Constant", [], ["y"], name="n", value_float=1.5), np.float32(1.5)
    elif constant == "value_floats":
        node = helper.make_node("Constant", [], ["y"], name="n", value_floats=values.tolist())
    elif constant == "sparse_value":
        sparse = helper.make_sparse_tensor(numpy_helper.from_array(values[1:], "v"),
                                           numpy_helper.from_array(np.array([1, 2], np.int64), "i"), [3])
        node, values = helper.make_node("Constant", [], ["y"], name="n", sparse_value=sparse), values * [0, 1, 1]
    elif constant.startswith("ConstantOfShape"):
        attrs = {} if constant.endswith("default") else {"value": numpy_helper.from_array(values[:1])}
        node = helper.make_node("ConstantOfShape", ["shape"], ["y"], name="n", **attrs)
        values = np.full(3, 0.0 if attrs == {} else values[0], np.float32)
    else:
        node = helper.make_node("Cast", ["x"], ["y"], name="n", to=FLOAT)
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.INT32, [3])] if constant == "Cast" else []
    inits = [numpy_helper.from_array(np.array([3], np.int64), "shape")] if "Shape" in constant else []
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)  # bfloat16 ConstantOfShape: 20+

    def edit(index: ModelIndex, edits: Edits) -> None:
        edits.low = low
        edits.retargeted.add("n")
        edits.dtypes["y"] = low.onnx_type
    out, _ = written(model, edit)
    onnx.checker.check_model(out, full_check=True)
    from onnx.reference import ReferenceEvaluator
    if constant == "sparse_value":  # onnx's reference runtime returns no dense tensor for it
        sparse = out.graph.node[0].attribute[0].sparse_tensor
        got = np.zeros(3, low.numpy)
        got[numpy_helper.to_array(sparse.indices)] = numpy_helper.to_array(sparse.values)
        assert sparse.values.data_type == low.onnx_type
    else:
        feeds = {"x": np.array([1, -2, 3], np.int32)} if constant == "Cast" else {}
        got, = ReferenceEvaluator(out).run(None, feeds)
    expected = np.array([1, -2, 3], np.float32) if constant == "Cast" else values
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), np.asarray(expected).astype(low.numpy).astype(np.float32))
    assert got.dtype == low.numpy
