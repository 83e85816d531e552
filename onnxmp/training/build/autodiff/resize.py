"""The gradient of Resize (nearest, linear, cubic; every coordinate transform but tf_crop_and_resize).

These modes are separable: along each resized axis the op is a fixed linear map ``A`` of shape
[out, in], which this rule measures at build time by running the forward op itself (onnx's
reference implementation, the forward's own attributes and scale) on the basis vectors.  The
gradient is then ``A^T`` applied along each axis: a MatMul per resized axis, no scatter, exact for
whatever rounding and coordinate rules the forward uses.  Static extents on the resized axes only.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxmp.training.build.autodiff.context import Vjp
from onnxmp.training.build.autodiff.context import numpy_type


def _axis_matrix(c: Vjp, axis: int, size_in: int, size_out: int, scale: float | None) -> np.ndarray:
    """The [out, in] matrix of the forward Resize along ``axis``: its response to each basis vector."""
    from onnx.reference import ReferenceEvaluator

    rank = c.rank(c.x(0))
    shape = [1] * rank
    shape[0], shape[axis] = size_in, size_in
    basis = np.zeros(shape, np.float64)
    for j in range(size_in):
        index = [0] * rank
        index[0], index[axis] = j, j
        basis[tuple(index)] = 1.0
    attrs = {a.name: helper.get_attribute_value(a) for a in c.node.attribute if a.name != "axes"}
    inputs = ["x", "", ""]
    inits = []
    if scale is not None:
        scales = np.ones(rank, np.float32)
        scales[axis] = scale
        inits.append(numpy_helper.from_array(scales, "scales"))
        inputs[2] = "scales"
    else:
        sizes = np.array(shape, np.int64)
        sizes[axis] = size_out
        inits.append(numpy_helper.from_array(sizes, "sizes"))
        inputs = ["x", "", "", "sizes"]
    node = helper.make_node("Resize", inputs, ["y"], **attrs)
    graph = helper.make_graph([node], "resize_matrix", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", c.info.opset)])
    (out,) = ReferenceEvaluator(model).run(None, {"x": basis})
    moved = np.moveaxis(out, axis, -1).reshape(size_in, -1)  # [in (basis), out]
    if moved.shape[1] != size_out:
        c.fail(f"its output extent along axis {axis} is {moved.shape[1]}, not the {size_out} shape inference gives")
    return moved.T


def resize(c: Vjp) -> None:
    x, y, dy = c.x(0), c.y(0), c.dy()
    if c.attr("coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize":
        c.fail("Resize with tf_crop_and_resize")
    if c.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        c.fail("Resize with a keep_aspect_ratio_policy", "export the Resize with explicit sizes or scales")
    shape_in, shape_out = c.shape(x), c.shape(y)
    if shape_in is None or shape_out is None:
        c.fail("the ranks of its input or output are unknown")
    scales = c.info.value(c.x(2)) if len(c.node.input) > 2 and c.x(2) else None
    sizes = c.info.value(c.x(3)) if len(c.node.input) > 3 and c.x(3) else None
    rank = len(shape_in)
    if scales is None and sizes is None and len(c.node.input) > 3 and c.x(3) and c.attr("axes") is None:
        # sizes = Concat(Shape(x)[0:2], [H, W]) (TorchScript's interpolate to a size): the symbolic
        # value tells the axes kept (the same dim as the input's) from the resized ones (constants)
        symbolic = c.info.symbolic.get(c.x(3))
        if symbolic is not None and len(symbolic) == rank and all(
                d is not None and d == shape_in[a] or isinstance(d, int) and not isinstance(d, bool)
                for a, d in enumerate(symbolic)):
            sizes = np.array(symbolic, dtype=object)
    if scales is None and sizes is None:
        c.fail("its scales or sizes are computed", "export the Resize with constant scales or sizes")
    listed = c.attr("axes")
    if listed is not None:  # Resize-18: scales/sizes for these axes only
        full = np.ones(rank) if scales is not None and scales.size else np.array(shape_in, dtype=object)
        for k, a in enumerate(listed):
            full[a % rank] = (scales if scales is not None and scales.size else sizes)[k]
        if scales is not None and scales.size:
            scales = full
        else:
            sizes = full
    per_axis = np.asarray(scales, np.float64) if scales is not None and scales.size else None
    resized = [a for a in range(rank) if (per_axis[a] != 1.0 if per_axis is not None else sizes[a] != shape_in[a])]
    if 0 in resized:
        c.fail("a Resize of the first axis")
    grad = dy
    elem = c.elem(dy)

    def constant(matrix: np.ndarray) -> str:
        return c.emit.constant(matrix.astype(numpy_type(elem)), elem=elem)

    for a in resized:
        size_in, size_out = shape_in[a], shape_out[a]
        if not isinstance(size_in, int) or not isinstance(size_out, int):
            c.fail(f"symbolic extents along resized axis {a}", "export the model with static sizes there")
        matrix = _axis_matrix(c, a, size_in, size_out, float(per_axis[a]) if per_axis is not None else None)
        if a == rank - 1:
            grad = c.op("MatMul", grad, constant(matrix))  # [.., out] @ [out, in]
        elif a == rank - 2:
            grad = c.op("MatMul", constant(matrix.T), grad)  # [in, out] @ [.., out, W]
        else:
            perm = [i for i in range(rank) if i != a] + [a]
            moved = c.op("MatMul", c.transpose(grad, perm), constant(matrix))
            grad = c.transpose(moved, [perm.index(i) for i in range(rank)])
    c.set(0, grad)


RULES = {"Resize": resize}
