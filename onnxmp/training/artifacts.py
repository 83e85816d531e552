"""Build the files onnxruntime training runs: training, eval and optimizer models, checkpoint.

The training graph follows the contract in ``spec/training.md``:

* the forward model is the user's model converted for training (trainable
  parameters stay float32 master weights, Cast at each low-precision use);
  on ``target="cpu"`` it is the emulated form, since the ORT CPU EP has no
  float16 compute kernels;
* the loss is multiplied by a scalar float input ``loss_scale`` and ORT's
  gradient builder differentiates that scaled loss; the unscaled ``loss`` is
  an output too;
* every gradient is multiplied by ``grad_weight / loss_scale`` (computed once)
  before its ``InPlaceAccumulatorV2``, so the accumulation buffers hold true
  gradients; the trainer feeds ``grad_weight = 1/k`` to make ``k`` accumulated
  micro-batches the mean gradient of the effective batch;
* ``all_finite`` (bool scalar) says whether every such gradient is finite,
  built from standard ONNX ops so it runs on the CPU (ORT has no CPU
  ``IsAllFinite``).
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import onnx
import onnx.version_converter
from onnx import TensorProto, helper, numpy_helper

from onnxmp.errors import OnnxMPError, first_line
from onnxmp.files import destination
from onnxmp.naming import FreshNames, proto_names
from onnxmp.precision import FLOAT32
from onnxmp.precision import PRECISIONS as LOW_PRECISIONS
from onnxmp.training import _ort
from onnxmp.training.labels import output_shape
from onnxmp.training.prepare import (describe, deterministic_gather_grads, float32_cpu_grad_kernels,
                                     prepare_for_gradient, promote_constants, unprove_symbolic_dims)

log = logging.getLogger("onnxmp.training.artifacts")

PRECISIONS = (*LOW_PRECISIONS, FLOAT32.name)  # float32: train without mixed precision
TARGETS = ("cpu", "cuda")
OPTIMIZERS = ("adamw", "sgd")
# loss name -> (onnxblock.loss class, onnxblock's default name for the label input)
LOSSES = {
    "cross_entropy": ("CrossEntropyLoss", "labels"),
    "mse": ("MSELoss", "target"),
    "bce_with_logits": ("BCEWithLogitsLoss", "target"),
    "l1": ("L1Loss", "target"),
}

LOSS_SCALE = "loss_scale"
GRAD_WEIGHT = "grad_weight"
LOSS = "loss"
LOSS_SCALED = "loss_scaled"
ALL_FINITE = "all_finite"
# ORT names each parameter's accumulation buffer <param>_grad.accumulation.buffer.
ACCUMULATION_BUFFER = "_grad.accumulation.buffer"
# Prefix of the node that checks a gradient has its parameter's shape.
GRAD_SHAPE = "onnxmp/gradient_shape_of/"
_RESERVED = (LOSS_SCALE, GRAD_WEIGHT, LOSS, LOSS_SCALED, ALL_FINITE)

# onnxruntime-training 1.19.2, the last training build, loads nothing newer.
MAX_IR_VERSION = 10
MAX_OPSET = 21

MANIFEST = "manifest.json"
FORMAT = "onnxmp-training/1"
FILES = {
    "training_model": "training_model.onnx",
    "eval_model": "eval_model.onnx",
    "optimizer_model": "optimizer_model.onnx",
    "forward_model": "forward_model.onnx",
    "checkpoint": "checkpoint",
}


@dataclass(frozen=True)
class Artifacts:
    """An artifacts folder and its manifest."""

    directory: Path
    manifest: dict[str, Any]

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Artifacts":
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.is_file():
            raise OnnxMPError(f"{directory} is not an onnxmp training folder (no {MANIFEST})",
                              "build one with onnxmp.training.build_artifacts or `onnxmp train`")
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise OnnxMPError(f"cannot read {path}: {exc}", "rebuild the artifacts") from None
        if manifest.get("format") != FORMAT:
            raise OnnxMPError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}",
                              "rebuild the artifacts with this onnxmp version")
        missing = [name for name in manifest["files"].values() if not (directory / name).exists()]
        if missing:
            raise OnnxMPError(f"{directory} lacks {', '.join(missing)}", "rebuild the artifacts")
        return cls(directory, manifest)

    def path(self, kind: str) -> Path:
        """Path of one file: ``training_model``, ``eval_model``, ``optimizer_model``,
        ``forward_model`` or ``checkpoint``."""
        return self.directory / self.manifest["files"][kind]

    @property
    def training_model(self) -> Path:
        return self.path("training_model")

    @property
    def eval_model(self) -> Path:
        return self.path("eval_model")

    @property
    def optimizer_model(self) -> Path:
        return self.path("optimizer_model")

    @property
    def checkpoint(self) -> Path:
        return self.path("checkpoint")

    @property
    def precision(self) -> str:
        return self.manifest["precision"]

    @property
    def target(self) -> str:
        return self.manifest["target"]

    @property
    def inputs(self) -> list[str]:
        """What a batch holds, in order: the model inputs, then the label input."""
        return list(self.manifest["inputs"])


def build_artifacts(
    model: onnx.ModelProto | str | os.PathLike,
    *,
    requires_grad: Iterable[str],
    frozen: Iterable[str] = (),
    loss: str | Any = "cross_entropy",
    optimizer: str = "adamw",
    precision: str = "float16",
    target: str = "cpu",
    out_dir: str | os.PathLike,
    label_name: str | None = None,
) -> Artifacts:
    """Build mixed-precision training artifacts for ``model`` in ``out_dir``.

    ``loss`` is one of :data:`LOSSES` or an ``onnxblock.Block``, which is
    called as ``block(output_name, label_name)`` and must return the name of a
    float32 scalar.  The loss reads the model's first output; ``label_name``
    (default: ``labels`` for cross entropy, ``target`` otherwise) names the new
    label input.  ``precision="float32"`` builds the fp32 baseline (no
    conversion).  Models over 2 GB are refused before any work (see :func:`check_trainable_size`).
    """
    from onnxmp.load import load

    _check_choice("precision", precision, PRECISIONS)
    _check_choice("target", target, TARGETS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    # A lone string is one name, not a sequence of one-letter names.
    requires_grad = list(dict.fromkeys([requires_grad] if isinstance(requires_grad, str) else requires_grad))
    frozen = list(dict.fromkeys([frozen] if isinstance(frozen, str) else frozen))
    if not requires_grad:
        raise OnnxMPError("requires_grad is empty", "name the initializers to train")
    both = sorted(set(requires_grad) & set(frozen))
    if both:
        raise OnnxMPError(f"parameters both trainable and frozen: {', '.join(both)}")

    check_trainable_size(model)
    forward = _supported_versions(load(model))
    trainable_forward, _ = promote_constants(forward, [*requires_grad, *frozen])
    _check_parameters(trainable_forward, requires_grad, frozen)
    loss_block, loss_name, label_name = _loss_block(loss, label_name)
    used = proto_names(forward.graph)
    clashes = sorted(used & {*_RESERVED, label_name})
    if clashes:
        raise OnnxMPError(f"the model already uses the name(s) {', '.join(clashes)}",
                          "rename them, or pass another label_name")

    prepared, preparations = prepare_for_gradient(trainable_forward, requires_grad)
    train_forward = _training_forward(prepared, precision, target, [*requires_grad, *frozen])
    training, evaluation, parameters = _gradient_graph(train_forward, loss_block, label_name,
                                                       requires_grad, frozen)
    add_loss_scaling(training)
    if target == "cpu":
        float32_cpu_grad_kernels(training)
        deterministic_gather_grads(training)
    _make_eval_outputs(evaluation, train_forward)
    opset = _default_opset(forward)
    optimizer_model = build_optimizer_model(optimizer, opset=opset)
    for proto in (training, evaluation):
        _cap_ir_version(proto)

    inputs = _user_inputs(training, {*requires_grad, *frozen})
    manifest = {
        "format": FORMAT,
        "onnxmp_version": _onnxmp_version(),
        "onnxruntime_version": _ort_version(),
        "precision": precision,
        "target": target,
        "loss": loss_name,
        "optimizer": optimizer,
        "opset": opset,
        "inputs": [name for name, _ in inputs],
        "input_dtypes": dict(inputs),
        "model_inputs": [name for name, _ in inputs if name != label_name],
        "label_input": label_name,
        "forward_outputs": [v.name for v in forward.graph.output],
        "output_shape": output_shape(forward),
        "training_outputs": [v.name for v in training.graph.output if not v.name.endswith(".accumulation.out")],
        "eval_outputs": [v.name for v in evaluation.graph.output],
        "loss_scale_input": LOSS_SCALE,
        "grad_weight_input": GRAD_WEIGHT,
        "requires_grad": requires_grad,
        "frozen": frozen,
        "prepared_for_gradient": describe(preparations),
        "files": dict(FILES),
    }
    out = Path(out_dir)
    write_artifacts(out, manifest, training=training, evaluation=evaluation,
                    optimizer_model=optimizer_model, forward=forward, parameters=parameters)
    log.info("training artifacts (%s, %s) written to %s", precision, target, destination(out))
    return Artifacts(out, manifest)


def check_trainable_size(model: onnx.ModelProto | str | os.PathLike) -> None:
    """Refuse a model whose weights and graph exceed protobuf's 2 GB limit, before reading any weight.

    onnxruntime-training 1.19.2 cannot differentiate it: onnxblock hands the forward model, weights
    included, to the C++ gradient builder as ONE serialized ModelProto
    (``onnxblock/_training_graph_utils.py``: ``GradientGraphBuilder(model.SerializeToString(), ...)``),
    and the training model it returns holds every weight again.  No external-data path exists there.
    """
    from onnxmp.external import PROTOBUF_LIMIT, data_bytes
    from onnxmp.load import load

    size = data_bytes(model if isinstance(model, onnx.ModelProto) else load(model, lazy_external=True))
    if size > PROTOBUF_LIMIT:
        raise OnnxMPError(
            f"the model is {size / 1e9:.2f} GB; onnxruntime-training {_ort_version()} cannot build training "
            f"artifacts over 2 GB (its gradient builder takes the whole model, weights included, as one "
            f"serialized protobuf, which is limited to 2 GB)",
            "train a model under 2 GB; convert, emulate and validate handle this one")


def write_artifacts(out: Path, manifest: dict, *, training, evaluation, optimizer_model, forward,
                    parameters) -> None:
    """Write every file into a temporary folder beside ``out``, renamed into place once complete:
    a folder with a manifest is always whole, and a failure leaves nothing behind."""
    from onnxmp.files import atomic_directory, guard_outputs, write_text_atomic
    from onnxmp.save import save

    check_replaceable(out)
    guard_outputs({"out_dir": out}, folders=["out_dir"])
    files = manifest["files"]
    with atomic_directory(out) as folder:
        save(training, folder / files["training_model"])
        save(evaluation, folder / files["eval_model"])
        save(optimizer_model, folder / files["optimizer_model"])
        save(forward, folder / files["forward_model"])
        _ort.onnxblock().save_checkpoint(parameters, str(folder / files["checkpoint"]))
        write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def check_replaceable(folder: Path, *, marker: str = MANIFEST, what: str = "training folder") -> None:
    """A folder written whole may only replace nothing, an empty folder or one onnxmp wrote
    (``marker`` inside): never a folder of the user's other files."""
    folder = Path(folder)
    if folder.is_dir() and any(folder.iterdir()) and not (folder / marker).exists():
        raise OnnxMPError(f"{folder} exists and is not an onnxmp {what}; writing it would replace the folder",
                          "choose a new or empty folder")


