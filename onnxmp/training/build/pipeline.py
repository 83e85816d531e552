"""The training build: an fp32 ONNX model in, a folder of training artifacts out.

The build is a pipeline of stages (``docs/training.md``), each a pass over one
:class:`TrainingBuild` state, run by :class:`~onnxmp.passes.PassManager`:

1. ``load``: the model (for ORT's builder at an opset and IR version onnxruntime-training 1.19
   loads), with Constant-node weights promoted to initializers (:mod:`~onnxmp.training.build.load`);
   the parameters, names and loss (:mod:`~onnxmp.training.build.loss_forms`) checked;
2. ``prepare``: a copy the gradient builder can differentiate (:mod:`~onnxmp.training.build.prepare`);
3. ``convert``: the mixed-precision forward graph (trainable parameters stay float32 master
   weights, Cast at each low-precision use); emulated on ``target="cpu"``;
4. ``gradient``: the gradient graph of the scaled loss, and the eval graph, by the builder
   ``builder`` picks: onnxmp's (:mod:`~onnxmp.training.build.autodiff`, any Python) or ORT's
   (:mod:`~onnxmp.training.build.gradient`, onnxruntime-training 1.19.2);
5. ``loss_scale``: unscale / finite check (:mod:`~onnxmp.training.build.unscale`);
6. ``determinism``: on the CPU, kernels that run exactly and deterministically
   (:mod:`~onnxmp.training.build.determinism`);
7. ``lower``: the training and eval models in ops plain onnxruntime runs, for the portable
   engine (:mod:`~onnxmp.training.build.lower`); an op it cannot lower stops the build, named;
8. ``device_values`` (target ``cuda``): no shape arithmetic feeds device data inside the step: what
   would cross host to device under the CUDA EP's placement is computed on the device
   (:mod:`~onnxmp.training.build.device_values`, :mod:`~onnxmp.training.build.placement`);
9. ``optimizer``: the optimizer models (:mod:`~onnxmp.training.build.optimizer_graphs`): torch's
   update in standard ops (:mod:`~onnxmp.training.update_graph`), which both engines step with, and
   (ORT's builder) onnxblock's;
10. ``write``: the folder, whole or not at all (:mod:`~onnxmp.training.artifacts`), with the
   portable form of the graphs and the manifest the contract describes
   (:func:`onnxmp.training.contract.manifest`), and the parameters in ``parameters.npz``; with
   ORT's builder, the native engine's files too.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxmp.domains import is_onnx_domain
from onnxmp.errors import OnnxMPError
from onnxmp.external import constant_node_values
from onnxmp.files import destination
from onnxmp.naming import FreshNames, proto_names
from onnxmp.normalize import infer_tensor_types
from onnxmp.passes import PassBase, PassManager, PassResult
from onnxmp.precision import BY_ONNX_TYPE, FLOAT32, PRECISIONS as LOW_PRECISIONS
from onnxmp.targets import target as target_named
from onnxmp.training import _ort, contract
from onnxmp.training._ort import cap_ir_version
from onnxmp.training.artifacts import Artifacts, write_artifacts
from onnxmp.training.build.determinism import deterministic_gather_grads, float32_cpu_grad_kernels
from onnxmp.training.build.gradient import gradient_graph, make_eval_outputs
from onnxmp.training.build.load import (check_trainable_size, model_opset, ort_version, promote_constants,
                                        runtime_loads_opset, supported_versions)
from onnxmp.training.build.lower import check_lowered, lower_model
from onnxmp.training.build.optimizer_graphs import build_optimizer_model, build_portable_optimizer
from onnxmp.training.build.prepare import Preparation, describe, prepare_for_gradient
from onnxmp.training.build.unscale import add_loss_scaling, proven_gradients
from onnxmp.training.contract import RESERVED
from onnxmp.training.build.loss_forms import loss_writer
from onnxmp.training.labels import check_output, output_shape
from onnxmp.training.optimizer_settings import Optimizer as OptimizerSpec
from onnxmp.training.optimizer_settings import optimizer_named

log = logging.getLogger("onnxmp.training")

PRECISIONS = (*LOW_PRECISIONS, FLOAT32.name)  # float32: train without mixed precision
BUILDERS = ("auto", "onnxmp", "ort")  # who differentiates: onnxmp's autodiff, or onnxruntime-training's builder


@dataclass
class TrainingBuild:
    """What the stages hand each other."""

    source: onnx.ModelProto | str | os.PathLike
    requires_grad: list[str]
    frozen: list[str]
    loss: Any
    label_name: str | None
    optimizer: OptimizerSpec
    precision: str
    target: str
    out: Path
    builder: str = "ort"                           # resolved: "onnxmp" or "ort" (resolve_builder)
    forward: onnx.ModelProto | None = None         # the model as loaded (what is exported again)
    trainable: onnx.ModelProto | None = None       # Constant-node weights promoted to initializers
    loss_block: Any = None                         # loss(graph, output, label) -> name (loss_forms.LossWriter)
    loss_name: str = ""
    loss_options: dict = field(default_factory=dict)
    prepared: onnx.ModelProto | None = None
    preparations: list = field(default_factory=list)
    train_forward: onnx.ModelProto | None = None   # the mixed-precision forward graph
    training: onnx.ModelProto | None = None
    evaluation: onnx.ModelProto | None = None
    parameters: Any = None
    lowered_training: onnx.ModelProto | None = None    # training/evaluation in ops plain onnxruntime runs
    lowered_evaluation: onnx.ModelProto | None = None
    optimizer_model: onnx.ModelProto | None = None
    portable_optimizer: onnx.ModelProto | None = None  # torch's update in standard ops (optimizer.py)
    artifacts: Artifacts | None = None

    @property
    def parameter_names(self) -> list[str]:
        return [*self.requires_grad, *self.frozen]

    @property
    def native(self) -> bool:
        """Whether the folder gets the native engine's files (onnxblock's optimizer, ORT's checkpoint)."""
        return self.builder == "ort"


