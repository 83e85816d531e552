"""onnxconverter-common's ``auto_mixed_precision``: ``auto_convert_mixed_precision``, same signature
and defaults (1.16), onnxmp's calibration search underneath (:mod:`onnxmp.compat._auto`)."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from onnxmp.compat._auto import allclose_check, run, search
from onnxmp.compat._convert import CompatError
from onnxmp.load import ModelLike, load

__all__ = ["auto_convert_mixed_precision"]


def auto_convert_mixed_precision(model: ModelLike, feed_dict: Mapping[str, np.ndarray], validate_fn=None, rtol=None,
                                 atol=None, keep_io_types=False) -> onnx.ModelProto:
    """Convert ``model`` to mixed precision, keeping in float32 what ``validate_fn(res_fp32, res_mixed)``
    (both lists of output arrays, in graph order) and/or ``np.allclose(r1, r2, rtol, atol)`` per
    output need to pass.

    As in onnxconverter-common: ``rtol`` alone sets ``atol=1e-8``, ``atol`` alone sets
    ``rtol=1e-5``; ``validate_fn`` and ``rtol`` both None is a ValueError, and so is a check that
    fails the float32 model against itself or that no candidate passes ("validation failed for
    final fp16 model").  ``keep_io_types=False`` gives float16 graph inputs and outputs (the
    float32 arrays of ``feed_dict`` are cast to float16 to check the result, as the original
    does).  A new model is returned; the argument is not modified.
    """
    if rtol is None and atol is not None:
        rtol = 1e-5
    if atol is None and rtol is not None:
        atol = 1e-8
    if rtol is None and validate_fn is None:
        raise CompatError("Argument `validate_fn` and `rtol` cannot both be `None`.",
                          hint="pass rtol=1e-3 (and atol), or a validate_fn(res1, res2) -> bool")
    validate = allclose_check(validate_fn, rtol, atol)
    proto = load(model)
    expected = run(proto, feed_dict, what="float32 model")
    if not validate(expected, expected):
        raise CompatError("validation failed for original fp32 model",
                          hint="validate_fn must accept the float32 model's outputs compared with themselves")
    result = search(proto, feed_dict, validate, keep_io_types, expected)
    if not validate(expected, run(result.model, feed_dict, what="converted model")):
        raise CompatError("validation failed for final fp16 model",
                          hint="the model passed under fp16 emulation but not on onnxruntime CPU; "
                               "please report it")
    return result.model
