"""Values of constant-only subgraphs, computed at build time (onnx's reference evaluator, one node at a time).

Exporters compute shapes, pads and repeats from constants and static shapes through chains onnx's
data propagation does not follow (TorchScript's reflect-pad pads: ConstantOfShape, Concat, Reshape,
Slice, Transpose, Cast; ``torch.tile``'s repeats behind an ``If`` whose condition is constant).
:func:`fold_constants` evaluates every node whose inputs are all known (small initializers,
Constants, values folded before it, ``Shape``/``Size`` of a static shape; an ``If`` whose condition is
known, through the branch it takes), keeping small tensors only so that it stays cheap.
"""
from __future__ import annotations

import logging
import warnings

import numpy as np
import onnx
from onnx import helper, numpy_helper

log = logging.getLogger("onnxmp.training.build.autodiff")

LIMIT = 4096  # elements: shape-like values and small tables, never weights of any size worth training
_RANDOM = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                     "Bernoulli", "Dropout"})
_LOOPS = frozenset({"Loop", "Scan", "SequenceMap"})


def small(array: np.ndarray) -> bool:
    """A value worth keeping: few elements, of a plain numpy type (what a Constant can hold)."""
    return array.size <= LIMIT and array.dtype.kind in "biuf"


def fold_constants(graph: onnx.GraphProto, opset_imports, shapes: dict, known: dict[str, np.ndarray]) -> dict:
    """``known`` extended by the values of the nodes of ``graph`` computable from it (a new dict)."""
    values = dict(known)
    _fold(graph.node, list(opset_imports), shapes, values)
    return values


def _fold(nodes, opsets, shapes: dict, values: dict) -> None:
    for node in nodes:
        if node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM or node.op_type in _LOOPS:
            continue
        outs = [o for o in node.output if o]
        if not outs or all(o in values for o in outs):
            continue
        try:
            # numpy's warnings (a Log of zero in T5's position buckets) are the forward's own business
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                found = _evaluate(node, opsets, shapes, values)
        except Exception as exc:  # the reference evaluator raises assorted types: the value stays unknown
            log.debug("not folded: %s (%s)", node.name or node.output[0], exc)
            continue
        if found is None:
            continue
        for name, array in zip(node.output, found):
            array = np.asarray(array)
            if name and small(array):
                values[name] = array


def _evaluate(node: onnx.NodeProto, opsets, shapes: dict, values: dict) -> list | None:
    op, ins = node.op_type, list(node.input)
    if op in ("Shape", "Size"):
        shape = values[ins[0]].shape if ins[0] in values else shapes.get(ins[0])
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        if op == "Size":
            return [np.array(int(np.prod(shape, dtype=np.int64)), np.int64)]
        attrs = {a.name: a.i for a in node.attribute}
        return [np.array(list(shape)[attrs.get("start", 0):attrs.get("end", None)], np.int64)]
    if op == "If":
        if ins[0] not in values:
            return None
        branch = next(a.g for a in node.attribute if a.name == ("then_branch" if values[ins[0]] else "else_branch"))
        scope = dict(values)
        _fold(branch.node, opsets, shapes, scope)
        outs = [scope.get(o.name) for o in branch.output]
        return None if any(o is None for o in outs) else outs
    if not all(i in values for i in ins if i) or any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
        return None
    from onnx.reference import ReferenceEvaluator

    feeds = {i: values[i] for i in ins if i}
    graph = helper.make_graph(
        [node], "fold", [helper.make_tensor_value_info(i, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                         for i, a in feeds.items()],
        [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output if o])
    model = helper.make_model(graph, opset_imports=opsets)
    result = ReferenceEvaluator(model).run(None, feeds)
    by_name = dict(zip([o for o in node.output if o], result))
    return [by_name.get(o) if o else None for o in node.output]


def initial_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Small initializers of ``graph``: the values folding starts from.  An initializer that is also a
    graph input is a default the caller may replace, so it is left out."""
    inputs = {v.name for v in graph.input}
    values = {}
    for t in graph.initializer:
        if t.name not in inputs and np.prod(t.dims, dtype=np.int64) <= LIMIT and t.data_type != onnx.TensorProto.STRING:
            array = numpy_helper.to_array(t)
            if small(array):
                values[t.name] = array
    return values


def inline_constant_ifs(graph: onnx.GraphProto, values: dict[str, np.ndarray]) -> int:
    """Each ``If`` of ``graph`` whose condition ``values`` knows, replaced by the nodes of the branch it
    takes (and Identity nodes to its outputs): TorchScript's ``torch.tile`` asks ``If`` whether the
    repeats are shorter than the rank, which static shapes answer.  A branch whose names the graph
    already uses stays an If.  Returns how many were inlined."""
    taken = {o for n in graph.node for o in n.output} | {t.name for t in graph.initializer}
    taken |= {v.name for v in graph.input}
    nodes, inlined = [], 0
    for node in graph.node:
        cond = values.get(node.input[0]) if node.op_type == "If" and node.domain in ("", "ai.onnx") else None
        if cond is None or cond.size != 1:
            nodes.append(node)
            continue
        branch = next(a.g for a in node.attribute if a.name == ("then_branch" if cond.item() else "else_branch"))
        names = {o for n in branch.node for o in n.output if o}
        if names & taken or len(branch.output) != len(node.output):
            nodes.append(node)
            continue
        taken |= names
        nodes.extend(branch.node)
        nodes.extend(helper.make_node("Identity", [b.name], [o], name=f"{node.name or o}/taken")
                     for b, o in zip(branch.output, node.output) if o)
        inlined += 1
    if inlined:
        del graph.node[:]
        graph.node.extend(nodes)
    return inlined
