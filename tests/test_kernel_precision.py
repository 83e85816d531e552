"""Precision by what the target's kernel computes (docs/coloring.md: kernel facts, fused kernels,
mask fills): decomposed normalizations colored as the float32 kernel ORT fuses them into, attention
mask fills that keep attention in low precision, and no Cast where ORT fuses or back to back."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxmp
from onnxmp.fusions import GraphFacts, fused_norms, gelus
from onnxmp.parity.emulate import emulate
from onnxmp.runtime import session_options

ROOT = Path(__file__).resolve().parent.parent
FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
H = 16


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), session_options(emulated=True),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def block(opset: int = 14, layer_norm: str = "decomposed", extra_reader: bool = False) -> onnx.ModelProto:
    """x -> MatMul -> Add(residual) -> LayerNorm -> MatMul -> y, the LayerNorm decomposed (as torch
    exports it below opset 17) or the op; ``extra_reader``: the residual sum is also read by a
    float32-only op (ReduceSum, deny) whose result is an output."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((H, H)).astype(np.float32) / 4, "w1"),
             numpy_helper.from_array(rng.standard_normal((H, H)).astype(np.float32) / 4, "w2"),
             numpy_helper.from_array(np.linspace(0.5, 1.5, H).astype(np.float32), "gamma"),
             numpy_helper.from_array(np.linspace(-0.1, 0.1, H).astype(np.float32), "beta")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "x"], ["r"], name="residual")]
    if layer_norm == "op":
        nodes.append(helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["n"], name="ln", axis=-1,
                                      epsilon=1e-5))
    else:
        inits += [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                  numpy_helper.from_array(np.array(1e-5, np.float32), "eps")]
        nodes += [helper.make_node("ReduceMean", ["r"], ["mean"], name="ln/mean", axes=[-1]),
                  helper.make_node("Sub", ["r", "mean"], ["d"], name="ln/sub"),
                  helper.make_node("Pow", ["d", "two"], ["d2"], name="ln/pow"),
                  helper.make_node("ReduceMean", ["d2"], ["var"], name="ln/var", axes=[-1]),
                  helper.make_node("Add", ["var", "eps"], ["vare"], name="ln/add_eps"),
                  helper.make_node("Sqrt", ["vare"], ["std"], name="ln/sqrt"),
                  helper.make_node("Div", ["d", "std"], ["nd"], name="ln/div"),
                  helper.make_node("Mul", ["nd", "gamma"], ["ng"], name="ln/scale"),
                  helper.make_node("Add", ["ng", "beta"], ["n"], name="ln/bias")]
    nodes.append(helper.make_node("MatMul", ["n", "w2"], ["y"], name="mm2"))
    outputs = [helper.make_tensor_value_info("y", FLOAT, [2, 4, H])]
    if extra_reader:
        nodes.append(helper.make_node("ReduceSum", ["r"], ["total"], name="total", keepdims=0))
        outputs.append(helper.make_tensor_value_info("total", FLOAT, []))
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", FLOAT, [2, 4, H])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _colors(report) -> dict[str, tuple[str, str]]:
    return {v.node: (v.color, v.rule) for v in report.vertices}


@pytest.mark.parametrize("opset", [14, 17])
def test_a_decomposed_layer_norm_is_colored_as_the_float32_kernel_ort_fuses_it_into(opset):
    result = onnxmp.convert(block(opset))
    colors = _colors(result.report)
    for name in ("ln/mean", "ln/sub", "ln/pow", "ln/var", "ln/add_eps", "ln/sqrt", "ln/div"):
        assert colors[name][0] == "fp32" and colors[name][1] == "not_processed"
    assert colors["ln/scale"][0] == colors["ln/bias"][0] == colors["residual"][0] == "allow"
    cause = next(v.cause for v in result.report.vertices if v.node == "ln/var")
    assert "LayerNormalization kernel ORT fuses" in cause and "layer_norm_impl.cu" in cause
    # The converted graph is again one fusable LayerNorm, its Casts absorbed: ORT runs one kernel
    # on the float16 residual sum, and nothing is Cast back and forth around it.
    norm, = fused_norms(GraphFacts(result.model.graph))
    assert len(norm.casts) == 2 and result.report.casts_inserted == 4  # + the graph's own input and output
    types = {v.name: v.type.tensor_type.elem_type for v in (*result.model.graph.value_info, *result.model.graph.input)}
    scale = {t.name: t.data_type for t in result.model.graph.initializer}[norm.scale]
    assert types[norm.input] == scale == FLOAT16 and types[norm.output] == FLOAT16


