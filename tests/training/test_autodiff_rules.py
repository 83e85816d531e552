"""Every gradient rule of onnxmp's builder (``VJP_RULES``), on the small graphs of autodiff_cases:

- in float64, against central finite differences of the loss (onnx's reference evaluator runs
  both the forward and the gradient graph);
- in float32, run by onnxruntime (the runtime is the judge), against the float64 gradient;
- on Python 3.11, against onnxruntime-training 1.19.2's own gradient builder, where it has one.

A rule without a case fails ``test_every_rule_has_a_case``.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_conv_transpose import ConvTranspose as _ReferenceConvTranspose

from onnxmp.training.build.autodiff import VJP_RULES, backward

sys.path.insert(0, str(Path(__file__).parent))
from autodiff_cases import CASES, MS, Case  # noqa: E402
from builders import needs_training_build  # noqa: E402

LOSS = "loss"
_erf = np.vectorize(math.erf)


def _gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class Erf(OpRun):
    # onnx's reference Erf computes in float32
    def _run(self, x):
        return (_erf(x).astype(x.dtype),)


class Gelu(OpRun):
    # com.microsoft's, and onnx's Gelu-20 (the evaluator takes this class for both)
    def _run(self, x, approximate="none"):
        return ((_gelu_tanh(x) if approximate == "tanh" else _gelu(x)).astype(x.dtype),)


class MsGelu(Gelu):
    op_domain = MS


MsGelu.__name__ = "Gelu"


class FastGelu(OpRun):
    op_domain = MS

    def _run(self, x, bias=None):
        return (_gelu_tanh(x if bias is None else x + bias).astype(x.dtype),)


class BiasGelu(OpRun):
    op_domain = MS

    def _run(self, x, bias):
        return (_gelu(x + bias).astype(x.dtype),)


class FusedMatMul(OpRun):
    op_domain = MS

    def _run(self, a, b, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):  # noqa: N803
        a = np.swapaxes(a, -1, -2) if transA else a
        b = np.swapaxes(b, -1, -2) if transB else b
        return ((alpha * np.matmul(a, b)).astype(a.dtype),)


class ConvTranspose(_ReferenceConvTranspose):
    # onnx's reference splits a grouped ConvTranspose's weight by output channels (and adds the
    # whole bias to each group): here each group's slices run through its ungrouped path
    def _run(self, X, W, B=None, group=None, **attrs):  # noqa: N803
        group = group or 1
        xs, ws = np.split(X, group, axis=1), np.split(W, group, axis=0)
        y = np.concatenate([super(ConvTranspose, self)._run(x, w, None, group=1, **attrs)[0]
                            for x, w in zip(xs, ws)], axis=1)
        if B is not None:
            y = y + B.reshape(1, -1, *[1] * (y.ndim - 2))
        return (y.astype(X.dtype),)


CUSTOM = [Erf, Gelu, MsGelu, FastGelu, BiasGelu, FusedMatMul, ConvTranspose]


class Evaluator:
    """onnxruntime where it has kernels for the model's types (float64 included), else onnx's
    reference evaluator (whose Softmax-11, ScatterElements and grouped Conv fall short elsewhere)."""

    def __init__(self, model: onnx.ModelProto):
        try:
            self.session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            self.reference = None
        except Exception:  # no kernel for a float64 op: NOT_IMPLEMENTED
            self.session = None
            self.reference = ReferenceEvaluator(model, new_ops=CUSTOM)

    def run(self, outputs: list[str], feeds: dict) -> list[np.ndarray]:
        if self.session is not None:
            return self.session.run(outputs, feeds)
        return self.reference.run(outputs, feeds)


def reference(model: onnx.ModelProto, feeds: dict, outputs: list[str]) -> list[np.ndarray]:
    return Evaluator(model).run(outputs, feeds)


def with_loss(case: Case, dtype) -> tuple[onnx.ModelProto, dict, list[str]]:
    """The case's model with ``loss = sum_k sum(y_k * w_k)``, w_k fixed random weights."""
    model, feeds, wrt = case.model(dtype)
    model64, feeds64, _ = case.model(np.float64)
    shapes = [y.shape for y in reference(model64, feeds64, list(case.outputs))]
    rng = np.random.default_rng(42)
    graph = model.graph
    terms = []
    for out, shape in zip(case.outputs, shapes):
        weight = numpy_helper.from_array(rng.uniform(-1, 1, shape).astype(dtype), f"{out}_weight")
        graph.initializer.append(weight)
        graph.node.extend([helper.make_node("Mul", [out, weight.name], [f"{out}_weighted"]),
                           helper.make_node("ReduceSum", [f"{out}_weighted"], [f"{out}_sum"], keepdims=0)])
        terms.append(f"{out}_sum")
    # Adds, not one Sum: onnxruntime-training has no gradient for Sum.
    total = terms[0]
    for k, term in enumerate(terms[1:]):
        graph.node.append(helper.make_node("Add", [total, term], [f"loss_part{k}"]))
        total = f"loss_part{k}"
    graph.node.append(helper.make_node("Identity", [total], [LOSS]))
    graph.output.append(helper.make_tensor_value_info(LOSS, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), []))
    return model, feeds, wrt


