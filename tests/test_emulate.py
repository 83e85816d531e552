"""Tests for onnxmp.emulate: fp16/bf16 numerics on the ORT CPU EP."""
from __future__ import annotations

import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxmp.cli import main
from onnxmp.parity.emulate import emulate, low_precision_types
from onnxmp.errors import OnnxMPError

MODELS = Path(__file__).resolve().parents[1] / "models"
IR_VERSION = 8


def make_model(nodes, inputs, outputs, initializers=(), value_info=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers),
                              value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    return model


def f16(name, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float16), name)


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_fp16_close(actual: np.ndarray, expected: np.ndarray, ulps: float = 2) -> None:
    """Equal within ``ulps`` fp16 units in the last place of the expected value."""
    expected = expected.astype(np.float32)
    actual = actual.astype(np.float32)
    spacing = np.spacing(np.abs(expected).astype(np.float16)).astype(np.float32)
    np.testing.assert_array_equal(np.isfinite(actual), np.isfinite(expected))
    finite = np.isfinite(expected)
    excess = np.abs(actual - expected)[finite] - ulps * spacing[finite]
    assert excess.max(initial=0) <= 0, f"off by more than {ulps} fp16 ulps: {actual} vs {expected}"


def fp16_mlp() -> onnx.ModelProto:
    """x(float) -> Cast fp16 -> MatMul -> Add -> Relu -> MatMul -> Softmax -> y (fp16) and y32 (float)."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], to=TP.FLOAT16),
        helper.make_node("MatMul", ["x16", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["y"], axis=-1),
        helper.make_node("Cast", ["logits"], ["y32"], to=TP.FLOAT),
    ]
    inits = [f16("w1", rng.standard_normal((8, 16)) * 0.7), f16("b1", rng.standard_normal(16)),
             f16("w2", rng.standard_normal((16, 5)) * 0.5)]
    value_info = [helper.make_tensor_value_info("h", TP.FLOAT16, ["N", 16])]
    return make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, ["N", 8])],
                      [helper.make_tensor_value_info("y", TP.FLOAT16, ["N", 5]),
                       helper.make_tensor_value_info("y32", TP.FLOAT, ["N", 5])],
                      inits, value_info)


def fp16_if_loop() -> onnx.ModelProto:
    """fp16 input and output; an If whose branches compute in fp16, then a Loop carrying an fp16 value."""
    then_g = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", TP.FLOAT16, [4])], initializer=[f16("k", [1.1] * 4)])
    else_g = helper.make_graph(
        [helper.make_node("Sub", ["x", "c"], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", TP.FLOAT16, [4])])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Mul", ["acc_in", "c"], ["acc_mul"]),
         helper.make_node("Add", ["acc_mul", "x"], ["acc_out"])],
        "body",
        [helper.make_tensor_value_info("i", TP.INT64, []), helper.make_tensor_value_info("cond_in", TP.BOOL, []),
         helper.make_tensor_value_info("acc_in", TP.FLOAT16, [4])],
        [helper.make_tensor_value_info("cond_out", TP.BOOL, []),
         helper.make_tensor_value_info("acc_out", TP.FLOAT16, [4])],
        value_info=[helper.make_tensor_value_info("acc_mul", TP.FLOAT16, [4])])
    nodes = [
        helper.make_node("If", ["flag"], ["branch"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Loop", ["trips", "go", "branch"], ["looped"], body=body),
        helper.make_node("Abs", ["looped"], ["abs"]),
        helper.make_node("Sqrt", ["abs"], ["y"]),
    ]
    inits = [f16("c", [0.3, 1.7, -2.1, 0.01]), numpy_helper.from_array(np.array(3, np.int64), "trips"),
             numpy_helper.from_array(np.array(True), "go")]
    return make_model(nodes,
                      [helper.make_tensor_value_info("x", TP.FLOAT16, [4]),
                       helper.make_tensor_value_info("flag", TP.BOOL, [])],
                      [helper.make_tensor_value_info("y", TP.FLOAT16, [4])], inits)


def low_precision_left(model: onnx.ModelProto, elem: int) -> list[str]:
    """Low-precision uses other than Cast nodes targeting it (the rounding steps)."""
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)

    def strip(graph):
        keep = [n for n in graph.node
                if not (n.op_type == "Cast" and helper.get_attribute_value(n.attribute[0]) == elem)]
        graph.ClearField("node")
        graph.node.extend(keep)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    strip(attr.g)

    strip(stripped.graph)
    name = {TP.FLOAT16: "float16", TP.BFLOAT16: "bfloat16"}[elem]
    return [t for t in low_precision_types(stripped) if t == name]


def consumers_of_low_precision_are_casts(model: onnx.ModelProto, elem: int) -> None:
    """No op other than Cast may read a low-precision tensor, or ORT CPU would need an fp16 kernel."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    low = set()

    def collect(graph):
        for v in [*graph.input, *graph.output, *graph.value_info]:
            if v.type.tensor_type.elem_type == elem:
                low.add(v.name)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    collect(attr.g)

    def check(graph):
        for node in graph.node:
            if node.op_type != "Cast":
                assert not low & set(node.input), f"{node.op_type} {node.name} reads {low & set(node.input)}"
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    check(attr.g)

    collect(inferred.graph)
    check(inferred.graph)


