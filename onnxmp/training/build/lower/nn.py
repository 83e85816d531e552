"""Lowerings of ORT's layer gradients and the training graph's state op (``training_ops/cpu/nn``,
``loss``, ``optimizer``): LayerNormalizationGrad, ConvGrad, SoftmaxCrossEntropyLossGrad,
InPlaceAccumulatorV2."""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from onnxmp.errors import OnnxMPError
from onnxmp.training.build.lower._emit import Emit, int64_fill


def _axis_start(e: Emit, axis: int, rank: str) -> str:
    """``axis`` as a non-negative int64 scalar for a tensor of rank ``rank`` (1-D)."""
    return e.op("Squeeze", [e.ints([axis]) if axis >= 0 else e.op("Add", [rank, e.ints([axis])])])


def layer_normalization_grad(e: Emit) -> None:
    """LayerNormalizationGrad(dY, X, scale, mean, inv_std_dev; axis=-1) -> dX, dscale, dbias.

    x_hat = (X - mean) * inv_std over the axes from ``axis`` on; with g = dY * scale,
    dX = inv_std * (g - mean(g) - x_hat * mean(g * x_hat)); dscale = sum(dY * x_hat) and
    dbias = sum(dY) over the leading axes.  In float32, as ORT's kernels accumulate."""
    dy, x, scale = (e.wide(e.input(i)) for i in range(3))
    mean, inv_std = e.wide(e.input(3)), e.wide(e.input(4))
    rank = e.rank(e.input(1))
    start, end = _axis_start(e, e.attr("axis", -1), rank), e.op("Squeeze", [rank])
    leading = e.op("Range", [e.ints(0), start, e.ints(1)])
    trailing = e.op("Range", [start, end, e.ints(1)])
    x_hat = e.op("Mul", [e.op("Sub", [x, mean]), inv_std])
    scale_type = e.dtype(e.input(2))
    if e.output(2):
        e.result(e.sum(dy, leading, keepdims=0), scale_type, e.output(2))
    if e.output(1):
        e.result(e.sum(e.op("Mul", [dy, x_hat]), leading, keepdims=0), scale_type, e.output(1))
    if e.output(0):
        g = e.op("Mul", [dy, scale])
        count = e.cast(e.op("Div", [e.op("Size", [x]), e.op("Size", [mean])]), TensorProto.FLOAT)
        mean_g = e.op("Div", [e.sum(g, trailing), count])
        mean_gx = e.op("Div", [e.sum(e.op("Mul", [g, x_hat]), trailing), count])
        dx = e.op("Mul", [inv_std, e.op("Sub", [e.op("Sub", [g, mean_g]), e.op("Mul", [x_hat, mean_gx])])])
        e.result(dx, e.dtype(e.input(1)), e.output(0))


# ConvTranspose and Conv have CUDA kernels for float16 but not bfloat16 (onnxmp/data/ort_kernels.json).
_CONV_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16})


