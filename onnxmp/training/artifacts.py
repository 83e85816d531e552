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
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import onnx
import onnx.version_converter
from onnx import TensorProto, helper

from onnxmp.errors import OnnxMPError
from onnxmp.naming import FreshNames, proto_names
from onnxmp.precision import FLOAT32
from onnxmp.precision import PRECISIONS as LOW_PRECISIONS
from onnxmp.training import _ort

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
    conversion).  Models over 2 GB are not supported (onnxblock needs them in
    memory).
    """
    from onnxmp.load import load

    _check_choice("precision", precision, PRECISIONS)
    _check_choice("target", target, TARGETS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    requires_grad = list(dict.fromkeys(requires_grad))
    frozen = list(dict.fromkeys(frozen))
    if not requires_grad:
        raise OnnxMPError("requires_grad is empty", "name the initializers to train")
    both = sorted(set(requires_grad) & set(frozen))
    if both:
        raise OnnxMPError(f"parameters both trainable and frozen: {', '.join(both)}")

    forward = _supported_versions(load(model))
    _check_parameters(forward, requires_grad, frozen)
    loss_block, loss_name, label_name = _loss_block(loss, label_name)
    used = proto_names(forward.graph)
    clashes = sorted(used & {*_RESERVED, label_name})
    if clashes:
        raise OnnxMPError(f"the model already uses the name(s) {', '.join(clashes)}",
                          "rename them, or pass another label_name")

    train_forward = _training_forward(forward, precision, target, [*requires_grad, *frozen])
    training, evaluation, parameters = _gradient_graph(train_forward, loss_block, label_name,
                                                       requires_grad, frozen)
    add_loss_scaling(training)
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
        "training_outputs": [v.name for v in training.graph.output if not v.name.endswith(".accumulation.out")],
        "eval_outputs": [v.name for v in evaluation.graph.output],
        "loss_scale_input": LOSS_SCALE,
        "grad_weight_input": GRAD_WEIGHT,
        "requires_grad": requires_grad,
        "frozen": frozen,
        "files": dict(FILES),
    }
    out = Path(out_dir)
    write_artifacts(out, manifest, training=training, evaluation=evaluation,
                    optimizer_model=optimizer_model, forward=forward, parameters=parameters)
    log.info("training artifacts (%s, %s) written to %s", precision, target, out)
    return Artifacts(out, manifest)


def write_artifacts(out: Path, manifest: dict, *, training, evaluation, optimizer_model, forward,
                    parameters) -> None:
    """Write every file, each atomically; the manifest goes last and is removed first,
    so a folder with a manifest is always complete."""
    from onnxmp.save import save

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OnnxMPError(f"cannot create {out}: {exc.strerror or exc}") from None
    (out / MANIFEST).unlink(missing_ok=True)
    files = manifest["files"]
    save(training, out / files["training_model"])
    save(evaluation, out / files["eval_model"])
    save(optimizer_model, out / files["optimizer_model"])
    save(forward, out / files["forward_model"])
    with atomic_path(out / files["checkpoint"]) as tmp:
        _ort.onnxblock().save_checkpoint(parameters, tmp)
    write_json(out / MANIFEST, manifest)


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
        raise OnnxMPError(f"onnxruntime could not build the gradient graph: {str(exc).strip()[:500]}",
                          "check that every op between the loss and the parameters is differentiable "
                          "in onnxruntime-training 1.19") from None
    return training, evaluation, parameters


def add_loss_scaling(training: onnx.ModelProto) -> None:
    """Unscale each gradient before its accumulator and add the ``all_finite`` output.

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
        grad = acc.input[1]
        unscaled = names(f"{grad}.unscaled")
        added.append(helper.make_node("Mul", [grad, unscale], [unscaled], name=names(f"onnxmp/unscale/{grad}")))
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


def build_optimizer_model(kind: str, *, opset: int, clip_global_norm: float | None = None) -> onnx.ModelProto:
    """The optimizer graph; with ``clip_global_norm`` its gradients pass ORT's
    ``InplaceClipGradNorm`` first (scale by ``c / (norm + 1e-6)`` when the
    global L2 norm exceeds ``c``, as torch's ``clip_grad_norm_``)."""
    _check_choice("optimizer", kind, OPTIMIZERS)
    ob = _ort.onnxblock()
    clip = None
    if clip_global_norm is not None:
        if not clip_global_norm > 0:
            raise OnnxMPError(f"clip_global_norm must be positive, got {clip_global_norm}")
        clip = ob.optim.ClipGradNorm(float(clip_global_norm))
    block = ob.optim.AdamW(clip_grad=clip) if kind == "adamw" else ob.optim.SGD(clip_grad=clip)
    # onnxblock only reads the element type of the first trainable parameter.
    parameters = ([helper.make_tensor("parameter", TensorProto.FLOAT, [1], [0.0])], [])
    with _ort.native_stderr_to_log(log), ob.empty_base(opset_version=opset):
        block(parameters)
        model = block.to_model_proto()
    _cap_ir_version(model)
    return model


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
                              f"and the conversion failed: {str(exc).strip()[:300]}",
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


class atomic_path:
    """``with atomic_path(p) as tmp:`` write a file at ``tmp``; it replaces ``p`` on success."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def __enter__(self) -> str:
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.close(fd)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                os.replace(self.tmp, self.path)
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)


def write_json(path: Path, data: Any) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(data, indent=2) + "\n")