def finite_differences(model: onnx.ModelProto, feeds: dict, name: str, h: float = 1e-6) -> np.ndarray:
    session = Evaluator(model)
    value = feeds[name]
    grad = np.zeros_like(value)
    for index in np.ndindex(value.shape):
        moved = []
        for step in (h, -h):
            shifted = value.copy()
            shifted[index] += step
            moved.append(float(session.run([LOSS], {**feeds, name: shifted})[0]))
        grad[index] = (moved[0] - moved[1]) / (2 * h)
    return grad


def relative(want: np.ndarray, got: np.ndarray) -> float:
    assert want.shape == got.shape, (want.shape, got.shape)
    scale = max(float(np.abs(want).max()) if want.size else 0.0, 1e-12)
    return float(np.abs(want - got).max()) / scale if want.size else 0.0


def float64_gradients(case: Case) -> dict[str, np.ndarray]:
    model, feeds, wrt = with_loss(case, np.float64)
    grad_model, _ = backward(model, LOSS, wrt)
    return dict(zip(wrt, reference(grad_model, feeds, [f"{w}_grad" for w in wrt])))


IDS = [c.id for c in CASES]
_FD: dict[str, dict[str, np.ndarray]] = {}


def fd_gradients(case: Case) -> dict[str, np.ndarray]:
    if case.id not in _FD:
        model, feeds, wrt = with_loss(case, np.float64)
        _FD[case.id] = {name: finite_differences(model, feeds, name) for name in wrt}
    return _FD[case.id]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rule_matches_finite_differences(case):
    grads = float64_gradients(case)
    for name, want in fd_gradients(case).items():
        assert relative(want, grads[name]) < 1e-6, name


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rule_runs_on_onnxruntime(case):
    model, feeds, wrt = with_loss(case, np.float32)
    got = _onnxmp_gradients(model, feeds, wrt)
    for name, want in fd_gradients(case).items():
        assert got[name].dtype == np.float32
        assert relative(want, got[name].astype(np.float64)) < 1e-4, name


def test_every_rule_has_a_case():
    tested = {c.op for c in CASES}
    untested = sorted(f"{d or 'ai.onnx'}::{op}" for (d, op), rule in VJP_RULES.items()
                      if rule is not None and (d, op) not in tested)
    assert not untested, f"rules without a case in autodiff_cases.py: {untested}"


# --- onnxruntime-training's builder as an oracle (Python 3.11 with the training build) ------------

# Cases onnxruntime-training 1.19.2's builder refuses (no gradient for the op, an optional output
# it needs, 1-D MatMul operands, a tensor read twice by one node...), cannot run on the CPU, or gets wrong (a broadcast not
# summed back: Where, symbolic dims; Split's unused output; Conv with auto_pad).  onnxmp's
# gradients of these match finite differences (above).  The test checks that ORT still fails
# them, so that the list stays true.
ORT_FAILS = {
    # no gradient builder, or the builder raises
    "Softplus", "Softsign", "Elu", "Selu", "Celu", "ThresholdedRelu", "HardSigmoid", "HardSwish", "Mish", "PRelu",
    "Gelu_tanh", "Pow_both", "Mean_two", "Sum_three", "InstanceNormalization", "GroupNormalization_18",
    "BatchNormalization_inference", "BatchNormalization_training", "ReduceMax", "ReduceMax_all", "ReduceMin",
    "ReduceSumSquare", "ReduceL2_all",
    "ReduceL2", "CumSum", "CumSum_exclusive_reverse", "GlobalMaxPool", "Einsum", "Dropout_inference", "Mul_empty",
    "Mul_same_input", "MatMul_vector_left", "MatMul_vector_right", "MatMul_vectors", "FusedMatMul",
    "LayerNormalization", "LayerNormalization_axis1_outputs",
    "Pad_reflect", "Pad_edge", "Pad_wrap_axes", "Pad_reflect_folded_pads",  # constant mode only
    "Tile_if_rank",  # an If's outer-scope input (GetIndexFromName)
    # a gradient the CPU cannot run (ResizeGrad has a CUDA kernel only; nor has ConvTransposeGrad a CPU one)
    "Resize_nearest", "Resize_linear_sizes", "Resize_cubic_align_corners", "Resize_sizes_from_shape",
    "ConvTranspose_grouped", "ConvTranspose_1d_dilated", "ConvTranspose_depthwise_symbolic",
    # a gradient of the wrong shape or value
    "Add_symbolic_vs_symbolic", "Where", "Where_scalar_branch", "Split_one_used", "Conv_1d_same",
}


