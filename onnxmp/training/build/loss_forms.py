"""A training loss in any of the forms users write it, as the one callable both gradient builders take.

``loss(graph, output, label) -> name``: append the loss nodes to ``graph`` (the forward graph the
builder differentiates), declare the label input, return the name of the float32 scalar loss.
:func:`loss_writer` makes one :class:`LossWriter` of:

- a name of the table (``"cross_entropy"``) or :func:`~onnxmp.training.losses.table_loss`;
- a Python function ``(builder, output, label) -> name`` that adds nodes with
  :class:`~onnxmp.training.losses.LossGraph` and declares the label with
  :func:`~onnxmp.training.losses.declare_label`;
- an ONNX graph (``GraphProto`` or ``ModelProto``) whose two inputs are (output, label) and whose one
  output is the scalar loss: inlined, its label input's type declared as the label's;
- an ONNX ``FunctionProto`` with the same two inputs and one output: inlined; a function has no types,
  so its label is int64 class ids when the function type-checks with them, else float targets shaped
  like the output (:func:`function_loss` says which);
- an onnxblock ``Block`` (where onnxruntime-training installs): run on the graph.

None of them but the ``Block`` needs onnxruntime-training.  Every form is held to the same two duties
(:func:`check_loss_block`): declare the label, return a value the graph produces.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import onnx
from onnx import TensorProto, helper

from onnxmp.domains import is_onnx_domain
from onnxmp.errors import OnnxMPError, first_line
from onnxmp.naming import FreshNames, proto_names
from onnxmp.training import losses
from onnxmp.training.contract import LOSS, LOSS_SCALE, LOSS_SCALED
from onnxmp.training.losses import LOSSES, LossGraph, TableLoss

_CUSTOM = "docs/training.md, custom losses"


@dataclass
class LossWriter:
    """``writer(graph, output, label)``: the loss appended to ``graph``; its name returned."""

    name: str                                    # the manifest's ``loss``
    write: Callable[[onnx.GraphProto, str, str], str]
    label: str = "labels"                        # the label input's default name
    options: dict = field(default_factory=dict)  # a table loss's options (the manifest's ``loss_options``)
    table: bool = False                          # a loss of LOSSES (labels checked against its kind)

    def __call__(self, graph: onnx.GraphProto, output: str, label: str) -> str:
        try:
            loss = self.write(graph, output, label)
        except OnnxMPError:
            raise
        except Exception as exc:
            check_loss_block(graph, None, label, self.name, label_only=True)
            raise OnnxMPError(f"the loss {self.name} failed: {type(exc).__name__}: {first_line(exc, 300)}",
                              f"see {_CUSTOM}") from exc
        check_loss_block(graph, loss, label, self.name)
        return loss


def checked_loss(loss: Callable[[onnx.GraphProto, str, str], str]) -> LossWriter:
    """``loss`` as a :class:`LossWriter`, whose call checks what it wrote: the pipeline passes one
    already; a bare ``loss(graph, output, label)`` (a :class:`~onnxmp.training.losses.TableLoss`, a
    test's function) gets the same checks, named by its table name or function name."""
    if isinstance(loss, LossWriter):
        return loss
    return LossWriter(getattr(loss, "loss_name", None) or getattr(loss, "__name__", type(loss).__name__), loss)


def check_loss_block(graph: onnx.GraphProto, loss, label_name: str, block: str, label_only: bool = False) -> None:
    """A custom loss block's two duties: declare its label input, return one value's name."""
    if label_name not in {v.name for v in graph.input}:
        raise OnnxMPError(f"the loss block {block} did not declare its label input {label_name!r}",
                          "append a graph input for it in build() (onnxmp.training.losses.declare_label "
                          "does it: see docs/training.md, custom losses)")
    if label_only:
        return
    if not isinstance(loss, str):
        raise OnnxMPError(f"the loss block {block} returned {type(loss).__name__}, not the name of its loss",
                          "build(output, label) must return the name of a float32 scalar it added")
    produced = {o for n in graph.node for o in n.output} | {t.name for t in graph.initializer}
    if loss not in produced:
        raise OnnxMPError(f"the loss block {block} returned {loss!r}, which no node of the graph produces",
                          "return the name of the loss node's output")


def add_scaled_loss(graph: onnx.GraphProto, loss_value: str) -> None:
    """The tail both builders write after the loss: the ``loss_scale`` input, ``loss`` (the loss's
    Identity) and ``loss_scaled`` (their product, where backpropagation starts)."""
    graph.input.append(helper.make_tensor_value_info(LOSS_SCALE, TensorProto.FLOAT, []))
    graph.node.append(helper.make_node("Identity", [loss_value], [LOSS], name="onnxmp/loss"))
    graph.node.append(helper.make_node("Mul", [LOSS, LOSS_SCALE], [LOSS_SCALED], name="onnxmp/loss_scale"))


def loss_writer(loss: Any, opset_import: Sequence[onnx.OperatorSetIdProto] = ()) -> LossWriter:
    """The :class:`LossWriter` of ``loss`` (any form the module docstring lists), for a forward model
    importing ``opset_import``; a clear error for anything else."""
    loss = losses.resolve_loss(loss)
    if isinstance(loss, LossWriter):
        return loss
    if isinstance(loss, str):
        loss = losses.table_loss(loss)
    table = getattr(loss, "loss_name", None)
    # A table loss however it was made: table_loss(...), losses.block(...) (an onnxblock Block), or any
    # object naming a table entry and its options.
    if isinstance(loss, TableLoss) or (table in LOSSES and isinstance(getattr(loss, "loss_options", None), dict)):
        table_writer = loss if isinstance(loss, TableLoss) else losses.table_loss(table, **loss.loss_options)
        return LossWriter(table, table_writer, losses.loss(table).label, dict(table_writer.loss_options), table=True)
    if isinstance(loss, (onnx.ModelProto, onnx.GraphProto)):
        return graph_loss(loss, opset_import)
    if isinstance(loss, onnx.FunctionProto):
        return function_loss(loss, opset_import)
    if is_block(loss):
        return LossWriter(type(loss).__name__, _block_writer(loss, opset_import))
    if callable(loss):
        return python_loss(loss)
    raise OnnxMPError(f"unsupported loss {loss!r}",
                      f"use one of {', '.join(LOSSES)}, a function (builder, output, label) -> loss name, an ONNX "
                      f"graph or function of (output, label), or an onnxblock Block ({_CUSTOM})")


def python_loss(function: Callable) -> LossWriter:
    """A function ``(builder: LossGraph, output, label) -> loss name`` as a :class:`LossWriter`."""
    name = getattr(function, "__name__", type(function).__name__)
    try:
        inspect.signature(function).bind(None, "output", "label")
    except TypeError:
        raise OnnxMPError(f"the loss function {name} does not take (builder, output, label)",
                          f"write def {name}(g, output, label) -> str, adding nodes with g.op(...) ({_CUSTOM})") from None
    except ValueError:
        pass  # no signature to read (a builtin): let the call tell

    def write(graph: onnx.GraphProto, output: str, label: str) -> str:
        return function(LossGraph(graph, name), output, label)

    return LossWriter(name, write)


def graph_loss(loss: onnx.GraphProto | onnx.ModelProto,
               opset_import: Sequence[onnx.OperatorSetIdProto] = ()) -> LossWriter:
    """An ONNX graph of (output, label) -> one scalar, inlined into the forward graph."""
    if isinstance(loss, onnx.ModelProto):
        loss = _at_opsets(loss, opset_import)
        graph = loss.graph
    else:
        graph = loss
    name = graph.name or "graph_loss"
    initializers = {t.name for t in graph.initializer}
    inputs = [v for v in graph.input if v.name not in initializers]
    if len(inputs) != 2 or len(graph.output) != 1:
        raise OnnxMPError(f"the loss graph {name} has {len(inputs)} input(s) and {len(graph.output)} output(s); "
                          "a loss graph takes (output, label) and returns one scalar", f"see {_CUSTOM}")
    result = graph.output[0]
    tensor = result.type.tensor_type
    if tensor.elem_type not in (0, TensorProto.FLOAT):
        raise OnnxMPError(f"the loss graph {name}'s output {result.name!r} is "
                          f"{TensorProto.DataType.Name(tensor.elem_type)}, not a float32 scalar",
                          "end the loss in float32 (Cast to FLOAT)")
    if tensor.HasField("shape") and len(tensor.shape.dim):
        raise OnnxMPError(f"the loss graph {name}'s output {result.name!r} has rank {len(tensor.shape.dim)}, "
                          "not a scalar", "reduce it to one value (ReduceMean with keepdims=0)")
    label_type = inputs[1].type
    if not label_type.tensor_type.elem_type:
        raise OnnxMPError(f"the loss graph {name}'s label input {inputs[1].name!r} has no type",
                          "give it an element type (and a shape, which the label input gets)")
    _check_domains(graph.node, opset_import, name)

    def write(target: onnx.GraphProto, output: str, label: str) -> str:
        _declare(target, label, label_type)
        renamed = _inline(target, name, graph.node, [i.name for i in inputs], [output, label],
                          list(graph.initializer))
        return renamed[result.name]

    return LossWriter(name, write)


def function_loss(function: onnx.FunctionProto, opset_import: Sequence[onnx.OperatorSetIdProto] = (),
                  *, classes: bool | None = None) -> LossWriter:
    """An ONNX function of (output, label) -> one scalar, inlined into the forward graph.

    ``classes``: the label is int64 class ids shaped like the output without its last axis (True),
    or float targets shaped like the output (False); None: the first of the two the function
    type-checks with."""
    name = function.name or "function_loss"
    if len(function.input) != 2 or len(function.output) != 1:
        raise OnnxMPError(f"the loss function {name} has {len(function.input)} input(s) and "
                          f"{len(function.output)} output(s); a loss function takes (output, label) and returns "
                          "one scalar", f"see {_CUSTOM}")
    if function.attribute or getattr(function, "attribute_proto", None):
        raise OnnxMPError(f"the loss function {name} has attributes, which a loss call cannot set",
                          "write their values into the function's nodes")
    if any(a.ref_attr_name for n in function.node for a in n.attribute):
        raise OnnxMPError(f"the loss function {name} refers to attributes it does not have")
    forward = {o.domain or "": o.version for o in opset_import}
    for o in function.opset_import:
        if (o.domain or "") in forward and forward[o.domain or ""] != o.version:
            raise OnnxMPError(f"the loss function {name} imports {o.domain or 'ai.onnx'} opset {o.version}, the model "
                              f"{forward[o.domain or '']}", "write the function at the model's opset")
    _check_domains(function.node, opset_import, name)

    def write(target: onnx.GraphProto, output: str, label: str) -> str:
        kind = classes if classes is not None else _label_kind(function, opset_import, target, output)
        losses.declare_label(target, output, label, classes=kind)
        renamed = _inline(target, name, function.node, list(function.input), [output, label], [])
        return renamed[function.output[0]]

    return LossWriter(name, write)


def is_block(obj: Any) -> bool:
    """An onnxblock ``Block``, told without importing onnxruntime-training (absent on Python 3.12+)."""
    return any(c.__name__ == "Block" and c.__module__.startswith("onnxruntime.training.onnxblock")
               for c in type(obj).__mro__)


def _block_writer(block, opset_import: Sequence[onnx.OperatorSetIdProto]):
    """A Block run on ``graph``: in ORT's builder the graph is onnxblock's base already; elsewhere
    (onnxmp's builder) the Block runs on a model holding a copy, which then replaces the graph."""

    def write(graph: onnx.GraphProto, output: str, label: str) -> str:
        from onnxmp.training import _ort

        ob = _ort.onnxblock()
        from onnxruntime.training.onnxblock import model_accessor

        current = model_accessor._GLOBAL_ACCESSOR
        if current is not None and current.model.graph is graph:
            return block(output, label)
        model = helper.make_model(graph, opset_imports=list(opset_import) or None)
        from onnxmp.training.update_graph import cap_ir_version

        cap_ir_version(model)
        with ob.base(model) as accessor:
            loss = block(output, label)
            graph.CopyFrom(accessor.model.graph)
        return loss

    return write


def _at_opsets(model: onnx.ModelProto, opset_import: Sequence[onnx.OperatorSetIdProto]) -> onnx.ModelProto:
    """A loss model at the forward model's default-domain opset (converted when it differs)."""
    wanted = next((o.version for o in opset_import if is_onnx_domain(o.domain)), None)
    have = next((o.version for o in model.opset_import if is_onnx_domain(o.domain)), None)
    if wanted is None or have is None or wanted == have:
        return model
    import onnx.version_converter

    try:
        return onnx.version_converter.convert_version(model, wanted)
    except Exception as exc:
        raise OnnxMPError(f"the loss model is at opset {have}, the model at {wanted}, and converting the loss "
                          f"failed: {first_line(exc, 300)}", f"write the loss at opset {wanted}") from None


def _check_domains(nodes, opset_import: Sequence[onnx.OperatorSetIdProto], name: str) -> None:
    if not opset_import:
        return
    known = {o.domain or "" for o in opset_import} | {"", "ai.onnx"}
    unknown = sorted({n.domain for n in nodes if (n.domain or "") not in known})
    if unknown:
        raise OnnxMPError(f"the loss {name} uses op domain(s) {', '.join(unknown)}, which the model does not import",
                          "write the loss in standard ONNX ops")
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in nodes for a in n.attribute):
        raise OnnxMPError(f"the loss {name} has control flow (If/Loop/Scan), which the gradient builders do not "
                          "differentiate", "write it without subgraphs (Where instead of If)")


