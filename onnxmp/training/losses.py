"""The losses a training graph can end in: one table.

Each entry names the function that writes the loss in standard ONNX ops (onnxruntime-training
1.19's gradient builder differentiates them, and the portable lowering keeps them as they are),
what its label input is called by default, what kind of labels it reads
(:mod:`onnxmp.training.labels` checks them), its options and their defaults, and which metrics
``onnxmp train`` reports for it.  Adding a loss is one writer and one entry here.

The semantics are those of the torch / Hugging Face originals, defaults included:

- ``cross_entropy``: ``torch.nn.CrossEntropyLoss(ignore_index=-100)`` with the class axis LAST
  (``[N, C]`` logits with ``[N]`` labels, ``[B, S, V]`` with ``[B, S]``, as Hugging Face heads
  compute it); the mean over the positions whose label is not ``ignore_index``.  When every position
  is ignored the loss is NaN and the gradients are zero, as torch gives (the update still runs).
- ``causal_lm``: Hugging Face's causal-LM loss (``LlamaForCausalLM``, ``GPT2LMHeadModel``): the
  logits at position ``t`` predict the label at ``t + 1``, i.e. ``logits[:, :-1]`` against
  ``labels[:, 1:]``, then ``cross_entropy``.  The labels are the unshifted token ids (often the
  input ids themselves), ``-100`` where no loss is wanted.
- ``bce_with_logits``: ``torch.nn.BCEWithLogitsLoss(pos_weight=...)``, in the stable form
  ``max(x, 0) - x*y + log(1 + exp(-|x|))`` (confident logits give finite losses, and the gradient is
  ``sigmoid(x) - y`` everywhere, ``x = 0`` included).
- ``mse``, ``l1``: ``torch.nn.MSELoss()``, ``torch.nn.L1Loss()`` (means).

A custom loss is a function ``(builder, output, label) -> loss name`` writing nodes with
:class:`LossGraph`, an ONNX graph or function, or (with onnxruntime-training) an onnxblock
``Block``: :mod:`onnxmp.training.build.loss_forms` turns each into the callable the gradient builders
take; see ``docs/training.md`` (custom losses), and :func:`resolve_loss` for ``--loss module:function``.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
from onnx import TensorProto

from onnxmp.errors import OnnxMPError, first_line
from onnxmp.training.contract import IGNORE_INDEX
from onnxmp.training.nodes import LossGraph

_INT64_MAX = np.iinfo(np.int64).max


def _float_output(g: LossGraph, output: str, elem_type: int) -> str:
    # Hugging Face upcasts the logits before the loss; onnxmp's training outputs are float32 already.
    return output if elem_type == TensorProto.FLOAT else g.op("Cast", output, what="upcast", to=TensorProto.FLOAT)


def _token_nll(g: LossGraph, logits: str, labels: str, ignore_index: int) -> str:
    """Mean negative log-likelihood over the positions whose label is not ``ignore_index``, class axis last."""
    # The labels, reshaped to the logits' positions with a last dim of 1, after an exact check that their
    # shape IS the positions' shape: labels with other positions fail in the labels_like_logits nodes
    # (labels.label_run_error says so) instead of GatherElements quietly reading a prefix.  The check is
    # computed, not left to Reshape: onnxruntime rewrites a Reshape to shapes with one symbolic dim into -1.
    shape = g.op("Shape", logits, what="logits_shape")
    positions = g.op("Slice", shape, g.const("zero_start", [0], np.int64), g.const("minus_one", [-1], np.int64),
                     g.const("axis0", [0], np.int64), what="positions_shape")
    same = g.op("Equal", g.op("Shape", labels, what="labels_shape"), positions, what="labels_like_logits_check")
    all_same = g.op("ReduceMin", g.op("Cast", same, what="same_dims", to=TensorProto.INT64), what="all_same",
                    keepdims=0)
    # positions + [1] by Pad, not Concat: onnxruntime-training turns every Concat into its ConcatTraining.
    index_shape = g.op("Pad", positions, g.const("append_one", [0, 1], np.int64), g.const("one", 1, np.int64),
                       what="index_shape", mode="constant")
    checked = g.op("Where", g.op("Cast", all_same, what="all_same_bool", to=TensorProto.BOOL), index_shape,
                   g.const("invalid_shape", [-2], np.int64), what="checked_index_shape")
    labels = g.op("Reshape", labels, checked, what="labels_like_logits")
    kept = g.op("Not", g.op("Equal", labels, g.const("ignore_index", ignore_index, np.int64)), what="kept")
    safe = g.op("Where", kept, labels, g.const("zero_class", 0, np.int64), what="safe_labels")
    log_probs = g.op("LogSoftmax", logits, axis=-1)
    picked = g.op("GatherElements", log_probs, safe, what="label_log_prob", axis=-1)
    weights = g.op("Cast", kept, what="kept_float", to=TensorProto.FLOAT)
    total = g.op("ReduceSum", g.op("Mul", picked, weights), what="log_prob_sum", keepdims=0)
    count = g.op("ReduceSum", weights, what="count", keepdims=0)
    mean = g.op("Neg", g.op("Div", total, g.op("Max", count, g.const("one_float", 1.0)), what="mean_log_prob"))
    # torch: NaN when every position is ignored, with zero gradients.  The NaN is added on a path that
    # reads only the labels, so no gradient goes through it (and the mean's gradient is 0 then).
    empty = g.op("Where", g.op("Greater", count, g.const("zero_float", 0.0)), g.const("zero_loss", 0.0),
                 g.const("nan", np.nan), what="nan_if_all_ignored")
    return g.op("Add", mean, empty, what="loss")


def cross_entropy(g: LossGraph, output: str, label: str, *, ignore_index: int = IGNORE_INDEX) -> str:
    return _token_nll(g, output, label, ignore_index)


def causal_lm(g: LossGraph, output: str, label: str, *, ignore_index: int = IGNORE_INDEX) -> str:
    # labels[:, 1:] padded with one ignored position: the logits stay whole (no Slice to differentiate),
    # and the last position, which predicts nothing, drops out of the mean.
    shifted = g.op("Slice", label, g.const("one_start", [1], np.int64), g.const("to_end", [_INT64_MAX], np.int64),
                   g.const("axis1", [1], np.int64), what="next_tokens")
    padded = g.op("Pad", shifted, g.const("pad_end", [0, 0, 0, 1], np.int64),
                  g.const("pad_value", ignore_index, np.int64), what="shifted_labels", mode="constant")
    return _token_nll(g, output, padded, ignore_index)


def bce_with_logits(g: LossGraph, output: str, label: str, *, pos_weight=None) -> str:
    x, y = output, label
    negative = g.op("Less", x, g.const("zero", 0.0), what="negative")
    minus_x = g.op("Neg", x, what="minus_x")
    # -|x| and max(-x, 0) through Where rather than Abs/Relu: at x = 0 their gradients (Sign(0) = 0,
    # ReluGrad(0) = 0) would make the loss's gradient -y instead of torch's sigmoid(0) - y.
    minus_abs = g.op("Where", negative, x, minus_x, what="minus_abs")
    clamp = g.op("Where", negative, minus_x, g.const("zero_clamp", 0.0), what="max_minus_x_0")
    softplus = g.op("Log", g.op("Add", g.const("one", 1.0), g.op("Exp", minus_abs)), what="log1p_exp")
    log_term = g.op("Add", softplus, clamp, what="minus_log_sigmoid")
    if pos_weight is not None:
        weight = np.asarray(pos_weight, np.float32)
        # torch: (1 + (pos_weight - 1) * y) weighs the -log(sigmoid(x)) term.
        log_weight = g.op("Add", g.const("one_weight", 1.0),
                          g.op("Mul", g.const("pos_weight_minus_one", weight - 1), y), what="log_weight")
        log_term = g.op("Mul", log_term, log_weight, what="weighted_log_term")
    linear = g.op("Mul", g.op("Sub", g.const("one_target", 1.0), y, what="one_minus_y"), x, what="linear_term")
    return g.op("ReduceMean", g.op("Add", linear, log_term, what="elementwise"), what="loss", keepdims=0)


def mse(g: LossGraph, output: str, label: str) -> str:
    diff = g.op("Sub", output, label, what="diff")
    return g.op("ReduceMean", g.op("Mul", diff, diff, what="squared"), what="loss", keepdims=0)


def l1(g: LossGraph, output: str, label: str) -> str:
    return g.op("ReduceMean", g.op("Abs", g.op("Sub", output, label, what="diff")), what="loss", keepdims=0)


@dataclass(frozen=True)
class Loss:
    name: str                  # the API and CLI spelling: loss="cross_entropy", --loss cross_entropy
    write: Callable[..., str]  # write(LossGraph, output, label, **options) -> the float32 scalar's name
    label: str                 # the label input's default name
    classes: bool              # labels are class ids (else float targets shaped like the output)
    probabilities: bool = False  # float targets must lie in [0, 1]
    metrics: tuple[str, ...] = ()  # what `onnxmp train` reports on the eval data
    options: dict[str, Any] = field(default_factory=dict)  # keyword options and their defaults
    ranks: tuple[int, int | None] = (0, None)  # the output ranks the loss accepts (low, high or None)

    def resolve(self, options: dict[str, Any] | None) -> dict[str, Any]:
        """The options with the defaults filled in; an unknown option is an error."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise OnnxMPError(f"the {self.name} loss has no option {', '.join(unknown)}",
                              f"its options: {', '.join(self.options) or 'none'}")
        resolved = {**self.options, **options}
        if "ignore_index" in resolved:
            resolved["ignore_index"] = int(resolved["ignore_index"])
        if resolved.get("pos_weight") is not None:
            weight = np.asarray(resolved["pos_weight"], np.float32)
            if weight.ndim > 1 or not np.all(np.isfinite(weight)) or np.any(weight < 0):
                raise OnnxMPError("pos_weight must be a non-negative number or one per class (a 1-D array)")
            resolved["pos_weight"] = weight.tolist()
        return resolved


