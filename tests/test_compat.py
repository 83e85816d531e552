"""onnxmp.compat: onnxconverter-common's float16 API and onnxruntime's float16 converter, onnxmp's conversion.

Written from the originals' code and docstrings (onnxconverter-common 1.16, onnxruntime 1.19): what a
caller feeds and reads, what is modified in place, the files written and the errors raised."""
from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxmp
from onnxmp.compat import (
    CompatError, auto_convert_mixed_precision, auto_convert_mixed_precision_model_path, convert_float_to_float16,
    convert_float_to_float16_model_path, ort_float16,
)
from tests.graphs import FLOAT, FLOAT16, header, parse, tensor_types

MODELS = Path(__file__).resolve().parent.parent / "models"
ZOO = sorted(p.stem for p in MODELS.glob("*.onnx"))


def occ_convert():
    return pytest.importorskip("onnxconverter_common.float16").convert_float_to_float16


def io_types(model: onnx.ModelProto) -> dict[str, int]:
    return {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.output)}


def between_matmuls(middle: str, extra_inits: str = "") -> onnx.ModelProto:
    """x -> MatMul -> <middle: h -> m> -> MatMul -> y, each node named after its output."""
    model = parse(header() + f"""
    g (float[2,4] x) => (float[2,4] y) <float[4,4] w = {{{','.join(['0.25'] * 16)}}}{extra_inits}> {{
        h = MatMul(x, w)
        {middle}
        y = MatMul(m, w)
    }}""")
    for node in model.graph.node:
        node.name = node.output[0]
    return model


