"""Calibration seeds, the switchboard, the bisection search and its run bound, hold-out, CLI contract."""
from __future__ import annotations

import logging
import math

import numpy as np
import onnx
import pytest

import onnxmp
from onnxmp.calibrate import (
    CalibrationReport, Measurement, SeededTensor, relative_error, run_with_intermediates, split_holdout,
)
from onnxmp.calibrate.driver import _low_nodes
from onnxmp.parity.emulate import emulate
from onnxmp.normalize import make_node_names_unique
from onnxmp.calibrate.search import RUNS_C, Oracle, find_fp32_set, run_bound
from onnxmp.calibrate.switchboard import Switchboard

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


def _samples(n: int, seed: int = 2, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": (rng.standard_normal((4, 16)) * scale).astype(np.float32)} for _ in range(n)]


def test_overflow_seen_only_on_real_data_is_denied_by_the_seed_without_a_search():
    model = _chain(10, hot_block=3, gain=2000.0)
    rng = np.random.default_rng(1)
    random_sample = {"x": rng.standard_normal((4, 16)).astype(np.float32)}
    real_sample = {"x": (rng.standard_normal((4, 16)) * 60).astype(np.float32)}  # "real" inputs are larger
    plain = onnxmp.convert(model).model
    assert _error(model, plain, random_sample) < 1e-2  # looks fine on random data ...
    assert _error(model, plain, real_sample) == np.inf  # ... overflows on real data

    result = onnxmp.convert(model, calibration=real_sample, tolerance=1e-2)
    cal = result.report.calibration
    assert cal.met and cal.cycles == [] and cal.runs == 1  # the rule did it: one measurement, no search
    assert _error(model, result.model, real_sample) <= 1e-2
    colors = result.report.node_colors()
    matmuls = [n for n in colors if n.startswith("mm")]
    assert sum(colors[n] == "allow" for n in matmuls) / len(matmuls) >= 0.9
    assert colors["mm3"] == "deny"
    cause = next(v.cause for v in result.report.vertices if v.node == "mm3")
    assert "`m3` reached" in cause and "calibration" in cause
    assert any(s.tensor == "m3" for s in cal.seeded)


def test_cancellation_is_found_by_the_search_and_confirmed_on_the_real_model():
    model = _chain(10, cancel=2000.0)
    samples = _samples(4)
    assert _error(model, onnxmp.convert(model).model, samples[0]) > 0.05
    result = onnxmp.convert(model, calibration=samples, tolerance=1e-2)
    cal = result.report.calibration
    assert cal.met and cal.final.tune_error <= 1e-2 and cal.final.holdout_error <= 1e-2
    assert cal.plain.tune_error > 0.05  # before and after are both reported
    assert cal.tune_samples == 3 and cal.holdout_samples == 1
    assert _error(model, result.model, samples[3]) <= 1e-2  # the written model, on the held-out sample
    moved = {m.node for m in cal.moved}
    assert moved and moved <= {"add_c", "sub_c"}
    for m in cal.moved:
        assert m.reason == "measurement" and m.error_with > 1e-2 >= m.error_without
    colors = result.report.node_colors()
    assert colors["add_c"] != "allow" and colors["sub_c"] != "allow"
    assert all(colors[n] == "allow" for n in colors if n.startswith("mm"))
    # The search scores what convert writes: denying one of the pair moves the other by propagation
    # (an infer op no longer between allow ops), so one forced node may be all it takes.
    assert any("accuracy fallback" in v.cause for v in result.report.vertices if v.node in moved)
    assert cal.runs <= run_bound(cal.candidates, len(moved))


def test_calibration_that_already_passes_changes_nothing_in_the_coloring():
    model = _chain(4)
    sample = {"x": np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)}
    calibrated = onnxmp.convert(model, calibration=sample)
    plain = onnxmp.convert(model)
    cal = calibrated.report.calibration
    assert cal.met and cal.runs == 1 and cal.moved == [] and cal.holdout_samples == 0
    assert calibrated.model.SerializeToString() == plain.model.SerializeToString()


def test_calibration_ignores_npz_arrays_that_are_no_model_input(tmp_path, caplog):
    """A training file holds the labels too; validate ignores them, calibration refused them."""
    sample = _samples(1)[0]
    np.savez(tmp_path / "train.npz", **sample, y=np.arange(4))
    with caplog.at_level(logging.INFO, logger="onnxmp"):
        result = onnxmp.convert(_chain(2), calibration=[str(tmp_path / "train.npz")])
    assert result.report.calibration.met
    assert "not model inputs: y" in caplog.text