LOSSES: dict[str, Loss] = {loss.name: loss for loss in (
    Loss("cross_entropy", cross_entropy, "labels", classes=True, metrics=("accuracy",),
         options={"ignore_index": IGNORE_INDEX}, ranks=(2, None)),
    Loss("causal_lm", causal_lm, "labels", classes=True, metrics=("token_accuracy",),
         options={"ignore_index": IGNORE_INDEX}, ranks=(3, 3)),
    Loss("mse", mse, "target", classes=False),
    Loss("bce_with_logits", bce_with_logits, "target", classes=False, probabilities=True,
         metrics=("binary_accuracy",), options={"pos_weight": None}),
    Loss("l1", l1, "target", classes=False),
)}


def loss(name: str) -> Loss:
    """The loss called ``name``; a clear error for anything else."""
    try:
        return LOSSES[name]
    except KeyError:
        raise OnnxMPError(f"unknown loss {name!r}", f"use one of: {', '.join(LOSSES)}, "
                                                    "or a custom loss (module:function or file.py:function)") from None


class TableLoss:
    """The table's loss ``name`` with its options, as the callable both gradient builders take:
    ``loss(graph, output, label)`` declares the label input, appends the loss nodes to ``graph``
    and returns the loss's name (a float32 scalar).  Needs no onnxruntime-training."""

    def __init__(self, name: str, **options):
        self.spec = loss(name)
        self.loss_name = self.spec.name
        self.loss_options = self.spec.resolve(options)

    def __call__(self, graph: onnx.GraphProto, output: str, label: str) -> str:
        declare_label(graph, output, label, classes=self.spec.classes)
        g = LossGraph(graph, self.spec.name)
        return self.spec.write(g, _float_output(g, output, _elem_type(graph, output)), label, **self.loss_options)

    def __repr__(self) -> str:
        return f"table_loss({self.loss_name!r}, **{self.loss_options!r})"


