"""The conversion under every compat function: onnxmp's coloring, steered by the originals' arguments.

See :mod:`onnxmp.compat` for what each argument does here and how it differs from the originals.
"""
from __future__ import annotations

import logging
import re
from typing import Iterable

import numpy as np
import onnx

from onnxmp.color.seeds import constant_producers, constant_values
from onnxmp.errors import OnnxMPError
from onnxmp.external import skeleton
from onnxmp.index import ModelIndex
from onnxmp.domains import op_key
from onnxmp.lists import is_known_op_type, is_onnx_op, list_of, resolve_lists, unknown_op
from onnxmp.load import ModelLike, load
from onnxmp.normalize import normalize
from onnxmp.options import DEFAULT_UNDERFLOW_SHARE, Options
from onnxmp.pipeline import convert_once

log = logging.getLogger("onnxmp.compat")


class CompatError(OnnxMPError, ValueError):
    """Where the originals raise ValueError, the compat functions raise this: callers catching
    ValueError keep working, and onnxmp's CLI shows it as any OnnxMPError."""


def steering(model: onnx.ModelProto, *, min_positive_val: float, max_finite_val: float, keep_io_types,
             op_block_list: Iterable[str] | None, node_block_list: Iterable[str] | None) -> Options:
    """The :class:`~onnxmp.options.Options` fields that say what the originals' arguments say."""
    graph = normalize(load(model)).index  # normalize edits its argument; `model` is converted later
    lists = _deny_ops(graph, op_block_list)
    return Options(keep_io_types=io_names(model, keep_io_types), lists=lists,
                   block_nodes=[rf"\A{re.escape(name)}\Z" for name in _existing_nodes(graph, node_block_list)],
                   forced_deny=_out_of_range_readers(graph, lists, min_positive_val, max_finite_val))


def convert_model(model: ModelLike, *, min_positive_val: float, max_finite_val: float, keep_io_types,
                  op_block_list: Iterable[str] | None, node_block_list: Iterable[str] | None) -> onnx.ModelProto:
    original = load(model)
    # convert_once normalizes again; node names are deterministic, so the names found here are
    # the ones it will see.
    options = steering(original, min_positive_val=min_positive_val, max_finite_val=max_finite_val,
                       keep_io_types=keep_io_types, op_block_list=op_block_list, node_block_list=node_block_list)
    return convert_once(original, options).model


def returned(model: ModelLike, result: onnx.ModelProto, disable_shape_infer: bool) -> onnx.ModelProto:
    """What the originals return: with ``disable_shape_infer=True`` they edit a ModelProto argument
    in place, so it is updated as well."""
    if disable_shape_infer and isinstance(model, onnx.ModelProto):
        model.CopyFrom(result)
        return model
    return result


def io_names(model: onnx.ModelProto, keep_io_types) -> bool | list[str]:
    """``keep_io_types`` for onnxmp: a bool as it is; a list (onnxruntime's form) names inputs and
    outputs exactly, and names the model does not have are ignored, as onnxruntime ignores them."""
    if isinstance(keep_io_types, (bool, np.bool_)) or keep_io_types is None:
        return bool(keep_io_types)
    names = {v.name for v in list(model.graph.input) + list(model.graph.output)}
    wanted = [keep_io_types] if isinstance(keep_io_types, str) else list(keep_io_types)
    missing = [n for n in wanted if n not in names]
    if missing:
        log.warning("keep_io_types: no graph input or output is named %s; ignored", ", ".join(map(repr, missing)))
    return [re.escape(n) for n in wanted if n in names]


def is_fp16_ready(model: onnx.ModelProto) -> bool:
    """onnxconverter-common's check_if_fp16_ready: after type inference the main graph declares a
    float16 input, output or value, holds a float16 initializer, or Casts to float16."""
    FLOAT16 = onnx.TensorProto.FLOAT16
    if any(t.data_type == FLOAT16 for t in model.graph.initializer):
        return True
    if any(n.op_type == "Cast" and any(a.name == "to" and a.i == FLOAT16 for a in n.attribute)
           for n in model.graph.node):
        return True
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton(model))
    except Exception:  # noqa: BLE001 (inference trouble is convert's to report)
        inferred = model
    g = inferred.graph
    return any(v.type.tensor_type.elem_type == FLOAT16 for v in [*g.input, *g.output, *g.value_info])


def check_fp16_ready(model: onnx.ModelProto) -> None:
    if is_fp16_ready(model):
        raise CompatError("The model is already converted to float16, if convert again, the model might be wrong.",
                          hint="If you are sure to convert again, please set check_fp16_ready=False (onnxmp's "
                               "conversion leaves float16 parts as they are)")


def _existing_nodes(graph: ModelIndex, names: Iterable[str] | None) -> list[str]:
    names = list(names or ())
    present = {n.name for scope in graph.scopes for n in scope.graph.node}
    for name in names:
        if name not in present:
            log.warning("node_block_list: no node is named %r; nothing is blocked by it", name)
    return [name for name in names if name in present]


def _deny_ops(graph: ModelIndex, op_block_list: Iterable[str] | None) -> dict[str, list[str]]:
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


def _out_of_range_readers(graph: ModelIndex, lists, min_positive_val: float, max_finite_val: float
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
