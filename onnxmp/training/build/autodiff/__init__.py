"""onnxmp's own reverse-mode gradient builder: training graphs without onnxruntime-training.

- :func:`backward` adds ``<w>_grad`` outputs to a model (the engine: :mod:`.engine`; one rule per
  op in :data:`VJP_RULES`, by family: :mod:`.elementwise`, :mod:`.activation_zoo`, :mod:`.linalg`,
  :mod:`.normalization`, :mod:`.data_movement`, :mod:`.indexing`, :mod:`.reductions`, :mod:`.conv`,
  :mod:`.resize`; what the shapes decide: :mod:`.info`, :mod:`.symbolic`, :mod:`.fold`).
- :func:`gradient_graph` builds the training and eval models with the contract of
  :func:`onnxmp.training.build.gradient.gradient_graph` (onnxruntime-training's onnxblock builder), so
  the rest of the build (loss scaling, lowering, optimizer, write) runs on either.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import onnx
from onnx import TensorProto, helper

from onnxmp.training.build.autodiff.engine import BackwardReport, backward
from onnxmp.training.build.autodiff.rules import VJP_RULES
from onnxmp.training.build.loss_forms import add_scaled_loss, checked_loss
from onnxmp.training.contract import (LAZY_RESET_GRAD, LOSS, LOSS_SCALED, accumulation_buffer,
                                      accumulation_out, gradient_output)

log = logging.getLogger("onnxmp.training.build.autodiff")

# loss(graph, output, label) -> the loss value's name; appends the loss nodes and the label input.
LossFn = Callable[[onnx.GraphProto, str, str], str]


def gradient_graph(forward: onnx.ModelProto, loss: LossFn, label_name: str, requires_grad: Sequence[str],
                   frozen: Sequence[str], *, reports: list | None = None, target: str = "cpu"):
    """(training, evaluation, (trainable, frozen)) as onnxruntime-training's onnxblock builds them:

    - both models read the parameters (``requires_grad`` then ``frozen``, in initializer order) as
      graph inputs after the user inputs, the label and ``loss_scale``; other initializers stay;
    - the eval model outputs ``loss_scaled`` and ``loss`` and runs Dropout/BatchNormalization in
      inference mode;
    - the training model outputs ``loss_scaled``, ``loss`` and, per trainable parameter ``P``,
      ``P_grad.accumulation.out`` from an ``InPlaceAccumulatorV2`` reading the inputs
      ``P_grad.accumulation.buffer`` and ``lazy_reset_grad``;
    - the parameters: two lists of TensorProto.

    ``reports``, when given, receives the :class:`BackwardReport` (nodes added, runtime-shape places).
    ``target`` the build's target: its kernel table decides which gradient ops run in float32.
    """
    requires_grad, frozen = list(requires_grad), list(frozen)
    model = onnx.ModelProto()
    model.CopyFrom(forward)
    graph = model.graph
    loss_value = checked_loss(loss)(graph, graph.output[0].name, label_name)
    add_scaled_loss(graph, loss_value)
    graph.ClearField("output")
    graph.output.extend([helper.make_tensor_value_info(LOSS_SCALED, TensorProto.FLOAT, []),
                         helper.make_tensor_value_info(LOSS, TensorProto.FLOAT, [])])

    params = set(requires_grad) | set(frozen)
    parameters = ([t for t in graph.initializer if t.name in requires_grad],
                  [t for t in graph.initializer if t.name in frozen])
    evaluation = onnx.ModelProto()
    evaluation.CopyFrom(model)
    _inference_mode(evaluation.graph)
    _initializers_to_inputs(evaluation.graph, params)

    training, report = backward(model, LOSS_SCALED, requires_grad, target=target)
    if reports is not None:
        reports.append(report)
    log.info("onnxmp gradient graph: %d nodes, %d runtime-shape place(s); ops: %s", report.nodes_added,
             report.runtime_shapes, ", ".join(f"{k} x{v}" for k, v in report.ops.items()))
    _initializers_to_inputs(training.graph, params)
    _accumulators(training, requires_grad)
    return training, evaluation, parameters


def _initializers_to_inputs(graph: onnx.GraphProto, names: set[str]) -> None:
    kept = []
    for t in graph.initializer:
        if t.name in names:
            graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, t.dims))
        else:
            kept.append(t)
    graph.ClearField("initializer")
    graph.initializer.extend(kept)


def _inference_mode(graph: onnx.GraphProto) -> None:
    """onnxblock's eval model: Dropout without its training_mode input, BatchNormalization at
    training_mode=0."""
    for node in graph.node:
        if node.op_type == "Dropout" and len(node.input) > 2:
            node.input[2] = ""
        elif node.op_type == "BatchNormalization":
            for a in node.attribute:
                if a.name == "training_mode":
                    a.i = 0


def _accumulators(training: onnx.ModelProto, requires_grad: list[str]) -> None:
    """onnxblock's gradient accumulation: each ``P_grad`` output into an InPlaceAccumulatorV2."""
    graph = training.graph
    grads = {gradient_output(p): p for p in requires_grad}
    outputs = []
    for index, value in enumerate(graph.output):
        if value.name not in grads:
            outputs.append(value)
            continue
        buffer, out = accumulation_buffer(grads[value.name]), accumulation_out(grads[value.name])
        graph.node.append(helper.make_node("InPlaceAccumulatorV2", [buffer, value.name, LAZY_RESET_GRAD], [out],
                                           name=f"GradientAccumulator{index}",
                                           domain="com.microsoft"))
        buffer_input = onnx.ValueInfoProto()
        buffer_input.CopyFrom(value)
        buffer_input.name = buffer
        graph.input.append(buffer_input)
        outputs.append(helper.make_tensor_value_info(out, TensorProto.BOOL, [1]))
    graph.input.append(helper.make_tensor_value_info(LAZY_RESET_GRAD, TensorProto.BOOL, [1]))
    graph.ClearField("output")
    graph.output.extend(outputs)
    if not any(o.domain == "com.microsoft" for o in training.opset_import):
        training.opset_import.append(helper.make_opsetid("com.microsoft", 1))


__all__ = ["BackwardReport", "LossFn", "VJP_RULES", "backward", "gradient_graph"]
