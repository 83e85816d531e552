"""TensorFlow's AMP conformance cases, restated for ONNX.

Each case asserts colors and the Cast count, and each has a twin where the rule
does not fire.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxmp
from tests.graphs import FLOAT, FLOAT16, count_op, header, named, node_by_name, parse, tensor_types

ALLOW, DENY, FP32 = "allow", "deny", "fp32"


def convert(model, **kw):
    return onnxmp.convert(model, **kw)


def test_noop_model_without_allow_ops_is_unchanged():
    model = parse(header() + """
    g (float[4,4] x) => (float[4,4] y) {
        r = Relu(x)
        y = Sigmoid(r)
    }""")
    result = convert(model)
    assert result.model.SerializeToString() == model.SerializeToString()
    assert not result.report.changed
    assert "no allow-list op" in result.report.unchanged_reason


def test_already_fp16_model_is_untouched():
    model = parse(header() + """
    g (float16[4,4] x, float16[4,4] w) => (float16[4,4] y) {
        m = MatMul(x, w)
        y = Relu(m)
    }""")
    result = convert(model)
    assert result.model.SerializeToString() == model.SerializeToString()
    assert result.report.casts_inserted == 0


SIMPLE_CHAIN = header() + """
g (float[4,4] x) => (float[4,4] y) {
    c = Constant <value = float[4,4] {1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16}> ()
    e = Exp(c)
    r1 = Relu(e)
    s = Sqrt(r1)
    r2 = Relu(s)
    m = MatMul(r2, r2)
    r3 = Relu(m)
    l = Log(r3)
    r4 = Relu(l)
    n = Sin(r4)
    y = Relu(n)
}"""


def test_simple_chain_only_matmul_and_its_relus_go_fp16():
    result = convert(named(SIMPLE_CHAIN))
    colors = result.report.node_colors()
    assert {n for n, c in colors.items() if c == ALLOW} == {"r2", "m", "r3"}
    assert colors["e"] == DENY and colors["r1"] == DENY and colors["s"] == DENY  # deny propagated
    assert colors["l"] == FP32 and colors["r4"] == FP32 and colors["n"] == FP32 and colors["y"] == FP32
    assert result.report.casts_inserted == 2
    assert count_op(result.model, "Cast") == 2


def test_deny_propagation_stops_at_clear_op_not_upstream_of_infer():
    # r1 (clear) after Exp only feeds MatMul: it is not "upstream of deny-or-infer", so deny does not reach it.
    model = named(header() + """
    g (float[4,4] x) => (float[4,4] y) {
        e = Exp(x)
        r1 = Relu(e)
        y = MatMul(r1, r1)
    }""")
    colors = convert(model).report.node_colors()
    assert colors["e"] == DENY and colors["r1"] == ALLOW and colors["y"] == ALLOW


def test_deny_propagates_forward_through_infer():
    model = named(header() + """
    g (float[4,4] x) => (float[4,4] y) {
        e = Exp(x)
        a = Add(e, x)
        y = MatMul(a, a)
    }""")
    report = convert(model).report
    assert report.node_colors()["a"] == DENY
    add = next(v for v in report.vertices if v.node == "a")
    assert add.rule == "propagate_deny_forward_through_clear_and_infer" and "Exp `e`" in add.cause


def test_treat_infer_as_deny_variant():
    model = named(header() + """
    g (float[4,4] x) => (float[4,4] y) {
        m1 = MatMul(x, x)
        s = Sqrt(m1)
        r = Relu(s)
        y = MatMul(r, r)
    }""")
    default = convert(model).report.node_colors()
    assert default["s"] == ALLOW and default["r"] == ALLOW
    strict = convert(model, level="treat_infer_as_deny").report.node_colors()
    assert strict["s"] == DENY
    assert strict["r"] == ALLOW  # clear op next to an allow op, not upstream of deny
    assert strict["m1"] == ALLOW and strict["y"] == ALLOW


def test_bidirectional_clear_chain_shares_one_input_cast():
    model = named(header() + """
    g (float[4,4] x) => (float[4,4] m, float[8,4] c, float[4,4] r4) {
        r1 = Relu(x)
        r2 = Relu(x)
        m = MatMul(r1, r1)
        c = Concat <axis = 0> (r1, r2)
        r4 = Relu(r2)
    }""")
    result = convert(model)
    colors = result.report.node_colors()
    assert all(colors[n] == ALLOW for n in ("r1", "r2", "m", "c", "r4"))
    casts = [n for n in result.model.graph.node if n.op_type == "Cast"]
    to_low = [n for n in casts if n.attribute[0].i == FLOAT16]
    assert len(to_low) == 1 and to_low[0].input == ["x"]  # one shared Cast for both readers of x
    assert len(casts) == 4  # + one per graph output, restoring float32


def test_graph_outputs_keep_dtype_with_a_cast_before_each():
    model = named(header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y, float[4,4] z) {
        y = MatMul(x, w)
        z = Relu(y)
    }""")
    result = convert(model)
    out = result.model.graph.output
    assert [(o.name, o.type.tensor_type.elem_type) for o in out] == [("y", FLOAT), ("z", FLOAT)]
    producers = {o: n for n in result.model.graph.node for o in n.output}
    assert producers["y"].op_type == "Cast" and producers["z"].op_type == "Cast"
    assert result.report.casts_inserted == 4  # x and w in, y and z out


