"""Accuracy metrics for calibration: how far a candidate's outputs are from the float32 reference.

Every metric is an **error**: 0 is a perfect match, larger is worse, and a
candidate meets ``tolerance`` when the error of every output is ``<= tolerance``.
Metrics that users think of as agreement are turned into disagreement:

=============  =================================================  ==========================
spec           error of one output                                 tolerance 0.01 means
=============  =================================================  ==========================
``rel``        max|ref - out| / max|ref|  (normwise, default)      1% of the output's range
``max_abs``    max|ref - out|                                      no element off by > 0.01
``cosine``     1 - cosine(ref, out), flattened                     cosine >= 0.99
``argmax``     share of rows whose last-axis argmax differs        >= 99% of rows agree
``binary:T``   share of elements where ``x > T`` differs           >= 99% of pixels agree
callable       whatever it returns (an error, lower is better)     returns <= 0.01
=============  =================================================  ==========================

Over several samples ``rel``, ``max_abs``, ``cosine`` and callables keep the
worst sample; ``argmax`` and ``binary:T`` pool every row or element of every
sample (a batch of one row per sample would otherwise turn one flip into 100%).
An output that is non-finite where the reference is finite has error ``inf``
under ``rel``, ``max_abs`` and ``cosine``.  Non-float outputs (indices, masks)
are compared for equality: their error is the share of elements that differ.

A :class:`MetricPlan` says which metric applies to which output: one spec for
all outputs, a mapping ``{output: spec}`` (outputs not named get ``rel``), the
CLI's ``["out1=argmax", "rel"]`` form, or one callable
``fn(ref_outputs: dict, out_outputs: dict) -> float`` judging the whole model.
"""
from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from onnxmp.errors import OnnxMPError

DEFAULT_METRIC = "rel"
# Metrics named by themselves; ``binary:T`` carries its threshold in the name.
PLAIN = ("rel", "max_abs", "cosine", "argmax")
NAMES = (*PLAIN, "binary:T")
MODEL_LABEL = "<model>"  # the label of a whole-model callable's error

Outputs = Mapping[str, np.ndarray]


