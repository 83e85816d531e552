"""Reverse-mode differentiation of an ONNX graph: the walk.

From a scalar seed, nodes are visited in reverse topological order (an ONNX graph's node list is
topologically sorted).  Only nodes on a path from a ``wrt`` tensor to the seed are
differentiated, through float tensors only: integer and bool tensors (shapes, masks, indices)
carry no gradient, and ops whose gradient is zero almost everywhere (Sign, Floor...) stop the
path.  A tensor read by several differentiated consumers gets its gradient summed once (one
``Sum`` over every contribution).  Each op's gradient is one rule of
:data:`~onnxmp.training.build.autodiff.rules.VJP_RULES`.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto

from onnxmp.domains import is_onnx_domain, op_key
from onnxmp.errors import OnnxMPError
from onnxmp.naming import FreshNames, proto_names
from onnxmp.training.build.autodiff.context import Vjp
from onnxmp.training.build.autodiff.emit import MS_DOMAIN, Emitter
from onnxmp.training.build.autodiff.fold import inline_constant_ifs
from onnxmp.training.build.autodiff.info import GraphInfo
from onnxmp.training.build.autodiff.rules import VJP_RULES
from onnxmp.training.contract import gradient_output
from onnxmp.training.nodes import FLOATS

log = logging.getLogger("onnxmp.training.build.autodiff")


@dataclass
class BackwardReport:
    """What :func:`backward` added: ``nodes_added`` nodes; ``runtime_shapes`` places where a
    shape is read at run time because the symbolic shapes could not decide it (``runtime_places``
    says where and what); ``ops`` the forward op types differentiated, with their counts;
    ``float32_ops`` the gradient's ops run in float32 for want of a low-precision kernel on the target."""

    nodes_added: int = 0
    runtime_shapes: int = 0
    runtime_places: list[str] = field(default_factory=list)
    ops: dict[str, int] = field(default_factory=dict)
    float32_ops: dict[str, int] = field(default_factory=dict)


def _domain(node: onnx.NodeProto) -> str:
    return "" if is_onnx_domain(node.domain) else node.domain


def _rule(node: onnx.NodeProto):
    return VJP_RULES.get((_domain(node), node.op_type), False)


