"""The forward fusions for onnxmp's gradient builder (onnxmp.training.build.fuse): each exported
GELU subgraph becomes one com.microsoft Gelu/FastGelu, computing the same values, and only then."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnxmp.training.build.fuse import fuse_gelus
from onnxmp.training.build.prepare import prepare_for_gradient

ERF = """
  d = Div(h, c_sqrt2)
  e = Erf(d)
  p = Add(e, c_one)
  m = Mul(h, p)
  y = Mul(m, c_half)"""
ERF_DYNAMO = """
  d = Mul(h, c_inv_sqrt2)
  e = Erf(d)
  p = Add(c_one, e)
  q = Mul(c_half, p)
  y = Mul(h, q)"""
TANH = """
  half = Mul(h, c_half)
  cube = Pow(h, c_three)
  k = Mul(cube, c_cubic)
  s = Add(h, k)
  u = Mul(s, c_scale)
  t = Tanh(u)
  p = Add(t, c_one)
  y = Mul(half, p)"""
CONSTANTS = {"c_sqrt2": np.sqrt(2.0), "c_inv_sqrt2": 1 / np.sqrt(2.0), "c_one": 1.0, "c_half": 0.5, "c_three": 3.0,
             "c_cubic": 0.044715, "c_scale": np.sqrt(2 / np.pi)}


def _model(body: str, out: str = "y", **changed) -> onnx.ModelProto:
    model = onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 17]>
g (float[N,4] x) => (float[N,4] {out}) {{
  h = MatMul(x, W){body}
}}""")
    rng = np.random.default_rng(0)
    model.graph.initializer.append(numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "W"))
    for name, value in {**CONSTANTS, **changed}.items():
        model.graph.initializer.append(numpy_helper.from_array(np.array(value, np.float32), name))
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> list:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


@pytest.mark.parametrize("body, op", [(ERF, "Gelu"), (ERF_DYNAMO, "Gelu"), (TANH, "FastGelu")],
                         ids=["erf", "erf-dynamo", "tanh"])
def test_an_exported_gelu_becomes_one_node_with_the_same_values(body, op):
    model = _model(body)
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert fuse_gelus(fused) == [(op, fused.graph.node[-1].name)]
    assert [(n.op_type, n.domain) for n in fused.graph.node] == [("MatMul", ""), (op, "com.microsoft")]
    x = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32) * 2
    np.testing.assert_allclose(_run(fused, x)[0], _run(model, x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("changed", [{"c_half": 0.25}, {"out": "y, float[N,4] e"}],
                         ids=["another constant", "an intermediate read elsewhere"])
def test_a_formula_that_is_not_gelu_or_is_read_midway_stays(changed):
    model = _model(ERF, **changed)
    assert fuse_gelus(model) == [] and len(model.graph.node) == 6 and "Erf" in [n.op_type for n in model.graph.node]


def test_a_trainable_constant_is_a_parameter_not_the_formula():
    model = _model(TANH)
    assert fuse_gelus(model, ["W", "c_cubic"]) == []
    assert len(fuse_gelus(model, ["W"])) == 1


def test_only_onnxmp_builder_gets_the_fused_gelu():
    model = _model(ERF)
    ours, done = prepare_for_gradient(model, ["W"], ort_builder=False)
    assert [p.op_type for p in done] == ["Gelu"] and ours.graph.node[-1].domain == "com.microsoft"
    theirs, done = prepare_for_gradient(model, ["W"])
    assert "Gelu" not in {p.op_type for p in done} and "Erf" in [n.op_type for n in theirs.graph.node]


def test_a_low_precision_build_keeps_the_forward_its_coloring_reads():
    """float16/bfloat16: GELU stays as exported and the runtime-broadcast reads are made for
    onnxmp's builder too (they move where the conversion casts), so both builders train one forward."""
    model = _model(ERF)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    low, done = prepare_for_gradient(model, ["W", "c_half"], ort_builder=False, low_precision=True)
    theirs, want = prepare_for_gradient(model, ["W", "c_half"])
    assert "Gelu" not in {p.op_type for p in done} and "Erf" in [n.op_type for n in low.graph.node]
    assert want and sorted((p.op_type, p.action) for p in done) == sorted((p.op_type, p.action) for p in want)
