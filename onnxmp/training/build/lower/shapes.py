"""Lowerings of ORT's shape, gather/scatter and concat/split training ops (``training_ops/cpu/tensor``).

Those that only move values run in the gradient's own type.  Those that add (the scatters with
reduction="add") add in float32 and round once: the CPU build has no float16 ScatterElements or
ScatterND with reduction="add", and ORT's CUDA kernels accumulate low-precision gradients in float.
"""
from __future__ import annotations

from onnx import TensorProto

from onnxmp.errors import OnnxMPError
from onnxmp.training.build.lower._emit import SCATTER_ADD_OPSET, Emit, int64_fill


def _padded(e: Emit, shape: str, rank: str) -> str:
    """``shape`` (1-D int64) left-padded with ones to length ``rank`` (1-D, one element)."""
    missing = e.op("Sub", [rank, e.op("Shape", [shape])])
    ones = e.op("ConstantOfShape", [missing], value=int64_fill(1))
    return e.op("Concat", [ones, shape], axis=0)


def reduce_axes(e: Emit, shape: str, other: str) -> str:
    """The axes (of the broadcast result, int64 1-D, descending as ORT's BroadcastGradientArgs
    lists them) along which a tensor of ``shape`` was broadcast against one of ``other``: every
    axis it lacks, and those where its dim is 1 and the other's is not (both 1: none)."""
    rank = e.op("Max", [e.op("Shape", [shape]), e.op("Shape", [other])])
    mine, theirs = _padded(e, shape, rank), _padded(e, other, rank)
    one = e.ints([1])
    positions = e.op("Range", [e.ints(0), e.op("Squeeze", [rank]), e.ints(1)])
    missing = e.op("Less", [positions, e.op("Sub", [rank, e.op("Shape", [shape])])])
    stretched = e.op("And", [e.op("Equal", [mine, one]), e.op("Not", [e.op("Equal", [theirs, one])])])
    broadcast = e.op("Or", [missing, stretched])
    backwards = e.op("Slice", [broadcast, e.ints([-1]), e.ints([-2**62]), e.ints([0]), e.ints([-1])])
    last = e.op("Sub", [e.op("Squeeze", [rank]), e.ints(1)])
    return e.op("Compress", [e.op("Range", [last, e.ints(-1), e.ints(-1)]), backwards], axis=0)


def sum_to(e: Emit, x: str, shape: str, other: str) -> str:
    """``x`` (the broadcast of tensors of ``shape`` and ``other``) summed back to ``shape``."""
    return e.op("Reshape", [e.sum(x, reduce_axes(e, shape, other)), shape])


def broadcast_gradient_args(e: Emit) -> None:
    """BroadcastGradientArgs(a_shape, b_shape) -> (a_axes, b_axes): the axes each input's gradient
    is summed over, numbered in the broadcast result, from the last (ORT's kernel walks them so)."""
    a, b = e.input(0), e.input(1)
    for output, (mine, theirs) in zip(e.node.output, ((a, b), (b, a))):
        if output:
            e.op("Identity", [reduce_axes(e, mine, theirs)], output)
            e.types[output] = TensorProto.INT64


def concat_training(e: Emit) -> None:
    """ConcatTraining(inputs...; axis) -> (concat, per_input_length): Concat, and each input's
    length along ``axis`` (int64), which SplitTraining of the gradient reads."""
    axis = e.attr("axis", 0)
    inputs = list(e.node.input)
    e.op("Concat", inputs, e.output(0), axis=axis)
    if e.output(1):
        lengths = [e.op("Gather", [e.op("Shape", [x]), e.ints([axis])], axis=0) for x in inputs]
        e.op("Concat", lengths, e.output(1), axis=0)
        e.types[e.output(1)] = TensorProto.INT64


def split_training(e: Emit) -> None:
    """SplitTraining(input, split; axis=0): Split with the lengths as an input (opset 13 on)."""
    outputs = [o for o in e.node.output]
    e.ops("Split", [e.input(0), e.input(1)], outputs, axis=e.attr("axis", 0))


