"""The release step (Conv/MatMul/Gemm back to fp16 after the search lands, with the proof for those kept)
and the candidates' colorings computed from seeds done once."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxmp
from onnxmp.calibrate.release import release_heavy
from onnxmp.calibrate.search import Oracle

pytest.importorskip("onnxruntime")


def _convs(n: int) -> list[str]:
    return [f"conv{i}" for i in range(n)]


def test_a_conv_whose_release_keeps_the_tolerance_goes_back_to_fp16_and_the_one_that_breaks_it_stays():
    convs = _convs(8)
    cheap = ["bn0", "bn1"]
    # conv5 in fp16 costs 3x the tolerance; every other Conv is free to go back.
    oracle = Oracle(lambda fp32: 0.5 if "conv5" in fp32 else 3.0, max_runs=100)
    kept, record = release_heavy([*cheap, *convs], frozenset(convs), [*convs, *cheap], oracle,
                                 dict.fromkeys(convs, "Conv"), tolerance=1e-2)
    assert sorted(kept) == ["bn0", "bn1", "conv5"]
    assert sorted(record.released) == sorted(set(convs) - {"conv5"})
    assert record.proven and [k.node for k in record.kept] == ["conv5"]
    assert record.kept[0].error_released == pytest.approx(3e-2)  # the proof's number: above the tolerance
    assert record.error == pytest.approx(5e-3)
    # All at once fails (1 run), then one at a time (8); conv5 again against the final set is the
    # all-at-once candidate, which the oracle has cached.
    assert record.runs == 9
    lines = record.summary_lines("float16", 1e-2, 10)
    assert "7 of the 8" in lines[0] and "conv5 (Conv): >= 0.03" in lines[-1] and "each breaks" in lines[1]


def test_no_conv_is_released_when_each_one_breaks_the_tolerance():
    convs = _convs(3)
    oracle = Oracle(lambda fp32: 0.9 if set(convs) <= fp32 else 1.5 + len(set(convs) - fp32), max_runs=100)
    kept, record = release_heavy(convs, frozenset(convs), convs, oracle, dict.fromkeys(convs, "Conv"), 1e-2)
    assert kept == convs and record.released == [] and record.proven
    assert [round(k.error_released, 4) for k in record.kept] == [0.025, 0.025, 0.025]


def test_every_conv_goes_back_at_once_in_one_run_when_the_set_passes_without_them():
    convs = _convs(6)
    oracle = Oracle(lambda fp32: 0.5 if "bn" in fp32 else 2.0, max_runs=100)
    kept, record = release_heavy(["bn", *convs], frozenset(convs), convs, oracle, {}, 1e-2)
    assert kept == ["bn"] and record.runs == 1 and record.kept == []


def test_a_conv_that_failed_before_a_later_release_is_measured_again_against_the_final_set():
    # Not monotone: conv0 passes only once conv1 is back in fp16 too (their roundings cancel, as twins'
    # do); conv3 must stay.  conv0 is tried first (least blamed) and fails, conv1 goes, then conv0 again.
    def score(fp32):
        if "conv3" not in fp32 or ("conv0" not in fp32 and "conv1" in fp32):
            return 2.0
        return 0.5

    oracle = Oracle(score, max_runs=100)
    heavy = frozenset({"conv0", "conv1", "conv3"})
    kept, record = release_heavy(["conv0", "conv1", "bn", "conv3"], heavy, ["conv3", "conv1", "conv0"],
                                 oracle, {}, 1e-2)
    assert kept == ["bn", "conv3"] and record.released == ["conv1", "conv0"]
    assert [k.node for k in record.kept] == ["conv3"] and record.proven


def test_the_run_budget_stops_the_release_and_the_report_says_the_proof_is_incomplete():
    convs = _convs(6)
    oracle = Oracle(lambda fp32: 0.5 if set(convs) <= fp32 else 2.0, max_runs=3)
    kept, record = release_heavy(convs, frozenset(convs), convs, oracle, {}, 1e-2)
    assert kept == convs and not record.proven
    assert "run budget ran out" in record.summary_lines("float16", 1e-2, 10)[1]


def test_an_island_of_more_convs_than_the_exhaustive_pass_takes_is_left_to_the_release_step():
    from onnxmp.calibrate.islands import EXHAUSTIVE_HEAVY, spare_heavy

    convs = _convs(3 * EXHAUSTIVE_HEAVY)
    cheap = [f"bn{i}" for i in range(3 * EXHAUSTIVE_HEAVY)]
    order = [*cheap, *convs]
    oracle = Oracle(lambda fp32: 0.5 if "conv5" in fp32 and set(cheap) <= fp32 else 2.0, max_runs=1000)
    spared, check = spare_heavy(order, order, frozenset(convs), oracle)
    assert spared is None and not check.exhaustive and check.candidates_run == 0
    kept, record = release_heavy(order, frozenset(convs), order, oracle, {}, 1e-2)
    assert set(kept) == {"conv5", *cheap} and record.proven


# --- colorings: cached from the seeds, identical to coloring from scratch ---------------------


def _block_net(blocks: int = 4, width: int = 16) -> onnx.ModelProto:
    """MatMul -> Add -> Relu -> Softmax-free blocks with a large-valued weight (an initializer-range
    seed) and a Reshape between blocks (a clear op the propagation moves)."""
    rng = np.random.default_rng(2)
    nodes, inits, cur = [], [numpy_helper.from_array(np.array([1, width], np.int64), "shape")], "x"
    for i in range(blocks):
        scale = 1e5 if i == 2 else 0.2  # block 2's bias exceeds float16's range: seeded deny
        inits += [numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32) * 0.2, f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(width).astype(np.float32) * scale, f"b{i}")]
        nodes += [helper.make_node("MatMul", [cur, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}"),
                  helper.make_node("Relu", [f"a{i}"], [f"r{i}"], name=f"relu{i}"),
                  helper.make_node("Reshape", [f"r{i}", "shape"], [f"s{i}"], name=f"reshape{i}")]
        cur = f"s{i}"
    nodes.append(helper.make_node("Identity", [cur], ["y"], name="out"))
    graph = helper.make_graph(nodes, "blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_cached_colorings_are_the_colorings_from_scratch_for_every_forced_set():
    from onnxmp.calibrate.colorings import Colorings
    from onnxmp.calibrate.driver import _Calibration
    from onnxmp.options import Options
    from onnxmp.pipeline import Conversion, Load, Normalize

    model = _block_net()
    samples = [{"x": np.random.default_rng(i).standard_normal((1, 16)).astype(np.float32)} for i in range(2)]
    cal = _Calibration(model, Options(calibration=samples, tolerance=1e-2, holdout=0))
    state = Conversion(cal.original, cal.resolved)
    Load().call(state)
    Normalize().call(state)
    options = state.resolved.replace(magnitudes=cal.magnitudes)
    cached, scratch = Colorings(state.normalized.index, options), Colorings(state.normalized.index, options, False)
    assert cached._seeded is not None and scratch._seeded is None  # the cache is really in use
    names = [n.name for n in cal.original.graph.node]
    sets = [(), ("mm0",), ("add1", "relu1"), ("reshape0",), ("mm1", "mm3"), names[::3], names]
    results = [cached.low(s) for s in sets]
    assert results == [scratch.low(s) for s in sets]
    assert len(set(results)) > 3  # the sets color differently: the comparison is not between equal answers
    assert "mm0" in results[0] and "mm0" not in results[1]
    # The per-vertex colors and rules agree too, not only the nodes that end low.
    a, b = cached.coloring(("mm1",)), scratch.coloring(("mm1",))
    assert {k: v[:2] for k, v in a.colors.items()} == {k: v[:2] for k, v in b.colors.items()}
    # The seeded state is left as it was: a second candidate starts from the same seeds.
    assert cached.low(()) == results[0] and cached.low(("mm0",)) == results[1]


def test_the_driver_reports_the_release_and_the_written_model_meets_the_tolerance():
    from onnxmp.parity.emulate import emulate
    from onnxmp.calibrate.session import cpu_session, run_samples
    from onnxmp.parity.metrics import relative_error

    from tests.test_calibrate_truth import _conv_net, _samples

    model, samples = _conv_net(layers=6), _samples(4)
    result = onnxmp.convert(model, calibration=samples, tolerance=5e-4, holdout=1)
    cal = result.report.calibration
    assert cal.met and cal.release is not None
    ref = list(run_samples(cpu_session(model, "model"), samples, ["y"]))
    out = list(run_samples(cpu_session(emulate(result.model, keep_io_types=False), "written"), samples, ["y"]))
    worst = max(relative_error(r["y"], o["y"]) for r, o in zip(ref, out))
    assert worst <= 5e-4 and worst == pytest.approx(cal.final.worst, rel=1e-3, abs=1e-7)
    text = "\n".join(cal.summary_lines())
    assert "release:" in text


# --- the release over the landed model: what earlier cycles forced, and the proof for every one ------


def _landed(tolerance: float = 5e-4):
    """A calibration of the Conv/BN/HardSwish net that lands with bn1 and the Gemm head in fp32."""
    from onnxmp.calibrate.driver import _Calibration
    from onnxmp.options import Options
    from tests.test_calibrate_truth import _conv_net, _samples

    cal = _Calibration(_conv_net(layers=6), Options(calibration=_samples(4), tolerance=tolerance, holdout=1))
    result = cal.run()
    assert result.report.calibration.met and "gemm" in cal.forced
    return cal


def test_a_conv_an_earlier_cycle_forced_goes_back_to_fp16_when_the_landed_set_passes_without_it():
    # conv3 forced as an earlier cycle would have left it: not in the last search's set, so its
    # release never tried it.  The release over the landed model does (fires).
    cal = _landed()
    forced = {**cal.forced, "conv3": "accuracy fallback: an earlier cycle"}
    best = cal.convert(forced)
    assert best.report.node_colors()["conv3"] != "allow"
    best_m = cal.measure(best)
    model, measured = cal.release_landed(best, best_m, forced)
    record = cal.report.release
    assert record.landed and "conv3" in record.released and record.proven
    assert model.report.node_colors()["conv3"] == "allow" and "conv3" not in cal.forced
    assert measured.meets(cal.tolerance)
    assert (model.report.tensor_core_share() or 0) > (best.report.tensor_core_share() or 0)


def test_a_forced_gemm_whose_release_breaks_the_tolerance_stays_and_is_listed_with_its_error():
    cal = _landed()
    forced = dict(cal.forced)
    best = cal.convert(forced)
    model, _ = cal.release_landed(best, cal.measure(best), forced)
    record = cal.report.release
    assert record.landed and record.proven and "gemm" not in record.released  # does not fire
    kept = {k.node: k.error_released for k in record.kept}
    assert kept["gemm"] > cal.tolerance
    assert model.report.node_colors()["gemm"] != "allow"
    # Every Conv/MatMul/Gemm of the written model in fp32 is in the proof: measured, or ruled by the coloring.
    colors, ops = model.report.node_colors(), {v.node: v.op for v in model.report.vertices}
    fp32 = {n for n, op in ops.items() if op in ("Conv", "MatMul", "Gemm") and colors[n] != "allow"}
    assert fp32 == set(kept) | {r.node for r in record.ruled}
    text = "\n".join(record.summary_lines("float16", cal.tolerance, 10))
    assert "all cycles" in text and "gemm (Gemm): >= " in text


def test_the_driver_releases_what_an_earlier_cycle_forced_and_each_accepted_candidate_passes_written(monkeypatch):
    import onnxmp.calibrate.driver as driver
    from tests.test_calibrate_truth import _conv_net, _samples

    real_search, real_release = driver._Calibration.search, driver._Calibration.release_landed
    real_scorer = driver._Calibration._scorer
    state = {"releasing": False}
    accepted: list[dict[str, str]] = []

    def search(self, low, *args, **kwargs):
        self._test = self  # the calibration, for the checks below
        found = real_search(self, low, *args, **kwargs)
        if "conv3" in low and all(m.node != "conv3" for m in found):  # as an earlier cycle forcing it
            found.append(driver.MovedNode("conv3", "Conv", "measurement", None, None))
        return found

    def release_landed(self, *args, **kwargs):
        # the base forced besides each candidate: none where the release reuses cycle 1's oracle
        state["releasing"], state["cal"], state["base"] = True, self, frozenset()
        try:
            return real_release(self, *args, **kwargs)
        finally:
            state["releasing"] = False

    def scorer(self, board, order, tol, base=frozenset()):
        if state["releasing"]:
            state["base"] = base
        return real_scorer(self, board, order, tol, base)

    class Recording(driver.Oracle):
        def __call__(self, fp32):
            probe = super().__call__(fp32)
            if state["releasing"] and probe.passed:
                accepted.append({**dict.fromkeys(state["base"], "base"), **dict.fromkeys(probe.fp32, "accepted")})
            return probe

    monkeypatch.setattr(driver._Calibration, "search", search)
    monkeypatch.setattr(driver._Calibration, "release_landed", release_landed)
    monkeypatch.setattr(driver._Calibration, "_scorer", scorer)
    monkeypatch.setattr(driver, "Oracle", Recording)
    result = onnxmp.convert(_conv_net(layers=6), calibration=_samples(4), tolerance=5e-4, holdout=1)
    cal = result.report.calibration
    assert cal.met and cal.release.landed and "conv3" in cal.release.released
    assert result.report.node_colors()["conv3"] == "allow"
    assert accepted, "the release accepted no candidate: nothing was checked"
    calibration = state["cal"]
    for candidate in accepted:
        assert calibration.measure(calibration.convert(candidate)).tune_error <= 5e-4, sorted(candidate)


def test_a_gemm_a_range_seed_keeps_in_fp32_is_listed_with_the_seed_not_tried():
    from onnxmp.calibrate.driver import _Calibration
    from onnxmp.options import Options
    from tests.test_calibrate_truth import _conv_net, _samples

    model = _conv_net(layers=6)
    head = next(t for t in model.graph.initializer if t.name == "head")
    # Weights that turn subnormal in float16: the range seed keeps the Gemm in fp32, whatever the search says.
    head.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(head) * 1e-6, "head"))
    cal = _Calibration(model, Options(calibration=_samples(4), tolerance=5e-4, holdout=1))
    plain = cal.convert({})
    assert plain.report.node_colors()["gemm"] != "allow"
    cal.run()
    forced = {**cal.forced, "conv3": "accuracy fallback: an earlier cycle"}
    best = cal.convert(forced)
    model, _ = cal.release_landed(best, cal.measure(best), forced)
    record = cal.report.release
    ruled = {r.node: r.reason for r in record.ruled}
    assert "seed_deny_from_initializer_range" in ruled["gemm"] and "gemm" not in {k.node for k in record.kept}
    assert "gemm (Gemm): seed_deny_from_initializer_range" in "\n".join(record.summary_lines("float16", 5e-4, 10))
