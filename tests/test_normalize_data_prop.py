"""normalize runs onnx's data propagation only where it may change the inferred types."""
from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

from models import hard_cases, zoo
from onnxmp.normalize import summarize
from onnxmp.normalize import data_propagation_matters, normalize
from tests import onnx_corpus
from tests.graphs import header, parse

MODELS = Path(__file__).resolve().parent.parent / "models"


def _matters(model: onnx.ModelProto) -> bool:
    return data_propagation_matters(model, summarize(model.graph))


def _inferred(model: onnx.ModelProto, data_prop: bool) -> bytes | str:
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=data_prop).SerializeToString()
    except Exception as exc:  # the corpus holds cases inference refuses; both runs must agree then too
        return f"{type(exc).__name__}: {exc}"


def _propagation_changes_types(model: onnx.ModelProto) -> bool:
    return _inferred(model, True) != _inferred(model, False)


def _unshaped_outputs(text: str) -> onnx.ModelProto:
    """``parse``'s model with the outputs' shapes left for inference (onnx.helper's ``shape=None``,
    which the text format cannot say and the checker refuses)."""
    model = parse(text)
    for output in model.graph.output:
        output.type.tensor_type.ClearField("shape")
    return model


def _reshape_by(shape_from: str, rank: int, extra_inputs: str = "", initializers: str = "") -> onnx.ModelProto:
    """Reshape x (float[2,3,4]) to ``rank`` dims by the int64 value ``s`` the lines of
    ``shape_from`` compute."""
    dims = ",".join("?" * rank)
    return _unshaped_outputs(header() + f"""
    g (float[2,3,4] x{extra_inputs}) => (float[{dims}] y) {initializers} {{
        {shape_from}
        y = Reshape(x, s)
    }}""")


def test_a_graph_of_arithmetic_and_constant_shapes_skips_propagation():
    model = parse(header() + """
    g (float[N,4,8] x) => (float[N,4,2,4] y) <int64[4] shape = {0,4,2,4}, float[8] b = {1,2,3,4,5,6,7,8}> {
        a = Add(x, b)
        m = Mul(a, a)
        y = Reshape(m, shape)
    }""")
    assert not _matters(model)
    assert not _propagation_changes_types(model)
    assert not _matters(zoo.linear_occ_stack(2))


def test_shape_gather_concat_feeding_a_reshape_keeps_propagation():
    model = _reshape_by("""
        shape = Shape(x)
        zero = Constant<value = int64[1] {0}>()
        first = Gather<axis = 0>(shape, zero)
        minus = Constant<value = int64[1] {-1}>()
        s = Concat<axis = 0>(first, minus)""", 2)
    assert _matters(model)
    assert _propagation_changes_types(model)  # y is float[2,12] only with propagation


def test_an_int_constant_cast_into_a_shape_keeps_propagation():
    model = _reshape_by("""
        c = Constant<value = int64[2] {6, 4}>()
        s = Cast<to = 7>(c)""", 2)
    assert _matters(model)
    assert _propagation_changes_types(model)


def test_an_unsqueezed_int_constant_keeps_propagation_where_a_shape_reads_it():
    model = _reshape_by("""
        c = Constant<value = int64 {24}>()
        axes = Constant<value = int64[1] {0}>()
        s = Unsqueeze(c, axes)""", 1)
    assert _matters(model)
    assert _propagation_changes_types(model)
    # The same value read by no shape input: its propagated value is never looked at.
    unread = parse(header() + """
    g (float[2,3,4] x) => (float[2,3,4] y, int64[1] s) {
        c = Constant<value = int64 {24}>()
        axes = Constant<value = int64[1] {0}>()
        s = Unsqueeze(c, axes)
        y = Relu(x)
    }""")
    assert not _matters(unread) and not _propagation_changes_types(unread)


def test_a_propagated_rank_joined_with_constants_keeps_propagation():
    """No Shape and no constant at a propagation function's first input, yet propagation
    changes the result: Concat gets a value for a 1-D tensor of known length (its entries
    unknown) and joins it with a constant.  Hence the rule looks at what shape inputs read."""
    model = _reshape_by("""
        k = Constant<value = int64[1] {4}>()
        s = Concat<axis = 0>(r, k)""", 2, ", int64[1] r")
    assert _matters(model)
    assert _propagation_changes_types(model)


