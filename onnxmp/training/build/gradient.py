"""Training stage: the gradient graph, built by onnxruntime-training 1.19's gradient builder.

The loss is multiplied by the scalar input ``loss_scale`` before backpropagation starts (the
unscaled ``loss`` is an output too), and the shape-inferred forward graph ORT's builder reads
has the dims of the runtime-shaped broadcasts cleared (:func:`unprove_symbolic_dims`).  ORT's
failures come back as one clear error naming the cause (:func:`gradient_error`).
"""
from __future__ import annotations

import logging
import re

import onnx
from onnx import TensorProto, helper

from onnxmp import runtime
from onnxmp.errors import OnnxMPError
from onnxmp.training import _ort
from onnxmp.training.contract import LOSS, LOSS_SCALE, LOSS_SCALED
from onnxmp.training.build.loss_forms import add_scaled_loss, checked_loss
from onnxmp.training.build.prepare import RUNTIME_SHAPE

log = logging.getLogger("onnxmp.training.build.gradient")


def gradient_graph(forward: onnx.ModelProto, loss, label_name: str, requires_grad, frozen):
    """(training, evaluation, (trainable, frozen) parameters) by ORT's builder.  ``loss(graph,
    output, label) -> name`` appends the loss to the forward graph (:mod:`~onnxmp.training.build.loss_forms`)."""
    ob = _ort.onnxblock()

    class LossScaledTraining(ob.TrainingBlock):
        def build(self, *outputs):
            graph = self.base.graph
            # checked: onnxblock checks the model after build(), where an undeclared label fails unnamed.
            loss_value = checked_loss(loss)(graph, outputs[0], label_name)
            add_scaled_loss(graph, loss_value)
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
        raise gradient_error(exc) from exc  # -v shows onnxruntime's own
    return training, evaluation, parameters


def gradient_error(exc: BaseException) -> OnnxMPError:
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
    reason = runtime.reason(text) or type(exc).__name__
    return OnnxMPError(f"onnxruntime could not build the gradient graph: {reason}",
                       "run with -v -v to see onnxruntime's log")



def make_eval_outputs(evaluation: onnx.ModelProto, forward: onnx.ModelProto) -> None:
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



def unprove_symbolic_dims(graph: onnx.GraphProto) -> int:
    """Clear the dims of the tensors :func:`_runtime_broadcast` made, in the shape-inferred model.

    ORT 1.19's gradient builders for broadcasting ops (Add, Sub, Mul, Div,
    Expand, ...) choose the axes to sum a gradient back over from the static
    shapes (``ComputeBroadcastBackwardAxes``), and two *different* symbolic dims
    at one position count as equal: no sum.  onnx's shape inference names every
    dim it cannot work out with a fresh ``unk__N``, so ``[1, S]`` position ids
    sliced from a buffer become ``[unk__0, unk__1]``, and their embedding added
    to ``[batch, sequence, H]`` word embeddings gets the whole gradient instead
    of its sum over the batch (a Reshape error downstream at best, a silently
    wrong embedding gradient at worst).  A tensor with dims of no value and no
    name makes ORT build that node's gradient from the runtime shapes instead
    (``BroadcastGradientArgs``), which is right for every broadcast.  Returns
    the number of dims cleared.
    """
    cleared = 0
    for value in graph.value_info:
        if value.name.startswith(RUNTIME_SHAPE) and value.type.HasField("tensor_type"):
            for dim in value.type.tensor_type.shape.dim:
                if dim.HasField("dim_param") or dim.HasField("dim_value"):
                    dim.Clear()
                    cleared += 1
    if cleared:
        log.debug("%d dim(s) left to onnxruntime's runtime shapes", cleared)
    return cleared