# --- (a) numerics equal the real fp16 model's --------------------------------------


def test_fp16_mlp_matches_reference_evaluator():
    model = fp16_mlp()
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    expected = ReferenceEvaluator(model).run(None, {"x": x})
    emulated = emulate(model)
    onnx.checker.check_model(emulated, full_check=True)
    consumers_of_low_precision_are_casts(emulated, TP.FLOAT16)
    got = run_ort(emulated, {"x": x})
    assert got[0].dtype == np.float16  # the interface keeps its dtype
    for g, e in zip(got, expected):
        assert_fp16_close(g, e)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the overflow is the point
def test_ort_cpu_hides_fp16_overflow_that_emulation_shows():
    # ORT CPU does load fp16 models: it wraps kernel-less fp16 regions in Casts
    # and then drops the Cast pairs between them, so intermediates stay fp32.
    nodes = [helper.make_node("Cast", ["x"], ["x16"], to=TP.FLOAT16),
             helper.make_node("Mul", ["x16", "x16"], ["sq"]),
             helper.make_node("Div", ["sq", "k"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [1])],
                       [helper.make_tensor_value_info("y", TP.FLOAT16, [1])], [f16("k", [1000])])
    x = {"x": np.array([300.0], np.float32)}
    assert run_ort(model, x)[0][0] == 90.0  # fp16 would have overflowed at 300 * 300
    assert np.isposinf(ReferenceEvaluator(model).run(None, x)[0][0])
    assert np.isposinf(run_ort(emulate(model), x)[0][0])


@pytest.mark.parametrize("flag", [True, False])
def test_if_and_loop_subgraphs_match_reference_evaluator(flag):
    model = fp16_if_loop()
    feeds = {"x": np.array([1.5, -0.7, 3.3, 12.0], np.float16), "flag": np.array(flag)}
    expected = ReferenceEvaluator(model).run(None, feeds)[0]
    emulated = emulate(model)
    onnx.checker.check_model(emulated, full_check=True)
    consumers_of_low_precision_are_casts(emulated, TP.FLOAT16)
    got = run_ort(emulated, feeds)[0]
    assert got.dtype == np.float16
    assert_fp16_close(got, expected)


def test_subgraph_formal_types_and_value_info_are_retyped():
    emulated = emulate(fp16_if_loop())
    loop = next(n for n in emulated.graph.node if n.op_type == "Loop")
    body = loop.attribute[0].g
    types = {v.name: v.type.tensor_type.elem_type for v in [*body.input, *body.output, *body.value_info]}
    assert types["acc_in"] == types["acc_out"] == types["acc_mul"] == TP.FLOAT
    iff = next(n for n in emulated.graph.node if n.op_type == "If")
    then_g = next(a.g for a in iff.attribute if a.name == "then_branch")
    assert then_g.initializer[0].data_type == TP.FLOAT
    assert then_g.output[0].type.tensor_type.elem_type == TP.FLOAT
    float_io = emulate(fp16_if_loop(), keep_io_types=False)
    assert low_precision_left(float_io, TP.FLOAT16) == []
    assert low_precision_left(emulated, TP.FLOAT16) == ["float16"]  # the kept fp16 interface


