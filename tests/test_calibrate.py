"""Calibration seeds and the accuracy-guided fallback (issue: parity without a GPU)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxmp
from onnxmp.calibrate import relative_error, run_with_intermediates
from onnxmp.emulate import emulate

pytest.importorskip("onnxruntime")

FLOAT = onnx.TensorProto.FLOAT


def _chain(n_blocks: int, hot_block: int | None = None, gain: float = 1.0, cancel: float | None = None,
           width: int = 16) -> onnx.ModelProto:
    """n MatMul+Relu blocks.  ``hot_block`` multiplies its weight by ``gain`` (and a Mul undoes it);
    ``cancel`` inserts (h + c) - c after the first block: exact in fp32, ruinous in fp16."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    cur = "x"
    for i in range(n_blocks):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        if i == hot_block:
            w *= np.float32(gain)
        inits.append(onnx.numpy_helper.from_array(w, f"w{i}"))
        nodes.append(onnx.helper.make_node("MatMul", [cur, f"w{i}"], [f"m{i}"], name=f"mm{i}"))
        cur = f"m{i}"
        if i == hot_block:
            inits.append(onnx.numpy_helper.from_array(np.array(1.0 / gain, np.float32), f"inv{i}"))
            nodes.append(onnx.helper.make_node("Mul", [cur, f"inv{i}"], [f"s{i}"], name=f"scale{i}"))
            cur = f"s{i}"
        if i == 0 and cancel is not None:
            inits.append(onnx.numpy_helper.from_array(np.array(cancel, np.float32), "c"))
            nodes.append(onnx.helper.make_node("Add", [cur, "c"], ["up"], name="add_c"))
            nodes.append(onnx.helper.make_node("Sub", ["up", "c"], ["down"], name="sub_c"))
            cur = "down"
        nodes.append(onnx.helper.make_node("Relu", [cur], [f"r{i}"], name=f"relu{i}"))
        cur = f"r{i}"
    nodes.append(onnx.helper.make_node("Identity", [cur], ["y"], name="out"))
    graph = onnx.helper.make_graph(nodes, "chain", [onnx.helper.make_tensor_value_info("x", FLOAT, ["N", width])],
                                   [onnx.helper.make_tensor_value_info("y", FLOAT, ["N", width])], inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _error(model, converted, sample) -> float:
    ref = run_with_intermediates(model, [sample])[0]["y"]
    out = run_with_intermediates(emulate(converted, keep_io_types=False), [sample])[0]["y"]
    return relative_error(ref, out)


def test_overflow_seen_only_on_real_data_is_fixed_in_one_cycle_keeping_90_percent_fp16():
    model = _chain(10, hot_block=3, gain=2000.0)
    rng = np.random.default_rng(1)
    random_sample = {"x": rng.standard_normal((4, 16)).astype(np.float32)}
    real_sample = {"x": (rng.standard_normal((4, 16)) * 60).astype(np.float32)}  # "real" inputs are larger
    plain = onnxmp.convert(model).model
    assert _error(model, plain, random_sample) < 1e-2  # looks fine on random data ...
    assert _error(model, plain, real_sample) == np.inf  # ... overflows on real data

    result = onnxmp.convert(model, calibration=real_sample, tolerance=1e-2)
    cal = result.report.calibration
    assert cal["passed"] and cal["cycles"] == 1
    assert _error(model, result.model, real_sample) <= 1e-2
    colors = result.report.node_colors()
    matmuls = [n for n in colors if n.startswith("mm")]
    assert sum(colors[n] == "allow" for n in matmuls) / len(matmuls) >= 0.9
    assert colors["mm3"] == "deny"
    cause = next(v.cause for v in result.report.vertices if v.node == "mm3")
    assert "`m3` reached" in cause and "calibration" in cause
    assert any(s["tensor"] == "m3" for s in cal["seeded"])


def test_precision_loss_is_fixed_by_the_fallback_within_budget():
    model = _chain(10, cancel=2000.0)
    rng = np.random.default_rng(2)
    sample = {"x": rng.standard_normal((4, 16)).astype(np.float32)}
    assert _error(model, onnxmp.convert(model).model, sample) > 0.05
    result = onnxmp.convert(model, calibration=[sample], tolerance=1e-2)
    cal = result.report.calibration
    assert cal["passed"] and cal["cycles"] <= 10
    assert _error(model, result.model, sample) <= 1e-2
    moved = {f["node"] for f in cal["fallback"]}
    assert moved and moved <= {"add_c", "sub_c"}
    colors = result.report.node_colors()
    # Once the amplifying Sub is fp32, the Add before it is no longer between allow ops either.
    assert colors["add_c"] != "allow" and colors["sub_c"] != "allow"
    matmuls = [n for n in colors if n.startswith("mm")]
    assert all(colors[n] == "allow" for n in matmuls)
    node = sorted(moved)[0]
    assert "accuracy fallback" in next(v.cause for v in result.report.vertices if v.node == node)


def test_calibration_that_already_passes_changes_nothing_in_the_coloring():
    model = _chain(4)
    sample = {"x": np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)}
    calibrated = onnxmp.convert(model, calibration=sample)
    plain = onnxmp.convert(model)
    assert calibrated.report.calibration["cycles"] == 1
    assert calibrated.model.SerializeToString() == plain.model.SerializeToString()


