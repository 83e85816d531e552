"""Small reference models for examples, tests and benchmarks."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def mlp(sizes: Sequence[int], *, seed: int = 0, opset: int = 17, ir_version: int = 8) -> onnx.ModelProto:
    """Classifier ``x [N, sizes[0]] -> logits [N, sizes[-1]]``: MatMul+Add per layer, Relu between.

    Weights ``W{i}``/``b{i}`` are He-normal/zero from ``seed``, so equal
    arguments give bit-identical models.
    """
    if len(sizes) < 2:
        raise ValueError("an MLP needs at least input and output sizes")
    rng = np.random.default_rng(seed)
    nodes, initializers = [], []
    current = "x"
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        weight = rng.normal(0.0, np.sqrt(2.0 / fan_in), (fan_in, fan_out)).astype(np.float32)
        initializers += [numpy_helper.from_array(weight, f"W{i}"),
                         numpy_helper.from_array(np.zeros(fan_out, np.float32), f"b{i}")]
        last = i == len(sizes) - 2
        nodes += [helper.make_node("MatMul", [current, f"W{i}"], [f"h{i}"], name=f"matmul{i}"),
                  helper.make_node("Add", [f"h{i}", f"b{i}"], ["logits" if last else f"z{i}"], name=f"add{i}")]
        if not last:
            nodes.append(helper.make_node("Relu", [f"z{i}"], [f"a{i}"], name=f"relu{i}"))
            current = f"a{i}"
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", sizes[0]])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", sizes[-1]])],
        initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version,
                              producer_name="onnxmp.training.models")
    onnx.checker.check_model(model, full_check=True)
    return model


def trainable(model: onnx.ModelProto) -> list[str]:
    """Names of the float32 initializers: what to pass as ``requires_grad`` to train them all."""
    return [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT]


def scaled_cross_entropy(multiplier: float):
    """A custom loss for ``build_artifacts(loss=...)``: cross entropy times ``multiplier``.

    A custom loss function as users write one (``(builder, output, label) -> loss name``); a
    small ``multiplier`` makes float16 gradients underflow without loss scaling.
    """
    from onnxmp.training import losses

    def scaled_cross_entropy(g: losses.LossGraph, output: str, labels: str) -> str:
        loss = losses.table_loss("cross_entropy")(g.graph, output, labels)  # the table's, in standard ops
        return g.op("Mul", loss, g.const("multiplier", multiplier), what="scaled")

    return scaled_cross_entropy
