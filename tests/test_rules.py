"""Each coloring rule and data seed: a case where it fires and one where it does not."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest

import onnxmp
from onnxmp.color import color
from onnxmp.options import Options
from onnxmp.color.rules import ALLOW, DENY, force_color_match, remove_allow_set_with_fp32
from onnxmp.lists import resolve_lists
from onnxmp.normalize import normalize
from tests.graphs import FLOAT, FLOAT16, header, named, parse, vertex


def colors(model, **kw) -> dict[str, str]:
    return onnxmp.explain(model, **kw).node_colors()


BETWEEN = header() + """
g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
    a = MatMul(x, w)
    b = Add(a, x)
    y = MatMul(b, w)
}"""
AFTER = header() + """
g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
    a = MatMul(x, w)
    y = Add(a, x)
}"""


def test_add_allow_ops_fires_for_allow_op_with_kernel():
    assert colors(named(AFTER))["a"] == ALLOW


def test_add_allow_ops_does_not_fire_without_a_low_precision_kernel():
    report = onnxmp.explain(named(AFTER), target="cpu")  # ORT CPU has no fp16 MatMul
    assert report.node_colors()["a"] == "fp32"
    assert not report.changed
    assert "no CPUExecutionProvider float16 kernel for MatMul" in next(v.cause for v in report.vertices if v.node == "a")


def test_between_allow_fires_and_does_not_fire():
    assert colors(named(BETWEEN))["b"] == ALLOW
    assert colors(named(AFTER))["y"] == "fp32"


def test_add_infer_to_allow_if_follow_allow_only_in_bfloat16():
    assert colors(named(AFTER), precision="bfloat16")["y"] == ALLOW
    assert colors(named(AFTER), precision="float16")["y"] == "fp32"


def test_add_infer_to_allow_if_follow_allow_skips_infer_with_deny_input():
    model = named(header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        a = MatMul(x, w)
        e = Exp(x)
        y = Add(a, e)
    }""")
    assert colors(model, precision="bfloat16")["y"] == DENY


def test_propagate_allow_through_clear_fires_and_does_not_cross_infer():
    fires = named(header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        a = MatMul(x, w)
        y = Relu(a)
    }""")
    assert colors(fires)["y"] == ALLOW
    blocked = named(header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        a = MatMul(x, w)
        s = Sigmoid(a)
        y = Relu(s)
    }""")
    result = colors(blocked)
    assert result["s"] == "fp32" and result["y"] == "fp32"



@pytest.mark.parametrize("first", ["a", "b"])
def test_propagate_allow_through_clear_names_the_allow_vertex_painted_first(first):
    # c is next to both MatMuls; r and y only to clear vertices: each walk starts from the allow
    # vertices in paint order (node order here), so the first MatMul names every cause.
    second = "b" if first == "a" else "a"
    model = named(header() + f"""
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {{
        {first} = MatMul(x, w)
        {second} = MatMul(w, x)
        c = Max(a, b)
        r = Relu(c)
        y = Identity(r)
    }}""")
    report = onnxmp.explain(model)
    for key in ("c:T", "r:T", "y:V"):
        row = vertex(report, key)
        assert (row.color, row.rule) == (ALLOW, "propagate_allow_through_clear")
        assert row.cause == f"clear op connected to allow MatMul `{first}`"

def _state(model, **kw):
    normalized = normalize(model)
    return color(normalized.index, Options.of(**kw).resolve(normalized.index.model))


def test_remove_allow_set_with_fp32_removes_incapable_vertex():
    state = _state(named(AFTER))
    add = "y:T"
    assert not state.is_allow(add)
    state.view.vertices[add].capable = False
    state.paint(add, ALLOW, "test", "forced")
    assert remove_allow_set_with_fp32(state).modified
    assert not state.is_allow(add)


def test_remove_allow_set_with_fp32_keeps_capable_vertices():
    state = _state(named(BETWEEN))
    before = set(state.allow_ids())
    assert not remove_allow_set_with_fp32(state).modified
    assert set(state.allow_ids()) == before


IF_MODEL = header() + """
g (float[4] x, bool c) => (float[4] y) {
    y = If(c) <then_branch = t () => (float[4] yt) { yt = Relu(x) },
               else_branch = e () => (float[4] ye) { ye = Sigmoid(x) }>
}"""


