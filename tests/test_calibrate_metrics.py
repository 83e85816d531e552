"""Calibration metrics: values, direction (all are errors), per-output plans, and their effect on the search."""
from __future__ import annotations

import math

import numpy as np
import pytest

import onnxmp
from onnxmp.parity.metrics import MODEL_LABEL, metric_plan, parse_metric


def _err(spec, ref, out) -> float:
    return parse_metric(spec).error([np.asarray(ref, np.float32)], [np.asarray(out, np.float32)])


def test_metric_values_are_errors():
    ref = np.array([[1.0, 2.0, 4.0], [0.5, 0.1, -4.0]])
    out = ref + np.array([[0.0, 0.0, 0.4], [0.0, 0.0, 0.0]])
    assert _err("rel", ref, out) == pytest.approx(0.1, rel=1e-6)
    assert _err("max_abs", ref, out) == pytest.approx(0.4, rel=1e-6)
    cos = float(np.dot(ref.ravel(), out.ravel()) / np.linalg.norm(ref) / np.linalg.norm(out))
    assert _err("cosine", ref, out) == pytest.approx(1 - cos, abs=1e-6)
    assert _err("rel", ref, ref) == _err("max_abs", ref, ref) == 0.0
    assert _err("cosine", ref, ref) == pytest.approx(0.0, abs=1e-7)


def test_agreement_metrics_count_disagreements_pooled_over_samples():
    argmax = parse_metric("argmax")
    ref = [np.array([[0.1, 0.9], [0.8, 0.2]]), np.array([[0.3, 0.7]])]
    out = [np.array([[0.6, 0.4], [0.8, 0.2]]), np.array([[0.3, 0.7]])]
    assert argmax.error(ref, out) == pytest.approx(1 / 3)  # one row of three flips
    binary = parse_metric("binary:0.5")
    assert binary.threshold == 0.5
    assert binary.error([np.array([0.1, 0.6, 0.9, 0.49])], [np.array([0.1, 0.4, 0.9, 0.51])]) == pytest.approx(0.5)
    assert binary.error([np.array([0.1, 0.6])], [np.array([0.2, 0.7])]) == 0.0


def test_non_finite_candidates_fail_error_metrics():
    ref = np.array([1.0, 2.0])
    assert _err("rel", ref, [1.0, np.inf]) == math.inf
    assert _err("max_abs", ref, [np.nan, 2.0]) == math.inf
    assert _err("cosine", ref, [1.0, np.inf]) == math.inf


def test_non_float_outputs_compare_for_equality():
    m = parse_metric("rel")
    assert m.error([np.array([1, 2, 3, 4])], [np.array([1, 2, 0, 4])]) == 0.25


def test_bad_metric_specs_are_clear_errors():
    with pytest.raises(onnxmp.OnnxMPError, match="unknown metric 'argmx'") as info:
        parse_metric("argmx")
    assert "argmax" in info.value.hint
    with pytest.raises(onnxmp.OnnxMPError, match="threshold is not a number"):
        parse_metric("binary:half")
    with pytest.raises(onnxmp.OnnxMPError, match="not an output of the model"):
        metric_plan(["logitz=argmax"], ["logits", "boxes"])


def test_plans_per_output_and_whole_model_callables():
    plan = metric_plan(["logits=argmax", "max_abs"], ["logits", "boxes"])
    assert plan.describe() == {"logits": "argmax", "boxes": "max_abs"}
    assert metric_plan({"boxes": "cosine"}, ["logits", "boxes"]).describe() == {"logits": "rel", "boxes": "cosine"}
    assert metric_plan(None, ["y"]).describe() == {"y": "rel"}

    def worst_gap(ref, out):
        return max(float(np.abs(ref[k] - out[k]).max()) for k in ref)

    plan = metric_plan(worst_gap, ["a", "b"])
    errors = plan.errors([{"a": np.zeros(2), "b": np.ones(2)}], [{"a": np.zeros(2), "b": np.full(2, 1.5)}])
    assert errors == {MODEL_LABEL: 0.5}
    per_output = metric_plan({"a": lambda r, o: 7.0}, ["a"])
    assert per_output.errors([{"a": np.zeros(1)}], [{"a": np.zeros(1)}]) == {"a": 7.0}


