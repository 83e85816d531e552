"""Small graphs, one or more per gradient rule of onnxmp.training.build.autodiff.VJP_RULES.

Each case is a few nodes producing ``y`` (and more outputs where the op has several), from inputs
that are differentiated (``F``: graph inputs, optionally with symbolic dims declared) or constant
(``C`` float, ``I`` integer, ``B`` bool: initializers).  The test builds the case in float64
(finite differences, onnx's reference evaluator) and float32 (onnxruntime), adds the loss
``sum_k sum(y_k * w_k)`` with fixed random weights, and differentiates it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"


@dataclass(frozen=True)
class F:
    """A differentiated float input: a graph input shaped ``shape`` (declared with ``dims``)."""
    shape: tuple
    dims: tuple | None = None
    low: float = -1.0
    high: float = 1.0
    wrt: bool = True


@dataclass(frozen=True)
class C:
    """A float constant (initializer, not differentiated), of the case's float type unless ``dtype``."""
    value: object
    dtype: object = None


@dataclass(frozen=True)
class I:  # noqa: E742 - the integer spec
    value: object
    dtype: object = np.int64


@dataclass(frozen=True)
class B:
    shape: tuple
    seed: int = 7


@dataclass
class Case:
    id: str
    op: tuple[str, str]
    nodes: list
    inputs: dict
    outputs: tuple = ("y",)
    opset: int = 17
    domains: dict = field(default_factory=dict)

    def model(self, dtype=np.float64, seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[str]]:
        """(forward model producing the outputs, feeds for the differentiated inputs, their names)."""
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        rng = np.random.default_rng(seed)
        inputs, inits, feeds = [], [], {}
        for name, spec in self.inputs.items():
            if isinstance(spec, F):
                value = rng.uniform(spec.low, spec.high, spec.shape).astype(dtype)
                feeds[name] = value
                inputs.append(helper.make_tensor_value_info(name, elem, list(spec.dims or spec.shape)))
            elif isinstance(spec, C):
                inits.append(numpy_helper.from_array(np.asarray(spec.value, spec.dtype or dtype), name))
            elif isinstance(spec, I):
                inits.append(numpy_helper.from_array(np.asarray(spec.value, spec.dtype), name))
            elif isinstance(spec, B):
                value = np.random.default_rng(spec.seed).random(spec.shape) > 0.5
                inits.append(numpy_helper.from_array(value, name))
        nodes = [_retyped(n, elem) for n in self.nodes]
        outputs = [helper.make_tensor_value_info(o, elem, None) for o in self.outputs]
        graph = helper.make_graph(nodes, self.id, inputs, outputs, inits)
        opsets = [helper.make_opsetid("", self.opset)] + [helper.make_opsetid(d, v) for d, v in self.domains.items()]
        model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
        return model, feeds, list(feeds)


def _retyped(node: onnx.NodeProto, elem: int) -> onnx.NodeProto:
    """A Cast to float written in the case becomes a Cast to the case's float type."""
    node = onnx.NodeProto.FromString(node.SerializeToString())
    for a in node.attribute:
        if node.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
            a.i = elem
    return node


def N(op: str, inputs, outputs=("y",), domain: str | None = None, **attrs) -> onnx.NodeProto:
    return helper.make_node(op, list(inputs), list(outputs), name=f"{op}_{'_'.join(outputs)}", domain=domain,
                            **attrs)


def unary(op: str, shape=(2, 3), low=-2.0, high=2.0, suffix: str = "", domain: str = "", **attrs) -> Case:
    key = (domain, op)
    return Case(f"{op}{suffix}", key, [N(op, ["x"], domain=domain or None, **attrs)],
                {"x": F(shape, low=low, high=high)}, domains={domain: 1} if domain else {})


def binary(op: str, a=(2, 3), b=(2, 3), suffix: str = "", dims_a=None, dims_b=None, low=-2.0, high=2.0) -> Case:
    return Case(f"{op}{suffix}", ("", op), [N(op, ["a", "b"])],
                {"a": F(a, dims_a, low, high), "b": F(b, dims_b, low, high)})


def _nonzero(shape, seed):
    value = np.random.default_rng(seed).uniform(0.5, 1.5, shape)
    return value * np.where(np.random.default_rng(seed + 1).random(shape) > 0.5, 1, -1)