def test_a_sample_with_an_all_nan_reference_is_refused_not_met():
    """NaN inputs made the fp32 output NaN everywhere; calibration reported MET at error 0."""
    nan = {"x": np.full((4, 16), np.nan, np.float32)}
    with pytest.raises(onnxmp.OnnxMPError, match="inf/NaN in every element on calibration sample 2"):
        onnxmp.convert(_chain(2), calibration=[_samples(1)[0], nan], holdout=1)
    partly = _samples(1)[0]
    partly["x"][0] = np.nan  # one row NaN: the other rows still judge
    assert onnxmp.convert(_chain(2), calibration=partly).report.calibration.met


def _with_sequence_and_optional_outputs(ragged: bool) -> onnx.ModelProto:
    """_chain(2) plus the sequence and optional outputs tf2onnx/torch exports can carry."""
    from onnx import helper

    model = _chain(2)
    out = model.graph.output[0].name
    second = "row" if ragged else out
    model.graph.node.extend([
        helper.make_node("ReduceSum", [out], ["row"], keepdims=1, name="row_sum"),
        helper.make_node("SequenceConstruct", [out, second], ["seq"], name="seq"),
        helper.make_node("Optional", [out], ["opt"], name="opt")])
    model.graph.output.extend([
        helper.make_tensor_sequence_value_info("seq", onnx.TensorProto.FLOAT, None),
        helper.make_value_info("opt", helper.make_optional_type_proto(
            helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, None)))])
    model.opset_import[0].version = max(model.opset_import[0].version, 18)
    return model


@pytest.mark.parametrize("ragged", [False, True])
def test_calibration_judges_sequence_and_optional_outputs(ragged):
    """A sequence output arrived as a list: AttributeError 'list' object has no attribute 'dtype'."""
    result = onnxmp.convert(_with_sequence_and_optional_outputs(ragged), calibration=_samples(2), holdout=1)
    cal = result.report.calibration
    assert cal.met and set(cal.final.holdout) == {result.model.graph.output[0].name, "seq", "opt"}


def test_calibration_input_errors_are_clear():
    model = _chain(2)
    with pytest.raises(onnxmp.OnnxMPError, match="no value for model input") as info:
        onnxmp.convert(model, calibration={"nope": np.zeros((2, 16), np.float32)})
    assert "--calibrate sample.npz" in info.value.hint  # was validate's "--inputs"
    with pytest.raises(onnxmp.OnnxMPError, match="tolerance must be positive"):
        onnxmp.convert(model, calibration={"x": np.zeros((2, 16), np.float32)}, tolerance=0)
    with pytest.raises(onnxmp.OnnxMPError, match="leaves no sample to tune on"):
        onnxmp.convert(model, calibration=_samples(2), holdout=2)
    for kwargs in ({"tolerance": 1e-2}, {"metric": "argmax"}, {"holdout": 1}, {"max_runs": 5}):
        with pytest.raises(onnxmp.OnnxMPError, match="needs calibration samples"):
            onnxmp.convert(_chain(2), **kwargs)


def test_holdout_split_is_automatic_and_explicit():
    s = _samples(8)
    assert [len(p) for p in split_holdout(s[:1], None)] == [1, 0]
    assert [len(p) for p in split_holdout(s[:2], None)] == [1, 1]
    assert [len(p) for p in split_holdout(s, None)] == [6, 2]
    assert [len(p) for p in split_holdout(s, 0)] == [8, 0]
    tune, held = split_holdout(s, 3)
    assert held[0] is s[5]  # the last K are held out


