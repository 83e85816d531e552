"""Numerical parity of a (mixed-precision) candidate model against its float32 reference.

Both models run on onnxruntime with the same inputs, one after the other (the
reference's session is freed before the candidate's is built, so a model over
2 GB is in memory once), and every reference output is compared, by name, with
the candidate's:

* ``max_abs_err``: max |ref - cand|;
* ``max_rel_err``: max |ref - cand| / max |ref|.  Normwise, not elementwise:
  elementwise relative error explodes on values near zero, which fp16 cannot
  represent closely anyway, so it would flag every healthy model;
* ``cosine``: cosine similarity of the flattened outputs;
* ``top1``: share of rows whose argmax agrees, for classifier-like outputs
  (2-D ``[batch, classes > 1]`` floats).

Over several samples the worst case is kept (largest errors, smallest
cosine); top-1 agreement is pooled over all rows.  Errors are measured where
both outputs are finite; a position that is finite in one model only (fp16
overflow, NaN) fails the output outright.  Non-float outputs must match
exactly.

The reference always runs on the CPU, the plain float32 ground truth whatever
the candidate's provider (and whatever GPU math modes apply there).  With
``provider="cpu"`` a candidate that computes in float16/bfloat16 is emulated
(:mod:`onnxmp.parity.emulate`); with ``"cuda"`` it runs for real.

Default thresholds depend on the candidate's lowest precision.  Measured on
the models in ``models/`` converted in full by onnxconverter-common:

    model                    float16 rel / cosine     bfloat16 rel / cosine
    MLP, CNN, GRU, LSTM      <= 8e-4 / >= 0.9999997   <= 9e-3 / >= 0.99998
    transformer, 1 layer     6.3e-4 / 0.9999999       7.2e-3 / 0.99999
    transformer, 12 layers   2.3e-3 / 0.9999993       2.0e-2 / 0.99995
    transformer, 24 layers   2.9e-3 / 0.9999988       2.3e-2 / 0.99992

so float16 defaults to ``cosine >= 0.999, rel <= 1e-2`` and bfloat16 (8
mantissa bits to fp16's 11) to ``cosine >= 0.995, rel <= 5e-2``: 2-4x room over
a 24-layer fully converted transformer, while a broken conversion (the
overflowing BatchNorm variance of ``cnn_bn_bigvar``) scores cosine 0.06.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from onnxmp import runtime
from onnxmp.load import as_model
from onnxmp.parity.emulate import emulate, low_precision_types
from onnxmp.errors import OnnxMPError
from onnxmp.external import discard_spilled
from onnxmp.inputs import Sample, as_samples, check_inputs, drop_extra_inputs, generate_inputs
from onnxmp.naming import json_safe
from onnxmp.precision import BFLOAT16, FLOAT16, FLOAT32
from onnxmp.targets import CPU, target
from onnxmp.verify import runtime_load_error

log = logging.getLogger("onnxmp.validate")

METRICS = ("max_abs_err", "max_rel_err", "cosine", "top1")


@dataclass
class Thresholds:
    """Pass limits; ``None`` disables a check."""

    cosine_min: float | None = 0.999
    rel_err_max: float | None = 1e-2
    abs_err_max: float | None = None
    # Off by default: near-tied logits may legitimately swap under fp16.
    top1_min: float | None = None


DEFAULT_THRESHOLDS = {
    "float16": Thresholds(cosine_min=0.999, rel_err_max=1e-2),
    "bfloat16": Thresholds(cosine_min=0.995, rel_err_max=5e-2),
    # A candidate left in float32 (nothing was converted) is held to the
    # float16 limits: those are what the conversion promised.
    "float32": Thresholds(cosine_min=0.999, rel_err_max=1e-2),
}


@dataclass
class ErrorHistogram:
    """Counts of |ref - cand| in log-spaced bins, for plotting without keeping every error.

    Exact matches are counted apart (a log axis has no 0); errors outside the
    bin range land in the end bins.
    """

    edges: list[float] = field(default_factory=lambda: np.logspace(-12, 12, 24 * 4 + 1).tolist())
    counts: list[int] = field(default_factory=lambda: [0] * (24 * 4))
    zeros: int = 0

    def add(self, errors: np.ndarray) -> None:
        errors = errors[np.isfinite(errors)]
        nonzero = errors[errors > 0]
        self.zeros += int(errors.size - nonzero.size)
        edges = np.asarray(self.edges)
        clipped = np.clip(nonzero, edges[0], np.nextafter(edges[-1], 0))
        counts, _ = np.histogram(clipped, bins=edges)
        self.counts = (np.asarray(self.counts) + counts).tolist()


@dataclass
class OutputParity:
    name: str
    dtype: str
    shape: list[int]
    exact: bool  # compared for equality (non-float output)
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    cosine: float | None = None
    top1: float | None = None
    nonfinite_mismatches: int = 0  # elements finite in one model only (or different inf/NaN)
    compared: int = 0  # elements finite in both models, which the error metrics are computed over
    mismatches: int = 0  # unequal elements of an exactly compared output
    histogram: ErrorHistogram = field(default_factory=ErrorHistogram)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclass
class ParityReport:
    outputs: list[OutputParity]
    thresholds: Thresholds
    samples: int
    provider: str
    precision: str  # the candidate's lowest precision; picks the default thresholds
    emulated: list[str]  # low-precision types emulated on CPU

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    def failures(self) -> list[str]:
        return [f"{o.name}: {reason}" for o in self.outputs for reason in o.failures]

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["passed"] = self.passed
        for out, src in zip(data["outputs"], self.outputs):
            out["passed"] = src.passed
        return json_safe(data)

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text; non-finite floats are written as the strings "inf", "-inf", "nan"."""
        return json.dumps(self.to_dict(), indent=indent)

    def summary(self) -> str:
        header = ("output", "shape", "max|err|", "rel err", "cosine", "top-1", "result")
        rows = [header]
        for o in self.outputs:
            if o.exact or not o.compared:  # nothing finite compared: no figure to show
                metrics = ("-", "-", "-", "-")
            else:
                metrics = (_fmt(o.max_abs_err, ".3e"), _fmt(o.max_rel_err, ".3e"), _fmt(o.cosine, ".8f"),
                           "-" if o.top1 is None else f"{100 * o.top1:.1f}%")
            result = "ok" if o.passed else "FAIL"
            if o.exact:
                result += f" (exact, {o.mismatches} differ)"
            rows.append((o.name, "x".join(map(str, o.shape)) or "scalar", *metrics, result))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        t = self.thresholds
        limits = [f"cosine >= {t.cosine_min}" if t.cosine_min is not None else "",
                  f"rel err <= {t.rel_err_max}" if t.rel_err_max is not None else "",
                  f"max|err| <= {t.abs_err_max}" if t.abs_err_max is not None else "",
                  f"top-1 >= {t.top1_min}" if t.top1_min is not None else ""]
        how = "emulated on CPU" if self.emulated else f"run on {self.provider}"
        lines.append(f"thresholds: {', '.join(x for x in limits if x) or 'none'}")
        lines.append(f"samples: {self.samples}; candidate: {self.precision}, {how}")
        lines.append("PASSED" if self.passed else "FAILED: " + "; ".join(self.failures()))
        return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _is_float(array: np.ndarray) -> bool:
    return np.issubdtype(array.dtype, np.floating) or "float" in array.dtype.name


