"""Stage 4: rewrite.  Apply a coloring to the graph (spec §6).

* Output tensors of ALLOW vertices are retyped to the low-precision type.
* At each boundary one Cast per (source tensor, target type, graph) is placed
  after the producer and shared by every consumer that needs it.
* Initializers read only by ALLOW vertices are stored in low precision; one
  read by both sides keeps its fp32 original and gets a low-precision twin.
  Master weights (training) always stay fp32 and are Cast at use.
* Tensors whose name the outside world sees (graph inputs/outputs with
  ``keep_io_types``, body formal I/O, outer-scope tensors read by a body) keep
  their name and dtype: the low-precision producer writes a renamed tensor and
  a Cast restores the original name.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxmp.color.rules import Coloring
from onnxmp.external import ConvertedValues, ExternalValues, constant_array
from onnxmp.graphs import MAIN, iter_graphs, onnx_dtype
from onnxmp.naming import FreshNames
from onnxmp.passes import PassResult, require

log = logging.getLogger("onnxmp.rewrite")

LOW_NUMPY = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
LOW_ENUM = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}
SUFFIX = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass
class RewriteStats:
    casts: list[str] = field(default_factory=list)          # names of inserted Cast nodes
    retyped_tensors: int = 0
    converted_initializers: list[str] = field(default_factory=list)
    twin_initializers: list[str] = field(default_factory=list)
    retargeted_nodes: list[str] = field(default_factory=list)


def _gs_names(graph: gs.Graph) -> FreshNames:
    """Fresh names that collide with no node or tensor name in any graph."""
    taken: set[str] = set()
    for _, g, _ in iter_graphs(graph):
        taken.update(n.name for n in g.nodes)
        taken.update(t.name for t in g.inputs + g.outputs)
        for n in g.nodes:
            taken.update(t.name for t in n.inputs + n.outputs)
    return FreshNames(taken)


def rewrite(graph: gs.Graph, state: Coloring, *, precision: str = "float16",
            master_weights: Iterable[str] = (), keep_io_types: bool = True) -> tuple[PassResult, RewriteStats]:
    view = state.view
    low_np, low_enum, low_sfx = LOW_NUMPY[precision], LOW_ENUM[precision], SUFFIX[precision]
    master = set(master_weights)
    names = _gs_names(graph)
    stats = RewriteStats()
    allow = set(state.allow_keys())

    # Which (node, input index) positions read in low precision.
    low_input: set[tuple[str, int]] = set()
    for key in allow:
        v = view.vertices[key]
        low_input.update((v.node, i) for i, _ in v.inputs)
    # Control-flow groups that go low: their tensors are retyped as a whole (spec §5.7).
    group_tensors: set[str] = set()
    body_members: set[str] = set()  # formal body I/O of low groups: retyped, not pinned any more
    node_outputs: set[str] = set()  # outputs of the control-flow nodes of low groups
    for group in state.low_groups:
        outer = view.graph_of_node[group.node]
        group_tensors.update(t for _, t in group.members)
        body_members.update(t for gid, t in group.members if gid != outer)
        node_outputs.add(group.output)
        low_input.update(group.low_inputs)

    graphs = list(iter_graphs(graph))
    # Every reader of every initializer, across graphs, to decide convert vs twin.
    const_readers: dict[str, list[bool]] = {}
    for _, g, _ in graphs:
        for node in g.nodes:
            for i, t in enumerate(node.inputs):
                if isinstance(t, gs.Constant):
                    const_readers.setdefault(t.name, []).append((node.name, i) in low_input)
    graph_io = {t.name for _, g, _ in graphs for t in g.inputs + g.outputs} | set(view.pinned)

    # Names are unique across scopes, so one alias map serves every graph: a body
    # reading an outer low tensor reads it directly, without a round trip.
    low_alias: dict[str, gs.Tensor] = {}  # original tensor name -> tensor holding its low value
    new_nodes: dict[str, list[gs.Node]] = {gid: [] for gid, _, _ in graphs}

    def retype_output(graph_id: str, node: gs.Node, index: int) -> None:
        tensor = node.outputs[index]
        name = tensor.name
        if name in view.pinned and name not in body_members:
            low = gs.Variable(names(f"{name}_onnxmp_{low_sfx}"), dtype=low_np, shape=tensor.shape)
            node.outputs[index] = low
            restore = gs.Node("Cast", names(f"{name}_onnxmp_cast_fp32"),
                              attrs={"to": int(onnx.TensorProto.FLOAT)}, inputs=[low], outputs=[tensor])
            new_nodes[graph_id].append(restore)
            stats.casts.append(restore.name)
            low_alias[name] = low
        else:
            tensor.dtype = low_np
            low_alias[name] = tensor
        stats.retyped_tensors += 1

    # 1. Retype low outputs (renaming pinned ones) and retarget dtype attributes, in every graph.
    for graph_id, g, _ in graphs:
        for node in list(g.nodes):
            for key in view.node_vertices.get(node.name, []):
                if key not in allow:
                    continue
                for index, _name in view.vertices[key].outputs:
                    retype_output(graph_id, node, index)
                if node.op in ("Cast", "Constant", "ConstantOfShape"):
                    _retarget(node, low_enum, low_np)
                    stats.retargeted_nodes.append(node.name)
            if node.op in ("If", "Loop", "Scan"):
                for index, out in enumerate(node.outputs):
                    if out.name in node_outputs and out.name not in low_alias:
                        retype_output(graph_id, node, index)
        for tensor in g.inputs:
            # Body formal inputs of a low group (Loop carried values) take the low type.
            if graph_id != MAIN and tensor.name in group_tensors:
                tensor.dtype = low_np
                low_alias[tensor.name] = tensor
                stats.retyped_tensors += 1

    # 2. Graph inputs of the main graph may turn low when keep_io_types is off.
    if not keep_io_types:
        main = graphs[0][1]
        for tensor in main.inputs:
            if onnx_dtype(tensor) != onnx.TensorProto.FLOAT or tensor.name in view.pinned:
                continue
            readers = [(n.name, i) for _, g, _ in graphs for n in g.nodes for i, t in enumerate(n.inputs)
                       if t.name == tensor.name]
            if readers and all(r in low_input for r in readers):
                tensor.dtype = low_np
                low_alias[tensor.name] = tensor
                stats.retyped_tensors += 1

    # 3. Fix every consumer: low readers of fp32 sources, fp32 readers of low tensors.
    #    Casts go into the reader's graph, shared per (tensor, target type).
    twins: dict[str, gs.Constant] = {}
    for graph_id, g, _ in graphs:
        shared_casts: dict[tuple[str, int], gs.Variable] = {}

        def cast(src: gs.Tensor, to_enum: int, to_np, sfx: str) -> gs.Variable:
            key = (src.name, to_enum)
            if key not in shared_casts:
                out = gs.Variable(names(f"{src.name}_onnxmp_{sfx}"), dtype=to_np, shape=src.shape)
                node = gs.Node("Cast", names(f"{src.name}_onnxmp_cast_{sfx}"),
                               attrs={"to": int(to_enum)}, inputs=[src], outputs=[out])
                new_nodes[graph_id].append(node)
                stats.casts.append(node.name)
                shared_casts[key] = out
            return shared_casts[key]

        inserted = {n.name for n in new_nodes[graph_id]}
        for node in list(g.nodes):
            if node.name in inserted:
                continue
            for i, tensor in enumerate(list(node.inputs)):
                if not tensor.name:
                    continue
                wants_low = (node.name, i) in low_input
                if isinstance(tensor, gs.Constant):
                    if wants_low and onnx_dtype(tensor) == onnx.TensorProto.FLOAT:
                        node.inputs[i] = _low_constant(tensor, const_readers, master, twins, names, low_np,
                                                       low_enum, low_sfx, stats, cast, graph_io)
                    continue
                is_low = tensor.name in low_alias
                if wants_low and not is_low:
                    if onnx_dtype(tensor) == onnx.TensorProto.FLOAT:
                        node.inputs[i] = cast(tensor, low_enum, low_np, low_sfx)
                elif wants_low and is_low:
                    node.inputs[i] = low_alias[tensor.name]
                elif not wants_low and is_low and low_alias[tensor.name].name == tensor.name:
                    node.inputs[i] = cast(tensor, onnx.TensorProto.FLOAT, np.float32, "fp32")
        for tensor in list(g.outputs):
            # A body output bound to a low group but produced in fp32 (an input passed through).
            if graph_id != MAIN and tensor.name in group_tensors and tensor.name not in low_alias:
                require(False, "rewrite", f"group member `{tensor.name}` has a low-precision producer")

    for graph_id, g, _ in graphs:
        place_after_producers(g, new_nodes[graph_id])
    modified = bool(stats.casts or stats.retyped_tensors or stats.converted_initializers or stats.twin_initializers)
    return PassResult(modified, {"casts": len(stats.casts)}), stats


def place_after_producers(g: gs.Graph, casts: list[gs.Node]) -> None:
    """Put each inserted Cast right after the node producing its input (spec §6), in one pass.

    Casts of graph inputs, initializers and outer-scope tensors go first.  A Cast may
    read another inserted Cast (a restored output cast again), so placement follows
    chains; this keeps the sorted order ``normalize`` established without a full sort.
    """
    after: dict[str, list[gs.Node]] = {}
    produced_here = {t.name for n in g.nodes for t in n.outputs}
    head: list[gs.Node] = []
    cast_outputs = {n.outputs[0].name for n in casts}
    for cast in casts:
        src = cast.inputs[0].name
        if src in produced_here or src in cast_outputs:
            after.setdefault(src, []).append(cast)
        else:
            head.append(cast)
    inserted = {id(n) for n in casts}
    ordered: list[gs.Node] = []

    def emit(node: gs.Node) -> None:
        ordered.append(node)
        for out in node.outputs:
            for follower in after.pop(out.name, []):
                emit(follower)

    for node in head:
        emit(node)
    for node in g.nodes:
        if id(node) not in inserted:
            emit(node)
    require(not after, "rewrite", "every inserted Cast found its producer")
    g.nodes = ordered


def _low_constant(tensor: gs.Constant, readers, master, twins, names, low_np, low_enum, low_sfx, stats, cast,
                  graph_io) -> gs.Tensor:
    if tensor.name in master or tensor.name in graph_io:
        return cast(tensor, low_enum, low_np, low_sfx)
    if all(readers[tensor.name]):
        # Converted once: afterwards the tensor is low precision and callers no longer ask.
        if onnx_dtype(tensor) == onnx.TensorProto.FLOAT:
            if isinstance(tensor._values, ExternalValues):
                # Big models: convert at export, one tensor at a time (see onnxmp.external).
                tensor._values = ConvertedValues(tensor._values.tensor, low_np, low_enum)
            else:
                tensor.values = constant_array(tensor).astype(low_np)
            tensor.data_location = None  # the new values no longer live in the source's data file
            stats.converted_initializers.append(tensor.name)
        return tensor
    if tensor.name not in twins:
        # Read without caching: the fp32 original must stay a (possibly external) reference.
        twins[tensor.name] = gs.Constant(names(f"{tensor.name}_onnxmp_{low_sfx}"),
                                         constant_array(tensor).astype(low_np))
        stats.twin_initializers.append(tensor.name)
    return twins[tensor.name]


def _retarget(node: gs.Node, low_enum: int, low_np) -> None:
    """Spec §5.8: an op whose float32 output type comes from an attribute now makes low precision."""
    if node.op == "Cast":
        node.attrs["to"] = int(low_enum)
        return
    value = node.attrs.get("value")
    if node.op == "Constant" and value is None:
        for attr in ("value_float", "value_floats"):
            if attr in node.attrs:
                value = gs.Constant(node.outputs[0].name + "_value",
                                    np.asarray(node.attrs.pop(attr), dtype=np.float32))
    if value is None:  # ConstantOfShape defaults to a float32 zero
        value = gs.Constant(node.outputs[0].name + "_value", np.zeros((1,), dtype=np.float32))
    node.attrs["value"] = gs.Constant(value.name, np.asarray(value.values).astype(low_np))
