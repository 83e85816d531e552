"""ONNX's operator conformance cases (``onnx.backend.test.case.node``) run through onnxmp.

Used by ``tests/test_onnx_conformance.py``; ``python -m tests.onnx_corpus`` prints the tallies.

Which cases: every case whose graph (or a body) has a float32 value (a tensor, or a
sequence/optional of float32 tensors, at an interface or as an initializer) and that
onnxruntime's CPU EP loads and runs in float32 as given.  The second filter is ORT's own
verdict, not a hand list: cases for opsets or IR versions newer than this onnxruntime, or
for kernels it lacks, drop out.

What each case must do, at every level: convert without a crash or a refusal, give a model
that passes :func:`onnxmp.verify.verify` (checker + strict type inference, also when the
model comes back unchanged), and keep the graph's input/output names and types (element
types, shapes, sequence/optional structure) exactly.

Parity (default level): the converted model, emulated on the CPU (:func:`onnxmp.emulate`),
must match the float32 run per output over the fp32 run's finite elements:

    max |y_mixed - y_fp32|  <=  4 * D * U * (max |y_fp32| + max |x|)

with U = 2**-11 the float16 unit roundoff and D the number of roundings to float16 on the
longest path through the emulated model (a Loop/Scan body counts once per possible
iteration).  Each rounding perturbs the values through it by at most U relative; the factor 4
is the amplification a rounded operand may see in one op (both operands of a product, and
a sum of such products accumulated in float32), measured against the largest magnitude in
play, input or output.  Non-finite elements and non-float outputs must agree exactly.  On
onnx 1.23's corpus the worst case uses 0.68 U (|y| + |x|) of that budget.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Iterator

import numpy as np
import onnx

import onnxmp
from onnxmp.errors import OnnxMPError
from onnxmp.subgraphs import iter_proto_graphs
from onnxmp.verify import io_signature, verify

LEVELS = ("default", "unsafe_force_all")
U = 2.0 ** -11  # fp16 unit roundoff
GAIN_PER_ROUNDING = 4.0
LOW = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)

OUTCOMES = ("ok", "crash", "refused", "invalid", "io_changed", "parity")


@dataclasses.dataclass
class Outcome:
    case: str
    level: str
    kind: str = "ok"           # one of OUTCOMES
    detail: str = ""


@functools.lru_cache(maxsize=1)
def _all_cases() -> tuple:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with np.errstate(all="ignore"):
            return tuple(collect_testcases())


def _leaf_elem(tp: onnx.TypeProto) -> int | None:
    which = tp.WhichOneof("value")
    if which in ("tensor_type", "sparse_tensor_type"):
        return getattr(tp, which).elem_type
    if which in ("sequence_type", "optional_type"):
        return _leaf_elem(getattr(tp, which).elem_type)
    if which == "map_type":
        return _leaf_elem(tp.map_type.value_type)
    return None


def _graph_has_float(graph: onnx.GraphProto) -> bool:
    for g in iter_proto_graphs(graph):
        if any(_leaf_elem(v.type) == onnx.TensorProto.FLOAT for v in list(g.input) + list(g.output)):
            return True
        if any(t.data_type == onnx.TensorProto.FLOAT for t in g.initializer):
            return True
    return False


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _feeds(model: onnx.ModelProto, inputs) -> dict:
    inits = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    return {name: value for name, value in zip(names, inputs) if value is not None}


def run_ort(model: onnx.ModelProto, inputs) -> list:
    session = _session(model)
    return session.run(None, _feeds(model, inputs))


@dataclasses.dataclass
class Case:
    name: str
    model: onnx.ModelProto
    inputs: list
    fp32_outputs: list


@functools.lru_cache(maxsize=1)
def selected_cases() -> dict[str, Case]:
    """Cases with float32 values that ORT's CPU EP runs in float32 (see the module docstring)."""
    out: dict[str, Case] = {}
    for case in _all_cases():
        if case.kind != "node" or case.model is None or not case.data_sets:
            continue
        if not _graph_has_float(case.model.graph):
            continue
        inputs = list(case.data_sets[0][0])
        try:
            with np.errstate(all="ignore"):
                fp32 = run_ort(case.model, inputs)
        except Exception:
            continue  # ORT itself cannot run this case in float32
        out[case.name] = Case(case.name, case.model, inputs, fp32)
    return out


def _flatten(value) -> Iterator[np.ndarray]:
    if value is None:
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)
        return
    yield np.asarray(value)


