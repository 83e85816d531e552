"""The gradient builder's ops on a target that computes in low precision for real (CUDA): an op
the target's kernel table has no float16/bfloat16 kernel for runs in float32 between Casts."""
from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import TensorProto, numpy_helper

from onnxmp.training.build.autodiff import backward
from onnxmp.training.build.graph_check import check_graph

BF16, F16, FLOAT = TensorProto.BFLOAT16, TensorProto.FLOAT16, TensorProto.FLOAT
NAMES = {BF16: "bfloat16", F16: "float16"}


def _model(body: str, low: int, shape: str = "N, 4") -> onnx.ModelProto:
    """``x`` (low) times the float32 master weight ``w`` cast to low, then ``body`` to the scalar ``l``."""
    model = onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 17]>
g ({NAMES[low]}[{shape}] x) => ({NAMES[low]} l) {{
    w16 = Cast<to={low}>(w)
    h = MatMul(x, w16)
    {body}
    l = ReduceSum<keepdims=0>(r)
}}""")
    model.graph.initializer.append(numpy_helper.from_array(np.random.default_rng(0).normal(size=(4, 4))
                                                           .astype(np.float32), "w"))
    return model


def _added(before: onnx.ModelProto, after: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in after.graph.node[len(before.graph.node):] if n.op_type == op_type]


def _cast_to(after: onnx.ModelProto, name: str) -> int | None:
    """The type a Cast producing ``name`` casts to (None: not a Cast's output)."""
    node = next((n for n in after.graph.node if name in n.output), None)
    return node.attribute[0].i if node is not None and node.op_type == "Cast" else None


@pytest.mark.parametrize("low,target,fires", [(BF16, "cuda", True), (F16, "cuda", False), (BF16, "cpu", False)])
def test_relus_greater_runs_in_float32_where_the_target_has_no_low_precision_kernel(low, target, fires):
    model = _model("r = Relu(h)", low)
    grad, report = backward(model, "l", ["w"], target=target)
    (greater,) = _added(model, grad, "Greater")
    assert [_cast_to(grad, x) for x in greater.input] == ([FLOAT, FLOAT] if fires else [None, None])
    assert report.float32_ops == ({"Greater": 1} if fires else {})
    check = check_graph(grad, "cuda")
    assert check.ok, check.invalid or check.unresolved
    # CUDA has float16 Greater, not bfloat16: the CPU build keeps it bfloat16 (emulated there anyway).
    assert check.without_kernel == ({"Greater": 1} if (low, target) == (BF16, "cpu") else {})


@pytest.mark.parametrize("low,fires", [(BF16, True), (F16, False)])
def test_slices_pad_casts_in_and_out_where_the_target_has_no_low_precision_kernel(low, fires):
    model = _model("r = Slice(h, starts, ends, axes)", low, shape="3, 4")
    model.graph.initializer.extend(numpy_helper.from_array(np.array([v], np.int64), k)
                                   for k, v in (("starts", 1), ("ends", 3), ("axes", 1)))
    grad, report = backward(model, "l", ["w"], target="cuda")
    (pad,) = _added(model, grad, "Pad")
    assert (_cast_to(grad, pad.input[0]) == FLOAT) == fires
    users = [n for n in grad.graph.node if pad.output[0] in n.input]
    assert [(n.op_type, n.attribute[0].i) for n in users if n.op_type == "Cast"] == ([("Cast", low)] if fires else [])
    assert report.float32_ops == ({"Pad": 1} if fires else {})
    check = check_graph(grad, "cuda")
    assert check.ok, check.invalid or check.unresolved
    assert not check.without_kernel