def reduce_sum_training(e: Emit) -> None:
    """ReduceSumTraining(data, axes; keepdims=1, noop_with_empty_axes=0): ReduceSum-13's semantics,
    summed in float32 (rounded once) for float16/bfloat16."""
    total = e.op("ReduceSum", [e.wide(e.input(0)), e.input(1)], keepdims=e.attr("keepdims", 1),
                 noop_with_empty_axes=e.attr("noop_with_empty_axes", 0))
    e.result(total, e.dtype(e.input(0)), e.output(0))


def gather_grad(e: Emit) -> None:
    """GatherGrad(shape, indices, dY; axis=0): the rows of dY added into zeros of ``shape`` at
    ``indices`` along ``axis``.  A ScatterElements(add) over [before, rows, after] views, which
    adds in index order (ORT's CPU kernel adds from a thread pool: run-to-run differences)."""
    shape, indices, dy = e.input(0), e.input(1), e.input(2)
    axis = e.attr("axis", 0)
    e.needs_opset(SCATTER_ADD_OPSET)
    start = e.ints([axis]) if axis >= 0 else e.op("Add", [e.op("Shape", [shape]), e.ints([axis])])
    stop = e.op("Add", [start, e.ints([1])])

    def product(begin: str, end: str) -> str:
        piece = e.op("Slice", [shape, begin, end])
        return e.op("ReduceProd", [e.op("Concat", [e.ints([1]), piece], axis=0)], keepdims=1)

    before, after = product(e.ints([0]), start), product(stop, e.ints([2**62]))
    rows = e.op("Slice", [shape, start, stop])
    count = e.op("Reshape", [e.op("Size", [indices]), e.ints([1])])
    dy_shape = e.op("Concat", [before, count, after], axis=0)
    dy3 = e.op("Reshape", [e.wide(dy), dy_shape])
    idx = e.op("Reshape", [indices, e.op("Concat", [e.ints([1]), count, e.ints([1])], axis=0)])
    idx = e.op("Expand", [e.cast(idx, TensorProto.INT64), dy_shape])
    zeros = e.zeros(e.op("Concat", [before, rows, after], axis=0), TensorProto.FLOAT)
    summed = e.op("ScatterElements", [zeros, idx, dy3], axis=1, reduction="add")
    e.result(e.op("Reshape", [summed, shape]), e.dtype(dy), e.output(0))


def gather_elements_grad(e: Emit) -> None:
    """GatherElementsGrad(dY, shape, indices; axis=0): ScatterElements(add) of dY into zeros."""
    dy, shape, indices = e.input(0), e.input(1), e.input(2)
    e.needs_opset(SCATTER_ADD_OPSET)
    zeros = e.zeros(shape, TensorProto.FLOAT)
    summed = e.op("ScatterElements", [zeros, e.cast(indices, TensorProto.INT64), e.wide(dy)],
                  axis=e.attr("axis", 0), reduction="add")
    e.result(summed, e.dtype(dy), e.output(0))