def test_the_statistics_read_the_input_through_a_cast_of_their_own():
    """A Cast the fusion absorbs must be read by the statistics alone: with no other float32
    reader of the input, the statistics read a Cast of their own."""
    result = onnxmp.convert(block())
    norm, = fused_norms(GraphFacts(result.model.graph))
    assert len(norm.casts) == 2 and norm.input == "r"


@pytest.mark.parametrize("opset", [14, 17])
def test_a_layer_norm_whose_input_is_also_read_in_float32_stays_float32_on_the_shared_copy(opset):
    # The residual sum is low and also read by a float32 ReduceSum.  A Cast of the statistics' own
    # beside the ReduceSum's would be merged with it by onnxruntime (1.32), whose fusion then reads
    # the float32 copy with a float16 scale and refuses the model (opset 17).  The normalization
    # stays float32 instead and reads the one float32 copy: loads, and one Cast fewer.
    result = onnxmp.convert(block(opset, extra_reader=True))
    colors = _colors(result.report)
    assert colors["residual"][0] == "allow"
    assert colors["ln/scale"] == colors["ln/bias"] == ("deny", "follow_input_in_fused_normalizations")
    assert "merges the two float32 copies" in next(v.cause for v in result.report.vertices if v.node == "ln/scale")
    assert [n.input[0] for n in result.model.graph.node if n.op_type == "Cast"].count("r") == 1
    ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_the_affine_tail_takes_the_precision_of_the_normalized_input():
    # The input is a graph input kept float32: the whole LayerNorm stays float32 (a float32 input
    # with a float16 scale would be a type error for LayerNormalization-17).
    model = block(17)
    graph = model.graph
    graph.node.remove(next(n for n in graph.node if n.name == "residual"))
    for node in graph.node:
        node.input[:] = ["x" if name == "r" else name for name in node.input]
    colors = _colors(onnxmp.convert(model).report)
    assert colors["ln/scale"][0] != "allow" and colors["ln/bias"][0] != "allow"


def test_a_scale_that_must_stay_float32_keeps_the_input_float32_too():
    model = block(17)  # the residual sum also feeds a MatMul: TF's rules put it in float16
    model.graph.node.append(helper.make_node("MatMul", ["r", "w1"], ["y2"], name="mm3"))
    model.graph.output.append(helper.make_tensor_value_info("y2", FLOAT, None))
    result = onnxmp.convert(model, block_nodes=["^ln/scale$"])
    colors = _colors(result.report)
    assert colors["residual"] == ("deny", "follow_input_in_fused_normalizations")
    assert colors["ln/bias"][0] != "allow"
    norm, = fused_norms(GraphFacts(result.model.graph))
    types = {v.name: v.type.tensor_type.elem_type for v in result.model.graph.value_info}
    assert types.get(norm.input, FLOAT) == FLOAT


def test_emulation_computes_a_decomposed_layer_norm_as_the_fused_kernel_does():
    """Converted at opset 14 (decomposed) and 17 (the op), the emulated outputs agree: both are one
    float32 LayerNorm kernel rounding once."""
    x = np.random.default_rng(1).standard_normal((2, 4, H)).astype(np.float32) * 3
    out14 = _run(emulate(onnxmp.convert(block(14)).model), {"x": x})[0]
    out17 = _run(emulate(onnxmp.convert(block(17, layer_norm="op")).model), {"x": x})[0]
    np.testing.assert_allclose(out14, out17, rtol=0, atol=2e-3 * np.abs(out17).max())
    reference = _run(block(14), {"x": x})[0]
    np.testing.assert_allclose(out14, reference, rtol=0, atol=1e-2 * np.abs(reference).max())


# --- mask fills ------------------------------------------------------------------------------

