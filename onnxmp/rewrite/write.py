"""Write the converted model: the normalized model with the rewrite's edits applied, in place.

The output is the input model plus exactly what the plan (:mod:`onnxmp.rewrite.plan`) decided:

* nodes keep their order; each inserted Cast stands right after the node producing its input
  (the plan placed them), rewired nodes read and write their new names, and retargeted
  Cast/Constant/ConstantOfShape nodes make the low-precision type;
* converted initializers hold their low-precision values, and twins sit beside their float32
  source in the same graph; an attention mask fill holds its replacement value;
* every retyped tensor's declarations (value_info, graph inputs and outputs) carry the new
  element type, and each new tensor is declared with its source's shape;
* a plain dead-node sweep: nodes nothing reads on the way to a graph output go (the restore
  Casts nobody reads among them), with their declarations and the initializers only they read.

Nothing else is rebuilt: untouched nodes, initializers and declarations are the input's own
messages, so doc strings, metadata and attribute order stay as they came.  Bodies are written
before the graphs holding them, since a graph whose node list changes is refilled with copies
of its nodes, bodies included.  See ``docs/design.md`` (the rewrite contract).
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import onnx
from onnx.external_data_helper import uses_external_data

from onnxmp.color.masks import replace_fills
from onnxmp.external import constant_node_values, converted_external, tensor_array
from onnxmp.index import ModelIndex
from onnxmp.rewrite.plan import Edits, GraphNodes, NewCast

FLOAT = onnx.TensorProto.FLOAT


def write(index: ModelIndex, edits: Edits) -> tuple[onnx.ModelProto, set[str]]:
    """Apply ``edits`` to ``index.model`` (edited in place) and return it with the names of the
    inserted Casts the sweep kept."""
    if edits.mask_fills:
        replace_fills(index.model.graph, {name: fill.value for name, fill in edits.mask_fills.items()}, edits.low)
    kept_casts: set[str] = set()
    read: set[str] = set()        # every name a kept node of any graph written so far reads
    outer_reads: dict[str, set[str]] = {}  # node holding bodies -> outer names its kept bodies read
    twin_of = {source: twin for twin, source in edits.twins.items()}
    for scope in reversed(index.scopes):  # bodies first: see the module docstring
        g = scope.graph
        nodes = edits.graphs[scope.gid]
        kept = _live(nodes, [t.name for t in g.output], outer_reads)
        items = [_written(nodes, k, edits, kept_casts) for k in kept]
        reads = set(chain.from_iterable(nodes.inputs[k] for k in kept))
        for k in kept:
            reads.update(outer_reads.get(nodes.names[k], ()))
        read |= reads
        if scope.parent is not None:
            local = set(scope.inputs).union(*(nodes.outputs[k] for k in kept), (t.name for t in g.initializer))
            outer_reads.setdefault(scope.parent.name, set()).update(reads - local)
        dead = len(kept) < len(nodes.items)
        if dead or len(items) != len(g.node):
            del g.node[:]
            g.node.extend(items)
        if dead:
            produced = set(chain.from_iterable(nodes.outputs[k] for k in kept))
            _keep_only(g.value_info, lambda vi: vi.name in produced or vi.name in read)
        _write_initializers(g, edits, twin_of, read)
        _retype_declarations(g, edits)
        _declare_new_tensors(g, edits, (nodes.outputs[k] for k in kept))
    return index.model, kept_casts


def _live(nodes: GraphNodes, outputs: list[str], outer_reads: dict[str, set[str]]) -> list[int]:
    """Positions of the nodes a graph output depends on, through any chain of nodes (a node
    holding bodies also reads what its bodies read from outside), in node order: one sweep from
    the last node back, as the plan's node lists are in topological order."""
    needed = set(outputs)
    kept = []
    for k in range(len(nodes.items) - 1, -1, -1):
        if not needed.isdisjoint(nodes.outputs[k]):
            kept.append(k)
            needed.update(nodes.inputs[k])
            extra = outer_reads.get(nodes.names[k])
            if extra:
                needed.update(extra)
    kept.reverse()
    return kept


def _written(nodes: GraphNodes, k: int, edits: Edits, kept_casts: set[str]) -> onnx.NodeProto:
    """Node ``k`` as it is written: a new Cast, or the input's node with its edits applied."""
    item, name = nodes.items[k], nodes.names[k]
    if type(item) is NewCast:
        kept_casts.add(name)
        return onnx.helper.make_node("Cast", [item.src], [item.dst], name=name, to=item.to)
    if name in edits.inputs:
        del item.input[:]
        item.input.extend(edits.inputs[name])
    if name in edits.outputs:
        del item.output[:]
        item.output.extend(edits.outputs[name])
    if name in edits.retargeted:
        _retarget(item, edits)
    elif name in edits.constant_types:
        _recast_constant(item, edits.constant_types[name])
    return item


