"""Build stage ``loss_scale``: the unscale / finite-check subgraph (``docs/training.md``).

The names it writes are the contract's (:mod:`onnxmp.training.contract`): ``loss_scale`` (the
scalar the loss is multiplied by before backpropagation), ``grad_weight`` (1/k for k accumulated
micro-batches), ``loss`` and ``all_finite`` (outputs).  :func:`add_loss_scaling` multiplies
every gradient by ``grad_weight / loss_scale`` (computed once) before its accumulator, so the
accumulation buffers hold true gradients, and outputs whether every gradient is finite, built
from standard ONNX ops so it runs on the CPU (ORT has no CPU ``IsAllFinite``).
"""
from __future__ import annotations

from typing import Iterable

import onnx
from onnx import TensorProto, helper

from onnxmp.errors import OnnxMPError
from onnxmp.naming import FreshNames, proto_names
from onnxmp.training.contract import (ALL_FINITE, GRAD_SHAPE, GRAD_WEIGHT, LOSS_SCALE, buffer_parameter,
                                      is_accumulation_out)


def proven_gradients(training: onnx.ModelProto) -> frozenset[str]:
    """The accumulated gradients of ``training`` whose shape the build proves equal to their
    buffer's (the parameter's, static): by the symbolic shapes of onnxmp's gradient builder
    (:class:`~onnxmp.training.build.autodiff.info.GraphInfo`), which reads every op it emits."""
    from onnxmp.training.build.autodiff.info import GraphInfo

    info = GraphInfo(training)
    graph = training.graph
    buffers = {v.name: v for v in graph.input}
    proven = set()
    for node in graph.node:
        if node.op_type != "InPlaceAccumulatorV2" or node.input[0] not in buffers:
            continue
        dims = buffers[node.input[0]].type.tensor_type.shape.dim
        want = tuple(d.dim_value if d.HasField("dim_value") else None for d in dims)
        if None not in want and info.shape(node.input[1]) == want:
            proven.add(node.input[1])
    return frozenset(proven)


def add_loss_scaling(training: onnx.ModelProto, proven: Iterable[str] = ()) -> None:
    """Unscale each gradient before its accumulator (checking it has the parameter's shape,
    unless ``proven`` names it: :func:`proven_gradients`) and add the ``all_finite`` output.

    The accumulators move to the end of the node list: they now read the
    unscaled gradients, which are computed after every gradient exists.
    """
    proven = frozenset(proven)
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
    sums, raw_sums = [], []
    for acc in accumulators:
        grad, buffer = acc.input[1], acc.input[0]
        if grad in proven:
            # Its shape is the buffer's by construction: no runtime check.  The finite check sums the
            # gradient before the unscale (the sum of sums is unscaled once, below), so that the
            # unscale's Mul is read by the accumulator alone: the lowering computes it inside the
            # accumulators' If, where it writes the new buffer directly on a reset step.
            unscaled, total = names(f"{grad}.unscaled"), names(f"{grad}.sum")
            added += [helper.make_node("ReduceSum", [grad], [total], keepdims=0, name=names(f"onnxmp/ReduceSum/{grad}")),
                      helper.make_node("Mul", [grad, unscale], [unscaled], name=names(f"onnxmp/unscale/{grad}"))]
            raw_sums.append(total)
            acc.input[1] = unscaled
            continue
        scaled = names(f"{grad}.unscaled_any_shape")
        added.append(helper.make_node("Mul", [grad, unscale], [scaled], name=names(f"onnxmp/unscale/{grad}")))
        # InPlaceAccumulatorV2 does not check shapes: a gradient ORT did not sum back over a
        # broadcast would be written past the end of the buffer (heap corruption).  The Reshape
        # to the buffer's shape fails cleanly instead, in the node GRAD_SHAPE names.
        shape, unscaled = names(f"{grad}.shape"), names(f"{grad}.unscaled")
        param = buffer_parameter(buffer) or grad
        added += [helper.make_node("Shape", [buffer], [shape], name=names(f"onnxmp/Shape/{grad}")),
                  helper.make_node("Reshape", [scaled, shape], [unscaled], name=names(f"{GRAD_SHAPE}{param}"))]
        total = names(f"{grad}.unscaled.sum")
        added.append(helper.make_node("ReduceSum", [unscaled], [total], keepdims=0,
                                      name=names(f"onnxmp/ReduceSum/{grad}")))
        sums.append(total)
        acc.input[1] = unscaled
    # A sum of sums is non-finite iff some element is (or the sum overflows
    # float32, which also deserves a skipped step).
    grad_sum, is_inf, is_nan, bad = (names(f"onnxmp/{n}") for n in ("grad_sum", "is_inf", "is_nan", "non_finite"))
    if raw_sums:
        raw, raw_unscaled = names("onnxmp/raw_grad_sum"), names("onnxmp/raw_grad_sum_unscaled")
        added += [helper.make_node("Sum", raw_sums, [raw], name=names("onnxmp/Sum_raw")),
                  helper.make_node("Mul", [raw, unscale], [raw_unscaled], name=names("onnxmp/Mul_raw_sum"))]
        sums.append(raw_unscaled)
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
    n_user = next(i for i, v in enumerate(outputs) if is_accumulation_out(v.name))
    graph.ClearField("output")
    graph.output.extend([*outputs[:n_user], helper.make_tensor_value_info(ALL_FINITE, TensorProto.BOOL, []),
                         *outputs[n_user:]])
