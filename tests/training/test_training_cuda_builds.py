"""Builds for target "cuda": the real float16/bfloat16 training graph, built and checked on the CPU.

Every export of the matrix (models/exports/) builds for the GPU in float16 and bfloat16, and each
graph of each build is valid (onnx.checker, strict types) and resolved by onnxruntime (types bound
as a session binds them before choosing kernels), with every standard op it holds registered by
plain onnxruntime's CUDA EP for its types (onnxmp.training.build.graph_check); the portable (lowered)
graphs, where a build writes them, with every op so registered.  A build and its checks take about a
second: the whole matrix is built, artifacts written.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxmp.errors import OnnxMPError
from onnxmp.training.build import pipeline as build_module
from onnxmp.training import build_artifacts
from onnxmp.training.build.pipeline import pow_exponents_like_bases
from onnxmp.training.build.graph_check import check_graph
from onnxmp.training.build.prepare import without_gradient

EXPORTS = Path(__file__).resolve().parents[2] / "models" / "exports"
MATRIX = json.loads((EXPORTS / "matrix.json").read_text())
ENTRIES = sorted(k for k, e in MATRIX.items() if "file" in e)
GRAPHS = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx")


def graphs_of(artifacts) -> list[str]:
    """The folder's training, eval and optimizer graphs: ORT's native ones where its builder made the
    folder, and always the portable ones (all an onnxmp-built folder holds)."""
    names = [artifacts.path(kind).name for kind in ("training_model", "eval_model", "optimizer_model")
             if kind in artifacts.manifest["files"]]
    return [*names, *(artifacts.portable_path(kind).name for kind in ("training_model", "eval_model",
                                                                        "optimizer_model"))]
# Standard ONNX ops the training graph holds that plain onnxruntime's CUDA EP has no kernel for: the
# lowering's (onnxmp.training.build.lower) to replace.  Every other standard op must have a CUDA kernel.
NO_PLAIN_CUDA_KERNEL = {"SoftmaxCrossEntropyLoss"}


def _pow_model(base: int, exponent: float, opset: int = 17) -> onnx.ModelProto:
    """``y = Pow(x, e)`` with a float32 constant exponent, as the conversion leaves it."""
    e = numpy_helper.from_array(np.array(exponent, np.float32), "e")
    graph = helper.make_graph([helper.make_node("Pow", ["x", "e"], ["y"], name="pow")], "g",
                              [helper.make_tensor_value_info("x", base, [2, 3])],
                              [helper.make_tensor_value_info("y", base, [2, 3])], [e])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _pow_inputs(model: onnx.ModelProto) -> dict[str, int]:
    inits = {t.name: t.data_type for t in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "Pow")
    return {"base": node.input[0], "exponent_type": inits.get(node.input[1], 0)}


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_an_exact_exponent_takes_its_bases_type():
    model = _pow_model(TensorProto.FLOAT16, 3.0)
    x = np.array([[0.5, -2.0, 3.0], [1.5, 7.0, -0.25]], np.float16)
    before = _run(model, x)
    done = pow_exponents_like_bases(model)
    assert [p.action for p in done] == ["exponent made float16, the type of its base"]
    assert _pow_inputs(model) == {"base": "x", "exponent_type": TensorProto.FLOAT16}
    onnx.checker.check_model(model, full_check=True)
    np.testing.assert_array_equal(_run(model, x), before)


def test_a_constant_nodes_value_float_exponent_is_read():
    model = _pow_model(TensorProto.BFLOAT16, 2.0)
    del model.graph.initializer[:]
    model.graph.node.insert(0, helper.make_node("Constant", [], ["e"], value_float=2.0))
    assert [p.action for p in pow_exponents_like_bases(model)] == ["exponent made bfloat16, the type of its base"]
    assert _pow_inputs(model)["exponent_type"] == TensorProto.BFLOAT16
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("base,exponent,opset,why", [
    (TensorProto.FLOAT16, 0.1, 17, "its exponent is not exact in float16"),
    (TensorProto.BFLOAT16, 3.0, 14, "Pow-14 takes no bfloat16 exponent"),  # bfloat16 T1 came with Pow-15
])
def test_other_pows_run_in_float32(base, exponent, opset, why):
    model = _pow_model(base, exponent, opset)
    done = pow_exponents_like_bases(model)
    assert [p.action for p in done] == [f"run in float32 ({why})"]
    ops = [(n.op_type, [a.i for a in n.attribute]) for n in model.graph.node]
    assert ops == [("Cast", [TensorProto.FLOAT]), ("Pow", []), ("Cast", [base])]
    assert model.graph.node[-1].output[0] == "y"
    onnx.checker.check_model(model, full_check=True)
    if base == TensorProto.FLOAT16:  # the CPU has no bfloat16 Pow to compare with
        x = np.array([[0.5, 2.0, 3.0], [1.5, 7.0, 0.25]], np.float16)
        np.testing.assert_array_equal(_run(model, x), _run(_pow_model(base, exponent, opset), x))


@pytest.mark.parametrize("base,exponent", [(TensorProto.FLOAT, 3.0), (TensorProto.DOUBLE, 2.0)])
def test_pows_of_other_bases_are_left_alone(base, exponent):
    model = _pow_model(base, exponent)
    if base == TensorProto.DOUBLE:
        model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(exponent), "e"))
    before = model.SerializeToString()
    assert pow_exponents_like_bases(model) == []
    assert model.SerializeToString() == before


def test_an_exponent_of_the_bases_type_is_left_alone():
    model = _pow_model(TensorProto.FLOAT16, 2.0)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(2.0, np.float16), "e"))
    assert pow_exponents_like_bases(model) == []


def _gelu_mlp(opset: int) -> onnx.ModelProto:
    """GPT-2's tanh GELU, with its x ** 3, between two trainable MatMuls."""
    text = f"""<ir_version: 8, opset_import: ["" : {opset}]>
g (float[8,4] x) => (float[8,2] y) {{
  h = MatMul(x, W)
  three = Constant<value=float {{3.0}}>()
  cube = Pow(h, three)
  k = Constant<value=float {{0.044715}}>()
  kc = Mul(k, cube)
  inner = Add(h, kc)
  c = Constant<value=float {{0.7978845608}}>()
  ci = Mul(c, inner)
  t = Tanh(ci)
  one = Constant<value=float {{1.0}}>()
  half = Constant<value=float {{0.5}}>()
  hh = Mul(half, h)
  t1 = Add(one, t)
  g1 = Mul(hh, t1)
  y = MatMul(g1, V)
}}"""
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(0)
    model.graph.initializer.extend([numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "W"),
                                    numpy_helper.from_array(rng.normal(size=(4, 2)).astype(np.float32), "V")])
    return model