def test_float_io_rounds_inputs_on_entry():
    model = fp16_if_loop()
    x = np.array([1.0004, -0.7, 3.3, 12.0], np.float32)  # 1.0004 is not an fp16 value
    emulated = emulate(model, keep_io_types=False)
    assert emulated.graph.input[0].type.tensor_type.elem_type == TP.FLOAT
    assert emulated.graph.output[0].type.tensor_type.elem_type == TP.FLOAT
    got = run_ort(emulated, {"x": x, "flag": np.array(True)})[0]
    expected = run_ort(emulate(model), {"x": x.astype(np.float16), "flag": np.array(True)})[0]
    np.testing.assert_array_equal(got, expected.astype(np.float32))


# --- (b) fp32 models are left alone -------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "loop_if", "transformer_block"])
def test_emulating_fp32_model_is_identity(name):
    model = onnx.load(MODELS / f"{name}.onnx")
    result = emulate(model)
    assert result.SerializeToString() == model.SerializeToString()
    assert result is not model


def test_input_model_is_not_modified():
    model = fp16_mlp()
    before = model.SerializeToString()
    emulate(model)
    assert model.SerializeToString() == before


def test_path_input_and_deterministic_output(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(fp16_mlp(), path)
    first, second = emulate(path), emulate(str(path))
    assert first.SerializeToString() == second.SerializeToString()
    assert first.ir_version == IR_VERSION


# --- (c) overflow and underflow ----------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the overflow is the point
def test_overflow_to_inf_and_underflow_to_zero_in_intermediates():
    nodes = [helper.make_node("Cast", ["x"], ["x16"], to=TP.FLOAT16),
             helper.make_node("Mul", ["x16", "x16"], ["sq"]),
             helper.make_node("Mul", ["sq", "k"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [3])],
                       [helper.make_tensor_value_info("y", TP.FLOAT16, [3])], [f16("k", [1e-3, 1e4, 1])])
    # Squares: 90000 > 65504 overflows; 1e-8 is below fp16's smallest subnormal
    # (6e-8). Scaled back by k both would be ordinary fp16 values (90, 1e-4).
    x = np.array([300.0, 1e-4, 2.0], np.float32)
    y = run_ort(emulate(model), {"x": x})[0]
    assert np.isposinf(y[0])
    assert y[1] == 0.0
    assert y[2] == 4.0
    np.testing.assert_array_equal(y, ReferenceEvaluator(model).run(None, {"x": x})[0])


# --- (d) bfloat16 ---------------------------------------------------------------


def bf16_model() -> onnx.ModelProto:
    w = np.array([1.01, -3.3, 0.1234, 7.77], np.float32).astype(ml_dtypes.bfloat16)
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=TP.BFLOAT16),
             helper.make_node("Mul", ["xb", "w"], ["p"]),
             helper.make_node("Add", ["p", "xb"], ["s"]),
             helper.make_node("Cast", ["s"], ["y"], to=TP.FLOAT)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [4])],
                      [helper.make_tensor_value_info("y", TP.FLOAT, [4])], [numpy_helper.from_array(w, "w")])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the overflow is the point
def test_bfloat16_rounding():
    model = bf16_model()
    assert low_precision_types(model) == ["bfloat16"]
    x = np.array([1.2345, 100.7, -0.333, 3e38], np.float32)
    emulated = emulate(model, "bfloat16")
    onnx.checker.check_model(emulated, full_check=True)
    consumers_of_low_precision_are_casts(emulated, TP.BFLOAT16)
    y = run_ort(emulated, {"x": x})[0]

    def bf(a):
        return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)

    w = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float32)
    expected = bf(bf(bf(x) * w) + bf(x))
    np.testing.assert_array_equal(y[:3], expected[:3])
    assert np.isposinf(y[3]) and np.isposinf(expected[3])  # 3e38 * 7.77 overflows bf16's range too
    assert not np.array_equal(y[:3], (x * w.astype(np.float32) + x)[:3])


def test_precision_selects_the_type_to_emulate():
    model = bf16_model()
    assert emulate(model, "float16").SerializeToString() == model.SerializeToString()
    with pytest.raises(OnnxMPError, match="unknown precision"):
        emulate(model, "float8")


# --- attributes, converters, names --------------------------------------------------


