"""The pipeline ``load -> normalize -> color -> rewrite -> verify -> save``.

``convert`` returns a verified mixed-precision model (or raises
:class:`OnnxMPError`); ``explain`` runs the analysis only.
"""
from __future__ import annotations

import difflib
import gc
import logging
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np
import onnx

from onnxmp.calibrate import ACCURACY_FALLBACK, DEFAULT_TOLERANCE, MAX_RUNS, convert_with_calibration, observe_magnitudes
from onnxmp.color import ColorOptions, ColorResult, color
from onnxmp.color.seeds import DEFAULT_THRESHOLD, DEFAULT_UNDERFLOW_SHARE
from onnxmp.errors import OnnxMPError, first_line
from onnxmp.index import keeps_io
from onnxmp.lists import TARGETS, ListOverrides, resolve_lists
from onnxmp.load import ModelLike, load
from onnxmp.normalize import normalize
from onnxmp.precision import low_precision
from onnxmp.report import Report, advice_records, group_rows, head, tensor_core_findings, vertex_rows
from onnxmp.rewrite import rewrite
from onnxmp.verify import check_input_model, io_signature, verify

log = logging.getLogger("onnxmp.convert")


@dataclass
class ConversionResult:
    model: onnx.ModelProto
    report: Report
    coloring: ColorResult | None = field(default=None, repr=False)


PROGRESS_ABOVE_NODES = 5000  # smaller models convert in well under a second: no bar