class Load(PassBase[TrainingBuild]):
    name = "load"

    def call(self, state: TrainingBuild) -> PassResult:
        from onnxmp.load import load

        check_trainable_size(state.source)
        state.forward = load(state.source)
        # ORT 1.19's opset cap where its builder and native engine read the graphs, or where the installed
        # onnxruntime (which the portable engine runs on) cannot load the model's opset either.
        if state.native or not runtime_loads_opset(model_opset(state.forward)):
            state.forward = supported_versions(state.forward)
        cap_ir_version(state.forward)  # the portable engine runs on onnxruntime >= 1.19 too
        state.trainable, promoted = promote_constants(state.forward, state.parameter_names)
        _check_parameters(state.trainable, state.requires_grad, state.frozen)
        state.loss_block, state.loss_name, state.loss_options, state.label_name = _loss_block(
            state.loss, state.label_name, state.forward)
        check_output(state.loss_name, output_shape(state.forward), repr(state.forward.graph.output[0].name))
        clashes = sorted(proto_names(state.forward.graph) & {*RESERVED, state.label_name})
        if clashes:
            raise OnnxMPError(f"the model already uses the name(s) {', '.join(clashes)}",
                              "rename them, or pass another label_name")
        return PassResult(bool(promoted), {"promoted_constants": len(promoted)})


class Prepare(PassBase[TrainingBuild]):
    name = "prepare"

    def call(self, state: TrainingBuild) -> PassResult:
        state.prepared, state.preparations = prepare_for_gradient(
            state.trainable, state.requires_grad, ort_builder=state.native, low_precision=state.precision != "float32")
        return PassResult(bool(state.preparations), {"rewritten": len(state.preparations)})


class Convert(PassBase[TrainingBuild]):
    name = "convert"

    def call(self, state: TrainingBuild) -> PassResult:
        state.train_forward, retyped = training_forward(state.prepared, state.precision, state.target,
                                                        state.parameter_names)
        state.preparations.extend(retyped)
        return PassResult(state.train_forward is not state.prepared, {"pow_exponents": len(retyped)})


