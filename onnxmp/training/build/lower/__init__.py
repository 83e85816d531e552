"""Lowering: ORT 1.19's training graph rewritten into ops every plain onnxruntime runs.

The training and eval models of :func:`~onnxmp.training.build_artifacts` hold ORT's gradient
ops (com.microsoft ``*Grad``, ``InPlaceAccumulatorV2``...), which only the deprecated training
build registers.  :func:`lower_model` replaces each by standard ONNX ops, one function per op
(:data:`LOWERINGS`), and keeps the com.microsoft ops that the plain CPU *and* CUDA builds both
register (FusedMatMul, Gelu, FastGelu...: :mod:`onnxmp.kernels`).  ORT also registers a few training
ops in the ai.onnx domain (MaxPoolGrad), where onnx defines no such op: those are lowered too.  An op it knows neither way
is an :class:`~onnxmp.errors.OnnxMPError` naming the op and node, at build time.

``InPlaceAccumulatorV2`` changes meaning (the portable contract, ``docs/training.md``): its
output, ``<P>_grad.accumulation.out``, becomes the new buffer value instead of a bool flag.  The
accumulators sharing the graph's reset flag are lowered together, as one ``If`` on it
(:func:`~onnxmp.training.build.lower.nn.in_place_accumulators`).
Each lowering is proven equal to ORT's own kernel in ``tests/training/test_lowering.py`` and
``scripts/check_lowering.py``.
"""
from __future__ import annotations

from typing import Callable

import onnx

from onnxmp.domains import ONNX_DOMAINS, is_onnx_domain, op_key
from onnxmp.errors import OnnxMPError
from onnxmp.kernels import KernelTable
from onnxmp.naming import FreshNames, proto_names
from onnxmp.subgraphs import iter_proto_graphs
from onnxmp.training.build.lower import activations, nn, shapes
from onnxmp.training.build.lower._emit import Emit

MS_DOMAIN = "com.microsoft"
ML_DOMAIN = "ai.onnx.ml"
# Plain onnxruntime must run both; the kernel table lists what its CPU and CUDA builds register.
PROVIDERS = ("cpu", "cuda")

LOWERINGS: dict[str, Callable[[Emit], None]] = {
    "BiasGeluGrad_dX": activations.bias_gelu_grad_dx,
    "BroadcastGradientArgs": shapes.broadcast_gradient_args,
    "ConcatTraining": shapes.concat_training,
    "ConvGrad": nn.conv_grad,
    "DivGrad": activations.div_grad,
    "DropoutGrad": activations.dropout_grad,
    "FastGeluGrad": activations.fast_gelu_grad,
    "GatherElementsGrad": shapes.gather_elements_grad,
    "GatherGrad": shapes.gather_grad,
    "GatherNDGrad": shapes.gather_nd_grad,
    "GeluGrad": activations.gelu_grad,
    "InPlaceAccumulatorV2": nn.in_place_accumulator_v2,
    "LayerNormalizationGrad": nn.layer_normalization_grad,
    "LogSoftmaxGrad": activations.log_softmax_grad,
    "LogSoftmaxGrad_13": activations.log_softmax_grad_13,
    "MaxPoolGrad": shapes.max_pool_grad,
    "QuickGeluGrad": activations.quick_gelu_grad,
    "ReduceSumTraining": shapes.reduce_sum_training,
    "ReluGrad": activations.relu_grad,
    "Scale": activations.scale,
    "SigmoidGrad": activations.sigmoid_grad,
    "SliceGrad": shapes.slice_grad,
    "SoftmaxCrossEntropyLossGrad": nn.softmax_cross_entropy_loss_grad,
    "SoftmaxGrad": activations.softmax_grad,
    "SoftmaxGrad_13": activations.softmax_grad_13,
    "SplitTraining": shapes.split_training,
    "TanhGrad": activations.tanh_grad,
}


def standard(node: onnx.NodeProto) -> bool:
    """An op onnx defines, in ai.onnx or ai.onnx.ml (ORT registers some training ops, MaxPoolGrad,
    in ai.onnx's domain, where onnx has no such op)."""
    if is_onnx_domain(node.domain):
        return onnx.defs.has(node.op_type)
    return node.domain == ML_DOMAIN and onnx.defs.has(node.op_type, ML_DOMAIN)


def kept(domain: str, op_type: str, version: int = 1) -> bool:
    """Whether a non-ai.onnx op stays: plain onnxruntime's CPU and CUDA builds both register it."""
    table = KernelTable.default()
    return all(table.has_kernel(p, domain, op_type, version) for p in PROVIDERS)


