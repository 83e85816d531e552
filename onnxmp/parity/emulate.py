"""Run low-precision models on the ONNX Runtime CPU EP with low-precision numerics.

The ORT CPU EP has almost no float16 or bfloat16 compute kernels.  It still
loads an fp16 model, but by wrapping each kernel-less region in Casts to
float32 and dropping the Cast pairs between regions, so the intermediates stay
float32 and fp16 overflow never shows (300 * 300 stays 90000).

:func:`emulate` rewrites such a model so that every low-precision tensor
becomes a float32 tensor holding values exactly representable in the
low-precision type:

* after every node that produced a low-precision tensor, a ``Cast(to=FLOAT16)``
  -> ``Cast(to=FLOAT)`` pair rounds the float32 result, which reproduces fp16
  rounding, overflow to inf and underflow to 0 (the compute itself happens in
  float32, like the fp32 accumulation of a GPU's fp16 kernels);
* ops that only move or select values (Reshape, Concat, Relu, If, ...) get
  no pair: their outputs are already representable;
* an existing ``Cast(to=FLOAT16)`` stays and is followed by ``Cast(to=FLOAT)``
  (unless only Casts read it: then it already is a rounding step);
* low-precision initializers and constant attribute tensors become float32
  (exact: the values are already representable);
* ``to``/``dtype`` attributes naming the low-precision type (RandomNormal,
  EyeLike, ...) are retargeted to FLOAT; the rounding pair follows;
* If/Loop/Scan bodies are rewritten recursively, their formal inputs, outputs
  and value_info retyped to float32;
* a subgraph onnxruntime fuses on the CUDA EP into one normalization kernel that
  computes in float32 (a decomposed LayerNorm, :mod:`onnxmp.fusions`) is computed as
  that kernel does: in float32 throughout, rounded once at its output (the Casts ORT
  absorbs round nothing).

Interface: with ``keep_io_types=True`` (the default) main-graph inputs and
outputs keep their names and low-precision dtypes, so the emulated model is a
drop-in replacement: an input is Cast to float32 right after it enters, an
output is Cast back right before it leaves.  ``keep_io_types=False`` turns
them into float32 instead, rounding inputs on entry; use that where the caller
cannot feed the low-precision type (onnxruntime's Python API has no bfloat16).
"""
from __future__ import annotations

import logging
import os

import numpy as np
import onnx
import onnx.inliner
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from onnxmp.domains import is_onnx_domain
from onnxmp.errors import OnnxMPError
from onnxmp.fusions import inside_fused_kernels
from onnxmp.subgraphs import bodies
from onnxmp.external import SKELETON_TENSOR_BYTES, is_large, read_external, spilled
from onnxmp.external import info as external_info
from onnxmp.precision import BY_ONNX_TYPE, LOW, low_precision
from onnxmp.naming import FreshNames, proto_names
from onnxmp.load import as_model
from onnxmp.normalize import infer_tensor_types

log = logging.getLogger("onnxmp.emulate")


# Default-domain ops whose low-precision outputs only copy or select input
# values (or constants) that are already representable, so rounding them again
# would change nothing; skipping them keeps the emulated graph small.
_EXACT_OPS = frozenset({
    "Constant", "ConstantOfShape", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze",
    "Transpose", "Expand", "Tile", "Concat", "Split", "Slice", "Gather", "GatherElements",
    "GatherND", "Compress", "Where", "Pad", "DepthToSpace", "SpaceToDepth", "MaxPool",
    "ReduceMax", "ReduceMin", "TopK", "Relu", "Max", "Min", "Abs", "Neg",
    "If", "Loop", "Scan", "SequenceAt",
})


def low_precision_types(model: onnx.ModelProto | str | os.PathLike) -> list[str]:
    """Names of the low-precision float types (``"float16"``, ``"bfloat16"``) the model uses.

    A low-precision tensor can only come from a declared type, an initializer,
    a constant attribute or a dtype attribute, so a structural scan (subgraphs
    and local functions included) finds every one without type inference.  An
    emulated model still lists its precision: its rounding Casts name it.
    """
    model = as_model(model)
    return [p.name for p in LOW.values() if _uses(model, p.onnx_type)]


def emulated_precisions(model: onnx.ModelProto | str | os.PathLike, requested: str | None = None,
                        name: str = "the model") -> list[str]:
    """The low-precision types to emulate in ``model``: those it holds, or ``requested`` if it holds that.

    A ``requested`` type the model does not hold is an error (emulating it would
    silently leave the real low-precision tensors in place); a model holding
    neither type, or both, gets a warning.
    """
    found = low_precision_types(model)
    if requested is not None:
        low_precision(requested)  # an unknown name is an error of its own
        if requested not in found:
            held = " and ".join(found) + " tensors" if found else "no float16 or bfloat16 tensors"
            raise OnnxMPError(f"{requested} was asked for, but {name} holds {held}",
                              hint="omit --precision: the model's own precision is detected")
        return [requested]
    if not found:
        log.warning("%s holds no float16 or bfloat16 tensors; writing it unchanged", name)
    elif len(found) > 1:
        log.warning("%s holds both float16 and bfloat16 tensors; emulating both", name)
    return found