def _keep_only(field, keep) -> None:
    """Remove the messages of a repeated field for which ``keep`` is false (from the end: the
    others are not copied)."""
    for i in reversed([i for i, message in enumerate(field) if not keep(message)]):
        del field[i]


def _write_initializers(g: onnx.GraphProto, edits: Edits, twin_of: dict[str, str], read: set[str]) -> None:
    """Converted initializers in place, twins beside their sources; initializers nothing reads go
    (a graph input or output reads its own)."""
    interface = {t.name for t in chain(g.input, g.output)}
    twins = []
    for init in g.initializer:
        name = init.name
        if name in edits.converted:
            _convert(init, edits.low)
        twin = twin_of.get(name)
        if twin is not None and twin in read:
            twins.append(_raw_tensor(twin, edits.low.onnx_type, tensor_array(init).astype(edits.low.numpy)))
    g.initializer.extend(twins)
    _keep_only(g.initializer, lambda t: t.name in read or t.name in interface)


def _convert(init: onnx.TensorProto, low) -> None:
    """``init`` converted to the low type, in place (a model holds thousands of small ones)."""
    if uses_external_data(init):
        init.CopyFrom(converted_external(init, low.numpy, low.onnx_type))  # spilled to disk, not held in memory
        return
    values = tensor_array(init).astype(low.numpy)
    for typed in ("float_data", "double_data", "int32_data"):
        init.ClearField(typed)
    init.data_type = low.onnx_type
    init.raw_data = np.ascontiguousarray(values).tobytes()


def _retype_declarations(g: onnx.GraphProto, edits: Edits) -> None:
    """Every declaration of a retyped tensor takes its new element type."""
    dtypes = edits.dtypes
    if not dtypes:
        return
    for vi in chain(g.value_info, g.input, g.output):
        dtype = dtypes.get(vi.name)
        if dtype is not None and vi.type.WhichOneof("value") == "tensor_type":
            vi.type.tensor_type.elem_type = dtype


def _declare_new_tensors(g: onnx.GraphProto, edits: Edits, outputs) -> None:
    """Declare each new tensor the kept nodes write, with its source's shape."""
    new = edits.new_tensors
    if not new:
        return
    for name in chain.from_iterable(outputs):
        info = new.get(name)
        if info is None:
            continue
        vi = g.value_info.add()
        vi.name = name
        tensor_type = vi.type.tensor_type
        tensor_type.elem_type = edits.dtypes.get(name, info.dtype)
        if info.shape is not None:
            tensor_type.shape.SetInParent()
            for d in info.shape:
                dim = tensor_type.shape.dim.add()
                if isinstance(d, str):
                    dim.dim_param = d
                elif d is not None:
                    dim.dim_value = d


def _raw_tensor(name: str, data_type: int, values: np.ndarray) -> onnx.TensorProto:
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=values.shape)
    tensor.raw_data = np.ascontiguousarray(values).tobytes()
    return tensor


def _retarget(node: onnx.NodeProto, edits: Edits) -> None:
    """An op whose float32 output type comes from an attribute now makes the low-precision type
    (TF's make_casts_allow_if_all_outputs_allow, extended to Constant and ConstantOfShape)."""
    low = edits.low
    attrs = {a.name: a for a in node.attribute}
    if node.op_type == "Cast":
        attrs["to"].i = low.onnx_type
        return
    if "value" in attrs or "sparse_value" in attrs:
        value = attrs["value"].t if "value" in attrs else attrs["sparse_value"].sparse_tensor.values
        value.CopyFrom(_raw_tensor(value.name, low.onnx_type, tensor_array(value).astype(low.numpy)))
        return
    # A Constant's float attributes become a value tensor; ConstantOfShape's default is a float32 zero.
    values = constant_node_values(node) if node.op_type == "Constant" else None
    values = np.zeros((1,), dtype=np.float32) if values is None else values
    for attr in [a for a in node.attribute if a.name in ("value_float", "value_floats")]:
        node.attribute.remove(attr)
    node.attribute.append(onnx.helper.make_attribute(
        "value", _raw_tensor(node.output[0] + "_value", low.onnx_type, values.astype(low.numpy))))


def _recast_constant(node: onnx.NodeProto, to: int) -> None:
    """A Constant whose Cast was folded holds its values in the Cast's type (exact: idle.py checked)."""
    values = constant_node_values(node)
    for attr in [a for a in node.attribute if a.name.startswith("value")]:
        node.attribute.remove(attr)
    node.attribute.append(onnx.helper.make_attribute(
        "value", _raw_tensor(node.output[0] + "_value", to, values.astype(onnx.helper.tensor_dtype_to_np_dtype(to)))))
