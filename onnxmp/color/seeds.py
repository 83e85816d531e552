"""Deny seeds from data (spec §4; onnxmp's addition, not in TF).

A node whose float32 initializer or Constant input cannot be represented in the
low-precision type is painted DENY before propagation, instead of being
silently clamped the way plain converters do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs

from onnxmp.color.rules import DENY, Coloring
from onnxmp.external import constant_array
from onnxmp.graphs import iter_graphs
from onnxmp.passes import PassResult

DEFAULT_UNDERFLOW_SHARE = 0.5     # share of an initializer's values that may flush or turn subnormal
DEFAULT_THRESHOLD = 65504.0 / 4   # calibration: |x| above which an intermediate's node is denied

LOW_LIMITS = {
    "float16": (float(np.finfo(np.float16).max), np.float16),
    "bfloat16": (float(ml_dtypes.finfo(ml_dtypes.bfloat16).max), ml_dtypes.bfloat16),
}


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
    tiny = ml_dtypes.finfo(low_dtype).tiny  # smallest normal number
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


def _constant_values(tensor: gs.Tensor) -> np.ndarray | None:
    if isinstance(tensor, gs.Constant):
        return constant_array(tensor)
    if isinstance(tensor, gs.Variable) and tensor.inputs and tensor.inputs[0].op == "Constant":
        value = tensor.inputs[0].attrs.get("value")
        if isinstance(value, gs.Constant):
            return np.asarray(value.values)
        for attr in ("value_float", "value_floats"):
            if attr in tensor.inputs[0].attrs:
                return np.asarray(tensor.inputs[0].attrs[attr], dtype=np.float32)
    return None


def seed_deny_from_initializer_range(state: Coloring, graph: gs.Graph, *,
                                     underflow_share: float = DEFAULT_UNDERFLOW_SHARE
                                     ) -> PassResult:
    """A list node fed by a float32 initializer or Constant whose finite |value| exceeds the
    low-precision maximum (65504 for fp16), or whose non-zero values mostly flush to zero or
    turn subnormal (below 6.1e-5 in fp16), is painted DENY: it stays float32 and taints
    downstream as a deny op does."""
    limit, low_dtype = LOW_LIMITS[state.low_name]
    view = state.view
    painted = 0
    checked: dict[str, str | None] = {}
    for _, g, _ in iter_graphs(graph):
        for node in g.nodes:
            keys = [k for k in view.node_vertices.get(node.name, []) if view.vertices[k].float32]
            if not keys or view.vertices[keys[0]].list not in ("allow", "infer", "clear"):
                continue
            if not any(view.vertices[k].processed for k in keys):
                continue
            float_inputs = {t for k in keys for _, t in view.vertices[k].inputs}
            for tensor in node.inputs:
                if tensor.name not in float_inputs:
                    continue
                if tensor.name not in checked:
                    values = _constant_values(tensor)
                    checked[tensor.name] = None if values is None else \
                        check_values(values, low_dtype).describe(tensor.name, limit, underflow_share)
                cause = checked[tensor.name]
                if cause:
                    for k in keys:
                        painted += state.paint(k, DENY, "seed_deny_from_initializer_range", cause)
                    break
    return PassResult(painted > 0, {"painted": painted})


def seed_deny_from_calibration(state: Coloring, magnitudes: Mapping[str, float], threshold: float
                               ) -> PassResult:
    """A node whose float output reached |value| > threshold on calibration data is DENY."""
    view = state.view
    painted = 0
    for tensor, observed in magnitudes.items():
        key = view.producer_of.get(tensor)
        if key is None or not observed > threshold:
            continue
        node = view.vertices[key].node
        for k in view.node_vertices.get(node, []):
            if view.vertices[k].float32:
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
        for k in view.node_vertices.get(node, []):
            if view.vertices[k].float32:
                painted += state.paint(k, DENY, "seed_deny_forced", cause)
    return PassResult(painted > 0, {"painted": painted})