def emulate(model: onnx.ModelProto | str | os.PathLike, precision: str = "float16", *,
            keep_io_types: bool = True) -> onnx.ModelProto:
    """Return a copy of ``model`` whose ``precision`` tensors are float32 holding rounded values.

    A model that does not use ``precision`` comes back unchanged (an equal
    copy).  To emulate a model that mixes float16 and bfloat16, apply this once
    per precision.
    """
    elem = low_precision(precision).onnx_type
    source = as_model(model)
    result = onnx.ModelProto()
    result.CopyFrom(source)
    if not _uses(result, elem):
        return result
    if any(_uses_function(f, elem) for f in result.functions):
        # Function bodies are typed at each call site; inlining lets the plain
        # per-node rewrite see the concrete types.
        result = onnx.inliner.inline_local_functions(result)
    types = infer_tensor_types(result)
    _Emulator(elem, types, FreshNames(proto_names(result.graph)), is_large(result),
              inside_fused_kernels(result.graph)).main_graph(result.graph, keep_io_types)
    return result


# --- detection -------------------------------------------------------------------


def _type_uses(tp: onnx.TypeProto, elem: int) -> bool:
    which = tp.WhichOneof("value")
    if which in ("tensor_type", "sparse_tensor_type"):
        return getattr(tp, which).elem_type == elem
    if which in ("sequence_type", "optional_type"):
        return _type_uses(getattr(tp, which).elem_type, elem)
    if which == "map_type":
        return _type_uses(tp.map_type.value_type, elem)
    return False


def _node_uses(node: onnx.NodeProto, elem: int) -> bool:
    for attr in node.attribute:
        if attr.type == AttributeProto.INT and attr.name in ("to", "dtype") and attr.i == elem:
            return True
        if attr.type == AttributeProto.TENSOR and attr.t.data_type == elem:
            return True
        if attr.type == AttributeProto.TENSORS and any(t.data_type == elem for t in attr.tensors):
            return True
        if attr.type == AttributeProto.SPARSE_TENSOR and attr.sparse_tensor.values.data_type == elem:
            return True
        if attr.type == AttributeProto.TYPE_PROTO and _type_uses(attr.tp, elem):
            return True
        if attr.type == AttributeProto.TYPE_PROTOS and any(_type_uses(t, elem) for t in attr.type_protos):
            return True
    return any(_graph_uses(g, elem) for g in bodies(node))


def _graph_uses(graph: onnx.GraphProto, elem: int) -> bool:
    values = [*graph.input, *graph.output, *graph.value_info]
    return (any(_type_uses(v.type, elem) for v in values)
            or any(t.data_type == elem for t in graph.initializer)
            or any(s.values.data_type == elem for s in graph.sparse_initializer)
            or any(_node_uses(n, elem) for n in graph.node))


def _uses_function(function: onnx.FunctionProto, elem: int) -> bool:
    return any(_node_uses(n, elem) for n in function.node) or any(
        _type_uses(v.type, elem) for v in function.value_info)


def _uses(model: onnx.ModelProto, elem: int) -> bool:
    return _graph_uses(model.graph, elem) or any(_uses_function(f, elem) for f in model.functions)


# --- rewriting -----------------------------------------------------------------


def _retype(tp: onnx.TypeProto, elem: int) -> bool:
    """Turn every ``elem`` inside ``tp`` into FLOAT; return whether anything changed."""
    which = tp.WhichOneof("value")
    if which in ("tensor_type", "sparse_tensor_type"):
        inner = getattr(tp, which)
        if inner.elem_type == elem:
            inner.elem_type = TensorProto.FLOAT
            return True
        return False
    if which in ("sequence_type", "optional_type"):
        return _retype(getattr(tp, which).elem_type, elem)
    if which == "map_type":
        return _retype(tp.map_type.value_type, elem)
    return False


