"""Write the converted model: the normalized model plus the rewrite's edits.

The output is byte for byte what onnxmp wrote when the rewrite went through an
onnx-graphsurgeon import and export (``gs.import_onnx`` -> edit -> ``cleanup`` ->
``gs.export_onnx``), without building GS's object graph for every node: the
per-node cost of that round trip made conversion slower than onnxconverter-common.
So this module keeps GS's export conventions:

* nodes lose their doc strings, attributes of kinds GS does not model move to the end,
  and subgraphs are written the same way, recursively;
* sequences, optionals and maps are written untyped by GS; their declared types are put back;
* nodes nothing reads towards a graph output are dropped (GS ``cleanup``);
* initializers and value_info follow GS's tensor order (graph inputs, then each
  node's inputs and outputs, then graph outputs); a body lists the outer
  initializers and typed values it reads, as GS writes them;
* inputs, outputs and value_info are rebuilt from (dtype, shape) as
  ``onnx.helper.make_tensor_value_info`` makes them;
* model functions still go through GS (they are few and small).

What the rewrite leaves alone is not rebuilt: unchanged nodes and initializers are the
input's own messages and declarations GS would write back unchanged are copies of the
input's (retyped in the copy), all copied by protobuf in C (nodes and declarations
serialized one by one and parsed into the output in one call, see :func:`_wire`); only
rewired or unclean nodes, converted initializers and the inserted Casts are built here.
"""
from __future__ import annotations

import functools
import math
from itertools import chain, compress, repeat
from operator import is_
from typing import Iterable

import numpy as np
import onnx
from onnx.external_data_helper import uses_external_data

from onnxmp.external import converted_external, tensor_array
from onnxmp.graphs import (GRAPH, GRAPHS, TENSOR_KIND, TENSOR_OR_UNTYPED, ModelGraph, TensorInfo, iter_proto_graphs,
                           may_hold_graphs)
from onnxmp.rewrite import Edits, GraphNodes, NewCast

A = onnx.AttributeProto
_SIMPLE = (A.INT, A.FLOAT, A.STRING, A.TENSOR)
_LISTS = (A.INTS, A.FLOATS, A.STRINGS)
_CHUNK = 2048  # initializers converted per numpy call at most
_BATCH_BYTES = 16 << 20  # serialized nodes written at once, at most (unless one is bigger)
_CHECK_IN_BULK_BELOW = 2048  # serialized bytes per node, on average
FLOAT = onnx.TensorProto.FLOAT


def emit(graph: ModelGraph, edits: Edits, original: onnx.ModelProto) -> onnx.ModelProto:
    """The converted model; ``original`` is the model ``graph`` indexes."""
    model = onnx.ModelProto()
    model.ir_version = original.ir_version
    emitter = _Emitter(graph, edits)
    emitter.graph(0, model.graph)  # written in place: a copy of the whole graph would double its memory
    edits.emitted_casts = emitter.kept_casts[0]
    declared = chain((scope.graph for scope in graph.scopes if scope.non_tensor),
                     chain.from_iterable(iter_proto_graphs(g) for g in emitter.listed_graphs))
    _restore_non_tensor_types(model.graph, _non_tensor_types(declared))
    model.opset_import.extend(original.opset_import)
    if original.functions:
        model.functions.extend(_functions_through_gs(original))
    for field_name in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(model, field_name, getattr(original, field_name))
    model.metadata_props.extend(original.metadata_props)
    restore_initializer_inputs(model, original, initializer_inputs(graph))
    return model


def _dense_initializer(graph: ModelGraph, name: str) -> bool:
    """A main-graph input ``name`` is one of the main graph's (dense) initializers: the main graph's
    initializers are indexed before anything else, so its TensorInfo is the initializer's."""
    info = graph.tensors.get(name)
    return info is not None and info.init is not None and info.kind == TENSOR_KIND


def initializer_inputs(graph: ModelGraph) -> tuple[str, ...]:
    """Main-graph inputs that are also main-graph (dense) initializers (exports with
    keep_initializers_as_inputs), in input order.  Known from the index: reading every
    initializer's name again would cost more than the few inputs do."""
    return tuple(vi.name for vi in graph.model.graph.input if _dense_initializer(graph, vi.name))


def restore_initializer_inputs(model: onnx.ModelProto, original: onnx.ModelProto, names: Iterable[str]) -> None:
    """Initializers that were also graph inputs (``names``) go back into the inputs, where they were."""
    names = set(names)
    if not names:
        return
    exported = {i.name: i for i in model.graph.input}
    ordered = [exported.get(i.name, i) for i in original.graph.input if i.name in names or i.name in exported]
    del model.graph.input[:]
    model.graph.input.extend(ordered)


