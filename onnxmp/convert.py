"""The public entry points: :func:`convert` and :func:`explain`.

Both take the model and an :class:`~onnxmp.options.Options` (or its fields as keywords).
``convert`` runs the pipeline (:mod:`onnxmp.pipeline`) once, or, given calibration samples,
the accuracy-guided search around it (:mod:`onnxmp.calibrate`); ``explain`` runs the analysis
only.
"""
from __future__ import annotations

import logging

from onnxmp.calibrate import calibrate, observe_magnitudes
from onnxmp.load import ModelLike, load
from onnxmp.options import Options
from onnxmp.pipeline import ConversionResult, analyse, convert_once
from onnxmp.report import Report
from onnxmp.verify import check_input_model

log = logging.getLogger("onnxmp.convert")

__all__ = ["ConversionResult", "convert", "explain"]


def convert(model: ModelLike, options: Options | None = None, /, **changes) -> ConversionResult:
    """Convert ``model`` (a path or a ModelProto, never modified) to mixed precision with TF's AMP
    algorithm: ``onnxmp.convert(model, precision="bfloat16", keep_io_types=["logits"])``.

    ``options`` and the keywords are those of :class:`~onnxmp.options.Options`.  The result holds
    the verified model and its :class:`~onnxmp.report.Report`.  With ``calibration`` samples a
    missed tolerance is not an exception: ``result.report.calibration.met`` is False and the model
    is the best found.
    """
    options = Options.of(options, **changes)
    if options.calibration is not None:
        return calibrate(model, options)
    options.check_calibration()
    return convert_once(model, options)


def explain(model: ModelLike, options: Options | None = None, /, **changes) -> Report:
    """Color ``model`` and return the report, without rewriting anything.

    With ``calibration`` samples the magnitude seed is applied (the accuracy-guided search needs
    a rewrite, so it is :func:`convert`'s alone)."""
    options = Options.of(options, **changes)
    options.check_calibration()
    if options.calibration is None:
        return analyse(model, options)
    proto = load(model, lazy_external=True)
    resolved = options.resolve(proto)
    check_input_model(proto)  # refuse what convert would refuse before running the model
    return analyse(proto, resolved.replace(magnitudes=observe_magnitudes(proto, options.calibration)))