def _declare(graph: onnx.GraphProto, label: str, label_type: onnx.TypeProto) -> None:
    if label not in {v.name for v in graph.input}:
        value = graph.input.add()
        value.name = label
        value.type.CopyFrom(label_type)


def _inline(graph: onnx.GraphProto, prefix: str, nodes, formal: list[str], actual: list[str],
            initializers: list[onnx.TensorProto]) -> dict[str, str]:
    """Append ``nodes`` (and ``initializers``) to ``graph``, ``formal`` inputs bound to ``actual``,
    every other name made fresh under ``onnxmp/loss/<prefix>/``; returns the renaming."""
    fresh = FreshNames(proto_names(graph))
    renamed = dict(zip(formal, actual))
    renamed[""] = ""

    def rename(name: str) -> str:
        if name not in renamed:
            renamed[name] = fresh(f"onnxmp/loss/{prefix}/{name}")
        return renamed[name]

    for init in initializers:
        copy = graph.initializer.add()
        copy.CopyFrom(init)
        copy.name = rename(init.name)
    for node in nodes:
        copy = graph.node.add()
        copy.CopyFrom(node)
        del copy.input[:]
        copy.input.extend(rename(n) for n in node.input)
        del copy.output[:]
        copy.output.extend(rename(n) for n in node.output)
        copy.name = fresh(f"onnxmp/loss/{prefix}/{node.name or node.op_type}")
    return renamed