def test_no_keep_io_types_retypes_graph_io():
    model = named(header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        y = MatMul(x, w)
    }""")
    result = convert(model, keep_io_types=False)
    assert result.report.casts_inserted == 0
    types = {v.name: v.type.tensor_type.elem_type for v in list(result.model.graph.input) + list(result.model.graph.output)}
    assert types == {"x": FLOAT16, "w": FLOAT16, "y": FLOAT16}


def test_blocked_by_name_node_stays_fp32():
    text = header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        a = MatMul(x, w)
        y = MatMul(a, w)
    }"""
    blocked = convert(named(text), block_nodes=["^y$"]).report
    colors = blocked.node_colors()
    assert colors["y"] == FP32 and colors["a"] == ALLOW
    assert "block pattern" in next(v.cause for v in blocked.vertices if v.node == "y")
    assert convert(named(text), block_nodes=["nomatch"]).report.node_colors()["y"] == ALLOW


def test_block_pattern_matching_no_node_is_a_named_warning(caplog):
    text = header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        a = MatMul(x, w)
        y = MatMul(a, w)
    }"""
    with caplog.at_level("WARNING", logger="onnxmp"):
        convert(named(text), block_nodes=["^y$", "^a$", "nomatch"])
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "'nomatch'" in warned[0]


def _bn_model(opset: int, var_value: float = 1.0) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    c = 8
    inits = {
        "w1": rng.standard_normal((c, c, 1, 1)).astype(np.float32) * 0.3,
        "w2": rng.standard_normal((c, c, 1, 1)).astype(np.float32) * 0.3,
        "scale": np.ones(c, np.float32), "bias": np.zeros(c, np.float32),
        "mean": np.zeros(c, np.float32), "var": np.full(c, var_value, np.float32),
    }
    nodes = [
        onnx.helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1"),
        onnx.helper.make_node("BatchNormalization", ["c1", "scale", "bias", "mean", "var"], ["b"], name="bn"),
        onnx.helper.make_node("Conv", ["b", "w2"], ["y"], name="conv2"),
    ]
    graph = onnx.helper.make_graph(
        nodes, "bn", [onnx.helper.make_tensor_value_info("x", FLOAT, [1, c, 4, 4])],
        [onnx.helper.make_tensor_value_info("y", FLOAT, [1, c, 4, 4])],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def test_batchnorm_opset15_on_cuda_is_one_vertex_because_the_kernel_ties_its_types():
    # ORT's CUDA kernel binds T1 and T2 to T: a float16 X with float32 statistics has no CUDA
    # kernel and would run on the CPU with copies around it.
    result = convert(_bn_model(15))
    assert [(v.param, v.color) for v in result.report.vertices if v.node == "bn"] == [("T", ALLOW)]
    inits = {t.name: t.data_type for t in result.model.graph.initializer}
    assert all(inits[n] == FLOAT16 for n in ("scale", "bias", "mean", "var", "w1"))
    bn = node_by_name(result.model, "bn")
    assert tensor_types(result.model)[bn.input[0]] == FLOAT16


def test_batchnorm_opset15_without_kernel_ties_keeps_statistics_fp32():
    """The same model, colored against a kernel table that records no ties (a provider whose
    kernel takes the mixed node): the schema's three parameters stay three vertices."""
    from onnxmp.color import color
    from onnxmp.kernels import KernelTable
    from onnxmp.normalize import normalize
    from onnxmp.options import Options

    table = KernelTable.from_file(Path(onnxmp.__file__).parent / "data" / "ort_kernels.json")
    assert table.tied_params("cuda", "", "BatchNormalization", 15) == ()
    index = normalize(_bn_model(15)).index
    coloring = color(index, Options().resolve(index.model), kernels=table)
    assert coloring.is_allow("bn:T") and not coloring.is_allow("bn:T1") and not coloring.is_allow("bn:T2")


def test_batchnorm_statistics_out_of_float16_range_keep_the_tied_node_fp32():
    # A running variance above 65504 cannot go float16; with the types tied, X stays float32 too.
    result = convert(_bn_model(15, var_value=1e6))
    assert [(v.param, v.color) for v in result.report.vertices if v.node == "bn"] == [("T", DENY)]
    inits = {t.name: t.data_type for t in result.model.graph.initializer}
    assert inits["var"] == FLOAT and inits["scale"] == FLOAT and inits["w1"] == FLOAT16