def _ort_gradients(model: onnx.ModelProto, feeds: dict, wrt: list[str]) -> dict[str, np.ndarray]:
    from onnxmp.training import _ort

    _ort.onnxblock()  # the training build, without torch
    from onnxruntime.capi._pybind_state import GradientGraphBuilder

    options = ort.SessionOptions()
    builder = GradientGraphBuilder(model.SerializeToString(), {LOSS}, set(wrt), LOSS, options)
    builder.build()
    grad_model = onnx.load_from_string(builder.get_model())
    session = ort.InferenceSession(grad_model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(wrt, session.run([f"{w}_grad" for w in wrt], feeds)))



@needs_training_build
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rule_matches_onnxruntime_training(case):
    model, feeds, wrt = with_loss(case, np.float32)
    if case.id in ORT_FAILS:
        try:
            want = _ort_gradients(model, feeds, wrt)
        except Exception:
            return  # refused, as listed
        got = _onnxmp_gradients(model, feeds, wrt)
        assert not all(want[w].shape == got[w].shape and relative(want[w], got[w]) < 1e-5 for w in wrt), \
            f"onnxruntime-training differentiates {case.id} right: take it out of ORT_FAILS"
        return
    want = _ort_gradients(model, feeds, wrt)
    got = _onnxmp_gradients(model, feeds, wrt)
    for name in wrt:
        assert relative(want[name], got[name]) < 1e-5, name


def _onnxmp_gradients(model: onnx.ModelProto, feeds: dict, wrt: list[str]) -> dict[str, np.ndarray]:
    grad_model, _ = backward(model, LOSS, wrt)
    options = ort.SessionOptions()
    if any(0 in v.shape for v in feeds.values()) and tuple(map(int, ort.__version__.split(".")[:2])) < (1, 20):
        # onnxruntime 1.19's graph optimizer crashes on empty tensors here ("RemoveNode ... should be
        # unreachable"); 1.20 and later run the same graph optimized.
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(grad_model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip(wrt, session.run([f"{w}_grad" for w in wrt], feeds)))



@pytest.mark.parametrize("name, einsum", [("Conv_1x1", True), ("Conv_1x1_strided", True),
                                          ("Conv_1x1_padded", False), ("Conv", False)])
def test_pointwise_conv_weight_gradient_is_one_einsum(name, einsum):
    """A 1x1 Conv without pads: dW is one Einsum (no Transpose, no Conv, no Reshape: a third operand
    of ones gives it the kernel's unit axes); padded or wider: the Conv."""
    from autodiff_cases import case_named

    model, _, wrt = with_loss(case_named(name), np.float32)
    grad_model, _ = backward(model, LOSS, wrt)
    forward = {n.name for n in model.graph.node}
    ops = [n.op_type for n in grad_model.graph.node if n.name not in forward]
    assert ("Einsum" in ops) == einsum
    assert ("Transpose" not in ops) == einsum
    if einsum:
        assert "Reshape" not in ops and "Conv" not in ops, ops


@pytest.mark.parametrize("name, dtype, scatters, summed", [
    ("LogSoftmax_picked", np.float32, 1, False), ("LogSoftmax_picked", np.float64, 1, False),
    ("LogSoftmax_picked_several", np.float32, 1, True), ("LogSoftmax_picked_other_axis", np.float32, 1, True),
    ("LogSoftmax_picked", np.float16, 1, True)])
def test_log_softmax_of_a_pick_is_one_scatter(name, dtype, scatters, summed):
    """GatherElements along LogSoftmax's axis (a cross-entropy): its scatter into zeros folds into
    LogSoftmax's gradient, one ScatterElements and no zeros; a ReduceSum only where the indices
    have several per row; across another axis (or in float16, whose scatter runs in float32
    between Casts) the plain form, zeros scattered then the sum, product and difference."""
    from autodiff_cases import case_named

    model, _, wrt = with_loss(case_named(name), dtype)
    grad_model, _ = backward(model, LOSS, wrt)
    forward = {n.name for n in model.graph.node}
    ops = [n.op_type for n in grad_model.graph.node if n.name not in forward]
    fused = name != "LogSoftmax_picked_other_axis" and dtype != np.float16
    assert ops.count("ScatterElements") == scatters
    assert ("ConstantOfShape" not in ops and "Sub" not in ops) == fused, ops
    assert ("ReduceSum" in ops) == summed, ops