def _finite_pairs(ref: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The elements where ``ref`` is finite, flattened, as float64; None when shapes differ or
    ``cand`` is non-finite where ``ref`` is finite (the candidate then fails outright)."""
    ref = np.asarray(ref, dtype=np.float64).ravel() if np.shape(ref) == np.shape(cand) else None
    if ref is None:
        return None
    cand = np.asarray(cand, dtype=np.float64).ravel()
    finite = np.isfinite(ref)
    if not np.isfinite(cand[finite]).all():
        return None
    return ref[finite], cand[finite]


def _relative_error_finite(ref, cand) -> float | None:
    """:func:`relative_error` of two float arrays of one shape whose ``ref`` is finite everywhere, with
    one float64 array instead of two converted copies and no masking (None otherwise).  The same
    figure bit for bit: the difference is taken in float64 as before, and abs and max are exact in
    the arrays' own type.  Attribution folds a layout_cdla sample's 1 GB of intermediates through
    this: 1.5 s a sample the general way."""
    if not (isinstance(ref, np.ndarray) and isinstance(cand, np.ndarray) and ref.shape == cand.shape
            and ref.dtype.kind == "f" and cand.dtype.kind == "f" and ref.size):
        return None
    if not np.isfinite(ref).all():
        return None
    if not np.isfinite(cand).all():
        return math.inf
    diff = np.empty(ref.shape, np.float64)  # an array even for 0-d operands, so abs can work in place
    np.subtract(cand, ref, out=diff, dtype=np.float64)
    np.abs(diff, out=diff)
    return float(diff.max()) / max(float(np.abs(ref).max()), 1e-12)


def relative_error(ref: np.ndarray, cand: np.ndarray) -> float:
    """max |cand - ref| / max |ref|; inf when cand is non-finite where ref is finite."""
    fast = _relative_error_finite(ref, cand)
    if fast is not None:
        return fast
    pairs = _finite_pairs(ref, cand)
    if pairs is None:
        return math.inf
    r, c = pairs
    if not r.size:
        return 0.0
    return float(np.abs(c - r).max()) / max(float(np.abs(r).max()), 1e-12)


def _max_abs(ref: np.ndarray, cand: np.ndarray) -> float:
    pairs = _finite_pairs(ref, cand)
    if pairs is None:
        return math.inf
    r, c = pairs
    return float(np.abs(c - r).max()) if r.size else 0.0


def _cosine_error(ref: np.ndarray, cand: np.ndarray) -> float:
    pairs = _finite_pairs(ref, cand)
    if pairs is None:
        return math.inf
    r, c = pairs
    norms = float(np.linalg.norm(r)) * float(np.linalg.norm(c))
    if norms == 0:
        return 0.0 if np.array_equal(r, c) else 1.0
    return max(0.0, 1.0 - float(np.dot(r, c)) / norms)


@dataclass(frozen=True)
class Metric:
    """One metric; ``spec`` is how the user wrote it (a callable's name for a callable)."""

    spec: str
    kind: str  # "rel" | "max_abs" | "cosine" | "argmax" | "binary" | "callable"
    threshold: float = 0.0  # binary:T
    fn: Callable[[np.ndarray, np.ndarray], float] | None = None

    def error(self, refs: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> float:
        """The error over all samples (worst sample, or pooled for agreement metrics)."""
        if not refs:
            return 0.0
        if not _is_float(refs[0]) and self.kind != "callable":
            return _pooled(refs, outs, lambda r, o: np.asarray(r) != np.asarray(o))
        if self.kind == "argmax":
            return _pooled(refs, outs, lambda r, o: np.argmax(r, axis=-1) != np.argmax(o, axis=-1)
                           if np.ndim(r) else np.zeros(1, bool))
        if self.kind == "binary":
            t = self.threshold
            return _pooled(refs, outs, lambda r, o: (np.asarray(r) > t) != (np.asarray(o) > t))
        per_sample = {"rel": relative_error, "max_abs": _max_abs, "cosine": _cosine_error}.get(self.kind, self.fn)
        return max(_as_error(per_sample(r, o)) for r, o in zip(refs, outs))


def _is_float(array: np.ndarray) -> bool:
    array = np.asarray(array)
    return np.issubdtype(array.dtype, np.floating) or "float" in array.dtype.name


def _pooled(refs, outs, differs) -> float:
    wrong = total = 0
    for r, o in zip(refs, outs):
        if np.shape(r) != np.shape(o):
            return 1.0
        d = np.asarray(differs(r, o))
        wrong += int(np.count_nonzero(d))
        total += d.size
    return wrong / total if total else 0.0


def _as_error(value) -> float:
    value = float(value)
    return math.inf if math.isnan(value) else value


def parse_metric(spec: str | Callable) -> Metric:
    if callable(spec):
        return Metric(getattr(spec, "__name__", "callable"), "callable", fn=spec)
    if not isinstance(spec, str):
        raise OnnxMPError(f"a metric is a name or a callable, got {type(spec).__name__}",
                          hint=f"one of: {', '.join(NAMES)}")
    text = spec.strip()
    if text in PLAIN:
        return Metric(text, text)
    if text.startswith("binary:"):
        try:
            threshold = float(text.split(":", 1)[1])
        except ValueError:
            raise OnnxMPError(f"bad metric {spec!r}: the threshold is not a number",
                              hint="e.g. binary:0.5 (agreement of x > 0.5)") from None
        return Metric(text, "binary", threshold=threshold)
    close = difflib.get_close_matches(text, [*PLAIN, "binary:0.5"], n=1)
    raise OnnxMPError(f"unknown metric {spec!r}",
                      hint=(f"did you mean {close[0]!r}? " if close else "") + f"known: {', '.join(NAMES)}")


@dataclass(frozen=True)
class MetricPlan:
    """Which metric judges which output."""

    per_output: Mapping[str, Metric]
    model_fn: Callable[[Outputs, Outputs], float] | None = None

    def describe(self) -> dict[str, str]:
        if self.model_fn is not None:
            return {MODEL_LABEL: getattr(self.model_fn, "__name__", "callable")}
        return {name: m.spec for name, m in self.per_output.items()}

    def errors(self, refs: Sequence[Outputs], outs: Sequence[Outputs]) -> dict[str, float]:
        """Error per output (or one entry for a whole-model callable), over all samples."""
        if self.model_fn is not None:
            return {MODEL_LABEL: max((_as_error(self.model_fn(r, o)) for r, o in zip(refs, outs)), default=0.0)}
        return {name: metric.error([r[name] for r in refs], [o[name] for o in outs])
                for name, metric in self.per_output.items()}


def metric_plan(metric, outputs: Sequence[str]) -> MetricPlan:
    """Resolve ``metric`` (None, a spec, a callable, ``{output: spec}`` or CLI ``name=spec`` strings)."""
    if metric is None:
        metric = DEFAULT_METRIC
    if callable(metric) and not isinstance(metric, str):
        return MetricPlan({}, model_fn=metric)
    if isinstance(metric, str):
        metric = [metric]
    chosen: dict[str, str | Callable] = {}
    default: str | Callable = DEFAULT_METRIC
    if isinstance(metric, Mapping):
        chosen = dict(metric)
    elif isinstance(metric, Sequence):
        for item in metric:
            if isinstance(item, str) and "=" in item:
                name, _, spec = item.rpartition("=")
                chosen[name] = spec
            else:
                default = item
    else:
        raise OnnxMPError(f"bad metric {metric!r}", hint=f"a name ({', '.join(NAMES)}), a callable, "
                                                          "or a dict {output: name}")
    unknown = [n for n in chosen if n not in outputs]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(outputs), n=1)
        raise OnnxMPError(f"metric for {unknown[0]!r}, which is not an output of the model",
                          hint=(f"did you mean {close[0]!r}? " if close else "")
                          + f"outputs: {', '.join(outputs[:10])}")
    return MetricPlan({name: parse_metric(chosen.get(name, default)) for name in outputs})