def test_dtype_attributes_and_constants_are_retargeted():
    const = helper.make_node("Constant", [], ["k"], value=f16("kv", [[0.5, 2.0], [4.0, 8.0]]))
    nodes = [
        const,
        helper.make_node("ConstantOfShape", ["shape"], ["filled"], value=f16("fill", [1.25])),
        helper.make_node("EyeLike", ["filled"], ["eye"], dtype=TP.FLOAT16),
        helper.make_node("Add", ["k", "eye"], ["ke"]),
        helper.make_node("CastLike", ["x", "ke"], ["xl"]),
        helper.make_node("Mul", ["xl", "filled"], ["m"]),
        helper.make_node("Add", ["m", "ke"], ["y"]),
    ]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [2, 2])],
                       [helper.make_tensor_value_info("y", TP.FLOAT16, [2, 2])],
                       [numpy_helper.from_array(np.array([2, 2], np.int64), "shape")])
    emulated = emulate(model, keep_io_types=False)
    assert low_precision_left(emulated, TP.FLOAT16) == []  # every fp16 attribute and tensor retargeted
    onnx.checker.check_model(emulated, full_check=True)
    x = np.array([[1.0001, 3.14159], [-2.7182, 1000.3]], np.float32)
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert_fp16_close(run_ort(emulated, {"x": x})[0], expected)


def test_converter_output_emulates_and_runs():
    from onnxconverter_common import float16

    model = onnx.load(MODELS / "mlp.onnx")
    converted = float16.convert_float_to_float16(model, keep_io_types=True)
    feeds = dict(np.load(MODELS / "mlp.inputs.npz"))
    emulated = emulate(converted)
    onnx.checker.check_model(emulated, full_check=True)
    assert emulated.ir_version == model.ir_version <= 10
    expected = ReferenceEvaluator(converted).run(None, feeds)[0].astype(np.float32)
    # ReferenceEvaluator rounds Gemm's product before adding the bias, the
    # emulation (like a GPU) once after; through three layers that is a few
    # ulps on small outputs, so measure against the largest one.
    got = run_ort(emulated, feeds)[0].astype(np.float32)
    assert np.abs(got - expected).max() <= 2 * np.spacing(np.abs(expected).max().astype(np.float16))


def test_elementwise_chain_is_bit_exact():
    # numpy computes each fp16 ufunc in float32 and rounds, exactly what the
    # emulation does, so any rounding step left out shows up here.
    nodes = [helper.make_node("Mul", ["x", "a"], ["m"]),
             helper.make_node("Add", ["m", "x"], ["s"]),
             helper.make_node("Div", ["s", "a"], ["d"]),
             helper.make_node("Sub", ["d", "m"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT16, [64])],
                       [helper.make_tensor_value_info("y", TP.FLOAT16, [64])],
                       [f16("a", np.linspace(0.01, 3.0, 64))])
    x = np.random.default_rng(3).standard_normal(64).astype(np.float16) * 100
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = run_ort(emulate(model), {"x": x})[0]
    np.testing.assert_array_equal(got, expected)
    a = np.linspace(0.01, 3.0, 64).astype(np.float16).astype(np.float32)
    x32 = x.astype(np.float32)
    unrounded = ((x32 * a + x32) / a - x32 * a).astype(np.float16)
    assert not np.array_equal(unrounded, expected)  # so skipping a rounding would be caught


def test_emulating_twice_changes_nothing_more():
    once = emulate(fp16_mlp())
    assert emulate(once).SerializeToString() == once.SerializeToString()


def test_inserted_names_never_collide():
    nodes = [helper.make_node("Cast", ["x"], ["x16"], to=TP.FLOAT16, name="x16__emu_cast_f32"),
             helper.make_node("Relu", ["x16"], ["r__emu_f32"], name="r__emu_cast_f16"),
             helper.make_node("Sigmoid", ["r__emu_f32"], ["r"], name="r__emu_f16"),
             helper.make_node("Sigmoid", ["r"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [2])],
                       [helper.make_tensor_value_info("y", TP.FLOAT16, [2])])
    emulated = emulate(model)
    onnx.checker.check_model(emulated, full_check=True)
    names = [n.name for n in emulated.graph.node]
    assert len(names) == len(set(names))
    outputs = [o for n in emulated.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs))
    x = np.array([0.3, -1.0], np.float32)
    assert_fp16_close(run_ort(emulated, {"x": x})[0], ReferenceEvaluator(model).run(None, {"x": x})[0])


