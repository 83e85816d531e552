"""Tests for onnxmp.validate, onnxmp.plots and the `onnxmp validate` command."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from onnxmp.cli import main
from onnxmp.errors import OnnxMPError
from onnxmp.plots import plot_errors
from onnxmp.parity.validate import Thresholds, validate

MODELS = Path(__file__).resolve().parents[1] / "models"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def small_mlp(dtype=np.float32, seed=0, hidden=32) -> onnx.ModelProto:
    """x[N,16] -> Gemm -> Relu -> Gemm -> logits[N,10], plus an ArgMax class output."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array((rng.standard_normal((16, hidden)) / 4).astype(dtype), "w1"),
             numpy_helper.from_array((rng.standard_normal(hidden) * 0.1).astype(dtype), "b1"),
             numpy_helper.from_array((rng.standard_normal((hidden, 10)) / 6).astype(dtype), "w2"),
             numpy_helper.from_array(np.zeros(10, dtype), "b2")]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["logits"]),
             helper.make_node("ArgMax", ["logits"], ["cls"], axis=1, keepdims=0)]
    return make_model(nodes, [helper.make_tensor_value_info("x", elem, ["N", 16])],
                      [helper.make_tensor_value_info("logits", elem, ["N", 10]),
                       helper.make_tensor_value_info("cls", TP.INT64, ["N"])], inits)


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxconverter_common import float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float16.convert_float_to_float16(model, keep_io_types=True)


def batch(n=64, seed=1) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)}


# --- (e) a converter's fp16 output passes against its fp32 original -------------------------


def test_converted_mlp_passes():
    reference = small_mlp()
    report = validate(reference, to_fp16(reference), batch())
    assert report.passed, report.summary()
    assert report.emulated == ["float16"] and report.precision == "float16"
    logits = report.outputs[0]
    assert logits.name == "logits"
    assert 0 < logits.max_abs_err < 0.05  # nonzero: fp16 numerics really were emulated
    assert 0.9999 < logits.cosine <= 1.0
    assert logits.top1 is not None and logits.top1 > 0.9
    assert report.outputs[1].exact and report.outputs[1].name == "cls"
    assert report.thresholds == Thresholds(cosine_min=0.999, rel_err_max=1e-2)


def test_converted_zoo_model_from_paths_with_npz(tmp_path):
    cand = tmp_path / "mlp16.onnx"
    onnx.save(to_fp16(onnx.load(MODELS / "mlp.onnx")), cand)
    report = validate(MODELS / "mlp.onnx", cand, MODELS / "mlp.inputs.npz")
    assert report.passed, report.summary()
    assert report.samples == 1


def test_fp16_overflow_in_a_real_model_fails():
    # A BatchNorm variance of ~1e8 overflows fp16 under a plain converter.
    report = validate(MODELS / "cnn_bn_bigvar.onnx", to_fp16(onnx.load(MODELS / "cnn_bn_bigvar.onnx")),
                      MODELS / "cnn_bn_bigvar.inputs.npz")
    assert not report.passed
    assert any("cosine" in f for f in report.failures())


def test_bfloat16_candidate_uses_bf16_thresholds():
    reference = small_mlp()
    candidate = small_mlp(dtype=ml_dtypes.bfloat16)
    # bf16 graph inputs cannot be fed through onnxruntime's Python API; the
    # emulation turns them into float32 inputs rounded on entry.
    report = validate(reference, candidate, batch())
    assert report.emulated == ["bfloat16"] and report.precision == "bfloat16"
    assert report.thresholds.rel_err_max == 5e-2
    assert report.passed, report.summary()
    assert report.outputs[0].max_rel_err > 1e-3  # bf16 is visibly coarser than fp16


# --- (f) failures ---------------------------------------------------------------


