"""Constant folding in the gradient builder's graph knowledge (autodiff/fold.py, GraphInfo)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxmp.errors import OnnxMPError

from onnxmp.training.build.autodiff import backward
from onnxmp.training.build.autodiff.info import GraphInfo


def _model(nodes, inputs, inits, outputs=("y",), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "fold", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                      for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _ints(name, values):
    return numpy_helper.from_array(np.asarray(values, np.int64), name)


def _pads_chain(dims):
    """TorchScript's reflect-pad pads (ConstantOfShape/Concat/Reshape/Slice/Transpose), then the Pad."""
    nodes = [
        helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Size", ["sx"], ["rank"]),
        helper.make_node("Sub", ["rank", "two"], ["n"]), helper.make_node("Reshape", ["n", "one"], ["n1"]),
        helper.make_node("Mul", ["n1", "two1"], ["n2"]),
        helper.make_node("ConstantOfShape", ["n2"], ["z"], value=helper.make_tensor("", TensorProto.INT64, [1], [0])),
        helper.make_node("Concat", ["k", "z"], ["kz"], axis=0), helper.make_node("Reshape", ["kz", "r"], ["k2"]),
        helper.make_node("Slice", ["k2", "s0", "e0", "a0", "t0"], ["k3"]),
        helper.make_node("Transpose", ["k3"], ["k4"], perm=[1, 0]), helper.make_node("Reshape", ["k4", "one"], ["p"]),
        helper.make_node("Pad", ["x", "p"], ["y"], mode="reflect"),
    ]
    inits = [_ints("two", 2), _ints("one", [-1]), _ints("two1", [2]), _ints("k", [1, 2, 2, 1]), _ints("r", [-1, 2]),
             _ints("s0", [-1]), _ints("e0", [-100]), _ints("a0", [0]), _ints("t0", [-1])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)], inits)


def test_constant_only_chain_is_folded_where_the_shapes_are_static():
    info = GraphInfo(_pads_chain(["N", 2, 4, 5]))  # the rank is static, the batch is not
    assert info.ints("p") == [0, 0, 2, 1, 0, 0, 1, 2]
    assert info.shape("y") == ("N", 2, 7, 8)


def test_shape_of_a_symbolic_dim_is_not_folded():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])]
    info = GraphInfo(_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])], []))
    assert info.value("s") is None
    static = GraphInfo(_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], []))
    assert static.ints("s") == [2, 3]


def test_float_values_are_no_constants_to_the_rules_and_large_values_stay_unfolded():
    # a Transpose of a (small) weight folds for the shapes, but a rule never sees its value:
    # the weight is trained; a ConstantOfShape over the folding limit is not computed at all
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("ConstantOfShape", ["big"], ["z"]),
             helper.make_node("MatMul", ["x", "wt"], ["y"])]
    inits = [numpy_helper.from_array(np.ones((4, 3), np.float32), "w"), _ints("big", [100, 100])]
    info = GraphInfo(_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], inits))
    assert "wt" in info.folded and info.value("wt") is None
    assert "z" not in info.folded
    grad_model, _ = backward(_with_sum(info_model := _model(nodes, [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 3])], inits)), "loss", ["w"])
    assert any(n.op_type == "Transpose" for n in grad_model.graph.node[len(info_model.graph.node):])


def _with_sum(model: onnx.ModelProto) -> onnx.ModelProto:
    model.graph.node.append(helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0))
    model.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    return model


def test_if_with_a_folded_condition_is_inlined_and_others_stay():
    def model(dims):
        branch = lambda name, node: helper.make_graph(  # noqa: E731
            [node], name, [], [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)])
        nodes = [helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Gather", ["sx", "zero"], ["d0"]),
                 helper.make_node("Less", ["d0", "three"], ["small"]),
                 helper.make_node("If", ["small"], ["y"],
                                  then_branch=branch("then", helper.make_node("Neg", ["x"], ["a"])),
                                  else_branch=branch("else", helper.make_node("Identity", ["x"], ["b"])))]
        return _with_sum(_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                                [_ints("zero", 0), _ints("three", 3)]))

    grad_model, _ = backward(model([2, 4]), "loss", ["x"])
    assert not any(n.op_type == "If" for n in grad_model.graph.node)
    assert any(n.op_type == "Neg" for n in grad_model.graph.node)
    # the condition depends on the batch: the If stays, and the builder finds no gradient path through it
    with pytest.raises(OnnxMPError) as caught:
        backward(model(["N", 4]), "loss", ["x"])
    assert "no gradient" in str(caught.value)
