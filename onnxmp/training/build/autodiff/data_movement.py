"""Gradients of the ops that move data without arithmetic: Reshape, Flatten, Squeeze, Unsqueeze,
Transpose, Concat, Split, Slice, Expand, Tile, Pad.

Shapes and offsets are constants wherever the symbolic shapes decide them: a Concat's inputs
are cut back out with Slices whose bounds count from whichever end has static sizes, a Slice's
gradient is a Pad with constant pads, or zeros concatenated around it when a dim is symbolic."""
from __future__ import annotations

from onnxmp.training.build.autodiff.context import Vjp, normalize_axes
from onnxmp.training.build.autodiff.emit import INT64_MAX


def reshape(c: Vjp) -> None:
    c.set(0, c.reshape_like(c.dy(), c.x(0), c.y(0)))


def squeeze(c: Vjp) -> None:
    x = c.x(0)
    axes = c.attr("axes") if c.info.opset < 13 else (c.const_ints(c.x(1)) if c.x(1) else None)
    if axes is None:
        shape = c.shape(x)
        if c.x(1) or shape is None or any(d is None or isinstance(d, str) for d in shape):
            c.set(0, c.reshape_like(c.dy(), x))
            return
        axes = [i for i, d in enumerate(shape) if d == 1]
    c.set(0, c.unsqueeze(c.dy(), normalize_axes(axes, c.rank(x))))


def unsqueeze(c: Vjp) -> None:
    axes = c.attr("axes") if c.info.opset < 13 else c.const_ints(c.x(1))
    if axes is None:
        c.set(0, c.reshape_like(c.dy(), c.x(0)))
        return
    c.set(0, c.squeeze(c.dy(), normalize_axes(axes, c.rank(c.y(0)))))


def flatten(c: Vjp) -> None:
    c.set(0, c.reshape_like(c.dy(), c.x(0)))


def transpose(c: Vjp) -> None:
    rank = c.rank(c.x(0))
    perm = c.attr("perm") or list(range(rank - 1, -1, -1))
    inverse = [0] * rank
    for i, p in enumerate(perm):
        inverse[p] = i
    c.set(0, c.transpose(c.dy(), inverse))


def _extent(c: Vjp, name: str, axis: int):
    shape = c.shape(name)
    d = shape[axis] if shape is not None and axis < len(shape) else None
    return d if isinstance(d, int) else None


def _cut(c: Vjp, grad: str, sizes: list, i: int, axis: int) -> str | None:
    """Piece ``i`` of ``grad`` along ``axis`` (pieces of ``sizes``, None where symbolic), with
    constant bounds counted from the start or the end, whichever is static; None if neither."""
    before, after = sizes[:i], sizes[i + 1:]
    if all(s is not None for s in before):
        start = sum(before)
    elif all(s is not None for s in sizes[i:]):
        start = -sum(sizes[i:])
    else:
        return None
    if all(s is not None for s in after):
        end = -sum(after) if after and sum(after) else INT64_MAX
    elif all(s is not None for s in sizes[:i + 1]):
        end = sum(sizes[:i + 1])
    else:
        return None
    return c.op("Slice", grad, c.ints([start]), c.ints([end]), c.ints([axis]))


def concat(c: Vjp) -> None:
    dy = c.dy()
    rank = c.rank(c.y(0))
    axis = normalize_axes([c.attr("axis")], rank)[0]
    inputs = list(c.node.input)
    sizes = [_extent(c, x, axis) for x in inputs]
    wanted = [i for i in range(len(inputs)) if c.needs(i)]
    if all(s is not None for s in sizes) and len(wanted) > 1:
        pieces = _split(c, dy, sizes, axis)
        for i in wanted:
            c.set(i, pieces[i])
        return
    runtime_sizes = None
    for i in wanted:
        piece = _cut(c, dy, sizes, i, axis)
        if piece is None:
            if runtime_sizes is None:
                c.runtime(f"Concat sizes along axis {axis}")
                runtime_sizes = c.op("Concat", *[
                    c.ints([s]) if s is not None else c.op("Gather", c.op("Shape", x, elem=7), c.ints([axis]), elem=7)
                    for x, s in zip(inputs, sizes)], axis=0, elem=7)
                runtime_pieces = _split(c, dy, runtime_sizes, axis)
            piece = runtime_pieces[i]
        c.set(i, piece)


