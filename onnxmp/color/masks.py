"""Attention mask fills: constants out of the low-precision range that only mask a softmax.

Exporters build an additive attention mask from a fill far below float16's range (torch's
``float32.min``, ``-1e9``) and add it to the attention scores just before a Softmax.  TF's
range rule would keep that whole path in float32, and with it the mask Add and the Softmax of
every layer (two Casts each, and the scores tensor moved in float32).  Yet the fill only has to
make ``exp`` vanish: any value far below the scores does, and the Softmax kernel computes in
float32 (``onnxmp/data/ort_kernel_numerics.json``).

So a fill qualifies when every path from it reaches the input of a Softmax (or LogSoftmax)
through mask-building ops only (Casts, shape ops, ``Where``, ``Mul`` by a mask, ``Add``/``Sub``
of masks and scores), and all its other values fit.  Where the conversion puts any of that
path in low precision, the fill's out-of-range values are replaced by :attr:`MaskFill.value`:
a value whose sum over the ``k`` fills that can meet in one Softmax input lies where the type's
spacing is widest and leaves room for the scores.  In float16 that is -49152 for one mask and
-24576 each for two, so:

* a partly masked row: ``exp`` of the masked entries is 0 in float32, as with the original fill;
* a fully masked row: every entry rounds to the same value while the scores lie within half the
  spacing there (16 in float16; bfloat16's spacing swamps any score), so the Softmax is uniform
  as in float32, and never NaN;
* two masks added never overflow to -inf.

The replacement is reported per constant (``docs/coloring.md``, mask fills).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnx

from onnxmp.domains import ONNX_DOMAINS, is_onnx_domain
from onnxmp.external import tensor_array
from onnxmp.index import ModelIndex
from onnxmp.precision import Precision
from onnxmp.subgraphs import iter_proto_graphs

# Ops a mask passes through on its way to the scores: they move, select, combine or cast it.
_PASS = frozenset({"Cast", "Unsqueeze", "Squeeze", "Reshape", "Expand", "Tile", "Transpose", "Concat", "Slice",
                   "Gather", "Identity", "Flatten", "Where", "Mul", "Add", "Sub", "Min", "Max"})
_SOFTMAX = frozenset({"Softmax", "LogSoftmax"})
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)


@dataclass(frozen=True)
class MaskFill:
    """A constant (initializer, or Constant node output) that only masks softmaxes."""

    constant: str
    original: float            # its most negative value
    value: float               # what out-of-range values become where its path goes low precision
    softmaxes: tuple[str, ...]  # the Softmax nodes it masks
    nodes: tuple[str, ...]     # the nodes on its paths (the Softmaxes excluded)
    tensors: frozenset[str]    # the tensors on its paths, up to the Softmax inputs



def replaced_fill(tensor: onnx.TensorProto, value: float, low: Precision) -> onnx.TensorProto:
    """``tensor`` (a mask fill) with every entry below the low type's range set to ``value``, in
    the tensor's own type: the rewrite's and the calibration switchboard's one way to do it."""
    values = tensor_array(tensor)
    out = np.array(values, dtype=np.float32, copy=True)
    out[out < -low.max] = value
    replaced = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=values.shape)
    replaced.raw_data = np.ascontiguousarray(out.astype(values.dtype)).tobytes()
    return replaced


def replace_fills(graph: onnx.GraphProto, fills: Mapping[str, float], low: Precision) -> None:
    """Apply :func:`replaced_fill` in place to the constants ``fills`` names (``{constant: value}``,
    initializers and Constant nodes, in ``graph`` and its bodies)."""
    for g in iter_proto_graphs(graph):
        for init in g.initializer:
            if init.name in fills:
                init.CopyFrom(replaced_fill(init, fills[init.name], low))
        for node in g.node:
            if node.op_type == "Constant" and node.output and node.output[0] in fills:
                value = next(a.t for a in node.attribute if a.name == "value")
                value.CopyFrom(replaced_fill(value, fills[node.output[0]], low))


def mask_fills(index: ModelIndex, low: Precision) -> dict[str, MaskFill]:
    """The mask fills of every graph, by constant name."""
    found: dict[str, MaskFill] = {}
    for scope in index.scopes:
        found.update(_graph_fills(scope.graph, scope.names, scope.ins, scope.outs, low))
    return found