def table_loss(name: str, **options) -> TableLoss:
    """The table's loss ``name`` with options other than the defaults, e.g.
    ``table_loss("cross_entropy", ignore_index=0)``: ``build_artifacts(loss=...)`` takes it like
    the plain name, and records its options in the manifest (``loss_options``) so that the labels
    are checked against them."""
    return TableLoss(name, **options)


def block(name: str, **options):
    """The table's loss ``name`` as an onnxblock ``Block`` (onnxruntime-training only; for code
    written before :func:`table_loss`, which needs no training build and is what to use now)."""
    from onnxmp.training import _ort

    table = TableLoss(name, **options)
    ob = _ort.onnxblock()

    class TableLossBlock(ob.Block):
        loss_name = table.loss_name
        loss_options = table.loss_options

        def build(self, output: str, label: str) -> str:
            return table(self.base.graph, output, label)

    TableLossBlock.__name__ = TableLossBlock.__qualname__ = f"{table.loss_name}_loss"
    return TableLossBlock()


def onnxblock():
    """onnxruntime's ``onnxblock`` module (the ``Block`` base class of custom losses), without importing torch."""
    from onnxmp.training import _ort

    return _ort.onnxblock()


def declare_label(graph: onnx.GraphProto, output: str, label: str, *, classes: bool) -> None:
    """Add the label input (unless the graph has it): int64 class ids shaped like the output without its
    last (class) axis, or float targets shaped like the output."""
    if label in {v.name for v in graph.input}:
        return
    like = next((v for v in graph.output if v.name == output), None)
    value = onnx.ValueInfoProto()
    if like is not None:
        value.CopyFrom(like)
    value.name = label
    tensor = value.type.tensor_type
    tensor.elem_type = TensorProto.INT64 if classes else TensorProto.FLOAT
    if classes and tensor.HasField("shape") and len(tensor.shape.dim):
        del tensor.shape.dim[-1]
        # Dims of their own: sharing the output's symbols ("N") lets onnxruntime's optimizer prove the
        # labels_like_logits reshape a no-op and drop the check that the labels have the logits' positions.
        for i, dim in enumerate(tensor.shape.dim):
            if not dim.HasField("dim_value"):
                dim.dim_param = f"{label}_dim{i}"
    graph.input.append(value)


