"""Stage 4: rewrite.  Apply a coloring to the model (spec §6).

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

The rewrite records only what changes (node inputs and outputs it rewires, tensors
it retypes, initializers it converts, the Casts it adds); :mod:`onnxmp.emit` then
writes the output model from the normalized one plus these edits.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import onnx

from onnxmp.color.rules import Coloring
from onnxmp.graphs import MAIN, ModelGraph, TensorInfo
from onnxmp.naming import FreshNames
from onnxmp.passes import PassResult, require
from onnxmp.precision import FLOAT16, FLOAT32, low_precision

log = logging.getLogger("onnxmp.rewrite")

FLOAT = onnx.TensorProto.FLOAT


@dataclass
class RewriteStats:
    casts: list[str] = field(default_factory=list)          # names of inserted Cast nodes
    retyped_tensors: int = 0
    converted_initializers: list[str] = field(default_factory=list)
    twin_initializers: list[str] = field(default_factory=list)


@dataclass
class NewCast:
    """A Cast the rewrite adds: ``dst = Cast(src, to)``."""

    name: str
    src: str
    dst: str
    to: int


@dataclass
class Edits:
    """Everything the rewrite changes, keyed by (unique) names; read by :mod:`onnxmp.emit`."""

    inputs: dict[str, list[str]] = field(default_factory=dict)    # node -> its new input names
    outputs: dict[str, list[str]] = field(default_factory=dict)   # node -> its new output names
    dtypes: dict[str, int] = field(default_factory=dict)          # retyped tensors (and converted constants)
    new_tensors: dict[str, TensorInfo] = field(default_factory=dict)  # Cast outputs, low twins of outputs
    converted: dict[str, tuple[np.dtype, int]] = field(default_factory=dict)  # initializer -> low (np, enum)
    twins: dict[str, str] = field(default_factory=dict)            # twin name -> fp32 source initializer
    retargeted: set[str] = field(default_factory=set)              # Cast/Constant/ConstantOfShape nodes
    raw_constants: set[str] = field(default_factory=set)           # Constant nodes whose value is rewritten raw
    order: dict[str, list] = field(default_factory=dict)           # graph id -> NodeProto | NewCast, in order
    emitted_casts: set[str] = field(default_factory=set)           # NewCasts the emitter wrote (cleanup drops some)
    low_np: np.dtype = FLOAT16.numpy
    low_enum: int = FLOAT16.onnx_type


def _fresh_names(graph: ModelGraph, node_names) -> FreshNames:
    """Fresh names that collide with no node name nor any tensor name any graph mentions."""
    taken = set(graph.tensors)
    taken.update(node_names)
    return FreshNames(taken)


def rewrite(graph: ModelGraph, state: Coloring, *, precision: str = "float16",
            master_weights: Iterable[str] = (), keep_io_types: bool = True) -> tuple[PassResult, RewriteStats, Edits]:
    """Work out the edits that apply ``state``; returns whether anything changed, what was done, and the edits."""
    rewriter = _Rewriter(graph, state, precision, set(master_weights))
    rewriter.retype_low_outputs()
    if not keep_io_types:
        rewriter.lower_main_inputs()
    rewriter.fix_consumers()
    for scope in graph.scopes:
        rewriter.edits.order[scope.gid] = place_after_producers(
            list(scope.graph.node), rewriter.new_nodes[scope.gid], rewriter.outputs_of)
    stats = rewriter.stats
    modified = bool(stats.casts or stats.retyped_tensors or stats.converted_initializers or stats.twin_initializers)
    return PassResult(modified, {"casts": len(stats.casts)}), stats, rewriter.edits


class _Rewriter:
    """The rewrite's working state; one method per phase, run in order by :func:`rewrite`."""

    def __init__(self, graph: ModelGraph, state: Coloring, precision: str, master: set[str]):
        self.graph = graph
        self.view = view = state.view
        low = low_precision(precision)
        self.low_np, self.low_enum, self.low_sfx = low.numpy, low.onnx_type, low.suffix
        self.master = master
        self.names = _fresh_names(graph, view.graph_of_node)
        self.stats = RewriteStats()
        self.edits = Edits(low_np=self.low_np, low_enum=self.low_enum, raw_constants=set(state.read_constants))
        self.allow = set(state.allow_ids())

        # Which (node, input index) positions read in low precision.
        self.low_input: set[tuple[str, int]] = set()
        for vid in self.allow:
            node = view.node_of(vid)
            self.low_input.update((node, i) for i, _ in view.inputs(vid))
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
        tensors = graph.tensors
        for scope in graph.scopes:
            for node in scope.graph.node:
                for i, t in enumerate(node.input):
                    info = tensors.get(t)
                    if t and info is not None and info.init is not None:
                        self.const_readers.setdefault(t, []).append((node.name, i) in self.low_input)
        self.fixed = set(view.pinned)
        for scope in graph.scopes:
            self.fixed.update(self._gs_inputs(scope.graph))
            self.fixed.update(t.name for t in scope.graph.output)
        # Names are unique across scopes, so one alias map serves every graph: a body
        # reading an outer low tensor reads it directly, without a round trip.
        self.low_alias: dict[str, str] = {}  # original tensor name -> tensor holding its low value
        self.new_nodes: dict[str, list[NewCast]] = {s.gid: [] for s in graph.scopes}
        self.twin_of: dict[str, str] = {}  # initializer -> its low twin

    @staticmethod
    def _gs_inputs(g: onnx.GraphProto) -> list[str]:
        inits = {t.name for t in g.initializer}
        return [t.name for t in g.input if t.name not in inits]

    # -- tensor state --------------------------------------------------------------------------
    def dtype(self, name: str):
        if name in self.edits.dtypes:
            return self.edits.dtypes[name]
        if name in self.edits.new_tensors:
            return self.edits.new_tensors[name].dtype
        return self.graph.dtype(name)

    def _like(self, src: str, name: str, dtype: int) -> TensorInfo:
        """A new tensor with ``src``'s shape (GS: ``Variable(name, dtype, shape=src.shape)``)."""
        info = self.edits.new_tensors.get(src) or self.graph.tensors.get(src)
        if info is None:
            return TensorInfo(name, dtype=dtype)
        new = TensorInfo(name, dtype=dtype, shape=info.shape)
        if info.init is None and not info.merged:
            new.decl = info.decl  # lets the emitter copy the declaration instead of rebuilding it
        return new

    def is_constant(self, name: str) -> bool:
        if name in self.edits.twins:
            return True
        info = self.graph.tensors.get(name)
        return info is not None and info.init is not None

    def outputs_of(self, node) -> Sequence[str]:
        if isinstance(node, NewCast):
            return (node.dst,)
        return self.edits.outputs.get(node.name) or node.output

    def _inputs(self, node: onnx.NodeProto) -> list[str]:
        current = self.edits.inputs.get(node.name)
        if current is None:
            current = self.edits.inputs[node.name] = list(node.input)
        return current

    def _outputs(self, node: onnx.NodeProto) -> list[str]:
        current = self.edits.outputs.get(node.name)
        if current is None:
            current = self.edits.outputs[node.name] = list(node.output)
        return current

    # -- phase 1 -------------------------------------------------------------------------------
    def retype_low_outputs(self) -> None:
        """Retype outputs of ALLOW vertices and of low control-flow groups; retarget dtype attributes."""
        view = self.view
        allow = self.allow
        for scope in self.graph.scopes:
            graph_id, g = scope.gid, scope.graph
            for node in g.node:
                for vid in view.ids_of_node(node.name):
                    if vid not in allow:
                        continue
                    for index, _name in view.outputs(vid):
                        self._retype_output(graph_id, node, index)
                    if node.op_type in ("Cast", "Constant", "ConstantOfShape"):
                        self.edits.retargeted.add(node.name)
                if node.op_type in ("If", "Loop", "Scan"):
                    for index, out in enumerate(self.outputs_of(node)):
                        if out in self.group_outputs and out not in self.low_alias:
                            self._retype_output(graph_id, node, index)
            if graph_id != MAIN:
                for name in self._gs_inputs(g):
                    # Body formal inputs of a low group (Loop carried values) take the low type.
                    if name in self.group_tensors:
                        self._retype_in_place(name)

    def _retype_output(self, graph_id: str, node: onnx.NodeProto, index: int) -> None:
        name = self.outputs_of(node)[index]
        if name not in self.view.pinned or name in self.body_members:
            self._retype_in_place(name)
            return
        # The outside world sees this name: write a renamed low tensor and restore the name with a Cast.
        low = self.names(f"{name}_onnxmp_{self.low_sfx}")
        self.edits.new_tensors[low] = self._like(name, low, self.low_enum)
        self._outputs(node)[index] = low
        restore = NewCast(self.names(f"{name}_onnxmp_cast_fp32"), low, name, FLOAT)
        self.new_nodes[graph_id].append(restore)
        self.stats.casts.append(restore.name)
        self.low_alias[name] = low
        self.stats.retyped_tensors += 1

    def _retype_in_place(self, name: str) -> None:
        self.edits.dtypes[name] = self.low_enum
        self.low_alias[name] = name
        self.stats.retyped_tensors += 1

    # -- phase 2 (keep_io_types=False) ------------------------------------------------------------
    def lower_main_inputs(self) -> None:
        """A float32 main-graph input whose readers all read low precision takes the low type."""
        readers: dict[str, list[tuple[str, int]]] = {}
        for scope in self.graph.scopes:
            for n in scope.graph.node:
                for i, t in enumerate(self.edits.inputs.get(n.name) or n.input):
                    readers.setdefault(t, []).append((n.name, i))
        for name in self._gs_inputs(self.graph.scopes[0].graph):
            if self.dtype(name) != FLOAT or name in self.view.pinned:
                continue
            found = readers.get(name, [])
            if found and all(r in self.low_input for r in found):
                self._retype_in_place(name)

    # -- phase 3 -------------------------------------------------------------------------------
    def fix_consumers(self) -> None:
        """Low readers of fp32 sources and fp32 readers of low tensors get a Cast, in the reader's
        graph, shared per (tensor, target type)."""
        for scope in self.graph.scopes:
            graph_id, g = scope.gid, scope.graph
            shared: dict[tuple[str, int], str] = {}
            edited, low_input, low_alias = self.edits.inputs, self.low_input, self.low_alias
            for node in g.node:
                node_name = node.name
                for i, name in enumerate(edited.get(node_name) or node.input):
                    if not name:
                        continue
                    wants_low = (node_name, i) in low_input
                    alias = low_alias.get(name)
                    if wants_low and alias is not None and not self.is_constant(name):
                        new = alias  # the common case inside a low-precision region
                    else:
                        new = self._input_for(graph_id, shared, name, wants_low)
                    if new != name:
                        self._inputs(node)[i] = new
            if graph_id != MAIN:
                for tensor in g.output:
                    if tensor.name in self.group_tensors:
                        require(tensor.name in self.low_alias, "rewrite",
                                f"group member `{tensor.name}` is produced in low precision")

    def _input_for(self, graph_id: str, shared, name: str, wants_low: bool) -> str:
        if self.is_constant(name):
            if wants_low and self.dtype(name) == FLOAT:
                return self._low_constant(graph_id, shared, name)
            return name
        alias = self.low_alias.get(name)
        if wants_low:
            if alias is not None:
                return alias
            if self.dtype(name) == FLOAT:
                return self._cast(graph_id, shared, name, self.low_enum, self.low_sfx)
            return name
        if alias is not None and alias == name:  # low in place; this reader wants fp32
            return self._cast(graph_id, shared, name, FLOAT, FLOAT32.suffix)
        return name

    def _cast(self, graph_id: str, shared, src: str, to_enum: int, sfx: str) -> str:
        key = (src, to_enum)
        if key not in shared:
            out = self.names(f"{src}_onnxmp_{sfx}")
            self.edits.new_tensors[out] = self._like(src, out, to_enum)
            node = NewCast(self.names(f"{src}_onnxmp_cast_{sfx}"), src, out, to_enum)
            self.new_nodes[graph_id].append(node)
            self.stats.casts.append(node.name)
            shared[key] = out
        return shared[key]

    def _low_constant(self, graph_id: str, shared, name: str) -> str:
        """Convert an initializer read only in low precision; otherwise give it a low twin.
        Master weights and initializers the outside world may feed are Cast at use instead."""
        if name in self.master or name in self.fixed:
            return self._cast(graph_id, shared, name, self.low_enum, self.low_sfx)
        if all(self.const_readers[name]):
            self.edits.converted[name] = (self.low_np, self.low_enum)
            self.edits.dtypes[name] = self.low_enum
            self.stats.converted_initializers.append(name)
            return name
        twin = self.twin_of.get(name)
        if twin is None:
            twin = self.twin_of[name] = self.names(f"{name}_onnxmp_{self.low_sfx}")
            self.edits.twins[twin] = name
            self.edits.new_tensors[twin] = self._like(name, twin, self.low_enum)
            self.stats.twin_initializers.append(name)
        return twin


