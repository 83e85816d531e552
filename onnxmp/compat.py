"""Drop-in replacement for onnxconverter-common's ``float16.convert_float_to_float16``.

Same signature and defaults as onnxconverter-common 1.16; the conversion is
onnxmp's (TF's AMP coloring: allow/infer/deny/clear lists), for CUDA float16.
Where the behaviour intentionally differs:

* **No clamping.** onnxconverter-common clamps initializer values into
  ``[min_positive_val, max_finite_val]`` (``1e-7``/``1e4`` by default), so a
  BatchNorm variance of 9.8e7 silently becomes 1e4.  onnxmp never changes a
  value: a node of the allow, infer or clear list fed by a float32 initializer
  or Constant with a finite ``|value| > max_finite_val``, or with more than
  half of its non-zero values below ``min_positive_val`` in magnitude, stays
  float32 (painted deny, so its downstream stays float32 too).  onnxmp's own
  range seed for fp16's real limits (above 65504; mostly flushed to zero or
  subnormal) always applies as well, so a ``max_finite_val`` above 65504 does
  not let larger values into fp16.
* **Not everything goes fp16.** Only what TF's AMP lists allow: allow ops
  (Conv, MatMul, Gemm, ...) and the infer/clear ops between them, where the
  CUDA EP has an fp16 kernel.  A model with no allow op comes back unchanged.
* **op_block_list** adds ops to the deny list (and takes them off the other
  lists): a blocked op stays float32 *and* keeps the infer/clear ops it feeds
  in float32, as TF's deny list does.  ``None`` means onnxmp's default lists,
  not onnxconverter-common's ``DEFAULT_OP_BLOCK_LIST``: of that list, Range,
  CumSum and RandomUniformLike are on onnxmp's deny list, the ai.onnx.ml ops
  and RoiAlign/NonMaxSuppression are on no list (so stay float32), and TopK,
  Resize, Upsample, Min and Max are clear (they follow their neighbours).
  Ops match by type in any domain, as in onnxconverter-common.
* **node_block_list** names nodes that stay float32 (exact names).  They do
  not taint their neighbours.
* Typos are reported, not ignored: an ``op_block_list`` entry that is neither an
  op type in the model nor one onnx or onnxruntime knows (in any domain) is an
  :class:`onnxmp.OnnxMPError` with the closest names as a hint; a
  ``node_block_list`` name that no node has is a logged warning.
* **keep_io_types** defaults to False as in onnxconverter-common, but False
  does not force every float graph input and output to fp16: each takes the
  type its readers or producer get (fp16 where they all run in fp16, float32
  otherwise).  Pass True for an interface identical to the original model.
* **check_fp16_ready** is accepted and ignored: onnxmp's conversion is
  idempotent (converting a converted model changes nothing, and fp16 tensors
  are never touched), so there is no error to raise for an fp16 model.
* **disable_shape_infer** is accepted and ignored: onnxmp needs tensor types,
  and its shape inference already tolerates failures (vertices whose type stays
  unknown are left float32).
* Nodes and initializers that no graph output depends on are dropped when
  the model changes; onnxconverter-common keeps them.
* The result is a new ModelProto; the argument is never modified.  Besides a
  ModelProto, a path or serialized bytes are accepted.  Errors are
  :class:`onnxmp.OnnxMPError`.
"""
from __future__ import annotations

import logging
import re
from typing import Iterable

import numpy as np
import onnx

from onnxmp.color.seeds import DEFAULT_UNDERFLOW_SHARE, constant_producers, constant_values
from onnxmp.convert import convert_once
from onnxmp.graphs import ModelGraph
from onnxmp.lists import is_known_op_type, is_onnx_op, list_of, op_key, resolve_lists, unknown_op
from onnxmp.load import ModelLike, load
from onnxmp.normalize import normalize

log = logging.getLogger("onnxmp.compat")


