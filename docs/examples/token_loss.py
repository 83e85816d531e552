"""A custom loss for onnxmp: token cross entropy with label smoothing (docs/training.md, custom losses).

What ``torch.nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=-100)`` computes over a
``[batch, sequence, vocab]`` head with ``[batch, sequence]`` labels::

    onnxmp train model.onnx --loss docs/examples/token_loss.py:token_loss ...
    build_artifacts(model, ..., loss="docs/examples/token_loss.py:token_loss")

It runs on any Python onnxmp runs on (no onnxruntime-training).  onnxmp calls
``token_loss(g, output, label)`` with a node builder ``g`` (``onnxmp.training.losses.LossGraph``)
on the forward graph, the name of the model's first output and the label input's name.  It must

1. declare the label input (``declare_label`` adds it, shaped like the output without its class axis),
2. add nodes in standard ONNX ops (``g.op(op_type, *inputs, **attributes)``, ``g.const(what, value)``), and
3. return the name of a float32 scalar: the loss.

``token_loss_block()`` is the same loss as an onnxruntime-training ``onnxblock.Block``, the form
custom losses took before; it needs onnxruntime-training (Python <= 3.11), and onnxmp still takes it
there (``--loss docs/examples/token_loss.py:token_loss_block``).
"""
import numpy as np
from onnx import TensorProto

from onnxmp.training.losses import LossGraph, declare_label


def token_loss(g: LossGraph, output: str, label: str, smoothing: float = 0.1, ignore_index: int = -100) -> str:
    declare_label(g.graph, output, label, classes=True)  # 1. int64 [batch, sequence]
    last = g.const("last_axis", [-1], np.int64)  # 2. nodes named onnxmp/loss/token_loss/...
    labels = g.op("Unsqueeze", label, last)  # [B, S, 1]
    kept = g.op("Not", g.op("Equal", labels, g.const("ignore", ignore_index, np.int64)))
    safe = g.op("Where", kept, labels, g.const("class0", 0, np.int64))  # ignored -> any valid class
    log_probs = g.op("LogSoftmax", output, axis=-1)
    nll = g.op("Neg", g.op("GatherElements", log_probs, safe, axis=-1))  # [B, S, 1]
    classes = g.op("Cast", g.op("Gather", g.op("Shape", output), last), to=TensorProto.FLOAT)
    uniform = g.op("Neg", g.op("Div", g.op("ReduceSum", log_probs, last, keepdims=1), classes))
    per_token = g.op("Add", g.op("Mul", nll, g.const("keep", 1.0 - smoothing)),
                     g.op("Mul", uniform, g.const("smooth", smoothing)))
    weights = g.op("Cast", kept, to=TensorProto.FLOAT)
    total = g.op("ReduceSum", g.op("Mul", per_token, weights), keepdims=0)
    return g.op("Div", total, g.op("ReduceSum", weights, keepdims=0))  # 3. the mean over kept tokens


def token_loss_block(smoothing: float = 0.1, ignore_index: int = -100):
    from onnxmp.training.losses import onnxblock

    ob = onnxblock()  # onnxruntime-training's module, without importing torch

    class SmoothedTokenLoss(ob.Block):
        def build(self, output: str, label: str) -> str:
            return token_loss(LossGraph(self.base.graph, "token_loss"), output, label, smoothing, ignore_index)

    return SmoothedTokenLoss()