def test_force_color_match_keeps_control_flow_io_fp32_even_if_listed():
    model = named(IF_MODEL)
    report = onnxmp.explain(model, lists={"allow_add": ["If"]})
    v = next(v for v in report.vertices if v.node == "y")
    assert v.color == DENY and v.rule == "force_color_match"


def test_force_color_match_does_nothing_without_control_flow():
    state = _state(named(BETWEEN))
    assert not force_color_match(state).modified


def test_env_overrides_apply(monkeypatch):
    monkeypatch.setenv("ONNXMP_ALLOWLIST_REMOVE", "MatMul")
    assert colors(named(AFTER))["a"] == "fp32"
    monkeypatch.delenv("ONNXMP_ALLOWLIST_REMOVE")
    monkeypatch.setenv("ONNXMP_CLEARLIST_REMOVE", "Relu")
    monkeypatch.setenv("ONNXMP_INFERLIST_ADD", "Relu")
    model = named(header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        a = MatMul(x, w)
        y = Relu(a)
    }""")
    assert colors(model)["y"] == "fp32"  # as an infer op, Relu no longer follows a lone allow op


def test_op_in_two_lists_is_an_error(monkeypatch):
    with pytest.raises(onnxmp.OnnxMPError, match="both the allow and the deny list"):
        onnxmp.convert(named(AFTER), lists={"allow_add": ["Exp"]})
    monkeypatch.setenv("ONNXMP_CLEARLIST_ADD", "MatMul")
    with pytest.raises(onnxmp.OnnxMPError, match="MatMul"):
        onnxmp.convert(named(AFTER))


def test_bad_list_key_and_level_are_errors():
    with pytest.raises(onnxmp.OnnxMPError, match="unknown list override"):
        onnxmp.convert(named(AFTER), lists={"allowed": ["X"]})
    with pytest.raises(onnxmp.OnnxMPError, match="unknown level"):
        onnxmp.convert(named(AFTER), level="fast")


@pytest.mark.parametrize("spec, hint", [
    ({"allow_add": ["Foo"]}, None),
    ({"deny_add": ["matmul"]}, "'MatMul'"),          # case-insensitive match
    ({"infer_remove": ["Gemmm"]}, "'Gemm'"),
    ({"clear_add": ["LayerNorm"]}, "'LayerNormalization'"),
    ({"allow_add": ["FusedMatMul"]}, "'com.microsoft:FusedMatMul'"),  # another domain's op, bare
])
def test_unknown_op_in_a_list_override_is_an_error_with_a_close_match(spec, hint):
    with pytest.raises(onnxmp.OnnxMPError, match="unknown op") as caught:
        onnxmp.convert(named(AFTER), lists=spec)
    key = next(iter(spec))
    assert key in caught.value.message and "--" + key.replace("_", "-") in caught.value.message
    assert caught.value.hint and (hint is None or hint in caught.value.hint)


def test_unknown_op_in_an_environment_override_names_the_variable(monkeypatch):
    monkeypatch.setenv("ONNXMP_DENYLIST_ADD", "Exp,Sofmax")
    with pytest.raises(onnxmp.OnnxMPError, match="ONNXMP_DENYLIST_ADD") as caught:
        onnxmp.convert(named(AFTER))
    assert "'Softmax'" in caught.value.hint


def test_known_and_custom_domain_ops_in_overrides_are_accepted():
    lists = resolve_lists(lists={"deny_remove": ["Exp"], "allow_add": ["com.microsoft.FusedConv", "my.domain:MyOp"],
                                 "infer_add": ["ai.onnx:Celu"]})
    assert "Exp" not in lists["deny"]
    assert {"com.microsoft:FusedConv", "my.domain:MyOp"} <= lists["allow"]  # dotted = domain:OpType
    assert "Celu" in lists["infer"]


def test_every_default_list_entry_names_a_known_op():
    from onnxmp.lists import default_lists, is_onnx_op
    from onnxmp.precision import PRECISIONS
    from onnxmp.targets import NAMES as TARGETS

    for target in TARGETS:
        for precision in PRECISIONS:
            for ops in default_lists(target, precision).values():
                assert all(":" in op or is_onnx_op(op) for op in ops), sorted(ops)


def test_level_tensor_cores_only_changes_only_allow_ops():
    result = colors(named(BETWEEN), level="tensor_cores_only")
    assert result["a"] == ALLOW and result["y"] == ALLOW and result["b"] == "fp32"


def test_level_unsafe_force_all_converts_deny_ops_but_not_random_or_loss():
    model = named(header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        a = MatMul(x, w)
        e = Exp(a)
        y = MatMul(e, w)
    }""")
    assert colors(model)["e"] == DENY
    assert colors(model, level="unsafe_force_all")["e"] == ALLOW
    from onnxmp.lists import resolve_lists as rl

    forced = rl(level="unsafe_force_all")
    assert "RandomNormal" in forced["deny"] and "SoftmaxCrossEntropyLoss" in forced["deny"]
    assert "RandomNormal" not in forced["allow"]