def _elem_type(graph: onnx.GraphProto, name: str) -> int:
    for value in [*graph.output, *graph.value_info, *graph.input]:
        if value.name == name:
            return value.type.tensor_type.elem_type
    return TensorProto.FLOAT


def resolve_loss(spec: Any):
    """What ``build_artifacts(loss=...)`` takes, from a CLI or API spelling.

    - a name of :data:`LOSSES` (``"cross_entropy"``): returned as it is;
    - ``"module:function"`` (an importable module) or ``"path/to/file.py:function"``: the
      attribute is the loss when it is one (a function ``(builder, output, label) -> loss name``,
      an ONNX graph, model or function, an onnxblock ``Block`` or ``Block`` subclass); a function
      taking no arguments is called and must return one of those;
    - anything else: returned as it is (:func:`onnxmp.training.build.loss_forms.loss_writer` checks it).
    """
    if not isinstance(spec, str):
        return spec
    if spec in LOSSES:
        return spec
    if ":" not in spec:
        loss(spec)  # the unknown-loss error
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise OnnxMPError(f"cannot read the loss {spec!r}", "write module:function or path/to/file.py:function")
    module = _load_module(where)
    target = getattr(module, attr, None)
    if target is None:
        raise OnnxMPError(f"{where} has no {attr!r}", f"define {attr}(builder, output, label) there "
                                                      "(docs/training.md, custom losses)")
    if isinstance(target, type):  # a Block subclass
        return target()
    if callable(target) and not _takes_loss_arguments(target):
        try:
            return target()
        except Exception as exc:
            raise OnnxMPError(f"{spec}() failed: {type(exc).__name__}: {first_line(exc, 300)}",
                              "a loss factory is called without arguments and returns the loss (a function, "
                              "an ONNX graph or function, or a Block): see docs/training.md, custom losses") from exc
    return target


def _takes_loss_arguments(function) -> bool:
    """Whether ``function`` is a loss itself (three positional arguments: builder, output, label)
    rather than a factory of one (no required argument)."""
    import inspect

    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return True
    required = [p for p in parameters if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) >= 3


def _load_module(where: str):
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise OnnxMPError(f"no loss file {where}", "pass path/to/file.py:function")
        name = f"onnxmp_custom_loss_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise OnnxMPError(f"{where} failed to load: {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(where)
    except ImportError as exc:
        raise OnnxMPError(f"cannot import the loss module {where!r}: {exc}",
                          "put it on PYTHONPATH, or pass path/to/file.py:function") from None