def _label_kind(function: onnx.FunctionProto, opset_import, graph: onnx.GraphProto, output: str) -> bool:
    """True (int64 class ids) when ``function`` type-checks with them, else False (float targets)."""
    import onnx.shape_inference

    like = next((v for v in [*graph.output, *graph.value_info] if v.name == output), None)
    probe = onnx.GraphProto()
    if like is not None:
        probe.output.add().CopyFrom(like)
    out_type = like.type if like is not None else helper.make_tensor_type_proto(TensorProto.FLOAT, None)
    for classes in (True, False):
        del probe.input[:]
        losses.declare_label(probe, output, "label", classes=classes)
        try:
            onnx.shape_inference.infer_function_output_types(
                _with_opsets(function, {o.domain or "": o.version for o in opset_import}),
                [out_type, probe.input[0].type], [])
        except Exception:  # onnx raises its InferenceError, and others for ill-formed functions
            continue
        return classes
    raise OnnxMPError(f"the loss function {function.name} type-checks neither with int64 class labels nor with "
                      "float targets shaped like the output", "check it with onnx.checker, or use function_loss("
                      "..., classes=...) to say which label it takes")


def _with_opsets(function: onnx.FunctionProto, opsets: dict[str, int]) -> onnx.FunctionProto:
    if function.opset_import or not opsets:
        return function
    copy = onnx.FunctionProto()
    copy.CopyFrom(function)
    copy.opset_import.extend(helper.make_opsetid(d, v) for d, v in opsets.items())
    return copy