def _split(c: Vjp, x: str, sizes, axis: int) -> list[str]:
    """Split ``x`` into pieces of ``sizes`` (a list of ints, or a tensor from opset 13)."""
    count = len(sizes) if not isinstance(sizes, str) else None
    if c.info.opset < 13:
        if isinstance(sizes, str):
            c.fail("Concat of symbolic sizes at opset < 13", "export the model at opset >= 13")
        return c.emit.ops("Split", [x], [""] * count, axis=axis, split=list(sizes))
    if not isinstance(sizes, str):
        sizes = c.ints(list(sizes))
    return c.emit.ops("Split", [x, sizes], [""] * (count or len(c.node.input)), axis=axis)


def split(c: Vjp) -> None:
    x = c.x(0)
    rank = c.rank(x)
    axis = normalize_axes([c.attr("axis", 0)], rank)[0]
    parts = []
    for i, y in enumerate(c.node.output):
        grad = c.dy(i)
        parts.append(grad if grad is not None else c.zeros_like(y))
    c.set(0, c.op("Concat", *parts, axis=axis))


def _slice_params(c: Vjp) -> tuple[list, list, list, list] | None:
    """(starts, ends, axes, steps), each a list of ints or a tensor name when computed."""
    if c.info.opset < 10:
        starts, ends = c.attr("starts"), c.attr("ends")
        axes = c.attr("axes") or list(range(len(starts)))
        return starts, ends, axes, [1] * len(starts)
    starts = c.const_ints(c.x(1))
    ends = c.const_ints(c.x(2))
    axes = c.const_ints(c.x(3)) if c.x(3) else None
    steps = c.const_ints(c.x(4)) if c.x(4) else None
    return starts, ends, axes, steps


def slice_(c: Vjp) -> None:
    x, dy = c.x(0), c.dy()
    shape = c.shape(x)
    if shape is None:
        c.fail(f"the rank of {x!r} is unknown", "export the model with static ranks")
    rank = len(shape)
    starts, ends, axes, steps = _slice_params(c)
    count = len(starts) if starts is not None else len(ends) if ends is not None else None
    if axes is None and count is not None and not c.x(3):
        axes = list(range(count))
    if steps is None and count is not None and not (c.info.opset >= 10 and c.x(4)):
        steps = [1] * count
    if axes is None or steps is None:
        c.fail("its axes or steps are computed", "export the slice with constant axes and steps")
    axes = normalize_axes(axes, rank)
    if any(s != 1 for s in steps):
        c.set(0, _strided(c, dy, shape, starts, ends, axes, steps))
        return
    if starts is not None and ends is not None and all(isinstance(shape[a], int) for a in axes):
        pads = [0] * (2 * rank)
        for a, s, e in zip(axes, starts, ends):
            d = shape[a]
            s = min(max(s + d if s < 0 else s, 0), d)
            e = min(max(e + d if e < 0 else e, 0), d)
            pads[a], pads[rank + a] = s, d - max(e, s)
        c.set(0, c.op("Pad", dy, c.ints(pads), mode="constant"))
        return
    # Symbolic extents: zeros cut from a zeros-like-x by the forward's own bounds, one axis at a
    # time, put around the gradient (Slice normalizes the bounds exactly as the forward did).
    c.runtime(f"Slice of {x} along a symbolic dim")
    zeros = c.zeros_like(x)
    grad = dy
    start_input, end_input = c.x(1), c.x(2)
    for k, a in enumerate(axes):
        # the zeros' extents: whole on the axes done so far and on this one, sliced on the rest
        rest = [(j, b) for j, b in enumerate(axes) if j > k]
        block = zeros
        if rest:
            idx = [j for j, _ in rest]
            block = c.op("Slice", zeros, _pick(c, start_input, starts, idx), _pick(c, end_input, ends, idx),
                         c.ints([b for _, b in rest]))
        one = [k]
        head = c.op("Slice", block, c.ints([0]), _pick(c, start_input, starts, one), c.ints([a]))
        tail = c.op("Slice", block, _pick(c, end_input, ends, one), c.ints([INT64_MAX]), c.ints([a]))
        grad = c.op("Concat", head, grad, tail, axis=a)
    c.set(0, grad)


