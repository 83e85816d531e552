"""The calibration driver: seeds, measure, search, confirm (``docs/calibration.md``).

:func:`calibrate` works in this order:

1. **Seeds (rules).**  The float32 model runs once on the tuning samples;
   nodes whose intermediates exceed ``calibration_threshold`` are denied before
   coloring (:func:`observe_magnitudes`).  This is plain conversion.
2. **Measure.**  The real converted model is emulated (:mod:`onnxmp.parity.emulate`)
   on the tuning and held-out samples and judged with the metric
   (:mod:`onnxmp.parity.metrics`).  Within tolerance: done.
3. **Search (measurement).**  A :class:`~onnxmp.calibrate.switchboard.Switchboard` (one ORT
   session whose every low node's rounding is switchable) ranks topological
   segments by the OUTPUT error they cause alone, then bisects the ranking for
   a small set of nodes to keep in float32 (:func:`~onnxmp.calibrate.search.find_fp32_set`;
   the run bound is documented there).
4. **Confirm.**  The real conversion with those nodes denied is measured
   again.  If the coloring's propagation made it differ from the switchboard's
   prediction, or the held-out samples miss while the tuning ones pass
   (the tuning tolerance then tightens), the search runs another cycle on the
   new coloring.  The best real candidate seen is kept, so the returned error
   never exceeds plain conversion's and never grows between cycles; an
   all-float32 fallback guarantees landing whenever the float32 model passes.

The result is always a :class:`~onnxmp.pipeline.ConversionResult`; when the
tolerance is still missed (``max_runs`` spent) ``result.report.calibration.met``
is False and the model is the best found.  Nothing is raised for that: the
caller decides (the CLI writes the model and exits 3).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from onnxmp.calibrate.attribution import attribution_ranking, local_attribution
from onnxmp.calibrate.colorings import Colorings
from onnxmp.calibrate.islands import fewer_casts, spare_heavy
from onnxmp.calibrate.progress import RunBar
from onnxmp.calibrate.records import REASONS, CalibrationReport, CycleRecord, Measurement, MovedNode, SeededTensor
from onnxmp.calibrate.release import RuledHeavy, release_heavy
from onnxmp.calibrate.samples import _check_references, _fold_magnitudes, _probe, samples_from, split_holdout
from onnxmp.calibrate.search import BudgetExhausted, Oracle, find_fp32_set
from onnxmp.calibrate.session import cpu_session, run_samples
from onnxmp.calibrate.switchboard import LowNode, Switchboard
from onnxmp.external import discard_spilled, is_large
from onnxmp.fusions import inside_fused_kernels
from onnxmp.load import ModelLike, load
from onnxmp.normalize import normalize
from onnxmp.options import DEFAULT_TOLERANCE, MAX_RUNS, Options
from onnxmp.parity.metrics import MetricPlan, metric_plan
from onnxmp.pipeline import ACCURACY_FALLBACK, Conversion, ConversionResult, Load, Normalize, convert_once
from onnxmp.report import TENSOR_CORE_OPS, Report
from onnxmp.subgraphs import proto_nodes

log = logging.getLogger("onnxmp.calibrate")

MAX_CYCLES = 4            # search + confirm cycles before the all-float32 fallback
MEASURE_EACH = 32         # a set this small gets each member's own measurement in the report


# --- the loop ---------------------------------------------------------------------------


def _low_share(report: Report) -> float | None:
    """Share of the non-Constant nodes that run in low precision."""
    ops = {v.node: v.op for v in report.vertices if v.op != "Constant"}
    colors = report.node_colors()
    return sum(colors.get(n) == "allow" for n in ops) / len(ops) if ops else None


def _added_casts(original: onnx.ModelProto, converted: onnx.ModelProto) -> int:
    def casts(model):
        return sum(n.op_type == "Cast" for n in model.graph.node)
    return casts(converted) - casts(original)


def _worst_sample(plan: MetricPlan, refs: Sequence[Mapping[str, np.ndarray]]) -> bool:
    """Whether the metric keeps the worst sample (so a partial run's error is a lower bound); the
    agreement metrics pool rows over all samples, and a prefix of them says nothing."""
    if plan.model_fn is not None:
        return True
    return bool(refs) and all(metric.kind in ("rel", "max_abs", "cosine", "callable")
                              and np.asarray(refs[0][name]).dtype.kind == "f"
                              for name, metric in plan.per_output.items())


def _low_io(original: onnx.ModelProto, converted: onnx.ModelProto) -> frozenset[str]:
    """Main-graph float32 inputs and outputs that the conversion gave a low-precision type
    (``keep_io_types=False``): the real model rounds them whatever its nodes compute in."""
    def types(model):
        return {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}

    before, after = types(original), types(converted)
    return frozenset(name for name, t in after.items()
                     if before.get(name) == onnx.TensorProto.FLOAT and t != onnx.TensorProto.FLOAT
                     and t in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16))


def _low_nodes(model: onnx.ModelProto, report: Report) -> dict[str, LowNode]:
    """Nodes with a low-precision vertex, and which of their tensors are low precision (from the report)."""
    protos = {node.name: node for node in proto_nodes(model.graph)}
    inside = inside_fused_kernels(model.graph)  # computed in float32 by the kernel ORT fuses: never rounded
    tensors: dict[str, set[str]] = {}
    ops: dict[str, str] = {}
    for v in report.vertices:
        if v.color == "allow" and v.node in protos:
            tensors.setdefault(v.node, set()).update(v.tensors)
            ops[v.node] = v.op
    low = {}
    for name, ts in tensors.items():
        node = protos[name]
        ins = frozenset(t for t in node.input if t in ts and t not in inside)
        outs = frozenset(t for t in node.output if t in ts and t not in inside)
        if ins or outs:
            low[name] = LowNode(name, ops[name], ins, outs)
    return low


@dataclass
class _PlainSearch:
    """The first cycle's search: its board switches every node plain conversion makes low, and its
    oracle scored candidates with nothing forced before them (keys: the whole fp32 set)."""

    board: Switchboard | None  # None once a later cycle built its own (one board alive at a time)
    low: Mapping[str, LowNode]
    heavy: frozenset[str]
    oracle: Oracle | None
    order: list[str]  # the attribution ranking, most blamed first
    joined: bool  # whether the held-out samples were among its samples
    fills: Mapping[str, float]
    low_io: frozenset[str]


class _Calibration:
    def __init__(self, model: ModelLike, options: Options):
        options.check_calibration()
        self.started = time.perf_counter()
        # Loaded and normalized once (types, unique names, every graph sorted): the switchboard, the
        # search and every conversion read this one model, so their node names and order agree, and
        # each conversion's own normalize finds nothing left to do.
        self.original = normalize(load(model, lazy_external=True)).index.model
        self.resolved = options.resolve(self.original)
        self.tolerance = DEFAULT_TOLERANCE if options.tolerance is None else options.tolerance
        self.max_runs = MAX_RUNS if options.max_runs is None else options.max_runs
        self.deadline = None if options.time_budget is None else self.started + options.time_budget
        self.precision = self.resolved.precision.name
        calibration_threshold = options.calibration_threshold
        samples = samples_from(self.original, options.calibration)
        self.tune, self.held = split_holdout(samples, options.holdout)
        self.outputs = [o.name for o in self.original.graph.output]
        self.plan: MetricPlan = metric_plan(options.metric, self.outputs)
        self.magnitudes: dict[str, float] = {}
        self.ref_tune = []
        probe = cpu_session(_probe(self.original), "model")
        for run in run_samples(probe, self.tune):
            _fold_magnitudes(self.magnitudes, run)
            self.ref_tune.append({name: run[name] for name in self.outputs})
        # The probe session answers for the held-out samples too: one session start less.
        self.ref_held = list(run_samples(probe, self.held, self.outputs)) if self.held else []
        del probe
        _check_references(self.ref_tune + self.ref_held)
        # What the search scores candidates on: the tuning samples, and the held-out ones once they miss
        self.search_samples, self.search_refs = list(self.tune), list(self.ref_tune)
        self.runs = 0
        self.forced: dict[str, str] = {}
        self._colorings: Colorings | None = None  # candidates' colorings, on convert's own load + normalize
        self._plain: _PlainSearch | None = None  # the first cycle's board, oracle and ranking
        self._order_samples: list[int] = []  # the last search's samples, hardest first
        self.report = CalibrationReport(
            tolerance=self.tolerance, metric=self.plan.describe(), threshold=calibration_threshold,
            samples=len(samples), tune_samples=len(self.tune), holdout_samples=len(self.held),
            seeded=[SeededTensor(t, m) for t, m in sorted(self.magnitudes.items(), key=lambda x: -x[1])
                    if m > calibration_threshold])

    def convert(self, forced: Mapping[str, str]) -> ConversionResult:
        return convert_once(self.original, self.resolved.replace(
            magnitudes=self.magnitudes, forced_deny={**self.resolved.forced_deny, **forced}))

    def low_after(self, forced: Iterable[str]) -> frozenset[str]:
        """The nodes the written model computes in low precision when ``forced`` nodes are denied:
        the coloring stage alone, as :meth:`convert` runs it (same load, retarget and normalize), so
        TF's propagation moves the same neighbours.  Cached by forced set, and every coloring starts
        from the seeds computed once (:mod:`onnxmp.calibrate.colorings`)."""
        if self._colorings is None:
            state = Conversion(self.original, self.resolved)
            Load().call(state)
            Normalize().call(state)
            self._colorings = Colorings(state.normalized.index, state.resolved.replace(magnitudes=self.magnitudes))
        return self._colorings.low(forced)

    def written_off(self, board: Switchboard, fp32: Iterable[str], base: Iterable[str]) -> frozenset[str]:
        """The switches a candidate turns off: not just its nodes but every node its written model
        computes in float32.  Convert denies the candidate's nodes (and the Constants that follow them,
        as the driver forces them) on top of ``base``, the nodes forced before the candidates (an
        earlier cycle's), and TF's propagation moves their neighbours too (deny runs forward
        through infer and clear ops; a clear op no longer between low ones leaves).  Set to that
        coloring, the switchboard computes what the written model does, so a candidate that passes the
        search passes written."""
        fp32 = set(fp32)
        forced = {*base, *fp32, *(c for n in fp32 for c in board.followers.get(n, ()))}
        return frozenset(board.nodes) - self.low_after(forced)

    def measure(self, result) -> Measurement:
        """Errors of the real converted model, emulated, on tuning and held-out samples."""
        from onnxmp.parity.emulate import emulate

        self.runs += 1
        emulated = emulate(result.model, self.precision, keep_io_types=False)
        session = cpu_session(emulated, "converted model")
        discard_spilled(emulated, keep=[result.model])  # the session holds them now
        del emulated
        tune = self.plan.errors(self.ref_tune, list(run_samples(session, self.tune, self.outputs)))
        held = (self.plan.errors(self.ref_held, list(run_samples(session, self.held, self.outputs)))
                if self.held else None)
        return Measurement(tune, held)

    def run(self):
        plain = self.convert({})
        rep = self.report
        rep.share_plain = plain.report.tensor_core_share()
        rep.share_all_plain = _low_share(plain.report)
        rep.casts_plain = _added_casts(self.original, plain.model)
        if not plain.report.changed:
            rep.met = True
            rep.plain = rep.final = Measurement({o: 0.0 for o in rep.metric}, {o: 0.0 for o in rep.metric}
                                                if self.held else None)
            return self.finish(plain)
        best = plain
        best_m = rep.plain = self.measure(plain)
        current, current_m = plain, best_m
        forced = self.forced  # the nodes forced to float32 so far, and why
        best_forced: dict[str, str] = {}  # what the best model forced
        moved: dict[str, MovedNode] = {}
        tune_tol = self.tolerance
        bar = RunBar("onnxmp calibrate")
        try:
            for cycle in range(1, MAX_CYCLES + 1):
                if best_m.meets(self.tolerance) or rep.budget_exhausted:
                    break
                if self._out_of_time():
                    rep.budget_exhausted = True
                    break
                if (current_m.tune_error <= tune_tol and current_m.holdout_error is not None
                        and not rep.holdout_joined):
                    # Tuned but the held-out samples miss: they stress nodes the tuning samples do not.
                    # Tightening the tuning tolerance instead compounds cycle after cycle (PP-OCR's
                    # classifier: 0.01 -> 0.0045 -> 0.00083, 24% of Conv/MatMul/Gemm left in fp16) while
                    # the held-out error follows the fp32 set, not the tuning error; so the held-out
                    # samples join the search, at the tolerance itself, and the report says so (their
                    # error no longer confirms independently).
                    rep.holdout_joined = (f"cycle {cycle}: tuning {current_m.tune_error:.3g} passed, held-out "
                                          f"{current_m.holdout_error:.3g} missed the tolerance {self.tolerance:g}")
                    log.info("calibration: the held-out samples join the search (%s)", rep.holdout_joined)
                    self.search_samples = [*self.tune, *self.held]
                    self.search_refs = [*self.ref_tune, *self.ref_held]
                low = _low_nodes(self.original, current.report)
                if cycle == 1:
                    rep.candidates = len(low)
                fills = {f.constant: f.value for f in current.report.mask_fills}
                found = self.search(low, fills, tune_tol, bar, _low_io(self.original, current.model))
                if not found:
                    break
                for item in found:
                    moved[item.node] = item
                    forced[item.node] = (f"{ACCURACY_FALLBACK}: measured on calibration data, the output error is "
                                         f"{item.error_with:.3g} with this node in {self.precision} and "
                                         f"{item.error_without:.3g} without" if item.error_with is not None
                                         else f"{ACCURACY_FALLBACK}: {REASONS[item.reason]}")
                current = self.convert(forced)
                current_m = self.measure(current)
                best, best_m = self._better(best, best_m, current, current_m)
                if best is current:
                    best_forced = dict(forced)
                rep.cycles.append(CycleRecord(cycle, len(forced), current_m, best_m.worst, tune_tol))
                held = "" if current_m.holdout_error is None else f", held-out {current_m.holdout_error:.3g}"
                log.info("calibration cycle %d: %d node(s) back in fp32, error %.3g%s, tolerance %g",
                         cycle, len(forced), current_m.tune_error, held, self.tolerance)
            if not best_m.meets(self.tolerance) and not rep.budget_exhausted:
                best, best_m = self.fallback_all_fp32(best, best_m, forced, moved)
            elif best_forced and not rep.budget_exhausted and not self._out_of_time():
                best, best_m = self.release_landed(best, best_m, best_forced, bar)
        finally:
            bar.close()
        rep.final = best_m
        rep.met = best_m.meets(self.tolerance)
        kept = {v.node for v in best.report.vertices if v.color != "allow"}
        rep.moved = [m for name, m in moved.items() if name in kept]
        if not rep.met:
            log.warning("calibration missed tolerance %g: best error %.3g after %d runs", self.tolerance,
                        best_m.worst, self.runs)
        return self.finish(best)

    def search(self, low: Mapping[str, LowNode], fills: Mapping[str, float], tune_tol: float,
               bar: RunBar, low_io: frozenset[str] = frozenset()) -> list[MovedNode]:
        if self._plain is not None:
            # A board holds a session and rounded copies of the weights: two alive at once doubled the
            # peak on a 2.25 GB model.  The release over the landed model builds it again if needed.
            self._plain.board = self._plain.oracle = None
        board = Switchboard(self.original, low, self.precision, fills, low_io)
        heavy = frozenset(name for name, n in low.items() if n.op in TENSOR_CORE_OPS)
        bar.heavy, bar.tolerance = heavy, tune_tol
        sample_error = [0.0] * len(self.search_samples)
        order_samples = list(range(len(self.search_samples)))
        self._order_samples = order_samples
        evaluate = self._scorer(board, order_samples, tune_tol, frozenset(self.forced))
        budget = self.max_runs - self.runs - 2  # the attribution's two passes come first
        if budget <= 0 or self._out_of_time():
            self.report.budget_exhausted = True
            return []
        oracle = Oracle(evaluate, max_runs=budget, on_run=bar, full=lambda fp32: evaluate(fp32, full=True),
                        deadline=self.deadline)
        if self._plain is None:
            # The first cycle's board switches every node plain conversion makes low: the release over
            # the landed model (release_landed) tries there what later cycles no longer switch.
            self._plain = _PlainSearch(board, low, heavy, oracle, [], bool(self.report.holdout_joined), fills, low_io)
        try:
            if max(self.plan.errors(self.search_refs, self.search_refs).values(), default=0.0) > tune_tol:
                log.warning("the metric rejects the float32 model itself; no mix can pass")
                return []
            self.runs += 2  # the two attribution passes, all fp32 and all low

            def judge(i: int, rounded: dict) -> None:
                sample_error[i] = max(self.plan.errors([self.search_refs[i]], [rounded]).values(), default=0.0)

            added = local_attribution(board, self.search_samples, judge)
            # Hardest sample first (largest all-low error): a failing candidate usually fails on it.
            order_samples.sort(key=lambda i: -sample_error[i])
            order = attribution_ranking(board.nodes, added, lambda m: m in heavy)
            if self._plain.board is board:
                self._plain.order[:] = order
            culprits = find_fp32_set(order, oracle, gallop=True)
            found = [MovedNode(c.node, low[c.node].op, "measurement", c.score_with * tune_tol,
                               c.score_without * tune_tol) if c.score_with is not None else
                     MovedNode(c.node, low[c.node].op, "ranking prefix", None, c.score_without * tune_tol)
                     for c in culprits]
            names = [c.node for c in culprits]
            if oracle(names).passed:
                found = self._islands(found, order, low, heavy, oracle, tune_tol)
                found = self._release(found, order, low, heavy, oracle, tune_tol)
        except BudgetExhausted:
            self.report.budget_exhausted = True
            # The cheapest passing candidate seen (a bisection prefix always passes).
            probe = oracle.best_passing(lambda fp32: (len(fp32 & heavy), len(fp32)))
            found = [] if probe is None else [
                MovedNode(name, low[name].op, "budget exhausted", None, probe.score * tune_tol)
                for name in board.nodes if name in probe.fp32]
        finally:
            self.runs += oracle.runs
            if self._plain.board is board and is_large(self.original):
                self._plain.board = self._plain.oracle = None  # not alive beside the confirmation's session
        return [*found, *(MovedNode(c, low[c].op, "follows its reader", None, None)
                          for item in found for c in board.followers.get(item.node, ()))]

    def _scorer(self, board: Switchboard, order_samples: list[int], tune_tol: float,
                base: frozenset[str] = frozenset()):
        """``evaluate(fp32, full=False)``: a candidate's worst error over the search's samples, as a
        multiple of ``tune_tol``, scored as the model it writes (:meth:`written_off`) with ``base``
        forced besides."""
        early = _worst_sample(self.plan, self.search_refs)
        # Per switch vector, the worst error of each sample run so far.  Two candidates that write the
        # same model (the coloring's propagation maps several forced sets onto one) are one model, and
        # a failing candidate re-scored over every sample for the report runs only the samples its
        # first score skipped.
        seen: dict[frozenset[str], dict[int, float]] = {}

        def evaluate(fp32: frozenset[str], full: bool = False) -> float:
            off = self.written_off(board, fp32, base)
            if not early:  # a pooled metric judges the samples together: every one, every time
                refs = [self.search_refs[i] for i in order_samples]
                outs = list(board.iter_run(off, [self.search_samples[i] for i in order_samples]))
                return max(self.plan.errors(refs, outs).values(), default=0.0) / tune_tol
            known = seen.setdefault(off, {})
            if full or not any(e > tune_tol for e in known.values()):
                todo = [i for i in order_samples if i not in known]
                for i, out in zip(todo, board.iter_run(off, [self.search_samples[i] for i in todo])):
                    known[i] = max(self.plan.errors([self.search_refs[i]], [out]).values(), default=0.0)
                    if not full and known[i] > tune_tol:
                        # A worst-sample metric fails on one sample: stop there, and try that sample
                        # first from now on (the candidates near the boundary fail on the same one,
                        # which the all-low ranking of the samples may have put third).
                        order_samples.remove(i)
                        order_samples.insert(0, i)
                        break
            return max(known.values(), default=0.0) / tune_tol
        return evaluate

    def _islands(self, found: list[MovedNode], order: Sequence[str], low: Mapping[str, LowNode],
                 heavy: frozenset[str], oracle: Oracle, tune_tol: float) -> list[MovedNode]:
        """Spare the set's Conv/MatMul/Gemm where cheap ops around them suffice, then close gaps that
        would cost Casts (:mod:`onnxmp.calibrate.islands`); each new member measured on its own."""
        names = [m.node for m in found]
        spared, check = spare_heavy(names, order, heavy, oracle)
        self.report.heavy_check = check
        if spared is not None:
            names = spared
        grown = fewer_casts(names, low, self.original.graph, heavy, oracle)
        if spared is None and grown == names:
            return found
        known = {m.node: m for m in found}
        whole = oracle.score(grown) * tune_tol
        out = []
        for name in grown:
            if name not in names:
                out.append(MovedNode(name, low[name].op, "fewer casts", None, whole))
            elif name in known and known[name].reason != "measurement" or len(names) > MEASURE_EACH:
                out.append(known.get(name) or MovedNode(name, low[name].op, "ranking prefix", None, whole))
            else:
                out.append(MovedNode(name, low[name].op, "measurement",
                                     oracle.score(set(grown) - {name}) * tune_tol, whole))
        return out

    def _release(self, found: list[MovedNode], order: Sequence[str], low: Mapping[str, LowNode],
                 heavy: frozenset[str], oracle: Oracle, tune_tol: float) -> list[MovedNode]:
        """Conv/MatMul/Gemm of the landed set back to low precision where the tolerance allows, and the
        proof for the rest (:mod:`onnxmp.calibrate.release`)."""
        names = [m.node for m in found]
        kept, record = release_heavy(names, heavy, order, oracle, {n: low[n].op for n in names}, tune_tol)
        self.report.release = record
        keep = set(kept)
        return [m for m in found if m.node in keep]

    def release_landed(self, best, best_m: Measurement, best_forced: Mapping[str, str], bar: RunBar | None = None):
        """The release step over every Conv/MatMul/Gemm the landed model keeps in float32.

        Each cycle's release tries only that cycle's set: a cycle's board switches only the nodes still
        low after the cycles before it, so what an earlier cycle forced is never tried again, and the
        last cycle's proof left it out (PP-OCRv4's detector: 3 of its 27 fp32 Conv listed).  Here every
        forced Conv/MatMul/Gemm is tried back in low precision on the first cycle's board (every node
        plain conversion makes low), each candidate scored as the model it writes; the releases that
        pass are converted and confirmed, and kept when the confirmed model is the better one.  A
        Conv/MatMul/Gemm the coloring keeps in fp32 by a rule or seed is listed with that reason."""
        plain = self._plain
        if plain is None:
            return best, best_m
        if plain.board is None:
            plain.board = Switchboard(self.original, plain.low, self.precision, plain.fills, plain.low_io)
        followers = plain.board.followers
        ops = {v.node: v.op for v in best.report.vertices}
        colors = best.report.node_colors()
        fp32_heavy = [n for n, op in ops.items() if op in TENSOR_CORE_OPS and colors.get(n) != "allow"]
        switched = [n for n in best_forced if n in plain.board.nodes]
        extra = {n: c for n, c in best_forced.items() if n not in plain.board.nodes and n not in plain.board.follows}
        ruled = [RuledHeavy(n, ops[n], _why(best.report, n)) for n in fp32_heavy if n not in best_forced]
        if not any(n in best_forced for n in fp32_heavy):
            if self.report.release is not None:
                self.report.release.ruled = ruled
            return best, best_m
        if plain.oracle is not None and bool(self.report.holdout_joined) == plain.joined and not extra:
            oracle = plain.oracle  # same board, samples and base: its cache holds what cycle 1 measured
        else:
            # Forced besides each candidate: what the first board does not switch (the candidates name
            # every other forced node themselves).
            evaluate = self._scorer(plain.board, self._order_samples, self.tolerance, frozenset(extra))
            oracle = Oracle(evaluate, max_runs=0, full=lambda fp32: evaluate(fp32, full=True), deadline=self.deadline)
        oracle.on_run = bar
        oracle.max_runs = oracle.runs + max(self.max_runs - self.runs, 0)
        before = oracle.runs
        try:
            kept, record = release_heavy(switched, plain.heavy, plain.order, oracle,
                                         {n: ops.get(n, "") for n in switched}, self.tolerance)
        finally:
            self.runs += oracle.runs - before
            plain.board = plain.oracle = None  # done with: not alive beside the confirmation's session
        record.landed, record.ruled = True, ruled
        self.report.release = record
        if not record.released:
            return best, best_m
        gone = set(record.released) | {c for n in record.released for c in followers.get(n, ())}
        forced = {n: c for n, c in best_forced.items() if n not in gone}
        cand = self.convert(forced)
        cand_m = self.measure(cand)
        self.report.cycles.append(CycleRecord(len(self.report.cycles) + 1, len(forced), cand_m,
                                              min(best_m.worst, cand_m.worst), self.tolerance))
        if not cand_m.meets(self.tolerance):
            record.note = (f"the model with {len(record.released)} released measured {cand_m.tune_error:.3g}"
                           + ("" if cand_m.holdout_error is None else f" (held-out {cand_m.holdout_error:.3g})")
                           + f" against the tolerance {self.tolerance:g}")
            record.proven = False
            self._drop(cand)
            return best, best_m
        log.info("calibration: the release over the landed model freed %d Conv/MatMul/Gemm",
                 len(record.released))
        self.forced.clear()
        self.forced.update(forced)
        return self._better(best, best_m, cand, cand_m)

    def _out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def fallback_all_fp32(self, best, best_m, forced, moved):
        """Every remaining low node back to float32 ("every node in fp32 but the I/O": the interface
        keeps the type keep_io_types gives it): lands whenever the float32 model does.  Taken only when
        every candidate measured so far failed; ``report.fallback`` says so in numbers."""
        cycles = self.report.cycles
        tried = (f"plain conversion and {len(cycles)} confirmed candidate(s) after {self.runs} run(s), the best at "
                 f"{best_m.worst:.3g} (tuning {best_m.tune_error:.3g}"
                 + (f", held-out {best_m.holdout_error:.3g}" if best_m.holdout_error is not None else "")
                 + f") against the tolerance {self.tolerance:g}")
        if self.report.budget_exhausted:
            tried += "; the run budget ran out"
        current = best
        for _ in range(2):  # deny propagation can leave a node low once; a second pass catches it
            low = _low_nodes(self.original, current.report)
            if not low:
                break
            for name, node in low.items():
                forced[name] = f"{ACCURACY_FALLBACK}: the search could not land; all-float32 fallback"
                moved[name] = MovedNode(name, node.op, "all-float32 fallback", None, None)
            previous, current = current, self.convert(forced)
            if previous is not best:
                self._drop(previous)
        current_m = self.measure(current)
        cycles.append(CycleRecord(len(cycles) + 1, len(forced), current_m, min(best_m.worst, current_m.worst),
                                  self.tolerance))
        io = "" if not _low_io(self.original, current.model) else " but the low-precision I/O"
        self.report.fallback = (f"{tried}; every node in fp32{io} measures {current_m.worst:.3g}"
                                + ("" if current_m.meets(self.tolerance) else ", which misses too"))
        log.warning("calibration fell back to float32: %s", self.report.fallback)
        return self._better(best, best_m, current, current_m)

    def _better(self, best, best_m: Measurement, cand, cand_m: Measurement):
        """Passing beats failing; among passing, more fp16 Conv/MatMul/Gemm; else the lower error."""
        def key(result, m: Measurement):
            share = result.report.tensor_core_share() or 0.0
            return (0, -share, m.worst) if m.meets(self.tolerance) else (1, m.worst, -share)

        if cand is best:
            return best, min(best_m, cand_m, key=lambda m: m.worst)
        if key(cand, cand_m) < key(best, best_m):
            self._drop(best)
            return cand, cand_m
        self._drop(cand)  # its report still steers the next cycle; its weights are not needed
        return best, best_m

    def _drop(self, result) -> None:
        """Delete the weights a converted candidate spilled (a large model's are as big as the model)."""
        discard_spilled(result.model, keep=[self.original])

    def finish(self, result):
        rep = self.report
        rep.runs = self.runs
        rep.seconds = time.perf_counter() - self.started
        rep.share_final = result.report.tensor_core_share()
        rep.share_all_final = _low_share(result.report)
        rep.casts_final = _added_casts(self.original, result.model)
        if self._colorings:
            log.info("calibration: %d candidate coloring(s), %.1f s of %.1f s", len(self._colorings),
                     self._colorings.seconds, rep.seconds)
        result.report.calibration = rep
        return result


def _why(report: Report, node: str) -> str:
    """The coloring's rule and cause for a node that ends in float32 (its first non-allow vertex)."""
    row = next((v for v in report.vertices if v.node == node and v.color != "allow"), None)
    return "" if row is None else f"{row.rule}: {row.cause}"


def calibrate(model: ModelLike, options: Options) -> ConversionResult:
    """Convert with calibration seeds, then search for the nodes to keep in fp32 until the outputs
    are within ``options.tolerance``.

    Returns the :class:`~onnxmp.pipeline.ConversionResult` of the best model found;
    ``result.report.calibration`` (a :class:`CalibrationReport`) says whether the tolerance was
    met (``.met``), the errors before and after, and why each node moved.
    """
    return _Calibration(model, options).run()