class _Emitter:
    def __init__(self, graph: ModelGraph, edits: Edits):
        self.model_graph = graph
        self.edits = edits
        self.tensors = graph.tensors
        self.constants = graph.constants.union(edits.twins)
        self.sparse = {s.values.name: s for scope in graph.scopes for s in scope.graph.sparse_initializer}
        self.scope_of = {id(s.graph): i for i, s in enumerate(graph.scopes)}
        self.parents: list[dict[str, onnx.NodeProto]] = [{} for _ in graph.scopes]  # nodes holding each graph's bodies
        for scope in graph.scopes:
            if scope.parent_scope is not None:
                self.parents[scope.parent_scope][scope.parent.name] = scope.parent
        # Nodes GS would write differently from the input: rewired, retargeted or rewritten ones.
        self.rebuilt = {*edits.inputs, *edits.outputs, *edits.retargeted, *edits.raw_constants}
        self.kept_casts: dict[int, set[str]] = {}  # scope -> NewCasts written there or in its kept bodies
        # Graphs in GRAPHS attributes (custom ops): not scopes, GS does not import them, but what they
        # declare counts in _non_tensor_types.  Every node holding one is rebuilt or dead, so met here.
        self.listed_graphs: list[onnx.GraphProto] = []

    # -- tensors -----------------------------------------------------------------------------
    def info(self, name: str) -> TensorInfo | None:
        return self.edits.new_tensors.get(name) or self.tensors.get(name)

    def dtype(self, name: str):
        """GS's dtype at export; sequences, optionals and maps are exported untyped (see
        :func:`_restore_non_tensor_types`)."""
        if name in self.edits.dtypes:
            return self.edits.dtypes[name]
        info = self.info(name)
        if info is None or (info.init is None and info.kind != TENSOR_KIND):
            return None
        return info.dtype

    def value_info(self, name: str) -> onnx.ValueInfoProto:
        """GS's export_value_info_proto."""
        info = self.info(name)
        dtype = self.dtype(name)
        if dtype is None:
            vi = onnx.ValueInfoProto()
            vi.name = name
            return vi
        return _tensor_value_info(name, dtype, info.shape)

    def _convert_small(self, names: list[str]) -> tuple[list, bytes]:
        """Small raw float32 initializers converted in one numpy call (thousands of biases and
        scalars would each pay numpy's per-call overhead).  For each of ``names``, in order:
        ``(name, dims, size)`` when its low-precision bytes are the next ``size`` of the bytes
        returned, else the name alone (an initializer kept, or one converted on its own)."""
        edits, tensors = self.edits, self.tensors
        converted, twins = edits.converted, edits.twins
        width = edits.low_np.itemsize
        plan, raws = [], []
        for name in names:
            if name in converted or name in twins:
                info = tensors[twins.get(name, name)]
                dims = info.shape
                count = math.prod(dims)
                if info.dtype == FLOAT and count < 1 << 14 and info.init.data_location != onnx.TensorProto.EXTERNAL:
                    raw = info.init.raw_data
                    if len(raw) == 4 * count:
                        plan.append((name, dims, count * width))
                        raws.append(raw)
                        continue
            plan.append(name)
        if not raws:
            return plan, b""
        return plan, np.frombuffer(b"".join(raws), dtype="<f4").astype(edits.low_np).tobytes()

    def initializer(self, name: str) -> onnx.TensorProto:
        edits = self.edits
        source = edits.twins.get(name)
        if source is not None:
            values = tensor_array(self.tensors[source].init).astype(edits.low_np)
            return _raw_tensor(name, edits.low_enum, values)
        init = self.tensors[name].init
        if name in edits.converted:
            low_np, low_enum = edits.converted[name]
            if uses_external_data(init):
                return converted_external(init, low_np, low_enum)
            return _raw_tensor(name, low_enum, tensor_array(init).astype(low_np))
        return init

    def _write_initializers(self, out: onnx.GraphProto, names: list[str]) -> None:
        """In GS's order; converted in chunks, so that the converted bytes waiting to be written stay few."""
        low_enum = self.edits.low_enum
        add, append = out.initializer.add, out.initializer.append
        for start in range(0, len(names), _CHUNK):
            plan, low = self._convert_small(names[start:start + _CHUNK])
            position = 0
            for entry in plan:
                if type(entry) is str:
                    append(self.initializer(entry))
                else:
                    name, dims, size = entry
                    stop = position + size
                    add(name=name, data_type=low_enum, dims=dims, raw_data=low[position:stop])
                    position = stop

    # -- graphs ----------------------------------------------------------------------------
    def graph(self, scope_index: int, out: onnx.GraphProto | None = None) -> tuple[onnx.GraphProto, set[str]]:
        """The exported graph after GS's cleanup (into ``out``, empty, when given), and the outer
        names its kept nodes read."""
        scope = self.model_graph.scopes[scope_index]
        g = scope.graph
        nodes = self.edits.graphs[scope.gid]
        bodies: dict[str, dict[str, tuple[onnx.GraphProto, set[str]]]] = {}  # node -> attribute -> body
        body_scopes: dict[str, list[int]] = {}
        for name, parent in self.parents[scope_index].items():
            for attr in parent.attribute:
                if attr.type == GRAPH:
                    child = self.scope_of[id(attr.g)]
                    bodies.setdefault(name, {})[attr.name] = self.graph(child)
                    body_scopes.setdefault(name, []).append(child)
        # The main graph in order, each tensor written by one node (the usual case): a node's
        # inputs are then graph inputs, initializers or earlier nodes' outputs.
        simple = scope_index == 0 and self.model_graph.in_order and self._single_writers(nodes)
        kept, dead = self._used(nodes, g, bodies, simple)
        for k in dead:
            self._note_listed_graphs(nodes.items[k])
        kept_inputs = nodes.inputs if kept is None else [nodes.inputs[k] for k in kept]
        kept_outputs = nodes.outputs if kept is None else [nodes.outputs[k] for k in kept]
        gs_inputs = scope.inputs  # GS's graph inputs: neither a dense nor a sparse initializer of g
        if g.sparse_initializer:
            sparse = {t.values.name for t in g.sparse_initializer}
            gs_inputs = [name for name in gs_inputs if name not in sparse]
        outputs = [t.name for t in g.output]

        # GS's tensor order: first mention wins, over the graph inputs, then each node's inputs
        # and outputs, then the graph outputs.  Initializers are written in it, and value_info for
        # the tensors that are none of those.
        if out is None:
            out = onnx.GraphProto()
        if simple and not g.sparse_initializer and self.constants.isdisjoint(gs_inputs):
            # Then an initializer is first mentioned by its first reader (or as a graph output),
            # and the rest of value_info are the nodes' outputs, each mentioned there first.
            constants = list(dict.fromkeys(filter(self.constants.__contains__,
                                                  chain(chain.from_iterable(kept_inputs), outputs))))
            graph_outputs = set(outputs)
            declared = [n for n in chain.from_iterable(kept_outputs) if n not in graph_outputs]
        else:
            tensor_order: dict[str, None] = dict.fromkeys(chain(
                gs_inputs, chain.from_iterable(chain.from_iterable(zip(kept_inputs, kept_outputs))), outputs))
            tensor_order.pop("", None)
            skip = set(gs_inputs)
            skip.update(outputs)
            constants = [n for n in tensor_order if n in self.constants]
            skip.update(constants)
            declared = [n for n in tensor_order if n not in skip]
        self._write_value_info(out, declared)  # first: see there
        del declared
        casts = self.kept_casts[scope_index] = set()
        self._write_nodes(out, nodes, kept, bodies, casts)
        if bodies:
            kept_names = set(nodes.names) if kept is None else {nodes.names[k] for k in kept}
            bodies = {name: graphs for name, graphs in bodies.items() if name in kept_names}
            for name in bodies:
                for child in body_scopes[name]:
                    casts.update(self.kept_casts[child])
        out.name = g.name
        out.input.extend([self.value_info(n) for n in gs_inputs])
        out.output.extend([self.value_info(n) for n in outputs])
        self._write_initializers(out, [n for n in constants if n not in self.sparse])
        if self.sparse:
            out.sparse_initializer.extend([self.sparse[n] for n in constants if n in self.sparse])
        if g.doc_string:
            out.doc_string = g.doc_string
        if scope_index == 0:
            return out, set()  # the main graph reads no outer names

        local = set(gs_inputs)
        read: set[str] = set()
        for ins, outs in zip(kept_inputs, kept_outputs):
            local.update(outs)
            read.update(ins)
        for graphs in bodies.values():
            for _, foreign in graphs.values():
                read.update(foreign)
        foreign = {n for n in read - local if n and n not in self.constants}
        return out, foreign

    def _write_value_info(self, out: onnx.GraphProto, names: list[str]) -> None:
        """GS writes value_info for each variable with a dtype or a shape.  A declaration GS would
        write back unchanged is copied, then renamed or retyped in the copy; others are rebuilt.

        The copies are first taken as they are and checked all at once (:func:`_all_canonical`);
        only when one is not canonical are they sorted one by one.  A copy is retyped or renamed
        in its bytes: a parse merges the fields appended to a message into the ones before, and a
        later value of a singular field replaces an earlier one."""
        written, retyped, renamed = self._declarations(names, check_each=False)
        blobs = list(map(_SERIALIZE_VALUE_INFO, written))
        data = _wire(value_info=blobs)
        if not _all_canonical(data):
            written, retyped, renamed = self._declarations(names, check_each=True)
            blobs = list(map(_SERIALIZE_VALUE_INFO, written))
            data = None
        del written
        patches = {dtype: _retyping(dtype) for dtype in set(retyped)}
        if len(patches) > 1 or None not in patches or renamed:
            blobs = list(map(bytes.__add__, blobs, map(patches.__getitem__, retyped)))
            for position, name in renamed:
                blobs[position] += onnx.ValueInfoProto(name=name).SerializeToString()
            data = None
        out.MergeFromString(_wire(value_info=blobs) if data is None else data)  # out holds nothing else yet

    def _declarations(self, names: list[str], check_each: bool) -> tuple[list, list, list]:
        """The declarations to write; for each, the dtype its copy takes (None: as it is); and
        (position, name) of the copies that take a new name."""
        infos = list(map(self.tensors.get, names))
        dtypes = list(map(self.edits.dtypes.get, names))
        if check_each:
            written, odd = [], range(len(names))
        else:
            # The common case, picked out in C: a tensor of the index with a declaration of its
            # own, copied (maybe retyped).  The others are looked at one by one.
            written = list(map(getattr, infos, repeat("decl"), repeat(None)))
            odd = sorted({*_positions(bytearray(map(is_, written, repeat(None))), 1),
                          *_positions(bytearray(map(getattr, infos, repeat("merged"), repeat(False))), 1)})
            if not odd:
                return written, dtypes, []
        kept, retyped, renamed = [], [], []
        start = 0
        for k in odd:
            kept += written[start:k]
            retyped += dtypes[start:k]
            start = k + 1
            declaration = self._declaration(names[k], infos[k], dtypes[k], check_each)
            if declaration is not None:
                if declaration[2]:
                    renamed.append((len(kept), names[k]))
                kept.append(declaration[0])
                retyped.append(declaration[1])
        kept += written[start:]
        retyped += dtypes[start:]
        return kept, retyped, renamed

    def _declaration(self, name: str, info: TensorInfo | None, dtype: int | None, check_each: bool):
        """One tensor's declaration to write, the dtype its copy takes and whether it takes the
        name ``name``; None when GS writes none.  ``info``: the index's, when it has the tensor."""
        if info is None:
            # The rewrite's new tensors have fresh names, which no tensor of the index has.
            info = self.edits.new_tensors.get(name)
            if info is None:
                return None
            dtype = self.edits.dtypes.get(name, info.dtype)
        elif info.decl is None and dtype is None:
            return None
        decl = info.decl
        if decl is not None and not info.merged and (not check_each or _canonical(decl)):
            return decl, dtype, name in self.edits.new_tensors
        if self.dtype(name) is not None or info.shape is not None:
            return self.value_info(name), None, False
        return None

    def _used(self, nodes: GraphNodes, g: onnx.GraphProto, bodies, simple: bool) -> tuple[list[int] | None, list[int]]:
        """GS cleanup: the positions of the nodes something reads on the way to a graph output
        (None when that is all of them), and of the others.  ``simple``: the main graph, in
        order, with single writers (see graph)."""
        if simple:
            used = self._used_in_order(nodes, g, bodies)
        else:
            used = self._used_in_any_order(nodes, g, bodies)
        dead = _positions(used, 0)
        return (list(compress(range(len(used)), used)) if dead else None), dead

    def _single_writers(self, nodes: GraphNodes) -> bool:
        """Each tensor the main graph's ``nodes`` write has one writer and is no graph input,
        initializer nor the empty name."""
        outputs = nodes.outputs
        written = set(chain.from_iterable(outputs))
        return len(written) == sum(map(len, outputs)) and "" not in written and written.isdisjoint(self.constants) \
            and written.isdisjoint(self.sparse) and written.isdisjoint(self.model_graph.scopes[0].inputs)

    def _used_in_order(self, nodes: GraphNodes, g: onnx.GraphProto, bodies) -> bytearray:
        """:meth:`_used_in_any_order` in one pass from the last node to the first, for a graph whose
        nodes read only graph inputs, initializers and earlier nodes' outputs (the index's
        ``in_order``), with :meth:`_single_writers`: then every reader of a node's output comes
        after it, so a node is used when a graph output or a later used node reads an output of it."""
        outputs, inputs, names = nodes.outputs, nodes.inputs, nodes.names
        used = bytearray(len(outputs))
        live = {t.name for t in g.output}
        for k in range(len(outputs) - 1, -1, -1):
            if live.isdisjoint(outputs[k]):
                continue
            used[k] = 1
            live.update(inputs[k])
            if bodies and names[k] in bodies:
                for _, foreign in bodies[names[k]].values():
                    live.update(foreign)
        return used

    @staticmethod
    def _used_in_any_order(nodes: GraphNodes, g: onnx.GraphProto, bodies) -> bytearray:
        """For each node, 1 when a graph output reads it, through any chain of nodes."""
        producer = {t: k for k, outs in enumerate(nodes.outputs) for t in outs}  # the last writer, as in GS
        inputs, names = nodes.inputs, nodes.names
        used = bytearray(len(inputs))
        queue = [t.name for t in g.output]
        seen = set(queue)
        while queue:
            k = producer.get(queue.pop())
            if k is None or used[k]:
                continue
            used[k] = 1
            for dep in inputs[k]:
                if dep not in seen:
                    seen.add(dep)
                    queue.append(dep)
            if bodies and names[k] in bodies:
                for _, foreign in bodies[names[k]].values():
                    for dep in foreign:
                        if dep not in seen:
                            seen.add(dep)
                            queue.append(dep)
        return used

    def _note_listed_graphs(self, item) -> None:
        if type(item) is not NewCast and may_hold_graphs(item):
            for attr in item.attribute:
                if attr.type == GRAPHS:
                    self.listed_graphs.extend(attr.graphs)

    # -- nodes -----------------------------------------------------------------------------
    def _write_nodes(self, out: onnx.GraphProto, nodes: GraphNodes, kept: list[int] | None, bodies,
                     casts: set[str]) -> None:
        """The kept nodes as GS writes them: most are the input's own NodeProtos; adds the
        names of the inserted Casts written to ``casts``.

        Written serialized, in batches of at most about ``_BATCH_BYTES`` (:func:`_wire`); the
        nodes of a batch copied as they are are first checked all at once (:func:`_all_clean`),
        and one by one only when one of them is not clean."""
        items, names, inputs, outputs = nodes.items, nodes.names, nodes.inputs, nodes.outputs
        order = range(len(items)) if kept is None else kept
        built_here = self.rebuilt.union(bodies, self.edits.casts)  # by name: the rest are copied
        batch: list[bytes] = []
        specials: list[int] = []  # where in the batch the nodes built here are
        first = size = 0  # the batch's first position in `order`, its bytes
        for k in order:
            name = names[k]
            if name in built_here:
                item = items[k]
                if type(item) is NewCast:
                    casts.add(name)
                    blob = _SERIALIZE_NODE(_cast_node(item))
                else:
                    blob = _SERIALIZE_NODE(self.node(item, inputs[k], outputs[k], bodies))
                specials.append(len(batch))
            else:
                blob = _SERIALIZE_NODE(items[k])
            batch.append(blob)
            size += len(blob)
            if size > _BATCH_BYTES:
                self._write_batch(out, nodes, bodies, batch, specials, order[first:first + len(batch)], size)
                first += len(batch)
                batch, specials, size = [], [], 0
        if batch:
            self._write_batch(out, nodes, bodies, batch, specials, order[first:], size)

    def _write_batch(self, out: onnx.GraphProto, nodes: GraphNodes, bodies, batch: list[bytes], specials: list[int],
                     ks, size: int) -> None:
        """Write ``batch``, the serialized nodes ``ks``; those not at ``specials`` are the input's
        own, rebuilt here if GS would not write them back unchanged."""
        data = None
        plain = len(batch) - len(specials)
        # The check in bulk reads every byte a few times: for nodes holding big tensors, checking
        # them one by one costs less.
        if plain and size < _CHECK_IN_BULK_BELOW * len(batch):
            if specials:
                skip = set(specials)
                clean = _all_clean(_wire(nodes=[blob for i, blob in enumerate(batch) if i not in skip]))
            else:
                data = _wire(nodes=batch)
                clean = _all_clean(data)
        else:
            clean = not plain
        if not clean:
            data = None
            skip = set(specials)
            for i, k in enumerate(ks):
                if i not in skip:
                    item = nodes.items[k]
                    if not _clean(item):
                        batch[i] = _SERIALIZE_NODE(self.node(item, nodes.inputs[k], nodes.outputs[k], bodies))
        if len(batch) == 1:
            out.node.add().MergeFromString(batch[0])  # a big one: no second copy of its bytes
        else:
            out.MergeFromString(_wire(nodes=batch) if data is None else data)

    def node(self, item: onnx.NodeProto, inputs, outputs, bodies) -> onnx.NodeProto:
        """A NodeProto as GS writes it, with the rewrite's edits."""
        name = item.name
        edits = self.edits
        node = onnx.NodeProto()
        node.op_type = item.op_type
        node.input.extend(inputs)
        node.output.extend(outputs)
        if item.name:
            node.name = item.name
        if item.HasField("domain"):
            node.domain = item.domain
        skipped = []
        for attr in item.attribute:
            exported = self.attribute(attr, bodies.get(name, {}))
            if exported is not None:
                node.attribute.append(exported)
            elif not attr.ref_attr_name:
                skipped.append(attr)
        self._note_listed_graphs(item)
        for attr in skipped:
            # Kinds GS does not model (TYPE_PROTO, SPARSE_TENSOR, TENSORS, GRAPHS...) were handed
            # back to it as Python values, so they come last, remade by make_attribute.
            node.attribute.append(onnx.helper.make_attribute(attr.name, onnx.helper.get_attribute_value(attr)))
        if name in edits.retargeted:
            _retarget(node, edits.low_enum, edits.low_np)
        elif name in edits.raw_constants:
            for attr in node.attribute:
                if attr.name == "value" and attr.type == A.TENSOR:
                    source = attr.t
                    raw = _raw_tensor(source.name, source.data_type, tensor_array(source))
                    if source.HasField("data_location"):
                        raw.data_location = source.data_location
                    attr.t.CopyFrom(raw)
        return node

    @staticmethod
    def attribute(attr: onnx.AttributeProto, bodies) -> onnx.AttributeProto | None:
        if attr.type == GRAPH:
            out = onnx.AttributeProto(name=attr.name, type=GRAPH)
            out.g.CopyFrom(bodies[attr.name][0])
            return out
        if attr.type in _LISTS and not (attr.ints or attr.floats or attr.strings):
            return onnx.helper.make_attribute(attr.name, [])  # GS export fails here too (ValueError)
        if attr.type in _SIMPLE or attr.type in _LISTS:
            out = onnx.AttributeProto()
            out.CopyFrom(attr)
            out.ClearField("doc_string")
            if attr.type == A.TENSOR:
                out.t.name = out.t.name  # GS names every tensor it writes, even with ""
            return out
        return None  # sparse tensors, tensor/graph lists, type protos: GS does not import them


