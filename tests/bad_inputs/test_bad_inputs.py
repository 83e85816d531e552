"""The bad-input corpus: problems users of other fp16 converters have reported.

Each case either converts correctly (verified, graph I/O kept, and emulated parity
against the fp32 model) or raises OnnxMPError naming the node or tensor, with a hint.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

import onnxmp
from onnxmp.parity.validate import validate

ort = pytest.importorskip("onnxruntime")
FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
MODELS = Path(__file__).resolve().parents[2] / "models"
RNG = np.random.default_rng(0)


def parse(text: str, opset: int = 17) -> onnx.ModelProto:
    model = onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : {opset}]>\n' + text)
    model.ir_version = 8
    return model


def init(model: onnx.ModelProto, name: str, values) -> None:
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(values, dtype=np.float32), name))


def weight(n: int = 8, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal((n, n)) / np.sqrt(n) * scale).astype(np.float32)


def converts(model: onnx.ModelProto, inputs: dict | None = None, reference: onnx.ModelProto | None = None,
             **kw) -> onnxmp.ConversionResult:
    onnx.checker.check_model(model, full_check=True)
    result = onnxmp.convert(model, **kw)
    onnx.checker.check_model(result.model, full_check=True)
    sig = lambda m: [(v.name, v.type.tensor_type.elem_type) for v in list(m.graph.input) + list(m.graph.output)]
    assert sig(result.model) == sig(model)
    report = validate(reference or model, result.model, inputs)
    assert report.passed, report.summary()
    return result


def x_input(shape=(4, 8), scale=1.0):
    return {"x": (RNG.standard_normal(shape) * scale).astype(np.float32)}


# 1
def test_cast_to_float_fed_by_int64():
    model = parse("""g (int64[4,8] ids) => (float[4,8] y) {
        f = Cast <to = 1> (ids)
        y = MatMul(f, w)
    }""")
    init(model, "w", weight())
    result = converts(model, {"ids": RNG.integers(-3, 3, (4, 8)).astype(np.int64)})
    cast = next(n for n in result.model.graph.node if n.op_type == "Cast" and n.input[0] == "ids")
    assert cast.attribute[0].i == FLOAT16  # int64 -> fp16 directly, no detour through fp32


# 2
@pytest.mark.parametrize("scales_from", ["initializer", "constant", "empty"])
def test_resize_scales_as_initializer_constant_or_empty(scales_from):
    scales = "sc" if scales_from != "empty" else ""
    sizes = ", sz" if scales_from == "empty" else ""
    model = parse(f"""g (float[1,8,4,4] x) => (float[1,8,8,8] y) {{
        c = Conv(x, w)
        {"sc = Constant <value = float[4] {1.0, 1.0, 2.0, 2.0}> ()" if scales_from == "constant" else ""}
        r = Resize <mode = "nearest"> (c, , {scales}{sizes})
        y = Conv(r, w)
    }}""")
    model.graph.initializer.append(onnx.numpy_helper.from_array(
        (RNG.standard_normal((8, 8, 1, 1)) * 0.3).astype(np.float32), "w"))
    if scales_from == "initializer":
        init(model, "sc", [1.0, 1.0, 2.0, 2.0])
    if scales_from == "empty":
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1, 8, 8, 8], np.int64), "sz"))
    result = converts(model, x_input((1, 8, 4, 4)))
    assert result.report.node_colors()[next(n.name for n in result.model.graph.node if n.op_type == "Resize")] \
        == "allow"
    types = {t.name: t.data_type for t in result.model.graph.initializer}
    assert types.get("sc", FLOAT) == FLOAT  # scales are tensor(float) by schema, never retyped


# 3
def test_initializer_shared_by_fp16_and_fp32_nodes():
    model = parse("""g (float[4,8] x) => (float[4,8] y, float[8,8] z) {
        y = MatMul(x, w)
        z = Exp(w)
    }""")
    init(model, "w", weight())
    result = converts(model, x_input())
    types = {t.name: t.data_type for t in result.model.graph.initializer}
    assert types["w"] == FLOAT and FLOAT16 in types.values()


# 4
@pytest.mark.parametrize("eps, stays_fp32", [(1e-5, False), (1e-12, True)])
def test_epsilon_constant_feeding_add_between_matmuls(eps, stays_fp32):
    model = parse(f"""g (float[4,8] x) => (float[4,8] y) {{
        a = MatMul(x, w)
        e = Constant <value = float {{{eps}}}> ()
        b = Add(a, e)
        y = MatMul(b, w)
    }}""")
    init(model, "w", weight())
    result = converts(model, x_input())
    add = next(v for v in result.report.vertices if v.op == "Add")
    assert (add.color == "deny") == stays_fp32
    if stays_fp32:
        assert "flush to zero" in add.cause


# 5
def test_input_straight_to_output_and_straight_into_a_deny_op():
    model = parse("""g (float[4,8] x, float[4,8] x2) => (float[4,8] x_copy, float[4,8] y) {
        x_copy = Identity(x)
        e = Exp(x2)
        y = MatMul(e, w)
    }""")
    init(model, "w", weight())
    converts(model, {"x": x_input()["x"], "x2": x_input(scale=0.1)["x"]})
    passthrough = parse("""g (float[4,8] x) => (float[4,8] x, float[4,8] y) {
        y = MatMul(x, w)
    }""")
    init(passthrough, "w", weight())
    converts(passthrough, x_input())


# 6
def test_unnamed_and_duplicate_node_names():
    model = parse("""g (float[4,8] x) => (float[4,8] y) {
        a = MatMul(x, w)
        b = Relu(a)
        y = MatMul(b, w)
    }""")
    init(model, "w", weight())
    reference = onnx.ModelProto()
    reference.CopyFrom(model)  # onnxruntime itself refuses duplicate names
    model.graph.node[0].name = "same"
    model.graph.node[1].name = "same"
    model.graph.node[2].name = ""
    result = converts(model, x_input(), reference=reference)
    names = [n.name for n in result.model.graph.node]
    assert len(names) == len(set(names))


# 7
def test_model_already_partly_fp16():
    model = parse("""g (float[4,8] x) => (float[4,8] y) {
        h = Cast <to = 10> (x)
        a16 = MatMul(h, w16)
        a = Cast <to = 1> (a16)
        y = MatMul(a, w)
    }""")
    init(model, "w", weight())
    model.graph.initializer.append(onnx.numpy_helper.from_array(weight().astype(np.float16), "w16"))
    result = converts(model, x_input())
    assert result.report.node_colors()[result.model.graph.node[-2].name] in ("allow", "fp32")


# 8
def test_model_converted_twice_is_unchanged():
    first = onnxmp.convert(MODELS / "transformer_block.onnx")
    second = onnxmp.convert(first.model)
    assert second.report.casts_inserted == 0
    assert second.model.SerializeToString() == first.model.SerializeToString()


# 9
def test_if_and_loop_bodies_reading_outer_scope_floats():
    model = onnx.load(str(MODELS / "loop_if.onnx"))
    inputs = dict(np.load(MODELS / "loop_if.inputs.npz"))
    converts(model, inputs)
    converts(model, {k: -v for k, v in inputs.items()})  # the other If branch


# 10
@pytest.mark.parametrize("case", ["nan", "inf", "big", "subnormal"])
def test_initializers_with_nan_inf_big_and_subnormal_values(case):
    model = parse("""g (float[4,8] x) => (float[4,8] y, float[4,8] z) {
        a = MatMul(x, w)
        z = Max(a, c)
        y = MatMul(a, v)
    }""")
    init(model, "w", weight())
    c = np.full((1, 8), -np.inf if case == "inf" else -100.0, np.float32)
    v = weight()
    if case == "big":
        v[0, 0] = 1e5
    if case == "subnormal":
        v = np.full((8, 8), 1e-6, np.float32)
    if case == "nan":
        c[0, 3] = np.nan
    init(model, "c", c)
    init(model, "v", v)
    if case == "nan":
        # Max(a, NaN) is NaN in both models; the NaN must survive conversion unclamped.
        result = onnxmp.convert(model)
        onnx.checker.check_model(result.model, full_check=True)
        c_out = next(t for t in result.model.graph.initializer if t.name == "c")
        assert np.isnan(onnx.numpy_helper.to_array(c_out)).sum() == 1
        return
    result = converts(model, x_input())
    mm = next(v for v in result.report.vertices if "v" in v.tensors)
    if case in ("big", "subnormal"):
        assert mm.color == "deny" and "`v`" in mm.cause
    else:
        assert mm.color == "allow"  # -inf in c is representable: nothing to keep in fp32


# 11
def test_sequence_of_float_tensors():
    model = parse("""g (float[4,8] x) => (float[4,8] y) {
        a = MatMul(x, w)
        s = SequenceConstruct(a, x)
        s2 = Identity(s)
        i = Constant <value = int64 {0}> ()
        b = SequenceAt(s2, i)
        y = MatMul(b, w)
    }""")
    init(model, "w", weight())
    result = converts(model, x_input())
    seq_types = [v for v in result.model.graph.value_info if v.type.HasField("sequence_type")]
    assert all(v.type.sequence_type.elem_type.tensor_type.elem_type == FLOAT for v in seq_types)


# 12
def test_random_normal_without_dtype():
    model = parse("""g (float[4,8] x) => (float[4,8] y) {
        r = RandomNormal <shape = [4, 8], seed = 1.0, scale = 0.01> ()
        a = Add(x, r)
        y = MatMul(a, w)
    }""")
    init(model, "w", weight())
    result = converts(model, x_input())
    assert next(v for v in result.report.vertices if v.op == "RandomNormal").color == "deny"


# 13
def test_reducemean_pow_chain_whose_intermediates_overflow_fp16():
    model = parse("""g (float[4,8] x) => (float[4,8] y) {
        a = MatMul(x, w)
        two = Constant <value = float {2.0}> ()
        p = Pow(a, two)
        m = ReduceMean <axes = [1]> (p)
        s = Sqrt(m)
        d = Div(a, s)
        y = MatMul(d, w)
    }""", opset=17)
    init(model, "w", weight())
    result = converts(model, x_input(scale=500.0))  # a ~ 500: a**2 ~ 2.5e5 > 65504
    colors = result.report.node_colors()
    assert colors[next(n for n in colors if n.startswith("Pow"))] == "deny"


# 14
def test_graph_not_topologically_sorted():
    model = parse("""g (float[4,8] x) => (float[4,8] y) {
        a = MatMul(x, w)
        b = Relu(a)
        y = MatMul(b, w)
    }""")
    init(model, "w", weight())
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    result = onnxmp.convert(model)
    onnx.checker.check_model(result.model, full_check=True)
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))  # sorted again, for the fp32 reference run
    assert validate(model, result.model, x_input()).passed


# 15
def test_opset_newer_than_onnx_knows_is_a_clear_error():
    model = parse("""g (float[4,8] x) => (float[4,8] y) { y = MatMul(x, w) }""", opset=onnx.defs.onnx_opset_version() + 5)
    init(model, "w", weight())
    with pytest.raises(onnxmp.OnnxMPError, match="newer than this onnx") as info:
        onnxmp.convert(model)
    assert "convert_version" in info.value.hint


def test_custom_domain_op_without_schema_stays_fp32():
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17, "my.ops" : 1]>
    g (float[4,8] x) => (float[4,8] y) {
        a = MatMul(x, w)
        b = my.ops.Foo(a)
        y = MatMul(b, w)
    }""")
    init(model, "w", weight())
    result = onnxmp.convert(model)
    foo = next(v for v in result.report.vertices if v.op == "my.ops:Foo")
    assert foo.color == "fp32" and "no list" in foo.cause
    foo_node = next(n for n in result.model.graph.node if n.op_type == "Foo")
    producers = {o: n.op_type for n in result.model.graph.node for o in n.output}
    assert producers[foo_node.input[0]] == "Cast"  # fed fp32 through a Cast


# 16
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_truncated_or_corrupt_file(tmp_path, damage):
    data = (MODELS / "mlp.onnx").read_bytes()
    path = tmp_path / "bad.onnx"
    path.write_bytes({"truncated": data[: len(data) // 3], "garbage": b"\x07not a model" * 50, "empty": b""}[damage])
    with pytest.raises(onnxmp.OnnxMPError) as info:
        onnxmp.convert(path)
    assert "bad.onnx" in str(info.value) and info.value.hint


# 17
def test_every_node_blocked_gives_bit_identical_outputs():
    model = onnx.load(str(MODELS / "transformer_block.onnx"))
    result = onnxmp.convert(model, block_nodes=[".*"])
    assert not result.report.changed
    inputs = dict(np.load(MODELS / "transformer_block.inputs.npz"))
    ref = ort.InferenceSession(model.SerializeToString()).run(None, inputs)
    out = ort.InferenceSession(result.model.SerializeToString()).run(None, inputs)
    for r, o in zip(ref, out):
        assert np.array_equal(r, o)