def test_stale_value_info_is_retyped():
    emulated = emulate(fp16_mlp())
    assert {v.name: v.type.tensor_type.elem_type for v in emulated.graph.value_info} == {"h": TP.FLOAT}


def test_cast_read_only_by_casts_keeps_its_declared_low_type():
    """A Cast to fp16 read only by another Cast stays a rounding step: its declared type stays fp16
    (a retyped declaration made ORT refuse the model: ViT's Softmax -> Cast -> Cast)."""
    nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=-1),
             helper.make_node("Cast", ["s"], ["c1"], to=TP.FLOAT16),
             helper.make_node("Cast", ["c1"], ["c2"], to=TP.FLOAT16),
             helper.make_node("Add", ["c2", "c2"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT16, [2, 3])],
                       [helper.make_tensor_value_info("y", TP.FLOAT16, [2, 3])],
                       value_info=[helper.make_tensor_value_info(t, TP.FLOAT16, [2, 3]) for t in ("s", "c1", "c2")])
    emulated = emulate(model, keep_io_types=False)
    types = {v.name: v.type.tensor_type.elem_type for v in emulated.graph.value_info}
    assert types["c1"] == TP.FLOAT16 and types["s"] == TP.FLOAT
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    (y,) = run_ort(emulated, {"x": x})
    x16 = x.astype(np.float16).astype(np.float32)
    e = np.exp(x16 - x16.max(axis=-1, keepdims=True))
    s16 = (e / e.sum(axis=-1, keepdims=True)).astype(np.float16)  # float32 math, rounded once
    np.testing.assert_array_equal(y, (s16 + s16).astype(np.float32))


# --- (h) CLI --------------------------------------------------------------------------


def test_cli_emulate(tmp_path):
    src, dst = tmp_path / "fp16.onnx", tmp_path / "emulated.onnx"
    onnx.save(fp16_if_loop(), src)
    assert main(["emulate", str(src), "-o", str(dst)]) == 0
    emulated = onnx.load(dst)
    onnx.checker.check_model(emulated, full_check=True)
    assert emulated.ir_version == IR_VERSION
    assert sorted(p.name for p in tmp_path.iterdir()) == ["emulated.onnx", "fp16.onnx"]  # no temp files


def test_cli_emulate_bfloat16_float_io(tmp_path):
    src, dst = tmp_path / "bf16.onnx", tmp_path / "out.onnx"
    onnx.save(bf16_model(), src)
    assert main(["emulate", str(src), "-o", str(dst), "--precision", "bfloat16", "--float-io"]) == 0
    emulated = onnx.load(dst)
    assert emulated.graph.input[0].type.tensor_type.elem_type == TP.FLOAT
    assert low_precision_left(emulated, TP.BFLOAT16) == []
    assert low_precision_types(emulated) == ["bfloat16"]  # the rounding Casts


def test_cli_emulate_missing_file(tmp_path, capsys):
    assert main(["emulate", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "out.onnx")]) == 1
    assert "not found" in capsys.readouterr().err
    assert not (tmp_path / "out.onnx").exists()


def test_cli_emulate_detects_bfloat16(tmp_path, capsys):
    """A bf16 model used to be emulated as float16: a warning, exit 0, and an unusable model."""
    src, dst = tmp_path / "x.bf16.onnx", tmp_path / "out.onnx"
    onnx.save(bf16_model(), src)
    assert main(["emulate", str(src), "-o", str(dst)]) == 0
    emulated = onnx.load(dst)
    assert low_precision_left(emulated, TP.BFLOAT16) == [] and low_precision_types(emulated) == ["bfloat16"]
    x = np.array([1.2345, 100.7, -0.333, 2.0], np.float32)
    run_ort(emulated, {"x": x})  # runs on the CPU EP: no bf16 kernel needed
    assert "warning" not in capsys.readouterr().err.lower()


