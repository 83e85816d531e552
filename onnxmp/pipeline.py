"""The conversion pipeline: ``load -> normalize -> color -> rewrite -> verify``, one pass per stage.

Each stage is a :class:`~onnxmp.passes.PassBase` over one :class:`Conversion` state, run by a
:class:`~onnxmp.passes.PassManager` that times and logs every stage the same way (the report's
``timings``).  ``save`` is the caller's (:func:`onnxmp.save`): the pipeline returns a verified
model or raises :class:`~onnxmp.errors.OnnxMPError`, never half a conversion.
See ``docs/design.md``.
"""
from __future__ import annotations

import gc
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable

import onnx

from onnxmp.color import Coloring, color
from onnxmp.index import keeps_io
from onnxmp.load import ModelLike, load
from onnxmp.kernels import KernelTable
from onnxmp.normalize import Normalized, normalize
from onnxmp.opset_gaps import retarget
from onnxmp.options import Options, Resolved
from onnxmp.passes import PassBase, PassManager, PassResult
from onnxmp.report import (TENSOR_CORE_OPS, MaskFillRow, Report, advice_records, group_rows, head,
                           tensor_core_findings, vertex_rows)
from onnxmp.rewrite import RewriteStats, rewrite
from onnxmp.verify import check_input_model, compact_bytes, io_signature, verify

log = logging.getLogger("onnxmp.convert")

PROGRESS_ABOVE_NODES = 5000  # smaller models convert in well under a second: no bar
ACCURACY_FALLBACK = "accuracy fallback"  # cause prefix of the nodes calibration forces to float32

_REWRITE_HINT = "please report this model; --block-node or --deny-add can route around the failing node meanwhile"


@dataclass
class ConversionResult:
    model: onnx.ModelProto
    report: Report
    coloring: Coloring | None = field(default=None, repr=False)


@dataclass
class Conversion:
    """What the stages hand each other."""

    source: ModelLike                 # the caller's model (a path or a proto), never modified
    options: Options | Resolved       # resolved by load, against the loaded model
    timings: dict[str, float] = field(default_factory=dict)
    model: onnx.ModelProto | None = None   # load's copy: normalize and the writer edit it in place
    normalized: Normalized | None = None
    coloring: Coloring | None = None
    report: Report | None = None
    expected_io: tuple | None = None  # the converted model's input/output signature
    stats: RewriteStats | None = None
    retargeted: str | None = None     # the opset raised to close a kernel gap (opset_gaps.py), in words
    foreign_ops: bool | None = None   # normalize found ops onnx does not define (verify checks their binding)

    @property
    def resolved(self) -> Resolved:
        assert isinstance(self.options, Resolved), "load resolves the options"
        return self.options


class Load(PassBase[Conversion]):
    """Read the model (a path, external data included, or a proto: copied, never modified) and
    check the options against it."""

    name = "load"

    def call(self, state: Conversion) -> PassResult:
        state.model = load(state.source, lazy_external=True)
        if isinstance(state.options, Options):
            state.options = state.options.resolve(state.model)
        options = state.options
        state.retargeted = retarget(state.model, KernelTable.default(options.ort_version), options.target.provider,
                                    options.precision.name)
        return PassResult(state.retargeted is not None)


class CheckInput(PassBase[Conversion]):
    """Refuse a model convert would refuse (explain colors nothing convert could not write)."""

    name = "check_input"

    def call(self, state: Conversion) -> PassResult:
        check_input_model(state.model)
        return PassResult(False)


class Normalize(PassBase[Conversion]):
    """Types from shape inference, unique node names, every graph sorted; the index built once."""

    name = "normalize"

    def requires(self, state: Conversion) -> None:
        self.check(state.model is not None, "a loaded model")

    def call(self, state: Conversion) -> PassResult:
        state.normalized = normalize(state.model)
        return PassResult(state.normalized.modified, {"renamed_nodes": state.normalized.renamed_nodes,
                                                      "resorted": state.normalized.resorted})


class Color(PassBase[Conversion]):
    """The data seeds and TF's rules; the report of every vertex.  Stops the pipeline when nothing
    would change (no vertex takes the low-precision type and no graph input or output is lowered)."""

    name = "color"

    def requires(self, state: Conversion) -> None:
        self.check(state.normalized is not None, "a normalized model")

    def call(self, state: Conversion) -> PassResult:
        options, index = state.resolved, state.normalized.index
        coloring = state.coloring = color(index, options)
        report = state.report = Report(target=options.target.name, precision=options.precision.name,
                                       level=options.level, timings=state.timings, node_count=index.node_count())
        report.defer("vertices", lambda: vertex_rows(coloring))  # the coloring is final: rows may come later
        findings = tensor_core_findings(index, coloring)  # reads the model, which the rewrite edits
        report.defer("advice", lambda: advice_records(findings))
        report.groups = group_rows(coloring)
        report.shape_inference_error = state.normalized.inference_error
        report.opset_retarget = state.retargeted
        report.changed = coloring.has_allow() or bool(lowered_io(index.model, options.keep_io_types))
        if not report.changed:
            report.unchanged_reason = unchanged_reason(report)
            log.info("model unchanged: %s", report.unchanged_reason)
        return PassResult(False, {"allow": coloring.has_allow()}, stop=not report.changed)