def test_fp32_amplifier_gets_its_low_precision_producer_moved():
    model = _chain(4, cancel=2000.0)
    # Give the Add a second, allow-list consumer so it stays between allow ops while the Sub is
    # pinned to fp32 by name: the Sub then amplifies rounding that happened in the fp16 Add.
    w = onnx.numpy_helper.from_array(np.eye(16, dtype=np.float32) * np.float32(1e-3), "w_side")
    model.graph.initializer.append(w)
    model.graph.node.append(onnx.helper.make_node("MatMul", ["up", "w_side"], ["side"], name="mm_side"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("side", FLOAT, ["N", 16]))
    assert onnxmp.explain(model, block_nodes=["^sub_c$"]).node_colors()["add_c"] == "allow"
    result = onnxmp.convert(model, calibration=_samples(3), tolerance=1e-2, block_nodes=["^sub_c$"])
    cal = result.report.calibration
    assert cal.met
    assert [m.node for m in cal.moved] == ["add_c"]


def _culprit_chain(blocks: int, culprits: set[int], width: int = 16) -> onnx.ModelProto:
    """``blocks`` MatMul+Relu blocks; after each block in ``culprits`` an Add (h + 2000) feeds a Sub that
    takes 2000 back off, pinned to fp32 by name, and a small side MatMul that keeps the Add between
    allow ops.  Exactly those Adds must return to fp32: any of them left in fp16 rounds h at 2000."""
    rng = np.random.default_rng(5)
    nodes, inits, outputs = [], [onnx.numpy_helper.from_array(np.array(2000.0, np.float32), "c")], ["y"]
    side_w = onnx.numpy_helper.from_array(np.eye(width, dtype=np.float32) * np.float32(1e-3), "w_side")
    inits.append(side_w)
    cur = "x"
    for i in range(blocks):
        inits.append(onnx.numpy_helper.from_array(
            (rng.standard_normal((width, width)) * np.sqrt(2.0 / width)).astype(np.float32), f"w{i}"))
        nodes.append(onnx.helper.make_node("MatMul", [cur, f"w{i}"], [f"m{i}"], name=f"mm{i}"))
        cur = f"m{i}"
        if i in culprits:
            nodes += [onnx.helper.make_node("Add", [cur, "c"], [f"up{i}"], name=f"culprit{i}"),
                      onnx.helper.make_node("Sub", [f"up{i}", "c"], [f"down{i}"], name=f"amp{i}"),
                      onnx.helper.make_node("MatMul", [f"up{i}", "w_side"], [f"side{i}"], name=f"side{i}")]
            outputs.append(f"side{i}")
            cur = f"down{i}"
        nodes.append(onnx.helper.make_node("Relu", [cur], [f"r{i}"], name=f"relu{i}"))
        cur = f"r{i}"
    nodes.append(onnx.helper.make_node("Identity", [cur], ["y"], name="out"))
    graph = onnx.helper.make_graph(nodes, "culprits", [onnx.helper.make_tensor_value_info("x", FLOAT, ["N", width])],
                                   [onnx.helper.make_tensor_value_info(o, FLOAT, None) for o in outputs], inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("culprits", [{7}, {3, 40}, {2, 25, 51}])
def test_k_culprits_out_of_n_are_found_within_the_documented_bound(culprits):
    model = _culprit_chain(60, culprits)
    # 60 fp16 layers accumulate ~5e-3 of rounding error on their own; a tolerance well above that
    # keeps the culprit test about culprits, not about the noise floor.
    result = onnxmp.convert(model, calibration=_samples(2, seed=7), tolerance=3e-2, holdout=0,
                            block_nodes=["^amp"])
    cal = result.report.calibration
    n, k = cal.candidates, len(culprits)
    assert n >= 100
    assert cal.met
    assert {m.node for m in cal.moved} == {f"culprit{i}" for i in culprits}
    assert cal.runs <= RUNS_C * k * math.log2(n), (cal.runs, n, k)


def test_search_alone_meets_the_bound_over_many_culprit_layouts():
    # The search on an exact culprit oracle (no model): every layout of k culprits among N.
    rng = np.random.default_rng(0)
    for n in (4, 16, 100, 1000):
        for k in (1, 2, 5):
            if k > n:
                continue
            nodes = [f"n{i}" for i in range(n)]
            for _ in range(5):
                guilty = set(rng.choice(nodes, size=k, replace=False))
                order = list(rng.permutation(nodes))
                oracle = Oracle(lambda fp32: 0.5 if guilty <= fp32 else 2.0, max_runs=10**6)
                found = find_fp32_set(order, oracle)
                assert {c.node for c in found} == guilty
                # The model-level bound adds the ranking's ceil(log2 N) runs and two real measurements.
                total = oracle.runs + math.ceil(math.log2(n)) + 2
                assert total <= RUNS_C * k * math.log2(max(n, 4)), (n, k, total)


def test_switchboard_all_off_is_fp32_and_all_on_is_the_real_conversion():
    from models.zoo import build, inputs_for

    model = build("transformer_block")
    make_node_names_unique(model.graph)
    sample = [inputs_for("transformer_block")]
    converted = onnxmp.convert(model)
    fills = {f.constant: f.value for f in converted.report.mask_fills}
    assert fills  # the block's float32.min mask fill is replaced: the switchboard must do it too
    board = Switchboard(model, _low_nodes(model, converted.report), fills=fills)
    names = [o.name for o in model.graph.output]
    ref = run_with_intermediates(model, sample)[0]
    real = run_with_intermediates(emulate(converted.model, keep_io_types=False), sample)[0]
    on, off = board.run([], sample)[0], board.run(board.nodes, sample)[0]
    for name in names:
        np.testing.assert_array_equal(on[name], real[name])
        np.testing.assert_allclose(off[name], ref[name], rtol=0, atol=1e-5)
        assert relative_error(ref[name], on[name]) > 0  # the switches do something


@pytest.mark.parametrize("keep", [False, True])
def test_switchboard_rounds_the_float16_interface_as_the_real_model_does(keep):
    # keep_io_types=False: the real model's x and y are float16 whatever its edge nodes compute in.  A
    # switchboard blind to that credited a float32 edge node with accuracy the model cannot have, so a
    # pass/fail check passed the candidate there and failed it on the real model, and the loop fell
    # back to all-float32.
    from onnxmp.calibrate.driver import _Calibration, _low_io
    from onnxmp.options import Options

    model = _chain(3)
    sample = _samples(1)
    cal = _Calibration(model, Options(calibration=sample, keep_io_types=keep, holdout=0))
    real = cal.convert({"mm0": "test", "relu2": "test", "out": "test"})  # the edge nodes in float32
    io = _low_io(cal.original, real.model)
    assert io == (frozenset() if keep else {"x", "y"})
    low = _low_nodes(cal.original, real.report)
    assert low and not {"mm0", "relu2", "out"} & set(low)
    expected = run_with_intermediates(emulate(real.model, keep_io_types=False), sample)[0]["y"]
    on = Switchboard(cal.original, low, low_io=io).run([], sample)[0]["y"]
    np.testing.assert_array_equal(on, expected)
    if not keep:  # blind to the interface, the switchboard misses the real model's rounding
        blind = Switchboard(cal.original, low).run([], sample)[0]["y"]
        assert not np.array_equal(blind, expected)


def test_budget_exhausted_returns_the_best_model_with_met_false_not_an_exception():
    model = _chain(10, cancel=2000.0)
    samples = _samples(3)
    result = onnxmp.convert(model, calibration=samples, tolerance=1e-2, max_runs=2)
    cal = result.report.calibration
    assert cal.met is False and cal.budget_exhausted
    assert cal.final.worst <= cal.plain.worst  # never worse than plain conversion
    assert cal.runs <= 3
    text = result.report.summary()
    assert "MISSED" in text and "above the tolerance" in text


def test_best_error_never_grows_between_cycles():
    from models import hard_cases

    model = hard_cases.correlated_rounding()
    result = onnxmp.convert(model, calibration=hard_cases.samples("correlated_rounding"), tolerance=1e-2)
    cal = result.report.calibration
    bests = [c.best_error for c in cal.cycles]
    assert bests == sorted(bests, reverse=True)
    assert cal.final.worst <= cal.plain.worst


def test_summary_caps_seeded_and_moved_lines_with_a_count():
    rep = CalibrationReport(tolerance=1e-2, metric={"y": "rel"}, threshold=1.0, samples=1, tune_samples=1,
                            holdout_samples=0, met=True, plain=Measurement({"y": 0.1}, None),
                            final=Measurement({"y": 0.001}, None),
                            seeded=[SeededTensor(f"t{i}", 1e5) for i in range(15)])
    lines = rep.summary_lines()
    assert sum("seeded fp32" in line for line in lines) == 10
    assert any("… 5 more" in line for line in lines)
    rep.seeded = rep.seeded[:10]
    assert not any("more" in line for line in rep.summary_lines())


def test_report_json_holds_the_typed_calibration_record():
    import json

    result = onnxmp.convert(_chain(10, cancel=2000.0), calibration=_samples(4), tolerance=1e-2)
    data = json.loads(result.report.to_json())
    cal = data["calibration"]
    assert cal["met"] is True and cal["runs"] >= 1 and cal["holdout_samples"] == 1
    assert {m["node"] for m in cal["moved"]} <= {"add_c", "sub_c"}
    assert cal["final"]["holdout"]["y"] <= 1e-2


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


def test_cli_exit_3_writes_the_best_model_when_the_tolerance_is_missed(tmp_path, capsys):
    from onnxmp.cli import main

    path = tmp_path / "m.onnx"
    onnx.save(_chain(10, cancel=2000.0), str(path))
    npzs = []
    for i, s in enumerate(_samples(3)):
        npzs.append(tmp_path / f"s{i}.npz")
        np.savez(npzs[-1], **s)
    out = tmp_path / "o.onnx"
    code = main(["convert", str(path), "-o", str(out), "--calibrate", *map(str, npzs), "--max-runs", "2",
                 "--metric", "y=rel"])
    captured = capsys.readouterr()
    assert code == 3
    assert out.exists()  # the best model found is written
    err = captured.err.strip().splitlines()
    assert err[0].startswith("onnxmp convert: error: calibration missed the tolerance: best error")
    assert err[1].startswith("  hint:") and len(err) == 2
    assert "MISSED" in captured.out


def test_cli_calibration_flags_need_calibrate(tmp_path, capsys):
    from onnxmp.cli import main

    path = tmp_path / "m.onnx"
    onnx.save(_chain(2), str(path))
    for flags in (["--metric", "argmax"], ["--holdout", "1"], ["--max-runs", "3"]):
        assert main(["convert", str(path), "-o", str(tmp_path / "o.onnx"), *flags]) == 2  # usage error
        assert "needs --calibrate" in capsys.readouterr().err


def test_a_held_out_miss_brings_the_held_out_samples_into_the_search_at_the_tolerance():
    # Large tuning inputs hide the cancellation's absolute error (~0.5); the small held-out input does not.
    # No tuning tolerance would stand in for it (the held-out error follows the fp32 set, not the tuning
    # error), so the held-out sample joins the search, the tolerance unchanged, and the report says so.
    samples = _samples(3, seed=4, scale=300.0) + _samples(1, seed=5, scale=1.0)
    result = onnxmp.convert(_chain(10, cancel=2000.0), calibration=samples, tolerance=1e-2)
    cal = result.report.calibration
    assert cal.plain.tune_error <= 1e-2 < cal.plain.holdout_error
    assert cal.met and cal.final.holdout_error <= 1e-2
    assert cal.cycles[0].tuning_tolerance == 1e-2
    assert cal.holdout_joined.startswith("cycle 1: tuning ")
    assert any("held-out samples joined the search" in line for line in cal.summary_lines())
    assert {m.node for m in cal.moved} <= {"add_c", "sub_c"}
    assert result.report.tensor_core_share() == 1.0


def test_when_the_search_finds_nothing_the_all_fp32_fallback_still_lands(monkeypatch):
    import onnxmp.calibrate.driver as calibrate

    monkeypatch.setattr(calibrate, "find_fp32_set", lambda order, oracle, fixed=(), **kw: [])
    result = onnxmp.convert(_chain(10, cancel=2000.0), calibration=_samples(3), tolerance=1e-2)
    cal = result.report.calibration
    assert cal.met and cal.final.worst <= 1e-2
    assert cal.moved and all(m.reason == "all-float32 fallback" for m in cal.moved)
    assert "every remaining node went back to fp32" in result.report.summary()
    # Why, in numbers: what was tried and what every node in fp32 measured.
    assert cal.fallback and "tolerance 0.01" in cal.fallback and "every node in fp32 measures" in cal.fallback
    assert f"{cal.plain.worst:.3g}" in cal.fallback
    assert "all-float32 fallback: " in result.report.summary()
    # The model is unchanged because calibration moved the allow-list nodes, not because none could run low.
    assert not result.report.changed
    assert result.report.unchanged_reason.startswith("calibration kept every node in float32")


def test_overflow_the_seed_misses_is_found_by_the_search_and_the_json_stays_strict():
    import json

    model = _chain(10, hot_block=3, gain=2000.0)
    rng = np.random.default_rng(1)
    rng.standard_normal((4, 16))
    sample = {"x": (rng.standard_normal((4, 16)) * 60).astype(np.float32)}  # overflows m3 (see the first test)
    result = onnxmp.convert(model, calibration=sample, tolerance=1e-2, calibration_threshold=1e30)  # no seeds
    cal = result.report.calibration
    assert cal.plain.tune_error == math.inf and cal.seeded == []
    assert cal.met and "mm3" in {m.node for m in cal.moved}

    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    data = json.loads(result.report.to_json(), parse_constant=no_constants)
    assert data["calibration"]["plain"]["tune"]["y"] == "inf"


def test_spread_error_stops_bisecting_node_by_node_and_returns_a_passing_prefix():
    # 400 nodes each adding a little error; passing needs 150 of them in fp32.  Node-by-node bisection
    # would take ~150 * 10 runs; the search caps the rounds and takes the ranking's passing prefix.
    n = 400
    order = [f"n{i}" for i in range(n)]
    oracle = Oracle(lambda fp32: (n - len(fp32)) / 250, max_runs=10**6)
    found = find_fp32_set(order, oracle)
    fp32 = {c.node for c in found}
    assert oracle(fp32).passed and len(fp32) <= 160
    assert any(c.score_with is None for c in found)  # prefix members, not measured one by one
    rounds = math.ceil(math.log2(n)) + 1
    assert oracle.runs <= rounds * (math.ceil(math.log2(n)) + 2) + 2


def test_calibration_names_unnamed_nodes_as_plain_conversion_does():
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).random((8, 8), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    sample = {"x": np.random.default_rng(1).random((2, 8), np.float32)}
    names = lambda m: sorted(n.name for n in m.graph.node if n.op_type in ("MatMul", "Relu"))  # noqa: E731
    assert names(onnxmp.convert(model, calibration=[sample]).model) == names(onnxmp.convert(model).model)


def test_galloping_finds_top_ranked_culprits_in_fewer_runs_than_bisecting_the_whole_order():
    n = 1000
    order = [f"n{i}" for i in range(n)]
    guilty = {"n1", "n3"}  # ranked near the top, as the attribution puts them
    plain = Oracle(lambda fp32: 0.5 if guilty <= fp32 else 2.0, max_runs=10**6)
    fast = Oracle(lambda fp32: 0.5 if guilty <= fp32 else 2.0, max_runs=10**6)
    assert {c.node for c in find_fp32_set(order, plain)} == guilty
    assert {c.node for c in find_fp32_set(order, fast, gallop=True)} == guilty
    assert fast.runs <= 0.7 * plain.runs, (fast.runs, plain.runs)  # 10 runs against 16


def test_galloping_still_finds_a_culprit_ranked_last():
    order = [f"n{i}" for i in range(100)]
    oracle = Oracle(lambda fp32: 0.5 if "n99" in fp32 else 2.0, max_runs=10**6)
    assert [c.node for c in find_fp32_set(order, oracle, gallop=True)] == ["n99"]


def test_attribution_ranks_the_node_that_adds_the_error_first_and_blames_upstream_of_an_amplifier():
    from onnxmp.calibrate.driver import _Calibration, _low_nodes
    from onnxmp.calibrate.attribution import attribution_ranking, local_attribution
    from onnxmp.options import Options

    model = _culprit_chain(8, {5})
    cal = _Calibration(model, Options(calibration=_samples(2, seed=7), tolerance=3e-2, holdout=0))
    low = _low_nodes(cal.original, cal.convert({}).report)
    board = Switchboard(cal.original, low)
    added = local_attribution(board, cal.tune)
    order = attribution_ranking(board.nodes, added, lambda m: low[m].op == "MatMul")
    assert "culprit5" in order[:3], order[:6]
    # Where nothing is rounded badly, nothing adds error worth ranking: a clean block ranks low.
    clean = [m for m in board.nodes if m in ("mm0", "relu0", "mm1", "relu1")]
    assert clean and added["culprit5"] > 10 * max(added[m] for m in clean)


def test_time_budget_keeps_the_best_model_found_so_far(monkeypatch):
    import onnxmp.calibrate.search as search

    model = _culprit_chain(20, {3, 11})
    clock = iter(range(0, 10**6, 1))  # every perf_counter() call advances one "second"
    monkeypatch.setattr(search.time, "perf_counter", lambda: float(next(clock)))
    result = onnxmp.convert(model, calibration=_samples(2, seed=7), tolerance=3e-2, holdout=0, time_budget=1e-3)
    cal = result.report.calibration
    assert cal.budget_exhausted
    assert cal.final.worst <= cal.plain.worst  # never worse than plain conversion


def test_time_budget_must_be_positive():
    with pytest.raises(onnxmp.OnnxMPError, match="time_budget"):
        onnxmp.convert(_culprit_chain(2, {0}), calibration=_samples(2), time_budget=0)


def test_a_conv_in_the_set_goes_back_to_fp16_when_the_cheap_ops_around_it_suffice():
    from onnxmp.calibrate.islands import spare_heavy

    order, heavy = ["conv", "bias", "norm", "act"], frozenset({"conv"})
    # Either the Conv in fp32, or its bias and norm: the bisection found the Conv; the island spares it.
    oracle = Oracle(lambda fp32: 0.5 if "conv" in fp32 or {"bias", "norm"} <= fp32 else 2.0, max_runs=100)
    spared, check = spare_heavy(["conv"], order, heavy, oracle)
    assert sorted(spared) == ["bias", "norm"]
    assert (check.members, check.kept_fp32, check.exhaustive) == (1, 0, True)


def test_a_conv_that_no_island_replaces_stays_and_the_exhaustive_pass_says_so():
    from onnxmp.calibrate.islands import spare_heavy

    order, heavy = ["conv", "bias", "norm"], frozenset({"conv"})
    oracle = Oracle(lambda fp32: 0.5 if "conv" in fp32 else 2.0, max_runs=100)
    spared, check = spare_heavy(["conv"], order, heavy, oracle)
    assert spared is None and check.kept_fp32 == 1 and check.exhaustive


def _relu_chain(names):
    nodes, cur = [], "x"
    for name in names:
        nodes.append(onnx.helper.make_node("Relu", [cur], [name + "_out"], name=name))
        cur = name + "_out"
    return onnx.helper.make_graph(nodes, "g", [], [])


def test_a_node_between_two_fp32_nodes_joins_the_island_to_save_its_casts():
    from onnxmp.calibrate.islands import fewer_casts
    from onnxmp.calibrate.switchboard import LowNode

    graph = _relu_chain(["a", "b", "c", "d"])
    low = {n.name: LowNode(n.name, "Relu", frozenset(n.input), frozenset(n.output)) for n in graph.node}
    oracle = Oracle(lambda fp32: 0.5 if {"a", "c"} <= fp32 else 2.0, max_runs=100)
    # b sits between a and c; d reads only c: both would cost Casts on every low-precision side.
    assert sorted(fewer_casts(["a", "c"], low, graph, frozenset(), oracle)) == ["a", "b", "c", "d"]
    # With c low, b has a low neighbour: nothing joins.
    assert fewer_casts(["a"], low, graph, frozenset(), oracle) == ["a"]


def test_attribution_in_groups_ranks_as_in_one_piece(monkeypatch):
    # A model whose intermediates exceed the memory limit is fetched group by group: same blame.
    import onnxmp.calibrate.attribution as attribution
    from onnxmp.calibrate.driver import _Calibration, _low_nodes
    from onnxmp.options import Options

    model = _culprit_chain(6, {2})
    cal = _Calibration(model, Options(calibration=_samples(2, seed=7), tolerance=3e-2, holdout=0))
    board = Switchboard(cal.original, _low_nodes(cal.original, cal.convert({}).report))
    whole = attribution.local_attribution(board, cal.tune)
    monkeypatch.setattr(attribution, "ATTRIBUTION_BYTES", 64)
    seen = []
    assert attribution.local_attribution(board, cal.tune, lambda i, out: seen.append((i, sorted(out)))) == whole
    assert seen == [(0, ["side2", "y"]), (1, ["side2", "y"])]


def test_paddles_dynamic_axes_minus_one_and_question_mark_take_any_size_and_a_fixed_one_still_checks():
    # PP-OCR's classifier declares its input [-1, 3, ?, ?]: onnxruntime runs any batch there.
    from onnxmp.calibrate import samples_from
    from onnxmp.errors import OnnxMPError

    x = onnx.helper.make_tensor_value_info("x", FLOAT, [-1, 4, "?", "?"])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x],
                                   [onnx.helper.make_tensor_value_info("y", FLOAT, [-1, 4, "?", "?"])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    (sample,) = samples_from(model, {"x": np.ones((3, 4, 48, 192), np.float32)})  # and "?" is no shared size
    assert sample["x"].shape == (3, 4, 48, 192)
    with pytest.raises(OnnxMPError, match="size 5 on axis 1; the model expects 4"):
        samples_from(model, {"x": np.ones((3, 5, 2, 2), np.float32)})