# --- graph building ------------------------------------------------------------------


def _gradient_graph(forward: onnx.ModelProto, loss_block, label_name: str, requires_grad, frozen):
    ob = _ort.onnxblock()

    class LossScaledTraining(ob.TrainingBlock):
        def build(self, *outputs):
            loss = loss_block(outputs[0], label_name)
            graph = self.base.graph
            graph.input.append(helper.make_tensor_value_info(LOSS_SCALE, TensorProto.FLOAT, []))
            graph.node.append(helper.make_node("Identity", [loss], [LOSS], name="onnxmp/loss"))
            graph.node.append(helper.make_node("Mul", [LOSS, LOSS_SCALE], [LOSS_SCALED], name="onnxmp/loss_scale"))
            # The first output is where backpropagation starts: the scaled loss.
            return LOSS_SCALED, LOSS

        def infer_shapes_on_base(self):
            # onnxblock's shape inference is what ORT's gradient builder reads shapes from.
            model = super().infer_shapes_on_base()
            unprove_symbolic_dims(model.graph)
            return model

    block = LossScaledTraining()
    for name in requires_grad:
        block.requires_grad(name)
    for name in frozen:
        block.requires_grad(name, False)
    try:
        with _ort.native_stderr_to_log(log), ob.base(forward):
            block(*[v.name for v in forward.graph.output])
            training, evaluation = block.to_model_proto()
            parameters = block.parameters()
    except OnnxMPError:
        raise
    except Exception as exc:  # ORT and onnx raise assorted types; the message is what matters
        raise _gradient_error(exc) from None
    return training, evaluation, parameters