def test_broken_candidate_fails():
    reference = small_mlp()
    broken = to_fp16(reference)
    w2 = next(t for t in broken.graph.initializer if t.name == "w2")
    w2.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w2)[:, ::-1].copy(), "w2"))
    report = validate(reference, broken, batch())
    assert not report.passed
    logits, cls = report.outputs
    assert logits.cosine < 0.9 and not logits.passed
    assert cls.mismatches > 0 and any("must match exactly" in f for f in cls.failures)
    assert "FAILED" in report.summary()


def test_slightly_off_candidate_fails_only_tight_thresholds():
    reference = small_mlp()
    candidate = to_fp16(reference)
    assert validate(reference, candidate, batch()).passed
    tight = validate(reference, candidate, batch(), thresholds={"rel_err_max": 1e-6})
    assert not tight.passed and tight.thresholds.cosine_min == 0.999  # other defaults kept
    assert any("rel err" in f for f in tight.failures())


def nan_model(poison: float) -> onnx.ModelProto:
    nodes = [helper.make_node("Mul", ["x", "k"], ["y"])]
    k = np.ones(4, np.float32)
    k[2] = poison
    return make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [2, 4])],
                      [helper.make_tensor_value_info("y", TP.FLOAT, [2, 4])],
                      [numpy_helper.from_array(k, "k")])


def test_nan_output_fails_even_with_all_else_equal():
    x = {"x": np.arange(1, 9, dtype=np.float32).reshape(2, 4)}
    report = validate(nan_model(1.0), nan_model(np.nan), x)
    assert not report.passed
    out = report.outputs[0]
    assert out.nonfinite_mismatches == 2
    assert out.max_abs_err == 0  # errors are measured where both are finite
    assert "inf/NaN" in out.failures[0]
    assert json.loads(report.to_json())["passed"] is False
    # The same NaN in both models is agreement, not failure.
    assert validate(nan_model(np.nan), nan_model(np.nan), x).passed


def test_an_output_inf_nan_everywhere_in_both_models_is_no_pass():
    """NaN inputs made both outputs NaN everywhere: PASSED with max|err| 0 and cosine 1, comparing nothing."""
    nan_inputs = {"x": np.full((2, 4), np.nan, np.float32)}
    report = validate(nan_model(1.0), nan_model(1.0), nan_inputs)
    assert not report.passed and report.outputs[0].compared == 0
    assert "no element is finite in both models" in report.outputs[0].failures[0]
    row = report.summary().splitlines()[1].split()
    assert row[2:6] == ["-", "-", "-", "-"]  # not "0.000e+00 ... 1.00000000 100.0%" for nothing compared
    one_row = {"x": np.array([[np.nan] * 4, [1, 2, 3, 4]], np.float32)}
    assert validate(nan_model(1.0), nan_model(1.0), one_row).passed  # the finite row still compares


def test_a_ragged_sequence_output_is_compared_not_an_internal_error():
    """np.asarray of a ragged sequence raised ValueError ('inhomogeneous shape')."""
    nodes = [helper.make_node("Mul", ["x", "k"], ["y"]), helper.make_node("ReduceSum", ["y"], ["r"], keepdims=1),
             helper.make_node("SequenceConstruct", ["y", "r"], ["s"])]
    reference = make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [2, 4])],
                           [helper.make_tensor_sequence_value_info("s", TP.FLOAT, None)],
                           [numpy_helper.from_array(np.full(4, 1.001, np.float32), "k")])
    report = validate(reference, reference, {"x": np.ones((2, 4), np.float32)})
    assert report.passed and report.outputs[0].shape == [9]  # 2x4 and 1x1, end to end


def test_fp16_overflow_to_inf_fails():
    nodes = [helper.make_node("Mul", ["x", "k"], ["y"])]
    reference = make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [3])],
                           [helper.make_tensor_value_info("y", TP.FLOAT, [3])],
                           [numpy_helper.from_array(np.full(3, 1000, np.float32), "k")])
    candidate = to_fp16(reference)
    x = np.array([1.0, 2.0, 70.0], np.float32)  # 70000 > 65504
    report = validate(reference, candidate, {"x": x})
    assert not report.passed and report.outputs[0].nonfinite_mismatches == 1
    assert validate(reference, candidate, {"x": x[:2].repeat(2)[:3]}).passed