def gather_nd_grad(e: Emit) -> None:
    """GatherNDGrad(shape, indices, update; batch_dims=0): the update added into zeros at the index
    rows (negative indices count from the end, as GatherND's)."""
    shape, indices, update = e.input(0), e.input(1), e.input(2)
    if e.attr("batch_dims", 0):
        raise OnnxMPError(f"cannot lower GatherNDGrad (node {e.scope!r}) with batch_dims="
                          f"{e.attr('batch_dims', 0)}: only batch_dims=0 has a standard equivalent here",
                          "re-export the model without batched GatherND")
    e.needs_opset(SCATTER_ADD_OPSET)
    indices = e.cast(indices, TensorProto.INT64)
    declared = e.shapes.get(e.input(1))
    dims = declared.tensor_type.shape.dim if declared is not None else []
    depth = dims[-1].dim_value if len(dims) else 0
    if not depth:  # the index depth is not declared: ScatterND(add) takes any
        summed = e.op("ScatterND", [e.zeros(shape, TensorProto.FLOAT), indices, e.wide(update)], reduction="add")
        e.result(summed, e.dtype(update), e.output(0))
        return
    # With the depth k known, each index row becomes one flat row of the first k axes, and the
    # update a [rows, rest] matrix added into zeros [prod(first k), rest] by ScatterElements(add).
    flat = None
    for j in range(depth):
        dim = e.op("Squeeze", [e.op("Slice", [shape, e.ints([j]), e.ints([j + 1])])])
        column = e.op("Mod", [e.op("Add", [e.op("Gather", [indices, e.ints(j)], axis=-1), dim]), dim])
        flat = column if flat is None else e.op("Add", [e.op("Mul", [flat, dim]), column])
    lead = e.op("ReduceProd", [e.op("Slice", [shape, e.ints([0]), e.ints([depth])])], keepdims=1)
    rest = e.op("ReduceProd", [e.op("Concat", [e.ints([1]), e.op("Slice", [shape, e.ints([depth]),
                                                                            e.ints([2**62])])], axis=0)], keepdims=1)
    table = e.op("Concat", [e.ints([-1]), rest], axis=0)
    values = e.op("Reshape", [e.wide(update), table])
    rows = e.op("Expand", [e.op("Reshape", [flat, e.ints([-1, 1])]), e.op("Shape", [values])])
    zeros = e.zeros(e.op("Concat", [lead, rest], axis=0), TensorProto.FLOAT)
    summed = e.op("ScatterElements", [zeros, rows, values], axis=0, reduction="add")
    e.result(e.op("Reshape", [summed, shape]), e.dtype(update), e.output(0))


def slice_grad(e: Emit) -> None:
    """SliceGrad(dY, shape, starts, ends[, axes, steps]): dY written into zeros of ``shape`` where
    the Slice read.  The positions come from slicing an iota of the input's flat indices the same
    way, so any steps (negative ones too) and clamped bounds behave as the forward Slice did."""
    dy, shape = e.input(0), e.input(1)
    count = e.op("ReduceProd", [shape], keepdims=1)
    iota = e.op("Reshape", [e.op("Range", [e.ints(0), e.op("Squeeze", [count]), e.ints(1)]), shape])
    taken = e.op("Slice", [iota, *[i for i in e.node.input[2:]]])
    positions = e.op("Reshape", [taken, e.ints([-1])])
    # ScatterElements, not ScatterND: CUDA registers ScatterElements at every opset the graphs use.
    flat = e.op("ScatterElements", [e.zeros(count, e.dtype(dy)), positions, e.op("Reshape", [dy, e.ints([-1])])],
                axis=0)
    e.op("Reshape", [flat, shape], e.output(0))
    e.types[e.output(0)] = e.dtype(dy)


def max_pool_grad(e: Emit) -> None:
    """MaxPoolGrad(dY, Indices) (ORT registers it in the ai.onnx domain, which has no such op):
    dY added into zeros at MaxPool's flat Indices.  dX's shape is the node's declared output
    shape with dY's batch, as ORT's kernel reads it."""
    dy, indices = e.input(0), e.input(1)
    declared = e.shapes.get(e.output(0))
    dims = [d.dim_value for d in declared.tensor_type.shape.dim] if declared is not None else []
    if not dims or not all(dims[1:]):
        raise OnnxMPError(f"cannot lower MaxPoolGrad (node {e.scope!r}): its output's shape is not declared",
                          "export the model with fixed channel and spatial sizes")
    e.needs_opset(SCATTER_ADD_OPSET)
    shape = e.op("Concat", [e.op("Slice", [e.op("Shape", [dy]), e.ints([0]), e.ints([1])]), e.ints(dims[1:])], axis=0)
    count = e.op("ReduceProd", [shape], keepdims=1)
    flat = e.op("ScatterElements", [e.zeros(count, TensorProto.FLOAT), e.op("Reshape", [indices, e.ints([-1])]),
                                    e.op("Reshape", [e.wide(dy), e.ints([-1])])], axis=0, reduction="add")
    e.result(e.op("Reshape", [flat, shape]), e.dtype(dy), e.output(0))