def _strided(c: Vjp, dy: str, shape: tuple, starts, ends, axes: list[int], steps) -> str:
    """A strided slice's gradient, axis by axis: each kept element followed by step - 1 zeros (an
    Unsqueeze, a Pad and a Reshape), then padded to the input's extent.  Static extents only."""
    if starts is None or ends is None or any(s <= 0 for s in steps):
        c.fail("a strided slice with computed bounds or a negative step")
    rank = len(shape)
    current = list(c.shape(c.y(0)) or shape)
    grad = dy
    for a, start, end, step in zip(axes, starts, ends, steps):
        d = shape[a]
        if not isinstance(d, int):
            c.fail("a strided slice along a symbolic dim", "export the model with static extents there")
        s0 = min(max(start + d if start < 0 else start, 0), d)
        e0 = min(max(end + d if end < 0 else end, 0), d)
        m = len(range(s0, e0, step))
        if step != 1:
            spread = c.unsqueeze(grad, [a + 1])
            pads = [0] * (2 * (rank + 1))
            pads[rank + 1 + a + 1] = step - 1
            spread = c.op("Pad", spread, c.ints(pads), mode="constant")
            spec, free = [], 0
            for i, dim in enumerate(current):
                if i == a:
                    spec.append(m * step)
                elif isinstance(dim, int):
                    spec.append(dim)
                elif i < a:
                    spec.append(0)
                else:
                    spec.append(-1)
                    free += 1
            if free > 1:
                c.fail("a strided slice of a tensor with several symbolic dims after the sliced axis")
            grad, m = c.op("Reshape", spread, c.ints(spec)), m * step
        grad = pad_crop(c, grad, rank, {a: (s0, d - s0 - m)})
        current[a] = d
    return grad


def _pick(c: Vjp, name: str, values, idx: list[int]) -> str:
    if values is not None:
        return c.ints([values[i] for i in idx])
    return c.op("Gather", name, c.ints(idx), elem=7)


def expand(c: Vjp) -> None:
    c.set(0, c.unbroadcast(c.dy(), c.x(0), c.y(0)))


def tile(c: Vjp) -> None:
    x, dy = c.x(0), c.dy()
    shape = c.shape(x)
    if shape is None:
        c.fail(f"the rank of {x!r} is unknown", "export the model with static ranks")
    repeats = c.const_ints(c.x(1))
    if repeats is not None and all(r == 1 for r in repeats):
        c.set(0, dy)
        return
    # [r0*d0, r1*d1, ...] -> [r0, d0, r1, d1, ...], summed over the r axes.
    rank = len(shape)
    if repeats is not None and sum(not isinstance(d, int) for d in shape) <= 1:
        spec = [v for r, d in zip(repeats, shape) for v in (r, d if isinstance(d, int) else -1)]
        blocks = c.op("Reshape", dy, c.ints(spec))
    else:
        c.runtime(f"Tile of {x} (computed repeats or symbolic dims)")
        times = c.ints(repeats) if repeats is not None else c.x(1)
        pairs = c.op("Concat", c.unsqueeze(times, [1]), c.unsqueeze(c.op("Shape", x, elem=7), [1]), axis=1, elem=7)
        blocks = c.op("Reshape", dy, c.op("Reshape", pairs, c.ints([-1]), elem=7))
    c.set(0, c.reduce("ReduceSum", blocks, list(range(0, 2 * rank, 2)), 0))


