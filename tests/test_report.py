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
