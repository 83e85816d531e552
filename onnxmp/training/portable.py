"""The portable form of the training artifacts: what plain ``onnxruntime.InferenceSession`` runs.

The write stage calls the lowering of the training and eval graphs to standard ops
(``onnxmp.training.lower.lower_model``) and the per-parameter optimizer graph
(``onnxmp.training.optimizer.build_portable_optimizer``), and describes the result in the
manifest: ``manifest["portable"]`` names the files and, per graph, the state pairs (input
name -> the output holding its next value) that the portable engine feeds back between runs.

Graph contract (docs/training.md): the portable training graph has the native one's inputs;
its outputs are ``loss_scaled``, ``loss``, ``all_finite``, then per trainable ``P`` the new
accumulation buffer ``P_grad.accumulation.out``.  The optimizer graph takes
``learning_rate``, ``step``, then per ``P``: ``P``, ``P.grad``, ``P.<slot>``...; it returns
``P.out``, ``P.<slot>.out``...
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import onnx

from onnxmp.errors import OnnxMPError
from onnxmp.training.artifacts import PORTABLE_FILES

log = logging.getLogger("onnxmp.training")

# MERGE(issue 28): helper B's lowering and helper C1's optimizer graph live on other branches.
# Until both are merged, a build writes no portable form (and says so); tests install their own
# scaffolding here.  When they land, these guards go and the imports become plain.
try:
    from onnxmp.training.lower import lower_model
except ImportError:
    lower_model: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None
try:
    from onnxmp.training.optimizer import build_portable_optimizer
except ImportError:
    build_portable_optimizer: Callable[..., onnx.ModelProto] | None = None

ACCUMULATION_BUFFER = "{}_grad.accumulation.buffer"
ACCUMULATION_OUT = "{}_grad.accumulation.out"


def available() -> bool:
    return lower_model is not None and build_portable_optimizer is not None


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


def optimizer_graph(optimizer: Any, parameters: Sequence[tuple[str, Sequence[int]]], opset: int,
                    clip_global_norm: float | None = None) -> onnx.ModelProto:
    """The per-parameter optimizer graph; ``clip_global_norm`` is a constant in it (the Trainer
    rebuilds the graph when it is given one)."""
    if build_portable_optimizer is None:
        raise OnnxMPError("this onnxmp has no portable optimizer graph builder",
                          "train with engine='native' (Python 3.11 with the training build)")
    kwargs = {} if clip_global_norm is None else {"clip_global_norm": float(clip_global_norm)}
    return build_portable_optimizer(optimizer, list(parameters), opset, **kwargs)


def portable_form(training: onnx.ModelProto, evaluation: onnx.ModelProto, optimizer: str,
                  parameters: Sequence[tuple[str, Sequence[int]]], requires_grad: Sequence[str],
                  opset: int) -> tuple[dict[str, onnx.ModelProto], dict[str, Any]] | None:
    """The three portable models by kind, and the manifest's ``portable`` entry; ``None`` (and
    a warning) when this onnxmp lacks the lowering or the optimizer graph builder."""
    if not available():
        log.warning("this onnxmp cannot lower training graphs yet: the artifacts have no portable form and "
                    "train with the native engine only")
        return None
    trainable = [(name, shape) for name, shape in parameters if name in set(requires_grad)]
    order = {name: i for i, name in enumerate(requires_grad)}
    trainable.sort(key=lambda item: order[item[0]])
    models = {
        "training_model": lower_model(training),
        "eval_model": lower_model(evaluation),
        "optimizer_model": optimizer_graph(optimizer, trainable, opset),
    }
    slots = optimizer_slots(models["optimizer_model"], requires_grad)
    entry = {"files": dict(PORTABLE_FILES), "state_pairs": state_pairs(requires_grad, slots), "slots": slots}
    return models, entry