def _gradient_error(exc: BaseException) -> OnnxMPError:
    """ORT's gradient-builder failures, in words that point at the cause."""
    text = str(exc).strip()
    missing = re.search(r"The gradient builder has not been registered: (\S+) for node ?(\S*)", text)
    if missing:
        op, node = missing.groups()
        return OnnxMPError(f"onnxruntime-training 1.19 has no gradient for {op} (node {node!r})",
                           f"freeze the parameters that feed it, or re-export the model with {op} "
                           "written in differentiable ops")
    if "OutputDefs().size()" in text:
        return OnnxMPError("onnxruntime's gradient builder needs an optional output that a node of the model "
                           "does not produce", "please report this model to onnxmp: its preparation pass "
                           "should have added the output")
    no_grad = re.search(r"failed to find NodeArg by name: (\S+)_grad\b", text)
    if no_grad:
        return OnnxMPError(f"onnxruntime computed no gradient for trainable parameter {no_grad.group(1)!r}: the "
                           "loss reads it only through inputs onnxruntime does not differentiate",
                           "leave it out of requires_grad (or pass it as frozen)")
    if "unordered_map::at" in text:
        return OnnxMPError("onnxruntime's gradient builder missed an attribute of a node between the parameters "
                           "and the loss (an exporter left out an optional attribute)",
                           "please report this model to onnxmp; run with -v -v to see onnxruntime's log")
    if "couldn't find the consumer node" in text:
        return OnnxMPError("a trainable parameter does not reach the loss through differentiable ops",
                           "leave parameters the loss does not use out of requires_grad")
    reason = _ort.error_reason(text) or type(exc).__name__
    return OnnxMPError(f"onnxruntime could not build the gradient graph: {reason}",
                       "run with -v -v to see onnxruntime's log")