@pytest.mark.parametrize("opset", [14, 17])
def test_pow_gradient_builds_in_bfloat16_for_cuda(opset, tmp_path, monkeypatch):
    model = _gelu_mlp(opset)
    built = build_artifacts(model, requires_grad=["W", "V"], precision="bfloat16", target="cuda",
                            out_dir=tmp_path / "fixed")
    assert any(row["op_type"] == "Pow" for row in built.manifest["prepared_for_gradient"])
    for name in graphs_of(built):
        assert check_graph(tmp_path / "fixed" / name).ok, name
    if built.builder != "ort":
        return
    # Without the rule, ORT's Pow gradient subtracts a bfloat16 one from the float32 exponent.
    monkeypatch.setattr(build_module, "pow_exponents_like_bases", lambda model: [])
    with pytest.raises(OnnxMPError, match="bound to different types"):
        build_artifacts(model, requires_grad=["W", "V"], precision="bfloat16", target="cuda",
                        out_dir=tmp_path / "unfixed")


def test_graph_check_names_a_type_binding_error():
    graph = helper.make_graph([helper.make_node("Sub", ["a", "b"], ["c"])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2]),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT16, [2])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])])
    check = check_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    assert not check.ok
    assert "bound to different types" in check.unresolved and "inconsistent type" in check.invalid


def test_graph_check_resolves_bfloat16_the_cpu_cannot_run():
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.BFLOAT16, [2, 2]),
                               helper.make_tensor_value_info("b", TensorProto.BFLOAT16, [2, 2])],
                              [helper.make_tensor_value_info("c", TensorProto.BFLOAT16, [2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(Exception, match="implementation"):  # the CPU EP has no bfloat16 MatMul
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    check = check_graph(model)
    assert check.ok and not check.without_kernel  # CUDA's MatMul takes bfloat16
    # CUDA's Round takes float16 but not bfloat16: a node is checked for its types, not its op alone.
    node = model.graph.node[0]
    node.op_type = "Round"
    del node.input[1:]
    assert check_graph(model).without_kernel == {"Round": 1}
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    assert check_graph(model).without_kernel == {}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_export_builds_for_cuda(entry, precision, tmp_path):
    model = onnx.load(str(EXPORTS / MATRIX[entry]["file"]))
    names = [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT]
    frozen = without_gradient(model, names)
    built = build_artifacts(model, requires_grad=[n for n in names if n not in frozen], frozen=list(frozen),
                            precision=precision, target="cuda", out_dir=tmp_path / "a")
    graphs = sorted(p.name for p in (tmp_path / "a").glob("*.onnx") if p.name != "forward_model.onnx")
    assert set(graphs_of(built)) == set(graphs)
    for name in graphs:
        check = check_graph(tmp_path / "a" / name)
        assert check.invalid is None, f"{name}: {check.invalid}"
        assert check.unresolved is None, f"{name}: {check.unresolved}"
        if ".portable." in name:  # lowered: what plain onnxruntime runs, every op registered by plain CUDA
            assert not check.without_kernel, f"{name}: no plain CUDA kernel for {dict(check.without_kernel)}"
        else:
            standard = set(check.standard_without_kernel)
            assert standard <= NO_PLAIN_CUDA_KERNEL, f"{name}: no plain CUDA kernel for {sorted(standard)}"
