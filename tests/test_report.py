"""Summaries: a truncated list always says how much was left out ("… N more")."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import onnxmp
from onnxmp.report import head


def test_head_notes_what_it_cuts():
    assert head([1, 2, 3], 3) == ([1, 2, 3], "")
    assert head([1, 2, 3, 4, 5], 2) == ([1, 2], "… 3 more")
    assert head([], 1) == ([], "")


def test_summary_lists_say_how_many_more():
    nodes, inits, outs = [], [], []
    for i in range(25):  # 25 denied Exps; 50 Tensor Core hints (K = N = 3)
        inits.append(numpy_helper.from_array(np.full((3, 3), 0.1, np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Exp", [f"m{i}"], [f"e{i}"], name=f"exp{i}")]
        outs.append(helper.make_tensor_value_info(f"e{i}", TP.FLOAT, [4, 3]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [4, 3])], outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    lines = onnxmp.explain(model).summary().splitlines()
    denied = lines[lines.index("kept in fp32 (deny):") + 1:]
    assert sum(line.startswith("  exp") for line in denied) == 20
    assert "  … 5 more (see --report JSON)" in denied
    assert "  … 30 more" in lines


def test_short_lists_have_no_more_line():
    graph = helper.make_graph([helper.make_node("Exp", ["x"], ["y"], name="exp")], "g",
                              [helper.make_tensor_value_info("x", TP.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert "more" not in onnxmp.explain(model).summary()


def _tiny_model():
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TP.FLOAT, [4, 3])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [4, 3])],
                              [numpy_helper.from_array(np.full((3, 3), 0.1, np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_deferred_rows_are_built_once_and_read_like_plain_fields():
    import pickle

    from onnxmp.report import Report

    report = onnxmp.convert(_tiny_model()).report
    eager = onnxmp.explain(_tiny_model())
    assert report.vertices == eager.vertices and report.advice == eager.advice
    assert [a.dimension for a in report.advice] == ["K", "N"]
    assert report.to_dict()["vertices"] == eager.to_dict()["vertices"]
    copy = pickle.loads(pickle.dumps(report))
    assert copy.vertices == report.vertices and copy.advice == report.advice
    calls = []
    later = Report("cuda", "float16", "default")
    later.defer("vertices", lambda: calls.append(1) or ["row"])
    assert later.vertices == ["row"] and later.vertices == ["row"] and calls == [1]
    later.defer("advice", lambda: calls.append(2) or ["never built"])
    later.advice = []
    assert later.advice == [] and calls == [1]


def _findings(model, paint=()):
    """tensor_core_findings of ``model`` colored with the defaults, after painting ``paint`` (vertex
    keys) ALLOW."""
    from onnxmp.color import color
    from onnxmp.normalize import normalize
    from onnxmp.options import Options
    from onnxmp.report import tensor_core_findings

    graph = normalize(model).index
    state = color(graph, Options().resolve(graph.model))
    for key in paint:
        state.paint(key, "allow", "test", "painted by the test")
    return tensor_core_findings(graph, state)


def _value(name, shape):
    return helper.make_tensor_value_info(name, TP.FLOAT, shape)


def _weight(name, shape, value=0.1):
    return numpy_helper.from_array(np.full(shape, value, np.float32), name)


def test_tensor_core_findings_cover_each_op_in_graph_order_across_bodies():
    # A Gemm in each If branch (transposes read), a ConvTranspose (groups), a MatMul with a symbolic
    # K and one whose A has no shape: findings come in the view's node order, bodies after the main
    # graph, and the nodes inside bodies are read from their own graph.
    then_g = helper.make_graph([helper.make_node("Gemm", ["a", "wt"], ["t"], name="gemm_then", transA=1)],
                               "then", [], [_value("t", [8, 20])])
    else_g = helper.make_graph([helper.make_node("Gemm", ["a2", "we"], ["e"], name="gemm_else", transB=1)],
                               "else", [], [_value("e", [8, 20])])
    nodes = [
        helper.make_node("ConvTranspose", ["img", "k"], ["ct"], name="ct", group=2),
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("MatMul", ["s", "w"], ["sym"], name="sym"),
        helper.make_node("Relu", ["u"], ["r"], name="r"),
        helper.make_node("MatMul", ["r", "w"], ["unknown"], name="unknown"),
        helper.make_node("If", ["c"], ["y"], name="if", then_branch=then_g, else_branch=else_g),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [_value("img", [1, 12, 5, 5]), _value("x", [4, 30]), _value("s", [4, "K"]), _value("u", None),
         _value("a", [30, 8]), _value("a2", [8, 30]), helper.make_tensor_value_info("c", TP.BOOL, [])],
        [_value("ct", None), _value("mm", [4, 20]), _value("sym", [4, 20]), _value("unknown", None),
         _value("y", [8, 20])],
        [_weight("k", (12, 6, 3, 3)), _weight("w", (30, 20)), _weight("wt", (30, 20)), _weight("we", (20, 30))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert _findings(model) == [
        ("ct", "ConvTranspose", "input channels", 12), ("ct", "ConvTranspose", "output channels", 12),
        ("mm", "MatMul", "K", 30), ("mm", "MatMul", "N", 20),
        ("sym", "MatMul", "N", 20),             # K = "K" is symbolic
        ("unknown", "MatMul", "N", 20),         # no K: A's shape is unknown
        # bodies in attribute order (make_node sorts them: else_branch first)
        ("gemm_else", "Gemm", "K", 30), ("gemm_else", "Gemm", "N", 20),  # transB: N is we's first dim
        ("gemm_then", "Gemm", "K", 30), ("gemm_then", "Gemm", "N", 20),  # transA: K is a's first dim
    ]


def test_tensor_core_findings_skip_nodes_that_stay_float32_and_friendly_dims():
    nodes = [helper.make_node("MatMul", ["x", "big"], ["d"], name="denied"),   # range seed: stays fp32
             helper.make_node("MatMul", ["x", "w"], ["f"], name="friendly"),   # K = 16, N = 4: friendly
             helper.make_node("MatMul", ["v", "w1"], ["o"], name="vector")]    # 1-D B: no N
    graph = helper.make_graph(
        nodes, "g", [_value("x", [4, 16]), _value("v", [30])],
        [_value("d", [4, 30]), _value("f", [4, 4]), _value("o", [])],
        [_weight("big", (16, 30), 1e6), _weight("w", (16, 4)), _weight("w1", (30,))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert _findings(model) == [("vector", "MatMul", "K", 30)]


def test_tensor_core_findings_read_ops_of_any_domain():
    # An op of another domain named like a Tensor Core op is advised on once it goes low precision
    # (here painted by hand: no kernel table knows it).
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="custom", domain="com.example")
    graph = helper.make_graph([node], "g", [_value("x", [4, 30])], [_value("y", [4, 20])], [_weight("w", (30, 20))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)],
                              ir_version=8)
    assert _findings(model) == []
    assert _findings(model, paint=["custom:*"]) == [("custom", "MatMul", "K", 30), ("custom", "MatMul", "N", 20)]
