"""Calibration's data: the samples, the float32 references, and the observed magnitudes that seed
the coloring."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from onnxmp.calibrate.session import cpu_session, run_samples
from onnxmp.errors import OnnxMPError
from onnxmp.external import skeleton
from onnxmp.load import load

Sample = dict[str, np.ndarray]


def samples_from(model: onnx.ModelProto, calibration) -> list[Sample]:
    """A dict of arrays, an .npz path or a list of either, checked against the model."""
    from onnxmp.inputs import as_samples, check_inputs, drop_extra_inputs

    samples = as_samples(calibration, what="calibration")
    # As validate does: a training file's labels are no reason to refuse it.
    return [check_inputs(model, s, flag="--calibrate") for s in drop_extra_inputs(model, samples)]


def split_holdout(samples: Sequence[Sample], holdout: int | None) -> tuple[list[Sample], list[Sample]]:
    """Tuning and held-out samples: the last ``holdout`` samples are held out.

    ``None`` picks automatically: a quarter of the samples (at least one) once
    there are two or more, none for a single sample.
    """
    n = len(samples)
    if holdout is None:
        holdout = max(1, n // 4) if n >= 2 else 0
    if holdout < 0 or (holdout and holdout >= n):
        raise OnnxMPError(f"--holdout {holdout} leaves no sample to tune on ({n} given)",
                          hint=f"hold out fewer than {n} samples, or pass more .npz files")
    return list(samples[:n - holdout]), list(samples[n - holdout:])


def _float_tensors(model: onnx.ModelProto) -> list[str]:
    """Main-graph tensors that are float32 after shape inference, in node order."""
    inferred = onnx.shape_inference.infer_shapes(skeleton(model))  # types only: no weights, no 2 GB limit
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input)}
    names = []
    for node in inferred.graph.node:
        names += [o for o in node.output if o and types.get(o) == onnx.TensorProto.FLOAT]
    return names


def _check_references(references: Sequence[dict[str, np.ndarray]]) -> None:
    """Refuse a sample on which the float32 model's output is inf/NaN everywhere: any candidate would
    'match' it, so calibration would report success without having measured anything."""
    for index, outputs in enumerate(references, 1):
        for name, value in outputs.items():
            value = np.asarray(value)
            if value.size and value.dtype.kind == "f" and not np.isfinite(value).any():
                raise OnnxMPError(f"the float32 model's output {name!r} is inf/NaN in every element on "
                                  f"calibration sample {index}; it cannot judge accuracy",
                                  hint="check that sample's inputs (NaN or inf in them?)")


def run_with_intermediates(model: onnx.ModelProto, samples: Sequence[Sample]) -> list[dict[str, np.ndarray]]:
    """Run on onnxruntime CPU with every float32 main-graph tensor exposed as an output."""
    return list(run_samples(cpu_session(_probe(model), "model"), samples))


def _probe(model: onnx.ModelProto) -> onnx.ModelProto:
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output}
    for name in _float_tensors(model):
        if name not in present:
            probe.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
            present.add(name)
    return probe


def observe_magnitudes(model: onnx.ModelProto, calibration) -> dict[str, float]:
    """max |x| over all samples of every float32 intermediate of the fp32 model."""
    model = load(model, lazy_external=True)
    magnitudes: dict[str, float] = {}
    for run in run_samples(cpu_session(_probe(model), "model"), samples_from(model, calibration)):
        _fold_magnitudes(magnitudes, run)
    return magnitudes


def _fold_magnitudes(out: dict[str, float], run: Mapping[str, np.ndarray]) -> None:
    for name, value in run.items():
        if value.dtype != np.float32 or value.size == 0:
            continue
        hi, lo = float(value.max()), float(value.min())
        if math.isfinite(hi) and math.isfinite(lo):
            # No inf/NaN (max and min propagate NaN): two reductions, no masked copy of each tensor
            peak = max(abs(hi), abs(lo))
        else:
            finite = value[np.isfinite(value)]
            peak = float(np.abs(finite).max()) if finite.size else 0.0
        out[name] = max(out.get(name, 0.0), peak)

