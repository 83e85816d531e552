"""onnxconverter-common's ``auto_mixed_precision_model_path``: ``auto_convert_mixed_precision_model_path``,
same signature and defaults (1.16), onnxmp's calibration search underneath (:mod:`onnxmp.compat._auto`)."""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import numpy as np

from onnxmp.compat._auto import allclose_check, run, search
from onnxmp.compat._convert import CompatError
from onnxmp.files import guard_outputs
from onnxmp.load import load
from onnxmp.save import save

log = logging.getLogger("onnxmp.compat")

__all__ = ["auto_convert_mixed_precision_model_path"]

DEFAULT_LOCATION = "fp16_tensor.data"


def auto_convert_mixed_precision_model_path(source_model_path: str | os.PathLike,
                                            input_feed: Mapping[str, np.ndarray],
                                            target_model_path: str | os.PathLike, provider: Sequence[str],
                                            location: str | None = None, customized_validate_func=None, rtol=None,
                                            atol=None, keep_io_types=True, verbose=False) -> None:
    """Convert the model at ``source_model_path`` to mixed precision and write it to
    ``target_model_path``, its tensors in the external data file ``location`` beside it
    (default ``fp16_tensor.data``).  Returns None, as the original.

    The check is ``customized_validate_func(res_fp32, res_mixed)`` when given, otherwise
    ``np.allclose(r1, r2, rtol=rtol, atol=atol)`` per output (defaults 1e-3 and 1e-5).  The
    model found is run on ``provider`` (a list of onnxruntime provider names) and checked
    before it is written.  A source that is no path is a TypeError, an ``input_feed`` that is
    no dict, a missing source, or a check that the float32 model or the final model fails a
    ValueError.  Unlike the original, nothing is written until the model passed (atomically,
    through :func:`onnxmp.save`), the source is never overwritten, and float32 feeds are cast
    to float16 where ``keep_io_types=False`` made an input float16.
    """
    if not isinstance(source_model_path, (str, os.PathLike)):
        raise TypeError("auto_convert_mixed_precision_model_path only accepts model Path (String),"
                        "you can use auto_convert_mixed_precision for the ModelProto.")
    if not isinstance(input_feed, dict):
        raise CompatError("input_feed should be a dictionary such as {'modelInput': input_x.astype(np.float32)}")
    rtol = 1e-3 if rtol is None else rtol
    atol = 1e-5 if atol is None else atol
    location = DEFAULT_LOCATION if location is None else location
    if not os.path.exists(source_model_path):
        raise CompatError(f"source_model_path does not exist: {source_model_path}")
    level = logging.INFO if verbose else logging.DEBUG
    validate = customized_validate_func or allclose_check(None, rtol, atol)
    folder = os.path.dirname(os.fspath(target_model_path))
    if folder:
        os.makedirs(folder, exist_ok=True)  # the original creates the target's folder too
    guard_outputs({"target_model_path": target_model_path,
                   "external data": os.path.join(folder, location)},
                  {"source model": source_model_path})
    model = load(source_model_path)
    expected = run(source_model_path, input_feed, provider, what="float32 model")
    if not validate(expected, expected):
        raise CompatError("validation failed for fp32 model",
                          hint="customized_validate_func must accept the float32 outputs compared with themselves")
    log.log(level, "converting %s with onnxmp's calibration search", source_model_path)
    result = search(model, input_feed, validate, keep_io_types, expected)
    if not validate(expected, run(result.model, input_feed, provider, what="converted model")):
        raise CompatError("Validation failed for final fp16 model.",
                          hint="the model passed under fp16 emulation but not on the given provider")
    save(result.model, target_model_path, external_data=True, location=location, source=source_model_path)
    log.log(level, "wrote %s and its external data %s", target_model_path, location)