def conv_grad(e: Emit) -> None:
    """ConvGrad(dY, X, W; Conv's attributes) -> dX, dW, dB.

    dX: ConvTranspose of dY by W with no padding, padded at the end (a stride that did not
    divide the input leaves rows no output read) and cut to X's extent after the start pads.
    dW: a Conv whose batch is X's channels and whose filters are dY's, per group, with
    stride and dilation exchanged, cut to the kernel's size.  dB: dY summed over batch and space.
    """
    auto_pad = e.attr("auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID"):
        raise OnnxMPError(f"cannot lower ConvGrad (node {e.scope!r}) with auto_pad={auto_pad}",
                          "re-export the model with explicit pads (torch.onnx does)")
    kernel = list(e.attr("kernel_shape", []))
    if not kernel:
        raise OnnxMPError(f"cannot lower ConvGrad (node {e.scope!r}) without kernel_shape",
                          "this is an onnxmp bug; please report it with the model")
    k = len(kernel)
    strides = list(e.attr("strides", [1] * k))
    dilations = list(e.attr("dilations", [1] * k))
    pads = list(e.attr("pads", [0] * (2 * k))) if auto_pad == "NOTSET" else [0] * (2 * k)
    group = int(e.attr("group", 1))
    dy_raw, x_raw, w_raw = e.input(0), e.input(1), e.input(2)
    elem = e.dtype(dy_raw)
    compute = elem if elem in _CONV_TYPES else TensorProto.FLOAT
    dy, x, w = (e.cast(v, compute) if e.dtype(v) != compute else v for v in (dy_raw, x_raw, w_raw))
    spatial = list(range(2, 2 + k))
    if e.output(0):
        full = e.op("ConvTranspose", [dy, w], group=group, strides=strides, dilations=dilations,
                    kernel_shape=kernel)
        extent = e.op("Slice", [e.op("Shape", [x]), e.ints([2]), e.ints([2 + k])])
        have = e.op("Slice", [e.op("Shape", [full]), e.ints([2]), e.ints([2 + k])])
        short = e.op("Sub", [e.op("Add", [extent, e.ints([pads[i] + pads[i + k] for i in range(k)])]), have])
        padded = e.op("Pad", [full, e.op("Concat", [e.ints([0] * (2 + k) + [0, 0]), short], axis=0)])
        begin = e.ints(pads[:k])
        dx = e.op("Slice", [padded, begin, e.op("Add", [begin, extent]), e.ints(spatial)])
        e.types[dx] = compute
        e.result(dx, e.dtype(x_raw), e.output(0))
    if e.output(1):
        shape_x, shape_dy = e.op("Shape", [x]), e.op("Shape", [dy])

        def grouped(shape: str, perm: list[int], value: str) -> str:
            # [A, C, S...] -> [A, group, C / group, S...] -> perm -> merge the first two axes of the result
            a, c = e.op("Slice", [shape, e.ints([0]), e.ints([1])]), e.op("Slice", [shape, e.ints([1]), e.ints([2])])
            rest = e.op("Slice", [shape, e.ints([2]), e.ints([2 + k])])
            split = e.op("Concat", [a, e.ints([group]), e.op("Div", [c, e.ints([group])]), rest], axis=0)
            moved = e.op("Transpose", [e.op("Reshape", [value, split])], perm=perm)
            return e.op("Reshape", [moved, e.op("Concat", [e.ints([0, -1]), rest], axis=0)])

        # X as [C/g, g*N, S...]: batch = input channels of a group, channels = (group, sample).
        xt = grouped(shape_x, [2, 1, 0, *range(3, 3 + k)], x)
        # dY as filters [g*Co/g, N, S...]: out channels in W's order, one input channel per sample.
        dyt = e.op("Reshape", [e.op("Transpose", [e.op("Reshape", [dy, e.op("Concat", [
            e.op("Slice", [shape_dy, e.ints([0]), e.ints([1])]), e.ints([group, -1]),
            e.op("Slice", [shape_dy, e.ints([2]), e.ints([2 + k])])], axis=0)])], perm=[1, 2, 0, *range(3, 3 + k)]),
            e.op("Concat", [e.ints([-1]), e.op("Slice", [shape_dy, e.ints([0]), e.ints([1])]),
                            e.op("Slice", [shape_dy, e.ints([2]), e.ints([2 + k])])], axis=0)])
        corr = e.op("Conv", [xt, dyt], group=group, strides=dilations, dilations=strides, pads=pads)
        cut = e.op("Slice", [corr, e.ints([0] * k), e.ints(kernel), e.ints(spatial)])
        dw = e.op("Transpose", [cut], perm=[1, 0, *spatial])
        e.types[dw] = compute
        e.result(dw, e.dtype(w_raw), e.output(1))
    if e.output(2):
        db = e.op("ReduceSum", [dy, e.ints([0, *spatial])], keepdims=0)
        e.types[db] = compute
        e.result(db, e.types.get(e.output(2)) or e.dtype(w_raw), e.output(2))