def backward(model: onnx.ModelProto, seed: str, wrt: Sequence[str], *,
             target: str = "cpu") -> tuple[onnx.ModelProto, BackwardReport]:
    """A copy of ``model`` with nodes computing ``<w>_grad``, the gradient of the float scalar
    ``seed`` with respect to each of ``wrt`` (initializers or graph inputs), added as graph outputs
    after the model's own (each shaped and typed like its ``w``), for ``target``'s kernels."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    wrt = list(dict.fromkeys(wrt))
    info = GraphInfo(result)
    # an If whose condition folds to a constant is the branch it takes (no rule differentiates If)
    if inline_constant_ifs(graph, {**info.folded, **{k: info.value(k) for k in info.constant_nodes}}):
        info = GraphInfo(result)
    _check_names(graph, seed, wrt, info)
    nodes = list(graph.node)

    active = set(wrt)
    for node in nodes:
        if _rule(node) is None or not any(x in active for x in node.input):
            continue
        active.update(o for o in node.output if o and info.types.get(o) in FLOATS)
    needed = {seed}
    on_path: list[onnx.NodeProto] = []
    for node in reversed(nodes):
        if any(o in needed and o in active for o in node.output) and any(x in active for x in node.input):
            needed.update(x for x in node.input if x in active)
            on_path.append(node)
    missing = [n for n in on_path if _rule(n) is False]
    if missing:
        raise _no_rule(missing, nodes, wrt, info)

    names = FreshNames(proto_names(graph))
    opset = max((o.version for o in result.opset_import if is_onnx_domain(o.domain)), default=1)
    emit = Emitter(names, dict(info.types), target=target, opset=opset)
    runtime: list[str] = []
    contributions: dict[str, list[str]] = {seed: [_seed(emit, seed, info, runtime)]}
    totals: dict[str, str] = {}

    def total(name: str) -> str | None:
        if name not in totals:
            parts = contributions.get(name)
            if not parts:
                return None
            emit.scope = f"{name}_grad"
            totals[name] = parts[0] if len(parts) == 1 else emit.op("Sum", parts)
        return totals[name]

    ops: Counter = Counter()
    for node in on_path:
        grads = [total(o) if o in active else None for o in node.output]
        if not any(grads):
            continue
        emit.scope = f"{node.name or node.output[0]}_Grad"
        ctx = Vjp(node, info, emit, grads, [x in active and x in needed for x in node.input], runtime)
        _rule(node)(ctx)
        ops[op_key(node.op_type, node.domain)] += 1
        for i, grad in ctx.grads.items():
            contributions.setdefault(node.input[i], []).append(grad)

    unreached = [w for w in wrt if not contributions.get(w)]
    read = {name for n in graph.node for name in n.input} | _outer_reads(graph)
    unused = [w for w in unreached if w not in read]
    if unused:
        raise OnnxMPError(f"the loss {seed!r} does not depend on trainable parameter(s) {', '.join(unused[:10])}: "
                          "no node reads them", "leave them out of requires_grad")
    if unreached:
        raise OnnxMPError(f"the loss {seed!r} reaches trainable parameter(s) {', '.join(unreached[:10])} only "
                          "through integer or boolean tensors, or inputs without a gradient (Clip's bounds, "
                          "Pow's exponent...), so they have no gradient",
                          "leave them out of requires_grad (or pass them as frozen)")
    finals = {w: total(w) for w in wrt}
    shared = Counter(finals.values())
    outputs = []
    for w in wrt:
        grad = _named(emit, finals[w], gradient_output(w), info.types.get(w), shared[finals[w]] > 1)
        outputs.append(onnx.helper.make_tensor_value_info(grad, info.types[w], info.shape(w)))

    _prune(emit, {o.name for o in outputs})
    added = len(emit.nodes)
    graph.node.extend(emit.nodes)
    graph.initializer.extend(emit.initializers)
    graph.output.extend(outputs)
    _opsets(result, emit)
    report = BackwardReport(added, len(runtime), runtime, dict(sorted(ops.items())),
                            dict(sorted(emit.float32_ops.items())))
    log.info("gradient graph: %d nodes added, %d runtime-shape place(s)", added, len(runtime))
    if emit.float32_ops:
        log.info("gradient ops run in float32 (no %s kernel for their low-precision types): %s", target,
                 ", ".join(f"{k} x{v}" for k, v in report.float32_ops.items()))
    return result, report


def _check_names(graph: onnx.GraphProto, seed: str, wrt: list[str], info: GraphInfo) -> None:
    produced = {o for n in graph.node for o in n.output} | {v.name for v in graph.input} | set(info.initializers)
    if seed not in produced:
        raise OnnxMPError(f"no value of the graph is called {seed!r}", "name the loss value to differentiate")
    if info.types.get(seed) not in FLOATS:
        raise OnnxMPError(f"the value to differentiate, {seed!r}, is not a float tensor",
                          "differentiate the float32 loss (Cast it to FLOAT first)")
    sources = {v.name for v in graph.input} | set(info.initializers)
    bad = [w for w in wrt if w not in sources]
    if bad:
        raise OnnxMPError(f"not initializers or inputs of the model: {', '.join(bad[:10])}",
                          "gradients are taken with respect to initializers (weights)")
    not_float = [w for w in wrt if info.types.get(w) not in FLOATS]
    if not_float:
        raise OnnxMPError(f"cannot differentiate with respect to non-float tensors: {', '.join(not_float[:10])}",
                          "train float initializers only; leave integer ones (shapes, indices) out of requires_grad")


def _seed(emit: Emitter, seed: str, info: GraphInfo, runtime: list[str]) -> str:
    elem = info.types[seed]
    emit.scope = f"{seed}_grad"
    shape = info.shape(seed)
    if shape == ():
        return emit.scalar(1.0, elem)
    static = info.static_shape(seed)
    if static is not None:
        return emit.constant(np.ones(static, np.float32), elem=elem)
    runtime.append(f"{seed}: ones shaped like the seed")
    ones = emit.op("ConstantOfShape", [emit.op("Shape", [seed], elem=TensorProto.INT64)],
                   value=onnx.numpy_helper.from_array(np.ones(1, np.float32)), elem=TensorProto.FLOAT)
    return emit.cast(ones, elem)


def _named(emit: Emitter, value: str, name: str, elem: int, shared: bool) -> str:
    """``value`` under the name ``name``: its producing node renamed when nothing else reads it
    (nor is it another parameter's gradient too, ``shared``)."""
    producer = next((n for n in reversed(emit.nodes) if value in n.output), None)
    read = shared or any(value in n.input for n in emit.nodes)
    if producer is not None and not read:
        producer.output[list(producer.output).index(value)] = name
        emit.types[name] = elem
        return name
    emit.scope = name
    return emit.op("Identity", [value], name)


def _prune(emit: Emitter, outputs: set[str]) -> None:
    """Drops the emitted nodes and constants nothing reads: a rule may take over what an earlier
    one emitted (LogSoftmax's gradient re-scatters GatherElements' picked values, a ReLU's the
    MaxPool after it), which then has no reader left."""
    from onnxmp.subgraphs import bodies

    def reads(node: onnx.NodeProto) -> set[str]:
        names = set(node.input)
        for body in bodies(node):
            names |= {name for n in body.node for name in n.input} | _outer_reads(body)
        return names

    nodes = list(emit.nodes)
    while True:
        read = outputs.union(*(reads(n) for n in nodes))
        kept = [n for n in nodes if any(o in read for o in n.output if o)]
        if len(kept) == len(nodes):
            break
        nodes = kept
    if len(nodes) < len(emit.nodes):
        emit.nodes[:] = nodes
        emit.initializers[:] = [t for t in emit.initializers if t.name in read]


def _opsets(model: onnx.ModelProto, emit: Emitter) -> None:
    for opset in model.opset_import:
        if is_onnx_domain(opset.domain) and opset.version < emit.min_opset:
            if any(n.op_type == "RoiAlign" for n in model.graph.node):
                raise OnnxMPError(f"the gradient graph needs opset {emit.min_opset} and the model holds RoiAlign "
                                  f"at opset {opset.version}", f"export the model at opset >= {emit.min_opset}")
            opset.version = emit.min_opset
    have = {o.domain for o in model.opset_import}
    for domain in sorted(emit.domains - have):
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))