def test_batchnorm_opset13_decides_as_one_vertex():
    result = convert(_bn_model(13))
    assert [v.param for v in result.report.vertices if v.node == "bn"] == ["T"]
    inits = {t.name: t.data_type for t in result.model.graph.initializer}
    assert all(inits[n] == FLOAT16 for n in ("scale", "bias", "mean", "var"))


def test_variadic_concat_and_sum_retype_every_input_together():
    model = named(header() + """
    g (float[4,4] x, float[4,4] w) => (float[12,4] y) {
        a = MatMul(x, w)
        b = MatMul(w, x)
        s = Sum(a, b, x)
        c = Concat <axis = 0> (s, a, x)
        y = MatMul(c, w)
    }""")
    result = convert(model)
    colors = result.report.node_colors()
    assert colors["s"] == ALLOW and colors["c"] == ALLOW
    types = tensor_types(result.model)
    assert all(types[i] == FLOAT16 for i in node_by_name(result.model, "s").input)
    assert all(types[i] == FLOAT16 for i in node_by_name(result.model, "c").input)
    # x is read low by four positions but cast once.
    assert sum(1 for n in result.model.graph.node if n.op_type == "Cast" and n.input == ["x"]) == 1
    assert result.report.casts_inserted == 3  # x, w, y


def test_variadic_sum_with_a_deny_input_stays_fp32():
    model = named(header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        a = MatMul(x, w)
        e = Exp(x)
        s = Sum(a, e)
        y = MatMul(s, w)
    }""")
    assert convert(model).report.node_colors()["s"] == DENY


def test_existing_cast_bool_to_float_feeding_matmul_is_retargeted():
    model = named(header() + """
    g (bool[4,4] b, float[4,4] w) => (float[4,4] y) {
        f = Cast <to = 1> (b)
        y = MatMul(f, w)
    }""")
    result = convert(model)
    cast = node_by_name(result.model, "f")
    assert cast.attribute[0].i == FLOAT16
    assert result.report.casts_inserted == 2  # w in, y out; none after the retargeted Cast
    rule = next(v for v in result.report.vertices if v.vertex == "f:T2").rule
    assert rule == "make_casts_allow_if_all_outputs_allow"


def test_existing_cast_with_an_fp32_consumer_is_not_retargeted():
    model = named(header() + """
    g (bool[4,4] b, float[4,4] w) => (float[4,4] y, float[4,4] z) {
        f = Cast <to = 1> (b)
        y = MatMul(f, w)
        z = Sin(f)
    }""")
    result = convert(model)
    assert node_by_name(result.model, "f").attribute[0].i == FLOAT


@pytest.mark.parametrize("op", ["Elu", "Erf", "Log", "LogSoftmax", "Reciprocal", "Sigmoid", "Softmax",
                                "Softplus", "Sqrt", "Tanh"])
def test_each_infer_op_between_two_matmuls_goes_fp16(op):
    model = named(header() + f"""
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {{
        a = MatMul(x, w)
        i = {op}(a)
        y = MatMul(i, w)
    }}""")
    result = convert(model)
    assert result.report.node_colors()["i"] == ALLOW
    assert result.report.casts_inserted == 3  # x, w in; y out (w is a graph input here)


@pytest.mark.parametrize("op", ["Sigmoid", "Log"])
def test_infer_op_after_allow_but_not_between_stays_fp32(op):
    model = named(header() + f"""
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {{
        a = MatMul(x, w)
        y = {op}(a)
    }}""")
    assert convert(model).report.node_colors()["y"] == FP32


@pytest.mark.parametrize("mask", ["float", "bool"])
def test_attention_tied_types_take_a_float_mask_along_and_leave_a_bool_mask(mask):
    # ORT's CUDA Attention-23 binds Q/K (T1), V (T2) and a float mask (U) to one type; a bool
    # mask is no float tensor and keeps its type.
    model = onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: ["" : 23]>
    g (float[1,2,4,8] x, float[8,8] w, {mask}[4,4] m) => (float[1,2,4,8] y) {{
        q = MatMul(x, w)
        k = MatMul(x, w)
        a = Attention(q, k, x, m)
        y = MatMul(a, w)
    }}""")
    for i, node in enumerate(model.graph.node):
        node.name = "att" if node.op_type == "Attention" else f"n{i}"
    result = convert(model, lists={"allow_add": ["Attention"]})
    assert [(v.param, v.color) for v in result.report.vertices if v.node == "att"] == [("T1", ALLOW)]
    att = node_by_name(result.model, "att")
    types = tensor_types(result.model)
    expected_mask = FLOAT16 if mask == "float" else onnx.TensorProto.BOOL
    assert [types[t] for t in att.input] == [FLOAT16, FLOAT16, FLOAT16, expected_mask]