def _positions(mask: bytearray, value: int) -> list[int]:
    """Where ``mask`` holds ``value``, searched in C."""
    found = []
    k = mask.find(value)
    while k >= 0:
        found.append(k)
        k = mask.find(value, k + 1)
    return found


def _cast_node(cast: NewCast) -> onnx.NodeProto:
    node = onnx.NodeProto(op_type="Cast", name=cast.name)
    node.input.append(cast.src)
    node.output.append(cast.dst)
    attr = node.attribute.add()
    attr.name, attr.type, attr.i = "to", A.INT, cast.to
    return node


def _clean(node: onnx.NodeProto) -> bool:
    """True when GS would write the node back unchanged (the common case)."""
    if node.HasField("doc_string") or node.HasField("overload") or node.metadata_props or node.device_configurations:
        return False
    for attr in node.attribute[:]:  # a list: iterating the field itself is slower, even when empty
        t = attr.type
        if t in _SIMPLE:
            if attr.HasField("doc_string") or (t == A.TENSOR and not attr.t.HasField("name")):
                return False
        elif t in _LISTS:
            if attr.HasField("doc_string") or not (attr.ints or attr.floats or attr.strings):
                return False
        else:
            return False
    return True


def _canonical(vi: onnx.ValueInfoProto) -> bool:
    """A declaration GS would write back unchanged: a tensor type with only elem_type and plain dims."""
    if len(vi.ListFields()) != 2:
        return False  # doc_string, metadata, or no type
    t = vi.type
    if len(t.ListFields()) != 1 or not t.HasField("tensor_type"):
        return False
    tensor_type = t.tensor_type
    if not tensor_type.HasField("elem_type"):
        return False
    for dim in tensor_type.shape.dim:
        if dim.denotation:  # dim_value and dim_param share a oneof: only a denotation can differ
            return False
    return True


