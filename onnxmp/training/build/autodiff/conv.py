"""Gradients of Conv (grouped, dilated, strided; 1-D to 3-D), MaxPool and AveragePool.

Conv's input gradient is one ConvTranspose (its output_padding computed at build time when the
spatial extents are static or the strides are 1); its weight gradient one Conv with the batch
and channel axes swapped (strides and dilations exchanged), cropped to the kernel by a constant
Slice; for a 1x1 Conv without pads, one Einsum over the batch and positions; for a float32 Conv
of static extents and 8 or more input channels, X's patches (one Gather of X channels-last) and
one Einsum with dY, as onnxruntime's ConvGrad computes it.  MaxPool's gradient scatters into the
forward's own Indices output (added when absent); a ReLU before it masks the pooled gradient
before the scatter (elementwise.relu)."""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from onnxmp import targets
from onnxmp.training.build.autodiff.context import Vjp
from onnxmp.training.build.autodiff.emit import INT64_MAX

INT64 = TensorProto.INT64


def _geometry(c: Vjp, x: str, kernel: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(strides, dilations, pads begin, pads end) with auto_pad resolved."""
    n = len(kernel)
    strides = list(c.attr("strides") or [1] * n)
    dilations = list(c.attr("dilations") or [1] * n)
    pads = list(c.attr("pads") or [0] * (2 * n))
    auto = c.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        shape = c.shape(x)
        spatial = shape[2:] if shape is not None else [None] * n
        if not all(isinstance(d, int) for d in spatial):
            c.fail(f"auto_pad {auto} with symbolic spatial extents", "export the model with explicit pads")
        pads = [0] * (2 * n)
        for i, (d, k, s, dl) in enumerate(zip(spatial, kernel, strides, dilations)):
            total = max((math.ceil(d / s) - 1) * s + (k - 1) * dl + 1 - d, 0)
            small = total // 2
            pads[i], pads[n + i] = (small, total - small) if auto == "SAME_UPPER" else (total - small, small)
    elif auto == "VALID":
        pads = [0] * (2 * n)
    return strides, dilations, pads[:n], pads[n:]


def _spatial(c: Vjp, name: str, n: int) -> list:
    shape = c.shape(name)
    return list(shape[2:]) if shape is not None and len(shape) == n + 2 else [None] * n


def conv(c: Vjp) -> None:
    x, w, dy = c.x(0), c.x(1), c.dy()
    w_shape = c.info.static_shape(w)
    if w_shape is None:
        c.fail("its weight's shape is not static", "export the model with static convolution weights")
    kernel = list(c.attr("kernel_shape") or w_shape[2:])
    n = len(kernel)
    group = int(c.attr("group", 1))
    strides, dilations, begin, end = _geometry(c, x, kernel)
    axes = list(range(2, 2 + n))
    if c.needs(2):
        c.set(2, c.reduce("ReduceSum", dy, [0, *axes], 0))
    if c.needs(0):
        c.set(0, _input_grad(c, x, w, dy, kernel, strides, dilations, begin, end, group))
    if c.needs(1):
        c.set(1, _weight_grad(c, x, w_shape, dy, kernel, strides, dilations, begin, end, group))


def _input_grad(c, x, w, dy, kernel, strides, dilations, begin, end, group) -> str:
    n = len(kernel)
    sizes, outs = _spatial(c, x, n), _spatial(c, c.y(0), n)
    attrs = dict(strides=strides, dilations=dilations, pads=begin + end, group=group if group != 1 else None)
    if all(s == 1 for s in strides):
        return c.op("ConvTranspose", dy, w, **attrs)
    if all(isinstance(d, int) for d in sizes + outs):
        padding = [d - (s * (o - 1) + (k - 1) * dl + 1 - b - e)
                   for d, o, k, s, dl, b, e in zip(sizes, outs, kernel, strides, dilations, begin, end)]
        return c.op("ConvTranspose", dy, w, output_padding=padding if any(padding) else None, **attrs)
    # Symbolic extents with strides: the largest output, cropped to the input's runtime extents.
    c.runtime(f"Conv input gradient of {x} (strided, symbolic extents)")
    full = c.op("ConvTranspose", dy, w, output_padding=[s - 1 for s in strides], **attrs)
    ends = c.op("Slice", c.op("Shape", x, elem=INT64), c.ints([2]), c.ints([INT64_MAX]), elem=INT64)
    return c.op("Slice", full, c.ints([0] * n), ends, c.ints(list(range(2, 2 + n))))


def _weight_grad(c, x, w_shape, dy, kernel, strides, dilations, begin, end, group, like=None) -> str:
    """``like``: names shaped as ``x`` and ``dy`` are (the forward's input and output by default)."""
    x_like, dy_like = like or (x, c.y(0))
    n = len(kernel)
    swap = [1, 0, *range(2, 2 + n)]
    cout, cin_group = w_shape[0], w_shape[1]
    if group == 1 and like is None and all(k == 1 for k in kernel) and not any(begin + end):
        return _pointwise_weight_grad(c, x, w_shape, dy, strides)
    geometry = _patch_geometry(c, x, w_shape, kernel, strides, dilations, begin, end) \
        if group == 1 and like is None else None
    if geometry is not None:
        return _patch_weight_grad(c, x, w_shape, dy, kernel, strides, dilations, begin, end, *geometry)
    end = _unused_end(c, x_like, kernel, strides, dilations, begin, end)
    attrs = dict(strides=dilations, dilations=strides, pads=begin + end)
    if group == 1:
        grad = c.op("Conv", c.transpose(x, swap), c.transpose(dy, swap), **attrs)
        grad = _crop(c, grad, x_like, kernel, strides, dilations, begin, end)
        return c.transpose(grad, swap)
    keep = [0] * n
    if cin_group == 1:
        # Depthwise: [N, C, *S] -> [1, C*N, *S], a grouped conv by [C*m, N, *O].
        xs = c.op("Reshape", c.transpose(x, swap), c.ints([1, -1, *keep]))
        grad = c.op("Conv", xs, c.transpose(dy, swap), group=group, **attrs)   # [1, C*m, *K']
        grad = _crop(c, grad, x_like, kernel, strides, dilations, begin, end)
        return c.op("Reshape", grad, c.ints([cout, 1, *kernel]))
    # Grouped: x as [cin_group, G*N, *S], dy as [G*cout_group, N, *O], a conv of G groups.
    cout_group = cout // group
    xs = _regroup(c, x, c.shape(x_like), group, cin_group, n)
    dys = _regroup(c, dy, c.shape(dy_like), group, cout_group, n, kernel_layout=True)
    grad = c.op("Conv", xs, dys, group=group, **attrs)  # [cin_group, G*cout_group, *K']
    grad = _crop(c, grad, x_like, kernel, strides, dilations, begin, end)
    return c.transpose(grad, swap)


def _pointwise_weight_grad(c: Vjp, x: str, w_shape, dy: str, strides: list[int]) -> str:
    """A 1x1 Conv without pads is a matrix product over the channels at each (strided) position:
    its weight gradient is one Einsum of dY with X (sampled at the strides by one Slice), summed
    over the batch and positions, instead of the generic Conv between transposes.  A third operand,
    ones shaped [1] * n, gives the Einsum's output the kernel's unit axes: the weight's own shape
    without a Reshape (one node less per 1x1 Conv: MobileNetV2 has 35)."""
    n = len(strides)
    if any(s != 1 for s in strides):  # position i of Y reads X at i * stride
        x = c.op("Slice", x, c.ints([0] * n), c.ints([INT64_MAX] * n), c.ints(list(range(2, 2 + n))),
                 c.ints(list(strides)))
    c.emit.needs_opset(12)
    spatial = "xyz"[:n]
    units = "abd"[:n]
    ones = c.emit.constant(np.ones([1] * n, np.float32), "unit", elem=c.elem(dy))
    return c.op("Einsum", dy, x, ones, equation=f"nk{spatial},nc{spatial},{units}->kc{units}")


# The patches of one sample (positions x kernel positions x channels) at most this many elements
# (4 MiB): they exist for the whole batch at once, K times X, where ConvGrad holds one sample's.
PATCH_LIMIT = 1 << 20


def _patch_geometry(c: Vjp, x: str, w_shape, kernel, strides, dilations, begin, end):
    """(padded extents, output extents) when :func:`_patch_weight_grad` is the cheaper form, else
    None: float32, one group, static spatial extents, a kernel of more than one position and at
    least 8 input channels (each gathered block 32 bytes or more: ResNet's 3x3 convs of 16 and 32
    channels take 45-60% of the swapped Conv's time; its 7x7 stem of 3 channels, gathered 3
    floats at a time, 180%).  On the CPU target only: the CUDA EP runs the swapped Conv as cuDNN's
    own convolution (onnxruntime's ConvGrad there is cudnnConvolutionBackwardFilter), one kernel
    where the patches would be a 9x copy of X and five launches."""
    if targets.target(c.emit.target).provider != "CPUExecutionProvider":
        return None
    sizes = _spatial(c, x, len(kernel))
    if (c.elem(x) != TensorProto.FLOAT or not all(isinstance(d, int) for d in sizes)
            or int(np.prod(kernel)) < 2 or w_shape[1] < 8):
        return None
    padded = [d + b + e for d, b, e in zip(sizes, begin, end)]
    outs = [(p - (k - 1) * dl - 1) // s + 1 for p, k, s, dl in zip(padded, kernel, strides, dilations)]
    if min(outs) < 1 or int(np.prod(outs)) * int(np.prod(kernel)) * w_shape[1] > PATCH_LIMIT:
        return None
    return padded, outs


def _patch_weight_grad(c: Vjp, x: str, w_shape, dy: str, kernel, strides, dilations, begin, end,
                       padded, outs) -> str:
    """The weight gradient as onnxruntime's ConvGrad computes it, X's patches (im2col) times dY,
    in five standard ops: X channels-last and padded, [N, *S', C], flattened to [N, S, C]; one
    Gather of its positions by a constant table [*O, *K] (output position o, kernel position k:
    the input position o reads at k), [N, *O, *K, C], each gathered row C floats; one Einsum with
    dY over the batch and output positions, which lands on the weight's own layout [Cout, C, *K].
    On ResNet's 3x3 convs (batch 8, one thread) about half of the swapped Conv's time, whose
    matrix products are Cout x K over N*positions, narrow for onnxruntime's CPU GEMM; the Einsum
    (onnxruntime moves dY's batch beside its positions and runs one GEMM) costs what the Gemm
    between reshapes and transposes did, in 5 nodes where that form took 12."""
    n = len(kernel)
    channels = w_shape[1]
    last = [0, *range(2, 2 + n), 1]
    xp = c.transpose(x, last)
    if any(begin + end):  # a Pad of nothing would still copy X
        xp = c.op("Pad", xp, c.ints([0, *begin, 0, 0, *end, 0]))
    rows = c.op("Reshape", xp, c.ints([0, int(np.prod(padded)), channels]))
    grids = np.meshgrid(*[np.arange(o) for o in outs], *[np.arange(k) for k in kernel], indexing="ij")
    flat = np.zeros(grids[0].shape, np.int64)
    for a in range(n):
        flat = flat * padded[a] + grids[a] * strides[a] + grids[n + a] * dilations[a]
    patches = c.op("Gather", rows, c.emit.constant(flat, "patch_positions"), axis=1)
    at, within = "xyz"[:n], "hwd"[:n]  # output and kernel positions
    c.emit.needs_opset(12)
    return c.op("Einsum", dy, patches, equation=f"no{at},n{at}{within}c->oc{within}")


def _regroup(c: Vjp, t: str, shape, group: int, per_group: int, n: int, kernel_layout: bool = False) -> str:
    """``t`` (shaped ``shape``): [N, G*P, *S] -> [P, G*N, *S] (or, for the kernel, [G*P, N, *S])."""
    rest = list(range(3, 3 + n))
    perm = [1, 2, 0, *rest] if kernel_layout else [2, 1, 0, *rest]
    if shape is not None and all(isinstance(d, int) for d in shape):
        batch, spatial = shape[0], list(shape[2:])
        split = c.op("Reshape", t, c.ints([batch, group, per_group, *spatial]))
        target = [group * per_group, batch, *spatial] if kernel_layout else [per_group, group * batch, *spatial]
        return c.op("Reshape", c.transpose(split, perm), c.ints(target))
    c.runtime(f"grouped Conv weight gradient ({t} has symbolic dims)")
    full = c.op("Shape", t, elem=INT64)
    batch = c.op("Slice", full, c.ints([0]), c.ints([1]), elem=INT64)
    spatial = c.op("Slice", full, c.ints([2]), c.ints([INT64_MAX]), elem=INT64)
    split = c.op("Reshape", t, c.op("Concat", batch, c.ints([group, per_group]), spatial, axis=0, elem=INT64))
    if kernel_layout:
        target = c.op("Concat", c.ints([group * per_group]), batch, spatial, axis=0, elem=INT64)
    else:
        target = c.op("Concat", c.ints([per_group, -1]), spatial, axis=0, elem=INT64)
    return c.op("Reshape", c.transpose(split, perm), target)


def _unused_end(c: Vjp, x: str, kernel, strides, dilations, begin, end) -> list[int]:
    """The end pads less what the last stride leaves unread (static extents): the weight-gradient
    conv then produces exactly the kernel's extent, with no Slice."""
    sizes = _spatial(c, x, len(kernel))
    if not all(isinstance(d, int) for d in sizes):
        return list(end)
    trimmed = []
    for d, k, s, dl, b, e in zip(sizes, kernel, strides, dilations, begin, end):
        unread = (d + b + e - (k - 1) * dl - 1) % s
        trimmed.append(e - unread if unread <= e else e)
    return trimmed


def _crop(c: Vjp, grad: str, x: str, kernel, strides, dilations, begin, end) -> str:
    """The weight-gradient conv's output cut to the kernel's extent (it is longer when the input's
    padded extent leaves a remainder after the last stride)."""
    n = len(kernel)
    sizes = _spatial(c, x, n)
    if all(isinstance(d, int) for d in sizes):
        outs = [(d + b + e - (k - 1) * dl - 1) // s + 1
                for d, k, s, dl, b, e in zip(sizes, kernel, strides, dilations, begin, end)]
        produced = [(d + b + e - s * (o - 1) - 1) // dl + 1
                    for d, o, s, dl, b, e in zip(sizes, outs, strides, dilations, begin, end)]
        if produced == list(kernel):
            return grad
    return c.op("Slice", grad, c.ints([0] * n), c.ints(list(kernel)), c.ints(list(range(2, 2 + n))))


def max_pool(c: Vjp) -> None:
    x, dy = c.x(0), c.dy()
    if int(c.attr("storage_order", 0)):
        c.fail("MaxPool with storage_order=1")
    indices = c.forward_output(1, "Indices", INT64, c.shape(c.y(0)))
    wide = TensorProto.DOUBLE if c.elem(x) == TensorProto.DOUBLE else TensorProto.FLOAT
    size = c.info.static_shape(x)
    if size is not None:
        zeros = c.emit.zeros([int(np.prod(size))], wide)
    else:
        c.runtime(f"MaxPool gradient of {x} (symbolic extents)")
        zeros = c.emit.zeros(c.op("Reshape", c.op("Size", x, elem=INT64), c.ints([1]), elem=INT64), wide)
    c.emit.needs_opset(16)
    positions = c.op("Reshape", indices, c.ints([-1]), elem=INT64)

    def scatter(grad: str) -> str:
        flat = c.op("ScatterElements", zeros, positions, c.op("Reshape", c.cast(grad, wide), c.ints([-1])),
                    axis=0, reduction="add")
        return c.cast(c.reshape_like(flat, x), c.elem(x))

    result = scatter(dy)
    if wide == c.elem(x):
        c.emit.pooled[result] = (dy, c.y(0), scatter)
    c.set(0, result)


def average_pool(c: Vjp) -> None:
    """Each output's gradient divided by its window's divisor (a constant table built from the
    static extents, count_include_pad and ceil_mode as onnxruntime counts them), spread over the
    window by a ConvTranspose with a kernel of ones."""
    x, dy = c.x(0), c.dy()
    kernel = list(c.attr("kernel_shape"))
    n = len(kernel)
    strides, dilations, begin, end = _geometry(c, x, kernel)
    if any(d != 1 for d in dilations):
        c.fail("AveragePool with dilations")
    sizes, outs = _spatial(c, x, n), _spatial(c, c.y(0), n)
    if not all(isinstance(d, int) for d in sizes + outs):
        c.fail("AveragePool over symbolic spatial extents", "export the model with static image sizes")
    include = int(c.attr("count_include_pad", 0))
    divisor = np.ones(outs, np.float64)
    for a, (d, o, k, s, b, e) in enumerate(zip(sizes, outs, kernel, strides, begin, end)):
        start = np.arange(o) * s - b
        stop = np.minimum(start + k, d + e)
        counts = stop - start if include else np.minimum(start + k, d) - np.maximum(start, 0)
        divisor = divisor * counts.reshape([-1 if i == a else 1 for i in range(n)])
    scaled = c.op("Mul", dy, c.emit.constant((1.0 / divisor).astype(np.float32), elem=c.elem(dy)))
    # ConvTranspose with zero pads covers [-b, -b + s*(o-1) + k): crop to [0, d) by its pads.
    tail = [s * (o - 1) + k - b - d for d, o, k, s, b in zip(sizes, outs, kernel, strides, begin)]
    pads_end = [max(t, 0) for t in tail]
    padding = [max(-t, 0) for t in tail]
    ones = c.emit.constant(np.ones([1, 1, *kernel], np.float32), elem=c.elem(dy))
    per_channel = c.op("Reshape", scaled, c.ints([-1, 1, *[0] * n]))
    grad = c.op("ConvTranspose", per_channel, ones, strides=strides, pads=begin + pads_end,
                output_padding=padding if any(padding) else None)
    c.set(0, c.reshape_like(grad, x))


def conv_transpose(c: Vjp) -> None:
    """ConvTranspose is the adjoint of the Conv with its weight and geometry (output_padding only
    lengthens its output): its input gradient is that Conv of dY, and its weight gradient the
    Conv's weight gradient with dY as the input and X as the output's gradient."""
    x, w, dy = c.x(0), c.x(1), c.dy()
    w_shape = c.info.static_shape(w)
    if w_shape is None:
        c.fail("its weight's shape is not static", "export the model with static convolution weights")
    if c.attr("output_shape") or c.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        c.fail("ConvTranspose with output_shape or auto_pad SAME_*", "export the model with explicit pads")
    kernel = list(c.attr("kernel_shape") or w_shape[2:])
    n = len(kernel)
    group = int(c.attr("group", 1))
    strides = list(c.attr("strides") or [1] * n)
    dilations = list(c.attr("dilations") or [1] * n)
    pads = [0] * (2 * n) if c.attr("auto_pad", "NOTSET") == "VALID" else list(c.attr("pads") or [0] * (2 * n))
    begin, end = pads[:n], pads[n:]
    axes = list(range(2, 2 + n))
    if c.needs(2):
        c.set(2, c.reduce("ReduceSum", dy, [0, *axes], 0))
    if c.needs(0):
        grad = c.op("Conv", dy, w, strides=strides, dilations=dilations, pads=begin + end,
                    group=group if group != 1 else None)
        sizes, outs = _spatial(c, x, n), _spatial(c, c.y(0), n)
        if all(isinstance(d, int) for d in sizes + outs):
            # an output_padding of a stride or more leaves a longer conv output: cut to X
            produced = [(o + b + e - (k - 1) * dl - 1) // s + 1
                        for o, k, s, dl, b, e in zip(outs, kernel, strides, dilations, begin, end)]
            if produced != sizes:
                grad = c.op("Slice", grad, c.ints([0] * n), c.ints(sizes), c.ints(axes))
        else:
            c.runtime(f"ConvTranspose input gradient of {x} (symbolic extents)")
            ends = c.op("Slice", c.op("Shape", x, elem=INT64), c.ints([2]), c.ints([INT64_MAX]), elem=INT64)
            grad = c.op("Slice", grad, c.ints([0] * n), ends, c.ints(axes))
        c.set(0, grad)
    if c.needs(1):
        c.set(1, _weight_grad(c, dy, w_shape, x, kernel, strides, dilations, begin, end, group,
                              like=(c.y(0), x)))


RULES = {"Conv": conv, "ConvTranspose": conv_transpose, "MaxPool": max_pool, "AveragePool": average_pool}
