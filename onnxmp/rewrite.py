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
    """Apply ``state`` to ``graph`` in place; returns whether anything changed and what was done."""
    rewriter = _Rewriter(graph, state, precision, set(master_weights))
    rewriter.retype_low_outputs()
    if not keep_io_types:
        rewriter.lower_main_inputs()
    rewriter.fix_consumers()
    for graph_id, g, _ in rewriter.graphs:
        place_after_producers(g, rewriter.new_nodes[graph_id])
    stats = rewriter.stats
    modified = bool(stats.casts or stats.retyped_tensors or stats.converted_initializers or stats.twin_initializers)
    return PassResult(modified, {"casts": len(stats.casts)}), stats


class _Rewriter:
    """The rewrite's working state; one method per phase, run in order by :func:`rewrite`."""

    def __init__(self, graph: gs.Graph, state: Coloring, precision: str, master: set[str]):
        self.view = view = state.view
        self.low_np, self.low_enum, self.low_sfx = LOW_NUMPY[precision], LOW_ENUM[precision], SUFFIX[precision]
        self.master = master
        self.names = _gs_names(graph)
        self.stats = RewriteStats()
        self.allow = set(state.allow_keys())
        self.graphs = list(iter_graphs(graph))

        # Which (node, input index) positions read in low precision.
        self.low_input: set[tuple[str, int]] = set()
        for key in self.allow:
            v = view.vertices[key]
            self.low_input.update((v.node, i) for i, _ in v.inputs)
        # Control-flow groups that go low: their tensors are retyped as a whole (spec §5.7).
        self.group_tensors: set[str] = set()
        self.body_members: set[str] = set()  # formal body I/O of low groups: retyped, no longer pinned
        self.group_outputs: set[str] = set()  # outputs of the control-flow nodes of low groups
        for group in state.low_groups:
            outer = view.graph_of_node[group.node]
            self.group_tensors.update(t for _, t in group.members)
            self.body_members.update(t for gid, t in group.members if gid != outer)
            self.group_outputs.add(group.output)
            self.low_input.update(group.low_inputs)

        # Every reader of every initializer, across graphs, to decide convert vs twin.
        self.const_readers: dict[str, list[bool]] = {}
        for _, g, _ in self.graphs:
            for node in g.nodes:
                for i, t in enumerate(node.inputs):
                    if isinstance(t, gs.Constant):
                        self.const_readers.setdefault(t.name, []).append((node.name, i) in self.low_input)
        self.fixed = {t.name for _, g, _ in self.graphs for t in g.inputs + g.outputs} | set(view.pinned)
        # Names are unique across scopes, so one alias map serves every graph: a body
        # reading an outer low tensor reads it directly, without a round trip.
        self.low_alias: dict[str, gs.Tensor] = {}  # original tensor name -> tensor holding its low value
        self.new_nodes: dict[str, list[gs.Node]] = {gid: [] for gid, _, _ in self.graphs}
        self.twins: dict[str, gs.Constant] = {}

    # -- phase 1 -------------------------------------------------------------------------------
    def retype_low_outputs(self) -> None:
        """Retype outputs of ALLOW vertices and of low control-flow groups; retarget dtype attributes."""
        view = self.view
        for graph_id, g, _ in self.graphs:
            for node in list(g.nodes):
                for key in view.node_vertices.get(node.name, []):
                    if key not in self.allow:
                        continue
                    for index, _name in view.vertices[key].outputs:
                        self._retype_output(graph_id, node, index)
                    if node.op in ("Cast", "Constant", "ConstantOfShape"):
                        _retarget(node, self.low_enum, self.low_np)
                        self.stats.retargeted_nodes.append(node.name)
                if node.op in ("If", "Loop", "Scan"):
                    for index, out in enumerate(node.outputs):
                        if out.name in self.group_outputs and out.name not in self.low_alias:
                            self._retype_output(graph_id, node, index)
            for tensor in g.inputs:
                # Body formal inputs of a low group (Loop carried values) take the low type.
                if graph_id != MAIN and tensor.name in self.group_tensors:
                    self._retype_in_place(tensor)

    def _retype_output(self, graph_id: str, node: gs.Node, index: int) -> None:
        tensor = node.outputs[index]
        name = tensor.name
        if name not in self.view.pinned or name in self.body_members:
            self._retype_in_place(tensor)
            return
        # The outside world sees this name: write a renamed low tensor and restore the name with a Cast.
        low = gs.Variable(self.names(f"{name}_onnxmp_{self.low_sfx}"), dtype=self.low_np, shape=tensor.shape)
        node.outputs[index] = low
        restore = gs.Node("Cast", self.names(f"{name}_onnxmp_cast_fp32"),
                          attrs={"to": int(onnx.TensorProto.FLOAT)}, inputs=[low], outputs=[tensor])
        self.new_nodes[graph_id].append(restore)
        self.stats.casts.append(restore.name)
        self.low_alias[name] = low
        self.stats.retyped_tensors += 1

    def _retype_in_place(self, tensor: gs.Tensor) -> None:
        tensor.dtype = self.low_np
        self.low_alias[tensor.name] = tensor
        self.stats.retyped_tensors += 1

    # -- phase 2 (keep_io_types=False) ------------------------------------------------------------
    def lower_main_inputs(self) -> None:
        """A float32 main-graph input whose readers all read low precision takes the low type."""
        main = self.graphs[0][1]
        for tensor in main.inputs:
            if onnx_dtype(tensor) != onnx.TensorProto.FLOAT or tensor.name in self.view.pinned:
                continue
            readers = [(n.name, i) for _, g, _ in self.graphs for n in g.nodes for i, t in enumerate(n.inputs)
                       if t.name == tensor.name]
            if readers and all(r in self.low_input for r in readers):
                self._retype_in_place(tensor)

    # -- phase 3 -------------------------------------------------------------------------------
    def fix_consumers(self) -> None:
        """Low readers of fp32 sources and fp32 readers of low tensors get a Cast, in the reader's
        graph, shared per (tensor, target type)."""
        for graph_id, g, _ in self.graphs:
            shared: dict[tuple[str, int], gs.Variable] = {}
            inserted = {n.name for n in self.new_nodes[graph_id]}
            for node in list(g.nodes):
                if node.name in inserted:
                    continue
                for i, tensor in enumerate(list(node.inputs)):
                    if tensor.name:
                        node.inputs[i] = self._input_for(graph_id, shared, tensor, (node.name, i) in self.low_input)
            for tensor in g.outputs:
                if graph_id != MAIN and tensor.name in self.group_tensors:
                    require(tensor.name in self.low_alias, "rewrite",
                            f"group member `{tensor.name}` is produced in low precision")

    def _input_for(self, graph_id: str, shared, tensor: gs.Tensor, wants_low: bool) -> gs.Tensor:
        if isinstance(tensor, gs.Constant):
            if wants_low and onnx_dtype(tensor) == onnx.TensorProto.FLOAT:
                return self._low_constant(graph_id, shared, tensor)
            return tensor
        alias = self.low_alias.get(tensor.name)
        if wants_low:
            if alias is not None:
                return alias
            if onnx_dtype(tensor) == onnx.TensorProto.FLOAT:
                return self._cast(graph_id, shared, tensor, self.low_enum, self.low_np, self.low_sfx)
            return tensor
        if alias is not None and alias.name == tensor.name:  # low in place; this reader wants fp32
            return self._cast(graph_id, shared, tensor, onnx.TensorProto.FLOAT, np.float32, "fp32")
        return tensor

    def _cast(self, graph_id: str, shared, src: gs.Tensor, to_enum: int, to_np, sfx: str) -> gs.Variable:
        key = (src.name, to_enum)
        if key not in shared:
            out = gs.Variable(self.names(f"{src.name}_onnxmp_{sfx}"), dtype=to_np, shape=src.shape)
            node = gs.Node("Cast", self.names(f"{src.name}_onnxmp_cast_{sfx}"),
                           attrs={"to": int(to_enum)}, inputs=[src], outputs=[out])
            self.new_nodes[graph_id].append(node)
            self.stats.casts.append(node.name)
            shared[key] = out
        return shared[key]

    def _low_constant(self, graph_id: str, shared, tensor: gs.Constant) -> gs.Tensor:
        """Convert an initializer read only in low precision; otherwise give it a low twin.
        Master weights and initializers the outside world may feed are Cast at use instead."""
        if tensor.name in self.master or tensor.name in self.fixed:
            return self._cast(graph_id, shared, tensor, self.low_enum, self.low_np, self.low_sfx)
        if all(self.const_readers[tensor.name]):
            if isinstance(tensor._values, ExternalValues):
                # Big models: convert at export, one tensor at a time (see onnxmp.external).
                tensor._values = ConvertedValues(tensor._values.tensor, self.low_np, self.low_enum)
            else:
                tensor.values = constant_array(tensor).astype(self.low_np)
            tensor.data_location = None  # the new values no longer live in the source's data file
            self.stats.converted_initializers.append(tensor.name)
            return tensor
        if tensor.name not in self.twins:
            # Read without caching: the fp32 original must stay a (possibly external) reference.
            self.twins[tensor.name] = gs.Constant(self.names(f"{tensor.name}_onnxmp_{self.low_sfx}"),
                                                  constant_array(tensor).astype(self.low_np))
            self.stats.twin_initializers.append(tensor.name)
        return self.twins[tensor.name]


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
