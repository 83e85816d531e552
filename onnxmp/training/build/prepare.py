"""Make an exported forward graph differentiable by onnxruntime-training 1.19's gradient builder.

ORT builds a gradient only for the op types in its registry, and some of
those builders read optional outputs or attributes that exporters leave out.
What :func:`prepare_for_gradient` does, on the training copy only (the
inference model the user exported is never changed):

* ``LayerNormalization`` with one output (torch.onnx, opset >= 17): adds the
  ``Mean`` and ``InvStdDev`` outputs that its gradient reads;
* ``Dropout`` with one output: adds the ``mask`` output its gradient reads;
* ``Transpose`` without ``perm``: writes the default (reversed axes) out;
* activations ORT 1.19 has no gradient for, rewritten into ops it has:
  ``Gelu`` (opset 20, both ``approximate`` modes; ORT would differentiate the
  tanh form as the Erf form), ``Elu``, ``Selu``, ``Celu``, ``Softplus``,
  ``Softsign``, ``Mish``, ``HardSigmoid``, ``HardSwish``, ``PRelu``, and the
  variadic ``Sum`` and ``Mean``;
* ``Where`` whose trainable ``X`` or ``Y`` input is broadcast (torch's dynamo
  exporter stores an attention mask's ``0`` and ``float32.min`` fill as 0-d
  initializers), and ``Pow`` whose trainable base is broadcast against its
  exponent: ORT's gradients of these two keep the output's shape instead of
  summing back to the input's, and ``InPlaceAccumulatorV2`` then writes that
  full-size gradient into the parameter's buffer (heap corruption: a wrong
  Reshape error, a segfault, or silently wrong weights), or a Slice's gradient
  silently takes a wrong part of it.  Such an input is first ``Expand``-ed to
  the output's shape, whose gradient ORT reduces.

Separately, :func:`unprove_symbolic_dims` runs on the shape-inferred model ORT's
gradient builder reads, so that the ops which do sum back (Add, Sub, Mul, Div,
Expand...) do so wherever a broadcast is hidden behind symbolic dims.

Ops left without a gradient (:data:`NO_GRADIENT`) on a path from a trainable
parameter to the loss raise :class:`OnnxMPError` naming the op and node, and
the trainable parameters that reach it (freezing those removes the op from
the backward pass).  ``requires_grad`` parameters the model output does not
depend on are reported the same way, instead of ORT's "couldn't find the
consumer node".
"""
from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxmp.normalize import infer_tensor_types
from onnxmp.domains import is_onnx_domain
from onnxmp.errors import OnnxMPError
from onnxmp.training.build.fuse import fuse_gelus
from onnxmp.naming import FreshNames, proto_names
from onnxmp.training.nodes import FLOATS, Rewrite, attribute

log = logging.getLogger("onnxmp.training.build.prepare")

# Op types of the default domain with no gradient builder in onnxruntime-training
# 1.19.2, each confirmed by building the gradient of MatMul -> op -> loss (ORT: "The
# gradient builder has not been registered").  The ones rewritten below are not listed;
# an op missing here still gets a named error, translated from ORT's.
NO_GRADIENT = frozenset({
    "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare", "ReduceL1", "Einsum", "CumSum", "Sign", "Floor",
    "Ceil", "Round", "Hardmax", "Atan", "Asin", "Acos", "Tan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
    "ThresholdedRelu", "Shrink", "LpNormalization", "InstanceNormalization", "GroupNormalization", "LRN",
    "Mod", "Det",
})

# Float input slots ORT 1.19 computes no gradient for (each confirmed: a parameter read only
# there makes ORT fail with "failed to find NodeArg by name: <param>_grad").
NOT_DIFFERENTIATED = {"Clip": {1: "min", 2: "max"}, "Pow": {1: "exponent"}, "Pad": {2: "constant_value"},
                      "Dropout": {1: "ratio"}, "Resize": {1: "roi", 2: "scales"},
                      # the running statistics of an inference-mode BatchNormalization
                      "BatchNormalization": {3: "input_mean", 4: "input_var"}}