# --- comparing ---------------------------------------------------------------------


def _compare(result: OutputParity, ref: np.ndarray, cand: np.ndarray, metrics: set[str],
             rows: list[int]) -> None:
    """Fold one sample's comparison into ``result`` (worst case over samples)."""
    if ref.shape != cand.shape:
        reason = f"shape {list(cand.shape)} differs from the reference's {list(ref.shape)}"
        if reason not in result.failures:
            result.failures.append(reason)
        return
    if result.exact:
        result.mismatches += int(np.count_nonzero(ref != cand))
        return
    r = ref.astype(np.float64)
    c = cand.astype(np.float64)
    finite = np.isfinite(r) & np.isfinite(c)
    same_special = (np.isnan(r) & np.isnan(c)) | (~finite & (r == c))
    result.nonfinite_mismatches += int(np.count_nonzero(~finite & ~same_special))
    result.compared += int(np.count_nonzero(finite))

    r_f, c_f = r[finite], c[finite]
    errors = np.abs(r_f - c_f)
    result.histogram.add(errors)
    max_abs = float(errors.max()) if errors.size else 0.0
    scale = float(np.abs(r_f).max()) if errors.size else 0.0
    max_rel = max_abs / scale if scale > 0 else max_abs
    norms = float(np.linalg.norm(r_f)) * float(np.linalg.norm(c_f))
    if norms > 0:
        cosine = float(np.dot(r_f, c_f)) / norms
    else:
        cosine = 1.0 if np.array_equal(r_f, c_f) else 0.0
    if "max_abs_err" in metrics:
        result.max_abs_err = max(result.max_abs_err or 0.0, max_abs)
    if "max_rel_err" in metrics:
        result.max_rel_err = max(result.max_rel_err or 0.0, max_rel)
    if "cosine" in metrics:
        result.cosine = cosine if result.cosine is None else min(result.cosine, cosine)
    if "top1" in metrics and r.ndim == 2 and r.shape[1] > 1:
        rows[0] += int(np.count_nonzero(np.argmax(r, axis=1) == np.argmax(c, axis=1)))
        rows[1] += r.shape[0]