def lower_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` in standard ONNX ops plus the com.microsoft ops plain onnxruntime
    registers on CPU and CUDA.  Same inputs and outputs, in order; an ``InPlaceAccumulatorV2``'s
    output becomes the new buffer value (float, the buffer's shape).  Raises
    :class:`OnnxMPError` naming the op and node for an op it cannot lower."""
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    types, declared = _types(lowered)
    versions = {("" if is_onnx_domain(o.domain) else o.domain): o.version for o in lowered.opset_import}
    min_opset = 0
    retyped: dict[str, onnx.TypeProto] = {}
    names = FreshNames(proto_names(lowered.graph))  # every graph's names: a body sees its parents'
    for graph in list(iter_proto_graphs(lowered.graph)):
        nodes: list[onnx.NodeProto] = []
        changed = False
        batch, scaled = nn.accumulator_batch(graph)
        batched = {id(n) for n in batch}
        for node in graph.node:
            if id(node) in batched:
                if node is batch[-1]:  # where every gradient the batch reads exists
                    emit = Emit(names, node, types, declared)
                    nn.in_place_accumulators(emit, batch, scaled)
                    moved = {id(n) for n in scaled.values()}  # the Muls now inside the If
                    nodes = [n for n in nodes if id(n) not in moved]
                    nodes.extend(emit.nodes)
                    retyped.update(emit.retyped)
                    changed = True
                continue
            if standard(node) or kept(node.domain, node.op_type, versions.get(node.domain, 1)):
                nodes.append(node)
                continue
            rule = LOWERINGS.get(node.op_type) if node.domain in (MS_DOMAIN, *ONNX_DOMAINS) else None
            if rule is None:
                raise OnnxMPError(
                    f"cannot lower {op_key(node.op_type, node.domain)} (node {node.name!r}): plain onnxruntime has no "
                    f"kernel for it and onnxmp has no standard form of it",
                    "report the model to onnxmp; the native engine (onnxruntime-training) still runs it")
            emit = Emit(names, node, types, declared)
            rule(emit)
            nodes.extend(emit.nodes)
            retyped.update(emit.retyped)
            min_opset = max(min_opset, emit.min_opset)
            changed = True
        if changed:
            graph.ClearField("node")
            graph.node.extend(nodes)
    _retype(lowered.graph, retyped)
    _set_opsets(lowered, min_opset)
    return lowered


def _types(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, onnx.TypeProto]]:
    """Element type and declared type of every value the model (or onnx's inference) types."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # a graph onnx cannot infer still carries ORT's own value_info
        inferred = model.graph
    declared: dict[str, onnx.TypeProto] = {}
    for graph in [inferred, *iter_proto_graphs(model.graph)]:
        for value in (*graph.value_info, *graph.input, *graph.output):
            if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
                declared.setdefault(value.name, value.type)
    types = {name: t.tensor_type.elem_type for name, t in declared.items()}
    for graph in iter_proto_graphs(model.graph):
        types.update((t.name, t.data_type) for t in graph.initializer)
        _propagate(graph, types)
    return types, declared


_INT64_OUT = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin", "BroadcastGradientArgs"})
_BOOL_OUT = frozenset({"Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Not", "And", "Or", "Xor",
                       "IsInf", "IsNaN", "InPlaceAccumulatorV2"})


def _propagate(graph: onnx.GraphProto, types: dict[str, int]) -> None:
    """Element types of the values neither ORT nor onnx's inference declared (the outputs of
    nodes downstream of an op onnx does not know): by the op's rule, else its first typed input's."""
    for node in graph.node:
        for i, out in enumerate(node.output):
            if not out or types.get(out):
                continue
            if node.op_type == "Cast":
                elem = next((a.i for a in node.attribute if a.name == "to"), 0)
            elif node.op_type in _INT64_OUT:
                elem = onnx.TensorProto.INT64
            elif node.op_type in _BOOL_OUT and i == 0:
                elem = onnx.TensorProto.BOOL
            else:
                elem = next((types[x] for x in node.input if x and types.get(x)), 0)
            if elem:
                types[out] = elem


def _retype(graph: onnx.GraphProto, retyped: dict[str, onnx.TypeProto]) -> None:
    """Declared outputs and value_info of the values whose type a lowering changed."""
    for value in (*graph.output, *graph.value_info):
        if value.name in retyped:
            value.type.CopyFrom(retyped[value.name])


def _set_opsets(model: onnx.ModelProto, min_opset: int) -> None:
    """Raise the ai.onnx opset to what the lowered nodes need, and drop the imports of domains
    no node uses any more (the training domains)."""
    used = {node.domain for graph in iter_proto_graphs(model.graph) for node in graph.node}
    keep = []
    for opset in model.opset_import:
        if is_onnx_domain(opset.domain):
            if opset.version < min_opset:
                if any(n.op_type == "RoiAlign" for g in iter_proto_graphs(model.graph) for n in g.node):
                    # RoiAlign-16 changed its default coordinate mode: the model would mean something else.
                    raise OnnxMPError(f"cannot lower the training graph: it needs opset {min_opset} and holds "
                                      f"RoiAlign at opset {opset.version}", f"export the model at opset >= {min_opset}")
                opset.version = min_opset
            keep.append(opset)
        elif opset.domain in used:
            keep.append(opset)
    model.ClearField("opset_import")
    model.opset_import.extend(keep)


def check_lowered(model: onnx.ModelProto) -> None:
    """Raise :class:`OnnxMPError` unless every op of ``model`` is ai.onnx or kept (a postcondition)."""
    for graph in iter_proto_graphs(model.graph):
        for node in graph.node:
            if not (standard(node) or kept(node.domain, node.op_type)):
                raise OnnxMPError(f"the lowered graph still holds {op_key(node.op_type, node.domain)} "
                                  f"(node {node.name!r})", "this is an onnxmp bug; please report it with the model")


__all__ = ["LOWERINGS", "check_lowered", "kept", "lower_model", "standard"]
