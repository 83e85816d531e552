"""torch's optimizer update (:mod:`onnxmp.training.optimizer_settings`' AdamW / SGD) written as a graph
of standard ONNX ops, with an optional global-norm clip: equal to ``torch.optim`` step for step, and any
onnxruntime runs it with a plain ``InferenceSession``.

Neither a build stage nor a run: the build writes it into the artifacts
(:mod:`onnxmp.training.build.optimizer_graphs`), and a run that asks for another clip norm than
the built graph's rebuilds it from the manifest's ``optimizer`` entry
(:mod:`onnxmp.training.run.engines.update`).  Its inputs and outputs are the contract's
(:mod:`onnxmp.training.contract`).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxmp.errors import OnnxMPError
from onnxmp.naming import FreshNames
from onnxmp.training._ort import MAX_OPSET, cap_ir_version
from onnxmp.training.contract import LEARNING_RATE, STEP, grad_input, next_value, slot_input
from onnxmp.training.nodes import Nodes, Writer
from onnxmp.training.optimizer_settings import SGD, AdamW, Optimizer, optimizer_named

__all__ = ["build_portable_optimizer", "clip_by_global_norm"]

DOUBLE, FLOAT = TensorProto.DOUBLE, TensorProto.FLOAT


def build_portable_optimizer(optimizer, parameters: Sequence[tuple[str, Sequence[int]]], opset: int, *,
                             clip_global_norm: float | None = None) -> onnx.ModelProto:
    """torch's update of ``parameters`` (``(name, shape)`` in the manifest's ``requires_grad`` order)
    as a graph of standard ONNX ops, over the parameters concatenated into flat vectors
    (:func:`_flat_groups`).

    Inputs ``learning_rate`` (float32 ``[]``), ``step`` (int64 ``[]``, the update's number counting
    this one, from 1), then per parameter ``P``, ``P.grad`` and ``P.<slot>`` for each of the
    optimizer's slots; outputs ``P.out`` and ``P.<slot>.out``.  Slots start as zeros.  The other
    hyperparameters are constants.  ``clip_global_norm`` (or the one a manifest entry records) first
    clips the gradients as torch's ``clip_grad_norm_`` does.

    Scalars (bias corrections, step size, decay factor) are computed in float64 from the float32
    lr and the step, as torch computes them in Python floats, and rounded to float32 where torch's
    kernels do; tensors are float32 in torch's operation order.
    """
    if clip_global_norm is None and isinstance(optimizer, dict):  # a manifest entry that recorded one
        clip_global_norm = optimizer.get("hyperparameters", {}).get("clip_global_norm")
    optimizer = optimizer_named(optimizer)
    parameters = [(str(name), [int(d) for d in shape]) for name, shape in parameters]
    if not parameters:
        raise OnnxMPError("the optimizer has no parameters to update", "name the initializers to train")
    names_seen = [name for name, _ in parameters]
    if len(set(names_seen)) != len(names_seen):
        raise OnnxMPError("a parameter is named twice in the optimizer's parameters")
    inputs = [helper.make_tensor_value_info(LEARNING_RATE, FLOAT, []),
              helper.make_tensor_value_info(STEP, TensorProto.INT64, [])]
    outputs = []
    for name, shape in parameters:
        state = [name, *(slot_input(name, slot) for slot in optimizer.slots)]
        for value in (name, grad_input(name), *state[1:]):
            inputs.append(helper.make_tensor_value_info(value, FLOAT, shape))
        for value in state:
            outputs.append(helper.make_tensor_value_info(next_value(value), FLOAT, shape))
    io = [v.name for v in [*inputs, *outputs]]
    if len(set(io)) != len(io):
        raise OnnxMPError("parameter names clash with the optimizer graph's input/output names "
                          "(a parameter named like another's '.grad' or slot)", "rename the initializer")
    g = _Graph(set(io))
    grads = [grad_input(name) for name, _ in parameters]
    if clip_global_norm is not None:
        grads = clip_by_global_norm(g.nodes, g.names, grads, float(clip_global_norm))
    if optimizer.maximize:
        grads = [g.op("Neg", grad) for grad in grads]
    update = _adamw if isinstance(optimizer, AdamW) else _sgd
    tensors, split = _flat_groups(g, optimizer, parameters, grads)
    update(g, optimizer, tensors)
    split()
    graph = helper.make_graph(g.nodes, f"onnxmp_{optimizer.name}", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", min(max(opset, 13), MAX_OPSET))],
                              producer_name="onnxmp")
    cap_ir_version(model)
    onnx.checker.check_model(model)
    return model


class _Graph(Writer):
    def __init__(self, used: set[str]):
        super().__init__(FreshNames(used), "onnxmp/optim")

    def f32(self, value: float) -> str:
        """A float32 constant, rounded from a Python float as torch rounds a scalar argument."""
        return self.constant(np.array(value, np.float32))

    def f64(self, value: float) -> str:
        return self.constant(np.array(value, np.float64))

    def to_float(self, name: str) -> str:
        return self.op("Cast", name, to=FLOAT)


class _Tensors:
    """What one update reads and writes: the parameter, its gradient and its slots (input names),
    the names of the new values, and whether weight decay applies."""

    def __init__(self, param: str, grad: str, slots: dict[str, str], outs: dict[str, str], decays: bool):
        self.param, self.grad, self.slots, self.outs, self.decays = param, grad, slots, outs, decays


def _flat_groups(g: _Graph, opt: Optimizer, parameters: list[tuple[str, list[int]]],
                 grads: list[str]) -> tuple[list[_Tensors], Callable[[], None]]:
    """The parameters in (at most) two flat float32 vectors, the decayed ones and the exempt ones.

    Every op of the update is elementwise with scalar constants, so one update over the
    concatenation gives each element exactly what the per-parameter update gives it (torch's
    result, bit for bit), in a graph of a few dozen nodes instead of a dozen per parameter:
    onnxruntime's cost per node, not the arithmetic, is what a per-parameter graph pays for.
    The contract's per-parameter inputs and outputs stay: Reshape/Concat in, and the returned
    function, called once the update is written, adds the Split/Reshape out."""
    groups: dict[bool, list[tuple[str, list[int], str]]] = {}
    for (name, shape), grad in zip(parameters, grads):
        groups.setdefault(opt.decays(name), []).append((name, shape, grad))
    flat_shape = g.constant(np.array([-1], np.int64))
    tensors, flats = [], []
    for decays, members in groups.items():
        if len(members) == 1:
            name, _, grad = members[0]
            tensors.append(_Tensors(name, grad, {s: slot_input(name, s) for s in opt.slots},
                                    {k: _out(name, k) for k in ("", *opt.slots)}, decays))
            continue

        def concat(names: list[str]) -> str:
            return g.op("Concat", *[g.op("Reshape", n, flat_shape) for n in names], axis=0)

        flat = _Tensors(concat([name for name, _, _ in members]), concat([grad for _, _, grad in members]),
                        {s: concat([slot_input(name, s) for name, _, _ in members]) for s in opt.slots},
                        {k: g.names(f"onnxmp/optim/flat{'_' + k if k else ''}") for k in ("", *opt.slots)}, decays)
        tensors.append(flat)
        flats.append((flat, members))

    def split() -> None:
        for flat, members in flats:
            sizes = g.constant(np.array([int(np.prod(shape, dtype=np.int64)) for _, shape, _ in members], np.int64))
            for key, flat_out in flat.outs.items():
                parts = [g.names("onnxmp/optim/part") for _ in members]
                g.nodes.append(helper.make_node("Split", [flat_out, sizes], parts, axis=0,
                                                name=g.names("onnxmp/optim/Split")))
                for part, (name, shape, _) in zip(parts, members):
                    g.op("Reshape", part, g.constant(np.array(shape, np.int64)), out=_out(name, key))
    return tensors, split


def _out(parameter: str, slot: str) -> str:
    """The output with the next value of ``parameter`` ("" slot) or of its ``slot``."""
    return next_value(slot_input(parameter, slot) if slot else parameter)


def _adamw(g: _Graph, opt: AdamW, parameters: list[_Tensors]) -> None:
    beta1, beta2 = opt.betas
    lr = g.op("Cast", LEARNING_RATE, to=DOUBLE)
    t = g.op("Cast", STEP, to=DOUBLE)
    one = g.f64(1.0)
    # bias_correction1 = 1 - beta1 ** step; step_size = lr / bias_correction1 (Python floats in torch)
    correction1 = g.op("Sub", one, g.op("Pow", g.f64(beta1), t))
    correction2 = g.op("Sub", one, g.op("Pow", g.f64(beta2), t))
    neg_step_size = g.to_float(g.op("Neg", g.op("Div", lr, correction1)))
    correction2_sqrt = g.to_float(g.op("Sqrt", correction2))
    decay = None
    if any(t.decays for t in parameters):
        decay = g.to_float(g.op("Sub", one, g.op("Mul", lr, g.f64(opt.weight_decay))))
    # exp_avg.lerp_(grad, 1 - beta1): torch's lerp takes the branch by the weight's size.
    weight = float(np.float32(1.0 - beta1))
    small = abs(weight) < 0.5
    w = g.f32(weight) if small else g.f32(float(np.float32(1.0) - np.float32(weight)))
    b2, one_minus_b2, eps = g.f32(beta2), g.f32(1.0 - beta2), g.f32(opt.eps)
    for t in parameters:
        grad = t.grad
        param = g.op("Mul", t.param, decay) if t.decays else t.param
        exp_avg, exp_avg_sq = t.slots["exp_avg"], t.slots["exp_avg_sq"]
        diff = g.op("Sub", grad, exp_avg)
        if small:
            m = g.op("Add", exp_avg, g.op("Mul", w, diff), out=t.outs["exp_avg"])
        else:
            m = g.op("Sub", grad, g.op("Mul", diff, w), out=t.outs["exp_avg"])
        # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        v = g.op("Add", g.op("Mul", exp_avg_sq, b2), g.op("Mul", g.op("Mul", one_minus_b2, grad), grad),
                 out=t.outs["exp_avg_sq"])
        if opt.amsgrad:
            v = g.op("Max", t.slots["max_exp_avg_sq"], v, out=t.outs["max_exp_avg_sq"])
        denom = g.op("Add", g.op("Div", g.op("Sqrt", v), correction2_sqrt), eps)
        # param.addcdiv_(exp_avg, denom, value=-step_size): torch's CPU kernel divides the product
        g.op("Add", param, g.op("Div", g.op("Mul", neg_step_size, m), denom), out=t.outs[""])


def _sgd(g: _Graph, opt: SGD, parameters: list[_Tensors]) -> None:
    neg_lr = g.op("Neg", LEARNING_RATE)  # exact in float32: alpha=-lr
    first = g.op("Equal", STEP, g.constant(np.array(1, np.int64))) if opt.momentum != 0 else None
    wd = g.f32(opt.weight_decay) if any(t.decays for t in parameters) else None
    mu = g.f32(opt.momentum) if first is not None else None
    rest = g.f32(1.0 - opt.dampening) if first is not None and opt.dampening != 0 else None
    for t in parameters:
        grad = t.grad
        if t.decays:
            grad = g.op("Add", grad, g.op("Mul", t.param, wd))  # grad.add(param, alpha=weight_decay)
        if first is not None:
            buffer = t.slots["momentum_buffer"]
            # torch: the buffer is the gradient itself at the first step, then mu*buf + (1-dampening)*g
            scaled = g.op("Mul", grad, rest) if opt.dampening != 0 else grad
            running = g.op("Add", g.op("Mul", buffer, mu), scaled)
            buffer = g.op("Where", first, grad, running, out=t.outs["momentum_buffer"])
            grad = g.op("Add", grad, g.op("Mul", buffer, mu)) if opt.nesterov else buffer
        g.op("Add", t.param, g.op("Mul", grad, neg_lr), out=t.outs[""])


def clip_by_global_norm(nodes: list, names: FreshNames, grads: list[str], max_norm: float) -> list[str]:
    """Append to ``nodes`` torch's ``clip_grad_norm_`` of ``grads`` (float32 tensors): each scaled by
    ``min(1, max_norm / (norm + 1e-6))``, ``norm`` the global L2 norm; returns the clipped names.

    The per-tensor sums of squares are added sorted by value, so the sum does not depend on the
    order the gradients come in (ORT does not document its sequence's order): the native and the
    portable optimizer graphs compute the same factor."""
    if not max_norm > 0:
        raise OnnxMPError(f"clip_global_norm must be positive, got {max_norm}")
    constant = _constant(nodes, names)
    sums = []
    for i, grad in enumerate(grads):
        squares, total = names(f"onnxmp/clip/sumsq_{i}_kept"), names(f"onnxmp/clip/sumsq_{i}")
        nodes.append(helper.make_node("ReduceSumSquare", [grad], [squares], keepdims=1,
                                      name=names(f"onnxmp/clip/ReduceSumSquare_{i}")))
        nodes.append(helper.make_node("Reshape", [squares, constant([1], np.int64)], [total],
                                      name=names(f"onnxmp/clip/Reshape_{i}")))
        sums.append(total)
    flat, ordered, order, sum_sq, norm, denominator, ratio, factor = (
        names(f"onnxmp/clip/{n}") for n in ("squares", "sorted", "order", "sum_sq", "norm", "denominator",
                                            "ratio", "factor"))
    k, eps, c, one = (constant([len(grads)], np.int64), constant(1e-6, np.float32),
                      constant(max_norm, np.float32), constant(1.0, np.float32))
    nodes += [
        helper.make_node("Concat", sums, [flat], axis=0, name=names("onnxmp/clip/Concat")),
        helper.make_node("TopK", [flat, k], [ordered, order], axis=0, largest=1, sorted=1,
                         name=names("onnxmp/clip/TopK")),
        helper.make_node("ReduceSum", [ordered], [sum_sq], keepdims=0, name=names("onnxmp/clip/ReduceSum")),
        helper.make_node("Sqrt", [sum_sq], [norm], name=names("onnxmp/clip/Sqrt")),
        helper.make_node("Add", [norm, eps], [denominator], name=names("onnxmp/clip/Add")),
        helper.make_node("Div", [c, denominator], [ratio], name=names("onnxmp/clip/Div")),
        helper.make_node("Min", [ratio, one], [factor], name=names("onnxmp/clip/Min")),
    ]
    scaled = []
    for grad in grads:
        out = names(f"{grad}.clipped")
        nodes.append(helper.make_node("Mul", [grad, factor], [out], name=names("onnxmp/clip/Mul")))
        scaled.append(out)
    return scaled


def _constant(nodes: list, names: FreshNames):
    clip = Nodes(names, "onnxmp/clip", nodes)
    return lambda value, dtype: clip.constant(np.array(value, dtype))
