"""Calibration: data-driven deny seeds and the accuracy-guided search (``docs/calibration.md``).

One module per concern:

* :mod:`~onnxmp.calibrate.driver`: :func:`calibrate`, the loop (seeds, measure, search, confirm);
* :mod:`~onnxmp.calibrate.samples`: samples, hold-out split, float32 references, magnitudes;
* :mod:`~onnxmp.calibrate.switchboard`: one session whose every low node's rounding is switchable;
* :mod:`~onnxmp.calibrate.attribution`: the error each node adds, and the ranking;
* :mod:`~onnxmp.calibrate.search`: the bisection (the algorithm only) and its run bound;
* :mod:`~onnxmp.calibrate.islands`: shaping the float32 set into cheap islands;
* :mod:`~onnxmp.calibrate.release`: Conv/MatMul/Gemm back to low precision after landing, and the proof;
* :mod:`~onnxmp.calibrate.colorings`: the candidates' colorings, from seeds computed once;
* :mod:`~onnxmp.calibrate.session`: onnxruntime sessions and runs;
* :mod:`~onnxmp.calibrate.records`: the report; :mod:`~onnxmp.calibrate.progress`: the bar.
"""
from __future__ import annotations

from onnxmp.calibrate.driver import calibrate
from onnxmp.calibrate.records import REASONS, CalibrationReport, CycleRecord, Measurement, MovedNode, SeededTensor
from onnxmp.calibrate.samples import observe_magnitudes, run_with_intermediates, samples_from, split_holdout
from onnxmp.calibrate.search import run_bound
from onnxmp.options import DEFAULT_TOLERANCE
from onnxmp.parity.metrics import relative_error
from onnxmp.pipeline import ACCURACY_FALLBACK

__all__ = ["ACCURACY_FALLBACK", "CalibrationReport", "CycleRecord", "Measurement", "MovedNode", "REASONS",
           "SeededTensor", "DEFAULT_TOLERANCE", "calibrate", "observe_magnitudes", "relative_error",
           "run_with_intermediates", "samples_from", "split_holdout", "run_bound"]