def test_shape_mismatch_fails():
    reference = nan_model(1.0)
    nodes = [helper.make_node("Mul", ["x", "k"], ["m"]),
             helper.make_node("Reshape", ["m", "shape"], ["y"])]
    candidate = make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [2, 4])],
                           [helper.make_tensor_value_info("y", TP.FLOAT, [8])],
                           [numpy_helper.from_array(np.ones(4, np.float32), "k"),
                            numpy_helper.from_array(np.array([8], np.int64), "shape")])
    report = validate(reference, candidate)
    assert not report.passed and "shape" in report.failures()[0]


# --- aggregation, options, errors ---------------------------------------------------


def test_worst_case_over_samples():
    reference = small_mlp()
    candidate = to_fp16(reference)
    samples = [batch(8, seed=s) for s in range(3)]
    each = [validate(reference, candidate, s).outputs[0] for s in samples]
    together = validate(reference, candidate, samples).outputs[0]
    assert together.max_abs_err == max(o.max_abs_err for o in each)
    assert together.max_rel_err == max(o.max_rel_err for o in each)
    assert together.cosine == min(o.cosine for o in each)
    assert together.top1 == pytest.approx(np.mean([o.top1 for o in each]))  # pooled rows, equal sizes
    assert sum(together.histogram.counts) + together.histogram.zeros == 3 * 8 * 10


def test_generated_inputs_and_dims():
    reference = small_mlp()
    report = validate(reference, to_fp16(reference), dims={"N": 5})
    assert report.outputs[0].shape == [5, 10]
    with pytest.raises(OnnxMPError, match="--dims"):
        validate(reference, reference, dims={"batch": 5})


def test_metrics_subset_only_checks_those():
    reference = small_mlp()
    report = validate(reference, to_fp16(reference), batch(), metrics=["cosine"],
                      thresholds={"rel_err_max": 1e-9})
    assert report.passed  # the impossible rel-err limit does not apply: not computed
    assert report.outputs[0].max_rel_err is None and report.outputs[0].top1 is None
    with pytest.raises(OnnxMPError, match="unknown metric"):
        validate(reference, reference, batch(), metrics=["psnr"])


def test_top1_only_for_classifier_like_outputs():
    x = {"x": np.ones((2, 4), np.float32)}
    assert validate(nan_model(1.0), nan_model(1.0), x).outputs[0].top1 == 1.0
    nodes = [helper.make_node("Identity", ["x"], ["y"])]
    model3d = make_model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3, 4])],
                         [helper.make_tensor_value_info("y", TP.FLOAT, [2, 3, 4])])
    assert validate(model3d, model3d).outputs[0].top1 is None


def test_user_errors():
    reference = small_mlp()
    renamed = small_mlp()
    renamed.graph.output[0].name = "scores"
    renamed.graph.node[2].output[0] = "scores"
    renamed.graph.node[3].input[0] = "scores"
    with pytest.raises(OnnxMPError, match="no output named 'logits'"):
        validate(reference, renamed, batch())
    with pytest.raises(OnnxMPError, match="unknown threshold"):
        validate(reference, reference, batch(), thresholds={"cos_min": 0.9})
    with pytest.raises(OnnxMPError, match="unknown provider"):
        validate(reference, reference, batch(), provider="tpu")
    with pytest.raises(OnnxMPError, match="no value for model input"):
        validate(reference, reference, {"y": batch()["x"]})
    # Arrays that are no model input (a training file's labels) are ignored, with an info line.
    assert validate(reference, reference, {"x": batch()["x"], "y": batch()["x"]}).passed


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="CUDA EP present")
def test_cuda_without_cuda_ep_is_a_clear_error():
    reference = small_mlp()
    with pytest.raises(OnnxMPError, match="CUDAExecutionProvider") as err:
        validate(reference, to_fp16(reference), batch(), provider="cuda")
    assert "--provider cpu" in err.value.hint