@dataclass(frozen=True)
class Preparation:
    """One rewrite: ``op_type`` node ``node`` and what was done to it."""

    op_type: str
    node: str
    action: str


def prepare_for_gradient(model: onnx.ModelProto, requires_grad: Iterable[str], *, ort_builder: bool = True,
                         low_precision: bool = False) -> tuple[onnx.ModelProto, list[Preparation]]:
    """A copy of ``model`` that ORT 1.19 can differentiate, and the list of what changed.

    ``ort_builder=False`` (onnxmp's builder) skips the refusal of :data:`NO_GRADIENT` ops: onnxmp's
    builder has rules for several of them (ReduceMax, Einsum, CumSum...) and names the op it lacks
    itself, at build time.  It also skips the rewrites that exist only for ORT's builder
    (:data:`ORT_ONLY`): onnxmp's has a rule for each such op, and decides broadcasts from the
    symbolic shapes itself, so they would only add nodes to its graph.  Instead, the exported GELU
    subgraphs become one com.microsoft Gelu/FastGelu each (:func:`~onnxmp.training.build.fuse.fuse_gelus`).

    ``low_precision`` (a float16/bfloat16 build, whose ``convert`` stage colors this graph): the
    rewrites that change what the AMP coloring runs in float32 (:data:`COLORING`) are made for
    onnxmp's builder too, and GELU is not fused, so that both builders train the same
    mixed-precision forward (measured: skipping them made onnxmp's float16 gradients of BERT up to
    2.4x further from the float32 ones than ORT's)."""
    requires_grad = list(requires_grad)
    skipped = frozenset() if ort_builder else ORT_ONLY - COLORING if low_precision else ORT_ONLY
    result, done = _rewritten(model, requires_grad, skipped=skipped)
    if not ort_builder and not low_precision:
        done += [Preparation(op_type, name, "fused from the exported GELU subgraph (one kernel, one gradient rule)")
                 for op_type, name in fuse_gelus(result, requires_grad)]
    if ort_builder:
        _check_differentiable(result, requires_grad, infer_tensor_types(result))
    counts = Counter(p.op_type for p in done)
    if counts:
        log.info("prepared for the gradient builder: %s",
                 ", ".join(f"{n} x{c}" for n, c in sorted(counts.items())))
    return result, done