@pytest.mark.parametrize("name, spread", [("ReduceMean", True), ("GlobalAveragePool", True),
                                          ("ReduceMean_opset18", False), ("GlobalAveragePool_symbolic", False)])
def test_a_mean_over_static_extents_spreads_by_one_mul(name, spread):
    """A mean's gradient over static reduced extents: one Mul by a constant of those extents (it
    broadcasts to X's shape), no Expand; over symbolic extents: the scaled gradient expanded."""
    from autodiff_cases import case_named

    for dtype in (np.float32, np.float16):
        model, _, wrt = with_loss(case_named(name), dtype)
        grad_model, _ = backward(model, LOSS, wrt)
        scope = f"{case_named(name).nodes[0].name}_Grad"
        ops = [n.op_type for n in grad_model.graph.node if n.name.startswith(scope)]
        assert ("Expand" not in ops) == spread and ops.count("Mul") == 1, (dtype, ops)


@pytest.mark.parametrize("name, dtype, pooled", [("MaxPool_after_Relu", np.float32, True),
                                                  ("MaxPool_after_Relu", np.float64, True),
                                                  ("MaxPool_after_Relu_shared", np.float32, False),
                                                  ("MaxPool_after_Relu", np.float16, False)])
def test_a_relu_before_a_max_pool_masks_the_pooled_gradient(name, dtype, pooled):
    """A ReLU whose output only a MaxPool reads: its gradient's Sign reads the pooled output and
    the mask multiplies dY before the one scatter; read elsewhere too (its gradient a Sum), or in
    float16 (a Greater and a Where): the mask after the scatter, on the ReLU's own output."""
    from autodiff_cases import case_named

    model, _, wrt = with_loss(case_named(name), dtype)
    grad_model, _ = backward(model, LOSS, wrt)
    forward = {n.name for n in model.graph.node}
    added = [n for n in grad_model.graph.node if n.name not in forward]
    assert [n.op_type for n in added].count("ScatterElements") == 1
    signs = [n.input[0] for n in added if n.op_type == "Sign"]
    assert signs == (["y"] if pooled else (["r"] if dtype != np.float16 else [])), signs


@pytest.mark.parametrize("name, patches", [("Conv_patches", True), ("Conv_patches_strided_dilated", True),
                                           ("Conv_patches_1d", True), ("Conv_patches_unpadded", True),
                                           ("Conv_patches_symbolic_extents", False),
                                           ("Conv", False), ("Conv_grouped", False), ("Conv_1x1", False)])
def test_conv_weight_gradient_by_patches(name, patches):
    """float32, static extents, 8 or more channels, one group, a kernel wider than 1x1: dW is one
    Gather of X's patches and one Einsum (no Gemm, no Reshape: it lands on the weight's layout), and
    the Conv's only Conv-like node is its dX; symbolic
    extents, 3 channels (Conv), grouped or 1x1: not.  Nor in float64."""
    from autodiff_cases import case_named

    for dtype in (np.float32, np.float64):
        model, _, wrt = with_loss(case_named(name), dtype)
        grad_model, _ = backward(model, LOSS, wrt)
        forward = {n.name for n in model.graph.node}
        added = [n for n in grad_model.graph.node if n.name not in forward]
        gathers = [n for n in added if n.op_type == "Gather" and "patch_positions" in n.input[1]]
        fires = patches and dtype == np.float32
        assert bool(gathers) == fires, dtype
        if fires:
            ops = [n.op_type for n in added]
            assert ops.count("Einsum") == 1 and "Conv" not in ops and "Gemm" not in ops
            assert ops.count("Transpose") == 1 and "Reshape" in ops and ops.count("Reshape") == 1
            assert ops.count("Pad") == (0 if name == "Conv_patches_unpadded" else 1)  # a Pad of nothing copies X


def test_a_cuda_build_keeps_one_conv_for_the_weight_gradient():
    """The patches are the CPU target's form: for CUDA, dW stays the swapped Conv (cuDNN's own)."""
    from autodiff_cases import case_named

    model, _, wrt = with_loss(case_named("Conv_patches"), np.float32)
    for target, patches in (("cpu", True), ("cuda", False)):
        grad_model, _ = backward(model, LOSS, wrt, target=target)
        added = [n.op_type for n in grad_model.graph.node if n.name not in {m.name for m in model.graph.node}]
        assert ("Einsum" in added) == patches and added.count("Conv") == (0 if patches else 1), target


