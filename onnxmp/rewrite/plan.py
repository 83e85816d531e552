"""The rewrite's plan: the edits that apply a coloring to the model (``docs/design.md``, the rewrite).

* Output tensors of ALLOW vertices are retyped to the low-precision type.
* At each boundary one Cast per (source tensor, target type) is shared by every
  consumer that needs it, in any graph (:mod:`onnxmp.rewrite.casts` says where it stands);
  pairs that cancel exactly are not added, and a Constant read only through it is retargeted.
* Initializers read only by ALLOW vertices are stored in low precision; one
  read by both sides keeps its fp32 original and gets a low-precision twin.
  Master weights (training) always stay fp32 and are Cast at use.
* Tensors whose name the outside world sees (graph inputs/outputs with
  ``keep_io_types``, body formal I/O) keep
  their name and dtype: the low-precision producer writes a renamed tensor and
  a Cast restores the original name.

The plan takes each graph's node names, inputs and outputs from the index (read once) and records only
what changes (the inputs and outputs it rewires, tensors it retypes, initializers it
converts, the Casts it adds); :mod:`onnxmp.rewrite.write` then applies these edits to the
normalized model.
"""
from __future__ import annotations

import logging
from itertools import chain
from dataclasses import dataclass, field
from typing import AbstractSet, Iterable, Iterator, Sequence

import onnx

from onnxmp.color.rules import Coloring
from onnxmp.color.layouts import RETARGETABLE
from onnxmp.rewrite.branches import lower_if_outputs, raise_if_outputs
from onnxmp.rewrite.idle import fold_constant_casts, remove_idle_casts
from onnxmp.rewrite.moves import move_casts_above_splits, move_casts_up, move_restores_down
from onnxmp.rewrite.casts import (GraphNodes, NewCast, ScopeTree, float_cast_inputs, foldable_constant,
                                  homes_and_producers, place_after_producers, read_counts)
from onnxmp.index import ModelIndex, TensorInfo, keeps_io
from onnxmp.naming import FreshNames
from onnxmp.passes import require
from onnxmp.precision import FLOAT16, FLOAT32, Precision
from onnxmp.subgraphs import MAIN

log = logging.getLogger("onnxmp.rewrite")

FLOAT = onnx.TensorProto.FLOAT
_CONTROL_FLOW = ("If", "Loop", "Scan")


@dataclass
class RewriteStats:
    casts: list[str] = field(default_factory=list)          # names of inserted Cast nodes
    retyped_tensors: int = 0
    converted_initializers: list[str] = field(default_factory=list)
    twin_initializers: list[str] = field(default_factory=list)
    mask_fills: list = field(default_factory=list)          # MaskFills whose values were replaced

    @property
    def modified(self) -> bool:
        return bool(self.casts or self.retyped_tensors or self.converted_initializers or self.twin_initializers)


@dataclass
class Edits:
    """Everything the rewrite changes, keyed by (unique) names; applied by :mod:`onnxmp.rewrite.write`."""

    graphs: dict[str, GraphNodes] = field(default_factory=dict)   # graph id -> its nodes after the rewrite
    inputs: dict[str, list[str]] = field(default_factory=dict)    # node -> its new input names
    outputs: dict[str, list[str]] = field(default_factory=dict)   # node -> its new output names
    dtypes: dict[str, int] = field(default_factory=dict)          # retyped tensors (and converted constants)
    new_tensors: dict[str, TensorInfo] = field(default_factory=dict)  # Cast outputs, low twins of outputs
    converted: set[str] = field(default_factory=set)               # initializers stored in low precision
    twins: dict[str, str] = field(default_factory=dict)            # twin name -> fp32 source initializer
    retargeted: set[str] = field(default_factory=set)              # Cast/Constant/ConstantOfShape nodes
    constant_types: dict[str, int] = field(default_factory=dict)   # Constant node -> the type it makes now
    mask_fills: dict = field(default_factory=dict)                 # constant -> MaskFill to write
    low: Precision = FLOAT16

    @classmethod
    def unchanged(cls, index: ModelIndex) -> Edits:
        """No edits: the writer then leaves the model as it is, but for the dead-node sweep."""
        return cls(graphs={scope.gid: GraphNodes.of(scope) for scope in index.scopes})


