"""TEST SCAFFOLDING, not library code: stand-ins for the real lowering (helper B's
``onnxmp.training.lower.lower_model``) and portable optimizer graph (helper C1's
``onnxmp.training.optimizer.build_portable_optimizer``) until they are merged.

``lower_for_tests`` rewrites only InPlaceAccumulatorV2 (to the contract's
``Where(reset, grad, Add(buffer, grad))``); every other training op stays, so its graphs run
in onnxruntime-training's InferenceSession (Python 3.11), not in plain onnxruntime.
``optimizer_for_tests`` writes the contract's per-parameter graph for onnxblock's SGD
(``p - lr * g``) and AdamW (the HF/transformers mode onnxblock builds: betas 0.9/0.999,
eps 1e-6, bias correction, no weight decay), with an optional global-norm clip as the native
optimizer graph computes it.  ``installed()`` puts them into :mod:`onnxmp.training.portable`
where the real ones are missing (once merged, the tests using it run the real ones).
"""
from __future__ import annotations

import contextlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


def lower_for_tests(model: onnx.ModelProto) -> onnx.ModelProto:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    shapes = {i.name: i.type.tensor_type.shape for i in graph.input}
    nodes, renamed = [], {}
    for node in graph.node:
        if node.op_type != "InPlaceAccumulatorV2":
            nodes.append(node)
            continue
        buffer, grad, reset = node.input
        total = f"{node.output[0]}/sum"
        nodes += [helper.make_node("Add", [buffer, grad], [total], name=f"{node.name}/Add"),
                  helper.make_node("Where", [reset, grad, total], [node.output[0]], name=f"{node.name}/Where")]
        renamed[node.output[0]] = shapes[buffer]
    graph.ClearField("node")
    graph.node.extend(nodes)
    for output in graph.output:
        if output.name in renamed:
            output.type.tensor_type.elem_type = TensorProto.FLOAT
            output.type.tensor_type.shape.CopyFrom(renamed[output.name])
    return model


def optimizer_for_tests(optimizer, parameters, opset, clip_global_norm=None) -> onnx.ModelProto:
    name = optimizer if isinstance(optimizer, str) else optimizer["name"]
    nodes, inits = [], []
    inputs = [helper.make_tensor_value_info("learning_rate", TensorProto.FLOAT, []),
              helper.make_tensor_value_info("step", TensorProto.INT64, [])]
    outputs = []

    def const(value, label):
        inits.append(numpy_helper.from_array(np.array(value, np.float32), label))
        return label

    def op(kind, ins, out, **attrs):
        nodes.append(helper.make_node(kind, ins, [out], name=out, **attrs))
        return out

    slots = ["exp_avg", "exp_avg_sq"] if name == "adamw" else []
    for p, shape in parameters:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
                   for n in (p, f"{p}.grad", *(f"{p}.{s}" for s in slots))]
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
                    for n in (f"{p}.out", *(f"{p}.{s}.out" for s in slots))]
    factor = None
    if clip_global_norm is not None:
        squares = [op("ReduceSumSquare", [f"{p}.grad"], f"{p}/sumsq", keepdims=0) for p, _ in parameters]
        total = op("Sum", squares, "clip/sum")
        norm = op("Sqrt", [total], "clip/norm")
        ratio = op("Div", [const(clip_global_norm, "clip/c"), op("Add", [norm, const(1e-6, "clip/eps")], "clip/den")],
                   "clip/ratio")
        factor = op("Min", [ratio, const(1.0, "clip/one")], "clip/factor")
    if name == "adamw":
        t = op("Cast", ["step"], "adamw/t", to=TensorProto.FLOAT)
        b1t = op("Pow", [const(0.9, "adamw/b1"), t], "adamw/b1t")
        b2t = op("Pow", [const(0.999, "adamw/b2"), t], "adamw/b2t")
        one = const(1.0, "adamw/one")
        c1 = op("Sub", [one, b1t], "adamw/c1")
        c2 = op("Sqrt", [op("Sub", [one, b2t], "adamw/c2sq")], "adamw/c2")
        step_size = op("Div", [op("Mul", ["learning_rate", c2], "adamw/lrc2"), c1], "adamw/step_size")
        const(0.1, "adamw/1-b1")
        const(0.001, "adamw/1-b2")
        const(1e-6, "adamw/eps")
    for p, _ in parameters:
        g = f"{p}.grad" if factor is None else op("Mul", [f"{p}.grad", factor], f"{p}/clipped")
        if name == "sgd":
            op("Sub", [p, op("Mul", ["learning_rate", g], f"{p}/update")], f"{p}.out")
            continue
        m = op("Add", [op("Mul", ["adamw/b1", f"{p}.exp_avg"], f"{p}/m0"), op("Mul", ["adamw/1-b1", g], f"{p}/m1")],
               f"{p}.exp_avg.out")
        v = op("Add", [op("Mul", ["adamw/b2", f"{p}.exp_avg_sq"], f"{p}/v0"),
                       op("Mul", ["adamw/1-b2", op("Mul", [g, g], f"{p}/g2")], f"{p}/v1")], f"{p}.exp_avg_sq.out")
        denominator = op("Add", [op("Sqrt", [v], f"{p}/sqrtv"), "adamw/eps"], f"{p}/den")
        update = op("Mul", [step_size, op("Div", [m, denominator], f"{p}/ratio")], f"{p}/update")
        op("Sub", [p, update], f"{p}.out")
    graph = helper.make_graph(nodes, "optimizer_for_tests", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


@contextlib.contextmanager
def installed():
    """The scaffolding in place of the lowering and optimizer builder this onnxmp lacks (only
    those: once the real ones are merged, the tests that use this run the real ones)."""
    import onnxmp.training.portable as portable

    with pytest.MonkeyPatch.context() as patch:
        if portable.lower_model is None:
            patch.setattr(portable, "lower_model", lower_for_tests)
        if portable.build_portable_optimizer is None:
            patch.setattr(portable, "build_portable_optimizer", optimizer_for_tests)
        yield