def _judge(result: OutputParity, limits: Thresholds) -> None:
    if result.failures:  # a shape mismatch makes the metrics meaningless
        return
    if result.exact:
        if result.mismatches:
            result.failures.append(f"{result.mismatches} elements differ ({result.dtype} must match exactly)")
        return
    if result.nonfinite_mismatches:
        result.failures.append(f"{result.nonfinite_mismatches} elements are inf/NaN in one model only "
                               "(overflow or NaN in the candidate?)")
    elif not result.compared and math.prod(result.shape) > 0:
        # Both inf/NaN everywhere: the metrics would read as a perfect match of nothing.
        result.failures.append("no element is finite in both models (the reference is inf/NaN everywhere: "
                               "NaN or inf in the inputs?)")
    checks = [
        (result.cosine, limits.cosine_min, lambda v, t: v < t, "cosine {v:.6f} < {t}"),
        (result.max_rel_err, limits.rel_err_max, lambda v, t: v > t, "max rel err {v:.3e} > {t}"),
        (result.max_abs_err, limits.abs_err_max, lambda v, t: v > t, "max abs err {v:.3e} > {t}"),
        (result.top1, limits.top1_min, lambda v, t: v < t, "top-1 agreement {v:.4f} < {t}"),
    ]
    for value, limit, fails, message in checks:
        if value is not None and limit is not None and fails(value, limit):
            result.failures.append(message.format(v=value, t=limit))


# --- running -----------------------------------------------------------------------