class Rewrite(PassBase[Conversion]):
    """Apply the coloring: retype, one shared Cast per boundary tensor, converted initializers."""

    name = "rewrite"

    def requires(self, state: Conversion) -> None:
        self.check(state.coloring is not None and state.report is not None, "a colored model")

    def call(self, state: Conversion) -> PassResult:
        options, index = state.resolved, state.normalized.index
        # Read before the writer edits the model in place.
        state.expected_io = _expected_io(io_signature(index.model), lowered_io(index.model, options.keep_io_types),
                                         options.precision.onnx_type)
        state.model, state.stats = rewrite(index, state.coloring, precision=options.precision,
                                           master_weights=options.master_weights,
                                           keep_io_types=options.keep_io_types)
        state.foreign_ops = state.normalized.foreign
        state.normalized = None  # the index points into the written model; freeing it lowers verify's peak
        report, stats = state.report, state.stats
        report.changed = stats.modified
        report.cast_nodes = stats.casts
        report.casts_inserted = len(stats.casts)
        report.converted_initializers = stats.converted_initializers
        report.twin_initializers = stats.twin_initializers
        report.mask_fills = [MaskFillRow(f.constant, f.original, f.value, list(f.softmaxes)) for f in stats.mask_fills]
        return PassResult(stats.modified, {"casts": len(stats.casts)})


class Verify(PassBase[Conversion]):
    """The full checker with strict type inference, topological order of every graph, and the
    graph inputs and outputs the caller asked for."""

    name = "verify"

    def call(self, state: Conversion) -> PassResult:
        written = compact_bytes(state.model)
        if written is not None:
            state.model = None  # let go before the checker runs: see compact_bytes
        state.model = verify(state.model if written is None else written, original_io=state.expected_io,
                             reload_original=lambda: normalize(load(state.source, lazy_external=True)).index.model,
                             ort_version=state.options.ort_version, foreign_ops=state.foreign_ops)
        return PassResult(False)


def convert_once(source: ModelLike, options: Options | Resolved) -> ConversionResult:
    """One run of the pipeline (no calibration search)."""
    state = Conversion(source, options)
    _run([Load(), Normalize(), Color(), Rewrite(), Verify()], state)
    if state.stats is None:  # the color stage found nothing to change: the model as it came
        return ConversionResult(load(source, lazy_external=True), state.report, state.coloring)
    return ConversionResult(state.model, state.report, state.coloring)


def analyse(source: ModelLike, options: Options | Resolved) -> Report:
    """The coloring's report, without rewriting anything."""
    state = Conversion(source, options)
    _run([Load(), CheckInput(), Normalize(), Color()], state)
    return state.report


def _run(stages: list[PassBase[Conversion]], state: Conversion) -> None:
    bar = _StageBar(len(stages))

    def on_pass(name: str) -> None:
        if name == "load":
            bar.start(len(state.model.graph.node))
        bar.stage(name)

    manager = PassManager(stages, log=log, timings=state.timings, on_pass=on_pass, hint=_REWRITE_HINT)
    try:
        with _no_cyclic_gc():
            manager(state)
    finally:
        bar.close()


class _StageBar:
    """A tqdm bar over the stages for big models (stderr, only on a terminal); it appears once
    the model is loaded and its size known."""

    def __init__(self, stages: int):
        self.stages, self.bar, self.done = stages, None, 0

    def stage(self, name: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(name)
            self.bar.update(1)

    def start(self, nodes: int) -> None:
        if nodes > PROGRESS_ABOVE_NODES:
            from tqdm import tqdm

            self.bar = tqdm(total=self.stages, initial=self.done, desc=f"onnxmp convert ({nodes} nodes)",
                            unit="stage", disable=None, leave=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


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


def unchanged_reason(report: Report) -> str:
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


__all__ = ["ACCURACY_FALLBACK", "Conversion", "ConversionResult", "TENSOR_CORE_OPS", "analyse", "convert_once",
           "lowered_io", "unchanged_reason"]
