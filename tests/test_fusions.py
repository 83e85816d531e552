"""onnxmp.fusions against onnxruntime's own fusions.

The fp32 forms are checked against what onnxruntime 1.19.2 fuses on the CPU (the same
LayerNormFusion code serves the CUDA EP); the forms with Casts absorb only on a GPU, so they
are checked against the conditions of ORT's source that onnxmp.fusions restates.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxmp.fusions import GraphFacts, fused_norms, gelus, layer_norms, simplified_layer_norms, skip_layer_norm_adds
from onnxmp.normalize import normalize

ROOT = Path(__file__).resolve().parent.parent
FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
FUSED_OPS = ("LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
             "SkipSimplifiedLayerNormalization")


def ort_fused(model: onnx.ModelProto) -> tuple[list[str], set[str]]:
    """The normalization nodes onnxruntime's CPU session makes at ORT_ENABLE_EXTENDED, and the
    names of the nodes left."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
        options.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath)
    return [n.op_type for n in optimized.graph.node if n.op_type in FUSED_OPS], {n.name for n in optimized.graph.node}


def layer_norm_model(form: str = "torch", opset: int = 14, hidden: int = 8) -> onnx.ModelProto:
    """A decomposed LayerNorm on [2, 4, hidden] in one of the forms exporters write."""
    g = []
    inits = [numpy_helper.from_array(np.linspace(0.5, 1.5, hidden).astype(np.float32), "gamma"),
             numpy_helper.from_array(np.linspace(-0.1, 0.1, hidden).astype(np.float32), "beta"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1e-5, np.float32), "eps")]
    wanted = [2] if form == "positive axis" else [-2, -1] if form == "two axes" else [-1]
    axes = {"axes": wanted} if opset < 18 else {}
    reduce_inputs = (lambda x: [x]) if opset < 18 else (lambda x: [x, "axes"])
    if opset >= 18:
        inits.append(numpy_helper.from_array(np.array(wanted, np.int64), "axes"))
    g.append(helper.make_node("ReduceMean", reduce_inputs("x"), ["mean"], name="mean", **axes))
    g.append(helper.make_node("Sub", ["x", "mean"], ["d"], name="sub"))
    if form == "square by Mul":
        g.append(helper.make_node("Mul", ["d", "d"], ["d2"], name="square"))
    else:
        g.append(helper.make_node("Pow", ["d", "two"], ["d2"], name="pow"))
    g.append(helper.make_node("ReduceMean", reduce_inputs("d2"), ["var"], name="var", **axes))
    g.append(helper.make_node("Add", ["var", "eps"], ["vare"], name="add_eps"))
    g.append(helper.make_node("Sqrt", ["vare"], ["std"], name="sqrt"))
    if form == "reciprocal":
        g.append(helper.make_node("Reciprocal", ["std"], ["rstd"], name="recip"))
        g.append(helper.make_node("Mul", ["d", "rstd"], ["n"], name="div"))
    else:
        g.append(helper.make_node("Div", ["d", "std"], ["n"], name="div"))
    g.append(helper.make_node("Mul", ["n", "gamma"], ["ng"], name="scale"))
    g.append(helper.make_node("Add", ["ng", "beta"], ["y"], name="bias"))
    outputs = [helper.make_tensor_value_info("y", FLOAT, [2, 4, hidden])]
    if form == "difference read elsewhere":
        g.append(helper.make_node("Relu", ["d"], ["r"], name="other"))
        outputs.append(helper.make_tensor_value_info("r", FLOAT, [2, 4, hidden]))
    if form == "transposed input":
        g.insert(0, helper.make_node("Transpose", ["x_in"], ["x"], name="transpose", perm=[0, 2, 1]))
        inputs = [helper.make_tensor_value_info("x_in", FLOAT, [2, hidden, 4])]
    else:
        inputs = [helper.make_tensor_value_info("x", FLOAT, [2, 4, hidden])]
    model = helper.make_model(helper.make_graph(g, "ln", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return normalize(model).index.model


def rms_model(form: str = "div") -> onnx.ModelProto:
    """T5's RMSNorm on [2, 4, 8]: x * rsqrt(mean(x^2) + eps) * gamma."""
    inits = [numpy_helper.from_array(np.linspace(0.5, 1.5, 8).astype(np.float32), "gamma"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    g = [helper.make_node("Pow", ["x", "two"], ["x2"], name="pow"),
         helper.make_node("ReduceMean", ["x2"], ["ms"], name="mean", axes=[-1]),
         helper.make_node("Add", ["ms", "eps"], ["mse"], name="add_eps"),
         helper.make_node("Sqrt", ["mse"], ["rms"], name="sqrt")]
    if form == "div":
        g.append(helper.make_node("Div", ["x", "rms"], ["n"], name="div"))
    elif form == "one over":
        g += [helper.make_node("Div", ["one", "rms"], ["inv"], name="div"),
              helper.make_node("Mul", ["x", "inv"], ["n"], name="times")]
    else:
        g += [helper.make_node("Reciprocal", ["rms"], ["inv"], name="recip"),
              helper.make_node("Mul", ["x", "inv"], ["n"], name="times")]
    g.append(helper.make_node("Mul", ["gamma", "n"], ["y"], name="scale"))
    model = helper.make_model(helper.make_graph(g, "rms", [helper.make_tensor_value_info("x", FLOAT, [2, 4, 8])],
                                                [helper.make_tensor_value_info("y", FLOAT, [2, 4, 8])], inits),
                              opset_imports=[helper.make_opsetid("", 14)], ir_version=8)
    return normalize(model).index.model


LAYER_NORM_FORMS = {  # form -> whether ORT fuses it
    "torch": True, "positive axis": True, "square by Mul": False, "reciprocal": False, "two axes": False,
    "difference read elsewhere": False, "transposed input": False,
}


@pytest.mark.parametrize("opset", [14, 17, 18])
@pytest.mark.parametrize("form", list(LAYER_NORM_FORMS))
def test_layer_norm_forms_match_exactly_what_onnxruntime_fuses(form, opset):
    model = layer_norm_model(form, opset)
    ours = layer_norms(GraphFacts(model.graph))
    fused, _ = ort_fused(model)
    assert len(ours) == int(LAYER_NORM_FORMS[form])
    assert ("LayerNormalization" in fused) == LAYER_NORM_FORMS[form] or form == "transposed input"
    if ours:
        norm, = ours
        assert norm.input == "x" and norm.output == "y" and norm.scale == "gamma" and norm.bias == "beta"
        assert norm.epsilon == pytest.approx(1e-5) and norm.affine == ("scale", "bias")


@pytest.mark.parametrize("form, fuses", [("div", True), ("one over", True), ("reciprocal", False)])
def test_rms_norm_forms_match_exactly_what_onnxruntime_fuses(form, fuses):
    model = rms_model(form)
    ours = simplified_layer_norms(GraphFacts(model.graph))
    fused, _ = ort_fused(model)
    assert len(ours) == int(fuses) and ("SimplifiedLayerNormalization" in fused) == fuses
    if ours:
        assert ours[0].input == "x" and ours[0].affine == ("scale",) and ours[0].bias is None


def _exports() -> list[Path]:
    return sorted((ROOT / "models" / "exports").glob("*.onnx")) + sorted((ROOT / "models").glob("*.onnx"))


@pytest.mark.parametrize("path", _exports(), ids=lambda p: p.stem)
def test_every_normalization_matched_in_a_real_export_is_fused_by_onnxruntime(path):
    """No false positive on the real exports: each unit counted is one ORT makes (ORT may fuse a
    few more, the tail of a LayerNorm its transpose optimizer rearranged: swin, wav2vec2)."""
    model = normalize(onnx.load(path)).index.model
    norms = fused_norms(GraphFacts(model.graph))
    fused, left = ort_fused(model)
    for norm in norms:
        assert not left.intersection(norm.statistics), f"{norm.kind} of {norm.affine} left unfused"
    declared = sum(n.op_type == "LayerNormalization" for n in model.graph.node)
    assert len(norms) + declared <= len(fused)
    if path.stem not in ("swin.torchscript14", "wav2vec2.torchscript14"):
        assert len(norms) + declared == len(fused)


def _skip_adds(model: onnx.ModelProto) -> dict[str, str]:
    facts = GraphFacts(model.graph)
    norms = {norm.input: (norm.output, norm.nodes) for norm in fused_norms(facts) if norm.kind == "LayerNormalization"}
    norms.update((n.input[0], (n.output[0], (n.name,))) for n in model.graph.node if n.op_type == "LayerNormalization")
    return skip_layer_norm_adds(facts, norms)


@pytest.mark.parametrize("path", _exports(), ids=lambda p: p.stem)
def test_skip_layer_norm_adds_are_exactly_those_onnxruntime_fuses(path):
    """SkipLayerNormFusion runs on the CPU EP too: on the float32 exports its count must match,
    the embeddings' broadcast Add (a [1, S, H] position table) and pre-LN residuals left out."""
    model = normalize(onnx.load(path)).index.model
    fused, _ = ort_fused(model)
    assert len(_skip_adds(model)) == fused.count("SkipLayerNormalization")


def residual_layer_norm(skip_shape=(2, 4, 8), reuse: bool = False, fused: bool = False) -> onnx.ModelProto:
    """``Add(x, skip) -> LayerNorm`` (decomposed, or one LayerNormalization-17 node with ``fused``)."""
    model = layer_norm_model("torch", 17)
    g = model.graph
    for node in g.node:
        node.input[:] = ["sum" if name == "x" else name for name in node.input]
    g.node.insert(0, helper.make_node("Add", ["x", "skip"], ["sum"], name="residual"))
    g.input.append(helper.make_tensor_value_info("skip", FLOAT, list(skip_shape)))
    if fused:
        kept = [n for n in g.node if n.name == "residual"]
        kept.append(helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], name="ln", axis=-1))
        del g.node[:]
        g.node.extend(kept)
        kept_inits = [t for t in g.initializer if t.name in ("gamma", "beta")]
        del g.initializer[:]
        g.initializer.extend(kept_inits)
    if reuse:
        g.node.append(helper.make_node("Add", ["sum", "y"], ["next"], name="next_residual"))
        g.output.append(helper.make_tensor_value_info("next", FLOAT, [2, 4, 8]))
    del g.value_info[:]
    return normalize(model).index.model


@pytest.mark.parametrize("case, fuses", [({}, True), ({"fused": True}, True), ({"reuse": True}, False),
                                         ({"reuse": True, "fused": True}, False),
                                         ({"skip_shape": (1, 4, 8)}, False), ({"skip_shape": (8,)}, False)])
def test_skip_layer_norm_add_fires_only_on_a_sole_same_shape_3d_residual(case, fuses):
    model = residual_layer_norm(**case)
    fused, _ = ort_fused(model)
    assert fused.count("SkipLayerNormalization") == int(fuses)  # what ORT does
    assert list(_skip_adds(model)) == (["residual"] if fuses else [])


def autocast_form(scale_type: int, cast_after_bias: bool = False) -> onnx.ModelProto:
    """torch.autocast's LayerNorm on a float16 input: x16 -> Cast(f32) -> statistics -> Div ->
    [Cast(f16) ->] Mul(gamma) -> Add(beta) [-> Cast(f16)]."""
    model = layer_norm_model("torch", 17)
    g = model.graph
    for node in g.node:
        node.input[:] = ["x32" if name == "x" else name for name in node.input]
    g.node.insert(0, helper.make_node("Cast", ["x"], ["x32"], name="to_float", to=FLOAT))
    g.input[0].type.tensor_type.elem_type = FLOAT16
    if scale_type == FLOAT16:
        div = next(n for n in g.node if n.name == "div")
        div.output[0] = "n32"
        position = [n.name for n in g.node].index("div") + 1
        g.node.insert(position, helper.make_node("Cast", ["n32"], ["n"], name="to_half", to=FLOAT16))
        for t in g.initializer:
            if t.name in ("gamma", "beta"):
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
        g.output[0].type.tensor_type.elem_type = FLOAT16
    if cast_after_bias:
        bias = next(n for n in g.node if n.name == "bias")
        bias.output[0] = "y32"
        g.node.append(helper.make_node("Cast", ["y32"], ["y"], name="out_half", to=FLOAT16))
        g.output[0].type.tensor_type.elem_type = FLOAT16
    del g.value_info[:]
    return normalize(model).index.model


def test_the_autocast_form_fuses_with_both_casts_absorbed():
    """layer_norm_fusion.cc: a leading Cast read only by ReduceMean and Sub, and Div -> Cast -> Mul,
    are absorbed: one LayerNormalization reads the float16 input and writes float16."""
    norm, = layer_norms(GraphFacts(autocast_form(FLOAT16).graph))
    assert norm.input == "x" and norm.output == "y" and norm.casts == ("to_float", "to_half")


def test_a_cast_after_the_bias_is_not_absorbed():
    norm, = layer_norms(GraphFacts(autocast_form(FLOAT, cast_after_bias=True).graph))
    assert norm.casts == ("to_float",) and norm.output == "y32"


def test_a_leading_cast_read_elsewhere_is_not_absorbed():
    model = autocast_form(FLOAT16)
    model.graph.node.append(helper.make_node("Relu", ["x32"], ["r"], name="other"))
    model.graph.output.append(helper.make_tensor_value_info("r", FLOAT, None))
    norm, = layer_norms(GraphFacts(model.graph))
    assert norm.input == "x32" and norm.casts == ("to_half",)


def gelu_model(constant_type: int) -> onnx.ModelProto:
    dtype = {FLOAT: np.float32, FLOAT16: np.float16}[constant_type]
    inits = [numpy_helper.from_array(np.array(v, dtype), n) for v, n in ((1.4142099618911743, "root2"), (1.0, "one"),
                                                                        (0.5, "half"))]
    g = [helper.make_node("Div", ["x", "root2"], ["a"], name="div"), helper.make_node("Erf", ["a"], ["b"], name="erf"),
         helper.make_node("Add", ["b", "one"], ["c"], name="add"), helper.make_node("Mul", ["x", "c"], ["d"], name="mul"),
         helper.make_node("Mul", ["d", "half"], ["y"], name="half")]
    t = constant_type
    return helper.make_model(helper.make_graph(g, "gelu", [helper.make_tensor_value_info("x", t, [2, 8])],
                                               [helper.make_tensor_value_info("y", t, [2, 8])], inits),
                             opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


@pytest.mark.parametrize("constant_type", [FLOAT, FLOAT16])
def test_erf_gelu_matches_with_float32_and_float16_constants(constant_type):
    """optimizer_utils::IsInitializerWithExpectedValue compares a float16 constant with the
    expected value rounded to float16."""
    assert gelus(GraphFacts(gelu_model(constant_type).graph)) == [("div", "erf", "add", "mul", "half")]