CASES: list[Case] = [
    # elementwise, with broadcasting (a leading axis, a 1-sized axis, a 0-d operand, symbolic dims)
    binary("Add", (2, 3), (3,), "_bias"),
    binary("Add", (2, 1, 3), (4, 1), "_both_broadcast"),
    binary("Add", (4, 3), (1, 3), "_symbolic", dims_a=("N", 3)),
    binary("Add", (2, 3), (2, 1), "_symbolic_vs_symbolic", dims_a=("N", "M"), dims_b=("K", "L")),
    binary("Sub", (2, 3), (1, 3), "_row"),
    binary("Mul", (2, 3), (), "_scalar"),
    binary("Mul", (0, 3), (3,), "_empty"),
    Case("Mul_same_input", ("", "Mul"), [N("Mul", ["a", "a"])], {"a": F((2, 3))}),
    Case("Div", ("", "Div"), [N("Div", ["a", "b"])], {"a": F((2, 3)), "b": F((3,), low=0.5, high=2.0)}),
    Case("Pow_square", ("", "Pow"), [N("Pow", ["a", "e"])], {"a": F((2, 3)), "e": C(2.0)}),
    Case("Pow_sqrt", ("", "Pow"), [N("Pow", ["a", "e"])], {"a": F((2, 3), low=0.5, high=2.0), "e": C(0.5)}),
    Case("Pow_cube", ("", "Pow"), [N("Pow", ["a", "e"])], {"a": F((2, 3)), "e": C(3.0)}),
    Case("Pow_both", ("", "Pow"), [N("Pow", ["a", "e"])], {"a": F((2, 3), low=0.5, high=2.0), "e": F((3,))}),
    unary("Neg"), unary("Identity"), unary("Sqrt", low=0.5), unary("Exp"), unary("Log", low=0.5), unary("Tanh"),
    unary("Sigmoid"), unary("Relu"), unary("Erf"), unary("Abs"), unary("Reciprocal", low=0.5), unary("Sin"),
    unary("Cos"),
    Case("Cast_roundtrip", ("", "Cast"), [N("Cast", ["x"], ["h"], to=TensorProto.DOUBLE),
                                          N("Cast", ["h"], ["y"], to=TensorProto.FLOAT)], {"x": F((2, 3))}),
    Case("Where", ("", "Where"), [N("Where", ["c", "a", "b"])], {"c": B((2, 3)), "a": F((2, 3)), "b": F((3,))}),
    Case("Where_scalar_branch", ("", "Where"), [N("Where", ["c", "a", "b"])],
         {"c": B((2, 3)), "a": F(()), "b": F((2, 3))}),
    binary("Max", (2, 3), (3,)), binary("Min", (2, 3), (2, 1)),
    Case("Max_three", ("", "Max"), [N("Max", ["a", "b", "c"])], {"a": F((2, 3)), "b": F((3,)), "c": F((2, 3))}),
    Case("Sum_three", ("", "Sum"), [N("Sum", ["a", "b", "c"])], {"a": F((2, 3)), "b": F((3,)), "c": F((2, 1))}),
    Case("Mean_two", ("", "Mean"), [N("Mean", ["a", "b"])], {"a": F((2, 3)), "b": F((3,))}),
    Case("Clip", ("", "Clip"), [N("Clip", ["x", "lo", "hi"])], {"x": F((3, 4), low=-2, high=2), "lo": C(-0.5),
                                                                   "hi": C(0.7)}),
    Case("Clip_min_only", ("", "Clip"), [N("Clip", ["x", "lo"])], {"x": F((3, 4)), "lo": C(0.1)}),
    Case("Dropout_inference", ("", "Dropout"), [N("Dropout", ["x", "r"])], {"x": F((2, 3)), "r": C(0.3)}),
    # activations
    unary("Softplus"), unary("Softsign"), unary("LeakyRelu", alpha=0.1), unary("Elu", alpha=0.7),
    unary("Selu"), unary("Celu", alpha=0.8), unary("ThresholdedRelu", alpha=0.3),
    unary("HardSigmoid", low=-4, high=4, alpha=0.3, beta=0.4), unary("HardSwish", low=-4, high=4),
    Case("Mish", ("", "Mish"), [N("Mish", ["x"])], {"x": F((2, 3), low=-2, high=2)}, opset=18),
    Case("PRelu", ("", "PRelu"), [N("PRelu", ["x", "s"])], {"x": F((2, 3, 2)), "s": F((3, 1))}),
    Case("Gelu_erf", ("", "Gelu"), [N("Gelu", ["x"])], {"x": F((2, 3), low=-3, high=3)}, opset=20),
    Case("Gelu_tanh", ("", "Gelu"), [N("Gelu", ["x"], approximate="tanh")], {"x": F((2, 3), low=-3, high=3)},
         opset=20),
    unary("Gelu", low=-3, high=3, suffix="_ms", domain=MS),
    Case("FastGelu_bias", (MS, "FastGelu"), [N("FastGelu", ["x", "b"], domain=MS)], {"x": F((2, 3)), "b": F((3,))},
         domains={MS: 1}),
    Case("BiasGelu", (MS, "BiasGelu"), [N("BiasGelu", ["x", "b"], domain=MS)], {"x": F((2, 3)), "b": F((3,))},
         domains={MS: 1}),
    # linear algebra
    Case("MatMul_2d", ("", "MatMul"), [N("MatMul", ["a", "b"])], {"a": F((2, 3)), "b": F((3, 4))}),
    Case("MatMul_batched_weight", ("", "MatMul"), [N("MatMul", ["a", "b"])],
         {"a": F((2, 3, 4), ("N", "S", 4)), "b": F((4, 5))}),
    Case("MatMul_attention", ("", "MatMul"), [N("MatMul", ["a", "b"])], {"a": F((2, 2, 3, 4)), "b": F((2, 2, 4, 3))}),
    Case("MatMul_broadcast_batch", ("", "MatMul"), [N("MatMul", ["a", "b"])], {"a": F((2, 3, 4)), "b": F((1, 4, 2))}),
    Case("MatMul_vector_left", ("", "MatMul"), [N("MatMul", ["a", "b"])], {"a": F((3,)), "b": F((2, 3, 4))}),
    Case("MatMul_vector_right", ("", "MatMul"), [N("MatMul", ["a", "b"])], {"a": F((2, 3)), "b": F((3,))}),
    Case("MatMul_vectors", ("", "MatMul"), [N("MatMul", ["a", "b"])], {"a": F((3,)), "b": F((3,))}),
    Case("Gemm", ("", "Gemm"), [N("Gemm", ["a", "b", "c"], alpha=0.7, beta=1.3)],
         {"a": F((2, 3)), "b": F((3, 4)), "c": F((4,))}),
    Case("Gemm_transA_transB", ("", "Gemm"), [N("Gemm", ["a", "b", "c"], transA=1, transB=1)],
         {"a": F((3, 2)), "b": F((4, 3)), "c": F((2, 1))}),
    Case("Gemm_transB", ("", "Gemm"), [N("Gemm", ["a", "b"], transB=1)], {"a": F((2, 3)), "b": F((4, 3))}),
    Case("Einsum", ("", "Einsum"), [N("Einsum", ["a", "b"], equation="bij,bjk->bik")],
         {"a": F((2, 3, 4)), "b": F((2, 4, 2))}),
    Case("FusedMatMul", (MS, "FusedMatMul"), [N("FusedMatMul", ["a", "b"], domain=MS, transA=1, alpha=0.5)],
         {"a": F((2, 4, 3)), "b": F((4, 2))}, domains={MS: 1}),
    # normalization
    Case("LayerNormalization", ("", "LayerNormalization"), [N("LayerNormalization", ["x", "s", "b"], epsilon=1e-5)],
         {"x": F((2, 3, 4), ("N", "S", 4)), "s": F((4,)), "b": F((4,))}),
    Case("LayerNormalization_axis1_outputs", ("", "LayerNormalization"),
         [N("LayerNormalization", ["x", "s"], ["y", "mean", "inv"], axis=1)],
         {"x": F((2, 3, 4)), "s": F((3, 4))}, outputs=("y",)),
    Case("BatchNormalization_training", ("", "BatchNormalization"),
         [N("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], training_mode=1)],
         {"x": F((3, 2, 2, 2)), "s": F((2,)), "b": F((2,)), "m": C([0.1, 0.2]), "v": C([1.0, 2.0])}),
    Case("BatchNormalization_inference", ("", "BatchNormalization"), [N("BatchNormalization", ["x", "s", "b", "m", "v"])],
         {"x": F((3, 2, 2)), "s": F((2,)), "b": F((2,)), "m": C([0.1, 0.2]), "v": C([1.0, 2.0])}),
    Case("InstanceNormalization", ("", "InstanceNormalization"), [N("InstanceNormalization", ["x", "s", "b"])],
         {"x": F((2, 2, 3, 2)), "s": F((2,)), "b": F((2,))}),
    Case("GroupNormalization_18", ("", "GroupNormalization"), [N("GroupNormalization", ["x", "s", "b"], num_groups=2)],
         {"x": F((2, 4, 3)), "s": F((2,)), "b": F((2,))}, opset=18),
    Case("Softmax", ("", "Softmax"), [N("Softmax", ["x"], axis=1)], {"x": F((2, 3, 4))}),
    Case("Softmax_opset11", ("", "Softmax"), [N("Softmax", ["x"], axis=1)], {"x": F((2, 3, 4))}, opset=11),
    Case("LogSoftmax", ("", "LogSoftmax"), [N("LogSoftmax", ["x"])], {"x": F((2, 5))}),
    # a cross-entropy's pick: LogSoftmax's gradient one scatter-add of the picked rows (one index per
    # row: no sum; several, with a repeat: summed); across another axis, the plain form
    Case("LogSoftmax_picked", ("", "LogSoftmax"),
         [N("LogSoftmax", ["x"], ["p"], axis=-1), N("GatherElements", ["p", "i"], axis=-1)],
         {"x": F((3, 5)), "i": I([[0], [4], [-3]])}),
    Case("LogSoftmax_picked_several", ("", "LogSoftmax"),
         [N("LogSoftmax", ["x"], ["p"], axis=1), N("GatherElements", ["p", "i"], axis=1)],
         {"x": F((2, 4, 3)), "i": I([[[0, 1, 3], [0, 2, 3]], [[3, 3, 1], [2, 0, 0]]])}),
    Case("LogSoftmax_picked_other_axis", ("", "LogSoftmax"),
         [N("LogSoftmax", ["x"], ["p"], axis=0), N("GatherElements", ["p", "i"], axis=1)],
         {"x": F((3, 5)), "i": I([[0], [4], [2]])}),
    # shapes
    Case("Reshape", ("", "Reshape"), [N("Reshape", ["x", "s"])], {"x": F((2, 3, 4), ("N", 3, 4)), "s": I([0, -1])}),
    Case("Reshape_symbolic", ("", "Reshape"), [N("Reshape", ["x", "s"])],
         {"x": F((2, 3, 4), ("N", "S", 4)), "s": I([-1, 4])}),
    Case("Squeeze", ("", "Squeeze"), [N("Squeeze", ["x", "a"])], {"x": F((2, 1, 3)), "a": I([-2])}),
    Case("Squeeze_opset11", ("", "Squeeze"), [N("Squeeze", ["x"], axes=[1])], {"x": F((2, 1, 3))}, opset=11),
    Case("Unsqueeze", ("", "Unsqueeze"), [N("Unsqueeze", ["x", "a"])], {"x": F((2, 3)), "a": I([0, -1])}),
    Case("Flatten", ("", "Flatten"), [N("Flatten", ["x"], axis=2)], {"x": F((2, 3, 2, 2), ("N", 3, 2, 2))}),
    Case("Transpose", ("", "Transpose"), [N("Transpose", ["x"], perm=[2, 0, 1])], {"x": F((2, 3, 4))}),
    Case("Concat", ("", "Concat"), [N("Concat", ["a", "b", "c"], axis=-1)],
         {"a": F((2, 2)), "b": F((2, 3)), "c": F((2, 1))}),
    Case("Concat_symbolic", ("", "Concat"), [N("Concat", ["a", "b", "c"], axis=1)],
         {"a": F((2, 2), (2, "P")), "b": F((2, 3)), "c": F((2, 1), (2, "Q"))}),
    Case("Split", ("", "Split"), [N("Split", ["x", "s"], ["y", "z"], axis=1)], {"x": F((2, 5)), "s": I([2, 3])},
         outputs=("y", "z")),
    Case("Split_one_used", ("", "Split"), [N("Split", ["x", "s"], ["y", "z"], axis=1)],
         {"x": F((2, 5)), "s": I([2, 3])}),
    Case("Slice", ("", "Slice"), [N("Slice", ["x", "s", "e", "a"])],
         {"x": F((3, 4)), "s": I([1, -3]), "e": I([100, -1]), "a": I([0, 1])}),
    Case("Slice_symbolic", ("", "Slice"), [N("Slice", ["x", "s", "e", "a"])],
         {"x": F((3, 5), ("N", "S")), "s": I([1, 0]), "e": I([3, -2]), "a": I([1, 0])}),
    Case("Slice_step", ("", "Slice"), [N("Slice", ["x", "s", "e", "a", "t"])],
         {"x": F((2, 5, 4)), "s": I([0, 1]), "e": I([100, 4]), "a": I([1, 2]), "t": I([2, 2])}),
    Case("Expand", ("", "Expand"), [N("Expand", ["x", "s"])], {"x": F((3, 1)), "s": I([2, 3, 4])}),
    Case("Tile", ("", "Tile"), [N("Tile", ["x", "r"])], {"x": F((2, 3)), "r": I([2, 3])}),
    Case("Tile_symbolic", ("", "Tile"), [N("Tile", ["x", "r"])], {"x": F((2, 3), ("N", "M")), "r": I([3, 1])}),
    # torch.tile in TorchScript: x reshaped to the repeats' rank behind an If whose condition static
    # shapes decide (the If is inlined; through it, the Tile's rank that the Expand needs is unknown)
    Case("Tile_if_rank", ("", "Tile"),
         [N("Shape", ["x"], ["sx"]), N("Size", ["sx"], ["rank"]), N("Size", ["r"], ["nr"]),
          N("Less", ["rank", "nr"], ["short"]),
          helper.make_node("If", ["short"], ["xr"], name="If_xr",
                           then_branch=helper.make_graph(
                               [N("Concat", ["one", "sx"], ["s3"], axis=0), N("Reshape", ["x", "s3"], ["xr_then"])],
                               "then", [], [helper.make_tensor_value_info("xr_then", TensorProto.FLOAT, None)]),
                           else_branch=helper.make_graph(
                               [N("Identity", ["x"], ["xr_else"])], "else", [],
                               [helper.make_tensor_value_info("xr_else", TensorProto.FLOAT, None)])),
          N("Tile", ["xr", "r"], ["t"]), N("Expand", ["t", "s"])],
         {"x": F((3, 1)), "one": I([1]), "r": I([2, 1, 4]), "s": I([2, 2, 3, 4])}),
    Case("Pad", ("", "Pad"), [N("Pad", ["x", "p", "v"])], {"x": F((2, 3)), "p": I([1, 0, 2, 1]), "v": C(0.5)}),
    Case("Pad_crop", ("", "Pad"), [N("Pad", ["x", "p"])], {"x": F((3, 4)), "p": I([1, -1, -1, 2])}),
    Case("Pad_reflect", ("", "Pad"), [N("Pad", ["x", "p"], mode="reflect")],
         {"x": F((2, 4, 5), ("N", 4, 5)), "p": I([0, 3, 1, 0, 2, 4])}),
    Case("Pad_edge", ("", "Pad"), [N("Pad", ["x", "p"], mode="edge")], {"x": F((3, 4)), "p": I([2, 0, 1, 3])}),
    Case("Pad_wrap_axes", ("", "Pad"), [N("Pad", ["x", "p", "", "a"], mode="wrap")],
         {"x": F((2, 3, 4)), "p": I([4, 1, 2, 3]), "a": I([-1, 1])}, opset=19),
    # pads computed from constants only (a chain onnx's data propagation does not follow): folded
    Case("Pad_reflect_folded_pads", ("", "Pad"),
         [N("ConstantOfShape", ["n"], ["z"], value=helper.make_tensor("", TensorProto.INT64, [1], [0])),
          N("Concat", ["k", "z"], ["kz"], axis=0), N("Reshape", ["kz", "r"], ["k2"]),
          N("Slice", ["k2", "s0", "e0", "a0", "t0"], ["k3"]), N("Transpose", ["k3"], ["k4"], perm=[1, 0]),
          N("Reshape", ["k4", "flat"], ["p"]), N("Pad", ["x", "p"], ["y0"], mode="reflect"),
          N("AveragePool", ["y0"], ["y"], kernel_shape=[2, 2], count_include_pad=1)],
         {"x": F((1, 2, 4, 5), ("N", 2, 4, 5)), "n": I([4]), "k": I([1, 2, 2, 1]), "r": I([-1, 2]),
          "s0": I([-1]), "e0": I([-100]), "a0": I([0]), "t0": I([-1]), "flat": I([-1])}),
    # indexing
    Case("Gather_embedding", ("", "Gather"), [N("Gather", ["w", "i"])], {"w": F((5, 3)), "i": I([[0, 4, 1], [4, 4, 2]])}),
    Case("Gather_int32_negative", ("", "Gather"), [N("Gather", ["w", "i"], axis=1)],
         {"w": F((2, 5, 3)), "i": I([-1, 0, 3], np.int32)}),
    Case("Gather_scalar_index", ("", "Gather"), [N("Gather", ["w", "i"], axis=1)],
         {"w": F((2, 4, 3), ("N", "S", 3)), "i": I(0)}),
    Case("GatherElements", ("", "GatherElements"), [N("GatherElements", ["x", "i"], axis=-1)],
         {"x": F((2, 4)), "i": I([[0, 0, 3], [1, 2, 1]])}),
    Case("GatherND", ("", "GatherND"), [N("GatherND", ["x", "i"])], {"x": F((3, 2, 2)), "i": I([[0, 1], [2, 0], [0, 1]])}),
    Case("ScatterND", ("", "ScatterND"), [N("ScatterND", ["x", "i", "u"])],
         {"x": F((4, 3)), "i": I([[1], [3]]), "u": F((2, 3))}),
    Case("ScatterElements", ("", "ScatterElements"), [N("ScatterElements", ["x", "i", "u"], axis=1)],
         {"x": F((2, 4)), "i": I([[1, 3], [0, 2]]), "u": F((2, 2))}),
    # reductions
    Case("ReduceSum", ("", "ReduceSum"), [N("ReduceSum", ["x", "a"], keepdims=0)], {"x": F((2, 3, 4)), "a": I([0, -1])}),
    Case("ReduceSum_symbolic", ("", "ReduceSum"), [N("ReduceSum", ["x", "a"])],
         {"x": F((2, 3, 4), ("N", "S", 4)), "a": I([1])}),
    Case("ReduceSum_all", ("", "ReduceSum"), [N("ReduceSum", ["x"], keepdims=0)], {"x": F((2, 3))}),
    Case("ReduceMean", ("", "ReduceMean"), [N("ReduceMean", ["x"], axes=[-1])], {"x": F((2, 3, 4))}),
    Case("ReduceMean_opset18", ("", "ReduceMean"), [N("ReduceMean", ["x", "a"], keepdims=0)],
         {"x": F((2, 3, 4), ("N", "S", 4)), "a": I([1])}, opset=18),
    Case("ReduceMax", ("", "ReduceMax"), [N("ReduceMax", ["x"], axes=[1], keepdims=0)], {"x": F((2, 4, 3))}),
    # every axis to a scalar: the scalar gradient broadcasts, no Unsqueeze
    Case("ReduceMax_all", ("", "ReduceMax"), [N("ReduceMax", ["x"], keepdims=0)], {"x": F((2, 4))}),
    Case("ReduceL2_all", ("", "ReduceL2"), [N("ReduceL2", ["x"], keepdims=0)], {"x": F((2, 3))}),
    Case("ReduceMin", ("", "ReduceMin"), [N("ReduceMin", ["x"], axes=[0])], {"x": F((3, 2))}),
    Case("ReduceSumSquare", ("", "ReduceSumSquare"), [N("ReduceSumSquare", ["x"], axes=[1])], {"x": F((2, 3))}),
    Case("ReduceL2", ("", "ReduceL2"), [N("ReduceL2", ["x"], axes=[1], keepdims=0)], {"x": F((2, 3))}),
    Case("ReduceLogSumExp", ("", "ReduceLogSumExp"), [N("ReduceLogSumExp", ["x"], axes=[0])], {"x": F((3, 2))}),
    Case("CumSum", ("", "CumSum"), [N("CumSum", ["x", "a"])], {"x": F((2, 4)), "a": I(1)}),
    Case("CumSum_exclusive_reverse", ("", "CumSum"), [N("CumSum", ["x", "a"], exclusive=1, reverse=1)],
         {"x": F((2, 4)), "a": I(-1)}),
    Case("GlobalAveragePool", ("", "GlobalAveragePool"), [N("GlobalAveragePool", ["x"])], {"x": F((2, 3, 2, 3))}),
    Case("GlobalAveragePool_symbolic", ("", "GlobalAveragePool"), [N("GlobalAveragePool", ["x"])],
         {"x": F((2, 3, 2, 3), ("N", 3, "H", "W"))}),
    Case("GlobalMaxPool", ("", "GlobalMaxPool"), [N("GlobalMaxPool", ["x"])], {"x": F((2, 2, 3, 3))}),
    # convolution and pooling
    Case("Conv", ("", "Conv"), [N("Conv", ["x", "w", "b"], pads=[1, 1, 1, 1])],
         {"x": F((2, 3, 5, 5), ("N", 3, 5, 5)), "w": F((4, 3, 3, 3)), "b": F((4,))}),
    Case("Conv_strided", ("", "Conv"), [N("Conv", ["x", "w"], strides=[2, 2], pads=[1, 0, 1, 0])],
         {"x": F((2, 2, 6, 5)), "w": F((3, 2, 3, 2))}),
    Case("Conv_strided_symbolic", ("", "Conv"), [N("Conv", ["x", "w"], strides=[2, 2], pads=[1, 1, 1, 1])],
         {"x": F((1, 2, 6, 5), ("N", 2, "H", "W")), "w": F((3, 2, 3, 3))}),
    Case("Conv_dilated", ("", "Conv"), [N("Conv", ["x", "w"], dilations=[2, 1], pads=[2, 1, 2, 1])],
         {"x": F((1, 2, 5, 4)), "w": F((2, 2, 3, 3))}),
    Case("Conv_grouped", ("", "Conv"), [N("Conv", ["x", "w"], group=2, strides=[2, 1])],
         {"x": F((2, 4, 5, 4)), "w": F((6, 2, 3, 2))}),
    Case("Conv_depthwise", ("", "Conv"), [N("Conv", ["x", "w"], group=3, pads=[1, 1, 1, 1], strides=[2, 2])],
         {"x": F((2, 3, 5, 5), ("N", 3, 5, 5)), "w": F((6, 1, 3, 3))}),
    # 1x1 without pads: the weight gradient is one Einsum (strided: of a strided Slice of X)
    Case("Conv_1x1", ("", "Conv"), [N("Conv", ["x", "w", "b"])],
         {"x": F((2, 3, 4, 5), ("N", 3, "H", "W")), "w": F((4, 3, 1, 1)), "b": F((4,))}),
    Case("Conv_1x1_strided", ("", "Conv"), [N("Conv", ["x", "w"], strides=[2, 2])],
         {"x": F((2, 3, 5, 4), ("N", 3, 5, 4)), "w": F((4, 3, 1, 1))}),
    Case("Conv_1x1_padded", ("", "Conv"), [N("Conv", ["x", "w"], pads=[1, 0, 1, 0], strides=[2, 1])],
         {"x": F((2, 3, 5, 4)), "w": F((4, 3, 1, 1))}),
    # float32, static extents, 8 or more channels: the weight gradient is one Gather of X's
    # patches and one Einsum with dY (symbolic extents: not)
    Case("Conv_patches", ("", "Conv"), [N("Conv", ["x", "w", "b"], pads=[1, 1, 1, 1])],
         {"x": F((2, 8, 5, 5), ("N", 8, 5, 5)), "w": F((4, 8, 3, 3)), "b": F((4,))}),
    Case("Conv_patches_strided_dilated", ("", "Conv"),
         [N("Conv", ["x", "w"], strides=[2, 1], dilations=[1, 2], pads=[1, 2, 0, 1])],
         {"x": F((2, 8, 7, 6), ("N", 8, 7, 6)), "w": F((3, 8, 3, 2))}),
    Case("Conv_patches_1d", ("", "Conv"), [N("Conv", ["x", "w"], strides=[3], pads=[2, 0])],
         {"x": F((2, 9, 8)), "w": F((2, 9, 4))}),
    # without pads: no Pad between the transpose and the Gather
    Case("Conv_patches_unpadded", ("", "Conv"), [N("Conv", ["x", "w"], strides=[2, 1])],
         {"x": F((2, 8, 6, 5), ("N", 8, 6, 5)), "w": F((3, 8, 3, 2))}),
    Case("Conv_patches_symbolic_extents", ("", "Conv"), [N("Conv", ["x", "w"], pads=[1, 1, 1, 1])],
         {"x": F((1, 8, 4, 5), ("N", 8, "H", "W")), "w": F((2, 8, 3, 3))}),
    Case("Conv_1d_same", ("", "Conv"), [N("Conv", ["x", "w"], auto_pad="SAME_UPPER", strides=[2])],
         {"x": F((2, 2, 7)), "w": F((3, 2, 4))}),
    Case("ConvTranspose_grouped", ("", "ConvTranspose"),
         [N("ConvTranspose", ["x", "w", "b"], group=2, strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])],
         {"x": F((2, 4, 3, 3), ("N", 4, 3, 3)), "w": F((4, 3, 3, 3)), "b": F((6,))}),
    Case("ConvTranspose_1d_dilated", ("", "ConvTranspose"),
         [N("ConvTranspose", ["x", "w"], strides=[3], dilations=[2], pads=[1, 2])],
         {"x": F((2, 3, 4)), "w": F((3, 2, 3))}),
    Case("ConvTranspose_depthwise_symbolic", ("", "ConvTranspose"),
         [N("ConvTranspose", ["x", "w"], group=3, strides=[2, 1], pads=[0, 1, 0, 1])],
         {"x": F((1, 3, 3, 4), ("N", 3, "H", "W")), "w": F((3, 2, 2, 3))}),
    Case("MaxPool", ("", "MaxPool"), [N("MaxPool", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])],
         {"x": F((2, 2, 5, 5), ("N", 2, 5, 5))}),
    # a ReLU before it (ResNet's stem): the ReLU's mask applied to the pooled gradient, before the
    # scatter; with its output read elsewhere too (a second output here): after it, as alone
    Case("MaxPool_after_Relu", ("", "MaxPool"),
         [N("Relu", ["x"], ["r"]), N("MaxPool", ["r"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])],
         {"x": F((2, 2, 5, 5), ("N", 2, 5, 5))}),
    Case("MaxPool_after_Relu_shared", ("", "MaxPool"),
         [N("Relu", ["x"], ["r"]), N("MaxPool", ["r"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])],
         {"x": F((2, 2, 5, 5))}, outputs=("y", "r")),
    Case("MaxPool_ceil_indices", ("", "MaxPool"), [N("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2], ceil_mode=1,
                                                      strides=[2, 2])], {"x": F((1, 2, 5, 3))}),
    Case("AveragePool", ("", "AveragePool"), [N("AveragePool", ["x"], kernel_shape=[3, 3], strides=[2, 2],
                                                pads=[1, 1, 1, 1])], {"x": F((2, 2, 5, 5))}),
    Case("Resize_nearest", ("", "Resize"), [N("Resize", ["x", "", "s"], mode="nearest",
                                             coordinate_transformation_mode="asymmetric", nearest_mode="floor")],
         {"x": F((2, 2, 3, 2), ("N", 2, 3, 2)), "s": C([1.0, 1.0, 2.0, 3.0], np.float32)}),
    Case("Resize_linear_sizes", ("", "Resize"), [N("Resize", ["x", "", "", "z"], mode="linear")],
         {"x": F((1, 2, 5, 4)), "z": I([1, 2, 3, 7])}),
    # TorchScript's interpolate(size=...): sizes = Concat(Shape(x)[0:2], [H, W]), the batch symbolic
    Case("Resize_sizes_from_shape", ("", "Resize"),
         [N("Shape", ["x"], ["sx"], end=2), N("Concat", ["sx", "hw"], ["z"], axis=0),
          N("Resize", ["x", "", "", "z"], mode="linear", coordinate_transformation_mode="align_corners")],
         {"x": F((2, 3, 4, 3), ("N", 3, 4, 3)), "hw": I([6, 5])}),
    Case("Resize_cubic_align_corners", ("", "Resize"), [N("Resize", ["x", "", "s"], mode="cubic",
                                                         coordinate_transformation_mode="align_corners")],
         {"x": F((1, 1, 4, 3)), "s": C([1.0, 1.0, 1.5, 2.0], np.float32)}),
    Case("AveragePool_include_pad_ceil", ("", "AveragePool"),
         [N("AveragePool", ["x"], kernel_shape=[2, 3], strides=[2, 2], pads=[1, 0, 0, 1], count_include_pad=1,
            ceil_mode=1)], {"x": F((1, 2, 5, 4))}),
]


def case_named(name: str) -> Case:
    return next(c for c in CASES if c.id == name)