def test_report_json_round_trip():
    reference = small_mlp()
    report = validate(reference, to_fp16(reference), batch())
    data = json.loads(report.to_json())
    assert data["passed"] is True and data["samples"] == 1
    assert [o["name"] for o in data["outputs"]] == ["logits", "cls"]
    assert data["thresholds"]["cosine_min"] == 0.999
    hist = data["outputs"][0]["histogram"]
    assert len(hist["edges"]) == len(hist["counts"]) + 1
    assert sum(hist["counts"]) + hist["zeros"] == 64 * 10


def test_report_json_writes_nonfinite_as_strings():
    report = validate(nan_model(1.0), nan_model(np.inf), {"x": np.ones((2, 4), np.float32)},
                      metrics=["max_abs_err"])
    report.outputs[0].max_abs_err = float("inf")
    assert json.loads(report.to_json())["outputs"][0]["max_abs_err"] == "inf"


# --- plots ------------------------------------------------------------------------


def test_plot_errors_writes_png(tmp_path):
    reference = small_mlp()
    report = validate(reference, to_fp16(reference), batch())
    path = tmp_path / "errors.png"
    plot_errors(report, path)
    assert path.read_bytes().startswith(PNG_MAGIC)
    assert [p.name for p in tmp_path.iterdir()] == ["errors.png"]  # no temp file left behind


def test_plot_into_missing_folder_is_a_user_error(tmp_path):
    report = validate(nan_model(1.0), nan_model(1.0), {"x": np.ones((2, 4), np.float32)})
    with pytest.raises(OnnxMPError, match="cannot write"):
        plot_errors(report, tmp_path / "nope" / "errors.png")


# --- (h) CLI --------------------------------------------------------------------------


@pytest.fixture
def mlp_files(tmp_path):
    reference = small_mlp()
    ref, cand = tmp_path / "ref.onnx", tmp_path / "cand.onnx"
    onnx.save(reference, ref)
    onnx.save(to_fp16(reference), cand)
    np.savez(tmp_path / "a.npz", **batch(4, seed=1))
    np.savez(tmp_path / "b.npz", **batch(4, seed=2))
    return tmp_path, ref, cand


