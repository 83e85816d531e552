"""The ``auto_`` forms: onnxmp's calibration search judged by the originals' pass/fail check.

The originals bisect node block lists, converting and running the model on onnxruntime each
time.  Here the caller's check becomes a metric for :func:`onnxmp.convert`'s calibration
(:mod:`onnxmp.calibrate`): error 0 when the check passes, 1 when it fails, tolerance 0.5.
Candidates are emulated (fp16 rounding on the CPU, as the target computes), and the model
found is then run for real, fed as the original's caller feeds it, and checked once more.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx

from onnxmp.compat._convert import CompatError, io_names
from onnxmp import runtime
from onnxmp.inputs import check_inputs

log = logging.getLogger("onnxmp.compat")

Check = Callable[[list, list], bool]
PASS, FAIL, TOLERANCE = 0.0, 1.0, 0.5


def allclose_check(validate_fn: Check | None, rtol: float | None, atol: float | None) -> Check:
    """onnxconverter-common's ``validate``: ``validate_fn`` (if any) and, with ``rtol``, np.allclose."""
    def validate(res1: list, res2: list) -> bool:
        if validate_fn is not None and not validate_fn(res1, res2):
            return False
        if rtol is not None:
            for r1, r2 in zip(res1, res2):
                if not np.allclose(r1, r2, rtol, atol):
                    return False
        return True

    return validate


def run(model: onnx.ModelProto | str, feed: Mapping[str, np.ndarray], providers: Sequence[str] | None = None,
        what: str = "model") -> list[np.ndarray]:
    """All outputs, in graph order, of ``model`` on onnxruntime; float feeds are cast to the width the
    model declares (the fp16 inputs of keep_io_types=False), as the caller of the original casts them."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model, load_external_data=False)
    feeds = check_inputs(proto, {k: v for k, v in feed.items()}, flag="feed_dict")
    # The providers as the original's caller names them; onnxruntime falls back to the CPU EP.
    session = runtime.session(model, what=what, provider_list=list(providers) if providers else None)
    return runtime.run(session, feeds, what)


def search(model: onnx.ModelProto, feed: Mapping[str, np.ndarray], validate: Check, keep_io_types,
           expected: list[np.ndarray]):
    """onnxmp's calibrated conversion, candidates judged by ``validate(expected, outputs)``."""
    import onnxmp

    outputs = [o.name for o in model.graph.output]

    def check(ref: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray]) -> float:
        return PASS if validate(expected, [out[name] for name in outputs]) else FAIL

    check.__name__ = "validate_fn"
    result = onnxmp.convert(model, keep_io_types=io_names(model, keep_io_types), calibration=dict(feed),
                            metric=check, tolerance=TOLERANCE, holdout=0)
    calibration = result.report.calibration
    if not calibration.met:
        raise CompatError("validation failed for final fp16 model",
                          hint="no mix of float16 and float32 that onnxmp tried passes the check "
                               "(validate_fn, rtol/atol)")
    if calibration.cycles and not any(v.color == "allow" for v in result.report.vertices):
        # The search moved every node back: no float16 candidate passed.  The original's
        # all-blocked model fails the check then too (its I/O Casts still round), and it raises.
        raise CompatError("validation failed for final fp16 model",
                          hint="the check rejects every candidate that computes anything in float16")
    log.info("%s", "\n".join(calibration.summary_lines()))
    return result
