"""The search's scorer (``driver._Calibration._scorer``): what a candidate costs in switchboard runs,
and that the savings never change a pass or a fail."""
from __future__ import annotations

import numpy as np
import pytest

from onnxmp.options import Options

pytest.importorskip("onnxruntime")

from onnxmp.calibrate.driver import _Calibration, _low_nodes  # noqa: E402
from onnxmp.calibrate.switchboard import Switchboard  # noqa: E402

from tests.test_calibrate import _culprit_chain, _samples  # noqa: E402


def _setup(metric=None):
    """A calibration over a one-culprit chain, its board, and each sample's all-low error."""
    options = Options(calibration=_samples(4, seed=7), tolerance=3e-2, holdout=0,
                      **({} if metric is None else {"metric": metric}))
    cal = _Calibration(_culprit_chain(6, {2}), options)
    low = _low_nodes(cal.original, cal.convert({}).report)
    board = Switchboard(cal.original, low)
    runs = []
    iter_run = board.iter_run

    def counted(off, samples, outputs=None):
        for out in iter_run(off, samples, outputs):
            runs.append(frozenset(off))
            yield out

    board.iter_run = counted
    errors = [max(cal.plan.errors([r], [o]).values()) for r, o in zip(cal.search_refs, board.run((), cal.search_samples))]
    runs.clear()
    return cal, board, runs, errors


def test_a_failing_sample_is_tried_first_by_the_next_candidates():
    cal, board, runs, errors = _setup()
    worst = int(np.argmax(errors))
    tol = (max(errors) + sorted(errors)[-2]) / 2  # only the worst sample fails all-low
    order = [i for i in range(4) if i != worst] + [worst]  # ... and it comes last
    evaluate = cal._scorer(board, order, tol)
    assert evaluate(frozenset()) > 1
    assert len(runs) == 4 and order[0] == worst
    # The next candidate that fails there fails on its first run.
    assert evaluate(frozenset({"relu0"})) > 1
    assert len(runs) == 5


def test_passing_candidates_run_every_sample_and_keep_the_order():
    cal, board, runs, errors = _setup()
    order = [3, 2, 1, 0]
    evaluate = cal._scorer(board, order, max(errors) * 2)
    assert evaluate(frozenset()) <= 1
    assert len(runs) == 4 and order == [3, 2, 1, 0]


def test_a_pooled_metric_runs_every_sample_even_when_it_fails():
    cal, board, runs, _ = _setup(metric="argmax")
    order = [0, 1, 2, 3]
    evaluate = cal._scorer(board, order, 1e-9)
    evaluate(frozenset())
    evaluate(frozenset())
    assert len(runs) == 8 and order == [0, 1, 2, 3]


def test_the_same_switches_are_one_model_and_run_once(monkeypatch):
    cal, board, runs, errors = _setup()
    evaluate = cal._scorer(board, [0, 1, 2, 3], max(errors) * 2)
    same = cal.written_off(board, frozenset({"culprit2"}), frozenset())
    monkeypatch.setattr(cal, "written_off", lambda b, fp32, base: same if "culprit2" in fp32 else frozenset())
    first = evaluate(frozenset({"culprit2"}))
    assert len(runs) == 4
    # Another forced set that writes the same model: no run; a different model: its own runs.
    assert evaluate(frozenset({"culprit2", "relu5"})) == first
    assert len(runs) == 4
    evaluate(frozenset({"relu5"}))
    assert len(runs) == 8


def test_the_full_score_of_a_failing_candidate_runs_only_the_samples_it_skipped():
    cal, board, runs, errors = _setup()
    worst = int(np.argmax(errors))
    tol = min(errors) / 2  # every sample fails all-low
    evaluate = cal._scorer(board, [worst, *(i for i in range(4) if i != worst)], tol)
    early = evaluate(frozenset())
    assert len(runs) == 1
    full = evaluate(frozenset(), full=True)
    assert len(runs) == 4
    assert full == pytest.approx(max(errors) / tol) and full >= early
    assert evaluate(frozenset(), full=True) == full and len(runs) == 4


@pytest.mark.parametrize("given", [False, True])
def test_calibration_sessions_do_not_spin(given):
    # Spinning intra-op threads burn a core through the Python work between runs; a caller's
    # options (the switchboard's) get the same.
    from onnxmp import runtime
    from onnxmp.calibrate.session import cpu_session

    model = _culprit_chain(2, set())
    options = runtime.session_options(optimization="disable") if given else None
    session = cpu_session(model, "model", options)
    assert session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_magnitudes_fold_the_finite_peak_with_or_without_inf_and_nan():
    from onnxmp.calibrate.samples import _fold_magnitudes

    out: dict[str, float] = {}
    _fold_magnitudes(out, {"plain": np.array([-7.0, 2.0], np.float32),
                           "inf": np.array([1.0, np.inf, -3.0], np.float32),
                           "nan": np.array([np.nan, -5.0], np.float32),
                           "all_nan": np.array([np.nan], np.float32)})
    assert out == {"plain": 7.0, "inf": 3.0, "nan": 5.0, "all_nan": 0.0}


def test_the_switchboard_alone_runs_without_a_memory_pattern():
    # Without memory reuse a pattern is one block the size of a whole run; with it, runs after a
    # change of switches took 1.4 to 3.4 s on layout_cdla.  The measurement keeps the default.
    from onnxmp.calibrate.session import cpu_session

    cal, board, _, _ = _setup()
    assert board.session.get_session_options().enable_mem_pattern is False
    assert cpu_session(cal.original, "model").get_session_options().enable_mem_pattern is True


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_float16_selections_cast_back_a_shared_low_copy_bfloat16_keeps_the_pair(precision):
    # float16: one Cast makes the low copy and each selection's "on" branch casts it back, so the
    # rounded values never take a float32 pass of their own; the values are the pair's, bit for bit.
    import onnx

    cal, _, _, _ = _setup()
    low = _low_nodes(cal.original, cal.convert({}).report)
    captured = {}
    from onnxmp.calibrate import switchboard as module
    create = module.cpu_session
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "cpu_session", lambda proto, *a: captured.setdefault("proto", proto) and create(proto, *a))
        board = Switchboard(cal.original, low, precision)
    graph = captured["proto"].graph
    ons = [a.g.node[0] for n in graph.node if n.op_type == "If" for a in n.attribute if a.name == "then_branch"]
    assert ons
    if precision == "float16":
        assert all(n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT for n in ons)
        assert board._low_copies
    else:
        assert all(n.op_type == "Identity" for n in ons) and not board._low_copies
    # Fetched rounded or raw, every probed value is float32.
    names = [*board.outputs, *board.probed]
    for off in ((), board.nodes):
        outs = next(board.iter_run(off, cal.search_samples[:1], names))
        assert all(outs[n].dtype == np.float32 for n in names)
