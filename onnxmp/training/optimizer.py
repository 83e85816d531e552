"""Training stage: the optimizer model (AdamW or SGD), with an optional global-norm clip."""
from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxmp.errors import OnnxMPError
from onnxmp.naming import FreshNames, proto_names
from onnxmp.training import _ort

log = logging.getLogger("onnxmp.training.optimizer")

OPTIMIZERS = ("adamw", "sgd")
# onnxruntime-training 1.19.2, the last training build, loads nothing newer.
MAX_IR_VERSION = 10
MAX_OPSET = 21


def cap_ir_version(model: onnx.ModelProto) -> None:
    """onnx 1.23 stamps new models IR 14 and ORT 1.19 refuses anything over 10; nothing onnxmp or
    onnxblock writes needs a newer IR feature."""
    model.ir_version = min(model.ir_version or MAX_IR_VERSION, MAX_IR_VERSION)


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
    if kind not in OPTIMIZERS:
        raise OnnxMPError(f"unknown optimizer {kind!r}", f"use one of: {', '.join(OPTIMIZERS)}")
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
    cap_ir_version(model)
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