def test_calibration_input_errors_are_clear():
    model = _chain(2)
    with pytest.raises(onnxmp.OnnxMPError, match="not inputs of the model"):
        onnxmp.convert(model, calibration={"nope": np.zeros((2, 16), np.float32)})
    with pytest.raises(onnxmp.OnnxMPError, match="tolerance must be positive"):
        onnxmp.convert(model, calibration={"x": np.zeros((2, 16), np.float32)}, tolerance=0)


def test_cli_convert_with_calibration(tmp_path, capsys):
    from onnxmp.cli import main

    model = _chain(10, hot_block=3, gain=2000.0)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    npz = tmp_path / "real.npz"
    np.savez(npz, x=(np.random.default_rng(1).standard_normal((4, 16)) * 60).astype(np.float32))
    out = tmp_path / "o.onnx"
    assert main(["convert", str(path), "-o", str(out), "--calibrate", str(npz), "--tolerance", "0.01"]) == 0
    assert out.exists()
    assert "mm3" in capsys.readouterr().out


def test_fp32_amplifier_blames_its_low_precision_producer():
    model = _chain(4, cancel=2000.0)
    # Give the Add a second, allow-list consumer so it stays between allow ops while the Sub is
    # pinned to fp32 by name: the Sub then amplifies rounding that happened in the fp16 Add.
    w = onnx.numpy_helper.from_array(np.eye(16, dtype=np.float32) * np.float32(1e-3), "w_side")
    model.graph.initializer.append(w)
    model.graph.node.append(onnx.helper.make_node("MatMul", ["up", "w_side"], ["side"], name="mm_side"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("side", FLOAT, ["N", 16]))
    sample = {"x": np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)}
    assert onnxmp.explain(model, block_nodes=["^sub_c$"]).node_colors()["add_c"] == "allow"
    result = onnxmp.convert(model, calibration=sample, tolerance=1e-2, block_nodes=["^sub_c$"])
    cal = result.report.calibration
    assert cal["passed"]
    first = cal["history"][0]["denied"]
    assert [d["node"] for d in first] == ["add_c"]
    assert "feeds Sub `sub_c`" in first[0]["cause"]


def test_thousand_node_transformer_with_a_hidden_cancellation_is_fixed_within_budget():
    from models.zoo import inputs_for, transformer_stack

    model = transformer_stack(15)
    g = model.graph
    idx, node = next((i, n) for i, n in enumerate(g.node) if n.name == "layer7/ffn/fc1/MatMul")
    out = node.output[0]
    node.output[0] = out + "_pre"
    g.initializer.append(onnx.numpy_helper.from_array(np.array(2000.0, np.float32), "big_c"))
    g.node.insert(idx + 1, onnx.helper.make_node("Add", [out + "_pre", "big_c"], [out + "_up"], name="inj_add"))
    g.node.insert(idx + 2, onnx.helper.make_node("Sub", [out + "_up", "big_c"], [out], name="inj_sub"))
    assert len(g.node) >= 1000
    sample = inputs_for("transformer_stack")
    assert _error_of(model, onnxmp.convert(model).model, sample) > 1e-2
    result = onnxmp.convert(model, calibration=sample, tolerance=1e-2)
    cal = result.report.calibration
    assert cal["passed"] and cal["cycles"] <= 10
    assert {f["node"] for f in cal["fallback"]} <= {"inj_add", "inj_sub"}  # the source, not its victims
    assert result.report.tensor_core_share() >= 0.9


def _error_of(model, converted, sample) -> float:
    ref = run_with_intermediates(model, [sample])[0]
    out = run_with_intermediates(emulate(converted, keep_io_types=False), [sample])[0]
    return max(relative_error(ref[o.name], out[o.name]) for o in model.graph.output)


def test_tolerance_without_calibration_is_an_error():
    with pytest.raises(onnxmp.OnnxMPError, match="tolerance needs calibration"):
        onnxmp.convert(_chain(2), tolerance=1e-2)