def rounding_depth(graph: onnx.GraphProto, iterations: int) -> int:
    """Most low-precision roundings (Casts to float16/bfloat16 of the emulated model) met on one
    path from an input to an output; a Loop/Scan body counts once per possible iteration."""
    depth: dict[str, int] = {}
    for node in graph.node:
        d = max((depth.get(name, 0) for name in node.input), default=0)
        if node.op_type == "Cast" and any(a.name == "to" and a.i in LOW for a in node.attribute):
            d += 1
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                repeat = iterations if node.op_type in ("Loop", "Scan") else 1
                d += rounding_depth(sub, iterations) * repeat
        for name in node.output:
            depth[name] = d
    return max((depth.get(v.name, 0) for v in graph.output), default=0)


def _iteration_bound(inputs) -> int:
    """An upper bound on Loop trip counts / Scan lengths in the case's data: its largest integer
    scalar or leading dimension (capped: corpus loops are short)."""
    bound = 1
    for array in (a for x in inputs for a in _flatten(x)):
        if array.ndim == 0 and array.dtype.kind in "iu":
            bound = max(bound, int(array))
        elif array.ndim:
            bound = max(bound, array.shape[0])
    return min(bound, 64)


def parity_error(case: Case, converted: onnx.ModelProto) -> str:
    """Empty when the emulated converted model matches the fp32 run within the bound."""
    from onnxmp.parity.emulate import emulate

    emulated = emulate(converted)
    with np.errstate(all="ignore"):
        got = run_ort(emulated, case.inputs)
    floats = [a for x in case.inputs for a in _flatten(x) if a.dtype.kind == "f"]
    x_max = max((float(np.max(np.abs(a[np.isfinite(a)]), initial=0.0)) for a in floats), default=0.0)
    gain = GAIN_PER_ROUNDING * max(1, rounding_depth(emulated.graph, _iteration_bound(case.inputs)))
    for index, (want, have) in enumerate(zip(case.fp32_outputs, got)):
        for w, h in zip(_flatten(want), _flatten(have)):
            if w.shape != h.shape:
                return f"output {index}: shape {h.shape} != {w.shape}"
            if w.dtype.kind != "f":
                if not np.array_equal(w, h):
                    return f"output {index}: non-float values differ"
                continue
            w64, h64 = w.astype(np.float64), h.astype(np.float64)
            finite = np.isfinite(w64)
            if not np.array_equal(w64[~finite], h64[~finite], equal_nan=True) or \
                    not np.isfinite(h64[finite]).all():
                return f"output {index}: non-finite values differ"
            if not finite.any():
                continue
            bound = gain * U * (float(np.max(np.abs(w64[finite]))) + x_max)
            err = float(np.max(np.abs(h64[finite] - w64[finite])))
            if not err <= bound:
                return f"output {index}: max |err| {err:.3g} > bound {bound:.3g} (gain {gain:g})"
    return ""


def check_case(case: Case, level: str) -> Outcome:
    outcome = Outcome(case.name, level)
    try:
        result = onnxmp.convert(case.model, level=level, keep_io_types=True)
    except OnnxMPError as exc:
        outcome.kind, outcome.detail = "refused", exc.one_line()
        return outcome
    except Exception as exc:  # noqa: BLE001 - the tally's point
        outcome.kind, outcome.detail = "crash", f"{type(exc).__name__}: {exc}"
        return outcome
    converted = result.model
    try:
        verify(converted)  # checker + strict type inference, also for models returned unchanged
    except OnnxMPError as exc:
        outcome.kind, outcome.detail = "invalid", exc.message
        return outcome
    if io_signature(converted) != io_signature(case.model):
        outcome.kind, outcome.detail = "io_changed", f"{io_signature(case.model)} -> {io_signature(converted)}"
        return outcome
    if level == "default":
        try:
            error = parity_error(case, converted)
        except Exception as exc:  # noqa: BLE001 - an emulated model ORT cannot run is a failure too
            error = f"emulated run failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if error:
            outcome.kind, outcome.detail = "parity", error
    return outcome


def main() -> None:
    import logging
    import time

    logging.getLogger("onnxmp").setLevel(logging.ERROR)
    start = time.perf_counter()
    cases = selected_cases()
    print(f"{len(cases)} cases selected of {len(_all_cases())} in {time.perf_counter() - start:.1f} s")
    for level in LEVELS:
        start = time.perf_counter()
        outcomes = [check_case(c, level) for c in cases.values()]
        tally = {k: sum(o.kind == k for o in outcomes) for k in OUTCOMES}
        print(f"{level}: {len(outcomes)} run in {time.perf_counter() - start:.1f} s: "
              + ", ".join(f"{k} {v}" for k, v in tally.items()))
        for o in outcomes:
            if o.kind != "ok":
                print(f"  {o.kind:10s} {o.case}: {o.detail[:200]}")


if __name__ == "__main__":
    main()