def place_after_producers(nodes: list, casts: list[NewCast], outputs_of) -> list:
    """Put each inserted Cast right after the node producing its input (spec §6), in one pass.

    Casts of graph inputs, initializers and outer-scope tensors go first.  A Cast may
    read another inserted Cast (a restored output cast again), so placement follows
    chains; this keeps the sorted order ``normalize`` established without a full sort.
    """
    if not casts:
        return nodes
    after: dict[str, list[NewCast]] = {}
    node_outputs = [outputs_of(n) for n in nodes]
    produced_here = {t for outs in node_outputs for t in outs}
    head: list[NewCast] = []
    cast_outputs = {c.dst for c in casts}
    for cast in casts:
        if cast.src in produced_here or cast.src in cast_outputs:
            after.setdefault(cast.src, []).append(cast)
        else:
            head.append(cast)
    ordered: list = []
    # Depth first, each node then its followers in output order.  A loop, not a recursive closure:
    # that would be a reference cycle, kept (with the whole rewrite state) while the pipeline runs
    # with the cycle collector off, and a long Cast chain would hit the recursion limit.
    stack: list[NewCast] = []
    for start, outs in (*((c, (c.dst,)) for c in head), *zip(nodes, node_outputs)):
        ordered.append(start)
        if not after:
            continue
        stack.extend(reversed([f for out in outs for f in after.pop(out, ())]))
        while stack:
            cast = stack.pop()  # followers are all inserted Casts
            ordered.append(cast)
            stack.extend(reversed(after.pop(cast.dst, ())))
    require(not after, "rewrite", "every inserted Cast found its producer")
    return ordered