def _graph_fills(graph, names, ins, outs, low: Precision) -> dict[str, MaskFill]:
    ops = [(node.op_type if node.domain in ONNX_DOMAINS else "") for node in graph.node]
    upstream = _upstream_of_softmaxes(ins, outs, ops)
    if not upstream:
        return {}
    candidates = {}
    for name, values in _constants(graph, upstream):
        finite = values[np.isfinite(values)]
        if finite.size and finite.min() < -low.max and finite.max() <= low.max:
            candidates[name] = float(finite.min())
    fills: dict[str, MaskFill] = {}
    if not candidates:
        return fills
    outputs = {v.name for v in graph.output}
    readers: dict[str, list[int]] = {}
    for k, inputs in enumerate(ins):
        for name in inputs:
            if name:
                readers.setdefault(name, []).append(k)
    walks = {}
    for name in candidates:
        walk = _walk(name, readers, ins, outs, ops, outputs)
        if walk is not None:
            walks[name] = walk
    if not walks:
        return fills
    counts = _fill_counts(walks, ins, outs, ops)
    for name, (nodes, softmaxes, tensors) in walks.items():
        k = max(counts.get(ins[s][0], 1) for s in softmaxes)
        fills[name] = MaskFill(name, candidates[name], _fill_value(low, k), tuple(names[s] for s in sorted(softmaxes)),
                               tuple(names[n] for n in sorted(nodes)), frozenset(tensors))
    return fills


def _upstream_of_softmaxes(ins, outs, ops) -> set[str]:
    """The tensors from which a Softmax input can be reached backward through mask ops only: the
    only places a fill can be (so that a model's thousands of weights are never read here)."""
    producer = {out: k for k, names in enumerate(outs) for out in names if out}
    pending = [ins[k][0] for k, op in enumerate(ops) if op in _SOFTMAX and ins[k] and ins[k][0]]
    seen = set(pending)
    while pending:
        k = producer.get(pending.pop())
        if k is None or ops[k] not in _PASS:
            continue
        for name in ins[k]:
            if name and name not in seen:
                seen.add(name)
                pending.append(name)
    return seen


def _constants(graph: onnx.GraphProto, names: set[str]):
    """(name, float values) of the graph's float initializers and Constant nodes among ``names``."""
    for init in graph.initializer:
        if init.name in names and init.data_type in _FLOATS:
            yield init.name, np.asarray(tensor_array(init), dtype=np.float64)
    for node in graph.node:
        if node.op_type == "Constant" and is_onnx_domain(node.domain) and node.output[0] in names:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None and value.data_type in _FLOATS:
                yield node.output[0], np.asarray(tensor_array(value), dtype=np.float64)


def _walk(name: str, readers, ins, outs, ops, outputs):
    """(nodes, softmaxes, tensors) on every path from ``name``, or None when a path leaves the mask
    ops or ends anywhere but a Softmax input."""
    nodes, softmaxes, tensors = set(), set(), {name}
    pending = [name]
    while pending:
        tensor = pending.pop()
        if tensor in outputs:
            return None
        for k in readers.get(tensor, ()):
            op = ops[k]
            if op in _SOFTMAX and ins[k][0] == tensor:
                softmaxes.add(k)
                continue
            if op not in _PASS or (op == "Where" and ins[k][0] == tensor):
                return None
            if k in nodes:
                continue
            nodes.add(k)
            for out in outs[k]:
                if out and out not in tensors:
                    tensors.add(out)
                    pending.append(out)
    return (nodes, softmaxes, tensors) if softmaxes else None


def _fill_counts(walks, ins, outs, ops) -> dict[str, int]:
    """For each tensor on a mask path, how many fills its values can sum (a bound): 1 at a fill;
    Add and Sub add their inputs' counts, every other op keeps the largest."""
    count: dict[str, int] = {name: 1 for name in walks}
    region = sorted({k for nodes, _, _ in walks.values() for k in nodes})
    for k in region:  # node order is topological (normalize)
        inputs = [count.get(name, 0) for name in ins[k]]
        total = sum(inputs) if ops[k] in ("Add", "Sub") else max(inputs, default=0)
        for out in outs[k]:
            count[out] = max(count.get(out, 0), total)
    return count


def _fill_value(low: Precision, k: int) -> float:
    """``-1.5 * 2**e / k``, with ``2**e`` the largest power of two in the type's range (float16:
    -49152 for one fill, -24576 each for two), as a value of the type: the sum of ``k`` fills and
    a score above ``-2**(e-1)`` stays finite, and the sum lies where the type's spacing is widest
    (32 in float16), so that scores within half of it round away."""
    value = -1.5 * 2.0 ** math.floor(math.log2(low.max)) / max(k, 1)
    rounded = float(np.asarray(value, dtype=np.float32).astype(low.numpy))
    while max(k, 1) * abs(rounded) > 1.5 * 2.0 ** math.floor(math.log2(low.max)):
        rounded = float(np.nextafter(np.asarray(rounded, low.numpy), low.numpy.type(0)))
    return rounded