# Message types over onnx's own field numbers that keep only some fields: bytes parsed as one
# of them and measured again tell, in C and for thousands of messages at once, whether any
# other field was there (see _all_canonical and _all_clean).  Strings are read as bytes (no
# UTF-8 check), and so is a message nothing needs to look into.  Closed (proto2) enums keep
# only the values they list: any other value is an unknown field, dropped with the rest.
_SCHEMAS = (
    # value_info as GS writes it: a name and a tensor type with an element type and plain dims
    ("Dim", (), [("dim_value", 1, "optional", "int64"), ("dim_param", 2, "optional", "bytes")]),
    ("Shape", (), [("dim", 1, "repeated", "Dim")]),
    ("TensorType", (), [("elem_type", 1, "required", "int32"), ("shape", 2, "optional", "Shape")]),
    ("Type", (), [("tensor_type", 1, "required", "TensorType")]),
    ("ValueInfo", (), [("name", 1, "required", "bytes"), ("type", 2, "required", "Type")]),
    ("Graph", (), [("value_info", 13, "repeated", "ValueInfo")]),
    # what makes a node one GS would not write back as it is (_clean), but for two conditions on the
    # attribute type: such fields, and the attribute types GS models (a closed enum)
    ("ShapeAttribute", [("GsType", {"FLOAT": 1, "INT": 2, "STRING": 3, "TENSOR": 4, "FLOATS": 6, "INTS": 7,
                                    "STRINGS": 8})],
     [("type", 20, "optional", "ShapeAttribute.GsType"),
      *[(name, number, "repeated", "bytes") for name, number in (
          ("g", 6), ("tensors", 10), ("graphs", 11), ("doc_string", 13), ("tp", 14), ("type_protos", 15),
          ("sparse_tensor", 22), ("sparse_tensors", 23))]]),
    ("ShapeNode", (), [("attribute", 5, "repeated", "ShapeAttribute"),
                       *[(name, number, "repeated", "bytes") for name, number in (
                           ("doc_string", 6), ("overload", 8), ("metadata_props", 9),
                           ("device_configurations", 10))]]),
    ("ShapeNodes", (), [("node", 1, "repeated", "ShapeNode")]),
    # list attributes with their values only: an empty one is just its type
    ("ListAttribute", [("ListType", {"FLOATS": 6, "INTS": 7, "STRINGS": 8})],
     [("floats", 7, "repeated", "float"), ("ints", 8, "repeated", "int64"), ("strings", 9, "repeated", "bytes"),
      ("type", 20, "optional", "ListAttribute.ListType")]),
    ("ListNode", (), [("attribute", 5, "repeated", "ListAttribute")]),
    ("ListNodes", (), [("node", 1, "repeated", "ListNode")]),
    # tensor attributes with their tensor's name only
    ("TensorName", (), [("name", 8, "optional", "bytes")]),
    ("TensorAttribute", [("TensorType", {"TENSOR": 4})],
     [("t", 5, "optional", "TensorName"), ("type", 20, "optional", "TensorAttribute.TensorType")]),
    ("TensorNode", (), [("attribute", 5, "repeated", "TensorAttribute")]),
    ("TensorNodes", (), [("node", 1, "repeated", "TensorNode")]),
    # a graph's nodes and value_info as serialized messages, parsed into the output in one call
    ("Wire", (), [("node", 1, "repeated", "bytes"), ("value_info", 13, "repeated", "bytes")]),
)

