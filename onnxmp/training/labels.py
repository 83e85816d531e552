"""Checks on labels before they reach onnxruntime, which truncates float class labels,
accepts out-of-range classes and reports shape mismatches deep in C++.

Three moments: :func:`check_output` at build time (the loss against the model's output
rank), :func:`check_labels` on every batch before a step (dtype, rows, classes, static
dims), and :func:`label_run_error` for what only the first step can see (the number of
positions, where the output's dims are symbolic).
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import numpy as np

from onnxmp.errors import OnnxMPError
from onnxmp.training.losses import LOSSES
from onnxmp.training.losses import loss as loss_named


def output_shape(model) -> list[int | None]:
    """Static dims of the model's first output (``None`` where symbolic or unknown)."""
    tensor_type = model.graph.output[0].type.tensor_type
    if not tensor_type.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]


def check_output(loss: str, shape: Sequence[int | None], output: str = "the model's first output") -> None:
    """At build time: refuse a loss the model's output cannot feed (its rank, a causal LM's length)."""
    if loss not in LOSSES or not shape:
        return  # a custom loss, or an output of unknown rank: the first step tells
    kind = loss_named(loss)
    low, high = kind.ranks
    rank = len(shape)
    if rank < low or (high is not None and rank > high):
        wanted = {"cross_entropy": "logits with the classes on the last axis ([N, C], [B, S, V], ...)",
                  "causal_lm": "[batch, sequence, vocab] logits"}.get(loss, f"rank {low}..{high}")
        raise OnnxMPError(f"the {loss} loss needs {wanted}, but {output} has shape {_dims(shape)}",
                          "use the loss that fits the model's head (cross_entropy for one label per row)"
                          if loss == "causal_lm" else "pick the loss that fits the model's head")
    if loss == "causal_lm" and shape[1] is not None and shape[1] < 2:
        raise OnnxMPError(f"the causal_lm loss predicts the next token: {output} has sequence length {shape[1]}",
                          "export the model with a sequence axis of 2 or more (or dynamic)")


def check_labels(loss: str, labels: np.ndarray, *, rows: int, shape: Sequence[int | None], where: str = "labels",
                 options: Mapping[str, Any] | None = None) -> np.ndarray:
    """Return ``labels`` in the dtype the loss reads, or raise OnnxMPError saying what is wrong.

    ``rows`` is the batch size of the model inputs, ``shape`` the model's first output shape
    (:func:`output_shape`), ``options`` the loss's options (the manifest's ``loss_options``;
    the defaults when absent).  Cross entropy and causal LM want integer classes in ``[0, C)``,
    or the ignore index, with one label per position: the logits' shape minus its last
    (class) axis.  The other losses want float targets shaped like the output.  A custom
    loss (a name not in the table) gets the checks every loss needs: numbers, one row per input row.
    """
    labels = np.asarray(labels)
    if labels.dtype.kind not in "biuf":
        raise OnnxMPError(f"{where} have dtype {labels.dtype}; the {loss} loss needs numbers",
                          "convert them to integers (class ids) or floats (targets) first")
    if labels.ndim == 0:
        raise OnnxMPError(f"{where} are a scalar; the {loss} loss needs one label per row")
    if len(labels) != rows:
        raise OnnxMPError(f"{where} have {len(labels)} rows but the inputs have {rows}")
    if loss not in LOSSES:
        return labels
    known = list(shape)
    kind = loss_named(loss)
    resolved = kind.resolve(dict(options or {}))
    if kind.classes:
        return _class_ids(loss, labels, known, where, resolved["ignore_index"])
    if labels.dtype.kind not in "fb" and kind.probabilities and labels.size and (
            labels.min() < 0 or labels.max() > 1):
        raise OnnxMPError(f"{where} for {loss} must lie in [0, 1]")
    if known and (labels.ndim != len(known) or any(k is not None and k != n for k, n in
                                                   zip(known[1:], labels.shape[1:]))):
        raise OnnxMPError(f"{where} have shape {list(labels.shape)} but the {loss} loss compares them with the "
                          f"model output, shape {_dims(known)}", "give targets the output's shape")
    return labels.astype(np.float32, copy=False)