def _to_float(tensor: TensorProto, spill: bool = False) -> TensorProto:
    """``tensor`` as float32; with ``spill`` (a large model) a big one goes to a spill file, as
    conversion's tensors do, so the emulated model never holds its weights in memory."""
    if tensor.data_location == TensorProto.EXTERNAL:
        if not os.path.isabs(external_info(tensor).get("location", "")):
            raise OnnxMPError(f"tensor {tensor.name!r} keeps its data in an external file that is not loaded",
                              "pass the model's path, or load it with onnxmp.load(path)")
        # Read as a whole in-memory tensor, one at a time, so numpy_helper decodes every dtype.
        loaded = TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
        loaded.raw_data = read_external(tensor).tobytes()
        values, spill = numpy_helper.to_array(loaded).astype(np.float32), True
        del loaded
    else:
        values = numpy_helper.to_array(tensor).astype(np.float32)
    if spill and values.nbytes > SKELETON_TENSOR_BYTES:
        converted = spilled(tensor.name, values, TensorProto.FLOAT)
    else:
        converted = numpy_helper.from_array(values, tensor.name)
    converted.doc_string = tensor.doc_string
    converted.metadata_props.extend(tensor.metadata_props)
    return converted


def _read_by_non_casts(graph: onnx.GraphProto, outputs: bool = True) -> set[str]:
    """Tensors read by a non-Cast node of ``graph``, by a subgraph, or (if ``outputs``) by the caller."""
    readers = {v.name for v in graph.output} if outputs else set()
    for node in graph.node:
        if not (node.op_type == "Cast" and is_onnx_domain(node.domain)):
            readers.update(node.input)
        for sub in bodies(node):
            readers |= proto_names(sub)  # a superset of the outer names it reads: safe
    return readers


def _cast_target(node: onnx.NodeProto) -> int:
    return next((attr.i for attr in node.attribute if attr.name == "to"), TensorProto.UNDEFINED)


def _rename(graph: onnx.GraphProto, mapping: dict[str, str], *, outputs: bool) -> None:
    """Rename tensors in ``graph`` and its subgraphs (whose outputs may name outer values)."""
    for node in graph.node:
        for field in (node.input, node.output):
            for i, name in enumerate(field):
                if name in mapping:
                    field[i] = mapping[name]
        for sub in bodies(node):
            _rename(sub, mapping, outputs=True)
    for value in [*graph.value_info, *graph.initializer, *(s.values for s in graph.sparse_initializer)]:
        value.name = mapping.get(value.name, value.name)
    if outputs:
        for value in graph.output:
            value.name = mapping.get(value.name, value.name)