def test_conv_patches_over_the_limit_keep_the_swapped_conv(monkeypatch):
    """A sample's patches above PATCH_LIMIT elements (Conv_patches: 25 positions x 9 x 8 = 1800):
    the swapped Conv, no patch Gather."""
    from autodiff_cases import case_named

    from onnxmp.training.build.autodiff import conv

    def patch_gathers(limit):
        monkeypatch.setattr(conv, "PATCH_LIMIT", limit)
        model, _, wrt = with_loss(case_named("Conv_patches"), np.float32)
        grad_model, _ = backward(model, LOSS, wrt)
        return [n for n in grad_model.graph.node if n.op_type == "Gather" and "patch_positions" in n.input[1]]

    assert not patch_gathers(1799)
    assert len(patch_gathers(1800)) == 1


@pytest.mark.parametrize("name, unsqueeze", [("ReduceSum_all", False), ("ReduceMax_all", False),
                                             ("ReduceSum", True), ("ReduceL2", True)])
def test_a_reduction_to_a_scalar_needs_no_unsqueeze(name, unsqueeze):
    from autodiff_cases import case_named

    model, _, wrt = with_loss(case_named(name), np.float32)
    grad_model, _ = backward(model, LOSS, wrt)
    scope = f"{model.graph.node[0].name or model.graph.node[0].output[0]}_Grad/"
    ops = [n.op_type for n in grad_model.graph.node if n.name.startswith(scope)]
    assert ops and ("Unsqueeze" in ops) == unsqueeze


def _grad_ops(model: onnx.ModelProto, wrt: list[str]) -> list[str]:
    grad_model, _ = backward(model, LOSS, wrt)
    forward = {n.name for n in model.graph.node}
    return [n.op_type for n in grad_model.graph.node if n.name not in forward]


@pytest.mark.parametrize("name, dtype, where", [("Relu", np.float32, False), ("Clip", np.float32, False),
                                                ("Clip_min_only", np.float32, False), ("Relu", np.float16, True),
                                                ("Clip", np.float16, True)])
def test_a_masked_gradient_is_a_mul_in_float32(name, dtype, where):
    """ReLU's and Clip's gradient: dy times the cast mask in float32 (onnxruntime's CPU Where is ~5x
    slower than Cast+Mul); Where in float16, where a masked non-finite dy must stay dropped."""
    from autodiff_cases import case_named

    model, _, wrt = with_loss(case_named(name), dtype)
    ops = _grad_ops(model, wrt)
    assert ("Where" in ops) == where
    if name == "Relu":  # ReLU's mask is Sign(y), y >= 0
        assert ("Sign" in ops and "Mul" in ops and "Greater" not in ops) != where
    else:
        assert ("Cast" in ops and "Mul" in ops) != where


def _clip_case(lo, hi, runtime_bounds: bool = False) -> Case:
    from autodiff_cases import C, F, N

    bounds = {"lo": F((1,)), "hi": F((1,))} if runtime_bounds else {"lo": C(lo), "hi": C(hi)}
    return Case("Clip_bounds", ("", "Clip"), [N("Clip", ["x", "lo", "hi"])], {"x": F((2, 4)), **bounds})


@pytest.mark.parametrize("lo, hi, runtime_bounds, equal", [(-0.5, 0.7, False, True), (0.7, -0.5, False, False),
                                                           (-0.5, 0.7, True, False)])
def test_clip_gradient_by_equal_output_only_for_ordered_constant_bounds(lo, hi, runtime_bounds, equal):
    """With both bounds constant and min <= max the mask is Equal(x, y) (bounds included, as the
    comparisons); inverted or runtime bounds keep the two comparisons and their And."""
    model, feeds, _ = with_loss(_clip_case(lo, hi, runtime_bounds), np.float32)
    ops = _grad_ops(model, ["x"])
    assert ("Equal" in ops) == equal and ("And" in ops) != equal
    x = np.array([[-0.5, 0.7, 0.0, 2.0], [-2.0, 0.69, -0.51, np.float32(0.7) + 1e-6]], np.float32)
    feeds = {**feeds, "x": x}
    if runtime_bounds:
        feeds.update(lo=np.array([lo], np.float32), hi=np.array([hi], np.float32))
    weight = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "y_weight"))
    inside = (x >= np.float32(lo)) & (x <= np.float32(hi))
    np.testing.assert_array_equal(_onnxmp_gradients(model, feeds, ["x"])["x"], np.where(inside, weight, 0))