# How _all_clean's ShapeNodes write an attribute of each type GS models, with nothing else; and how
# its ListNodes and TensorNodes write an attribute _clean rejects: a list type without values, a
# tensor type without a tensor or with a tensor without a name (either field order).
_ATTRIBUTE = 5 << 3 | 2  # NodeProto.attribute's tag
_PLAIN_ATTRIBUTE = {kind: bytes([_ATTRIBUTE, 3, 160, 1, kind]) for kind in (*_SIMPLE, *_LISTS)}
_EMPTY_LIST = tuple(_PLAIN_ATTRIBUTE[kind] for kind in _LISTS)
_UNNAMED_TENSOR = (_PLAIN_ATTRIBUTE[A.TENSOR], bytes([_ATTRIBUTE, 5, _ATTRIBUTE, 0, 160, 1, A.TENSOR]),
                   bytes([_ATTRIBUTE, 5, 160, 1, A.TENSOR, _ATTRIBUTE, 0]))


@functools.cache
def _schema(name: str):
    """The message class ``name`` of :data:`_SCHEMAS`."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    labels = {"optional": F.LABEL_OPTIONAL, "repeated": F.LABEL_REPEATED, "required": F.LABEL_REQUIRED}
    scalars = {"int64": F.TYPE_INT64, "int32": F.TYPE_INT32, "float": F.TYPE_FLOAT, "bytes": F.TYPE_BYTES}
    file = descriptor_pb2.FileDescriptorProto(name="onnxmp_gs.proto", package="onnxmp_gs", syntax="proto2")
    enums = {f"{message}.{enum}" for message, nested, _ in _SCHEMAS for enum, _ in nested}
    for message, nested, fields in _SCHEMAS:
        proto = file.message_type.add(name=message)
        for enum, values in nested:
            kind = proto.enum_type.add(name=enum)
            for value_name, number in values.items():
                kind.value.add(name=value_name, number=number)
        for field_name, number, label, kind in fields:
            field = proto.field.add(name=field_name, number=number, label=labels[label])
            if kind in scalars:
                field.type = scalars[kind]
            else:
                field.type = F.TYPE_ENUM if kind in enums else F.TYPE_MESSAGE
                field.type_name = f".onnxmp_gs.{kind}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    descriptor = pool.FindMessageTypeByName(f"onnxmp_gs.{name}")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)  # protobuf < 4.22


def _keeps_everything(schema: str, data: bytes) -> bool:
    """``data`` parsed as ``schema`` has all its required fields and loses no byte when the
    fields ``schema`` does not list are dropped."""
    from google.protobuf.message import EncodeError

    parsed = _schema(schema)()
    parsed.MergeFromString(data)
    parsed.DiscardUnknownFields()
    try:
        return len(parsed.SerializeToString()) == len(data)  # checks required fields on the way
    except EncodeError:
        return False


_SERIALIZE_NODE = onnx.NodeProto.SerializeToString
_SERIALIZE_VALUE_INFO = onnx.ValueInfoProto.SerializeToString


@functools.cache
def _retyping(dtype: int | None) -> bytes:
    """Bytes that, appended to a serialized tensor declaration, set its element type to ``dtype``."""
    if dtype is None:
        return b""
    vi = onnx.ValueInfoProto()
    vi.type.tensor_type.elem_type = dtype
    return vi.SerializeToString()


def _wire(nodes: list[bytes] = (), value_info: list[bytes] = ()) -> bytes:
    """A serialized graph holding these serialized nodes and declarations.  Parsed into a graph,
    it adds them all in one call: protobuf copies each message appended to a repeated field by
    serializing and parsing it, which costs more per message than serializing it here."""
    wire = _schema("Wire")()
    wire.node.extend(nodes)
    wire.value_info.extend(value_info)
    return wire.SerializeToString()


def _all_canonical(data: bytes) -> bool:
    """True when every declaration in ``data`` (a serialized graph holding only value_info)
    passes :func:`_canonical`: one with any other field (a doc string, a denotation, another kind
    of type) loses bytes as a ``Graph``, and one lacking a name, type or element type is not
    initialized."""
    return _keeps_everything("Graph", data)


def _kept_fields(schema: str, data: bytes) -> bytes:
    """``data`` parsed as ``schema`` and written again without the fields ``schema`` does not list."""
    parsed = _schema(schema)()
    parsed.MergeFromString(data)
    parsed.DiscardUnknownFields()
    return parsed.SerializeToString()


def _all_clean(data: bytes) -> bool:
    """True when every node in ``data`` (a serialized graph holding only nodes) passes
    :func:`_clean`, checked in C rather than field by field.

    Written as ``ShapeNodes``, a clean node is its tag and length followed by one of five-byte
    :data:`_PLAIN_ATTRIBUTE` per attribute.  Anything else there (a doc string, an attribute
    without a type GS models, or with a field GS drops) is left when those are taken out.  Left
    are then the tags and lengths of the nodes, in pairs, with no byte over 127: a bad field's tag
    would be the first byte after its node's pair, never 10 (a node's tag), and a length of 128
    or more has two bytes.  The rest depends on the attribute type, so lists and tensors are read
    as ``ListNodes`` and ``TensorNodes``: each bad attribute is then one of a few byte strings
    (any of them elsewhere is a false alarm, which only costs the check node by node)."""
    shapes = _kept_fields("ShapeNodes", data)
    left = shapes
    for plain in _PLAIN_ATTRIBUTE.values():
        left = left.replace(plain, b"")
    if not (left.isascii() and len(left) % 2 == 0 and left[::2] == b"\n" * (len(left) // 2)):
        return False
    for kinds, schema, bad in ((_LISTS, "ListNodes", _EMPTY_LIST), ((A.TENSOR,), "TensorNodes", _UNNAMED_TENSOR)):
        if any(_PLAIN_ATTRIBUTE[kind] in shapes for kind in kinds):
            written = _kept_fields(schema, data)
            if any(pattern in written for pattern in bad):
                return False
    return True


def _tensor_value_info(name: str, dtype: int, shape) -> onnx.ValueInfoProto:
    """``onnx.helper.make_tensor_value_info``, without its per-call overhead."""
    vi = onnx.ValueInfoProto()
    vi.name = name
    tensor_type = vi.type.tensor_type
    tensor_type.elem_type = dtype
    if shape is not None:
        dims = tensor_type.shape.dim
        tensor_type.shape.SetInParent()
        for d in shape:
            dim = dims.add()
            if d is None:
                continue
            if isinstance(d, str):
                dim.dim_param = d
            else:
                dim.dim_value = d
    return vi


def _raw_tensor(name: str, data_type: int, values: np.ndarray) -> onnx.TensorProto:
    tensor = onnx.TensorProto()
    tensor.name = name
    tensor.data_type = data_type
    tensor.dims.extend(values.shape)
    tensor.raw_data = values.tobytes()
    return tensor


def _retarget(node: onnx.NodeProto, low_enum: int, low_np) -> None:
    """Spec §5.8: an op whose float32 output type comes from an attribute now makes low precision."""
    attrs = {a.name: a for a in node.attribute}
    if node.op_type == "Cast":
        attrs["to"].i = int(low_enum)
        return
    values, name = None, None
    if "value" in attrs:
        values, name = tensor_array(attrs["value"].t), attrs["value"].t.name
    elif node.op_type == "Constant":
        for key in ("value_float", "value_floats"):
            if key in attrs:
                attr = attrs[key]
                values = np.asarray(attr.f if key == "value_float" else list(attr.floats), dtype=np.float32)
                name = node.output[0] + "_value"
                node.attribute.remove(attr)
    if values is None:  # ConstantOfShape defaults to a float32 zero
        values, name = np.zeros((1,), dtype=np.float32), node.output[0] + "_value"
    tensor = _raw_tensor(name, low_enum, np.asarray(values).astype(low_np))
    if "value" in attrs:
        attrs["value"].t.CopyFrom(tensor)
    else:
        attr = node.attribute.add()
        attr.name, attr.type = "value", A.TENSOR
        attr.t.CopyFrom(tensor)


def _value_infos(graph: onnx.GraphProto):
    for g in iter_proto_graphs(graph):
        yield from g.input
        yield from g.output
        yield from g.value_info


def _non_tensor_types(graphs: Iterable[onnx.GraphProto]) -> dict[str, onnx.TypeProto]:
    """Sequence, optional and map types by value name, over ``graphs``.  A name that two sibling
    scopes use with different types is left out: which one a value had is then unknown."""
    types: dict[str, onnx.TypeProto] = {}
    ambiguous: set[str] = set()
    for g in graphs:
        for values in (g.input, g.output, g.value_info):
            if {value.type.WhichOneof("value") for value in values} <= TENSOR_OR_UNTYPED:
                continue
            for value in values:
                if value.type.WhichOneof("value") in TENSOR_OR_UNTYPED:
                    continue
                known = types.setdefault(value.name, value.type)
                if known != value.type:
                    ambiguous.add(value.name)
    for name in ambiguous:
        del types[name]
    return types


def _restore_non_tensor_types(graph: onnx.GraphProto, types: dict[str, onnx.TypeProto]) -> None:
    """Values that are not plain tensors never change type: they get their declared types back."""
    if not types:
        return
    for value in _value_infos(graph):
        original = types.get(value.name)
        if original is not None:
            value.type.CopyFrom(original)


def _functions_through_gs(original: onnx.ModelProto) -> list[onnx.FunctionProto]:
    """Model functions as GS writes them after its cleanup (onnxmp does not edit functions)."""
    import onnx_graphsurgeon as gs
    from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter
    from onnx_graphsurgeon.logger import G_LOGGER

    shell = onnx.ModelProto()
    shell.ir_version = original.ir_version
    shell.opset_import.extend(original.opset_import)
    shell.functions.extend(original.functions)
    shell.graph.name = "functions"
    with G_LOGGER.suppress(G_LOGGER.ERROR):
        graph = gs.import_onnx(shell)
        for func in graph.functions:
            func.cleanup(remove_unused_node_outputs=False, recurse_subgraphs=True, remove_unused_graph_inputs=False,
                         recurse_functions=False)
        return [OnnxExporter.export_function(func) for func in graph.functions]
