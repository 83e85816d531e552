"""Calibration: data-driven deny seeds and the accuracy-guided fallback (spec §4).

``observe_magnitudes`` runs the fp32 model once on onnxruntime CPU and records
max |x| of every intermediate; nodes whose outputs exceed the threshold are
denied before coloring.

``convert_with_calibration`` then converts, runs the emulated low-precision
model on the same samples, and, if an output misses the tolerance, compares
*every intermediate tensor* of the two runs.  Each low-precision node is ranked
by the error it adds (its output error minus the worst error already on its
inputs); the worst are forced to fp32 and the loop repeats.  Unlike
onnxconverter-common's whole-model bisection this needs a handful of
convert+run cycles, not tens.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import onnx

from onnxmp.color.seeds import DEFAULT_THRESHOLD, DEFAULT_UNDERFLOW_SHARE
from onnxmp.errors import OnnxMPError
from onnxmp.load import load

log = logging.getLogger("onnxmp.calibrate")

DEFAULT_TOLERANCE = 1e-2          # max |cand - ref| / max |ref| per output
MAX_CYCLES = 10
MAX_DENY_PER_CYCLE = 8

Sample = dict[str, np.ndarray]


def samples_from(model: onnx.ModelProto, calibration) -> list[Sample]:
    """A dict of arrays, a list of dicts, one .npz path or a list of them."""
    from onnxmp.inputs import check_inputs, load_npz

    if isinstance(calibration, Mapping):
        samples = [dict(calibration)]
    elif isinstance(calibration, (str, os.PathLike)):
        samples = load_npz([calibration])
    elif isinstance(calibration, Sequence) and calibration and all(isinstance(s, Mapping) for s in calibration):
        samples = [dict(s) for s in calibration]
    elif isinstance(calibration, Sequence) and calibration:
        samples = load_npz(list(calibration))
    else:
        raise OnnxMPError("calibration needs sample inputs",
                          hint="pass a dict of input arrays, a list of them, or .npz paths")
    return [check_inputs(model, s) for s in samples]


def _float_tensors(model: onnx.ModelProto) -> list[str]:
    """Main-graph tensors that are float32 after shape inference, in node order."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input)}
    names = []
    for node in inferred.graph.node:
        names += [o for o in node.output if o and types.get(o) == onnx.TensorProto.FLOAT]
    return names