def add_loss_scaling(training: onnx.ModelProto) -> None:
    """Unscale each gradient before its accumulator (checking it has the parameter's shape)
    and add the ``all_finite`` output.

    The accumulators move to the end of the node list: they now read the
    unscaled gradients, which are computed after every gradient exists.
    """
    graph = training.graph
    names = FreshNames(proto_names(graph))
    accumulators = [n for n in graph.node if n.op_type == "InPlaceAccumulatorV2"]
    if not accumulators:
        raise OnnxMPError("the training graph has no gradient accumulators",
                          "requires_grad must name parameters the loss depends on")
    rest = [n for n in graph.node if n.op_type != "InPlaceAccumulatorV2"]
    graph.input.append(helper.make_tensor_value_info(GRAD_WEIGHT, TensorProto.FLOAT, []))

    inverse, unscale = names("onnxmp/inv_loss_scale"), names("onnxmp/grad_unscale")
    added = [
        helper.make_node("Reciprocal", [LOSS_SCALE], [inverse], name=names("onnxmp/Reciprocal")),
        helper.make_node("Mul", [inverse, GRAD_WEIGHT], [unscale], name=names("onnxmp/Mul_grad_weight")),
    ]
    sums = []
    for acc in accumulators:
        grad, buffer = acc.input[1], acc.input[0]
        scaled = names(f"{grad}.unscaled_any_shape")
        added.append(helper.make_node("Mul", [grad, unscale], [scaled], name=names(f"onnxmp/unscale/{grad}")))
        # InPlaceAccumulatorV2 does not check shapes: a gradient ORT did not sum back over a
        # broadcast would be written past the end of the buffer (heap corruption).  The Reshape
        # to the buffer's shape fails cleanly instead, in the node GRAD_SHAPE names.
        shape, unscaled = names(f"{grad}.shape"), names(f"{grad}.unscaled")
        param = buffer[:-len(ACCUMULATION_BUFFER)] if buffer.endswith(ACCUMULATION_BUFFER) else grad
        added += [helper.make_node("Shape", [buffer], [shape], name=names(f"onnxmp/Shape/{grad}")),
                  helper.make_node("Reshape", [scaled, shape], [unscaled], name=names(f"{GRAD_SHAPE}{param}"))]
        total = names(f"{grad}.unscaled.sum")
        added.append(helper.make_node("ReduceSum", [unscaled], [total], keepdims=0,
                                      name=names(f"onnxmp/ReduceSum/{grad}")))
        sums.append(total)
        acc.input[1] = unscaled
    # A sum of sums is non-finite iff some element is (or the sum overflows
    # float32, which also deserves a skipped step).
    grad_sum, is_inf, is_nan, bad = (names(f"onnxmp/{n}") for n in ("grad_sum", "is_inf", "is_nan", "non_finite"))
    added += [
        helper.make_node("Sum", sums, [grad_sum], name=names("onnxmp/Sum")),
        helper.make_node("IsInf", [grad_sum], [is_inf], name=names("onnxmp/IsInf")),
        helper.make_node("IsNaN", [grad_sum], [is_nan], name=names("onnxmp/IsNaN")),
        helper.make_node("Or", [is_inf, is_nan], [bad], name=names("onnxmp/Or")),
        helper.make_node("Not", [bad], [ALL_FINITE], name=names("onnxmp/Not")),
    ]
    graph.ClearField("node")
    graph.node.extend([*rest, *added, *accumulators])

    outputs = list(graph.output)
    n_user = next(i for i, v in enumerate(outputs) if v.name.endswith(".accumulation.out"))
    graph.ClearField("output")
    graph.output.extend([*outputs[:n_user], helper.make_tensor_value_info(ALL_FINITE, TensorProto.BOOL, []),
                         *outputs[n_user:]])