def test_cli_emulate_precision_that_the_model_does_not_hold_is_an_error(tmp_path, capsys):
    src, dst = tmp_path / "x.bf16.onnx", tmp_path / "out.onnx"
    onnx.save(bf16_model(), src)
    assert main(["emulate", str(src), "-o", str(dst), "--precision", "float16"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"onnxmp emulate: error: float16 was asked for, but {src} holds bfloat16 tensors"
    assert err[1] == "  hint: omit --precision: the model's own precision is detected"
    assert not dst.exists()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the overflow is the point
def test_cli_emulate_model_with_both_types_emulates_both(tmp_path, caplog):
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TP.FLOAT16),
             helper.make_node("Mul", ["h", "h"], ["h2"]),
             helper.make_node("Cast", ["h2"], ["b"], to=TP.BFLOAT16),
             helper.make_node("Mul", ["b", "b"], ["b2"]),
             helper.make_node("Cast", ["b2"], ["y"], to=TP.FLOAT)]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [3])],
                       [helper.make_tensor_value_info("y", TP.FLOAT, [3])])
    src, dst = tmp_path / "mixed.onnx", tmp_path / "out.onnx"
    onnx.save(model, src)
    assert main(["emulate", str(src), "-o", str(dst)]) == 0
    assert "holds both float16 and bfloat16 tensors; emulating both" in caplog.text
    emulated = onnx.load(dst)
    assert low_precision_left(emulated, TP.FLOAT16) == [] and low_precision_left(emulated, TP.BFLOAT16) == []
    x = np.array([1.001, 300.0, -2.5], np.float32)

    def bf(a):
        return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)

    h2 = (x.astype(np.float16) ** 2).astype(np.float32)  # 300**2 overflows fp16
    np.testing.assert_array_equal(run_ort(emulated, {"x": x})[0], bf(bf(h2) ** 2))


def test_cli_emulate_float32_model_warns_and_copies(tmp_path, caplog):
    src, dst = tmp_path / "m.onnx", tmp_path / "out.onnx"
    shutil.copy(MODELS / "mlp.onnx", src)
    assert main(["emulate", str(src), "-o", str(dst)]) == 0
    assert "holds no float16 or bfloat16 tensors; writing it unchanged" in caplog.text
    assert low_precision_types(onnx.load(dst)) == []
    assert main(["emulate", str(src), "-o", str(dst), "--precision", "float16"]) == 1


def _fast_gelu_model(value_info=()) -> onnx.ModelProto:
    # onnxruntime's own converter writes no value_info: onnx's inference types neither FastGelu's
    # output (com.microsoft) nor the Mul computed from it.
    graph = helper.make_graph(
        [helper.make_node("FastGelu", ["x"], ["g"], domain="com.microsoft"),
         helper.make_node("Mul", ["g", "g"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TP.FLOAT16, [2, 4])],
        [helper.make_tensor_value_info("y", TP.FLOAT16, [2, 4])], value_info=list(value_info))
    return helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def _rounded_outputs(model: onnx.ModelProto) -> set[str]:
    """Tensors followed by a Cast(to=FLOAT16): the ones the emulation rounds."""
    return {n.input[0] for n in model.graph.node if n.op_type == "Cast" and n.attribute[0].i == TP.FLOAT16}


@pytest.mark.parametrize("declared", [False, True])
def test_runtime_ops_outputs_are_rounded_without_value_info(declared):
    vi = [helper.make_tensor_value_info("g", TP.FLOAT16, None)] if declared else []
    emulated = emulate(_fast_gelu_model(vi))
    rounded = _rounded_outputs(emulated)
    fast_gelu, mul = (n for n in emulated.graph.node if n.op_type in ("FastGelu", "Mul"))
    assert fast_gelu.output[0] in rounded and mul.output[0] in rounded
    x = np.linspace(-3, 3, 8, dtype=np.float16).reshape(2, 4)
    xf = x.astype(np.float64)
    g = (0.5 * xf * (1 + np.tanh(np.sqrt(2 / np.pi) * (xf + 0.044715 * xf ** 3)))).astype(np.float16)
    want = (g.astype(np.float32) * g.astype(np.float32)).astype(np.float16)
    got = run_ort(emulated, {"x": x})[0]
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=1e-3)


def test_an_op_no_schema_types_is_left_as_declared(caplog):
    model = _fast_gelu_model()
    model.graph.node[0].op_type = "NoSuchFusedOp"
    with caplog.at_level("WARNING", logger="onnxmp.emulate"):
        emulated = emulate(model)
    assert "cannot type" in caplog.text
    assert not _rounded_outputs(emulated) & {"g", "y"}