def test_a_shape_input_that_is_an_initializer_needs_no_propagation():
    model = _unshaped_outputs(header() + """
    g (float[2,3,4] x) => (float[?,?] y, int64[2] t) <int64[2] s = {6, 4}> {
        t = Cast<to = 7>(s)
        y = Reshape(x, s)
    }""")
    assert not _matters(model)  # Cast propagates `s` too, but inference takes an initializer's data first
    assert not _propagation_changes_types(model)


def test_bodies_and_local_functions_keep_propagation():
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TP.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TP.FLOAT, [2])])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
                              [helper.make_tensor_value_info("c", TP.BOOL, []),
                               helper.make_tensor_value_info("x", TP.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [2])])
    assert _matters(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))

    model = parse("""
    <ir_version: 8, opset_import: ["" : 17, "local" : 1]>
    g (float[2] x) => (float[2] y) {
        y = local.Twice(x)
    }
    <domain: "local", opset_import: ["" : 17]>
    Twice (a) => (b) {
        b = Add(a, a)
    }""")
    assert _matters(model)


def test_a_custom_domain_node_without_bodies_does_not_force_propagation():
    model = parse(header(extra=', "com.example" : 1') + """
    g (float[2,3,4] x) => (float[2,3,4] y) {
        a = com.example.Custom<alpha = 1.0>(x)
        y = Add(a, x)
    }""")
    assert summarize(model.graph).holding  # may hold bodies, until its attributes are read
    assert not _matters(model)


def test_ops_inferred_through_their_function_body_keep_propagation():
    """GreaterOrEqual-12 has a body and no inference function: inference runs the body, with
    the caller's propagated values.  From opset 16 it has its own inference function."""
    text = """
    g (int64[2] a, int64[2] b) => (bool[2] y) {
        y = GreaterOrEqual(a, b)
    }"""
    assert _matters(parse(header(opset=12) + text))
    assert not _matters(parse(header(opset=16) + text))


def test_normalize_runs_inference_with_propagation_only_where_it_matters(monkeypatch):
    seen = []
    infer = onnx.shape_inference.infer_shapes

    def spy(model, *args, data_prop=False, **kwargs):
        seen.append(data_prop)
        return infer(model, *args, data_prop=data_prop, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", spy)
    normalize(zoo.linear_occ_stack(1))
    normalize(_reshape_by("s = Shape(x)", 3))
    assert seen == [False, True]


def _bundled_models() -> list[onnx.ModelProto]:
    models = [onnx.load(str(path)) for path in sorted(MODELS.glob("*.onnx"))]
    models += [zoo.linear_occ_stack(2), zoo.transformer_stack(1, hidden=8, seq=4, heads=2),
               zoo.transformer_classifier(), zoo.transformer_classifier("where")]
    models += [hard_cases.transformer_cancellation(layers=1), hard_cases.db_head()]
    return models


@pytest.mark.parametrize("source", ["onnx_node_cases", "bundled_models"])
def test_skipping_propagation_never_changes_inference(source):
    """Over ONNX's own operator cases and the bundled models: wherever the rule skips
    propagation, inference with and without it gives the same bytes; where propagation does
    change them, the rule kept it.  Not vacuous: the corpus has many cases of each kind."""
    if source == "onnx_node_cases":
        models = [case.model for case in onnx_corpus._all_cases()]
    else:
        models = _bundled_models()
    skipped = kept = changed = 0
    for model in models:
        matters = _matters(model)
        differs = _propagation_changes_types(model)
        assert matters or not differs, model.graph.name
        skipped += not matters
        kept += matters
        changed += differs
    if source == "onnx_node_cases":
        assert skipped > 1000 and kept > 100 and changed > 50, (skipped, kept, changed)
    else:
        assert skipped >= 5 and kept >= 1, (skipped, kept)


def test_propagation_is_kept_for_an_int64_constant_from_a_constant_node_with_ints():
    """A Constant's value_ints is an int64 value to propagation like a tensor attribute."""
    model = _reshape_by("""
        c = Constant<value_ints = [6, 4]>()
        s = Cast<to = 7>(c)""", 2)
    assert _matters(model) and _propagation_changes_types(model)
    as_initializer = _reshape_by("s = Cast<to = 7>(c)", 2, initializers="<int64[2] c = {6, 4}>")
    assert _matters(as_initializer) and _propagation_changes_types(as_initializer)