def _no_rule(missing: list[onnx.NodeProto], nodes: list[onnx.NodeProto], wrt: list[str],
             info: GraphInfo) -> OnnxMPError:
    first = missing[0]
    reaching = []
    for w in wrt:
        active = {w}
        for node in nodes:
            if any(x in active for x in node.input):
                if node is first:
                    reaching.append(w)
                    break
                active.update(o for o in node.output if o and info.types.get(o) in FLOATS)
    others = sorted({op_key(n.op_type, n.domain) for n in missing[1:]} - {op_key(first.op_type, first.domain)})
    shown = ", ".join(reaching[:8]) + (", ..." if len(reaching) > 8 else "")
    domain = first.domain or "ai.onnx"
    return OnnxMPError(
        f"onnxmp has no gradient for {first.op_type} (domain {domain}, node {first.name!r}), which lies between "
        f"trainable parameters and the loss" + (f"; nor for {', '.join(others)}" if others else ""),
        f"pass the parameters that reach it as frozen ({shown}), or re-export the model with {first.op_type} "
        "written in differentiable ops")


__all__ = ["BackwardReport", "backward", "MS_DOMAIN"]


def _outer_reads(graph: onnx.GraphProto) -> set[str]:
    """Names the subgraphs of ``graph``'s nodes read (from their enclosing scope, among others)."""
    from onnxmp.subgraphs import bodies

    names: set[str] = set()
    for node in graph.node:
        for body in bodies(node):
            names |= {name for n in body.node for name in n.input} | _outer_reads(body)
    return names
