"""Training stage: what ORT 1.19's CPU kernels need to run the backward graph exactly and
deterministically.

* :func:`float32_cpu_grad_kernels`: low-precision ``SliceGrad``/``GatherGrad`` (which have no
  CPU kernel in that type) run in float32 between two Casts; exact, since they only move and
  add values.
* :func:`deterministic_gather_grads`: the embedding gradient summed in index order, so that
  identical runs are bit-identical.
"""
from __future__ import annotations

import logging

import onnx
from onnx import TensorProto, helper

from onnxmp.domains import is_onnx_domain
from onnxmp.naming import FreshNames, proto_names
from onnxmp.precision import LOW

log = logging.getLogger("onnxmp.training.build.determinism")


# ORT 1.19's CPU gradient kernels that take float and double only: op -> index of the gradient input.
_CPU_FLOAT_ONLY_GRADS = {"SliceGrad": 0, "GatherGrad": 2}
_LOW_TYPES = frozenset(p.onnx_type for p in LOW.values())


def float32_cpu_grad_kernels(training: onnx.ModelProto) -> int:
    """Run low-precision ``SliceGrad`` and ``GatherGrad`` nodes (com.microsoft) in float32.

    The emulated forward graph holds only float32 arithmetic, but the compute
    optimizer of ORT's training build hoists a Slice or Gather above the
    emulation's rounding ``Cast``, so the Slice then reads the float16 (or
    bfloat16) tensor and its gradient is built in that type, which the CPU
    kernels refuse ("Type for T or Tind not supported yet in SliceGrad").
    Both kernels only move and add gradient values, so casting the gradient in
    to float32 and the result back gives what a low-precision kernel would.
    Returns how many nodes were wrapped.
    """
    graph = training.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.input, *graph.output)
             if v.type.HasField("tensor_type")}
    names = FreshNames(proto_names(graph))
    nodes: list[onnx.NodeProto] = []
    wrapped = 0
    for node in graph.node:
        slot = _CPU_FLOAT_ONLY_GRADS.get(node.op_type) if node.domain == "com.microsoft" else None
        low = types.get(node.input[slot]) if slot is not None and len(node.input) > slot else None
        if low not in _LOW_TYPES:
            nodes.append(node)
            continue
        scope = node.name or node.output[0]
        new = onnx.NodeProto()
        new.CopyFrom(node)
        wide = names(f"{scope}/float32_input")
        nodes.append(helper.make_node("Cast", [node.input[slot]], [wide], name=names(f"{scope}/Cast_in"),
                                      to=TensorProto.FLOAT))
        new.input[slot] = wide
        new.output[0] = names(f"{scope}/float32_output")
        nodes.append(new)
        nodes.append(helper.make_node("Cast", [new.output[0]], [node.output[0]], name=names(f"{scope}/Cast_out"),
                                      to=low))
        for value in graph.value_info:  # ORT's type for the renamed output no longer holds
            if value.name == node.output[0]:
                value.type.tensor_type.elem_type = low
        wrapped += 1
    if wrapped:
        graph.ClearField("node")
        graph.node.extend(nodes)
        log.info("%d low-precision gradient node(s) run in float32 (no CPU kernel for their type)", wrapped)
    return wrapped


_SCATTER_REDUCTION_OPSET = 16


def deterministic_gather_grads(training: onnx.ModelProto) -> int:
    """Replace ORT's CPU ``GatherGrad`` (com.microsoft) by a ``ScatterElements(reduction="add")``.

    The CPU GatherGrad adds rows from a thread pool under a mutex, so the order
    in which repeated indices (the same token twice in a batch) are summed
    changes from run to run and the embedding gradient differs in its last
    bits: identical runs drift apart.  ScatterElements adds in index order.
    Needs opset 16 (``reduction``); a training graph at opset 14 or 15 is
    moved to 16, which changed no op of those versions incompatibly except
    RoiAlign's default mode (a graph with RoiAlign stays as it is).
    Returns how many nodes were replaced.
    """
    graph = training.graph
    grads = [n for n in graph.node if n.op_type == "GatherGrad" and n.domain == "com.microsoft"]
    if not grads:
        return 0
    default = next((o for o in training.opset_import if is_onnx_domain(o.domain)), None)
    if default is None or default.version < 14 or (
            default.version < _SCATTER_REDUCTION_OPSET and any(n.op_type == "RoiAlign" for n in graph.node)):
        # RoiAlign-16 changed its default coordinate mode, so such a graph keeps its opset.
        log.warning("embedding gradients stay nondeterministic: the model's opset %s cannot move to %d",
                    default.version if default else "?", _SCATTER_REDUCTION_OPSET)
        return 0
    default.version = max(default.version, _SCATTER_REDUCTION_OPSET)
    # The lowering's GatherGrad is the deterministic one: the native graph takes it as it is.
    from onnxmp.training.build.lower import shapes
    from onnxmp.training.build.lower._emit import Emit

    names = FreshNames(proto_names(graph))
    # On the emulated target every gradient is float32 here (float32_cpu_grad_kernels ran first).
    types = {n.input[2]: TensorProto.FLOAT for n in grads}
    replaced = 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if not (node.op_type == "GatherGrad" and node.domain == "com.microsoft"):
            nodes.append(node)
            continue
        emit = Emit(names, node, types, {})
        shapes.gather_grad(emit)
        nodes.extend(emit.nodes)
        replaced += 1
    graph.ClearField("node")
    graph.node.extend(nodes)
    log.info("replaced %d GatherGrad node(s) by deterministic ScatterElements", replaced)
    return replaced
