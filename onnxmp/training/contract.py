"""The portable form of the training artifacts: what plain ``onnxruntime.InferenceSession`` runs.

The build's ``lower`` stage lowers the training and eval graphs to standard ops
(:func:`onnxmp.training.build.lower.lower_model`) and its ``optimizer`` stage writes torch's update as
a graph (:func:`onnxmp.training.update_graph.build_portable_optimizer`); the write stage calls
:func:`portable_form` to describe them in the manifest: ``manifest["portable"]`` names the
files and, per graph, the state pairs (input name -> the output holding its next value) that
the engines feed back between runs.

Graph contract (docs/training.md): the portable training graph has the native one's inputs;
its outputs are ``loss_scaled``, ``loss``, ``all_finite``, then per trainable ``P`` the new
accumulation buffer ``P_grad.accumulation.out``.  The optimizer graph takes
``learning_rate``, ``step``, then per ``P``: ``P``, ``P.grad``, ``P.<slot>``...; it returns
``P.out``, ``P.<slot>.out``...
"""
from __future__ import annotations

from typing import Any, Sequence

import onnx

from onnxmp.training.artifacts import PORTABLE_FILES

ACCUMULATION_BUFFER = "{}_grad.accumulation.buffer"
ACCUMULATION_OUT = "{}_grad.accumulation.out"


def optimizer_slots(model: onnx.ModelProto, requires_grad: Sequence[str]) -> list[str]:
    """The state slots of a portable optimizer graph, read from its inputs (``P.<slot>``)."""
    first = requires_grad[0]
    inputs = [i.name for i in model.graph.input]
    return [name[len(first) + 1:] for name in inputs
            if name.startswith(f"{first}.") and name != f"{first}.grad"]


def state_pairs(requires_grad: Sequence[str], slots: Sequence[str]) -> dict[str, dict[str, str]]:
    return {
        "training_model": {ACCUMULATION_BUFFER.format(p): ACCUMULATION_OUT.format(p) for p in requires_grad},
        "optimizer_model": {name: f"{name}.out" for p in requires_grad
                            for name in (p, *(f"{p}.{slot}" for slot in slots))},
    }


def portable_form(training: onnx.ModelProto, evaluation: onnx.ModelProto, optimizer: onnx.ModelProto,
                  requires_grad: Sequence[str]) -> tuple[dict[str, onnx.ModelProto], dict[str, Any]]:
    """The three portable models (already lowered / built) by kind, and the manifest's
    ``portable`` entry."""
    models = {"training_model": training, "eval_model": evaluation, "optimizer_model": optimizer}
    slots = optimizer_slots(optimizer, requires_grad)
    entry = {"files": dict(PORTABLE_FILES), "state_pairs": state_pairs(requires_grad, slots), "slots": slots}
    return models, entry
