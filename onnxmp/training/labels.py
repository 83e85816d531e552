"""Checks on labels before they reach onnxruntime, which truncates float class labels,
accepts out-of-range classes and reports shape mismatches deep in C++."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from onnxmp.errors import OnnxMPError
from onnxmp.training.losses import loss as loss_named


def output_shape(model) -> list[int | None]:
    """Static dims of the model's first output (``None`` where symbolic or unknown)."""
    tensor_type = model.graph.output[0].type.tensor_type
    if not tensor_type.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]


def check_labels(loss: str, labels: np.ndarray, *, rows: int, shape: Sequence[int | None], where: str = "labels",
                 ) -> np.ndarray:
    """Return ``labels`` in the dtype the loss reads, or raise OnnxMPError saying what is wrong.

    ``rows`` is the batch size of the model inputs, ``shape`` the model's first
    output shape (:func:`output_shape`).  Cross entropy wants integer classes in
    ``[0, C)`` with one label per row (``shape`` minus its last dim); the other
    losses want float targets shaped like the output.
    """
    labels = np.asarray(labels)
    if labels.dtype.kind not in "biuf":
        raise OnnxMPError(f"{where} have dtype {labels.dtype}; the {loss} loss needs numbers",
                          "convert them to integers (class ids) or floats (targets) first")
    if len(labels) != rows:
        raise OnnxMPError(f"{where} have {len(labels)} rows but the inputs have {rows}")
    known = list(shape)
    kind = loss_named(loss)
    if kind.classes:
        if labels.dtype.kind == "f":
            if not np.all(np.isfinite(labels)) or np.any(labels != np.round(labels)):
                raise OnnxMPError(f"{where} hold non-integer values (e.g. {_first_bad(labels)}); "
                                  "cross entropy needs class ids", "pass integer class ids, not probabilities")
        elif labels.dtype.kind == "b":
            raise OnnxMPError(f"{where} are booleans; cross entropy needs integer class ids",
                              "use the bce_with_logits loss for binary targets, or labels.astype(int)")
        if known and labels.ndim != len(known) - 1:
            raise OnnxMPError(f"{where} have shape {list(labels.shape)} but the {loss} loss needs one class id per "
                              f"row of the logits (shape {_dims(known[:-1])} for logits {_dims(known)})",
                              "pass class ids, not one-hot rows" if labels.ndim == len(known) else None)
        classes = known[-1] if known else None
        if labels.size:
            low, high = labels.min(), labels.max()
            if low < 0 or (classes is not None and high >= classes):
                bad = low if low < 0 else high
                raise OnnxMPError(f"{where} hold class id {int(bad)}, outside [0, {classes if classes else 'C'})"
                                  + (f" for logits with {classes} classes" if classes else ""),
                                  "class ids must index the logits' last dimension")
        return labels.astype(np.int64, copy=False)
    if labels.dtype.kind not in "fb" and kind.probabilities and labels.size and (
            labels.min() < 0 or labels.max() > 1):
        raise OnnxMPError(f"{where} for {loss} must lie in [0, 1]")
    if known and (labels.ndim != len(known) or any(k is not None and k != n for k, n in
                                                   zip(known[1:], labels.shape[1:]))):
        raise OnnxMPError(f"{where} have shape {list(labels.shape)} but the {loss} loss compares them with the "
                          f"model output, shape {_dims(known)}", "give targets the output's shape")
    return labels.astype(np.float32, copy=False)


def _dims(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("N" if i == 0 and d is None else "?" if d is None else str(d)
                           for i, d in enumerate(shape)) + "]"


def _first_bad(labels: np.ndarray):
    flat = labels.ravel()
    bad = flat[~np.isfinite(flat) | (flat != np.round(flat))]
    return bad[0] if bad.size else None