def _warn_if_no_tensor_cores() -> None:
    """Best effort: fp16 is only faster on GPUs with Tensor Cores (compute capability >= 7.0)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        name, cap = out.splitlines()[0].rsplit(",", 1)
        capability = float(cap)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.debug("cannot read the GPU compute capability: %s", exc)
        return
    if capability < 7.0:
        log.warning("GPU %s has compute capability %.1f (< 7.0, no Tensor Cores): "
                    "float16 will not be faster than float32 there", name.strip(), capability)


def _session(model: onnx.ModelProto, provider: str, role: str):
    chosen = target(provider, "provider")
    runtime.check_device(provider, "install onnxruntime-gpu (onnxmp[gpu]), or use --provider cpu to emulate "
                                   "low precision")
    # On the CPU the candidate is emulated; the reference runs the same way, so that neither
    # side's numbers depend on which fusions ORT picks.  No optimization at all there, as
    # calibration measures (calibrate/session.py): even ORT's basic level changed a mixed model's
    # roundings (PP-OCRv4's recognizer, half its nodes in fp32: 0.046 against 0.024 as written), and
    # the error validate reports must be the one calibration accepted.
    options = runtime.session_options(optimization="disable") if chosen.emulated else runtime.session_options()
    return runtime.session(model, what=f"{role} model", device=provider, options=options)


def check_loads(model: onnx.ModelProto, role: str) -> None:
    """Raise :class:`OnnxMPError` when this onnxruntime refuses ``model`` itself at session creation
    (graph resolution: a type parameter bound to two types, a type a schema does not allow).

    On a CPU-only machine a low-precision model made for the GPU may find no CPU kernel for some
    node; onnxruntime then says NOT_IMPLEMENTED, "Could not find an implementation", after the
    graph resolved (or "Failed to find kernel ... Kernel not found" for an op the CPU EP lacks in
    every type, com.microsoft GroupNorm).  That is no fault of the model and passes, logged.
    """
    message = runtime_load_error(model)
    if message is not None:
        raise OnnxMPError(f"onnxruntime {runtime.version()} cannot load the {role} model itself: {message}",
                          "a model converted for another onnxruntime (convert's --ort-version) may not load in "
                          "this one; convert it for this one, or report it with the model")


def _run(session, model: onnx.ModelProto, sample: Sample, role: str) -> dict[str, np.ndarray]:
    try:
        feeds = check_inputs(model, sample)
    except OnnxMPError as exc:
        raise OnnxMPError(f"{role} model: {exc.message}", exc.hint) from None
    for name, array in feeds.items():
        if array.dtype.name == "bfloat16":
            raise OnnxMPError(f"{role} model input {name!r} is bfloat16, which onnxruntime's Python API "
                              "cannot feed", "convert with keep_io_types=True, or use --provider cpu")
    return dict(zip((o.name for o in session.get_outputs()), runtime.run(session, feeds, f"{role} model")))


def _outputs(model: onnx.ModelProto, given: onnx.ModelProto, provider: str, role: str,
             samples: Sequence[Sample]) -> Iterable[dict[str, np.ndarray]]:
    """``model``'s outputs on each sample, from one session; ``model`` is ``given`` or its emulated copy,
    whose spilled weights are deleted once the session holds them."""
    session = _session(model, provider, role)
    if model is not given:
        discard_spilled(model, keep=[given])
    for sample in samples:
        yield _run(session, model, sample, role)


def _samples(model: onnx.ModelProto, inputs, dims, seed: int) -> list[Sample]:
    if inputs is None:
        return [generate_inputs(model, dims, seed=seed)]
    if dims:
        log.warning("--dims is ignored: the inputs given fix every shape")
    return as_samples(inputs)


def _thresholds(thresholds: Thresholds | Mapping[str, float | None] | None, precision: str) -> Thresholds:
    if isinstance(thresholds, Thresholds):
        return thresholds
    limits = dataclasses.replace(DEFAULT_THRESHOLDS[precision])
    known = {f.name for f in dataclasses.fields(Thresholds)}
    for key, value in (thresholds or {}).items():
        if key not in known:
            raise OnnxMPError(f"unknown threshold {key!r}", f"known: {', '.join(sorted(known))}")
        setattr(limits, key, value)
    return limits


def _emulated(model: onnx.ModelProto, precisions: list[str]) -> onnx.ModelProto:
    """``model`` with its ``precisions`` (``low_precision_types(model)``) emulated in float32."""
    for precision in precisions:
        # float32 I/O: onnxruntime's Python API cannot feed bfloat16, and
        # rounding on entry reproduces what a low-precision input would hold.
        model = emulate(model, precision, keep_io_types=False)
    return model


def validate(reference: onnx.ModelProto | str | os.PathLike, candidate: onnx.ModelProto | str | os.PathLike,
             inputs: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]] | str | os.PathLike
             | Sequence[str | os.PathLike] | None = None, *, provider: str = "cpu",
             metrics: Iterable[str] | None = None,
             thresholds: Thresholds | Mapping[str, float | None] | None = None,
             dims: Mapping[str, int] | None = None, seed: int = 0) -> ParityReport:
    """Run ``reference`` and ``candidate`` on the same inputs and compare every output.

    ``inputs``: one sample (dict), several, or ``.npz`` paths; ``None``
    generates one sample from the reference's input metadata (``dims`` sets
    its symbolic dims, ``seed`` its values).  ``metrics`` restricts the
    metrics computed (and so checked) to a subset of :data:`METRICS`.
    ``thresholds`` overrides the defaults for the candidate's precision,
    wholly (a :class:`Thresholds`) or per key (a dict).
    """
    target(provider, "provider")  # a clear error for an unknown one, before any work
    wanted = set(METRICS if metrics is None else metrics)
    if wanted - set(METRICS):
        raise OnnxMPError(f"unknown metric(s) {', '.join(sorted(wanted - set(METRICS)))}",
                          f"known: {', '.join(METRICS)}")
    ref_model = as_model(reference)
    cand_model = as_model(candidate)
    cand_precisions = low_precision_types(cand_model)
    ref_precisions = low_precision_types(ref_model)
    if ref_precisions and not cand_precisions:
        # Not an error: comparing two precisions either way round is legitimate, but the float32
        # thresholds then apply to a low-precision model, and that is almost always a slip.
        log.warning("the reference holds %s tensors and the candidate none: are they swapped? "
                    "The reference comes first, the converted model second",
                    " and ".join(ref_precisions))
    precision = next((p for p in (BFLOAT16.name, FLOAT16.name) if p in cand_precisions), FLOAT32.name)
    limits = _thresholds(thresholds, precision)

    cand_outputs = {o.name for o in cand_model.graph.output}
    missing = [o.name for o in ref_model.graph.output if o.name not in cand_outputs]
    if missing:
        raise OnnxMPError(f"the candidate has no output named {', '.join(map(repr, missing))}",
                          "outputs are compared by name; the candidate must keep the reference's names")
    samples = drop_extra_inputs(ref_model, _samples(ref_model, inputs, dims, seed))

    ref_run = _emulated(ref_model, ref_precisions)  # a reference with fp16 in it still runs on the CPU
    emulated: list[str] = []
    if target(provider, "provider").emulated:
        cand_run, emulated = _emulated(cand_model, cand_precisions), cand_precisions
    else:
        cand_run = cand_model
        _warn_if_no_tensor_cores()
    if emulated:
        log.info("emulating %s numerics of the candidate on CPU", " and ".join(emulated))
        check_loads(cand_model, "candidate")  # the emulated copy loading says nothing of the model itself

    # One session at a time: the reference's outputs are kept (small next to the weights) and its
    # session is freed before the candidate's is built, so a large model's weights are in memory once.
    ref_outs = list(_outputs(ref_run, ref_model, CPU.name, "reference", samples))
    results: dict[str, OutputParity] = {}
    top1_rows: dict[str, list[int]] = {}
    for ref_out, cand_out in zip(ref_outs, _outputs(cand_run, cand_model, provider, "candidate", samples)):
        for name, ref in ref_out.items():
            if name not in results:
                results[name] = OutputParity(name=name, dtype=ref.dtype.name, shape=list(ref.shape),
                                             exact=not _is_float(ref))
                top1_rows[name] = [0, 0]
            _compare(results[name], ref, cand_out[name], wanted, top1_rows[name])
    for name, result in results.items():
        agree, total = top1_rows[name]
        if total:
            result.top1 = agree / total
        _judge(result, limits)
    return ParityReport(outputs=list(results.values()), thresholds=limits, samples=len(samples),
                        provider=provider, precision=precision, emulated=emulated)