def _rewritten(model: onnx.ModelProto, requires_grad: list[str], *,
               skipped: frozenset[str] = frozenset()) -> tuple[onnx.ModelProto, list[Preparation]]:
    """The rewrites of :func:`prepare_for_gradient` but those of the op types ``skipped``, without its checks."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    names = FreshNames(proto_names(graph))
    types = infer_tensor_types(result)
    trainable = _downstream(graph, requires_grad)
    done: list[Preparation] = []
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if not is_onnx_domain(node.domain):
            nodes.append(node)
            continue
        rewrite = _REWRITES.get(node.op_type)
        if rewrite is None or node.op_type in skipped:
            nodes.append(node)
            continue
        replacement = rewrite(node, Rewrite.of(names, node, types, trainable), types)
        if replacement is None:
            nodes.append(node)
            continue
        new_nodes, action = replacement
        nodes.extend(new_nodes)
        done.append(Preparation(node.op_type, node.name, action))
    graph.ClearField("node")
    graph.node.extend(nodes)
    return result, done


# --- rewrites --------------------------------------------------------------------------


def _add_outputs(node: onnx.NodeProto, b: Rewrite, wanted: int, labels: list[str]) -> tuple[list, str] | None:
    present = len(node.output)
    if present >= wanted and all(node.output[:wanted]):
        return None
    new = onnx.NodeProto()
    new.CopyFrom(node)
    added = []
    for i in range(wanted):
        if i >= len(new.output):
            new.output.append("")
        if not new.output[i]:
            new.output[i] = b.names(f"{b.scope}/{labels[i]}")
            added.append(labels[i])
    return [new], f"added the {' and '.join(added)} output{'s' * (len(added) > 1)} its gradient reads"


def _layer_norm(node, b, types):
    return _add_outputs(node, b, 3, ["Y", "Mean", "InvStdDev"])


def _batch_norm(node, b, types):
    # ORT trains BatchNormalization on batch statistics (BatchNormInternal, training_mode=1) and
    # never writes the running ones back: an eval-mode export would be fine-tuned as another
    # function than the one it computes, and deployed with statistics that do not match its
    # weights.  Written out with the running statistics as constants, it trains as exported.
    if attribute(node, "training_mode", 0) or any(node.output[1:]):
        return None
    tp = types.get(node.input[0])
    if tp is None or not tp.tensor_type.HasField("shape") or len(tp.tensor_type.shape.dim) < 2:
        log.warning("BatchNormalization %r: rank of its input unknown, so onnxruntime trains it on batch "
                    "statistics", node.name)
        return None
    rank = len(tp.tensor_type.shape.dim)
    x, scale, bias, mean, var = node.input[:5]
    per_channel = b.names(f"{b.scope}/per_channel")
    b.nodes.append(helper.make_node("Constant", [], [per_channel], name=b.names(f"{b.scope}/Constant"),
                                    value=numpy_helper.from_array(np.array([-1] + [1] * (rank - 2), np.int64),
                                                                  per_channel)))
    inv = b.op("Div", [scale, b.op("Sqrt", [b.op("Add", [var, b.const(attribute(node, "epsilon", 1e-5))])])])
    shift = b.op("Sub", [bias, b.op("Mul", [mean, inv])])
    b.op("Add", [b.op("Mul", [x, b.op("Reshape", [inv, per_channel])]), b.op("Reshape", [shift, per_channel])],
         node.output[0])
    return b.nodes, "written out with its running statistics, which an eval-mode export trains with"


def _dropout(node, b, types):
    return _add_outputs(node, b, 2, ["output", "mask"])


def _transpose(node, b, types):
    if attribute(node, "perm", None) is not None:
        return None
    tp = types.get(node.input[0])
    if tp is None or not tp.tensor_type.HasField("shape"):
        raise OnnxMPError(f"Transpose node {node.name!r} has no perm and the rank of its input is unknown, "
                          "so onnxruntime cannot differentiate it",
                          "give the Transpose an explicit perm attribute (or a static-rank input)")
    rank = len(tp.tensor_type.shape.dim)
    new = onnx.NodeProto()
    new.CopyFrom(node)
    new.attribute.append(helper.make_attribute("perm", list(range(rank - 1, -1, -1))))
    return [new], "wrote out the default perm its gradient reads"


def _gelu(node, b, types):
    x, y = node.input[0], node.output[0]
    half_x = b.op("Mul", [x, b.const(0.5)])
    if attribute(node, "approximate", b"none") in (b"tanh", "tanh"):
        cube = b.op("Mul", [b.op("Mul", [x, x]), x])
        inner = b.op("Add", [x, b.op("Mul", [cube, b.const(0.044715)])])
        t = b.op("Tanh", [b.op("Mul", [inner, b.const(math.sqrt(2.0 / math.pi))])])
        action = "decomposed to 0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3)))"
    else:
        t = b.op("Erf", [b.op("Div", [x, b.const(math.sqrt(2.0))])])
        action = "decomposed to the Erf form 0.5x(1+erf(x/sqrt2)) torch exports"
    b.op("Mul", [half_x, b.op("Add", [t, b.const(1.0)])], y)
    return b.nodes, action


def _softplus_of(b: Rewrite, x: str, output: str | None = None) -> str:
    # log(1 + exp(x)) = relu(x) + log(1 + exp(-|x|)): no overflow for large x.
    tail = b.op("Log", [b.op("Add", [b.op("Exp", [b.op("Neg", [b.op("Abs", [x])])]), b.const(1.0)])])
    return b.op("Add", [b.op("Relu", [x]), tail], output)


def _softplus(node, b, types):
    _softplus_of(b, node.input[0], node.output[0])
    return b.nodes, "decomposed to relu(x) + log(1 + exp(-|x|))"


def _mish(node, b, types):
    x = node.input[0]
    b.op("Mul", [x, b.op("Tanh", [_softplus_of(b, x)])], node.output[0])
    return b.nodes, "decomposed to x * tanh(softplus(x))"


def _softsign(node, b, types):
    x = node.input[0]
    b.op("Div", [x, b.op("Add", [b.op("Abs", [x]), b.const(1.0)])], node.output[0])
    return b.nodes, "decomposed to x / (1 + |x|)"


def _elu_of(b: Rewrite, x: str, alpha: float, output: str | None = None, *, divide: bool = False) -> str:
    z = b.const(0.0)
    arg = b.op("Div", [x, b.const(alpha)]) if divide else x
    # Min(x, 0) inside Exp keeps the unused branch finite, so its gradient is too.
    neg = b.op("Mul", [b.const(alpha), b.op("Sub", [b.op("Exp", [b.op("Min", [arg, z])]), b.const(1.0)])])
    return b.op("Where", [b.op("Greater", [x, z]), x, neg], output)


def _elu(node, b, types):
    _elu_of(b, node.input[0], attribute(node, "alpha", 1.0), node.output[0])
    return b.nodes, "decomposed to where(x > 0, x, alpha(exp(min(x, 0)) - 1))"


def _celu(node, b, types):
    _elu_of(b, node.input[0], attribute(node, "alpha", 1.0), node.output[0], divide=True)
    return b.nodes, "decomposed to where(x > 0, x, alpha(exp(min(x/alpha, 0)) - 1))"


def _selu(node, b, types):
    alpha = attribute(node, "alpha", 1.67326319217681884765625)
    gamma = attribute(node, "gamma", 1.05070102214813232421875)
    b.op("Mul", [b.const(gamma), _elu_of(b, node.input[0], alpha)], node.output[0])
    return b.nodes, "decomposed to gamma * elu(x, alpha)"


def _hard_sigmoid_of(b: Rewrite, x: str, alpha: float, beta: float, output: str | None = None) -> str:
    lin = b.op("Add", [b.op("Mul", [x, b.const(alpha)]), b.const(beta)])
    return b.op("Clip", [lin, b.const(0.0), b.const(1.0)], output)


def _hard_sigmoid(node, b, types):
    _hard_sigmoid_of(b, node.input[0], attribute(node, "alpha", 0.2), attribute(node, "beta", 0.5), node.output[0])
    return b.nodes, "decomposed to clip(alpha x + beta, 0, 1)"


def _hard_swish(node, b, types):
    x = node.input[0]
    b.op("Mul", [x, _hard_sigmoid_of(b, x, 1.0 / 6.0, 0.5)], node.output[0])
    return b.nodes, "decomposed to x * clip(x/6 + 1/2, 0, 1)"


def _prelu(node, b, types):
    x, slope = node.input[0], node.input[1]
    b.op("Where", [b.op("Less", [x, b.const(0.0)]), b.op("Mul", [x, slope]), x], node.output[0])
    return b.nodes, "decomposed to where(x < 0, slope x, x)"


def _variadic(node, b, types):
    inputs = [i for i in node.input if i]
    if node.op_type == "Sum" and len(inputs) == 1:
        b.op("Identity", inputs, node.output[0])
        return b.nodes, "replaced by Identity (one input)"
    total = inputs[0]
    last = node.op_type == "Sum"
    for i, name in enumerate(inputs[1:], 1):
        total = b.op("Add", [total, name], node.output[0] if last and i == len(inputs) - 1 else None)
    if node.op_type == "Mean":
        b.op("Div", [total, b.const(float(len(inputs)))], node.output[0])
    return b.nodes, "decomposed into a chain of Add" + (" and a Div" if node.op_type == "Mean" else "")


def _expand_broadcast(node, b, types, slots: tuple[int, ...]):
    """Expand the trainable inputs at ``slots`` that broadcast to the output's shape.

    For ops whose ORT 1.19 gradient returns the output's shape for every input
    instead of summing back over the broadcast axes (see :data:`_REWRITES`).
    Expand's own gradient does sum back, so each such input is first expanded
    by the shapes of the node's other inputs: to the output's shape, without
    computing the node twice.  Shape inputs carry no gradient.
    """
    out_shape = _static_shape(types.get(node.output[0]))
    broadcast = [i for i in slots if i < len(node.input) and node.input[i] in b.trainable
                 and (out_shape is None or _static_shape(types.get(node.input[i])) != out_shape)]
    if not broadcast:
        return None
    new = onnx.NodeProto()
    new.CopyFrom(node)
    for i in broadcast:
        wide = _runtime_shaped(b, node.input[i], i)  # the Expands sum back by runtime shapes too
        for j, other in enumerate(node.input):
            if j != i and other:
                wide = b.op("Expand", [wide, b.op("Shape", [other])])
        new.input[i] = wide
    b.nodes.append(new)
    return b.nodes, "expanded a broadcast trainable input to the output's shape, so its gradient is summed back"


def _where(node, b, types):
    return _expand_broadcast(node, b, types, (1, 2))


def _pow(node, b, types):
    return _expand_broadcast(node, b, types, (0,))  # ORT computes no gradient for the exponent


# Prefix of the tensors whose dims ORT's gradient builder must not read (unprove_symbolic_dims).
RUNTIME_SHAPE = "onnxmp_runtime_shape/"


def _hidden_broadcast(x: tuple | None, y: tuple | None) -> bool:
    """Whether ORT 1.19 could get the broadcast of shapes ``x`` and ``y`` wrong statically.

    ``ComputeBroadcastBackwardAxes`` takes two different symbolic dims for equal
    and a symbolic dim against a value other than 1 for that value: no sum back,
    though either may be 1 at run time.  Two values, or a 1 on either side (the
    1 is summed over), it gets right.
    """
    if x is None or y is None:
        return True
    return any(p != q and 1 not in (p, q) and not (isinstance(p, int) and isinstance(q, int))
               for p, q in zip(reversed(x), reversed(y)))


def _runtime_shaped(b: Rewrite, x: str, slot: int) -> str:
    """``x`` through ``Reshape(x, Shape(x))``: an identity, named for :func:`unprove_symbolic_dims`."""
    return b.op("Reshape", [x, b.op("Shape", [x])], output=b.names(f"{RUNTIME_SHAPE}{b.scope}/{slot}"))


def _runtime_broadcast(node, b, types):
    """Hand ORT a broadcasting node whose shapes hide a broadcast with shapes it cannot read.

    Each trainable input is read through ``Reshape(x, Shape(x))``, an identity
    whose output :func:`unprove_symbolic_dims` leaves without dims: the gradient
    builder then sums back over the axes the shapes have at run time
    (``BroadcastGradientArgs``) for this node alone.  Other consumers keep the
    static shapes (ORT's MatMul gradient, for one, goes wrong on the runtime
    path: batch-size dependent gradients on wav2vec2).
    """
    shapes = [_static_shape(types.get(i)) if i else () for i in node.input]
    slots = [i for i, name in enumerate(node.input) if name in b.trainable]
    if not slots or not any(_hidden_broadcast(shapes[i], shapes[j])
                            for i in slots for j in range(len(node.input)) if j != i and node.input[j]):
        return None
    new = onnx.NodeProto()
    new.CopyFrom(node)
    for i in slots:
        new.input[i] = _runtime_shaped(b, node.input[i], i)
    b.nodes.append(new)
    return b.nodes, "read its inputs with runtime shapes, so a broadcast symbolic dims hide is summed back"


def _static_shape(tp: onnx.TypeProto | None) -> tuple | None:
    """The shape as a tuple of ints and dim_param names; None if any part is unknown."""
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    dims = []
    for d in tp.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.dim_param:
            dims.append(d.dim_param)
        else:
            return None
    return tuple(dims)


def _downstream(graph: onnx.GraphProto, sources: Iterable[str]) -> frozenset[str]:
    """Every tensor of ``graph`` computed from one of ``sources`` (the sources included)."""
    reached = set(sources)
    for node in graph.node:  # graph.node is topologically sorted
        if any(i in reached for i in node.input):
            reached.update(o for o in node.output if o)
    return frozenset(reached)


_REWRITES: dict[str, Callable] = {
    "LayerNormalization": _layer_norm, "Dropout": _dropout, "BatchNormalization": _batch_norm, "Transpose": _transpose, "Gelu": _gelu,
    "Softplus": _softplus, "Mish": _mish, "Softsign": _softsign, "Elu": _elu, "Celu": _celu, "Selu": _selu,
    "HardSigmoid": _hard_sigmoid, "HardSwish": _hard_swish, "PRelu": _prelu, "Sum": _variadic,
    "Mean": _variadic,
    # ORT 1.19's Where and Pow gradients keep the output's shape for a broadcast input.
    "Where": _where, "Pow": _pow,
    # ORT sums these back over broadcast axes, but decides which from static shapes.
    **dict.fromkeys(("Add", "Sub", "Mul", "Div", "Max", "Min", "Expand"), _runtime_broadcast),
}

# The rewrites only ORT's builder needs: it lacks a gradient for these activations, reads the
# optional outputs and attributes exporters leave out, and gets broadcasts wrong (Where, Pow, and
# symbolic dims).  onnxmp's builder has a rule for each op (``autodiff.VJP_RULES``), adds the
# outputs it reads itself (``Vjp.forward_output``) and sums broadcasts back from the symbolic
# shapes: for it these rewrites only add nodes.  BatchNormalization's rewrite is not here: it keeps
# an eval-mode export training as the function it computes, whichever builder differentiates it.
ORT_ONLY = frozenset(_REWRITES) - {"BatchNormalization"}
# Of those, the ones that change the AMP coloring of the graph: a trainable input read through
# Reshape(x, Shape(x)) moves where the conversion casts it (parts of BERT's forward stay float32).
COLORING = frozenset(("Add", "Sub", "Mul", "Div", "Max", "Min", "Expand"))


# --- the differentiable path -----------------------------------------------------------


def _check_differentiable(model: onnx.ModelProto, requires_grad: list[str],
                          types: dict[str, onnx.TypeProto]) -> None:
    """Every trainable parameter must reach the loss (the first output) through float
    tensors, and no op on those paths may lack a gradient."""
    paths = _GradientPaths(model, types)
    unused = [p for p in requires_grad if p not in paths.needed]
    if unused:
        raise OnnxMPError(f"the model's output {paths.target!r} does not depend on trainable parameter(s) "
                          f"{', '.join(unused[:10])}", "leave them out of requires_grad (or pass them as frozen)")
    blocked: dict[str, onnx.NodeProto] = {}
    reached_by: dict[str, set[str]] = defaultdict(set)  # node -> parameters reaching it
    for param in requires_grad:
        reaches, nodes, stopped = paths.walk(param)
        for key, node in nodes.items():
            reached_by[key].add(param)
            if node.op_type in NO_GRADIENT and is_onnx_domain(node.domain):
                blocked[key] = node
        if not reaches:
            detail = f" (it feeds only {stopped})" if stopped else ""
            raise OnnxMPError(f"trainable parameter {param!r} reaches the output {paths.target!r} only through "
                              f"integer or boolean tensors or inputs onnxruntime does not differentiate{detail}, "
                              "so it has no gradient", "leave it out of requires_grad (or pass it as frozen)")
    if blocked:
        first = next(iter(blocked.values()))
        key = first.name or first.output[0]
        params = sorted(reached_by[key])
        ops = sorted({n.op_type for n in blocked.values()})
        raise OnnxMPError(
            f"onnxruntime-training 1.19 has no gradient for {first.op_type} (node {first.name!r}), which lies "
            f"between trainable parameters and the loss" + (f"; also: {', '.join(ops)}" if len(ops) > 1 else ""),
            f"freeze the parameters that feed it ({', '.join(params[:5])}{', ...' if len(params) > 5 else ''}), "
            f"or re-export the model with {first.op_type} written in differentiable ops")


def without_gradient(model: onnx.ModelProto, names: Iterable[str]) -> dict[str, str]:
    """Of the initializers ``names``, those the loss cannot differentiate, with the reason.

    For callers that train "every weight" (``onnxmp train``): exporters such as
    torch's dynamo exporter store constants (a clamp's minimum, a mask fill) as
    initializers, and ORT computes no gradient for them.
    """
    statistics = {n.input[i]: f"it is BatchNormalization {n.name!r}'s running {what}"
                  for n in model.graph.node if n.op_type == "BatchNormalization" and is_onnx_domain(n.domain)
                  for i, what in ((3, "mean"), (4, "variance")) if len(n.input) > i}
    # The checks of prepare_for_gradient have nothing to check with no trainable parameter.
    model, _ = _rewritten(model, [])
    paths = _GradientPaths(model, infer_tensor_types(model))
    result = {}
    for name in names:
        if name in statistics:
            result[name] = statistics[name]
            continue
        if name not in paths.needed:
            result[name] = f"the output {paths.target!r} does not use it"
            continue
        reaches, _, stopped = paths.walk(name)
        if not reaches:
            result[name] = f"it feeds only {stopped or 'integer or boolean tensors'}"
    return result


class _GradientPaths:
    """The float paths from tensors to the loss (the model's first output)."""

    def __init__(self, model: onnx.ModelProto, types: dict[str, onnx.TypeProto]):
        graph = model.graph
        self.types = types
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        producers: dict[str, onnx.NodeProto] = {}
        for node in graph.node:
            for name in dict.fromkeys(node.input):
                self.consumers[name].append(node)
            for name in node.output:
                producers[name] = node
        self.target = graph.output[0].name
        # Backward from the loss's input: every tensor the first output depends on.
        self.needed: set[str] = set()
        queue = deque([self.target])
        while queue:
            name = queue.popleft()
            if name in self.needed:
                continue
            self.needed.add(name)
            node = producers.get(name)
            if node is not None:
                queue.extend(i for i in node.input if i)

    def _is_float(self, name: str) -> bool:
        tp = self.types.get(name)
        if tp is None or not tp.HasField("tensor_type"):
            return True  # unknown: let ORT decide
        return tp.tensor_type.elem_type in FLOATS

    def walk(self, source: str) -> tuple[bool, dict[str, onnx.NodeProto], str]:
        """Whether ``source`` reaches the loss through differentiated float inputs; the nodes on
        the way; and the first input slot ORT does not differentiate that stopped the walk."""
        seen, queue, nodes, stopped, reaches = {source}, deque([source]), {}, "", False
        while queue:
            name = queue.popleft()
            reaches |= name == self.target
            for node in self.consumers.get(name, ()):
                skip = NOT_DIFFERENTIATED.get(node.op_type, {}) if is_onnx_domain(node.domain) else {}
                slots = [i for i, n in enumerate(node.input) if n == name]
                if all(i in skip for i in slots):
                    stopped = stopped or f"{node.op_type} {skip[slots[0]]} (node {node.name!r})"
                    continue
                outs = [o for o in node.output if o and o in self.needed and self._is_float(o)]
                if not outs:
                    continue
                nodes[node.name or node.output[0]] = node
                for o in outs:
                    if o not in seen:
                        seen.add(o)
                        queue.append(o)
        return reaches, nodes, stopped


def describe(preparations: list[Preparation]) -> list[dict[str, str | int]]:
    """One summary row per op type: what was done and to how many nodes (for the manifest)."""
    rows: dict[tuple[str, str], int] = Counter((p.op_type, p.action) for p in preparations)
    return [{"op_type": op, "action": action, "nodes": n} for (op, action), n in sorted(rows.items())]
