"""The losses a training graph can end in: one table.

Each entry says which onnxruntime ``onnxblock.loss`` block computes it, what its label input
is called by default, what kind of labels it reads (:mod:`onnxmp.training.labels` checks them),
and which metrics ``onnxmp train`` reports for it.  Adding a loss is one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass

from onnxmp.errors import OnnxMPError


@dataclass(frozen=True)
class Loss:
    name: str                  # the API and CLI spelling: loss="cross_entropy", --loss cross_entropy
    block: str                 # the onnxruntime.training.onnxblock.loss class
    label: str                 # onnxblock's default name for the label input
    classes: bool              # labels are class ids (else float targets shaped like the output)
    probabilities: bool = False  # float targets must lie in [0, 1]
    metrics: tuple[str, ...] = ()  # what `onnxmp train` reports on the eval data


LOSSES: dict[str, Loss] = {loss.name: loss for loss in (
    Loss("cross_entropy", "CrossEntropyLoss", "labels", classes=True, metrics=("accuracy",)),
    Loss("mse", "MSELoss", "target", classes=False),
    Loss("bce_with_logits", "BCEWithLogitsLoss", "target", classes=False, probabilities=True,
         metrics=("binary_accuracy",)),
    Loss("l1", "L1Loss", "target", classes=False),
)}


def loss(name: str) -> Loss:
    """The loss called ``name``; a clear error for anything else."""
    try:
        return LOSSES[name]
    except KeyError:
        raise OnnxMPError(f"unknown loss {name!r}", f"use one of: {', '.join(LOSSES)}") from None