class Gradient(PassBase[TrainingBuild]):
    name = "gradient"

    def call(self, state: TrainingBuild) -> PassResult:
        details = {"builder": state.builder}
        if state.builder == "onnxmp":
            from onnxmp.training.build.autodiff import gradient_graph as onnxmp_gradient_graph

            reports: list = []
            state.training, state.evaluation, state.parameters = onnxmp_gradient_graph(
                state.train_forward, state.loss_block, state.label_name, state.requires_grad, state.frozen,
                reports=reports, target=state.target)
            places = sum(r.runtime_shapes for r in reports)
            details.update(nodes_added=sum(r.nodes_added for r in reports), runtime_shapes=places)
            log.info("onnxmp's gradient builder: %d node(s); %d place(s) read a shape at run time (the symbolic "
                     "shapes could not decide them)", details["nodes_added"], places)
        else:
            state.training, state.evaluation, state.parameters = gradient_graph(
                state.train_forward, state.loss_block, state.label_name, state.requires_grad, state.frozen)
        make_eval_outputs(state.evaluation, state.train_forward)
        return PassResult(True, details)


class LossScale(PassBase[TrainingBuild]):
    name = "loss_scale"

    def call(self, state: TrainingBuild) -> PassResult:
        # onnxmp's gradients have the parameters' shapes by construction, which the symbolic shapes
        # prove at build time; ORT's keep the runtime check (its Where/Pow gradients did not).
        proven = proven_gradients(state.training) if state.builder == "onnxmp" else frozenset()
        add_loss_scaling(state.training, proven)
        return PassResult(True, {"proven_shapes": len(proven)})


class Determinism(PassBase[TrainingBuild]):
    name = "determinism"

    def call(self, state: TrainingBuild) -> PassResult:
        if not target_named(state.target).emulated:
            return PassResult(False)
        wrapped = float32_cpu_grad_kernels(state.training)
        replaced = deterministic_gather_grads(state.training)
        return PassResult(bool(wrapped or replaced), {"float32_grads": wrapped, "scatter_grads": replaced})


class Lower(PassBase[TrainingBuild]):
    """The portable training and eval models: ORT's training ops rewritten into standard ONNX
    (and the com.microsoft ops plain onnxruntime registers on CPU and CUDA)."""

    name = "lower"

    def call(self, state: TrainingBuild) -> PassResult:
        state.lowered_training = lower_model(state.training)
        state.lowered_evaluation = lower_model(state.evaluation)
        for proto in (state.lowered_training, state.lowered_evaluation):
            cap_ir_version(proto)
        return PassResult(True, {"training_nodes": len(state.lowered_training.graph.node)})

    def ensures(self, state: TrainingBuild) -> None:
        for proto in (state.lowered_training, state.lowered_evaluation):
            check_lowered(proto)
        same = [v.name for v in state.lowered_training.graph.input] == [v.name for v in state.training.graph.input]
        self.check(same, "the lowered training model has the native one's inputs, in order")


class DeviceValues(PassBase[TrainingBuild]):
    """On a GPU target: the lowered graphs' shape arithmetic that would feed device data from the
    host (a host-to-device copy and a stall every step) computed on the device instead."""

    name = "device_values"

    def call(self, state: TrainingBuild) -> PassResult:
        if target_named(state.target).emulated:
            return PassResult(False)
        from onnxmp.training.build.device_values import keep_on_device

        found = {part: keep_on_device(proto) for part, proto in
                 (("training", state.lowered_training), ("evaluation", state.lowered_evaluation))}
        moved = sum(f["rewritten"] for f in found.values())
        log.info("%d shape value(s) computed on the device; %d host-to-device copies left", moved,
                 sum(f["copies"] for f in found.values()))
        return PassResult(bool(moved), {part: f for part, f in found.items()})


class Optimizer(PassBase[TrainingBuild]):
    name = "optimizer"

    def call(self, state: TrainingBuild) -> PassResult:
        if state.native:
            state.optimizer_model = build_optimizer_model(state.optimizer, opset=model_opset(state.forward))
        shapes = {t.name: list(t.dims) for t in state.trainable.graph.initializer}
        state.portable_optimizer = build_portable_optimizer(
            state.optimizer, [(name, shapes[name]) for name in state.requires_grad], model_opset(state.forward))
        for proto in (state.training, state.evaluation):
            cap_ir_version(proto)
        return PassResult(True)