def softmax_cross_entropy_loss_grad(e: Emit) -> None:
    """SoftmaxCrossEntropyLossGrad(dY, log_prob, label[, weight]; reduction="mean", ignore_index)
    -> d_logits = (softmax - one_hot(label)) * w * dY / denominator, over classes on axis 1.

    w is weight[label] (1 without weights) and 0 where label == ignore_index; the mean's
    denominator is the sum of w (ORT's kernel), the sum's 1; "none" multiplies by dY per row."""
    dy_raw, log_prob_raw, label = e.input(0), e.input(1), e.input(2)
    weight = e.input(3)
    reduction = e.attr("reduction", "mean")
    if reduction not in ("mean", "sum", "none"):
        raise OnnxMPError(f"cannot lower SoftmaxCrossEntropyLossGrad (node {e.scope!r}): reduction {reduction!r}")
    dy, log_prob = e.wide(dy_raw), e.wide(log_prob_raw)
    label = e.cast(label, TensorProto.INT64)
    rank = e.rank(log_prob)
    # classes as [1, C, 1...] against label as [N, 1, d...]
    classes = e.op("Gather", [e.op("Shape", [log_prob]), e.ints(1)], axis=0)
    ones = e.op("ConstantOfShape", [e.op("Sub", [rank, e.ints([2])])], value=int64_fill(1))
    class_ids = e.op("Reshape", [e.op("Range", [e.ints(0), classes, e.ints(1)]),
                                 e.op("Concat", [e.ints([1, -1]), ones], axis=0)])
    label1 = e.op("Unsqueeze", [label, e.ints([1])])
    one_hot = e.cast(e.op("Equal", [class_ids, label1]), TensorProto.FLOAT)
    ignore = e.attr("ignore_index", None)
    valid = e.op("Not", [e.op("Equal", [label, e.ints(ignore)])]) if ignore is not None else None
    if weight:
        safe = e.op("Where", [valid, label, e.ints(0)]) if valid is not None else label
        w = e.op("Gather", [e.wide(weight), safe], axis=0)
        if valid is not None:
            w = e.op("Mul", [w, e.cast(valid, TensorProto.FLOAT)])
    else:
        w = e.cast(valid, TensorProto.FLOAT) if valid is not None else None
    if reduction == "none":
        factor = e.op("Mul", [w, dy]) if w is not None else dy
    else:
        factor = dy
        if w is not None:
            factor = e.op("Mul", [w, dy])
        if reduction == "mean":
            denominator = (e.op("ReduceSum", [w], keepdims=0) if w is not None
                           else e.cast(e.op("Size", [label]), TensorProto.FLOAT))
            # Every label ignored: ORT's kernel gives zeros (every w is 0), not 0 / 0.
            empty = e.op("Equal", [denominator, e.scalar(0.0)])
            factor = e.op("Div", [factor, e.op("Where", [empty, e.scalar(1.0), denominator])])
    d_logits = e.op("Mul", [e.op("Sub", [e.op("Exp", [log_prob]), one_hot]), e.op("Unsqueeze", [factor, e.ints([1])])
                            if w is not None or reduction == "none" else factor])
    e.result(d_logits, e.dtype(log_prob_raw), e.output(0))


def in_place_accumulator_v2(e: Emit) -> None:
    """InPlaceAccumulatorV2(buffer, value[, overwrite]) -> the NEW buffer value (the portable
    contract, docs/training.md): ``overwrite ? value : buffer + value``.  ORT's kernel writes that
    into the buffer and outputs a bool flag; a portable engine feeds this output back as the buffer."""
    buffer, value, overwrite = e.input(0), e.input(1), e.input(2)
    elem = e.dtype(buffer)
    if e.dtype(value) != elem:
        value = e.cast(value, elem)
    total = e.op("Add", [buffer, value])
    out = e.output(0)
    if overwrite:
        flag = e.op("Reshape", [overwrite, e.ints([])])
        e.op("Where", [flag, value, total], out)
    else:
        e.op("Identity", [total], out)
    e.types[out] = elem
    known = e.shapes.get(buffer)
    e.retyped[out] = known if known is not None else helper.make_tensor_type_proto(elem, None)
    if e.output(1):
        e.op("Identity", [out], e.output(1))
        e.types[e.output(1)] = elem
        e.retyped[e.output(1)] = e.retyped[out]


