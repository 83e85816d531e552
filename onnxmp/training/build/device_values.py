"""Keep shape arithmetic from feeding device data inside a CUDA step.

onnxruntime's CUDA EP runs small int64 subgraphs that start at a ``Shape`` or ``Size`` on the CPU
(``GetCpuPreferredNodes``, :mod:`~onnxmp.training.build.placement`).  Where such a value only sizes
a kernel (``Reshape``'s shape, ``Expand``'s shape, ``Slice``'s starts: inputs the CUDA kernels take
in CPU memory by design) that costs nothing.  Where it is data of a device kernel (a token count
as the divisor of a mean, a sequence length multiplied into int64 positions), onnxruntime copies it
host to device on every run, and the device waits for the host's arithmetic.

:func:`keep_on_device` rewrites each such value so that nothing crosses host to device:

- a value the static shapes decide is folded by onnxruntime before placement (level-1 constant
  folding, which the simulation applies too): it never runs;
- otherwise the arithmetic is computed a second time on the device, for the device consumers only:
  each dimension ``n`` it reads from a ``Shape`` becomes ``ReduceSum(ConstantOfShape([n], 1))``, a
  device int64 built from the CPU shape through ``ConstantOfShape``'s CPU-memory input (``n``
  elements of work); a static dimension becomes a constant; a ``Size`` becomes the product of
  those dimensions; one dimension picked from a ``Shape`` (a ``Gather`` of one index, a one-element
  ``Slice``) is counted from the picked CPU value itself, which needs no rank.  The copied nodes
  read device tensors, so the CUDA EP keeps them; the CPU subgraph stays for the consumers that take
  it in CPU memory, and what nothing reads any more is dropped;
- an ``ArgMax``/``ArgMin`` over positions (``Range`` outputs, masked or selected), for which the CUDA
  EP has no int64 kernel, runs on the device on a float64 copy, which holds such values exactly.

The values are the same integers, so no number the graph computes changes.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import numpy_helper

from onnxmp.naming import FreshNames, proto_names
from onnxmp.training.build.placement import CudaKernels, place
from onnxmp.training.nodes import Nodes, attribute

log = logging.getLogger("onnxmp.training")

ROUNDS = 4  # a rewrite can expose a copy behind it only through a CPU-EP node; a few rounds settle it


def keep_on_device(model: onnx.ModelProto, kernels: CudaKernels | None = None) -> dict:
    """Rewrite ``model`` in place (see the module's docstring); returns ``{"rewritten": values moved
    to the device, "copies": host-to-device copies left}``."""
    kernels = kernels or CudaKernels()
    moved = 0
    for _ in range(ROUNDS):
        placement = place(model, kernels)
        if not placement.copies:
            return {"rewritten": moved, "copies": 0}
        done = _rewrite(model, placement)
        moved += done
        if not done:
            break
    left = place(model, kernels).copies
    if left:
        log.warning("%d value(s) still cross host to device in the CUDA graph: %s", len(left), ", ".join(sorted(left)[:5]))
    return {"rewritten": moved, "copies": len(left)}


def _rewrite(model: onnx.ModelProto, placement) -> int:
    graph = model.graph
    nodes = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    shapes = placement.shapes
    names = FreshNames(proto_names(graph))
    after: dict[int, list[onnx.NodeProto]] = {}   # node index -> device nodes written right after it
    device: dict[str, str] = {}                   # CPU value -> its device twin

    def twin(name: str) -> str | None:
        """The device twin of CPU value ``name``, written on first use; None where it cannot be."""
        if name in device:
            return device[name]
        i = producer.get(name)
        if i is None or i not in placement.cpu and nodes[i].op_type not in ("Shape", "Size"):
            return name  # a constant or a graph input: where its consumer wants it already
        node = nodes[i]
        b = Nodes(names, f"{node.name or node.op_type}/device", after.setdefault(i, []))
        if i not in placement.cpu:  # Shape or Size of a device tensor: the leaf of the arithmetic
            found = _shape_on_device(b, node, shapes.get(node.input[0]))
        elif i in placement.preferred and (one := _one_dimension(node, nodes, producer, placement.values)):
            # one dimension picked from a Shape (at any position, the rank unknown): counted on the device
            count = node.output[0] if one == "vector" else b.op("Reshape", [node.output[0], b.ints([1])])
            found = _count_on_device(b, count)
            if one == "scalar":
                found = b.op("Reshape", [found, b.ints([])])
        elif i in placement.preferred:
            inputs = [twin(x) if x else "" for x in node.input]
            if any(x is None for x in inputs):
                return None
            found = _clone(b, node, inputs, device)[list(node.output).index(name)]
        elif node.op_type in WIDEN and _index_like(node.input[0], nodes, producer, placement.bool_values):
            # no CUDA kernel for its integer type: the same kernel on float64 copies of values no
            # larger than a tensor's size (positions), which float64 holds exactly
            wide = b.op("Cast", [node.input[0]], to=onnx.TensorProto.DOUBLE)
            found = _clone(b, node, [wide, *node.input[1:]], device)[list(node.output).index(name)]
        else:
            return None  # no CUDA kernel for the node itself: it stays on the CPU EP
        device[name] = found
        return found

    moved = 0
    for value, users in placement.copies.items():
        found = twin(value)
        if found is None or found == value:
            continue
        for i in users:
            node = nodes[i]
            for k, x in enumerate(node.input):
                if x == value:
                    node.input[k] = found
        moved += 1
    if not moved:
        return 0
    ordered = []
    for i, node in enumerate(nodes):
        ordered.append(node)
        ordered.extend(after.get(i, ()))
    graph.ClearField("node")
    graph.node.extend(_live(ordered, {o.name for o in graph.output}, {id(nodes[i]) for i in placement.cpu}))
    return moved


def _clone(b: Nodes, node: onnx.NodeProto, inputs: list[str], device: dict[str, str]) -> list[str]:
    """A copy of ``node`` reading ``inputs``, with fresh outputs (recorded as the twins of its outputs)."""
    clone = onnx.NodeProto()
    clone.CopyFrom(node)
    clone.name = b.fresh(node.op_type)
    clone.ClearField("input")
    clone.input.extend(inputs)
    clone.ClearField("output")
    clone.output.extend(b.fresh(o) if o else "" for o in node.output)
    b.nodes.append(clone)
    device.update({o: c for o, c in zip(node.output, clone.output) if o})
    return list(clone.output)


def _one_dimension(node: onnx.NodeProto, nodes, producer: dict, values: dict) -> str | None:
    """``"scalar"`` or ``"vector"`` (of one element) where ``node`` picks one dimension from a ``Shape``
    output (a ``Gather`` of one constant index, a unit-step ``Slice`` of one element on axis 0); None
    otherwise."""
    i = producer.get(node.input[0]) if node.input else None
    if i is None or nodes[i].op_type != "Shape":
        return None
    const = [np.asarray(values[x]).astype(np.int64) if x in values else None for x in node.input[1:]]
    if node.op_type == "Gather" and const and const[0] is not None and const[0].size == 1:
        return "scalar" if const[0].ndim == 0 else "vector" if const[0].ndim == 1 else None
    if node.op_type != "Slice" or len(const) < 2 or any(c is None for c in const):
        return None
    starts, ends, *rest = [c.reshape(-1) for c in const]
    axes, steps = (rest + [None, None])[:2]
    if starts.size != 1 or (axes is not None and axes.tolist() not in ([0], [-1])) or (
            steps is not None and steps.tolist() != [1]):
        return None
    first, last = int(starts[0]), int(ends[0])
    one = last == first + 1 and (first >= 0 or last < 0) or first == -1 and last >= 2**31
    return "vector" if one else None


def _live(nodes: list, outputs: set[str], removable: set[int]) -> list:
    """``nodes`` without the CPU nodes (``removable``, by id) that nothing reads any more: the host
    arithmetic whose only readers were the device consumers now reading the twins."""
    used = set(outputs)
    kept = []
    for node in reversed(nodes):
        if id(node) in removable and not any(o in used for o in node.output if o):
            continue
        used.update(x for x in node.input if x)
        kept.append(node)
    return kept[::-1]


# Ops the CUDA EP registers for float types only, whose result is an index: on values that float64
# holds exactly they give the same index (ties included: equal integers stay equal).
WIDEN = frozenset({"ArgMax", "ArgMin"})


def _position(node, inputs) -> bool:
    return node.op_type == "Range"


def _masked(node, inputs) -> bool:
    return inputs(node.input[0]) and inputs(node.input[1], mask=True) or inputs(node.input[1]) and inputs(
        node.input[0], mask=True)


def _either(node, inputs) -> bool:
    return inputs(node.input[1]) and inputs(node.input[2])


def _same(node, inputs) -> bool:
    return inputs(node.input[0])


# op -> whether its output is no larger than a tensor's size, given which inputs are (rules per op)
_INDEX_LIKE = {"Range": _position, "Mul": _masked, "Where": _either, "Cast": _same, "Identity": _same,
               "Reshape": _same, "Unsqueeze": _same, "Squeeze": _same}


def _index_like(name: str, nodes, producer: dict, bools: frozenset, depth: int = 8) -> bool:
    """Whether ``name`` holds integers bounded by a tensor size: ``Range`` positions, masked (multiplied
    by a cast bool) or selected (Where) through shape-preserving ops."""
    def inputs(x: str, mask: bool = False) -> bool:
        if mask:
            i = producer.get(x)
            return i is not None and nodes[i].op_type == "Cast" and nodes[i].input[0] in bools
        return depth > 0 and _index_like(x, nodes, producer, bools, depth - 1)
    i = producer.get(name)
    return i is not None and nodes[i].op_type in _INDEX_LIKE and _INDEX_LIKE[nodes[i].op_type](nodes[i], inputs)


def _shape_on_device(b: Nodes, node: onnx.NodeProto, dims: tuple | None) -> str | None:
    """A device int64 equal to ``node``'s output (``Shape`` with its start/end, or ``Size``); None
    when the rank is unknown."""
    if dims is None:
        return None
    if node.op_type == "Size":
        # the product of the dimensions, multiplied on the device (the CUDA EP has no int64 ReduceProd)
        shape = b.op("Shape", [node.input[0]])
        parts = [_dims_on_device(b, shape, [k], dims, offset=0) for k in range(len(dims))]
        size = parts[0] if parts else b.ints([1])
        for part in parts[1:]:
            size = b.op("Mul", [size, part])
        return b.op("Reshape", [size, b.ints([])])
    picked = range(len(dims))[slice(attribute(node, "start", 0), attribute(node, "end", None))]
    if not len(picked):
        return None
    return _dims_on_device(b, node.output[0], picked, dims, offset=picked.start)


def _dims_on_device(b: Nodes, shape: str, picked, dims: tuple | None, offset: int = 0) -> str:
    """A device int64 vector of the dimensions ``picked`` of a tensor whose ``Shape`` (from dimension
    ``offset`` on) is ``shape``, a CPU tensor; ``dims`` its static dimensions where known."""
    parts = []
    for k in picked:
        if dims is not None and k < len(dims) and isinstance(dims[k], int):
            parts.append(b.ints([dims[k]]))
            continue
        parts.append(_count_on_device(b, b.op("Slice", [shape, b.ints([k - offset]), b.ints([k - offset + 1])])))
    if len(parts) == 1:
        return parts[0]
    return b.op("Concat", parts, axis=0)


def _count_on_device(b: Nodes, count: str) -> str:
    """A device int64 ``[n]`` from ``count``, the CPU int64 ``[n]`` (n >= 0): ``ConstantOfShape`` reads its
    shape in CPU memory and writes on the device; n ones, summed, are n (n elements of work)."""
    ones = b.op("ConstantOfShape", [count], value=numpy_helper.from_array(np.array([1], np.int64)))
    return b.op("ReduceSum", [ones], keepdims=1)