class Write(PassBase[TrainingBuild]):
    name = "write"

    def call(self, state: TrainingBuild) -> PassResult:
        manifest = contract.manifest(
            training=state.training, evaluation=state.evaluation, forward=state.forward,
            portable_optimizer=state.portable_optimizer, requires_grad=state.requires_grad, frozen=state.frozen,
            label_input=state.label_name, loss=state.loss_name, loss_options=state.loss_options,
            optimizer=state.optimizer.manifest_entry(state.requires_grad), precision=state.precision,
            target=state.target, opset=model_opset(state.forward), output_shape=output_shape(state.forward),
            prepared_for_gradient=describe(state.preparations),
            versions={"onnxmp_version": _onnxmp_version(), "onnxruntime_version": ort_version()},
            builder=state.builder, native=state.native)
        models = {"training_model": state.lowered_training, "eval_model": state.lowered_evaluation,
                  "optimizer_model": state.portable_optimizer}
        native = {"training_model": state.training, "eval_model": state.evaluation,
                  "optimizer_model": state.optimizer_model} if state.native else None
        write_artifacts(state.out, manifest, native=native, forward=state.forward, parameters=state.parameters,
                        portable=models)
        log.info("training artifacts (%s, %s) written to %s", state.precision, state.target, destination(state.out))
        state.artifacts = Artifacts(state.out, manifest)
        return PassResult(True)


STAGES = (Load, Prepare, Convert, Gradient, LossScale, Determinism, Lower, DeviceValues, Optimizer, Write)


def build_artifacts(
    model: onnx.ModelProto | str | os.PathLike,
    *,
    requires_grad: Iterable[str],
    frozen: Iterable[str] = (),
    loss: str | Any = "cross_entropy",
    optimizer: str | OptimizerSpec = "adamw",
    precision: str = "float16",
    target: str = "cpu",
    out_dir: str | os.PathLike,
    label_name: str | None = None,
    builder: str = "auto",
) -> Artifacts:
    """Build mixed-precision training artifacts for ``model`` in ``out_dir``.

    ``builder`` differentiates the graph: ``"onnxmp"`` (onnxmp's own gradient builder, any Python,
    plain onnxruntime; the folder holds the portable engine's files), ``"ort"`` (onnxruntime-training
    1.19.2's, Python <= 3.11; the folder holds the native engine's files too) or ``"auto"`` (ORT's
    where onnxruntime-training imports, onnxmp's elsewhere).  The manifest records which.

    ``loss`` is one of :data:`~onnxmp.training.losses.LOSSES`, or a custom loss: a function
    ``(builder, output, label) -> loss name`` adding nodes with ``losses.LossGraph``, an ONNX graph
    or function of (output, label) with one float32 scalar output, or an ``onnxblock.Block``
    (called as ``block(output_name, label_name)``) where onnxruntime-training installs
    (:mod:`~onnxmp.training.build.loss_forms`).  The loss reads the model's first output; ``label_name`` (default: the loss's own,
    ``labels`` for cross entropy, ``target`` otherwise) names the new label input.
    ``optimizer`` is ``onnxmp.training.AdamW(...)`` / ``SGD(...)`` (torch.optim's arguments; its
    ``lr`` is the default learning rate) or ``"adamw"`` / ``"sgd"`` (torch's defaults); the
    manifest records it (:mod:`~onnxmp.training.optimizer_settings`).
    ``precision="float32"`` builds the fp32 baseline (no conversion).  Models over 2 GB are
    refused before any work (see :func:`check_trainable_size`).

    ``loss`` may also be ``losses.table_loss(name, **options)`` (a table loss with other options than
    the defaults, e.g. ``ignore_index``, ``pos_weight``) or ``"module:function"`` /
    ``"file.py:function"`` (:func:`~onnxmp.training.losses.resolve_loss`); a custom loss must
    declare its label input (docs/training.md, custom losses).  ``causal_lm``'s label is ``labels``.
    """
    builder = resolve_builder(builder)  # before any work: the builder asked for is there
    if precision not in PRECISIONS:
        raise OnnxMPError(f"unknown precision {precision!r}", f"use one of: {', '.join(PRECISIONS)}")
    target_named(target)
    optimizer = optimizer_named(optimizer)
    # A lone string is one name, not a sequence of one-letter names.
    requires_grad = list(dict.fromkeys([requires_grad] if isinstance(requires_grad, str) else requires_grad))
    frozen = list(dict.fromkeys([frozen] if isinstance(frozen, str) else frozen))
    if not requires_grad:
        raise OnnxMPError("requires_grad is empty", "name the initializers to train")
    both = sorted(set(requires_grad) & set(frozen))
    if both:
        raise OnnxMPError(f"parameters both trainable and frozen: {', '.join(both)}")
    state = TrainingBuild(model, requires_grad, frozen, loss, label_name, optimizer, precision, target, Path(out_dir),
                          builder)
    PassManager([stage() for stage in STAGES], log=log,
                hint="please report this model to onnxmp; run with -v for onnxruntime's log")(state)
    return state.artifacts


