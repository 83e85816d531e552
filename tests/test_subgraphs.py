"""Subgraph color matching (TF's force_color_match): Loop carried values, If outputs, Scan state, outer-scope reads."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxmp
from onnxmp.parity.emulate import emulate

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


def _if_model(then_op: str, else_op: str, post_op: str = "MatMul") -> onnx.ModelProto:
    then_g = onnx.helper.make_graph([onnx.helper.make_node(then_op, ["h", "wb"] if then_op == "MatMul" else ["h"],
                                                           ["t_out"], name="then_op")], "then", [], [_vi("t_out")])
    else_g = onnx.helper.make_graph([onnx.helper.make_node(else_op, ["h", "wb"] if else_op == "MatMul" else ["h"],
                                                           ["e_out"], name="else_op")], "else", [], [_vi("e_out")])
    nodes = [onnx.helper.make_node("MatMul", ["x", "w0"], ["h"], name="pre"),
             onnx.helper.make_node("If", ["cond"], ["z"], name="if", then_branch=then_g, else_branch=else_g),
             onnx.helper.make_node(post_op, ["z", "w0"] if post_op == "MatMul" else ["z"], ["y"], name="post")]
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


def _branches(result):
    if_node = next(n for n in result.model.graph.node if n.op_type == "If")
    return (next(a.g for a in if_node.attribute if a.name == "then_branch"),
            next(a.g for a in if_node.attribute if a.name == "else_branch"))


def test_if_whose_branches_differ_keeps_its_output_fp32_for_a_float32_reader():
    model = _if_model("MatMul", "Exp", post_op="Exp")
    result = onnxmp.convert(model)
    then_g, else_g = _branches(result)
    assert _types(then_g)["t_out"] == FLOAT and _types(else_g)["e_out"] == FLOAT
    assert sum(n.op_type == "Cast" for n in then_g.node) == 1  # restores fp32 at the branch output
    # Exp reads the outer low `h` through a float32 Cast of it made in its branch, the only graph
    # reading it in float32 (it runs only when the branch is taken); none in the outer graph.
    assert [n.input[0] for n in else_g.node if n.op_type == "Cast"] == ["h"]
    assert not any(n.op_type == "Cast" and n.input[0] == "h" for n in result.model.graph.node)
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32) * 0.1
    for cond in (True, False):
        _check_parity(model, result.model, {"x": x, "cond": np.array(cond)})
    note = result.coloring.group_notes
    assert any("If output" in k for k in note)


def test_if_whose_branches_differ_returns_fp16_when_only_a_low_reader_reads_it():
    # The coloring keeps the If output fp32 (the branches differ); its one reader wants fp16.  A
    # restore Cast in the MatMul branch plus a Cast after the If (2) become one Cast at the end of
    # the Exp branch: the same values, one Cast fewer, none more on either path.
    model = _if_model("MatMul", "Exp")
    result = onnxmp.convert(model)
    then_g, else_g = _branches(result)
    assert _types(then_g)["t_out"] == FLOAT16 and _types(else_g)["e_out"] == FLOAT16
    assert sum(n.op_type == "Cast" for n in then_g.node) == 0
    # The Exp branch reads the outer low `h` through its own float32 Cast, and narrows its output.
    assert [n.attribute[0].i for n in else_g.node if n.op_type == "Cast"] == [FLOAT, FLOAT16]
    assert not any(n.op_type == "Cast" and n.input[0] in ("z", "h") for n in result.model.graph.node)
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32) * 0.1
    for cond in (True, False):
        _check_parity(model, result.model, {"x": x, "cond": np.array(cond)})


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


# --- sequence and optional values (ONNX conformance cases test_if_opt, test_loop16_seq_none,
# --- test_sequence_map_*, test_loop13_seq, test_scan_sum) ----------------------------------

from onnxmp.verify import io_signature  # noqa: E402
from tests.graphs import header, parse  # noqa: E402


def test_if_returning_an_optional_sequence_beside_matmul_work_converts():
    # An optional's GS dtype is a whole TypeProto: it crashed coloring (unhashable) and GS export.
    model = parse(header(18) + """
    g (bool cond, float[4,4] a, float[4,4] b) => (optional(seq(float[5])) s, float[4,4] y) {
        y = MatMul(a, b)
        s = If(cond) <
            then_branch = then_g () => (optional(seq(float[5])) e) {
                e = Optional <type = seq(float[5])> ()
            },
            else_branch = else_g () => (optional(seq(float[5])) f) {
                x = Constant <value = float[5] {1,2,3,4,5}> ()
                q = SequenceConstruct(x)
                f = Optional(q)
            }>
    }""")
    for level in ("default", "unsafe_force_all"):
        result = onnxmp.convert(model, level=level)
        assert result.report.changed
        assert io_signature(result.model) == io_signature(model)


def test_loop_over_an_optional_sequence_keeps_its_types():
    model = parse(header(18) + """
    g (int64 n, bool c, optional(seq(float)) o, float[4,4] a) => (seq(float) r, float[4,4] y) {
        y = MatMul(a, a)
        r = Loop(n, c, o) <body = body_g (int64 i, bool c_in, optional(seq(float)) o_in)
                                          => (bool c_out, seq(float) s_out) {
            c_out = Identity(c_in)
            has = OptionalHasElement(o_in)
            s_out = If(has) <
                then_branch = t_g () => (seq(float) s1) { s1 = OptionalGetElement(o_in) },
                else_branch = e_g () => (seq(float) s2) {
                    z = Constant <value = float {0}> ()
                    s2 = SequenceConstruct(z)
                }>
        }>
    }""")
    result = onnxmp.convert(model, level="unsafe_force_all")
    assert io_signature(result.model) == io_signature(model)


SEQUENCE_MAP = header(17) + """
g (seq(float[N]) xs, float[N] t) => (seq(float[N]) ys) {
    ys = SequenceMap(xs, t) <body = body_g (float[N] x, float[N] u) => (float[N] z) {
        z = Add(x, u)
    }>
}"""


def test_sequence_interface_keeps_element_shapes_when_a_body_goes_low():
    # GS writes sequences without their element shape: the graph's declared I/O types changed.
    model = parse(SEQUENCE_MAP)
    result = onnxmp.convert(model, level="unsafe_force_all")
    assert result.report.changed
    assert io_signature(result.model) == io_signature(model)


def test_sequence_interface_untouched_when_nothing_goes_low():
    model = parse(SEQUENCE_MAP)
    result = onnxmp.convert(model)
    assert not result.report.changed
    assert io_signature(result.model) == io_signature(model)


def test_declared_output_type_is_kept_where_inference_would_refine_it():
    # The declared seq(float) output has no element shape; inference infers one from the body.
    model = parse(header(13) + """
    g (int64 n, bool c, seq(float) s0, float[4,4] a) => (seq(float) r, float[4,4] y) {
        y = MatMul(a, a)
        r = Loop(n, c, s0) <body = body_g (int64 i, bool c_in, seq(float) s_in) => (bool c_out, seq(float) s_out) {
            c_out = Identity(c_in)
            v = Constant <value = float {1}> ()
            s_out = SequenceInsert(s_in, v)
        }>
    }""")
    model.graph.output[0].type.sequence_type.elem_type.tensor_type.ClearField("shape")  # rank unknown
    onnx.checker.check_model(model, full_check=True)
    result = onnxmp.convert(model, level="unsafe_force_all")
    assert io_signature(result.model) == io_signature(model)


SCAN_SUM = """
g (float[%(b)s2] initial, float[%(b)s3,2] x) => (float[%(b)s2] y, float[%(b)s3,2] z) {
    y, z = Scan(%(lens)s initial, x) <num_scan_inputs = 1, body = body_g (float[2] acc, float[2] v) => (float[2] acc_out, float[2] each) {
        acc_out = Add(acc, v)
        each = Identity(acc_out)
    }>
}"""


@pytest.mark.parametrize("opset", [8, 9])
def test_scan_state_pairs_outer_and_body_values_in_both_scan_layouts(opset):
    # Scan-8 has a leading sequence_lens input its body does not see (and a batch axis); Scan-9+ has neither.
    batched = opset == 8
    model = parse(header(opset) + SCAN_SUM % {"b": "1," if batched else "", "lens": '"",' if batched else ""},
                  ir_version=7)
    result = onnxmp.convert(model, level="unsafe_force_all")
    groups = {g["name"]: g["members"] for g in result.report.groups}
    state = next(members for name, members in groups.items() if "carried value" in name)
    assert state == ["initial", "acc", "acc_out", "y"]
    lead = (1,) if batched else ()
    feeds = {"initial": np.ones(lead + (2,), np.float32), "x": np.arange(6, dtype=np.float32).reshape(lead + (3, 2))}
    out = ort.InferenceSession(emulate(result.model).SerializeToString()).run(None, feeds)
    np.testing.assert_array_equal(out[0].reshape(2), [7, 10])
