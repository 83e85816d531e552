"""What a gradient rule sees: its forward node, the gradients of its outputs, and helpers that
decide shapes at build time (broadcast reductions, reshapes back) where the symbolic shapes tell,
falling back to a runtime-shape path (counted) only where they do not."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxmp.errors import OnnxMPError
from onnxmp.training.build.autodiff.emit import Emitter
from onnxmp.training.build.autodiff.info import GraphInfo, Shape
from onnxmp.training.nodes import attribute, node_input, node_output


class Vjp:
    """One node's vector-Jacobian product: ``dy(i)`` the gradient of output ``i`` (None when no
    gradient reaches it), ``needs(i)`` whether input ``i`` wants one, ``set(i, g)`` gives it."""

    def __init__(self, node: onnx.NodeProto, info: GraphInfo, emit: Emitter, output_grads: list[str | None],
                 needed: list[bool], runtime: list[str]):
        self.node = node
        self.info = info
        self.emit = emit
        self._dy = output_grads
        self._needs = needed
        self._runtime = runtime
        self.grads: dict[int, str] = {}

    # -- the node ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.node.name or self.node.output[0]

    def attr(self, name: str, default=None):
        value = attribute(self.node, name, default)
        return value.decode() if isinstance(value, bytes) else value

    def x(self, i: int) -> str:
        return node_input(self.node, i)

    def y(self, i: int) -> str:
        return node_output(self.node, i)

    def dy(self, i: int = 0) -> str | None:
        return self._dy[i] if i < len(self._dy) else None

    def needs(self, i: int) -> bool:
        return i < len(self._needs) and self._needs[i]

    def set(self, i: int, grad: str) -> None:
        if self.needs(i):
            self.grads[i] = grad

    def fail(self, why: str, hint: str = "freeze the parameters that feed it, or re-export the model without it"):
        raise OnnxMPError(f"onnxmp cannot differentiate {self.node.op_type} (node {self.name!r}): {why}", hint)

    def runtime(self, what: str) -> None:
        """Record that a shape is read at run time here (the report counts them)."""
        self._runtime.append(f"{self.name}: {what}")

    # -- values -----------------------------------------------------------------------------
    def elem(self, name: str) -> int:
        elem = self.emit.types.get(name) or self.info.types.get(name, 0)
        if not elem:
            self.fail(f"the element type of {name!r} is unknown", "run onnx shape inference on the model first")
        return elem

    def shape(self, name: str) -> Shape:
        return self.info.shape(name)

    def rank(self, name: str) -> int:
        shape = self.info.shape(name)
        if shape is None:
            self.fail(f"the rank of {name!r} is unknown", "export the model with static ranks")
        return len(shape)

    def const_ints(self, name: str) -> list[int] | None:
        return self.info.ints(name)

    # -- emitting ---------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: str, elem: int | None = None, domain: str = "", **attrs) -> str:
        return self.emit.op(op_type, list(inputs), elem=elem, domain=domain, **attrs)

    def ints(self, values) -> str:
        return self.emit.ints(values)

    def scalar(self, value: float, like: str) -> str:
        """A scalar constant of ``like``'s element type."""
        return self.emit.scalar(value, self.elem(like))

    def cast(self, name: str, elem: int) -> str:
        return self.emit.cast(name, elem)

    def zeros_like(self, name: str) -> str:
        shape = self.info.static_shape(name)
        if shape is None:
            self.runtime(f"zeros shaped like {name}")
            return self.emit.zeros(self.op("Shape", name, elem=TensorProto.INT64), self.elem(name))
        return self.emit.zeros(shape, self.elem(name))

    def shape_of(self, name: str) -> str:
        """``name``'s shape as an int64 1-D tensor: a constant when static, else a Shape node (counted)."""
        shape = self.info.static_shape(name)
        if shape is not None:
            return self.ints(shape)
        self.runtime(f"shape of {name}")
        return self.op("Shape", name, elem=TensorProto.INT64)

    # opset-dependent spellings: ReduceSum/Squeeze/Unsqueeze take axes as an input from opset 13,
    # the other reductions from 18.
    def reduce(self, op_type: str, x: str, axes: list[int], keepdims: int) -> str:
        threshold = 13 if op_type == "ReduceSum" else 18
        if self.info.opset >= threshold:
            return self.op(op_type, x, self.ints(axes), keepdims=keepdims)
        return self.op(op_type, x, axes=axes, keepdims=keepdims)

    def squeeze(self, x: str, axes: list[int]) -> str:
        if self.info.opset >= 13:
            return self.op("Squeeze", x, self.ints(axes))
        return self.op("Squeeze", x, axes=axes)

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        if self.info.opset >= 13:
            return self.op("Unsqueeze", x, self.ints(axes))
        return self.op("Unsqueeze", x, axes=axes)

    def transpose(self, x: str, perm: list[int]) -> str:
        if perm == list(range(len(perm))):
            return x
        return self.op("Transpose", x, perm=perm)

    # -- shapes decided at build time -------------------------------------------------------
    def unbroadcast(self, grad: str, target: str, like: str | None, *, target_shape: Shape = None,
                    like_shape: Shape = None, peer_shapes: list | None = None) -> str:
        """``grad`` (shaped like ``like``, the broadcast result) summed back to ``target``'s shape.

        Axes ``target`` lacks, and axes where it is 1 and the result is not, are summed, as
        constants; an axis where the symbolic shapes cannot tell (a symbolic dim against another
        one) is summed at run time where ``target``'s dim is 1.
        """
        ts = target_shape if target_shape is not None else self.shape(target)
        os_ = like_shape if like_shape is not None else self.shape(like)
        if ts is None or os_ is None:
            self.fail(f"the rank of {target!r} or {like!r} is unknown, so the broadcast cannot be summed back",
                      "export the model with static ranks")
        if len(ts) > len(os_):
            self.fail(f"{target!r} has a higher rank than the broadcast result {like!r}")
        lead = len(os_) - len(ts)
        if peer_shapes is None and like == self.y(0) and self.node.op_type in _BROADCASTING:
            # the other operands: where each is 1 or equal to the target, nothing was broadcast
            peer_shapes = [self.shape(x) for x in self.node.input if x and x != target]
        peers = [p for p in peer_shapes or [] if p is not None]
        complete = peer_shapes is not None and len(peers) == len(peer_shapes)
        summed, unknown = [], []
        for i, td in enumerate(ts):
            od = os_[lead + i]
            if td == 1:
                if od != 1:
                    summed.append(lead + i)
            elif isinstance(td, int) or td == od or od == 1:
                continue
            elif complete and all(_peer_dim(p, len(os_), lead + i) in (1, td) for p in peers):
                continue
            else:
                unknown.append(lead + i)
        if unknown:
            self.runtime(f"broadcast of {target} over axes {unknown}")
            dims = self.op("Gather", self.op("Shape", target, elem=TensorProto.INT64),
                           self.ints([a - lead for a in unknown]), elem=TensorProto.INT64)
            ones = self.op("Equal", dims, self.ints(1), elem=TensorProto.BOOL)
            axes = self.op("Compress", self.ints(unknown), ones, axis=0, elem=TensorProto.INT64)
            grad = self.op("ReduceSum", grad, axes, keepdims=1, noop_with_empty_axes=1)
        leading = list(range(lead))
        if not summed:
            return self.reduce("ReduceSum", grad, leading, 0) if leading else grad
        if not leading:
            return self.reduce("ReduceSum", grad, summed, 1)
        return self.squeeze(self.reduce("ReduceSum", grad, leading + summed, 1), leading)

    def reshape_like(self, grad: str, target: str, source: str | None = None) -> str:
        """``grad`` reshaped to ``target``'s shape: a constant shape (with 0 where ``source``,
        the shape ``grad`` has, holds the same dim, and one -1) when the symbols allow it, else
        ``target``'s runtime shape."""
        ts = self.shape(target)
        ss = self.shape(source) if source else None
        if ts is not None:
            spec, unknown = [], 0
            for i, d in enumerate(ts):
                if isinstance(d, int) and d > 0:
                    spec.append(d)
                elif d is not None and d != 0 and ss is not None and i < len(ss) and ss[i] == d:
                    spec.append(0)
                else:
                    spec.append(-1)
                    unknown += 1
            if unknown <= 1 and 0 not in ts:
                return self.op("Reshape", grad, self.ints(spec))
        self.runtime(f"reshape to the shape of {target}")
        return self.op("Reshape", grad, self.op("Shape", target, elem=TensorProto.INT64))

    def forward_output(self, k: int, what: str, elem: int, shape: Shape) -> str:
        """Output ``k`` of the forward node, added (with fresh names) when the node lacks it."""
        node = self.node
        while len(node.output) <= k:
            node.output.append("")
        if not node.output[k]:
            node.output[k] = self.emit.names(f"{node.output[0]}_{what}")
            self.info.types[node.output[k]] = elem
            self.info.shapes[node.output[k]] = shape
        return node.output[k]


# Ops whose inputs broadcast against each other (numpy-style) to the output.
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Sum", "Mean", "PRelu"})


def _peer_dim(shape: tuple, rank: int, axis: int):
    """The dim of ``shape``, right-aligned to ``rank`` axes, at ``axis`` (1 where it has none)."""
    i = axis - (rank - len(shape))
    return shape[i] if i >= 0 else 1


def normalize_axes(axes, rank: int) -> list[int]:
    return [int(a) + rank if int(a) < 0 else int(a) for a in axes]


def numpy_type(elem: int):
    return np.float32 if elem == TensorProto.BFLOAT16 else helper.tensor_dtype_to_np_dtype(elem)
