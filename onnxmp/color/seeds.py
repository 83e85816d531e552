"""Deny seeds from data (onnxmp's addition to TF's algorithm; ``docs/coloring.md``).

A node whose float32 initializer or Constant input cannot be represented in the
low-precision type is painted DENY before propagation, instead of being
silently clamped the way plain converters do.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping

import ml_dtypes
import numpy as np
import onnx

from onnxmp.color.rules import DENY, Coloring
from onnxmp.external import constant_node_values, tensor_array
from onnxmp.index import TENSOR_KIND, ModelIndex
from onnxmp.options import DEFAULT_UNDERFLOW_SHARE
from onnxmp.passes import PassResult
from onnxmp.precision import low_precision

FLOAT, EXTERNAL = onnx.TensorProto.FLOAT, onnx.TensorProto.EXTERNAL



@dataclass(frozen=True)
class RangeCheck:
    max_abs: float
    underflow_share: float
    size: int

    def describe(self, name: str, limit: float, share: float) -> str | None:
        if self.max_abs > limit:
            return f"initializer `{name}` max {self.max_abs:.3g} > {limit:g}"
        if self.underflow_share > share:
            return (f"initializer `{name}`: {self.underflow_share:.0%} of its non-zero values "
                    f"flush to zero or turn subnormal in low precision (more than {share:.0%})")
        return None


CHECK_CHUNK = 1 << 22  # elements per step: big initializers are scanned with bounded memory


def check_values(values: np.ndarray, low_dtype) -> RangeCheck:
    flat = np.asarray(values).reshape(-1)
    tiny = ml_dtypes.finfo(low_dtype).tiny  # smallest normal number (check_values takes any dtype)
    max_abs, nonzero, flushed = 0.0, 0, 0
    for start in range(0, flat.size, CHECK_CHUNK):
        a = flat[start:start + CHECK_CHUNK].astype(np.float32, copy=False)
        finite = a[np.isfinite(a)]
        if finite.size:
            max_abs = max(max_abs, float(np.abs(finite).max()))
        nz = finite[finite != 0]
        nonzero += nz.size
        with np.errstate(over="ignore"):  # overflow is reported through max_abs, not here
            # In a weight tensor, subnormals keep only a few significant bits: as harmful as a
            # flush.  A lone scalar (an epsilon) only needs to survive, so it counts only if it flushes.
            floor = tiny if flat.size > 1 else 0
            flushed += int(np.count_nonzero(np.abs(nz.astype(low_dtype)) <= floor))
    return RangeCheck(max_abs, flushed / nonzero if nonzero else 0.0, int(flat.size))


BATCH_BELOW = 1 << 16  # elements: smaller constants are range-checked together in one vectorized sweep


def check_many(arrays: list[np.ndarray], low_dtype) -> list[RangeCheck]:
    """:func:`check_values` of each array; small ones in one vectorized pass (models carry
    thousands of tiny biases and scalars, and numpy's per-call overhead would dominate)."""
    results: list[RangeCheck | None] = [None] * len(arrays)
    small = [i for i, a in enumerate(arrays) if 0 < a.size < BATCH_BELOW]
    for i, a in enumerate(arrays):
        if not 0 < a.size < BATCH_BELOW:
            results[i] = check_values(a, low_dtype)
    if small:
        flat = np.concatenate([arrays[i].reshape(-1).astype(np.float32, copy=False) for i in small])
        for i, check in zip(small, _check_segments(flat, [arrays[i].size for i in small], low_dtype)):
            results[i] = check
    return results


def _check_segments(flat: np.ndarray, sizes: list[int], low_dtype) -> list[RangeCheck]:
    """:func:`check_values` of each consecutive segment of ``flat`` (float32), all at once."""
    max_abs, nonzero, flushed = _segment_counts(flat, sizes, low_dtype)
    results = []
    for j in range(len(sizes)):
        nz = int(nonzero[j])
        results.append(RangeCheck(float(max_abs[j]), int(flushed[j]) / nz if nz else 0.0, int(sizes[j])))
    return results


def _segment_counts(flat: np.ndarray, sizes: list[int], low_dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per consecutive segment of ``flat`` (float32): the finite max |x|, the non-zero finite
    count and how many of those flush or turn subnormal (see :func:`check_values`)."""
    sizes = np.array(sizes)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    magnitude = np.abs(flat)
    finite = magnitude < np.inf
    max_abs = np.maximum.reduceat(np.where(finite, magnitude, np.float32(0)), starts)
    nonzero = finite & (magnitude != 0)
    tiny = np.float32(ml_dtypes.finfo(low_dtype).tiny)
    flushed_counts = np.add.reduceat(nonzero & (magnitude <= _flush_limit(low_dtype, tiny)), starts)
    # A lone scalar (an epsilon) only needs to survive: it counts only if it flushes to zero.
    lone = starts[sizes == 1]
    flushed_counts[sizes == 1] = nonzero[lone] & (magnitude[lone] <= _flush_limit(low_dtype, np.float32(0)))
    return max_abs, np.add.reduceat(nonzero, starts), flushed_counts


@functools.lru_cache(maxsize=None)
def _flush_limit(low_dtype, floor: np.float32) -> np.float32:
    """The largest float32 |x| whose low-precision value is at most ``floor`` in magnitude.
    Rounding is monotonic, so ``|x| <= limit`` is the cast-and-compare test of
    :func:`check_values` without casting every value."""
    def at_most_floor(bits: int) -> bool:
        x = np.array([bits], dtype=np.uint32).view(np.float32)
        with np.errstate(over="ignore"):
            return bool(np.abs(x.astype(low_dtype)).astype(np.float32)[0] <= floor)

    low, high = 0, 0x7F800000  # +0 passes, +inf does not
    while high - low > 1:
        middle = (low + high) // 2
        if at_most_floor(middle):
            low = middle
        else:
            high = middle
    return np.array([low], dtype=np.uint32).view(np.float32)[0]


def _segment_causes(names: list[str], flat: np.ndarray, sizes: list[int], low_dtype, limit: float,
                    share: float) -> dict[str, str]:
    """:meth:`RangeCheck.describe` of each segment that has a cause, by name; the test is
    vectorized (in float64, as describe compares) and only the few hits become RangeChecks."""
    max_abs, nonzero, flushed = _segment_counts(flat, sizes, low_dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        shares = np.where(nonzero > 0, flushed / np.maximum(nonzero, 1).astype(np.float64), 0.0)
    hits = np.flatnonzero((max_abs.astype(np.float64) > limit) | (shares > share))
    causes = {}
    for j in hits.tolist():
        nz = int(nonzero[j])
        check = RangeCheck(float(max_abs[j]), int(flushed[j]) / nz if nz else 0.0, int(sizes[j]))
        causes[names[j]] = check.describe(names[j], limit, share)
    return causes


def constant_producers(graph: ModelIndex) -> dict[str, onnx.NodeProto]:
    """Tensor -> the Constant node that makes it, across all graphs (what :func:`constant_values` reads)."""
    return {out: node for scope in graph.scopes for node in scope.graph.node if node.op_type == "Constant"
            for out in node.output}


def constant_values(graph: ModelIndex, name: str, producers: Mapping[str, onnx.NodeProto]) -> np.ndarray | None:
    """Values of an initializer, or of a tensor a Constant node makes; None otherwise."""
    info = graph.tensors.get(name)
    if info is not None and info.init is not None:
        return tensor_array(info.init)
    node = producers.get(name)
    if node is None or node.op_type != "Constant":
        return None
    return constant_node_values(node)


def _value_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """A Constant node's ``value`` tensor, if it has one."""
    for attr in node.attribute:
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
            return attr.t
    return None


def seed_deny_from_initializer_range(state: Coloring, graph: ModelIndex, *,
                                     underflow_share: float = DEFAULT_UNDERFLOW_SHARE
                                     ) -> PassResult:
    """A list node fed by a float32 initializer or Constant whose finite |value| exceeds the
    low-precision maximum (65504 for fp16), or whose non-zero values mostly flush to zero or
    turn subnormal (below 6.1e-5 in fp16), is painted DENY: it stays float32 and taints
    downstream as a deny op does.  An attention mask's fill is not such a cause
    (:mod:`onnxmp.color.masks`)."""
    low = low_precision(state.low_name)
    limit, low_dtype = low.max, low.numpy
    view = state.view
    tensors, constant_at = graph.tensors, view.constant_at
    lst, f32, v_kind, node_first, float_io = view.lst, view.f32, view.v_kind, view.node_first, view.float_io
    listed = ("allow", "infer", "clear")
    # Each candidate: (float32 vertex ids of a listed, processed node; its float inputs that hold
    # constants, in input order).  Other inputs have no values, so no cause.
    candidates: list[tuple[list[int], list[str]]] = []
    causes: dict[str, str | None] = {}
    # Small float32 tensors are checked together from their raw bytes, CHECK_CHUNK values at a time.
    raw_names: list[str] = []
    raw_bytes: list[bytes] = []
    raw_size = 0

    def check_raw() -> None:
        nonlocal raw_size
        flat = np.frombuffer(b"".join(raw_bytes), dtype="<f4")
        sizes = [len(raw) // 4 for raw in raw_bytes]
        causes.update(_segment_causes(raw_names, flat, sizes, low_dtype, limit, underflow_share))
        raw_names.clear()
        raw_bytes.clear()
        raw_size = 0

    small: dict[str, np.ndarray] = {}  # other small constants, checked together
    constants = graph.constants.union(constant_at)
    judged: list[int] = []  # nodes whose inputs at some positions have a judge of their own
    for k, ins in enumerate(view.node_ins):
        if constants.isdisjoint(ins):
            continue
        first, end = node_first[k], node_first[k + 1]
        own = _INPUT_JUDGES.get(v_kind[first].group.op.op_type) if first < end else None
        if own is not None and v_kind[first].group.op.domain in ("", "ai.onnx"):
            judged.append(k)
            ins = tuple("" if i in own else name for i, name in enumerate(ins))
        if end - first == 1:  # the common node: one vertex
            kind = v_kind[first]
            if not (kind.float32 and kind.processed and kind.list in listed):
                continue
            vids = [first]
            float_inputs = kind.group.pick_in(ins) if first not in float_io else view.input_names(first)
        else:
            vids = [v for v in range(first, end) if f32[v]]
            if not vids or lst[first] not in listed or not any(v_kind[v].processed for v in vids):
                continue
            float_inputs = {t for v in vids for t in view.input_names(v)}
        names = []
        for name in ins:
            if name not in constants or name not in float_inputs or name in state.mask_fills:
                continue
            names.append(name)
            if name in causes or name in small:
                continue
            info = tensors.get(name)
            init = info.init if info is not None else None
            node = None
            if init is None:
                scope, position = constant_at[name]
                node = graph.scopes[scope].graph.node[position]
                init = _value_tensor(node)
            raw = None
            if init is not None:
                # The raw little-endian bytes of a small in-memory float32 tensor whose size matches
                # its dims, read inline (thousands of tiny initializers come this way).
                if node is None and info.kind == TENSOR_KIND:  # the index's dtype and (cached) shape
                    dtype, dims = info.dtype, info.shape
                else:
                    dtype, dims = init.data_type, init.dims
                if dtype == FLOAT and init.data_location != EXTERNAL:
                    size = math.prod(dims)
                    if 0 < size < BATCH_BELOW:
                        raw = init.raw_data
                        if len(raw) != 4 * size:
                            raw = None
            if raw is not None:
                causes[name] = None  # decided with the other raw ones
                raw_names.append(name)
                raw_bytes.append(raw)
                raw_size += len(raw) // 4
                if raw_size >= CHECK_CHUNK:
                    check_raw()
                continue
            values = tensor_array(init) if node is None else constant_node_values(node)
            if values is not None and 0 < values.size < BATCH_BELOW:
                small[name] = values
            else:
                causes[name] = None if values is None else \
                    check_values(values, low_dtype).describe(name, limit, underflow_share)
            del values
        if names:
            candidates.append((vids, names))
    if raw_bytes:
        check_raw()
    for name, check in zip(small, check_many(list(small.values()), low_dtype)):
        causes[name] = check.describe(name, limit, underflow_share)
    painted = 0
    if any(causes.values()):
        for vids, names in candidates:
            cause = next((causes[n] for n in names if causes.get(n)), None)
            if cause:
                for k in vids:
                    painted += state.paint(k, DENY, "seed_deny_from_initializer_range", cause)
    producers = _constants_at(graph, view) if judged else {}
    for k in judged:
        if not any(f32[vid] and v_kind[vid].processed for vid in range(node_first[k], node_first[k + 1])):
            continue
        cause = _judged_cause(graph, view, k, low, underflow_share, producers)
        if cause:
            for vid in range(node_first[k], node_first[k + 1]):
                if f32[vid] and v_kind[vid].processed:
                    painted += state.paint(vid, DENY, "seed_deny_from_initializer_range", cause)
    return PassResult(painted > 0, {"painted": painted})


def _constants_at(graph: ModelIndex, view) -> dict[str, onnx.NodeProto]:
    """Tensor -> its Constant node, from the view's positions (no walk over every node)."""
    return {name: graph.scopes[s].graph.node[i] for name, (s, i) in view.constant_at.items()}


def _node_proto(graph: ModelIndex, view, k: int) -> onnx.NodeProto:
    """The NodeProto of the view's node ``k`` (the view numbers nodes graph after graph)."""
    s = view.node_scope[k]
    return graph.scopes[s].graph.node[k - view.node_index[graph.scopes[s].names[0]]]


def _judged_cause(graph: ModelIndex, view, k: int, low, share: float, producers) -> str | None:
    """The first cause the own judges of node ``k``'s inputs find (see :data:`_INPUT_JUDGES`)."""
    node = _node_proto(graph, view, k)
    for i, judge in _INPUT_JUDGES[node.op_type].items():
        if i >= len(node.input) or not node.input[i] or graph.dtype(node.input[i]) != FLOAT:
            continue
        values = constant_values(graph, node.input[i], producers)
        if values is not None and values.size:
            cause = judge(node, node.input[i], np.asarray(values, dtype=np.float32), low, share)
            if cause:
                return cause
    return None


def _additive(node: onnx.NodeProto, name: str, values: np.ndarray, low, share: float) -> str | None:
    """A term added to the output (a bias, a mean subtracted): only its range matters.  A value
    that turns subnormal or flushes is off by less than half the smallest subnormal step (3e-8 in
    float16), far below the output's own rounding wherever the output is a normal number."""
    finite = np.abs(values[np.isfinite(values)])
    top = float(finite.max()) if finite.size else 0.0
    return f"initializer `{name}` max {top:.3g} > {low.max:g}" if top > low.max else None


def _inverse_root(node: onnx.NodeProto, name: str, values: np.ndarray, low, share: float) -> str | None:
    """A normalization's variance enters only as 1/sqrt(var + epsilon), computed in float32 by the
    kernel from the low-precision var it reads.  Its tiny values may flush or turn subnormal
    without harm where epsilon dominates them.  The variance is a cause when that factor overflows,
    or when it moves by more than one low-precision ulp of its exact value for more than ``share``
    of the channels (the share the other initializers are held to for values that flush)."""
    too_big = _additive(node, name, values, low, share)
    if too_big:
        return too_big  # var itself overflows: the factor becomes 0
    eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        exact = 1.0 / np.sqrt(values.astype(np.float64) + eps)
        rounded = 1.0 / np.sqrt(values.astype(low.numpy).astype(np.float64) + eps)
        ulp = np.abs(exact.astype(low.numpy).astype(np.float64) - np.nextafter(
            exact.astype(low.numpy), np.array(np.inf, dtype=low.numpy)).astype(np.float64))
        bad = ~(np.abs(rounded - exact) <= ulp) | ~(exact <= low.max)
        over = np.isfinite(values) & ~(exact <= low.max)
    bad &= np.isfinite(values)
    if over.any():
        j = int(np.flatnonzero(over)[0])
        return f"initializer `{name}`: 1/sqrt(var + epsilon) = {exact.flat[j]:.3g} > {low.max:g} (var {values.flat[j]:.3g})"
    if bad.sum() <= share * values.size:
        return None
    return (f"initializer `{name}`: 1/sqrt(var + epsilon) of {int(bad.sum())} of its {values.size} values moves by "
            f"more than one {low.name} ulp when var is rounded (more than {share:.0%})")


# op -> {input position: judge(node, name, values, low, share) -> cause or None}: inputs whose effect on
# the result is not that of a weight, judged by what the kernel computes from them instead of by
# the share of values that flush (BatchNormalization: scale is a weight, B and mean are added,
# var enters as 1/sqrt(var + epsilon)).
_INPUT_JUDGES = {"BatchNormalization": {2: _additive, 3: _additive, 4: _inverse_root}}


def seed_deny_from_calibration(state: Coloring, magnitudes: Mapping[str, float], threshold: float
                               ) -> PassResult:
    """A node whose float output reached |value| > threshold on calibration data is DENY.  The
    values on an attention mask's path are large because of its fill, which the rewrite replaces
    (:mod:`onnxmp.color.masks`): they seed nothing."""
    view = state.view
    masked = frozenset().union(*(fill.tensors for fill in state.mask_fills.values()))
    painted = 0
    for tensor, observed in magnitudes.items():
        vid = view.producer_of.get(tensor)
        if vid is None or not observed > threshold or tensor in masked:
            continue
        for k in view.ids_of_node(view.node_of(vid)):
            if view.f32[k]:
                painted += state.paint(k, DENY, "seed_deny_from_calibration",
                                       f"output `{tensor}` reached |x| = {observed:.3g} > {threshold:g} "
                                       "on calibration data")
    return PassResult(painted > 0, {"painted": painted})


def seed_deny_forced(state: Coloring, causes: Mapping[str, str]) -> PassResult:
    """Nodes a caller forces to float32, each with its cause, are painted DENY: the accuracy
    fallback's culprits, and the compat API's range limits."""
    view = state.view
    painted = 0
    for node, cause in causes.items():
        for k in view.ids_of_node(node):
            if view.f32[k]:
                painted += state.paint(k, DENY, "seed_deny_forced", cause)
    return PassResult(painted > 0, {"painted": painted})
