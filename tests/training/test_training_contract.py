"""The contract's names and the one node builder (no training build needed)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxmp.naming import FreshNames
from onnxmp.training import contract
from onnxmp.training.nodes import LossGraph, Nodes, Rewrite, Writer
from onnxmp.training.update_graph import build_portable_optimizer


def test_accumulation_names_round_trip():
    buffer = contract.accumulation_buffer("layer.weight")
    assert buffer == "layer.weight_grad.accumulation.buffer"
    assert contract.is_accumulation_buffer(buffer) and contract.buffer_parameter(buffer) == "layer.weight"
    assert contract.buffer_parameter("layer.weight") is None
    assert contract.is_accumulation_out(contract.accumulation_out("w"))
    assert not contract.is_accumulation_out(buffer)


def test_gradient_names_round_trip():
    assert contract.gradient_output("layer.weight") == "layer.weight_grad"
    assert contract.gradient_parameter("layer.weight_grad") == "layer.weight"
    assert contract.gradient_parameter("layer.weight") is None
    # the accumulation buffer is named after the gradient
    assert contract.accumulation_buffer("w").startswith(contract.gradient_output("w"))


def test_slots_and_state_pairs_follow_the_update_graph():
    model = build_portable_optimizer("adamw", [("w", [2, 3]), ("b", [3])], 17)
    slots = contract.optimizer_slots([i.name for i in model.graph.input], ["w", "b"])
    assert slots == ["exp_avg", "exp_avg_sq"]
    pairs = contract.state_pairs(["w", "b"], slots)
    # every state input of the optimizer graph has its next value among the graph's outputs
    outputs = {o.name for o in model.graph.output}
    assert set(pairs["optimizer_model"].values()) == outputs
    assert all(contract.updated(out) == name for name, out in pairs["optimizer_model"].items())
    assert pairs["training_model"] == {"w_grad.accumulation.buffer": "w_grad.accumulation.out",
                                       "b_grad.accumulation.buffer": "b_grad.accumulation.out"}
    assert contract.optimizer_slots([i.name for i in build_portable_optimizer("sgd", [("w", [2])], 17)
                                     .graph.input], ["w"]) == []


def test_user_inputs_leave_out_parameters_and_the_contract_inputs():
    value = helper.make_tensor_value_info
    graph = helper.make_graph([], "g", [value("x", TensorProto.FLOAT, [1]), value("labels", TensorProto.INT64, [1]),
                                        value("w", TensorProto.FLOAT, [1]),
                                        value(contract.accumulation_buffer("w"), TensorProto.FLOAT, [1]),
                                        value(contract.LAZY_RESET_GRAD, TensorProto.BOOL, [1]),
                                        value(contract.LOSS_SCALE, TensorProto.FLOAT, []),
                                        value(contract.GRAD_WEIGHT, TensorProto.FLOAT, [])], [])
    assert contract.user_inputs(helper.make_model(graph), ["w"]) == [("x", "float32"), ("labels", "int64")]


def test_nodes_name_fresh_and_place_constants():
    names = FreshNames({"s/Add"})
    nodes = Nodes(names, "s")
    out = nodes.op("Add", ["a", "b"])
    const = nodes.constant(np.array([1, 2], np.int64))
    assert [n.name for n in nodes.nodes] == ["s/Add_1", "s/Constant"]
    assert out == "s/Add_output" and const == "s/const"
    into: list = []
    held = Nodes(FreshNames(set()), "t", into, initializers=[])
    held.constant(np.float32(1.0))
    assert into == [] and held.initializers[0].name == "t/const"


def test_a_rewrite_takes_its_scope_and_float_type_from_the_node():
    node = helper.make_node("Gelu", ["x"], ["y"], name="act")
    half = helper.make_tensor_type_proto(TensorProto.FLOAT16, [2])
    b = Rewrite.of(FreshNames(set()), node, {"x": half})
    c = b.const(0.5)
    assert b.scope == "act" and b.nodes[-1].attribute[0].t.data_type == TensorProto.FLOAT16 and c == "act/const"
    ints = Rewrite.of(FreshNames(set()), node, {"x": helper.make_tensor_type_proto(TensorProto.INT64, [2])})
    assert ints.elem == TensorProto.FLOAT  # not a float: constants in float32


def test_writers_take_inputs_as_arguments_and_exact_output_names():
    w = Writer(FreshNames(set()), "onnxmp/optim")
    assert w.op("Mul", "a", "b", out="c") == "c"
    assert w.op("Neg", "c", what="neg") == "onnxmp/optim/neg"
    assert list(w.nodes[0].input) == ["a", "b"]


def test_loss_graph_names_nodes_as_their_outputs_and_keeps_constants_as_initializers():
    graph = helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], [])
    graph.node.append(helper.make_node("Identity", ["x"], ["onnxmp/loss/mse/diff"], name="taken"))
    g = LossGraph(graph, "mse")
    diff = g.op("Sub", "x", g.const("zero", 0.0), what="diff")
    assert diff == "onnxmp/loss/mse/diff_1" and graph.node[-1].name == diff
    assert [t.name for t in graph.initializer] == ["onnxmp/loss/mse/zero"]
    assert g.name("diff") == "onnxmp/loss/mse/diff_2"


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_update_graph_is_valid_onnx_under_the_training_build_limits(optimizer):
    from onnxmp.training._ort import MAX_IR_VERSION, MAX_OPSET

    model = build_portable_optimizer(optimizer, [("w", [2, 3]), ("b", [3])], 23, clip_global_norm=1.0)
    onnx.checker.check_model(model)
    assert model.ir_version <= MAX_IR_VERSION and model.opset_import[0].version <= MAX_OPSET