class _StageBar:
    """A tqdm bar over pipeline stages for big models (stderr, only on a terminal)."""

    def __init__(self):
        self.bar = None

    def start(self, nodes: int, stages: int) -> None:
        if nodes > PROGRESS_ABOVE_NODES:
            from tqdm import tqdm

            self.bar = tqdm(total=stages, desc=f"onnxmp convert ({nodes} nodes)", unit="stage", disable=None,
                            leave=False)

    def stage(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(name)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None  # a later small model must not update (nor keep alive) this one


_BAR = _StageBar()


@contextmanager
def _timed(timings: dict[str, float], stage: str):
    start = time.perf_counter()
    yield
    timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - start
    _BAR.stage(stage)


def _options(model: onnx.ModelProto, target, precision, level, lists, block_nodes, keep_io_types,
             calibration_magnitudes=None, calibration_threshold=DEFAULT_THRESHOLD,
             underflow_share=DEFAULT_UNDERFLOW_SHARE, forced_deny=None) -> ColorOptions:
    if target not in TARGETS:
        raise OnnxMPError(f"unknown target {target!r}", hint=f"choose one of: {', '.join(TARGETS)}")
    low_precision(precision)  # a clear error for an unknown name
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    newest = onnx.defs.onnx_opset_version()
    if opset is not None and opset > newest:
        # Schemas decide which tensors change type together; guessing them for an unknown opset
        # could silently produce an invalid model.
        raise OnnxMPError(f"the model uses ai.onnx opset {opset}, newer than this onnx {onnx.__version__} knows "
                          f"(up to {newest})",
                          hint=f"upgrade onnx, or convert the model down with "
                               f"onnx.version_converter.convert_version(model, {newest})")
    if precision == "bfloat16" and opset is not None and opset < 13:
        raise OnnxMPError(f"bfloat16 needs opset >= 13 (Cast to bfloat16); the model has opset {opset}",
                          hint="upgrade it with onnx.version_converter.convert_version(model, 13)")
    block = list(block_nodes or ())
    for pattern in block:
        try:
            re.compile(pattern)
        except Exception as exc:
            raise OnnxMPError(f"bad --block-node pattern {pattern!r}: {exc}", hint="use a Python regular expression") \
                from None
    return ColorOptions(lists=resolve_lists(target, precision, level, lists), target=target, precision=precision,
                        level=level, block_nodes=block, keep_io_types=kept_io(model, keep_io_types),
                        calibration_magnitudes=calibration_magnitudes,
                        calibration_threshold=calibration_threshold, underflow_share=underflow_share,
                        forced_deny=forced_deny)


def kept_io(model: onnx.ModelProto, keep_io_types) -> bool | frozenset[str]:
    """``keep_io_types`` as the stages take it: True, False, or the set of main-graph input and
    output names that keep their type.  A list (or one string) holds names or Python regular
    expressions matched against whole names; every other float32 input and output takes the
    low-precision type, as a list means in onnxruntime's float16 converter."""
    if isinstance(keep_io_types, (bool, np.bool_)):
        return bool(keep_io_types)
    if isinstance(keep_io_types, frozenset):
        return keep_io_types  # resolved already (calibration converts many times)
    entries = [keep_io_types] if isinstance(keep_io_types, str) else list(keep_io_types)
    names = list(dict.fromkeys([v.name for v in model.graph.input] + [v.name for v in model.graph.output]))
    kept: set[str] = set()
    for entry in entries:
        if not isinstance(entry, str):
            raise OnnxMPError(f"keep_io_types takes True, False or input/output names; got {entry!r} in the list",
                              hint="e.g. keep_io_types=['logits'] or --keep-io-types logits")
        try:
            pattern = re.compile(entry)
        except re.error as exc:
            raise OnnxMPError(f"bad keep_io_types pattern {entry!r}: {exc}",
                              hint="a name, or a Python regular expression matching whole names") from None
        hits = [n for n in names if n == entry or pattern.fullmatch(n)]
        if not hits:
            close = difflib.get_close_matches(entry, names, n=3)
            raise OnnxMPError(f"keep_io_types {entry!r} matches no graph input or output",
                              hint=(f"did you mean {', '.join(map(repr, close))}? " if close else "")
                              + f"inputs and outputs: {', '.join(names[:12])}")
        kept.update(hits)
    return frozenset(kept)


def lowered_io(model: onnx.ModelProto, keep_io_types: bool | frozenset[str]) -> list[str]:
    """The float32 main-graph inputs and outputs that conversion turns low precision (not kept)."""
    initializers = {t.name for t in model.graph.initializer}
    return [v.name for v in list(model.graph.input) + list(model.graph.output)
            if v.name not in initializers and not keeps_io(keep_io_types, v.name)
            and v.type.WhichOneof("value") == "tensor_type" and v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]


def _expected_io(original_io: tuple[list, list], lowered: Iterable[str], low_enum: int) -> tuple[list, list]:
    """``io_signature`` of the converted model: the original's, with the lowered tensors low precision."""
    lowered = set(lowered)
    return tuple([(name, (sig[0], low_enum, sig[2]) if name in lowered else sig) for name, sig in side]
                 for side in original_io)


def _analyse(proto: onnx.ModelProto, options: ColorOptions, timings: dict[str, float]):
    with _timed(timings, "normalize"):
        normalized = normalize(proto)
    options.initializer_inputs = normalized.index.initializer_inputs
    with _timed(timings, "color"):
        colored = color(normalized.index, options)
    report = Report(target=options.target, precision=options.precision, level=options.level, timings=timings,
                    node_count=normalized.index.node_count())
    coloring = colored.coloring  # final once color returns: the rows may be built at any later time
    report.defer("vertices", lambda: vertex_rows(coloring))
    findings = tensor_core_findings(normalized.index, coloring)  # reads the model, which goes before verify
    report.defer("advice", lambda: advice_records(findings))
    report.groups = group_rows(colored.coloring)
    if normalized.inference_error:
        report.shape_inference_error = normalized.inference_error
    return normalized, colored, report


def explain(model: ModelLike, *, target: str = "cuda", precision: str = "float16",
            keep_io_types: bool | Iterable[str] = True,
            level: str = "default", lists: Mapping[str, Iterable[str]] | ListOverrides | None = None,
            block_nodes: Iterable[str] = (), calibration=None, calibration_threshold: float = DEFAULT_THRESHOLD,
            underflow_share: float = DEFAULT_UNDERFLOW_SHARE) -> Report:
    """Color ``model`` and return the report, without rewriting anything.

    With ``calibration`` the magnitude seed is applied (the fallback loop needs a rewrite,
    so it is :func:`convert`'s alone).
    """
    timings: dict[str, float] = {}
    with _timed(timings, "load"):
        proto = load(model, lazy_external=True)
    check_input_model(proto)  # refuse what convert would refuse, rather than color it
    magnitudes = None
    if calibration is not None:
        magnitudes = observe_magnitudes(model, calibration)
    options = _options(proto, target, precision, level, lists, block_nodes, keep_io_types,
                       magnitudes, calibration_threshold, underflow_share)
    _, colored, report = _analyse(proto, options, timings)
    report.changed = colored.coloring.has_allow()
    if not report.changed:
        report.unchanged_reason = _unchanged_reason(report)
    return report


def convert(model: ModelLike, *, target: str = "cuda", precision: str = "float16",
            keep_io_types: bool | Iterable[str] = True,
            level: str = "default", lists: Mapping[str, Iterable[str]] | ListOverrides | None = None,
            block_nodes: Iterable[str] = (), calibration=None, tolerance: float | None = None,
            calibration_threshold: float = DEFAULT_THRESHOLD, underflow_share: float = DEFAULT_UNDERFLOW_SHARE,
            master_weights: Iterable[str] = (), metric=None, holdout: int | None = None,
            max_runs: int | None = None) -> ConversionResult:
    """Convert ``model`` to mixed ``precision`` for ``target`` with TF's AMP algorithm.

    ``calibration`` (sample inputs: a dict of arrays, a list of them, or .npz paths)
    enables the magnitude seed (``calibration_threshold``) and the accuracy-guided
    search to ``tolerance`` under ``metric`` (see :mod:`onnxmp.calibrate` and
    :mod:`onnxmp.metrics`), tuning on all but the last ``holdout`` samples and
    giving up after ``max_runs`` emulated runs.  A missed tolerance is not an
    exception: ``result.report.calibration.met`` is False and the model is the
    best found.  ``underflow_share`` is the
    share of an initializer's values that may flush or turn subnormal before its node
    stays float32.  ``master_weights`` names initializers that must stay float32 and be
    Cast at each low-precision use (training).

    ``keep_io_types``: True keeps every graph input and output as declared; False turns every
    float32 one low precision, Cast inside the graph where its reader or producer stays float32;
    a list of names or regular expressions (whole names) keeps those and lowers the other
    float32 ones (a decoder's KV cache in fp16, its logits in fp32: ``keep_io_types=["logits"]``).
    """
    if calibration is not None:
        return convert_with_calibration(
            model, convert_pass=convert_once, calibration=calibration,
            tolerance=DEFAULT_TOLERANCE if tolerance is None else tolerance,
            metric=metric, holdout=holdout, max_runs=MAX_RUNS if max_runs is None else max_runs,
            calibration_threshold=calibration_threshold, underflow_share=underflow_share, target=target,
            precision=precision, keep_io_types=keep_io_types, level=level, lists=lists, block_nodes=block_nodes,
            master_weights=master_weights)
    for name, value in (("tolerance", tolerance), ("metric", metric), ("holdout", holdout), ("max_runs", max_runs)):
        if value is not None:
            raise OnnxMPError(f"{name} needs calibration samples", hint="pass calibration=inputs (or --calibrate a.npz)")
    return convert_once(model, target=target, precision=precision, keep_io_types=keep_io_types, level=level,
                        lists=lists, block_nodes=block_nodes, master_weights=master_weights,
                        underflow_share=underflow_share)


def convert_once(model: ModelLike, *, target: str = "cuda", precision: str = "float16",
                 keep_io_types: bool | Iterable[str] = True,
                 level: str = "default", lists=None, block_nodes: Iterable[str] = (),
                 master_weights: Iterable[str] = (), calibration_magnitudes: Mapping[str, float] | None = None,
                 calibration_threshold: float = DEFAULT_THRESHOLD, underflow_share: float = DEFAULT_UNDERFLOW_SHARE,
                 forced_deny: Mapping[str, str] | None = None) -> ConversionResult:
    """One pass of the pipeline, no calibration loop."""
    timings: dict[str, float] = {}
    with _timed(timings, "load"):
        original = load(model, lazy_external=True)
    _BAR.start(len(original.graph.node), stages=4)
    try:
        options = _options(original, target, precision, level, lists, block_nodes, keep_io_types,
                           calibration_magnitudes, calibration_threshold, underflow_share, forced_deny)
        # Handed over in a list so that no frame but _convert_loaded's holds it: it drops the
        # analysed model before verification, whose checker copies the converted one twice.
        handover = [original]
        del original
        with _no_cyclic_gc():
            return _convert_loaded(model, handover, timings, options, tuple(master_weights))
    finally:
        _BAR.close()


@contextmanager
def _no_cyclic_gc():
    """The analysis builds hundreds of thousands of small objects; each of Python's full collections
    walks all of them, which makes conversion time grow faster than the node count.  Nothing here
    relies on cycle collection while the pipeline runs."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _convert_loaded(model: ModelLike, handover: list[onnx.ModelProto], timings: dict[str, float],
                    options: ColorOptions, master_weights: tuple[str, ...]) -> ConversionResult:
    original = handover.pop()
    normalized, colored, report = _analyse(original, options, timings)
    lowered = lowered_io(original, options.keep_io_types)
    if not colored.coloring.has_allow() and not lowered:
        report.unchanged_reason = _unchanged_reason(report)
        log.info("model unchanged: %s", report.unchanged_reason)
        # normalize annotated `original` with inferred types; hand back the model as it came.
        return ConversionResult(load(model, lazy_external=True), report, colored)
    with _timed(timings, "rewrite"):
        try:
            converted, stats = rewrite(normalized.index, colored.coloring,
                                       precision=low_precision(options.precision), master_weights=master_weights,
                                       keep_io_types=options.keep_io_types)
        except OnnxMPError:
            raise
        except Exception as exc:  # keep deep stack traces away from users
            raise OnnxMPError(f"rewrite failed: {type(exc).__name__}: {first_line(exc)}",
                              hint="please report this model; --block-node or --deny-add can route around "
                                   "the failing node meanwhile") from exc
    original_io = _expected_io(io_signature(original), lowered, low_precision(options.precision).onnx_type)
    # The original model and the index are no longer needed; freeing them now lowers the
    # peak the checker's copies reach.
    del original, normalized
    with _timed(timings, "verify"):
        verify(converted, original_io=original_io,
               reload_original=lambda: normalize(load(model, lazy_external=True)).index.model)
    report.changed = stats.modified
    report.cast_nodes = stats.casts
    report.casts_inserted = len(report.cast_nodes)
    report.converted_initializers = stats.converted_initializers
    report.twin_initializers = stats.twin_initializers
    return ConversionResult(converted, report, colored)


def _unchanged_reason(report: Report) -> str:
    heavy = [v for v in report.vertices if v.op in ("Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "LSTM",
                                                      "GRU", "RNN")]
    if not heavy:
        return "no allow-list op (Conv/MatMul/Gemm/...) with float32 tensors"
    # Calibration forces only nodes an earlier run had in low precision: they could run there.
    moved = sum(v.rule == "seed_deny_forced" and v.cause.startswith(ACCURACY_FALLBACK) for v in heavy)
    if moved:
        return (f"calibration kept every node in float32 to meet the tolerance "
                f"({moved} allow-list vertices moved back by the accuracy fallback)")
    shown, rest = head(sorted({v.cause for v in heavy}), 3)
    return "no allow-list op can run in low precision: " + "; ".join([*shown, rest] if rest else shown)