def test_cli_validate_passes_and_writes_report_and_plot(mlp_files, capsys):
    folder, ref, cand = mlp_files
    code = main(["validate", str(ref), str(cand), "--inputs", str(folder / "a.npz"), str(folder / "b.npz"),
                 "--report", str(folder / "report.json"), "--plot", str(folder / "errors.png")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "logits" in out.out and "PASSED" in out.out
    assert json.loads((folder / "report.json").read_text())["samples"] == 2
    assert (folder / "errors.png").read_bytes().startswith(PNG_MAGIC)


def test_cli_validate_fails_with_exit_1_and_one_line_reason(mlp_files, capsys):
    folder, ref, cand = mlp_files
    code = main(["validate", str(ref), str(cand), "--dims", "N=3", "--rel-err-max", "1e-7",
                 "--plot", str(folder / "errors.png")])
    out = capsys.readouterr()
    assert code == 1
    reason = [line for line in out.err.splitlines() if "parity failed" in line]
    assert len(reason) == 1 and "logits" in reason[0] and "rel err" in reason[0]
    assert "FAILED" in out.out
    assert (folder / "errors.png").exists()  # written even on failure, to look at


def test_cli_validate_int_input_needs_npz(tmp_path, capsys):
    nodes = [helper.make_node("Cast", ["ids"], ["y"], to=TP.FLOAT)]
    model = make_model(nodes, [helper.make_tensor_value_info("ids", TP.INT64, [3])],
                       [helper.make_tensor_value_info("y", TP.FLOAT, [3])])
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["validate", str(tmp_path / "m.onnx"), str(tmp_path / "m.onnx")]) == 1
    err = capsys.readouterr().err
    assert "'ids'" in err and "hint:" in err and "--inputs" in err


def test_cli_validate_bad_dims_syntax(mlp_files, capsys):
    _, ref, cand = mlp_files
    assert main(["validate", str(ref), str(cand), "--dims", "N:3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("onnxmp validate: error: argument --dims:") and "NAME=SIZE" in err[0]
    assert err[1:] == ["  hint: see `onnxmp validate --help`"]


def test_cli_validate_ignores_extra_npz_keys_and_names_them(mlp_files, capsys, caplog):
    """A training file holds the labels too; they used to be rejected as 'not inputs of the model'."""
    folder, ref, cand = mlp_files
    np.savez(folder / "train.npz", **batch(4, seed=3), y=np.arange(4), mask=np.ones(4))
    caplog.set_level("INFO", logger="onnxmp.inputs")
    assert main(["validate", str(ref), str(cand), "--inputs", str(folder / "train.npz")]) == 0, \
        capsys.readouterr().err
    notes = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert notes == ["ignoring input array(s) that are not model inputs: mask, y"]


def test_cli_validate_missing_npz_key_is_still_an_error(mlp_files, capsys):
    folder, ref, cand = mlp_files
    np.savez(folder / "labels.npz", y=np.arange(4))
    assert main(["validate", str(ref), str(cand), "--inputs", str(folder / "labels.npz")]) == 1
    err = capsys.readouterr().err
    assert "no value for model input(s) 'x'" in err and "Traceback" not in err


def _swap_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "swapped" in r.getMessage()]


@pytest.mark.parametrize("order, warned", [
    ("fp16 fp32", True),   # swapped: the low-precision model given as the reference
    ("fp32 fp16", False),
    ("fp16 fp16", False),  # comparing two low-precision models is deliberate
    ("fp32 fp32", False),
])
def test_a_low_precision_reference_against_a_float32_candidate_warns(caplog, order, warned):
    """REF and CAND swapped passed silently, judged by float32's tight thresholds."""
    models = {"fp32": small_mlp(), "fp16": to_fp16(small_mlp())}
    reference, candidate = (models[k] for k in order.split())
    caplog.set_level("WARNING", logger="onnxmp.validate")
    validate(reference, candidate, batch(4), thresholds={"rel_err_max": 1.0, "abs_err_max": 1.0})
    warnings_seen = _swap_warnings(caplog)
    assert len(warnings_seen) == (1 if warned else 0), warnings_seen
    if warned:
        assert warnings_seen[0].startswith("the reference holds float16 tensors and the candidate none")


def test_cli_validate_swapped_models_warn_but_still_compare(mlp_files, capsys, caplog):
    folder, ref, cand = mlp_files
    caplog.set_level("WARNING", logger="onnxmp.validate")
    main(["validate", str(cand), str(ref), "--inputs", str(folder / "a.npz")])
    assert "logits" in capsys.readouterr().out
    assert len(_swap_warnings(caplog)) == 1


def test_a_candidate_that_fails_to_run_is_one_line_with_a_hint():
    # Both load; the candidate's Reshape asks for a size the input does not have, which only running finds.
    x = helper.make_tensor_value_info("x", TP.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TP.FLOAT, ["m"])
    shape = numpy_helper.from_array(np.array([3], dtype=np.int64), "shape")
    reference = make_model([helper.make_node("Relu", ["x"], ["y"])], [x], [y])
    candidate = make_model([helper.make_node("Reshape", ["x", "shape"], ["y"])], [x], [y], [shape])
    with pytest.raises(OnnxMPError) as caught:
        validate(reference, candidate, {"x": np.ones(4, np.float32)})
    message = caught.value.message
    assert message.startswith(f"onnxruntime {ort.__version__} cannot run the candidate model: a Reshape node: ")
    assert "\n" not in message and "onnxruntime_src" not in message and caught.value.hint