def convert_float_to_float16(
    model: ModelLike,
    min_positive_val: float = 1e-7,
    max_finite_val: float = 1e4,
    keep_io_types: bool = False,
    disable_shape_infer: bool = False,
    op_block_list: Iterable[str] | None = None,
    node_block_list: Iterable[str] | None = None,
    check_fp16_ready: bool = True,
) -> onnx.ModelProto:
    """Convert ``model`` to mixed float16 with onnxmp; see the module docstring for differences."""
    original = load(model)
    # convert_once normalizes again; node names are deterministic, so the
    # names found here are the ones it will see.
    graph = normalize(load(original)).graph  # normalize edits its argument; `original` is converted below
    lists = _deny_ops(graph, op_block_list)
    block_nodes = [rf"\A{re.escape(name)}\Z" for name in _existing_nodes(graph, node_block_list)]
    forced = _out_of_range_readers(graph, lists, min_positive_val, max_finite_val)
    result = convert_once(original, keep_io_types=bool(keep_io_types), lists=lists, block_nodes=block_nodes,
                          forced_deny=forced)
    return result.model


def _existing_nodes(graph: ModelGraph, names: Iterable[str] | None) -> list[str]:
    names = list(names or ())
    present = {n.name for scope in graph.scopes for n in scope.graph.node}
    for name in names:
        if name not in present:
            log.warning("node_block_list: no node is named %r; nothing is blocked by it", name)
    return [name for name in names if name in present]


def _deny_ops(graph: ModelGraph, op_block_list: Iterable[str] | None) -> dict[str, list[str]]:
    blocked = set(op_block_list or ())
    if not blocked:
        return {}
    in_model = {n.op_type for scope in graph.scopes for n in scope.graph.node}
    for op in sorted(blocked):
        # onnxconverter-common's own DEFAULT_OP_BLOCK_LIST names ai.onnx.ml ops: known, so fine.
        if op not in in_model and not is_known_op_type(op):
            raise unknown_op(op, "op_block_list")
    # onnxconverter-common matches op_type in every domain; onnxmp's lists key
    # other domains as "domain:OpType".
    ops = {op for op in blocked if is_onnx_op(op)}
    for scope in graph.scopes:
        ops.update(op_key(n.op_type, n.domain or "") for n in scope.graph.node if n.op_type in blocked)
    ops = sorted(ops)
    return {"deny_add": ops, "allow_remove": ops, "infer_remove": ops, "clear_remove": ops}


def _out_of_range_readers(graph: ModelGraph, lists, min_positive_val: float, max_finite_val: float
                          ) -> dict[str, str]:
    """Node name -> cause, for list nodes reading a float32 constant outside the given range."""
    resolved = resolve_lists("cuda", "float16", "default", lists)
    producers = constant_producers(graph)
    causes: dict[str, str | None] = {}
    forced: dict[str, str] = {}
    for scope in graph.scopes:
        for node in scope.graph.node:
            if list_of(op_key(node.op_type, node.domain or ""), resolved) not in ("allow", "infer", "clear"):
                continue
            for name in node.input:
                values = constant_values(graph, name, producers) if name else None
                if values is None or values.dtype != np.float32:
                    continue
                if name not in causes:
                    causes[name] = _range_cause(name, values, min_positive_val, max_finite_val)
                if causes[name]:
                    forced[node.name] = causes[name]
                    break
    return forced


def _range_cause(name: str, values: np.ndarray, min_positive_val: float, max_finite_val: float) -> str | None:
    magnitudes = np.abs(values[np.isfinite(values)])
    if magnitudes.size and magnitudes.max() > max_finite_val:
        return f"initializer `{name}` max {magnitudes.max():.3g} > max_finite_val {max_finite_val:g}"
    nonzero = magnitudes[magnitudes != 0]
    tiny = float(np.mean(nonzero < min_positive_val)) if nonzero.size else 0.0
    if tiny > DEFAULT_UNDERFLOW_SHARE:  # the built-in underflow seed's share
        return (f"initializer `{name}`: {tiny:.0%} of its non-zero values are below "
                f"min_positive_val {min_positive_val:g}")
    return None
