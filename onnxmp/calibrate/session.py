"""onnxruntime plumbing for calibration: the ONE place calibration creates a session, and the
per-sample run loop."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx

from onnxmp import runtime


def cpu_session(model: onnx.ModelProto, what: str, options=None):
    """A quiet onnxruntime CPU session over ``model`` (``options``: a SessionOptions to start from);
    a model it cannot load is an OnnxMPError naming ``what``.

    By default every calibration session runs with no onnxruntime optimization, as the switchboard
    does: one emulation for the search and the confirmation, the graph's arithmetic as written.  At
    the default level (all optimizations) the CPU EP rewrites an emulated graph across its rounding
    Casts (NCHWc Convs): PP-OCRv4's recognizer measured 0.235 there and 0.123 as written, plain
    conversion, same sample.  Even the basic level changes a mixed model's roundings: with half its
    nodes forced to fp32 it measured 0.046 at the basic level and 0.024 as written, which is what
    the switchboard measures for the same coloring.  Either way candidates the search accepted
    failed their confirmation.
    """
    options = options or runtime.session_options(optimization="disable")
    options.log_severity_level = 3
    # Calibration alternates short runs with Python work (the metric, the next candidate's coloring);
    # onnxruntime's spinning intra-op threads burn a core through all of it.  On 2 cores a
    # layout_cdla switchboard run took 0.45 CPU s spinning and 0.29 without, wall 0.23 and 0.19 s.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return runtime.session(model, what=f"{what} for calibration", options=options,
                           hint="check that the float32 model runs on onnxruntime CPU")


def run_samples(session, samples: Iterable[Mapping[str, np.ndarray]], outputs: Sequence[str] | None = None,
                extra: Mapping[str, np.ndarray] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """``outputs`` (default: all) of ``session`` per sample; arrays that feed no input are left out
    (a training file's labels), ``extra`` feeds are added to each sample."""
    allowed = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()] if outputs is None else list(outputs)
    for sample in samples:
        feeds = {k: v for k, v in sample.items() if k in allowed}
        feeds.update(extra or {})
        values = runtime.run(session, feeds, "calibration model", outputs=names,
                             hint="check the calibration inputs' shapes and dtypes")
        yield dict(zip(names, values))