def _make_eval_outputs(evaluation: onnx.ModelProto, forward: onnx.ModelProto) -> None:
    """Eval model: no ``loss_scale`` input; outputs the unscaled loss and the model's outputs."""
    graph = evaluation.graph
    nodes = [n for n in graph.node if LOSS_SCALED not in n.output]
    inputs = [v for v in graph.input if v.name != LOSS_SCALE]
    graph.ClearField("node")
    graph.node.extend(nodes)
    graph.ClearField("input")
    graph.input.extend(inputs)
    graph.ClearField("output")
    graph.output.extend([helper.make_tensor_value_info(LOSS, TensorProto.FLOAT, []), *forward.graph.output])


def build_optimizer_model(kind: str, *, opset: int, clip_global_norm: float | None = None,
                          parameters: int | None = None) -> onnx.ModelProto:
    """The optimizer graph; with ``clip_global_norm`` the unscaled gradients are first
    scaled by ``min(1, c / (norm + 1e-6))``, ``norm`` their global L2 norm (as torch's
    ``clip_grad_norm_``).

    The norm is computed in the graph in a fixed order (one ReduceSumSquare per
    gradient, the squares summed sorted by value), not by ORT's CPU ``InplaceClipGradNorm``,
    whose threads add partial sums in whatever order they finish: identical runs
    would drift apart.  ``parameters`` (how many gradients the sequence holds) is
    required with clipping.
    """
    _check_choice("optimizer", kind, OPTIMIZERS)
    ob = _ort.onnxblock()
    block = ob.optim.AdamW() if kind == "adamw" else ob.optim.SGD()
    # onnxblock only reads the element type of the first trainable parameter.
    params = ([helper.make_tensor("parameter", TensorProto.FLOAT, [1], [0.0])], [])
    with _ort.native_stderr_to_log(log), ob.empty_base(opset_version=opset):
        block(params)
        model = block.to_model_proto()
    if clip_global_norm is not None:
        if not clip_global_norm > 0:
            raise OnnxMPError(f"clip_global_norm must be positive, got {clip_global_norm}")
        if not parameters:
            raise OnnxMPError("clipping needs the number of trainable parameters")
        _add_global_norm_clip(model, float(clip_global_norm), parameters)
    _cap_ir_version(model)
    return model