def _matmul_with_weight(values: np.ndarray) -> onnx.ModelProto:
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
         onnx.helper.make_node("Relu", ["a"], ["y"], name="relu")],
        "g", [onnx.helper.make_tensor_value_info("x", FLOAT, [2, 4])],
        [onnx.helper.make_tensor_value_info("y", FLOAT, [2, 4])],
        [onnx.numpy_helper.from_array(values.astype(np.float32), "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_initializer_range_seed_fires_above_65504():
    w = np.full((4, 4), 0.5)
    w[0, 0] = 1e5
    report = onnxmp.explain(_matmul_with_weight(w))
    mm = next(v for v in report.vertices if v.node == "mm")
    assert mm.color == DENY and mm.rule == "seed_deny_from_initializer_range" and "max 1e+05 > 65504" in mm.cause


def test_initializer_range_seed_ignores_inf_and_small_values():
    w = np.full((4, 4), 0.5)
    w[0, 0] = np.inf  # not finite: the seed only looks at finite magnitudes
    assert onnxmp.explain(_matmul_with_weight(w)).node_colors()["mm"] == ALLOW
    assert onnxmp.explain(_matmul_with_weight(np.full((4, 4), 60000.0))).node_colors()["mm"] == ALLOW


def test_underflow_seed_fires_when_most_values_flush_to_zero():
    w = np.full((4, 4), 1e-9)
    report = onnxmp.explain(_matmul_with_weight(w))
    assert report.node_colors()["mm"] == DENY
    assert "flush to zero" in next(v.cause for v in report.vertices if v.node == "mm")


def test_underflow_seed_does_not_fire_for_a_few_tiny_values():
    w = np.full((4, 4), 1e-2)
    w[0, :3] = 1e-9  # 3 of 16 flush: below the 50% share
    assert onnxmp.explain(_matmul_with_weight(w)).node_colors()["mm"] == ALLOW


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_batched_range_checks_match_the_per_tensor_cast(precision):
    # The range seed checks small constants together and tests flushing by a magnitude limit
    # instead of casting each value; it must count exactly what casting one tensor counts,
    # right at the limits, for lone scalars, and for inf, nan and signed zeros.
    from onnxmp.color.seeds import _flush_limit, check_many, check_values
    from onnxmp.precision import low_precision

    low = low_precision(precision).numpy
    tiny = np.float32(ml_dtypes.finfo(low).tiny)
    edges = [0.0, -0.0, np.inf, -np.inf, np.nan, tiny, 65504.0, 65520.0, 3.4e38, 1e-45]
    for floor in (tiny, np.float32(0)):
        limit = _flush_limit(low, floor)
        edges += [limit, -limit, np.nextafter(limit, np.float32(1)), np.nextafter(limit, np.float32(0))]
    rng = np.random.default_rng(0)
    arrays = [np.array([e], dtype=np.float32) for e in edges]  # lone scalars
    for _ in range(40):
        values = rng.standard_normal(rng.integers(2, 30)) * 10.0 ** rng.uniform(-45, 38)
        values = values.astype(np.float32)
        values[rng.integers(0, values.size, 3)] = rng.choice(np.array(edges, dtype=np.float32), 3)
        arrays.append(values)
    assert check_many(arrays, low) == [check_values(a, low) for a in arrays]


def test_range_seed_gives_the_same_causes_when_raw_batches_are_split(monkeypatch):
    from onnxmp.color import seeds

    rng = np.random.default_rng(1)
    weights = [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(4)]
    weights[1][2, 2] = 1e5
    weights[3][:] = 1e-9
    nodes = [onnx.helper.make_node("MatMul", [f"h{i}", f"w{i}"], [f"h{i + 1}"], name=f"mm{i}") for i in range(4)]
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("h0", FLOAT, [4, 4])],
        [onnx.helper.make_tensor_value_info("h4", FLOAT, [4, 4])],
        [onnx.numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])

    def causes():
        return {v.node: (v.color, v.cause) for v in onnxmp.explain(model).vertices}

    whole = causes()
    monkeypatch.setattr(seeds, "CHECK_CHUNK", 20)  # a batch of about one 4x4 weight
    assert causes() == whole
    assert whole["mm1"][0] == DENY and "max 1e+05" in whole["mm1"][1]
    assert whole["mm3"][0] == DENY and "flush to zero" in whole["mm3"][1]
    assert whole["mm0"][0] == ALLOW