def _fresh_names(graph: ModelIndex, node_names) -> FreshNames:
    """Fresh names that collide with no node name nor any tensor name any graph mentions
    (looked up where they are: a set of them all would be the rewrite's biggest object)."""
    return FreshNames((), graph.tensors, node_names)


def plan(index: ModelIndex, state: Coloring, *, precision: Precision, master_weights: Iterable[str] = (),
         keep_io_types: bool | AbstractSet[str] = True) -> tuple[Edits, RewriteStats]:
    """Work out the edits that apply ``state``, and what they do.

    Main-graph float32 inputs and outputs that ``keep_io_types`` does not keep (see
    :func:`onnxmp.index.keeps_io`) take the low-precision type whatever their readers and
    producers run in: a Cast inside the graph bridges to a float32 reader or producer."""
    rewriter = _Rewriter(index, state, precision, set(master_weights))
    rewriter.replace_mask_fills(state)
    rewriter.retype_low_outputs()
    rewriter.lower_main_inputs(keep_io_types)
    rewriter.convert_initializers()
    rewriter.fix_consumers()
    lower_if_outputs(rewriter)
    raise_if_outputs(rewriter)
    move_restores_down(rewriter)
    raise_if_outputs(rewriter)  # the outer Ifs whose branch outputs are now restores
    move_casts_up(rewriter)
    move_casts_above_splits(rewriter)
    rewriter.place_shared_casts()
    rewriter.lower_main_outputs(keep_io_types)
    remove_idle_casts(rewriter)
    fold_constant_casts(rewriter)
    for scope, nodes in zip(index.scopes, rewriter.nodes):
        rewriter.edits.graphs[scope.gid] = place_after_producers(nodes, rewriter.new_nodes[scope.gid])
    return rewriter.edits, rewriter.stats