def _classifier():
    """Logits whose ranking is robust but whose values carry an (h + 2000) - 2000 cancellation."""
    import onnx

    rng = np.random.default_rng(3)
    w1 = (rng.standard_normal((16, 16)) / 4).astype(np.float32)
    w2 = (rng.standard_normal((16, 4)) * 0.2).astype(np.float32)
    w2[:4, :4] = np.eye(4) * 10  # class k follows feature k: wide margins
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
         onnx.helper.make_node("Add", ["h", "c"], ["up"], name="add_c"),
         onnx.helper.make_node("Sub", ["up", "c"], ["down"], name="sub_c"),
         onnx.helper.make_node("MatMul", ["down", "w2"], ["logits"], name="mm2")],
        "clf", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 16])],
        [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", 4])],
        [onnx.numpy_helper.from_array(w1, "w1"), onnx.numpy_helper.from_array(w2, "w2"),
         onnx.numpy_helper.from_array(np.array(2000.0, np.float32), "c")])
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    x = rng.standard_normal((64, 16)).astype(np.float32)
    x[:, :4] = 0
    x[np.arange(64), rng.integers(0, 4, 64)] = 4.0  # one clear winner per row
    return model, [{"x": x[:32] @ np.linalg.pinv(w1)}, {"x": x[32:] @ np.linalg.pinv(w1)}]


def test_the_metric_decides_what_the_search_gives_up():
    model, samples = _classifier()
    by_value = onnxmp.convert(model, calibration=samples, tolerance=1e-2)
    by_class = onnxmp.convert(model, calibration=samples, tolerance=1e-2, metric="argmax")
    assert by_value.report.calibration.plain.tune_error > 1e-2  # values are off ...
    assert by_value.report.calibration.met and by_value.report.calibration.moved
    cal = by_class.report.calibration
    assert cal.met and cal.metric == {"logits": "argmax"}
    assert cal.plain.tune_error <= 1e-2 and cal.moved == []  # ... the predicted classes are not
    assert cal.holdout_samples == 1 and cal.final.holdout == {"logits": cal.final.holdout["logits"]}


def test_relative_error_of_finite_floats_takes_the_short_way_to_the_same_figure():
    from onnxmp.parity import metrics

    def general(ref, out):  # the masked float64 path, which arrays with inf/NaN take
        r, c = metrics._finite_pairs(ref, out)
        return float(np.abs(c - r).max()) / max(float(np.abs(r).max()), 1e-12)

    rng = np.random.default_rng(0)
    for dtype in (np.float16, np.float32, np.float64):
        for scale in (1e-6, 1.0, 1e3):
            ref = (rng.standard_normal(1000) * scale).astype(dtype)
            out = (ref.astype(np.float64) * (1 + rng.standard_normal(1000) * 1e-3)).astype(dtype)
            assert metrics._relative_error_finite(ref, out) == general(ref, out) == metrics.relative_error(ref, out)
    # Not taken: inf in the reference, other shapes, integers, nothing at all.
    ref = np.array([1.0, np.inf, -4.0], np.float32)
    assert metrics._relative_error_finite(ref, ref + 1) is None
    assert metrics.relative_error(ref, np.array([1.5, np.inf, -4.0], np.float32)) == 0.125
    assert metrics._relative_error_finite(np.zeros(3, np.float32), np.zeros(4, np.float32)) is None
    assert metrics._relative_error_finite(np.arange(3), np.arange(3)) is None
    assert metrics._relative_error_finite(np.zeros(0, np.float32), np.zeros(0, np.float32)) is None
    # Taken, and a candidate non-finite where the reference is finite fails outright.
    assert metrics.relative_error(np.ones(3, np.float32), np.array([1, np.nan, 1], np.float32)) == math.inf
    # Scalars (0-d outputs) too.
    assert metrics.relative_error(np.array(2.0, np.float32), np.array(2.5, np.float32)) == 0.25