def resolve_builder(builder: str) -> str:
    """``"onnxmp"`` or ``"ort"`` for ``builder``; ``auto``: ORT's where onnxruntime-training imports
    (the reference path), onnxmp's elsewhere.  ``"ort"`` without the training build is one error
    naming the Python 3.11 step; ``"onnxmp"`` needs nothing but onnx and onnxruntime."""
    if builder not in BUILDERS:
        raise OnnxMPError(f"unknown gradient builder {builder!r}", f"use one of: {', '.join(BUILDERS)}")
    if builder == "ort":
        _ort.onnxblock()
        return builder
    if builder == "auto" and _ort.available():
        return "ort"
    return "onnxmp"


def training_forward(forward: onnx.ModelProto, precision: str, target: str,
                     master: Sequence[str]) -> tuple[onnx.ModelProto, list[Preparation]]:
    """The mixed-precision forward graph: trainable parameters stay float32 master weights, Cast at
    each low-precision use; on an emulated target (the CPU) the low-precision numerics are emulated.
    Also returns what :func:`pow_exponents_like_bases` changed for ORT's gradient builder."""
    if precision == "float32":
        return forward, []
    from onnxmp.options import Options
    from onnxmp.pipeline import convert_once

    # The CUDA coloring on both targets: CPU training emulates what the GPU would run.
    options = Options(target="cuda", precision=precision, keep_io_types=True, master_weights=tuple(master))
    converted = convert_once(forward, options).model
    initializers = {t.name: t for t in converted.graph.initializer}
    lost = [n for n in master if n not in initializers or initializers[n].data_type != TensorProto.FLOAT]
    if lost:
        raise OnnxMPError(f"the conversion did not keep float32 master weights for {', '.join(lost)}",
                          "this is an onnxmp bug; please report it")
    # Before the emulation, so that the CPU emulates the graph the GPU runs.
    retyped = pow_exponents_like_bases(converted)
    emulated = target_named(target).emulated
    if emulated:
        from onnxmp.parity.emulate import emulate

        converted = emulate(converted, precision=precision)
    log.info("forward model converted to %s (%s)", precision,
             "emulated in float32 for the CPU" if emulated else "CUDA")
    return converted, retyped