class _Emulator:
    def __init__(self, elem: int, types: dict[str, onnx.TypeProto], namer: FreshNames, spill: bool = False,
                 unrounded: set[str] = frozenset()):
        self.elem = elem
        self.unrounded = unrounded  # tensors computed inside a fused float32 kernel
        self.spill = spill
        self.tag = BY_ONNX_TYPE[elem].tag
        self.types = types
        self.name = namer

    def _is_low(self, name: str) -> bool:
        tp = self.types.get(name)
        return tp is not None and tp.HasField("tensor_type") and tp.tensor_type.elem_type == self.elem

    def _cast(self, src: str, dst: str, to: int) -> onnx.NodeProto:
        tag = "f32" if to == TensorProto.FLOAT else self.tag
        return helper.make_node("Cast", [src], [dst], name=self.name(f"{dst}__emu_cast_{tag}"), to=to)

    def _round(self, src: str, dst: str) -> list[onnx.NodeProto]:
        """``src`` (float32) -> low precision -> ``dst`` (float32)."""
        low = self.name(f"{dst}__emu_{self.tag}")
        return [self._cast(src, low, self.elem), self._cast(low, dst, TensorProto.FLOAT)]

    def graph(self, graph: onnx.GraphProto, keep_output_types: bool = False) -> None:
        for i, init in enumerate(graph.initializer):
            if init.data_type == self.elem:
                graph.initializer[i].CopyFrom(_to_float(init, self.spill))
        for sparse in graph.sparse_initializer:
            if sparse.values.data_type == self.elem:
                sparse.values.CopyFrom(_to_float(sparse.values, self.spill))
        for value in graph.value_info:
            _retype(value.type, self.elem)
        needs_float = _read_by_non_casts(graph, outputs=not keep_output_types)
        kept_low: set[str] = set()
        nodes = [new for node in graph.node for new in self._node(node, needs_float, kept_low)]
        graph.ClearField("node")
        graph.node.extend(nodes)
        for value in graph.value_info:
            if value.name in kept_low and value.type.HasField("tensor_type"):
                value.type.tensor_type.elem_type = self.elem  # still written in the low type

    def _subgraph(self, graph: onnx.GraphProto) -> None:
        # Formal inputs/outputs of bodies are internal tensors: plain float32,
        # fed by and feeding already rounded values, so they need no Casts.
        for value in [*graph.input, *graph.output]:
            _retype(value.type, self.elem)
        self.graph(graph)

    def _node(self, node: onnx.NodeProto, needs_float: set[str], kept_low: set[str]) -> list[onnx.NodeProto]:
        default_domain = is_onnx_domain(node.domain)
        is_cast = default_domain and node.op_type == "Cast"
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                self._subgraph(attr.g)
            elif attr.type == AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    self._subgraph(sub)
            elif attr.type == AttributeProto.TENSOR and attr.t.data_type == self.elem:
                attr.t.CopyFrom(_to_float(attr.t, self.spill))
            elif attr.type == AttributeProto.TENSORS:
                for t in attr.tensors:
                    if t.data_type == self.elem:
                        t.CopyFrom(_to_float(t, self.spill))
            elif attr.type == AttributeProto.SPARSE_TENSOR and attr.sparse_tensor.values.data_type == self.elem:
                attr.sparse_tensor.values.CopyFrom(_to_float(attr.sparse_tensor.values, self.spill))
            elif attr.type == AttributeProto.TYPE_PROTO:
                _retype(attr.tp, self.elem)
            elif attr.type == AttributeProto.TYPE_PROTOS:
                for tp in attr.type_protos:
                    _retype(tp, self.elem)
            elif (attr.type == AttributeProto.INT and attr.name in ("to", "dtype") and attr.i == self.elem
                  and not is_cast):
                attr.i = TensorProto.FLOAT

        if default_domain and node.op_type in _EXACT_OPS:
            return [node]
        if self.unrounded.intersection(node.output):
            if is_cast:  # a Cast the fused kernel absorbs: it rounds nothing there
                next(a for a in node.attribute if a.name == "to").i = TensorProto.FLOAT
            return [node]
        rewritten = [node]
        for k, out in enumerate(node.output):
            if not out or not self._is_low(out):
                continue
            if is_cast and out not in needs_float:
                # A Cast to the low type read only by Casts is already a
                # rounding step that ORT CPU can run (a converter's output
                # Cast, or an emulated model emulated again).
                kept_low.add(out)
                continue
            if is_cast:
                # Casting straight from the source type keeps the single
                # rounding of the real model (double -> fp16 is not double ->
                # float -> fp16); only the way back to float32 is added.
                low = self.name(f"{out}__emu_{self.tag}")
                node.output[k] = low
                rewritten.append(self._cast(low, out, TensorProto.FLOAT))
            else:
                raw = self.name(f"{out}__emu_f32")
                node.output[k] = raw
                rewritten.extend(self._round(raw, out))
        return rewritten

    def main_graph(self, graph: onnx.GraphProto, keep_io_types: bool) -> None:
        self.graph(graph, keep_output_types=keep_io_types)
        initializers = {t.name for t in graph.initializer}
        inputs = {v.name for v in graph.input}
        needs_float = _read_by_non_casts(graph)
        head: list[onnx.NodeProto] = []
        renames: dict[str, str] = {}
        for value in graph.input:
            if value.name in initializers:
                # An IR < 4 initializer listed as input: the initializer is float32 now.
                _retype(value.type, self.elem)
                continue
            if not self._is_low(value.name):
                if not keep_io_types:
                    _retype(value.type, self.elem)
                elif _type_uses(value.type, self.elem):
                    raise OnnxMPError(
                        f"graph input {value.name!r} is a non-tensor type holding {self.tag} values",
                        "emulate with keep_io_types=False to make it float32")
                continue
            if keep_io_types and value.name not in needs_float:
                continue  # ORT CPU casts from the low type; nothing else reads it
            inner = self.name(f"{value.name}__emu_f32")
            renames[value.name] = inner
            if keep_io_types:
                head.append(self._cast(value.name, inner, TensorProto.FLOAT))
            else:
                _retype(value.type, self.elem)
                head.extend(self._round(value.name, inner))
        _rename(graph, renames, outputs=False)

        tail: list[onnx.NodeProto] = []
        renames = {}
        low_casts = {node.output[0] for node in graph.node if node.op_type == "Cast"
                     and is_onnx_domain(node.domain) and _cast_target(node) == self.elem}
        for value in graph.output:
            if not keep_io_types:
                _retype(value.type, self.elem)
                continue
            if value.name in inputs or value.name in renames or value.name in low_casts:
                continue  # a pass-through input, or already Cast to the low type
            if not self._is_low(value.name):
                if _type_uses(value.type, self.elem):
                    raise OnnxMPError(
                        f"graph output {value.name!r} is a non-tensor type holding {self.tag} values",
                        "emulate with keep_io_types=False to make it float32")
                continue
            inner = self.name(f"{value.name}__emu_f32")
            renames[value.name] = inner
            tail.append(self._cast(inner, value.name, self.elem))
        _rename(graph, renames, outputs=False)

        nodes = [*head, *graph.node, *tail]
        graph.ClearField("node")
        graph.node.extend(nodes)
