"""Build stage ``optimizer``: the artifacts' optimizer models.

* ``build_optimizer_model``: onnxblock's AdamW / SGD over sequences, the ``optimizer_model.onnx``
  onnxruntime-training's ``Optimizer`` would run.  Its update is onnxruntime's, not torch's: both
  engines step with torch's update instead;
* torch's update in standard ops (:func:`onnxmp.training.update_graph.build_portable_optimizer`),
  which both engines run: ``optimizer_model.portable.onnx``.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxmp.errors import OnnxMPError
from onnxmp.naming import FreshNames, proto_names
from onnxmp.training import _ort
from onnxmp.training._ort import cap_ir_version
from onnxmp.training.nodes import Nodes
from onnxmp.training.optimizer_settings import Optimizer, optimizer_named
from onnxmp.training.update_graph import build_portable_optimizer, clip_by_global_norm

__all__ = ["build_optimizer_model", "build_portable_optimizer"]

log = logging.getLogger("onnxmp.training.build.optimizer_graphs")


def build_optimizer_model(kind: str | Optimizer | dict, *, opset: int, clip_global_norm: float | None = None,
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
    kind = optimizer_named(kind).name  # as before: onnxblock's own defaults, onnxruntime's update
    ob = _ort.onnxblock()
    block = ob.optim.AdamW() if kind == "adamw" else ob.optim.SGD()
    # onnxblock only reads the element type of the first trainable parameter.
    params = ([helper.make_tensor("parameter", TensorProto.FLOAT, [1], [0.0])], [])
    with _ort.native_stderr_to_log(log), ob.empty_base(opset_version=opset):
        block(params)
        model = block.to_model_proto()
    if clip_global_norm is not None:
        if not clip_global_norm > 0:
            raise OnnxMPError(f"clip_global_norm must be positive, got {clip_global_norm}",
                              "pass a norm above 0, or None not to clip")
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
    nodes, grads = [], []
    clip = Nodes(names, "onnxmp/clip", nodes)
    for i in range(count):
        grad = names(f"onnxmp/clip/grad_{i}")
        nodes.append(helper.make_node("SequenceAt", ["gradients", clip.constant(np.array(i, np.int64))], [grad],
                                      name=names(f"onnxmp/clip/SequenceAt_{i}")))
        grads.append(grad)
    scaled = clip_by_global_norm(nodes, names, grads, max_norm)
    clipped = names("onnxmp/clip/gradients")
    nodes.append(helper.make_node("SequenceConstruct", scaled, [clipped], name=names("onnxmp/clip/SequenceConstruct")))
    step.input[position] = clipped
    rest = list(graph.node)
    graph.ClearField("node")
    graph.node.extend([*nodes, *rest])