def pow_exponents_like_bases(model: onnx.ModelProto) -> list[Preparation]:
    """Give each ``Pow`` of a low-precision base an exponent of the base's type, in place.

    ORT 1.19's Pow gradient (``GetPowGradient``, orttraining's gradient_builder.cc) subtracts a
    constant 1 *of the base's type* from the exponent and multiplies the result by the exponent:
    a float16 base with the float32 exponent the conversion keeps (Pow's ``T1``) makes a Sub of
    float32 and float16, and the gradient graph fails to type-check.  A constant exponent that
    the base's type holds exactly (2, 3, 0.5: every exporter's) becomes a constant of that type,
    which changes no value; any other Pow runs on a float32 copy of its base and rounds its result
    back, which is what CUDA's low-precision Pow kernel does inside anyway (it computes in float).
    """
    graph = model.graph
    if not any(n.op_type == "Pow" for n in graph.node):
        return []
    types = infer_tensor_types(model)
    initializers = {t.name: t for t in graph.initializer}
    constant_nodes = {n.output[0]: n for n in graph.node if n.op_type == "Constant" and is_onnx_domain(n.domain)}
    names = FreshNames(proto_names(graph))
    # Pow-13's exponent takes float16 but not bfloat16 (Pow-15 added it).
    exponent_types = {c.type_param_str: set(c.allowed_type_strs)
                      for c in onnx.defs.get_schema("Pow", model_opset(model)).type_constraints}.get("T1", set())
    retyped: dict[tuple[str, int], str] = {}
    done: list[Preparation] = []
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes.append(node)
        if node.op_type != "Pow" or not is_onnx_domain(node.domain) or len(node.input) < 2:
            continue
        base, exponent = (_elem_type(types.get(name)) for name in node.input[:2])
        low = BY_ONNX_TYPE.get(base)
        if low is None or low.name not in LOW_PRECISIONS or exponent in (base, 0):
            continue
        scope = node.name or f"Pow_{node.output[0]}"
        value = _constant_value(node.input[1], initializers, constant_nodes)
        exact = (_exactly(value, low.numpy)
                 if value is not None and low.type_str in exponent_types else None)
        if exact is not None:
            key = (node.input[1], base)
            if key not in retyped:
                retyped[key] = names(f"{node.input[1]}_{low.suffix}")
                graph.initializer.append(numpy_helper.from_array(exact, retyped[key]))
            node.input[1] = retyped[key]
            done.append(Preparation("Pow", node.name, f"exponent made {low.name}, the type of its base"))
        elif exponent == TensorProto.FLOAT:
            wide, out = names(f"{scope}/base_fp32"), names(f"{scope}/output_fp32")
            nodes.insert(len(nodes) - 1, helper.make_node("Cast", [node.input[0]], [wide], names(f"{scope}/Cast_fp32"),
                                                          to=TensorProto.FLOAT))
            result = node.output[0]
            node.input[0], node.output[0] = wide, out
            nodes.append(helper.make_node("Cast", [out], [result], names(f"{scope}/Cast_{low.suffix}"), to=base))
            why = ("its exponent is computed" if value is None else f"Pow-{model_opset(model)} takes no {low.name} exponent"
                   if low.type_str not in exponent_types else f"its exponent is not exact in {low.name}")
            done.append(Preparation("Pow", node.name, f"run in float32 ({why})"))
    if done:
        graph.ClearField("node")
        graph.node.extend(nodes)
        log.info("%d Pow node(s) given exponents of their bases' type for onnxruntime's gradient builder", len(done))
    return done


def _constant_value(name: str, initializers: dict, constant_nodes: dict) -> np.ndarray | None:
    """The value of ``name`` when an initializer or a Constant node holds it (floats), else None."""
    if name in initializers:
        return numpy_helper.to_array(initializers[name])
    value = constant_node_values(constant_nodes[name]) if name in constant_nodes else None
    # an integer exponent keeps its own type: only float values are retyped to the base's
    return value if value is not None and value.dtype.kind == "f" else None


def _elem_type(tp: onnx.TypeProto | None) -> int:
    return tp.tensor_type.elem_type if tp is not None and tp.HasField("tensor_type") else 0


def _exactly(value: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """``value`` in ``dtype`` if every element converts exactly (finite), else None."""
    if value.dtype.kind != "f" or not np.all(np.isfinite(value)):
        return None
    cast = value.astype(dtype)
    return cast if np.array_equal(cast.astype(value.dtype), value) else None


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


def _loss_block(loss, label_name: str | None, forward: onnx.ModelProto):
    """(the loss writer, the manifest's loss name, its options, the label input's name) for ``loss``."""
    writer = loss_writer(loss, forward.opset_import)
    return writer, writer.name, dict(writer.options), label_name or writer.label


def _onnxmp_version() -> str:
    from onnxmp import __version__

    return __version__
