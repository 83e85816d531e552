"""Subgraph color matching (spec §5.7): Loop carried values, If outputs, Scan state, outer-scope reads."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxmp
from onnxmp.emulate import emulate

FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
ort = pytest.importorskip("onnxruntime")


def _model(nodes, inputs, outputs, inits=()):
    graph = onnx.helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _w(name, seed=0, n=8):
    rng = np.random.default_rng(seed)
    return onnx.numpy_helper.from_array((rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32), name)


def _vi(name, elem=FLOAT, shape=(4, 8)):
    return onnx.helper.make_tensor_value_info(name, elem, list(shape))


def _check_parity(model, converted, feeds):
    ref = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    out = ort.InferenceSession(emulate(converted).SerializeToString()).run(None, feeds)
    for r, o in zip(ref, out):
        np.testing.assert_allclose(o, r, rtol=2e-2, atol=2e-2)


def _types(graph: onnx.GraphProto) -> dict[str, int]:
    return {v.name: v.type.tensor_type.elem_type for v in list(graph.input) + list(graph.output)}


def _loop_model(body_text: str) -> onnx.ModelProto:
    body = onnx.parser.parse_graph(body_text)
    nodes = [onnx.helper.make_node("MatMul", ["x", "w0"], ["h"], name="pre"),
             onnx.helper.make_node("Loop", ["trip", "", "h"], ["v_final"], name="loop", body=body),
             onnx.helper.make_node("MatMul", ["v_final", "w0"], ["y"], name="post")]
    return _model(nodes, [_vi("x")], [_vi("y")],
                  [onnx.numpy_helper.from_array(np.array(3, np.int64), "trip"), _w("w0"), _w("wb", 1)])


def test_loop_carried_value_doing_matmul_work_goes_fp16_as_a_group():
    model = _loop_model("""
    body (int64 i, bool c, float[4,8] v) => (bool c_out, float[4,8] v_out) {
        m = MatMul(v, wb)
        c_out = Identity(c)
        v_out = Relu(m)
    }""")
    result = onnxmp.convert(model)
    loop = next(n for n in result.model.graph.node if n.op_type == "Loop")
    body = loop.attribute[0].g
    assert _types(body)["v"] == FLOAT16 and _types(body)["v_out"] == FLOAT16
    assert not any(n.op_type == "Cast" for n in body.node)  # no Cast inside the loop at all
    assert result.report.casts_inserted == 2  # x in, y out: the carried value never round-trips
    _check_parity(model, result.model, {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)})


def test_loop_carried_value_through_a_deny_op_stays_fp32():
    model = _loop_model("""
    body (int64 i, bool c, float[4,8] v) => (bool c_out, float[4,8] v_out) {
        m = MatMul(v, wb)
        c_out = Identity(c)
        v_out = Exp(m)
    }""")
    result = onnxmp.convert(model)
    body = next(n for n in result.model.graph.node if n.op_type == "Loop").attribute[0].g
    assert _types(body)["v"] == FLOAT and _types(body)["v_out"] == FLOAT
    assert sum(n.op_type == "Cast" for n in body.node) == 2  # into and out of the body's MatMul
    _check_parity(model, result.model, {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32) * 0.1})


def _if_model(then_op: str, else_op: str) -> onnx.ModelProto:
    then_g = onnx.helper.make_graph([onnx.helper.make_node(then_op, ["h", "wb"] if then_op == "MatMul" else ["h"],
                                                           ["t_out"], name="then_op")], "then", [], [_vi("t_out")])
    else_g = onnx.helper.make_graph([onnx.helper.make_node(else_op, ["h", "wb"] if else_op == "MatMul" else ["h"],
                                                           ["e_out"], name="else_op")], "else", [], [_vi("e_out")])
    nodes = [onnx.helper.make_node("MatMul", ["x", "w0"], ["h"], name="pre"),
             onnx.helper.make_node("If", ["cond"], ["z"], name="if", then_branch=then_g, else_branch=else_g),
             onnx.helper.make_node("MatMul", ["z", "w0"], ["y"], name="post")]
    return _model(nodes, [_vi("x"), onnx.helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])],
                  [_vi("y")], [_w("w0"), _w("wb", 1)])


def test_if_whose_branches_both_do_matmul_returns_fp16():
    model = _if_model("MatMul", "MatMul")
    result = onnxmp.convert(model)
    if_node = next(n for n in result.model.graph.node if n.op_type == "If")
    for attr in if_node.attribute:
        assert _types(attr.g)[attr.g.output[0].name] == FLOAT16
        assert not any(n.op_type == "Cast" for n in attr.g.node)
    # h is read low inside both branches straight from the outer scope: no Cast for it anywhere.
    assert result.report.casts_inserted == 2
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    for cond in (True, False):
        _check_parity(model, result.model, {"x": x, "cond": np.array(cond)})


def test_if_whose_branches_differ_keeps_its_output_fp32():
    model = _if_model("MatMul", "Exp")
    result = onnxmp.convert(model)
    if_node = next(n for n in result.model.graph.node if n.op_type == "If")
    then_g = next(a.g for a in if_node.attribute if a.name == "then_branch")
    else_g = next(a.g for a in if_node.attribute if a.name == "else_branch")
    assert _types(then_g)["t_out"] == FLOAT and _types(else_g)["e_out"] == FLOAT
    assert sum(n.op_type == "Cast" for n in then_g.node) == 1  # restores fp32 at the branch output
    # Exp reads the outer low `h` through the fp32 copy restored in the outer graph.
    assert sum(n.op_type == "Cast" for n in else_g.node) == 0
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32) * 0.1
    for cond in (True, False):
        _check_parity(model, result.model, {"x": x, "cond": np.array(cond)})
    note = result.coloring.coloring.group_notes
    assert any("If output" in k for k in note)


def test_scan_state_doing_matmul_work_goes_fp16():
    body = onnx.parser.parse_graph("""
    body (float[4,8] s, float[8] e) => (float[4,8] s_out, float[4,8] scan_out) {
        m = MatMul(s, wb)
        a = Add(m, e)
        s_out = Relu(a)
        scan_out = Identity(s_out)
    }""")
    nodes = [onnx.helper.make_node("MatMul", ["x", "w0"], ["h"], name="pre"),
             onnx.helper.make_node("Scan", ["h", "seq"], ["s_final", "outs"], name="scan", body=body,
                                   num_scan_inputs=1),
             onnx.helper.make_node("MatMul", ["s_final", "w0"], ["y"], name="post")]
    model = _model(nodes, [_vi("x"), _vi("seq", shape=(3, 8))], [_vi("y"), _vi("outs", shape=(3, 4, 8))],
                   [_w("w0"), _w("wb", 1)])
    result = onnxmp.convert(model)
    scan = next(n for n in result.model.graph.node if n.op_type == "Scan")
    body_types = _types(scan.attribute[0].g)
    assert body_types["s"] == FLOAT16 and body_types["s_out"] == FLOAT16
    assert {v.name: v.type.tensor_type.elem_type for v in result.model.graph.output} == {"y": FLOAT, "outs": FLOAT}
    rng = np.random.default_rng(0)
    _check_parity(model, result.model, {"x": rng.standard_normal((4, 8)).astype(np.float32),
                                        "seq": rng.standard_normal((3, 8)).astype(np.float32)})


def test_report_lists_control_flow_groups_and_their_outcome():
    report = onnxmp.convert(_if_model("MatMul", "Exp")).report
    (group,) = report.groups
    assert group["name"].startswith("If output") and not group["low"]
    assert "is not computed by an allow vertex" in group["why"]
    assert "control-flow groups" in report.summary()
    low = onnxmp.convert(_if_model("MatMul", "MatMul")).report.groups
    assert low[0]["low"] and low[0]["why"] == ""