def _add_global_norm_clip(model: onnx.ModelProto, max_norm: float, count: int) -> None:
    graph = model.graph
    names = FreshNames(proto_names(graph))
    step = next(n for n in graph.node if n.op_type in ("AdamWOptimizer", "SGDOptimizerV2"))
    position = list(step.input).index("gradients")
    nodes, grads, sums = [], [], []

    def constant(value, dtype) -> str:
        out = names("onnxmp/clip/const")
        nodes.append(helper.make_node("Constant", [], [out], name=names("onnxmp/clip/Constant"),
                                      value=numpy_helper.from_array(np.array(value, dtype), out)))
        return out

    for i in range(count):
        grad, total = names(f"onnxmp/clip/grad_{i}"), names(f"onnxmp/clip/sumsq_{i}")
        nodes.append(helper.make_node("SequenceAt", ["gradients", constant(i, np.int64)], [grad],
                                      name=names(f"onnxmp/clip/SequenceAt_{i}")))
        squares = names(f"onnxmp/clip/sumsq_{i}_kept")
        nodes.append(helper.make_node("ReduceSumSquare", [grad], [squares], keepdims=1,
                                      name=names(f"onnxmp/clip/ReduceSumSquare_{i}")))
        nodes.append(helper.make_node("Reshape", [squares, constant([1], np.int64)], [total],
                                      name=names(f"onnxmp/clip/Reshape_{i}")))
        grads.append(grad)
        sums.append(total)
    # ORT does not document the order of the gradient sequence (it is not the manifest's);
    # summing the per-parameter squares sorted by value makes the sum independent of it.
    flat, ordered, order, sum_sq, norm, denominator, ratio, factor, clipped = (
        names(f"onnxmp/clip/{n}") for n in ("squares", "sorted", "order", "sum_sq", "norm", "denominator",
                                            "ratio", "factor", "gradients"))
    k, eps, c, one = (constant([count], np.int64), constant(1e-6, np.float32), constant(max_norm, np.float32),
                      constant(1.0, np.float32))
    nodes += [
        helper.make_node("Concat", sums, [flat], axis=0, name=names("onnxmp/clip/Concat")),
        helper.make_node("TopK", [flat, k], [ordered, order], axis=0, largest=1, sorted=1,
                         name=names("onnxmp/clip/TopK")),
        helper.make_node("ReduceSum", [ordered], [sum_sq], keepdims=0, name=names("onnxmp/clip/ReduceSum")),
        helper.make_node("Sqrt", [sum_sq], [norm], name=names("onnxmp/clip/Sqrt")),
        helper.make_node("Add", [norm, eps], [denominator], name=names("onnxmp/clip/Add")),
        helper.make_node("Div", [c, denominator], [ratio], name=names("onnxmp/clip/Div")),
        helper.make_node("Min", [ratio, one], [factor], name=names("onnxmp/clip/Min")),
    ]
    scaled = []
    for grad in grads:
        out = names(f"{grad}.clipped")
        nodes.append(helper.make_node("Mul", [grad, factor], [out], name=names("onnxmp/clip/Mul")))
        scaled.append(out)
    nodes.append(helper.make_node("SequenceConstruct", scaled, [clipped], name=names("onnxmp/clip/SequenceConstruct")))
    step.input[position] = clipped
    rest = list(graph.node)
    graph.ClearField("node")
    graph.node.extend([*nodes, *rest])


# --- conversion ----------------------------------------------------------------------


