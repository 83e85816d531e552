"""The contract between the training build and its runs: every name both sides read.

The build (:mod:`onnxmp.training.build`) writes graphs and a manifest with these names; the
runs (:mod:`onnxmp.training.run`) read them back.  Neither side spells one of them itself.

* **manifest schema**: :data:`FORMAT` (the version), the files of a folder (:data:`FILES`,
  :data:`PORTABLE_FILES`), and :func:`manifest`, which builds the manifest from the built graphs.
* **training graph**: the inputs ``loss_scale`` (the scalar the loss is multiplied by before
  backpropagation) and ``grad_weight`` (1/k for k accumulated micro-batches), ORT's
  ``lazy_reset_grad``, per trainable ``P`` its gradient ``P_grad`` (:func:`gradient_output`), the accumulation buffer ``P_grad.accumulation.buffer``
  (its next value: ``P_grad.accumulation.out``); the outputs ``loss_scaled``, ``loss``,
  ``all_finite``, then the buffers' next values.  A gradient checked against its parameter's shape
  runs in a node named ``GRAD_SHAPE + P``, which a run's error message names.
* **optimizer graph** (torch's update, :mod:`onnxmp.training.update_graph`): inputs
  ``learning_rate``, ``step``, then per ``P``: ``P``, ``P.grad``, ``P.<slot>``...; outputs
  ``P.out``, ``P.<slot>.out``.  A run asks for a graph with another clip norm by rebuilding it from
  the manifest's ``optimizer`` entry (:func:`onnxmp.training.update_graph.build_portable_optimizer`,
  which the build uses too: neither build nor run).
* **state pairs** (:func:`state_pairs`): per portable graph, an input -> the output holding its
  next value, which the engines feed back between runs.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import onnx
from onnx import helper

# --- manifest schema ----------------------------------------------------------------------

MANIFEST = "manifest.json"
FORMAT = "onnxmp-training/2"
OLD_FORMATS = ("onnxmp-training/1",)
FILES = {
    "training_model": "training_model.onnx",
    "eval_model": "eval_model.onnx",
    "optimizer_model": "optimizer_model.onnx",
    "forward_model": "forward_model.onnx",
    "checkpoint": "checkpoint",
    "parameters": "parameters.npz",
}
NATIVE_FILES = ("training_model", "eval_model", "optimizer_model", "checkpoint")  # onnxruntime-training's
PORTABLE_FILES = {
    "training_model": "training_model.portable.onnx",
    "eval_model": "eval_model.portable.onnx",
    "optimizer_model": "optimizer_model.portable.onnx",
}

# --- training graph -----------------------------------------------------------------------

LOSS_SCALE = "loss_scale"
GRAD_WEIGHT = "grad_weight"
LOSS = "loss"
LOSS_SCALED = "loss_scaled"
ALL_FINITE = "all_finite"
LAZY_RESET_GRAD = "lazy_reset_grad"  # ORT's: true on the first micro-batch after a reset
RESERVED = (LOSS_SCALE, GRAD_WEIGHT, LOSS, LOSS_SCALED, ALL_FINITE)
# Both builders name each parameter's gradient <param>_grad (ORT's name), and ORT its accumulation
# buffer <param>_grad.accumulation.buffer.
GRAD_SUFFIX = "_grad"
BUFFER_SUFFIX = GRAD_SUFFIX + ".accumulation.buffer"
BUFFER_OUT_SUFFIX = GRAD_SUFFIX + ".accumulation.out"
# Prefix of the node that checks a gradient has its parameter's shape.
GRAD_SHAPE = "onnxmp/gradient_shape_of/"

IGNORE_INDEX = -100  # the label cross entropy ignores: torch's and Hugging Face's


def gradient_output(parameter: str) -> str:
    """The gradient graph's output holding ``parameter``'s gradient (before accumulation)."""
    return parameter + GRAD_SUFFIX


def gradient_parameter(name: str) -> str | None:
    """The parameter whose gradient ``name`` is (None: not a gradient's name)."""
    return name[:-len(GRAD_SUFFIX)] if name.endswith(GRAD_SUFFIX) else None


def accumulation_buffer(parameter: str) -> str:
    return parameter + BUFFER_SUFFIX


def accumulation_out(parameter: str) -> str:
    return parameter + BUFFER_OUT_SUFFIX


def is_accumulation_buffer(name: str) -> bool:
    return name.endswith(BUFFER_SUFFIX)


def is_accumulation_out(name: str) -> bool:
    return name.endswith(BUFFER_OUT_SUFFIX)


def buffer_parameter(buffer: str) -> str | None:
    """The parameter whose accumulation buffer ``buffer`` is (None: not a buffer)."""
    return buffer[:-len(BUFFER_SUFFIX)] if is_accumulation_buffer(buffer) else None


# --- optimizer graph ----------------------------------------------------------------------

LEARNING_RATE, STEP = "learning_rate", "step"
GRAD, OUT = ".grad", ".out"


def grad_input(parameter: str) -> str:
    return parameter + GRAD


def slot_input(parameter: str, slot: str) -> str:
    return f"{parameter}.{slot}"


def next_value(name: str) -> str:
    """The optimizer graph's output holding the next value of its input ``name``."""
    return name + OUT


def updated(output: str) -> str | None:
    """The input whose next value ``output`` is (None: not an output of the contract)."""
    return output[:-len(OUT)] if output.endswith(OUT) else None


def optimizer_slots(input_names: Iterable[str], requires_grad: Sequence[str]) -> list[str]:
    """The state slots of an optimizer graph, read from its inputs (``P.<slot>``)."""
    first = requires_grad[0]
    return [name[len(first) + 1:] for name in input_names
            if name.startswith(f"{first}.") and name != grad_input(first)]


def state_pairs(requires_grad: Sequence[str], slots: Sequence[str]) -> dict[str, dict[str, str]]:
    return {
        "training_model": {accumulation_buffer(p): accumulation_out(p) for p in requires_grad},
        "optimizer_model": {name: next_value(name) for p in requires_grad
                            for name in (p, *(slot_input(p, slot) for slot in slots))},
    }


def portable_entry(optimizer: onnx.ModelProto, requires_grad: Sequence[str]) -> dict[str, Any]:
    """The manifest's ``portable`` entry: the files and, per graph, the state pairs."""
    slots = optimizer_slots([i.name for i in optimizer.graph.input], requires_grad)
    return {"files": dict(PORTABLE_FILES), "state_pairs": state_pairs(requires_grad, slots), "slots": slots}


# --- the manifest -------------------------------------------------------------------------


def user_inputs(training: onnx.ModelProto, parameters: Iterable[str]) -> list[tuple[str, str]]:
    """The training graph's inputs a batch feeds, with their numpy dtypes."""
    skip = {*parameters, LOSS_SCALE, GRAD_WEIGHT, LAZY_RESET_GRAD}
    result = []
    for value in training.graph.input:
        if value.name in skip or is_accumulation_buffer(value.name):
            continue
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        result.append((value.name, str(dtype)))
    return result


def manifest(*, training: onnx.ModelProto, evaluation: onnx.ModelProto, forward: onnx.ModelProto,
             portable_optimizer: onnx.ModelProto | None, requires_grad: Sequence[str], frozen: Sequence[str],
             label_input: str, loss: str, loss_options: Mapping[str, Any], optimizer: dict, precision: str,
             target: str, opset: int, output_shape: list, prepared_for_gradient: list,
             versions: Mapping[str, str], builder: str, native: bool) -> dict[str, Any]:
    """The manifest of a built folder (``versions``: ``onnxmp_version`` and ``onnxruntime_version``;
    ``builder``: who differentiated; ``native``: whether the native engine's files are written)."""
    inputs = user_inputs(training, [*requires_grad, *frozen])
    entry = {
        "format": FORMAT,
        **versions,
        "builder": builder,
        "precision": precision,
        "target": target,
        "loss": loss,
        "optimizer": dict(optimizer),
        "opset": opset,
        "inputs": [name for name, _ in inputs],
        "input_dtypes": dict(inputs),
        "model_inputs": [name for name, _ in inputs if name != label_input],
        "label_input": label_input,
        "loss_options": dict(loss_options),
        "forward_outputs": [v.name for v in forward.graph.output],
        "output_shape": output_shape,
        "training_outputs": [v.name for v in training.graph.output if not is_accumulation_out(v.name)],
        "eval_outputs": [v.name for v in evaluation.graph.output],
        "loss_scale_input": LOSS_SCALE,
        "grad_weight_input": GRAD_WEIGHT,
        "requires_grad": list(requires_grad),
        "frozen": list(frozen),
        "prepared_for_gradient": prepared_for_gradient,
        "files": {kind: name for kind, name in FILES.items() if native or kind not in NATIVE_FILES},
    }
    if portable_optimizer is not None:
        entry["portable"] = portable_entry(portable_optimizer, requires_grad)
        entry["optimizer"]["slots"] = entry["portable"]["slots"]
    return entry