def _signature(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("module, name", [
    ("float16", "convert_float_to_float16"), ("float16", "convert_float_to_float16_model_path"),
    ("auto_mixed_precision", "auto_convert_mixed_precision"),
    ("auto_mixed_precision_model_path", "auto_convert_mixed_precision_model_path")])
def test_signatures_match_onnxconverter_common(module, name):
    import importlib

    theirs = getattr(pytest.importorskip(f"onnxconverter_common.{module}"), name)
    ours = getattr(importlib.import_module(f"onnxmp.compat.{module}"), name)
    assert _signature(ours) == _signature(theirs)
    assert getattr(onnxmp.compat, name) is ours  # `from onnxconverter_common import name` works too


def test_signature_matches_onnxruntime_float16():
    theirs = pytest.importorskip("onnxruntime.transformers.float16").convert_float_to_float16
    assert _signature(ort_float16.convert_float_to_float16) == _signature(theirs)


@pytest.mark.parametrize("name", ZOO)
def test_bundled_models_convert_and_keep_parity(name):
    from onnxmp.parity.validate import validate

    original = onnx.load(str(MODELS / f"{name}.onnx"))
    before = original.SerializeToString()
    converted = convert_float_to_float16(original)
    assert original.SerializeToString() == before  # the argument is never modified
    onnx.checker.check_model(converted, full_check=True)
    onnx.shape_inference.infer_shapes(converted, check_type=True, strict_mode=True)
    assert any(t.data_type == FLOAT16 for t in converted.graph.initializer)
    report = validate(original, converted, str(MODELS / f"{name}.inputs.npz"))
    assert report.passed, report.summary()


def test_keep_io_types_defaults_to_false_like_onnxconverter_common():
    original = onnx.load(str(MODELS / "mlp.onnx"))
    assert io_types(convert_float_to_float16(original)) == {"x": FLOAT16, "logits": FLOAT16}
    assert io_types(convert_float_to_float16(original, keep_io_types=True)) == io_types(original)


def test_bigvar_batchnorm_stays_fp32_where_onnxconverter_common_clamps_it_to_garbage():
    from onnxmp.parity.validate import validate

    original = onnx.load(str(MODELS / "cnn_bn_bigvar.onnx"))
    inputs = str(MODELS / "cnn_bn_bigvar.inputs.npz")
    ours = convert_float_to_float16(original)
    bn = next(n for n in ours.graph.node if n.name == "bn1/BatchNormalization")
    assert tensor_types(ours)[bn.output[0]] == FLOAT
    assert {t.name: t.data_type for t in ours.graph.initializer}["bn1.running_var"] == FLOAT
    good = validate(original, ours, inputs)
    assert good.passed and good.outputs[0].max_rel_err < 2e-3, good.summary()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # occ warns that it truncates 9.8e7 to 1e4
        theirs = occ_convert()(original)
    garbage = validate(original, theirs, inputs)
    assert not garbage.passed and garbage.outputs[0].cosine < 0.5


def test_op_block_list_keeps_those_ops_fp32_and_denies_downstream():
    model = between_matmuls("r = Relu(h)\n        m = Tanh(r)")
    default = tensor_types(convert_float_to_float16(model))
    assert default["r"] == FLOAT16 and default["m"] == FLOAT16
    blocked = tensor_types(convert_float_to_float16(model, op_block_list=["Relu"]))
    # Relu (a clear op) moved to the deny list without a "two lists" error; the
    # infer op after it stays fp32 too, as after any deny op.
    assert blocked["r"] == FLOAT and blocked["m"] == FLOAT
    assert blocked["h"] == FLOAT16 and blocked["y"] == FLOAT16


def test_op_block_list_of_an_allow_op():
    model = between_matmuls("m = Relu(h)")
    types = tensor_types(convert_float_to_float16(model, op_block_list=["MatMul"]))
    # Only the interface is float16 (keep_io_types=False), Cast inside to the float32 nodes.
    assert {n for n, t in types.items() if t == FLOAT16} == {"x", "y"}
    assert types["h"] == types["m"] == FLOAT


def test_node_block_list_blocks_exact_names_only():
    model = parse(header() + """
    g (float[2,4] x) => (float[2,4] y) <float[4,4] w = {0.5,0,0,0, 0,0.5,0,0, 0,0,0.5,0, 0,0,0,0.5}> {
        a = MatMul(x, w)
        b = MatMul(a, w)
        y = MatMul(b, w)
    }""")
    for node, name in zip(model.graph.node, ["a.b", "axb", "a.b2"]):
        node.name = name
    types = tensor_types(convert_float_to_float16(model, node_block_list=["a.b"]))
    # "a.b" is not a pattern: it matches neither "axb" nor "a.b2".
    assert types["a"] == FLOAT and types["b"] == FLOAT16 and types["y"] == FLOAT16


def test_typo_in_op_block_list_is_an_error_with_a_close_match():
    import onnxmp

    model = between_matmuls("m = Relu(h)")
    with pytest.raises(onnxmp.OnnxMPError, match="Gemmm") as caught:
        convert_float_to_float16(model, op_block_list=["Gemmm"])
    assert "'Gemm'" in caught.value.hint


def test_op_block_list_accepts_ops_of_any_known_domain_and_of_the_model():
    model = between_matmuls("m = Relu(h)")
    model.graph.node[1].domain = "custom.dom"  # the Relu is now a custom op the lists cannot know
    model.opset_import.append(onnx.helper.make_opsetid("custom.dom", 1))
    # onnxconverter-common's DEFAULT_OP_BLOCK_LIST has ai.onnx.ml ops such as Binarizer.
    convert_float_to_float16(model, op_block_list=["Binarizer", "Relu", "Gemm"])


def test_node_block_list_name_matching_no_node_is_a_named_warning(caplog):
    model = parse(header() + """
    g (float[2,4] x) => (float[2,4] y) <float[4,4] w = {0.5,0,0,0, 0,0.5,0,0, 0,0,0.5,0, 0,0,0,0.5}> {
        a = MatMul(x, w)
        y = MatMul(a, w)
    }""")
    model.graph.node[0].name = "first"
    with caplog.at_level("WARNING", logger="onnxmp"):
        types = tensor_types(convert_float_to_float16(model, node_block_list=["first", "nonexistent_node"]))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "'nonexistent_node'" in warned[0]
    assert types["a"] == FLOAT


def test_max_finite_val_keeps_nodes_reading_larger_initializers_fp32():
    # 2e4 fits fp16 (max 65504) but exceeds onnxconverter-common's default max_finite_val 1e4,
    # which would clamp it; onnxmp keeps the node in fp32 instead.
    model = between_matmuls("m = Div(h, big)", ", float[1] big = {20000}")
    assert tensor_types(convert_float_to_float16(model))["m"] == FLOAT
    assert {t.name: t.data_type for t in convert_float_to_float16(model).graph.initializer}["big"] == FLOAT
    assert tensor_types(convert_float_to_float16(model, max_finite_val=65504))["m"] == FLOAT16


def test_min_positive_val_keeps_nodes_reading_tiny_initializers_fp32():
    # A lone 5e-7 survives in fp16 (as a subnormal), so onnxmp's own seed lets it through;
    # a min_positive_val above it keeps the node in fp32.
    model = between_matmuls("m = Add(h, tiny)", ", float[1] tiny = {5e-7}")
    assert tensor_types(convert_float_to_float16(model))["m"] == FLOAT16
    assert tensor_types(convert_float_to_float16(model, min_positive_val=1e-6))["m"] == FLOAT


def test_values_are_never_clamped():
    model = between_matmuls("m = Add(h, b)", ", float[4] b = {30000, 0.5, 1e-9, -2}")
    original = onnx.numpy_helper.to_array(model.graph.initializer[1])

    def values(converted):
        return {t.name: onnx.numpy_helper.to_array(t) for t in converted.graph.initializer}["b"]

    assert np.array_equal(values(convert_float_to_float16(model)), original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clamped = values(occ_convert()(model)).astype(np.float32)
    assert clamped[0] == np.float16(1e4) and clamped[2] == np.float16(1e-7)


def test_an_fp16_model_is_refused_unless_check_fp16_ready_is_false_then_idempotent():
    once = convert_float_to_float16(onnx.load(str(MODELS / "mlp.onnx")))
    with pytest.raises(ValueError, match="already converted to float16"):  # as onnxconverter-common
        convert_float_to_float16(once)
    twice = convert_float_to_float16(once, check_fp16_ready=False)
    assert twice.SerializeToString() == once.SerializeToString()
    # onnxruntime's converter has no such check: it converts again, and so does onnxmp.
    assert ort_float16.convert_float_to_float16(once).SerializeToString() == once.SerializeToString()
    theirs = occ_convert()(onnx.load(str(MODELS / "mlp.onnx")))
    assert convert_float_to_float16(theirs, check_fp16_ready=False).SerializeToString() == \
        theirs.SerializeToString()


def test_model_without_allow_ops_comes_back_unchanged_when_its_io_is_kept():
    model = parse(header() + """
    g (float[2,4] x) => (float[2,4] y) { y = Tanh(x) }""")
    assert convert_float_to_float16(model, keep_io_types=True).SerializeToString() == model.SerializeToString()
    lowered = convert_float_to_float16(model)  # the interface is float16 all the same
    assert io_types(lowered) == {"x": FLOAT16, "y": FLOAT16}
    assert [n.op_type for n in lowered.graph.node] == ["Cast", "Tanh", "Cast"]


def test_constant_node_range_is_checked_like_an_initializer():
    model = between_matmuls("c = Constant<value = float[1] {50000}>()\n        m = Div(h, c)")
    assert tensor_types(convert_float_to_float16(model))["m"] == FLOAT


def test_unnamed_nodes_reading_out_of_range_constants_are_found():
    model = between_matmuls("m = Div(h, big)", ", float[1] big = {20000}")
    for node in model.graph.node:
        node.name = ""
    assert tensor_types(convert_float_to_float16(model))["m"] == FLOAT



# --- keep_io_types: what a caller feeds and reads ------------------------------------------------

W = ",".join(["0.25"] * 16)
# x's first reader runs fp16; s is read only by float32 nodes; y is produced in fp16 and also read by
# a float32 node; z is produced by a float32 node (e and z are blocked by name).
MIXED_READERS = header() + f"""
g (float[2,4] x, float[2,4] s) => (float[2,4] y, float[2,4] z) <float[4,4] w = {{{W}}}> {{
    a = MatMul(x, w)
    b = Relu(a)
    y = MatMul(b, w)
    e = Add(y, s)
    z = Mul(e, s)
}}"""
# onnxconverter-common's Loop case: no allow op at all, a body reading an outer graph input.
LOOP = header() + """
g (float[3,2] data) => (float[2] total, float[3,2] scan) {
    n = Constant<value = int64 {3}>()
    c = Constant<value = bool {1}>()
    zeros = Constant<value = float[2] {0, 0}>()
    total, scan = Loop(n, c, zeros) <body = body (int64 i, bool cin, float[2] acc) => (bool cout, float[2] acc2,
                                                                                      float[2] out) {
        cout = Identity(cin)
        row = Gather<axis = 0>(data, i)
        acc2 = Add(acc, row)
        out = Identity(acc2)
    }>
}"""
# A graph output (y, produced in float32) that an If body reads; the then-branch computes in fp16.
IF_READS_OUTPUT = header() + f"""
g (float[2,4] x, bool c) => (float[2,4] y, float[2,4] z) <float[4,4] w = {{{W}}}> {{
    y = Tanh(x)
    z = If(c) <then_branch = t () => (float[2,4] o) {{ o = MatMul(y, w) }},
               else_branch = e () => (float[2,4] o2) {{ o2 = Identity(y) }}>
}}"""
# Already partly fp16: h is a float16 input and output.
PARTLY_FP16 = header() + f"""
g (float[2,4] x, float16[2,4] h) => (float[2,4] y, float16[2,4] h2) <float[4,4] w = {{{W}}}> {{
    a = MatMul(x, w)
    hc = Cast<to = 1>(h)
    y = Add(a, hc)
    h2 = Relu(h)
}}"""


def mixed_readers():
    model = parse(MIXED_READERS)
    for node in model.graph.node:
        node.name = node.output[0]
    return model


def as_caller_feeds(model: onnx.ModelProto, feeds: dict) -> dict:
    """What onnxconverter-common's callers do: cast float feeds to the type each input declares."""
    declared = {v.name: onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type) for v in model.graph.input}
    return {k: v.astype(declared[k]) if v.dtype.kind == "f" else v for k, v in feeds.items()}


def run(model: onnx.ModelProto, feeds: dict) -> dict:
    """Outputs of an onnxruntime CPU session, each checked to have the dtype the model declares."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    declared = {v.name: onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type) for v in model.graph.output}
    assert {k: v.dtype for k, v in out.items()} == declared
    return out


def io_after(model, keep):
    """Expected I/O types: every float32 input/output float16 unless kept."""
    kept = set(io_types(model)) if keep is True else set(keep or ())
    return {n: FLOAT16 if t == FLOAT and n not in kept else t for n, t in io_types(model).items()}


CONVERTERS = {
    "onnxconverter-common": lambda m, keep, **kw: convert_float_to_float16(m, keep_io_types=keep, **kw),
    "onnxruntime": lambda m, keep, **kw: ort_float16.convert_float_to_float16(m, keep_io_types=keep, **kw),
    "onnxmp": lambda m, keep, node_block_list=(): onnxmp.convert(
        m, keep_io_types=keep, block_nodes=[f"^{n}$" for n in node_block_list]).model,
}
CASES = {  # name: (model, feeds, node_block_list, lists of names to keep)
    "mixed_readers": (mixed_readers, lambda: {"x": np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4),
                                              "s": np.full((2, 4), 0.5, np.float32)}, ["e", "z"], [["z", "s"], ["y"]]),
    "loop": (lambda: parse(LOOP), lambda: {"data": np.array([[2, 3], [4, 5], [6, 7]], np.float32)}, [],
             [["scan"]]),
    "if_reads_output": (lambda: parse(IF_READS_OUTPUT), lambda: {"x": np.linspace(-1, 1, 8, dtype=np.float32)
                                                                 .reshape(2, 4), "c": np.array(True)}, [],
                        [["z"], ["y"]]),
    "loop_if": (lambda: onnx.load(str(MODELS / "loop_if.onnx")),
                lambda: dict(np.load(str(MODELS / "loop_if.inputs.npz"))), [], [["logits"]]),
    "partly_fp16": (lambda: parse(PARTLY_FP16), lambda: {"x": np.ones((2, 4), np.float32),
                                                         "h": np.full((2, 4), -0.5, np.float16)}, [], [["x"]]),
}
# onnxconverter-common's keep_io_types is a bool; the others also take lists.
KEEP_FORMS = [(converter, case, keep) for converter in CONVERTERS for case, (*_, lists) in CASES.items()
              for keep in [False, True, *(lists if converter != "onnxconverter-common" else [])]]


@pytest.mark.parametrize("converter, case, keep", KEEP_FORMS, ids=[f"{v}-{c}-{k}" for v, c, k in KEEP_FORMS])
def test_keep_io_types_forms_give_the_interface_callers_feed_and_read(converter, case, keep):
    build, feeds, blocked, _ = CASES[case]
    model = build()
    extra = {"node_block_list": blocked} if blocked else {}
    if converter == "onnxconverter-common":
        extra["check_fp16_ready"] = False  # partly_fp16 would be refused, as by the original
    converted = CONVERTERS[converter](model, keep, **extra)
    onnx.checker.check_model(converted, full_check=True)
    assert io_types(converted) == io_after(model, keep)
    expected = run(model, feeds())
    actual = run(converted, as_caller_feeds(converted, feeds()))
    for name, ref in expected.items():
        assert np.allclose(actual[name].astype(np.float32), ref, rtol=1e-2, atol=1e-2), name


def test_lowered_io_bridges_to_float32_readers_and_producers_with_casts_inside():
    converted = convert_float_to_float16(mixed_readers(), node_block_list=["e", "z"])
    producers = {o: n for n in converted.graph.node for o in n.output}
    readers = {i: n for n in converted.graph.node for i in n.input}
    assert readers["s"].op_type == "Cast"  # s's readers stay float32
    assert producers["z"].op_type == "Cast" and producers["y"].op_type == "MatMul"  # z's producer stays float32
    types = tensor_types(converted)
    assert types[producers["z"].input[0]] == FLOAT


def test_partly_fp16_model_is_refused_by_the_onnxconverter_common_form_by_default():
    with pytest.raises(CompatError, match="already converted"):
        convert_float_to_float16(parse(PARTLY_FP16))


def test_keep_io_types_list_ignores_names_the_model_lacks_as_onnxruntime_does(caplog):
    with caplog.at_level("WARNING", logger="onnxmp"):
        converted = ort_float16.convert_float_to_float16(mixed_readers(), keep_io_types=["z", "nope"])
    assert io_types(converted) == {"x": FLOAT16, "s": FLOAT16, "y": FLOAT16, "z": FLOAT}
    assert any("'nope'" in r.getMessage() for r in caplog.records)


def test_keep_io_types_names_are_exact_in_the_compat_forms():
    model = mixed_readers()
    assert io_types(ort_float16.convert_float_to_float16(model, keep_io_types=["."])) == io_after(model, [])


@pytest.mark.parametrize("fn", [convert_float_to_float16, ort_float16.convert_float_to_float16])
def test_disable_shape_infer_updates_the_model_in_place_as_the_originals_do(fn):
    model = onnx.load(str(MODELS / "mlp.onnx"))
    before = model.SerializeToString()
    returned = fn(model)
    assert model.SerializeToString() == before and returned is not model
    returned = fn(model, disable_shape_infer=True)
    assert returned is model and io_types(model) == {"x": FLOAT16, "logits": FLOAT16}


def test_onnxruntime_form_asserts_fp16_limits_and_refuses_bfloat16_blocked_nodes():
    model = onnx.load(str(MODELS / "mlp.onnx"))
    with pytest.raises(AssertionError, match="min_positive_val"):
        ort_float16.convert_float_to_float16(model, min_positive_val=1e-8)
    with pytest.raises(AssertionError, match="max_finite_val"):
        ort_float16.convert_float_to_float16(model, max_finite_val=1e5)
    with pytest.raises(onnxmp.OnnxMPError, match="use_bfloat16_as_blocked_nodes_dtype"):
        ort_float16.convert_float_to_float16(model, use_bfloat16_as_blocked_nodes_dtype=True)


def test_onnxruntime_form_takes_a_path(tmp_path):
    converted = ort_float16.convert_float_to_float16(str(MODELS / "mlp.onnx"), keep_io_types=True)
    assert io_types(converted) == {"x": FLOAT, "logits": FLOAT}
    assert any(t.data_type == FLOAT16 for t in converted.graph.initializer)


# --- onnxmp's own keep_io_types: names and patterns --------------------------------------------------


def test_kv_decoder_cache_in_fp16_logits_fp32_ids_int64():
    from onnxmp.inputs import check_inputs
    from onnxmp.parity.validate import validate

    converted = onnxmp.convert(str(MODELS / "kv_decoder.onnx"), keep_io_types=["logits"]).model
    types = io_types(converted)
    assert types.pop("input_ids") == onnx.TensorProto.INT64 and types.pop("logits") == FLOAT
    assert set(types) == {f"{side}.{i}.{kind}" for side in ("past_key_values", "present") for i in (0, 1)
                          for kind in ("key", "value")}
    assert set(types.values()) == {FLOAT16}
    inputs = str(MODELS / "kv_decoder.inputs.npz")
    report = validate(str(MODELS / "kv_decoder.onnx"), converted, inputs)
    assert report.passed, report.summary()
    # Fed for real: validate's feeds are the .npz's float32 arrays cast to what the candidate declares.
    feeds = check_inputs(converted, dict(np.load(inputs)))
    assert feeds["past_key_values.0.key"].dtype == np.float16 and feeds["input_ids"].dtype == np.int64
    out = run(converted, feeds)
    assert out["present.1.value"].dtype == np.float16 and out["logits"].dtype == np.float32


def test_keep_io_types_patterns_match_whole_names():
    path = str(MODELS / "kv_decoder.onnx")
    by_pattern = io_types(onnxmp.convert(path, keep_io_types=[r"present\.\d\.key", "logits"]).model)
    assert by_pattern["present.0.key"] == by_pattern["present.1.key"] == by_pattern["logits"] == FLOAT
    assert by_pattern["present.0.value"] == by_pattern["past_key_values.0.key"] == FLOAT16
    # "present" alone matches no whole name: a typo is an error, with the names to choose from.
    with pytest.raises(onnxmp.OnnxMPError, match="matches no graph input or output") as caught:
        onnxmp.convert(path, keep_io_types=["present"])
    assert "present.0.key" in caught.value.hint


def test_keep_io_types_list_is_honoured_by_calibration():
    path = str(MODELS / "kv_decoder.onnx")
    result = onnxmp.convert(path, keep_io_types=["logits"], calibration=str(MODELS / "kv_decoder.inputs.npz"))
    assert result.report.calibration.met
    assert io_types(result.model)["logits"] == FLOAT and io_types(result.model)["present.0.key"] == FLOAT16


# --- auto_convert_mixed_precision ------------------------------------------------------------------


def mlp_feed():
    return dict(np.load(str(MODELS / "mlp.inputs.npz")))


@pytest.mark.parametrize("keep", [True, False])
def test_auto_convert_mixed_precision_meets_rtol_with_the_interface_keep_io_types_says(keep):
    model = onnx.load(str(MODELS / "mlp.onnx"))
    before = model.SerializeToString()
    feed = mlp_feed()
    expected = run(model, feed)["logits"]
    converted = auto_convert_mixed_precision(model, feed, rtol=0.01, atol=1e-3, keep_io_types=keep)
    assert model.SerializeToString() == before  # a new model is returned
    assert io_types(converted) == io_after(model, keep)
    assert any(t.data_type == FLOAT16 for t in converted.graph.initializer)
    actual = run(converted, as_caller_feeds(converted, feed))["logits"]
    assert np.allclose(actual, expected, rtol=0.01, atol=1e-3)


def test_validate_fn_gets_lists_of_outputs_fp32_first():
    calls = []

    def validate_fn(res1, res2):
        calls.append((res1, res2))
        return all(np.allclose(a, b, rtol=0.01, atol=1e-3) for a, b in zip(res1, res2))

    model = onnx.load(str(MODELS / "kv_decoder.onnx"))
    feed = dict(np.load(str(MODELS / "kv_decoder.inputs.npz")))
    auto_convert_mixed_precision(model, feed, validate_fn)
    first = calls[0]
    assert first[0] is first[1]  # the float32 outputs against themselves, checked first
    assert [a.shape for a in first[0]] == [a.shape for a in run(model, feed).values()]
    assert all(isinstance(r, list) and len(r) == 5 for call in calls for r in call)


def test_auto_convert_argument_errors_are_value_errors_as_in_onnxconverter_common():
    model = onnx.load(str(MODELS / "mlp.onnx"))
    with pytest.raises(ValueError, match="`validate_fn` and `rtol` cannot both be `None`"):
        auto_convert_mixed_precision(model, mlp_feed())
    with pytest.raises(ValueError, match="validation failed for original fp32 model"):
        auto_convert_mixed_precision(model, mlp_feed(), lambda a, b: False)


@pytest.mark.parametrize("keep", [True, False])
def test_validate_fn_rejecting_every_candidate_raises_as_onnxconverter_common_does(keep):
    def identical(res1, res2):
        return all(np.array_equal(a, b) for a, b in zip(res1, res2))

    with pytest.raises(ValueError, match="validation failed for final fp16 model"):
        auto_convert_mixed_precision(onnx.load(str(MODELS / "mlp.onnx")), mlp_feed(), identical, keep_io_types=keep)


def test_atol_alone_turns_on_the_allclose_check():
    # atol alone: rtol becomes 1e-5, so a tolerance fp16 cannot meet anywhere is refused at the end.
    with pytest.raises(ValueError, match="validation failed for final fp16 model"):
        auto_convert_mixed_precision(onnx.load(str(MODELS / "mlp.onnx")), mlp_feed(), atol=0.0)


# --- the _model_path forms ------------------------------------------------------------------------


def external_copy(tmp_path, name="mlp"):
    """``name`` saved with every tensor in ``weights.bin`` beside it."""
    folder = tmp_path / "src"
    folder.mkdir()
    path = folder / f"{name}.onnx"
    onnx.save_model(onnx.load(str(MODELS / f"{name}.onnx")), str(path), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    return path


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_convert_float_to_float16_model_path_reads_external_data_and_writes_nothing(tmp_path):
    path = external_copy(tmp_path)
    before = snapshot(path.parent)
    converted = convert_float_to_float16_model_path(str(path))
    assert snapshot(path.parent) == before
    assert io_types(converted) == {"x": FLOAT16, "logits": FLOAT16}
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in converted.graph.initializer)
    expected = run(onnx.load(str(path)), mlp_feed())["logits"]
    assert np.allclose(run(converted, as_caller_feeds(converted, mlp_feed()))["logits"], expected, atol=1e-2)
    kept = convert_float_to_float16_model_path(path, keep_io_types=True)
    assert io_types(kept) == {"x": FLOAT, "logits": FLOAT}


@pytest.mark.parametrize("location", [None, "w16.bin"])
def test_auto_model_path_writes_the_target_and_its_external_data(tmp_path, location):
    import onnxruntime as ort

    source = external_copy(tmp_path)
    before = snapshot(source.parent)
    target = tmp_path / "out" / "mlp16.onnx"  # the folder does not exist yet: created, as by the original
    returned = auto_convert_mixed_precision_model_path(str(source), mlp_feed(), str(target), ["CPUExecutionProvider"],
                                                       location=location, rtol=1e-2, atol=1e-3)
    assert returned is None
    assert snapshot(source.parent) == before
    data = location or "fp16_tensor.data"
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([data, "mlp16.onnx"])
    written = onnx.load(str(target), load_external_data=False)
    assert {onnx.external_data_helper.ExternalDataInfo(t).location for t in written.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL} == {data}
    assert io_types(written) == {"x": FLOAT, "logits": FLOAT}  # keep_io_types defaults to True here
    session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    expected = run(onnx.load(str(source)), mlp_feed())["logits"]
    assert np.allclose(session.run(None, mlp_feed())[0], expected, rtol=1e-2, atol=1e-3)


def test_auto_model_path_with_keep_io_types_false_casts_the_float32_feed(tmp_path):
    target = tmp_path / "mlp16.onnx"
    auto_convert_mixed_precision_model_path(str(MODELS / "mlp.onnx"), mlp_feed(), str(target),
                                            ["CPUExecutionProvider"], keep_io_types=False, rtol=1e-2, atol=1e-3)
    assert io_types(onnx.load(str(target), load_external_data=False)) == {"x": FLOAT16, "logits": FLOAT16}


def test_auto_model_path_customized_validate_func_replaces_rtol_atol(tmp_path):
    calls = []

    def validate(res1, res2):
        calls.append(1)
        return all(np.allclose(a, b, rtol=0.05, atol=0.05) for a, b in zip(res1, res2))

    target = tmp_path / "mlp16.onnx"
    auto_convert_mixed_precision_model_path(str(MODELS / "mlp.onnx"), mlp_feed(), str(target),
                                            ["CPUExecutionProvider"], customized_validate_func=validate,
                                            rtol=0.0, atol=0.0)  # ignored: the function decides
    assert calls and target.exists()


def test_auto_model_path_errors_match_the_original_and_nothing_is_written(tmp_path):
    target = tmp_path / "out.onnx"
    feed = mlp_feed()
    args = (feed, str(target), ["CPUExecutionProvider"])
    with pytest.raises(TypeError, match="only accepts model Path"):
        auto_convert_mixed_precision_model_path(onnx.load(str(MODELS / "mlp.onnx")), *args)
    with pytest.raises(ValueError, match="input_feed should be a dictionary"):
        auto_convert_mixed_precision_model_path(str(MODELS / "mlp.onnx"), [feed], str(target), ["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="source_model_path does not exist"):
        auto_convert_mixed_precision_model_path(str(tmp_path / "missing.onnx"), *args)
    with pytest.raises(ValueError, match="validation failed for fp32 model"):
        auto_convert_mixed_precision_model_path(str(MODELS / "mlp.onnx"), *args,
                                                customized_validate_func=lambda a, b: False)
    with pytest.raises(ValueError, match="alidation failed for final fp16 model"):
        auto_convert_mixed_precision_model_path(
            str(MODELS / "mlp.onnx"), *args,
            customized_validate_func=lambda a, b: all(np.array_equal(x, y) for x, y in zip(a, b)))
    assert list(tmp_path.iterdir()) == []


def test_auto_model_path_never_writes_over_its_source(tmp_path):
    source = external_copy(tmp_path)
    before = snapshot(source.parent)
    with pytest.raises(onnxmp.OnnxMPError, match="never writes over its input"):
        auto_convert_mixed_precision_model_path(str(source), mlp_feed(), str(source), ["CPUExecutionProvider"])
    assert snapshot(source.parent) == before


@pytest.mark.parametrize("ours, module", [(onnxmp.compat.float16, "onnxconverter_common.float16"),
                                          (ort_float16, "onnxruntime.transformers.float16")])
def test_default_op_block_list_is_the_originals_and_passing_it_denies_those_ops(ours, module):
    assert ours.DEFAULT_OP_BLOCK_LIST == pytest.importorskip(module).DEFAULT_OP_BLOCK_LIST
    model = between_matmuls("m = Max(h, h)")  # Max is a clear op for onnxmp, blocked by the originals' list
    assert tensor_types(ours.convert_float_to_float16(model))["m"] == FLOAT16
    blocked = ours.convert_float_to_float16(model, op_block_list=ours.DEFAULT_OP_BLOCK_LIST + ["Relu"])
    assert tensor_types(blocked)["m"] == FLOAT


# Models the originals accept because they run onnx shape inference first (disable_shape_infer=False,
# and always in the _model_path and auto_ forms): a graph output, or an If body's outputs, declared
# without a type (test_subgraph.onnx of onnxconverter-common's tests is one).
def untyped_if(output: str = "none", then_rank: int = 2) -> onnx.ModelProto:
    """x -> MatMul -> If(sum > 0: MatMul, else: Relu) -> y; the bodies' outputs have empty types,
    y has none (``output="none"``) or an element type only (``"elem"``); ``then_rank=1`` makes the
    then body flatten, so the rank of y depends on the branch taken."""
    h = onnx.helper
    w = h.make_tensor("w", FLOAT, [4, 4], np.linspace(-1, 1, 16, dtype=np.float32).tolist())
    then_nodes = [h.make_node("MatMul", ["m", "w"], ["t" if then_rank == 1 else "then_y"], name="then_mm")]
    if then_rank == 1:
        then_nodes.append(h.make_node("Reshape", ["t", "flat"], ["then_y"], name="flatten"))
    then_g = h.make_graph(then_nodes, "then", [], [onnx.ValueInfoProto(name="then_y", type=onnx.TypeProto())],
                          initializer=[h.make_tensor("flat", onnx.TensorProto.INT64, [1], [-1])])
    else_g = h.make_graph([h.make_node("Relu", ["m"], ["else_y"], name="relu")], "else", [],
                          [onnx.ValueInfoProto(name="else_y", type=onnx.TypeProto())])
    y = onnx.ValueInfoProto(name="y")
    if output == "elem":
        y.type.tensor_type.elem_type = FLOAT
    graph = h.make_graph([
        h.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
        h.make_node("ReduceSum", ["m"], ["s"], name="sum", keepdims=0),
        h.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
        h.make_node("If", ["cond"], ["y"], name="if", then_branch=then_g, else_branch=else_g),
    ], "untyped_if", [h.make_tensor_value_info("x", FLOAT, [2, 4])], [y],
        initializer=[w, h.make_tensor("zero", FLOAT, [], [0.0])])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)


UNTYPED_FEEDS = [np.linspace(0.5, 2, 8, dtype=np.float32).reshape(2, 4),     # then branch
                 -np.linspace(0.5, 2, 8, dtype=np.float32).reshape(2, 4)]    # else branch


def _untyped_converters(tmp_path):
    def model_path(model, keep_io_types):
        onnx.save(model, str(tmp_path / "m.onnx"))
        return convert_float_to_float16_model_path(tmp_path / "m.onnx", keep_io_types=keep_io_types)

    def auto(model, keep_io_types):
        return auto_convert_mixed_precision(model, {"x": UNTYPED_FEEDS[0]}, rtol=1e-2, atol=1e-2,
                                            keep_io_types=keep_io_types)

    return {"occ": convert_float_to_float16, "ort": ort_float16.convert_float_to_float16,
            "model_path": model_path, "auto": auto}


@pytest.mark.parametrize("output", ["none", "elem"])
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("form", ["occ", "ort", "model_path", "auto"])
def test_untyped_outputs_get_the_types_shape_inference_gives_as_in_the_originals(tmp_path, form, keep, output):
    model = untyped_if(output)
    before = model.SerializeToString()
    converted = _untyped_converters(tmp_path)[form](model, keep_io_types=keep)
    assert model.SerializeToString() == before  # as infer_shapes, which returns a new model
    want = FLOAT if keep else FLOAT16
    assert io_types(converted) == {"x": want, "y": want}
    assert [d.dim_value for d in converted.graph.output[0].type.tensor_type.shape.dim] == [2, 4]
    for x in UNTYPED_FEEDS:  # both branches, fed and read as the originals' callers do
        expected = run(onnx.shape_inference.infer_shapes(model), {"x": x})["y"]
        got = run(converted, as_caller_feeds(converted, {"x": x}))["y"]
        np.testing.assert_allclose(got.astype(np.float32), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("keep", [True, False])
def test_untyped_outputs_give_the_interface_of_onnxconverter_common(keep):
    model = untyped_if()
    theirs = occ_convert()(model, keep_io_types=keep)
    assert io_types(convert_float_to_float16(model, keep_io_types=keep)) == io_types(theirs)


@pytest.mark.parametrize("fn", [convert_float_to_float16, ort_float16.convert_float_to_float16])
def test_untyped_outputs_convert_with_disable_shape_infer_too(fn):
    # The originals skip inference then; onnxmp's own inference (normalize) fills the types in
    # either case, and the argument is edited in place as the originals do.
    model = untyped_if()
    returned = fn(model, disable_shape_infer=True)
    assert returned is model and io_types(model) == {"x": FLOAT16, "y": FLOAT16}


@pytest.mark.parametrize("disable", [False, True])
@pytest.mark.parametrize("fn", [convert_float_to_float16, ort_float16.convert_float_to_float16])
def test_output_whose_rank_depends_on_the_branch_converts_with_no_new_error(fn, disable, caplog):
    # ONNX's checker wants a rank on every main-graph output; onnxruntime and the originals do not
    # (onnxconverter-common's with_subgraph case).  The input fails the checker already, in the same
    # words as the output: verify judges by "no new errors", and onnxruntime runs the result.
    model = untyped_if(then_rank=1)
    with caplog.at_level("WARNING", logger="onnxmp.verify"):
        converted = fn(model, disable_shape_infer=disable)
    assert any("already fails onnx.checker in the same way" in r.getMessage() for r in caplog.records)
    for x in UNTYPED_FEEDS:
        expected = run(onnx.shape_inference.infer_shapes(untyped_if(then_rank=1)), {"x": x})["y"]
        got = run(converted, as_caller_feeds(converted, {"x": x}))["y"]
        np.testing.assert_allclose(got.astype(np.float32).reshape(expected.shape), expected, rtol=1e-2, atol=1e-2)


def test_an_output_error_the_input_did_not_have_is_still_refused(monkeypatch):
    from onnxmp import verify as verify_module

    model = untyped_if(then_rank=1)
    real = verify_module.full_check
    calls = []

    def check(m):  # the converted model fails in other words than its input
        calls.append(1)
        if len(calls) == 1:
            raise onnx.checker.ValidationError("something new")
        return real(m)
    monkeypatch.setattr(verify_module, "full_check", check)
    with pytest.raises(onnxmp.OnnxMPError, match="input model is invalid"):
        convert_float_to_float16(model)


def test_explain_takes_the_input_convert_takes_under_no_new_errors():
    report = onnxmp.explain(untyped_if(then_rank=1))  # fails onnx's checker; onnxruntime loads it
    assert report.vertices