def _class_ids(loss: str, labels: np.ndarray, known: list[int | None], where: str, ignore: int) -> np.ndarray:
    if labels.dtype.kind == "f":
        if not np.all(np.isfinite(labels)) or np.any(labels != np.round(labels)):
            raise OnnxMPError(f"{where} hold non-integer values (e.g. {_first_bad(labels)}); "
                              f"{loss} needs class ids", "pass integer class ids, not probabilities")
    elif labels.dtype.kind == "b":
        raise OnnxMPError(f"{where} are booleans; {loss} needs integer class ids",
                          "use the bce_with_logits loss for binary targets, or labels.astype(int)")
    if known:
        positions = known[:-1]
        if labels.ndim != len(positions):
            per = "row" if len(known) == 2 else "position"
            raise OnnxMPError(f"{where} have shape {list(labels.shape)} but the {loss} loss needs one class id per "
                              f"{per} of the logits (shape {_dims(positions)} for logits {_dims(known)}, "
                              "the classes on the last axis)",
                              "pass class ids, not one-hot rows" if labels.ndim == len(known) else None)
        wrong = [i for i, (k, n) in enumerate(zip(positions, labels.shape)) if i and k is not None and k != n]
        if wrong:
            # torch's layout puts the classes on axis 1 ([N, C, d1...] with [N, d1...] labels); a model whose
            # head does that would be computed over the wrong axis: refuse rather than guess.
            torch_layout = len(known) >= 3 and list(labels.shape[1:]) == [k for k in known[2:]]
            raise OnnxMPError(f"{where} have shape {list(labels.shape)} but the {loss} loss needs "
                              f"{_dims(positions)} for logits {_dims(known)} (the classes on the last axis)",
                              "the model puts the classes on axis 1 (torch's layout): transpose its output so "
                              "the classes come last" if torch_layout else
                              "give one class id per position of the logits")
    classes = known[-1] if known else None
    if labels.size:
        valid = labels[labels != ignore] if ignore is not None else labels
        if valid.size:
            low, high = valid.min(), valid.max()
            if low < 0 or (classes is not None and high >= classes):
                bad = low if low < 0 else high
                raise OnnxMPError(f"{where} hold class id {int(bad)}, outside [0, {classes if classes else 'C'})"
                                  + (f" for logits with {classes} classes" if classes else "")
                                  + f" and not the ignore index {ignore}",
                                  "class ids must index the logits' last dimension; "
                                  f"mark positions without a label with {ignore}")
    return labels.astype(np.int64, copy=False)


def label_run_error(text: str, inputs: Sequence[str] = ()) -> OnnxMPError | None:
    """onnxruntime's error from a table loss's label check, as the batch's fault; None for any other.

    The class-id losses check in the graph that the labels' shape is the logits' shape without
    the class axis (the ``labels_like_logits`` nodes), so labels with other positions than the
    output (dims the build could not know) fail there, at the first step.
    """
    match = re.search(r"onnxmp/loss/(\w+)/labels_like_logits", text)
    if match is None:
        return None
    return OnnxMPError(f"the labels do not have the logits' positions: the {match.group(1)} loss needs one "
                       "class id per position, the shape of the model's output without its last (class) axis",
                       "check the labels' sequence length against the inputs'"
                       + (f" (a batch is {', '.join(inputs)})" if inputs else ""))


def _dims(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("N" if i == 0 and d is None else "?" if d is None else str(d)
                           for i, d in enumerate(shape)) + "]"


def _first_bad(labels: np.ndarray):
    flat = labels.ravel()
    bad = flat[~np.isfinite(flat) | (flat != np.round(flat))]
    return bad[0] if bad.size else None