def pad(c: Vjp) -> None:
    x, dy = c.x(0), c.dy()
    mode = c.attr("mode", "constant")
    rank = c.rank(x)
    if c.info.opset < 11:
        pads, axes = c.attr("pads"), None
    else:
        pads = c.const_ints(c.x(1))
        axes = c.const_ints(c.x(3)) if len(c.node.input) > 3 and c.x(3) else None
        if pads is None and mode != "constant":
            c.fail(f"Pad mode {mode!r} with computed pads", "export the model with constant pads")
        if pads is None:
            c.runtime(f"Pad of {x} by computed pads")
            extra = ["", c.x(3)] if len(c.node.input) > 3 and c.x(3) else []
            c.set(0, c.op("Pad", dy, c.op("Neg", c.x(1), elem=7), *extra, mode="constant"))
            return
    # The gradient of padding is cropping (and of a negative pad's crop, zeros around it).
    listed = normalize_axes(axes, rank) if axes is not None else list(range(rank))
    n = len(listed)
    if mode != "constant":
        c.set(0, _fold_borders(c, dy, x, mode, {a: (pads[k], pads[n + k]) for k, a in enumerate(listed)}))
        return
    c.set(0, pad_crop(c, dy, rank, {a: (-pads[k], -pads[n + k]) for k, a in enumerate(listed)}))


def _fold_borders(c: Vjp, dy: str, x: str, mode: str, edges: dict[int, tuple[int, int]]) -> str:
    """The gradient of an edge/reflect/wrap Pad: per padded axis (the modes pad one axis after another),
    the middle strip plus each border strip added onto the elements it copies (reflect: reversed,
    one in from the edge; edge: summed onto the first/last element; wrap: from the other end)."""
    if mode not in ("edge", "reflect", "wrap"):
        c.fail(f"Pad mode {mode!r}")
    shape = c.shape(x)
    grad = dy
    for a, (b, e) in sorted(edges.items()):
        if not b and not e:
            continue
        d = shape[a]
        if b < 0 or e < 0 or not isinstance(d, int):
            c.fail(f"Pad mode {mode!r} with negative pads or along a symbolic dim",
                   "export the model with static extents along the padded axes")
        if mode == "reflect" and max(b, e) >= d or mode == "wrap" and max(b, e) > d:
            c.fail(f"Pad mode {mode!r} wider than the input")
        total = c.op("Slice", grad, c.ints([b]), c.ints([b + d]), c.ints([a]))
        for side, width in (("begin", b), ("end", e)):
            if not width:
                continue
            lo, hi = (0, b) if side == "begin" else (b + d, b + d + e)
            strip = c.op("Slice", grad, c.ints([lo]), c.ints([hi]), c.ints([a]))
            if mode == "edge":
                strip, at = c.reduce("ReduceSum", strip, [a], 1), (0 if side == "begin" else d - 1)
                width = 1
            elif mode == "reflect":
                strip = c.op("Slice", strip, c.ints([-1]), c.ints([-INT64_MAX]), c.ints([a]), c.ints([-1]))
                at = 1 if side == "begin" else d - 1 - e
            else:
                at = d - b if side == "begin" else 0
            pads = [0] * (2 * len(shape))
            pads[a], pads[len(shape) + a] = at, d - at - width
            total = c.op("Add", total, c.op("Pad", strip, c.ints(pads), mode="constant"))
        grad = total
    return grad


def pad_crop(c: Vjp, x: str, rank: int, edges: dict[int, tuple[int, int]]) -> str:
    """``x`` (of rank ``rank``) with, per axis, (begin, end) elements added as zeros (positive) or cut off (negative):
    a Slice for the cuts, then a Pad for the zeros (no negative pads: not every runtime takes them)."""
    cuts = {a: (b, e) for a, (b, e) in edges.items() if b < 0 or e < 0}
    if cuts:
        axes = sorted(cuts)
        x = c.op("Slice", x, c.ints([max(-cuts[a][0], 0) for a in axes]),
                 c.ints([min(cuts[a][1], 0) or INT64_MAX for a in axes]), c.ints(axes))
    grow = {a: (max(b, 0), max(e, 0)) for a, (b, e) in edges.items() if b > 0 or e > 0}
    if grow:
        pads = [0] * (2 * rank)
        for a, (b, e) in grow.items():
            pads[a], pads[rank + a] = b, e
        x = c.op("Pad", x, c.ints(pads), mode="constant")
    return x


RULES = {
    "Reshape": reshape, "Squeeze": squeeze, "Unsqueeze": unsqueeze, "Flatten": flatten, "Transpose": transpose,
    "Concat": concat, "Split": split, "Slice": slice_, "Expand": expand, "Tile": tile, "Pad": pad,
}