def _training_forward(forward: onnx.ModelProto, precision: str, target: str,
                      master: Sequence[str]) -> onnx.ModelProto:
    if precision == "float32":
        return forward
    import onnxmp

    convert = getattr(onnxmp, "convert", None)
    if convert is None:
        raise OnnxMPError(f"{precision} training needs onnxmp.convert, which this onnxmp build lacks",
                          "use precision='float32' or update onnxmp")
    # The CUDA coloring on both targets: CPU training emulates what the GPU would run.
    result = convert(forward, target="cuda", precision=precision, keep_io_types=True, master_weights=tuple(master))
    converted = result.model
    initializers = {t.name: t for t in converted.graph.initializer}
    lost = [n for n in master if n not in initializers or initializers[n].data_type != TensorProto.FLOAT]
    if lost:
        raise OnnxMPError(f"the conversion did not keep float32 master weights for {', '.join(lost)}",
                          "this is an onnxmp bug; please report it")
    if target == "cpu":
        from onnxmp.emulate import emulate

        converted = emulate(converted, precision=precision)
    log.info("forward model converted to %s (%s)", precision,
             "emulated in float32 for the CPU" if target == "cpu" else "CUDA")
    return converted


def _supported_versions(model: onnx.ModelProto) -> onnx.ModelProto:
    opset = _default_opset(model)
    if opset > MAX_OPSET:
        log.info("converting the model from opset %d to %d for onnxruntime-training 1.19", opset, MAX_OPSET)
        try:
            model = onnx.version_converter.convert_version(model, MAX_OPSET)
        except Exception as exc:
            raise OnnxMPError(f"the model uses opset {opset}; onnxruntime-training 1.19 loads at most {MAX_OPSET} "
                              f"and the conversion failed: {first_line(exc, 300)}",
                              f"export the model at opset <= {MAX_OPSET}") from None
    _cap_ir_version(model)
    return model


def _cap_ir_version(model: onnx.ModelProto) -> None:
    # onnx 1.23 stamps new models IR 14 and ORT 1.19 refuses anything over 10;
    # nothing onnxmp or onnxblock writes needs a newer IR feature.
    model.ir_version = min(model.ir_version or MAX_IR_VERSION, MAX_IR_VERSION)


def _default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise OnnxMPError("the model imports no default-domain opset", "re-export it with an opset")


# --- checks and small helpers --------------------------------------------------------


def _check_choice(what: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise OnnxMPError(f"unknown {what} {value!r}", f"use one of: {', '.join(choices)}")


def _check_parameters(model: onnx.ModelProto, requires_grad: list[str], frozen: list[str]) -> None:
    initializers = {t.name: t for t in model.graph.initializer}
    missing = [n for n in [*requires_grad, *frozen] if n not in initializers]
    if missing:
        raise OnnxMPError(f"not initializers of the model: {', '.join(missing[:10])}",
                          "requires_grad and frozen name initializers (weights) of the model")
    not_float = [n for n in requires_grad if initializers[n].data_type != TensorProto.FLOAT]
    if not_float:
        raise OnnxMPError(f"trainable parameters must be float32: {', '.join(not_float[:10])}",
                          "train the float32 model; onnxmp converts it for mixed precision itself")


def _loss_block(loss, label_name: str | None):
    ob = _ort.onnxblock()
    if isinstance(loss, str):
        _check_choice("loss", loss, tuple(LOSSES))
        cls_name, default_label = LOSSES[loss]
        return getattr(ob.loss, cls_name)(), loss, label_name or default_label
    if isinstance(loss, ob.Block):
        return loss, type(loss).__name__, label_name or "labels"
    raise OnnxMPError(f"unsupported loss {loss!r}",
                      f"use one of {', '.join(LOSSES)} or an onnxruntime.training.onnxblock.Block")


def _user_inputs(training: onnx.ModelProto, parameters: set[str]) -> list[tuple[str, str]]:
    skip = {*parameters, LOSS_SCALE, GRAD_WEIGHT, "lazy_reset_grad"}
    result = []
    for value in training.graph.input:
        if value.name in skip or value.name.endswith(".accumulation.buffer"):
            continue
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        result.append((value.name, str(dtype)))
    return result


def _onnxmp_version() -> str:
    from onnxmp import __version__

    return __version__


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__