def test_initializer_read_by_both_sides_gets_a_low_precision_twin():
    model = _matmul_with_weight(np.eye(4))
    model.graph.node.append(onnx.helper.make_node("Sin", ["w"], ["z"], name="sin"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("z", FLOAT, [4, 4]))
    result = onnxmp.convert(model)
    inits = {t.name: t.data_type for t in result.model.graph.initializer}
    assert inits["w"] == FLOAT and inits["w_onnxmp_fp16"] == FLOAT16
    assert result.report.twin_initializers == ["w"]


def test_initializer_read_only_by_allow_vertices_is_converted_in_place():
    result = onnxmp.convert(_matmul_with_weight(np.eye(4)))
    assert {t.name: t.data_type for t in result.model.graph.initializer} == {"w": FLOAT16}


def test_master_weights_stay_fp32_and_are_cast_at_use():
    model = _matmul_with_weight(np.eye(4))
    result = onnxmp.convert(model, master_weights=["w"])
    inits = {t.name: t.data_type for t in result.model.graph.initializer}
    assert inits == {"w": FLOAT}
    assert any(n.op_type == "Cast" and n.input == ["w"] for n in result.model.graph.node)


def test_unknown_type_vertex_is_not_painted_and_says_why():
    model = named(header(extra=', "custom.domain" : 1') + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        a = MatMul(x, w)
        b = custom.domain.Foo(a)
        y = MatMul(b, w)
    }""".replace("custom.domain.Foo", "custom.domain.Foo"))
    report = onnxmp.explain(model)
    foo = next(v for v in report.vertices if v.node == "b")
    assert foo.color == "fp32"


def test_bfloat16_has_its_own_lists_pow_is_range_only():
    from onnxmp.lists import default_lists

    fp16, bf16 = default_lists(precision="float16"), default_lists(precision="bfloat16")
    assert "Pow" in fp16["deny"] and "Pow" in bf16["infer"] and "Pow" not in bf16["deny"]
    assert "Exp" in bf16["deny"] and "ReduceMean" in bf16["deny"]  # precision-driven denials stay
    model = named(header() + """
    g (float[4,4] x, float[4,4] w, float[1] two) => (float[4,4] y) {
        a = MatMul(x, w)
        p = Pow(a, two)
        y = MatMul(p, w)
    }""")
    assert colors(model, precision="float16")["p"] == DENY
    assert colors(model, precision="bfloat16")["p"] == ALLOW



def test_vertices_of_one_op_on_float32_other_and_blocked_tensors_keep_their_own_facts():
    # The view shares one kind per op type parameter and dtypes: a double MatMul and a blocked
    # one met first must not lend their facts to the float32 MatMuls after them.
    model = named(header() + """
    g (double[4,4] d, float[4,4] x, float[4,4] w) => (double[4,4] b, float[4,4] c, float[4,4] a, float[4,4] e) {
        b = MatMul(d, d)
        c = MatMul(x, w)
        a = MatMul(x, w)
        e = MatMul(a, w)
    }""")
    report = onnxmp.explain(model, block_nodes=["^c$"])
    rows = {row.node: row for row in report.vertices}
    assert "b" not in rows  # a double vertex is no candidate: reports leave it out
    assert rows["c"].color == "fp32" and rows["c"].cause == "node name matches block pattern '^c$'"
    assert rows["a"].color == ALLOW and rows["e"].color == ALLOW


def test_range_seed_reads_constant_nodes_whichever_input_holds_the_cause():
    # A Constant node's value seeds like an initializer, before or after a fine input; a
    # value_float Constant seeds nothing here, and a constant nothing listed reads is not read.
    helper, numpy_helper = onnx.helper, onnx.numpy_helper

    def const(name, values):
        return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(
            np.asarray(values, np.float32), name + "_value"))

    nodes = [const("big", np.full((4, 4), 1e6)), const("w1", np.full((4, 4), 0.5)),
             const("w2", np.full((4, 4), 0.5)), const("unread", np.full((4, 4), 0.5)),
             helper.make_node("Constant", [], ["eps"], name="eps", value_float=0.5),
             helper.make_node("Add", ["big", "w1"], ["s1"], name="s1"),   # w1 comes after the cause
             helper.make_node("Add", ["w2", "big"], ["s2"], name="s2"),   # w2 comes before it
             helper.make_node("Add", ["x", "eps"], ["s3"], name="s3"),
             helper.make_node("Sum", ["s1", "s2", "s3"], ["y"], name="y")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("y", FLOAT, [4, 4]),
                               helper.make_tensor_value_info("unread", FLOAT, [4, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    state = _state(model)
    assert state.is_deny("s1:T") and state.is_deny("s2:T") and not state.is_deny("s3:T")


def _conv_bn(var: np.ndarray, eps: float, bias: np.ndarray | None = None) -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu -> Conv over 4 channels, the variance and bias given."""
    c = var.size
    inits = [onnx.numpy_helper.from_array(np.full((c, c, 1, 1), 0.25, np.float32), "w"),
             onnx.numpy_helper.from_array(np.ones(c, np.float32), "scale"),
             onnx.numpy_helper.from_array(np.zeros(c, np.float32) if bias is None else bias.astype(np.float32), "b"),
             onnx.numpy_helper.from_array(np.zeros(c, np.float32), "mean"),
             onnx.numpy_helper.from_array(var.astype(np.float32), "var")]
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", ["x", "w"], ["a"], name="conv"),
         onnx.helper.make_node("BatchNormalization", ["a", "scale", "b", "mean", "var"], ["n"], name="bn", epsilon=eps),
         onnx.helper.make_node("Relu", ["n"], ["r"], name="relu"),
         onnx.helper.make_node("Conv", ["r", "w"], ["y"], name="conv2")],
        "g", [onnx.helper.make_tensor_value_info("x", FLOAT, [1, c, 4, 4])],
        [onnx.helper.make_tensor_value_info("y", FLOAT, [1, c, 4, 4])], inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_batchnorm_variance_that_flushes_under_epsilon_is_no_cause():
    # Every variance flushes to zero in float16, which the plain range seed counts as a cause; but
    # it enters as 1/sqrt(var + 1e-5), which moves by far less than a float16 ulp: BN stays low.
    # So does a bias of tiny values: it is added, off by at most 3e-8.
    colors = onnxmp.explain(_conv_bn(np.full(4, 1e-9), 1e-5, bias=np.full(4, 1e-9))).node_colors()
    assert colors["bn"] == ALLOW


def test_batchnorm_variance_whose_inverse_root_moves_is_a_cause():
    # With epsilon 1e-9 the subnormal variances decide 1/sqrt(var + eps): rounding them moves it
    # by many ulps on every channel.
    report = onnxmp.explain(_conv_bn(np.array([1.3e-7, 2.9e-7, 3.7e-7, 4.1e-7]), 1e-9))
    bn = next(v for v in report.vertices if v.node == "bn")
    assert bn.color == DENY and "1/sqrt(var + epsilon)" in bn.cause


def test_batchnorm_variance_above_the_range_is_a_cause():
    report = onnxmp.explain(_conv_bn(np.array([1.0, 1.0, 1.0, 9.8e7]), 1e-5))
    bn = next(v for v in report.vertices if v.node == "bn")
    assert bn.color == DENY and "max 9.8e+07 > 65504" in bn.cause