class _Rewriter:
    """The plan's working state; one method per phase, run in order by :func:`plan`.

    Work that does not depend on order (retyping in place, deciding which initializers to
    convert) is done in bulk over sets; the graphs are walked in node order only where the
    order shows: fresh names, the Casts inserted and the lists the report gives.
    """

    def __init__(self, graph: ModelIndex, state: Coloring, low: Precision, master: set[str]):
        self.graph = graph
        self.view = view = state.view
        self.low_enum, self.low_sfx = low.onnx_type, low.suffix
        self.master = master
        self.names = _fresh_names(graph, view.graph_of_node)
        self.stats = RewriteStats()
        self.edits = Edits(low=low)
        allow_ids = state.allow_ids()
        self.allow = set(allow_ids)
        self.allow_ids = allow_ids
        self.nodes = [GraphNodes.of(scope) for scope in graph.scopes]
        self.constants = graph.constants

        # Which inputs of each node read in low precision: bit i of low_inputs[k] for input i of the
        # view's node k (the ALLOW vertices' are added by retype_low_outputs, which reads each of
        # them anyway).  A list by node index: the phases walk it beside the nodes, without a
        # look-up by name.
        self.low_inputs: list[int] = [0] * len(view.node_names)
        low_inputs, node_index = self.low_inputs, view.node_index
        # Control-flow groups that go low: their tensors are retyped as a whole (docs/design.md, force_color_match).
        self.group_tensors: set[str] = set()
        self.body_members: set[str] = set()  # formal body I/O of low groups: retyped, no longer pinned
        self.group_outputs: set[str] = set()  # outputs of the control-flow nodes of low groups
        for group in state.low_groups:
            outer = view.graph_of_node[group.node]
            self.group_tensors.update(t for _, t in group.members)
            self.body_members.update(t for gid, t in group.members if gid != outer)
            self.group_outputs.add(group.output)
            for node, i in group.low_inputs:
                low_inputs[node_index[node]] |= 1 << i

        # (statistics node, its input) -> the fused normalization it belongs to (see fix_consumers)
        # (a unit that stays float32 reads the one float32 copy of its input everybody shares)
        self.fused_readers = {reader: i for i, unit in enumerate(view.fused) for reader in unit.readers
                              if not self.allow.isdisjoint(unit.affine)}
        # Names the outside world may feed or read keep their type, and so do sparse initializers
        # (the writer converts dense ones only): low readers read a Cast of them.
        self.fixed = set(view.pinned)
        self.fixed.update(name for name, info in graph.tensors.items() if info.kind == "sparse_initializer")
        for scope in graph.scopes:
            self.fixed.update(scope.inputs)
            self.fixed.update(t.name for t in scope.graph.output)
        # Names are unique across scopes, so these maps serve every graph: a body reading an
        # outer low tensor reads it (or the renamed one) directly, without a round trip.
        self.renamed: dict[str, str] = {}  # output the outside world sees -> the low tensor written instead
        self.fp32_read: set[str] = set()  # initializers some node reads in float32
        self.new_nodes: dict[str, list[NewCast]] = {s.gid: [] for s in graph.scopes}
        self.twin_of: dict[str, str] = {}  # initializer -> its low twin
        # The Casts fix_consumers shares across graphs, (source, type, fused unit) -> the Cast, and
        # the graphs (scope positions) reading each; place_shared_casts puts them in a graph.
        self.shared: dict[tuple[str, int, int | None], NewCast] = {}
        self.shared_readers: dict[str, set[int]] = {}
        self._float_casts: dict[str, str] | None = None

    def masks(self) -> list[list[int]]:
        """``low_inputs`` cut into one list per graph, beside ``self.nodes``' lists (the view numbers
        nodes graph after graph, in node order, as the index lists them)."""
        cut, start = [], 0
        for nodes in self.nodes:
            cut.append(self.low_inputs[start:start + len(nodes.names)])
            start += len(nodes.names)
        return cut

    def _reads(self, names: AbstractSet[str]) -> Iterator[tuple[str, bool]]:
        """Each read of a tensor in ``names``, graph after graph and in node and input order:
        (the tensor, whether that input is read in low precision)."""
        for nodes, masks in zip(self.nodes, self.masks()):
            for inputs, mask in zip(nodes.inputs, masks):
                if names.isdisjoint(inputs):  # most nodes read none of them
                    continue
                for i, t in enumerate(inputs):
                    if t in names:
                        yield t, bool(mask >> i & 1)

    # -- tensor state --------------------------------------------------------------------------
    def dtype(self, name: str):
        if name in self.edits.dtypes:
            return self.edits.dtypes[name]
        if name in self.edits.new_tensors:
            return self.edits.new_tensors[name].dtype
        return self.graph.dtype(name)

    def is_low(self, name: str) -> bool:
        """The tensor now holds a low-precision value (retyped in place), or its producer writes
        one under a new name."""
        return name in self.renamed or (name in self.edits.dtypes and name not in self.constants)

    def _like(self, src: str, name: str, dtype: int) -> TensorInfo:
        """A new tensor with ``src``'s shape."""
        info = self.edits.new_tensors.get(src) or self.graph.tensors.get(src)
        return TensorInfo(name, dtype=dtype, shape=info.shape if info is not None else None)

    # -- phase 0 -------------------------------------------------------------------------------
    def replace_mask_fills(self, state: Coloring) -> None:
        """An attention mask fill whose path to its Softmax goes low precision anywhere takes its
        replacement value (:mod:`onnxmp.color.masks`), in float32 too: the mask may cross into low
        precision through a Cast."""
        view, allow = self.view, self.allow
        for name, fill in state.mask_fills.items():
            if any(vid in allow for node in (*fill.nodes, *fill.softmaxes) for vid in view.ids_of_node(node)):
                self.edits.mask_fills[name] = fill
                self.stats.mask_fills.append(fill)

    # -- phase 1 -------------------------------------------------------------------------------
    def retype_low_outputs(self) -> None:
        """Retype outputs of ALLOW vertices and of low control-flow groups; retarget dtype attributes.
        Notes which inputs each ALLOW vertex reads (``low_inputs``)."""
        view = self.view
        pinned, body_members, low_inputs, retargeted = view.pinned, self.body_members, self.low_inputs, \
            self.edits.retargeted
        unpinned = pinned.keys().isdisjoint
        in_place: list[str] = []
        renaming: set[str] = set()  # nodes with an output the outside world sees: renamed below, in order
        node_names, node_outs, v_node, v_kind, float_io = view.node_names, view.node_outs, view.v_node, view.v_kind, \
            view.float_io
        # view.inputs / view.output_names, inlined: this loop runs once per ALLOW vertex.
        for vid in self.allow_ids:
            k = v_node[vid]
            group = v_kind[vid].group
            cut = float_io.get(vid) if float_io else None
            if cut is None:
                mask, names = group.in_mask, group.pick_out(node_outs[k])
            else:
                mask, names = sum(1 << i for i, _ in cut[0]), tuple(t for _, t in cut[1])
            low_inputs[k] |= mask
            node = node_names[k]
            if unpinned(names):
                in_place += names
            else:
                for name in names:
                    if name in pinned and name not in body_members:
                        renaming.add(node)
                    else:
                        in_place.append(name)
            if group.op.op_type in RETARGETABLE:
                retargeted.add(node)
        self._retype_in_place(in_place)
        if renaming or self.group_outputs:
            self._retype_in_order(renaming)
        for scope in self.graph.scopes[1:]:
            # Body formal inputs of a low group (Loop carried values) take the low type.
            self._retype_in_place([name for name in scope.inputs if name in self.group_tensors])

    def _retype_in_order(self, renaming: set[str]) -> None:
        """The renamed outputs of ALLOW vertices and the outputs of low control-flow groups, in
        node order: each rename adds a fresh name and a Cast."""
        vertices, node_vertices, allow = self.view.vertices, self.view.node_vertices, self.allow
        pinned, body_members, group_outputs = self.view.pinned, self.body_members, self.group_outputs
        for scope, nodes in zip(self.graph.scopes, self.nodes):
            for k, name in enumerate(nodes.names):
                if name in renaming:
                    for key in node_vertices.get(name, ()):
                        vertex = vertices[key]
                        if vertex.id in allow:
                            for index, out in vertex.outputs:
                                if out in pinned and out not in body_members:  # the others are retyped
                                    self._retype_output(scope.gid, nodes, k, index)
                outputs = nodes.outputs[k]
                if group_outputs and not group_outputs.isdisjoint(outputs) \
                        and nodes.items[k].op_type in _CONTROL_FLOW:
                    for index, out in enumerate(outputs):
                        if out in group_outputs and not self.is_low(out):
                            self._retype_output(scope.gid, nodes, k, index)

    def _retype_output(self, graph_id: str, nodes: GraphNodes, k: int, index: int) -> None:
        name = nodes.outputs[k][index]
        if name not in self.view.pinned or name in self.body_members:
            self._retype_in_place((name,))
            return
        # The outside world sees this name: write a renamed low tensor and restore the name with a Cast.
        low = self.names(f"{name}_onnxmp_{self.low_sfx}")
        self.edits.new_tensors[low] = self._like(name, low, self.low_enum)
        outputs = nodes.outputs[k] = list(nodes.outputs[k])
        outputs[index] = low
        self.edits.outputs[nodes.names[k]] = outputs
        restore = NewCast(self.names(f"{name}_onnxmp_cast_fp32"), low, name, FLOAT)
        self.new_nodes[graph_id].append(restore)
        self.stats.casts.append(restore.name)
        self.renamed[name] = low
        self.stats.retyped_tensors += 1

    def _retype_in_place(self, names: Sequence[str]) -> None:
        self.edits.dtypes.update(dict.fromkeys(names, self.low_enum))
        self.stats.retyped_tensors += len(names)

    # -- phase 2 (I/O not kept) ---------------------------------------------------------------------
    def lower_main_inputs(self, keep_io_types) -> None:
        """A float32 main-graph input that is not kept takes the low type; fix_consumers then gives
        its float32 readers (a body's too) a Cast back."""
        for name in self.graph.scopes[0].inputs:  # initializers listed as inputs are not among them
            if not keeps_io(keep_io_types, name) and self.dtype(name) == FLOAT:
                self._retype_in_place((name,))

    def lower_main_outputs(self, keep_io_types) -> None:
        """A float32 main-graph output that is not kept and no low producer writes in place: its
        producer writes a renamed float32 tensor, which the graph's own readers read, and a Cast to
        the low type writes the output.  Where the producer writes low precision under a new name
        (the output was also read by a body), the Cast reads that low tensor."""
        main = self.nodes[0]
        casts = self.new_nodes[MAIN]
        renames: dict[str, str] = {}  # output -> the float32 tensor its producer writes now
        for name in dict.fromkeys(t.name for t in self.graph.scopes[0].graph.output):
            if keeps_io(keep_io_types, name) or name in self.edits.dtypes or self.dtype(name) != FLOAT:
                continue  # kept, low already (retyped in place, a lowered input), or not float32
            if name in self.constants:
                log.warning("graph output %r is an initializer; it stays float32", name)
                continue
            renames[name] = fp32 = self.names(f"{name}_onnxmp_{FLOAT32.suffix}")
            self.edits.new_tensors[fp32] = self._like(name, fp32, FLOAT)
        if not renames:
            return
        for cast in casts:
            if cast.dst in renames:
                cast.dst = renames[cast.dst]  # the Cast restoring a renamed low output
        for k, outputs in enumerate(main.outputs):
            if not renames.keys().isdisjoint(outputs):
                outputs = main.outputs[k] = [renames.get(t, t) for t in outputs]
                self.edits.outputs[main.names[k]] = outputs
        self._reread(renames)
        for name, fp32 in renames.items():
            cast = NewCast(self.names(f"{name}_onnxmp_cast_{self.low_sfx}"), self.renamed.get(name, fp32), name,
                           self.low_enum)
            casts.append(cast)
            self.stats.casts.append(cast.name)
            self.edits.dtypes[name] = self.low_enum
            self.stats.retyped_tensors += 1

    def _reread(self, renames: dict[str, str]) -> None:
        """Every reader of a renamed tensor, in any graph and the added Casts included, reads the new name."""
        for nodes in self.nodes:
            for k, inputs in enumerate(nodes.inputs):
                if not renames.keys().isdisjoint(inputs):
                    rewired = nodes.inputs[k] = [renames.get(t, t) for t in inputs]
                    self.edits.inputs[nodes.names[k]] = rewired
        for cast in chain(self.shared.values(), *self.new_nodes.values()):
            cast.src = renames.get(cast.src, cast.src)

    # What rewrite/branches.py uses of the rewriter.
    reread = _reread

    def retype(self, names: Sequence[str]) -> None:
        self._retype_in_place(names)

    def like(self, src: str, name: str, dtype: int) -> TensorInfo:
        return self._like(src, name, dtype)

    def add_cast(self, graph_id: str, src: str, dst: str, to: int) -> None:
        cast = NewCast(self.names(f"{dst}_onnxmp_cast_{self.low_sfx if to != FLOAT else FLOAT32.suffix}"), src, dst, to)
        self.new_nodes[graph_id].append(cast)
        self.stats.casts.append(cast.name)

    def low_read(self, reader: int, name: str) -> str:
        """What a low reader in graph ``reader`` reads for float32 ``name`` (as fix_consumers decides)."""
        return self.renamed.get(name) or self._cast(reader, name, self.low_enum, self.low_sfx)

    def float_read(self, reader: int, name: str) -> str:
        return self._cast(reader, name, FLOAT, FLOAT32.suffix)

    def unretype(self, name: str) -> None:
        """``name`` keeps its float32 type after all."""
        del self.edits.dtypes[name]
        self.stats.retyped_tensors -= 1

    def drop_shared(self, key: tuple[str, int, int | None]) -> NewCast:
        cast = self.shared.pop(key)
        self.shared_readers.pop(cast.name)
        self.stats.casts.remove(cast.name)
        return cast

    def read_counts(self, names: AbstractSet[str]) -> dict[str, int]:
        """How often each of ``names`` is read by the nodes and Casts of any graph (graph outputs aside)."""
        return read_counts((n.inputs for n in self.nodes),
                           (c.src for c in chain(self.shared.values(), *self.new_nodes.values())), names)

    def graph_depth(self, s: int) -> int:
        depth, scopes = 0, self.graph.scopes
        while scopes[s].parent_scope is not None:
            s, depth = scopes[s].parent_scope, depth + 1
        return depth

    # -- phase 3 -------------------------------------------------------------------------------
    def convert_initializers(self) -> None:
        """A float32 initializer read only in low precision (in any graph) is stored in low
        precision, unless it is a master weight or the outside world may feed it.  Listed in
        the order of their first low reads."""
        constants = self.constants
        low_read: dict[str, None] = {}
        for t, low in self._reads(constants):
            if low:
                low_read[t] = None
            else:
                self.fp32_read.add(t)
        tensors = self.graph.tensors
        converted = [t for t in low_read if t not in self.fp32_read and t not in self.master
                     and t not in self.fixed and tensors[t].dtype == FLOAT]
        self.edits.converted.update(converted)
        self.edits.dtypes.update(dict.fromkeys(converted, self.low_enum))
        self.stats.converted_initializers.extend(converted)

    # -- phase 4 -------------------------------------------------------------------------------
    def fix_consumers(self) -> None:
        """Low readers of fp32 sources and fp32 readers of low tensors get a Cast, in the reader's
        graph, shared per (tensor, target type); low readers of an initializer that stays float32
        read a Cast of it or its low twin."""
        renamed, constants, edited = self.renamed, self.constants, self.edits.inputs
        retargeted = self.edits.retargeted
        identity_inputs = set(self.view.identity_casts.values())
        # Low readers read these as they are: tensors retyped in place and converted initializers
        # (a set of them: one issuperset call per node in a low region, which most nodes are).
        low_as_is = set(self.edits.dtypes)
        for s, (scope, nodes, masks) in enumerate(zip(self.graph.scopes, self.nodes, self.masks())):
            graph_id, g = scope.gid, scope.graph
            for k, (node_name, inputs, mask) in enumerate(zip(nodes.names, nodes.inputs, masks)):
                if mask == 0:
                    if low_as_is.isdisjoint(inputs):
                        continue  # float32 reads of float32 values
                elif mask == (1 << len(inputs)) - 1 and low_as_is.issuperset(inputs):
                    continue  # inside a low-precision region
                for i, name in enumerate(inputs):
                    if not name:
                        continue
                    if mask >> i & 1:
                        if name in low_as_is or (node_name in retargeted and name in identity_inputs):
                            continue  # low already, or a float32 input of a Cast that now converts it
                        if name in constants:
                            if self.dtype(name) != FLOAT:
                                continue
                            new = self._low_constant(s, name)
                        else:
                            new = renamed.get(name) or self._low_variable(s, name)
                    elif name in low_as_is and name not in constants:
                        if nodes.items[k].op_type == "Cast" and type(nodes.items[k]) is not NewCast:
                            continue  # a Cast reads any float type: it converts the low value itself
                        # Low in place; this reader wants fp32.  The statistics of a fused
                        # normalization read it through a Cast of their own, which ORT's fusion
                        # absorbs only when nothing else reads it.
                        new = self._cast(s, name, FLOAT, FLOAT32.suffix,
                                         self.fused_readers.get((node_name, name)))
                    else:
                        continue  # a float32 reader of a float32 value
                    if new != name:
                        if node_name not in edited:
                            inputs = nodes.inputs[k] = list(inputs)
                            edited[node_name] = inputs
                        inputs[i] = new
            if graph_id != MAIN:
                for tensor in g.output:
                    if tensor.name in self.group_tensors:
                        require(self.is_low(tensor.name), "rewrite",
                                f"group member `{tensor.name}` is produced in low precision")

    def _low_variable(self, reader: int, name: str) -> str:
        """What a low-precision reader reads for a tensor no low producer writes: a Cast of a
        float32 one, or the tensor itself (int64 shapes, bool masks...)."""
        if self.dtype(name) == FLOAT:
            return self._cast(reader, name, self.low_enum, self.low_sfx)
        return name

    def _cast(self, reader: int, src: str, to_enum: int, sfx: str, unit: int | None = None) -> str:
        """What graph ``reader`` reads for ``src`` in type ``to_enum``: the one Cast of it the
        whole model shares, or a tensor that holds that value already."""
        # A Cast of what an identity Cast passes through reads that Cast's input: no Cast pair.
        source = self.view.identity_casts.get(src)
        if source is not None and self.is_low(source) == self.is_low(src):
            src = source
        if to_enum == self.low_enum:
            # Cast(Cast(h, to=float32), to=low) of a low h is h, bit for bit (docs/design.md).
            widened = self.float_casts.get(src)
            if widened is not None:
                low = self.renamed.get(widened) or (widened if self.dtype(widened) == self.low_enum else None)
                if low is not None:
                    return low
        key = (src, to_enum, unit)
        node = self.shared.get(key)
        if node is None:
            out = self.names(f"{src}_onnxmp_{sfx}")
            self.edits.new_tensors[out] = self._like(src, out, to_enum)
            node = self.shared[key] = NewCast(self.names(f"{src}_onnxmp_cast_{sfx}"), src, out, to_enum)
            self.shared_readers[node.name] = set()
            self.stats.casts.append(node.name)
        self.shared_readers[node.name].add(reader)
        return node.dst

    @property
    def float_casts(self) -> dict[str, str]:
        """The model's own Cast(to=float32) nodes, output -> input (read once, when first asked)."""
        if self._float_casts is None:
            self._float_casts = float_cast_inputs(self.graph)
        return self._float_casts

    # -- phase 4b ------------------------------------------------------------------------------
    def place_shared_casts(self) -> None:
        """Put each shared Cast in its graph (:class:`onnxmp.rewrite.casts.ScopeTree`), after
        retargeting the Constants read only through their Cast to the low type."""
        if not self.shared:
            return
        casts = list(self.shared.values())
        sources = {c.src for c in casts}
        homes, producers = homes_and_producers(self.graph, [n.outputs for n in self.nodes],
                                               [[c.dst for c in self.new_nodes[s.gid]] for s in self.graph.scopes],
                                               sources)
        casts = self._fold_constants(casts, producers)
        tree = ScopeTree(self.graph)
        for cast in casts:
            site = tree.site(homes.get(cast.src), self.shared_readers[cast.name])
            self.new_nodes[self.graph.scopes[site].gid].append(cast)

    def _fold_constants(self, casts: list[NewCast], producers: dict[str, tuple[int, int]]) -> list[NewCast]:
        """The Casts left once each float32 Constant/ConstantOfShape that nothing but its Cast to
        the low type reads makes the low type itself (retargeted; its readers read it)."""
        candidates = {c.src for c in casts if c.to == self.low_enum and c.src in producers
                      and c.src not in self.edits.dtypes and self.dtype(c.src) == FLOAT
                      and foldable_constant(self.nodes[producers[c.src][0]].items[producers[c.src][1]], c.src)}
        if not candidates:
            return casts
        outputs = (t.name for scope in self.graph.scopes for t in scope.graph.output)
        counts = read_counts((n.inputs for n in self.nodes),
                             chain((c.src for c in casts), (c.src for cs in self.new_nodes.values() for c in cs),
                                   outputs), candidates)
        folded: dict[str, str] = {}
        for cast in casts:
            if cast.src in candidates and counts[cast.src] == 1:
                s, k = producers[cast.src]
                self.edits.retargeted.add(self.nodes[s].names[k])
                self._retype_in_place((cast.src,))
                folded[cast.dst] = cast.src
        if not folded:
            return casts
        self._reread(folded)
        gone = {c.name for c in casts if c.dst in folded}
        self.stats.casts = [name for name in self.stats.casts if name not in gone]
        return [c for c in casts if c.name not in gone]

    def _low_constant(self, reader: int, name: str) -> str:
        """A low read of a float32 initializer that stays float32: master weights and initializers
        the outside world may feed are Cast at use; one also read in float32 gets a low twin."""
        if name in self.master or name in self.fixed:
            return self._cast(reader, name, self.low_enum, self.low_sfx)
        twin = self.twin_of.get(name)
        if twin is None:
            twin = self.twin_of[name] = self.names(f"{name}_onnxmp_{self.low_sfx}")
            self.edits.twins[twin] = name
            self.edits.new_tensors[twin] = self._like(name, twin, self.low_enum)
            self.stats.twin_initializers.append(name)
        return twin
