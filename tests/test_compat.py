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
    from onnxmp.validate import validate

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
    from onnxmp.validate import validate

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