def attention(fill: float = float(np.finfo(np.float32).min), form: str = "mul", masks: int = 1,
              seq: int = 6) -> onnx.ModelProto:
    """Scores of q and k, an additive mask (``form``: "mul" for (1 - m) * fill, "where" for
    Where(m, 0, fill), "masked_fill" for Where(m == 0, fill, scores)), Softmax, then the values."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((H, H)).astype(np.float32) / 4, n) for n in ("wq", "wk", "wv")]
    inits += [numpy_helper.from_array(np.array(fill, np.float32), "fill"),
              numpy_helper.from_array(np.array(1.0, np.float32), "one"),
              numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
              numpy_helper.from_array(np.array([1], np.int64), "axes12")]
    nodes = [helper.make_node("MatMul", ["x", w], [n], name=n) for w, n in (("wq", "q"), ("wk", "k"), ("wv", "v"))]
    nodes += [helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
              helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk")]
    added = "scores"
    for i in range(masks):
        m = f"m{i}"
        nodes.append(helper.make_node("Unsqueeze", [f"mask{i}", "axes12"], [f"{m}u"], name=f"{m}u"))
        if form == "masked_fill":
            nodes += [helper.make_node("Equal", [f"{m}u", "zero_i"], [f"{m}z"], name=f"{m}z"),
                      helper.make_node("Where", [f"{m}z", "fill", added], [f"{m}filled"], name=f"{m}where")]
            added = f"{m}filled"
            continue
        nodes.append(helper.make_node("Cast", [f"{m}u"], [f"{m}f"], name=f"{m}f", to=FLOAT))
        if form == "mul":
            nodes += [helper.make_node("Sub", ["one", f"{m}f"], [f"{m}inv"], name=f"{m}inv"),
                      helper.make_node("Mul", [f"{m}inv", "fill"], [f"{m}add"], name=f"{m}mul")]
        else:
            nodes += [helper.make_node("Cast", [f"{m}u"], [f"{m}b"], name=f"{m}b", to=TensorProto.BOOL),
                      helper.make_node("Where", [f"{m}b", "zero", "fill"], [f"{m}add"], name=f"{m}where")]
        if i:
            nodes.append(helper.make_node("Add", ["m0add", f"{m}add"], [f"sum{i}"], name=f"masksum{i}"))
    if form != "masked_fill":
        total = f"sum{masks - 1}" if masks > 1 else "m0add"
        nodes.append(helper.make_node("Add", ["scores", total], ["masked"], name="addmask"))
        added = "masked"
    nodes += [helper.make_node("Softmax", [added], ["p"], name="softmax", axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    if form == "masked_fill":
        inits.append(numpy_helper.from_array(np.array(0, np.int64), "zero_i"))
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("x", FLOAT, [2, seq, H])] + [
        helper.make_tensor_value_info(f"mask{i}", TensorProto.INT64, [2, seq]) for i in range(masks)],
        [helper.make_tensor_value_info("y", FLOAT, [2, seq, H]), helper.make_tensor_value_info("p", FLOAT, [2, seq, seq])],
        inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)  # bfloat16 Where: 16+


def _masks(count: int, seq: int = 6) -> dict[str, np.ndarray]:
    """Row 0 partly masked, row 1 fully masked, in every mask."""
    mask = np.ones((2, seq), np.int64)
    mask[0, seq // 2:] = 0
    mask[1, :] = 0
    return {f"mask{i}": mask for i in range(count)}


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
@pytest.mark.parametrize("form", ["mul", "where", "masked_fill"])
@pytest.mark.parametrize("fill", [float(np.finfo(np.float32).min), -1e9])
def test_a_mask_fill_keeps_attention_in_low_precision_and_softmax_within_rounding(form, fill, precision):
    model = attention(fill, form)
    result = onnxmp.convert(model, precision=precision)
    colors = _colors(result.report)
    assert colors["softmax"][0] == "allow" and colors["pv"][0] == "allow"
    if precision == "bfloat16" and fill == -1e9:
        assert not result.report.mask_fills  # it fits bfloat16's range: nothing to replace
    else:
        row, = result.report.mask_fills
        assert row.constant == "fill" and row.original == pytest.approx(fill) and row.softmaxes == ["softmax"]
        assert row.value == (-49152.0 if precision == "float16" else -1.5 * 2.0 ** 127)
    x = np.random.default_rng(3).standard_normal((2, 6, H)).astype(np.float32)
    feeds = {"x": x, **_masks(1)}
    reference = _run(model, feeds)
    got = _run(emulate(result.model, precision), feeds)
    for ref, out in zip(reference, got):
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, rtol=0, atol=(4e-3 if precision == "float16" else 3e-2) * np.abs(ref).max())
    probabilities = got[1]
    np.testing.assert_allclose(probabilities[1], 1 / 6, atol=1e-3)  # a fully masked row: uniform, as in float32
    np.testing.assert_array_equal(probabilities[0][:, 3:], 0)         # masked keys weigh nothing


def test_two_masks_added_do_not_overflow():
    result = onnxmp.convert(attention(masks=2))
    assert {row.value for row in result.report.mask_fills} == {-24576.0}
    got = _run(emulate(result.model), {"x": np.ones((2, 6, H), np.float32), **_masks(2)})
    assert np.isfinite(got[1]).all() and np.allclose(got[1][1], 1 / 6, atol=1e-3)


def test_a_large_constant_read_beyond_the_softmax_is_no_mask_fill():
    model = attention()
    model.graph.node.append(helper.make_node("Mul", ["x", "fill"], ["scaled"], name="scaled"))
    model.graph.output.append(helper.make_tensor_value_info("scaled", FLOAT, None))
    result = onnxmp.convert(model)
    assert not result.report.mask_fills
    colors = _colors(result.report)
    assert colors["m0mul"] == ("deny", "seed_deny_from_initializer_range")


def test_a_fill_on_a_path_kept_float32_is_left_as_it_is():
    result = onnxmp.convert(attention(), level="treat_infer_as_deny")
    assert not result.report.mask_fills
    fill = next(t for t in result.model.graph.initializer if t.name == "fill")
    assert numpy_helper.to_array(fill) == np.finfo(np.float32).min


def test_calibration_magnitudes_on_a_mask_path_seed_nothing():
    feeds = {"x": np.random.default_rng(4).standard_normal((2, 6, H)).astype(np.float32), **_masks(1)}
    report = onnxmp.explain(attention(), calibration=[feeds])
    colors = _colors(report)
    assert colors["addmask"][0] == "allow" and colors["softmax"][0] == "allow"


# --- no Cast where ORT fuses, none back to back ------------------------------------------------

def _cast_pairs(model: onnx.ModelProto) -> set[tuple[str, str]]:
    producer = {out: node for node in model.graph.node for out in node.output}
    return {(producer[n.input[0]].name, n.name) for n in model.graph.node
            if n.op_type == "Cast" and n.input[0] in producer and producer[n.input[0]].op_type == "Cast"}


def _models() -> list[Path]:
    return sorted((ROOT / "models" / "exports").glob("*.onnx")) + sorted((ROOT / "models").glob("*.onnx"))


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
@pytest.mark.parametrize("path", _models(), ids=lambda p: p.stem)
def test_no_cast_breaks_a_fusion_and_none_follows_another(path, precision):
    model = onnx.load(path)
    converted = onnxmp.convert(model, precision=precision).model
    before, after = GraphFacts(model.graph), GraphFacts(converted.graph)
    assert len(fused_norms(after)) == len(fused_norms(before))
    if precision == "float16":  # ORT's GeluFusion takes no bfloat16 constant
        assert len(gelus(after)) == len(gelus(before))
    assert _cast_pairs(converted) <= _cast_pairs(model)


def test_an_identity_cast_passes_colors_through_and_is_cast_around_by_its_source():
    """torch's ``.to(torch.float32)`` of a float32 tensor (T5's RMSNorm): a clear op."""
    model = block(14)
    graph = model.graph
    for node in graph.node:
        node.input[:] = ["rc" if name == "r" and node.name.startswith("ln/") else name for name in node.input]
    position = [n.name for n in graph.node].index("residual") + 1
    graph.node.insert(position, helper.make_node("Cast", ["r"], ["rc"], name="identity", to=FLOAT))
    graph.node.append(helper.make_node("MatMul", ["rc", "w1"], ["y2"], name="mm3"))  # as T5's residual stream
    graph.output.append(helper.make_tensor_value_info("y2", FLOAT, None))
    result = onnxmp.convert(model)
    colors = _colors(result.report)
    assert colors["identity"][0] == "allow" and colors["ln/scale"][0] == "allow"
    assert not _cast_pairs(result.model)