def accumulator_batch(graph: onnx.GraphProto) -> tuple[list[onnx.NodeProto], dict[str, onnx.NodeProto]]:
    """The ``InPlaceAccumulatorV2`` nodes of ``graph`` that :func:`in_place_accumulators` lowers
    together: those reading the most common reset flag, without the optional second output; none
    when fewer than two do (each is then lowered on its own).  Also the float ``Mul`` nodes whose
    output only such an accumulator reads (the unscale, ``unscale.add_loss_scaling``), by output:
    they move into the ``If``'s branches."""
    accumulators = [n for n in graph.node if n.op_type == "InPlaceAccumulatorV2" and len(n.input) > 2
                    and n.input[2] and not (len(n.output) > 1 and n.output[1])]
    flags = [n.input[2] for n in accumulators]
    if not flags:
        return [], {}
    flag = max(set(flags), key=flags.count)
    batch = [n for n in accumulators if n.input[2] == flag]
    if len(batch) < 2:
        return [], {}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in set(node.input):
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    values = {n.input[1] for n in batch}
    scaled = {n.output[0]: n for n in graph.node if n.op_type == "Mul" and not n.domain and n.output[0] in values
              and readers.get(n.output[0]) == 1 and n.output[0] not in outputs}
    return batch, scaled


def in_place_accumulators(e: Emit, batch: list[onnx.NodeProto], scaled: dict[str, onnx.NodeProto]) -> None:
    """Every accumulator of ``batch`` (one reset flag) lowered as one ``If`` on the flag: its then
    branch passes the new gradients through, its else branch adds them to the buffers.  A gradient
    that is a ``Mul`` read by its accumulator alone (``scaled``: the unscale by
    ``grad_weight / loss_scale``) is multiplied inside the branches.

    The per-node lowering (:func:`in_place_accumulator_v2`) computes ``buffer + value`` for every
    parameter and then picks by ``Where``: two passes over every gradient, and the sum thrown
    away on a reset step.  The flag is one bool for the whole step, so one branch decides them all;
    on a reset step (every step without accumulation) the unscale writes the new buffer directly.
    ``e`` emits for the last node of the batch, where every gradient exists."""
    then_nodes, else_nodes, then_out, else_out, outputs = [], [], [], [], []
    for node in batch:
        buffer, value, out = node.input[0], node.input[1], node.output[0]
        elem = e.types.get(buffer) or e.dtype(buffer)
        known = e.shapes.get(buffer)
        declared = known if known is not None else helper.make_tensor_type_proto(elem, None)
        passed, added = e.names(f"{out}/reset"), e.names(f"{out}/accumulated")
        mul = scaled.get(value)
        if mul is not None and e.dtype(value) == elem:
            then_nodes.append(helper.make_node("Mul", list(mul.input), [passed], name=e.names(f"{out}/Mul")))
            product = e.names(f"{out}/value")
            else_nodes += [helper.make_node("Mul", list(mul.input), [product], name=e.names(f"{out}/Mul")),
                           helper.make_node("Add", [buffer, product], [added], name=e.names(f"{out}/Add"))]
        else:
            if mul is not None:  # typed otherwise: the Mul stays where it was
                scaled.pop(value)
            if e.dtype(value) != elem:
                value = e.cast(value, elem)
            then_nodes.append(helper.make_node("Identity", [value], [passed], name=e.names(f"{out}/Identity")))
            else_nodes.append(helper.make_node("Add", [buffer, value], [added], name=e.names(f"{out}/Add")))
        for branch, name in ((then_out, passed), (else_out, added)):
            info = onnx.ValueInfoProto(name=name)
            info.type.CopyFrom(declared)
            branch.append(info)
        outputs.append(out)
        e.types[out] = elem
        e.retyped[out] = declared
    # If takes a condition of one element, of any rank, so it reads the flag as it is: the CUDA EP
    # holds If's condition in host memory, and a Reshape here would run on the device and copy its
    # result back to the host inside every step.
    flag = batch[0].input[2]
    then_branch = helper.make_graph(then_nodes, e.names("accumulators/reset"), [], then_out)
    else_branch = helper.make_graph(else_nodes, e.names("accumulators/accumulate"), [], else_out)
    e.nodes.append(helper.make_node("If", [flag], outputs, name=e.names("accumulators/If"),
                                    then_branch=then_branch, else_branch=else_branch))