def run_with_intermediates(model: onnx.ModelProto, samples: Sequence[Sample]) -> list[dict[str, np.ndarray]]:
    """Run on onnxruntime CPU with every float32 main-graph tensor exposed as an output."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output}
    for name in _float_tensors(model):
        if name not in present:
            probe.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
            present.add(name)
    try:
        session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise OnnxMPError(f"onnxruntime cannot load the model for calibration: {str(exc).splitlines()[0][:300]}",
                          hint="check that the fp32 model runs on onnxruntime CPU") from None
    names = [o.name for o in session.get_outputs()]
    feeds_allowed = {i.name for i in session.get_inputs()}
    runs = []
    for sample in samples:
        try:
            values = session.run(None, {k: v for k, v in sample.items() if k in feeds_allowed})
        except Exception as exc:
            raise OnnxMPError(f"calibration run failed: {str(exc).splitlines()[0][:300]}",
                              hint="check the calibration inputs' shapes and dtypes") from None
        runs.append(dict(zip(names, values)))
    return runs


def observe_magnitudes(model: onnx.ModelProto, calibration) -> dict[str, float]:
    """max |x| over all samples of every float32 intermediate of the fp32 model."""
    model = load(model)
    runs = run_with_intermediates(model, samples_from(model, calibration))
    return _magnitudes(runs)


def _magnitudes(runs: Sequence[Mapping[str, np.ndarray]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for run in runs:
        for name, value in run.items():
            if value.dtype != np.float32 or value.size == 0:
                continue
            finite = value[np.isfinite(value)]
            peak = float(np.abs(finite).max()) if finite.size else 0.0
            out[name] = max(out.get(name, 0.0), peak)
    return out


def relative_error(ref: np.ndarray, cand: np.ndarray) -> float:
    """max |cand - ref| / max |ref|; inf when cand is non-finite where ref is finite."""
    ref = np.asarray(ref, dtype=np.float64)
    cand = np.asarray(cand, dtype=np.float64)
    if ref.shape != cand.shape:
        return math.inf
    finite = np.isfinite(ref)
    if not np.isfinite(cand[finite]).all():
        return math.inf
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(ref[finite]).max()), 1e-12)
    return float(np.abs(cand[finite] - ref[finite]).max()) / scale


@dataclass
class Cycle:
    cycle: int
    output_errors: dict[str, float]
    passed: bool
    denied: list[dict[str, Any]] = field(default_factory=list)


def convert_with_calibration(model, *, calibration, tolerance: float = DEFAULT_TOLERANCE,
                             calibration_threshold: float = DEFAULT_THRESHOLD, max_cycles: int = MAX_CYCLES,
                             underflow_share: float = DEFAULT_UNDERFLOW_SHARE, **convert_options):
    """Convert with calibration seeds, then fall back node by node until outputs are within tolerance."""
    from onnxmp.convert import convert_once
    from onnxmp.emulate import emulate

    if not tolerance > 0:
        raise OnnxMPError(f"tolerance must be positive, got {tolerance}", hint="e.g. --tolerance 0.01")
    original = load(model)
    samples = samples_from(original, calibration)
    reference = run_with_intermediates(original, samples)
    magnitudes = _magnitudes(reference)
    outputs = [o.name for o in original.graph.output]
    forced: dict[str, str] = {}
    history: list[Cycle] = []
    result = None
    for cycle in range(1, max_cycles + 1):
        result = convert_once(original, calibration_magnitudes=magnitudes,
                              calibration_threshold=calibration_threshold, underflow_share=underflow_share,
                              forced_deny=forced, **convert_options)
        if not result.report.changed:
            history.append(Cycle(cycle, {}, True))
            break
        precision = convert_options.get("precision", "float16")
        candidate = run_with_intermediates(emulate(result.model, precision, keep_io_types=False), samples)
        errors = {name: max(relative_error(r[name], c[name]) for r, c in zip(reference, candidate))
                  for name in outputs if reference[0][name].dtype == np.float32}
        passed = all(e <= tolerance for e in errors.values())
        record = Cycle(cycle, errors, passed)
        history.append(record)
        log.info("calibration cycle %d: worst output error %.3g (tolerance %g)", cycle,
                 max(errors.values(), default=0.0), tolerance)
        if passed or cycle == max_cycles:
            break
        culprits = _rank_added_error(result, reference, candidate, tolerance, forced)
        if not culprits:
            log.warning("no low-precision node adds measurable error; stopping the fallback")
            break
        for culprit in culprits:
            forced[culprit["node"]] = culprit["cause"]
            record.denied.append(culprit)
    assert result is not None
    passed = bool(history) and history[-1].passed
    seeded = sorted(((t, m) for t, m in magnitudes.items() if m > calibration_threshold), key=lambda x: -x[1])
    result.report.calibration.update({
        "tolerance": tolerance, "threshold": calibration_threshold, "samples": len(samples),
        "cycles": len(history), "passed": passed,
        "history": [c.__dict__ for c in history],
        "fallback": [{"node": n, "cause": c} for n, c in forced.items()],
        "seeded": [{"tensor": t, "observed_max": m} for t, m in seeded],
    })
    if not passed:
        log.warning("calibrated conversion still misses tolerance %g after %d cycles", tolerance, len(history))
    return result


def _rank_added_error(result, reference, candidate, tolerance, forced) -> list[dict[str, Any]]:
    """Nodes to force to fp32, worst local error amplification first.

    A node's added error is its output's relative error minus the worst relative
    error already on its inputs.  A low-precision node that adds error is itself
    the culprit.  A float32 node that still adds error amplifies the rounding its
    inputs carry (cancellation, as in ``(x + 2000) - 2000``), so the low-precision
    nodes feeding it are the culprits.
    """
    view = result.coloring.coloring.view
    state = result.coloring.coloring
    allow_nodes = {view.vertices[k].node for k in state.allow_keys()}
    err_cache: dict[str, float] = {}

    def err(name: str) -> float:
        if name not in err_cache:
            if name not in reference[0] or name not in candidate[0]:
                err_cache[name] = 0.0  # initializers and graph inputs: no run-time error of their own
            else:
                err_cache[name] = max(relative_error(r[name], c[name]) for r, c in zip(reference, candidate))
        return err_cache[name]

    scored = []
    for order, (node, keys) in enumerate(view.node_vertices.items()):
        keys = [k for k in keys if view.vertices[k].float32 and view.vertices[k].graph == ""]
        outs = [t for k in keys for _, t in view.vertices[k].outputs]
        ins = [t for k in keys for _, t in view.vertices[k].inputs]
        if not outs:
            continue
        out_err = max(err(t) for t in outs)
        in_err = max((err(t) for t in ins), default=0.0)
        if math.isinf(in_err):
            continue  # the damage happened upstream
        added = math.inf if math.isinf(out_err) else out_err - in_err
        if added > tolerance / 10:
            scored.append((order, added, node, view.vertices[keys[0]].op, out_err, in_err, ins))
    # Relative errors grow downstream as tensors' ranges change, so the node adding the most
    # is often a victim.  Errors flow forward: among the nodes adding a significant share of
    # the worst, the earliest in topological order are the likeliest sources.
    worst = max((r[1] for r in scored), default=0.0)
    significant = [r for r in scored if r[1] >= 0.25 * worst or (math.isinf(worst) and math.isinf(r[1]))]
    significant.sort(key=lambda r: r[0])
    chosen: dict[str, dict[str, Any]] = {}
    downstream: set[str] = set()  # nodes fed by a chosen culprit: maybe only its victims

    def mark_downstream(culprit: str) -> None:
        stack = list(view.node_vertices.get(culprit, []))
        while stack:
            for nxt in view.fanout[view.vertices[stack.pop()].id]:
                owner = view.by_id[nxt].node
                if owner not in downstream:
                    downstream.add(owner)
                    stack.extend(view.node_vertices.get(owner, []))

    for _, added, node, op, out_err, in_err, ins in significant:
        if node in downstream:
            continue
        if node in allow_nodes and node not in forced:
            mark_downstream(node)
            chosen.setdefault(node, {
                "node": node, "op": op, "added_error": added, "output_error": out_err, "input_error": in_err,
                "cause": f"accuracy fallback: adds relative error {added:.3g} on calibration data "
                         f"(inputs {in_err:.3g} -> output {out_err:.3g})"})
            continue
        for tensor in ins:  # an fp32 amplifier: blame its low-precision producers
            producer = view.producer_of.get(tensor)
            if producer is None:
                continue
            src = view.by_id[producer]
            if src.node in allow_nodes and src.node not in forced:
                mark_downstream(src.node)
                chosen.setdefault(src.node, {
                    "node": src.node, "op": src.op, "added_error": added, "output_error": out_err,
                    "input_error": in_err,
                    "cause": f"accuracy fallback: feeds {op} `{node}`, which amplifies its rounding error "
                             f"to {out_err:.3g} on calibration data (inputs {in_err:.3g})"})
    return list(chosen.values())[:MAX_DENY_PER_CYCLE]
