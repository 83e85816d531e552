"""Each lowering of ORT's training ops (onnxmp/training/build/lower) against ORT's own kernel.

The oracle is onnxruntime-training 1.19.2's CPU kernel, run on a graph of the one node; the
lowered graph (standard ONNX ops) runs in the same session type.  ORT's CPU training kernels are
float32 only: float16 is checked against the float32 kernel on float16-rounded inputs (within
float16 rounding), bfloat16 by onnx's full check and a session of the lowered graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxmp.errors import OnnxMPError
from onnxmp.training.build.lower import LOWERINGS, check_lowered, lower_model

MS = "com.microsoft"
RNG = np.random.default_rng(0)


def normal(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@dataclass
class Case:
    op: str
    inputs: dict[str, np.ndarray]
    outputs: int = 1
    attrs: dict = field(default_factory=dict)
    floats: tuple[str, ...] = ()  # inputs that take the case's float type (default: every float32 input)
    domain: str = MS
    output_shapes: tuple = ()     # declared output shapes, where ORT's kernel reads them
    id: str = ""

    @property
    def float_inputs(self) -> tuple[str, ...]:
        return self.floats or tuple(k for k, v in self.inputs.items() if v.dtype == np.float32)


def _elem(array: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(array.dtype)


def _graph(case: Case, elem: int) -> onnx.ModelProto:
    """The case's one-node graph with its float inputs in ``elem``; outputs untyped unless declared."""
    floats = case.float_inputs
    inputs = [helper.make_tensor_value_info(k, elem if k in floats else _elem(v), list(v.shape))
              for k, v in case.inputs.items()]
    names = [f"out{i}" for i in range(case.outputs)]
    shapes = case.output_shapes or (None,) * case.outputs
    outputs = [helper.make_tensor_value_info(n, elem, s) if s is not None else onnx.ValueInfoProto(name=n)
               for n, s in zip(names, shapes)]
    node = helper.make_node(case.op, list(case.inputs), names, domain=case.domain, name=f"the_{case.op}",
                            **case.attrs)
    graph = helper.make_graph([node], "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                             ir_version=8)


def model_of(case: Case) -> onnx.ModelProto:
    """The float32 graph, its outputs declared as ORT's kernel makes them (the lowering reads them)."""
    model = _graph(case, TensorProto.FLOAT)
    results = _session(model).run(None, _feeds(case))
    for i, result in enumerate(results):
        model.graph.output[i].CopyFrom(helper.make_tensor_value_info(
            model.graph.output[i].name, helper.np_dtype_to_tensor_dtype(result.dtype), list(result.shape)))
    return model


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _feeds(case: Case, dtype=np.float32) -> dict[str, np.ndarray]:
    return {k: (v.astype(dtype) if v.dtype == np.float32 else v).copy() for k, v in case.inputs.items()}


def _close(want, got, rtol=1e-5, what=""):
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    assert want.shape == got.shape, what
    assert np.array_equal(np.isnan(want), np.isnan(got)), what
    scale = max(float(np.abs(np.nan_to_num(want)).max(initial=0)), 1e-30)
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=rtol, atol=rtol * scale, err_msg=what)


SHAPE = (3, 5)
ids = np.array([[1, 4, 1], [0, 4, 4]], np.int64)
CASES = [
    Case("GeluGrad", {"dY": normal(*SHAPE), "X": normal(*SHAPE) * 3}),
    Case("FastGeluGrad", {"dY": normal(*SHAPE), "X": normal(*SHAPE) * 3}),
    Case("BiasGeluGrad_dX", {"dY": normal(*SHAPE), "X": normal(*SHAPE), "B": normal(5)}),
    Case("QuickGeluGrad", {"dY": normal(*SHAPE), "X": normal(*SHAPE) * 3}, attrs={"alpha": 1.5}),
    Case("TanhGrad", {"dY": normal(*SHAPE), "Y": np.tanh(normal(*SHAPE))}),
    Case("SigmoidGrad", {"dY": normal(*SHAPE), "Y": 1 / (1 + np.exp(-normal(*SHAPE)))}),
    Case("DropoutGrad", {"dY": normal(*SHAPE), "mask": RNG.random(SHAPE) > 0.3, "ratio": np.array(0.3, np.float32),
                         "mode": np.array(True)}, floats=("dY",)),
    Case("DropoutGrad", {"dY": normal(*SHAPE), "mask": RNG.random(SHAPE) > 0.3, "ratio": np.array(0.3, np.float32),
                         "mode": np.array(False)}, floats=("dY",), id="training-mode-ignored"),
    Case("DropoutGrad", {"dY": normal(*SHAPE), "mask": RNG.random(SHAPE) > 0.5, "ratio": np.array(0.0, np.float16)},
         floats=("dY",), id="ratio0-float16-ratio"),
    Case("DropoutGrad", {"dY": normal(*SHAPE), "mask": RNG.random(SHAPE) > 0.5}, floats=("dY",), id="defaults"),
    Case("ReluGrad", {"dY": normal(*SHAPE), "X": np.maximum(normal(*SHAPE), 0)}, id="zeros-in-X"),
    Case("SoftmaxGrad_13", {"dY": normal(2, 3, 4), "Y": RNG.dirichlet(np.ones(4), (2, 3)).astype(np.float32)},
         id="default-axis"),
    Case("SoftmaxGrad_13", {"dY": normal(2, 3, 4), "Y": RNG.random((2, 3, 4)).astype(np.float32)},
         attrs={"axis": 1}),
    Case("SoftmaxGrad_13", {"dY": normal(2, 3, 4), "Y": RNG.random((2, 3, 4)).astype(np.float32)},
         attrs={"axis": -2}, id="negative-axis"),
    Case("SoftmaxGrad", {"dY": normal(2, 3, 4), "Y": RNG.random((2, 3, 4)).astype(np.float32)},
         attrs={"axis": 1}, id="coerced-2d"),
    Case("LogSoftmaxGrad_13", {"dY": normal(2, 3, 4), "Y": np.log(RNG.random((2, 3, 4))).astype(np.float32)},
         attrs={"axis": -1}),
    Case("LogSoftmaxGrad", {"dY": normal(2, 3, 4), "Y": np.log(RNG.random((2, 3, 4))).astype(np.float32)},
         attrs={"axis": 1}, id="coerced-2d"),
    Case("Scale", {"X": normal(*SHAPE), "scale": np.array([4.0], np.float32)}, floats=("X",)),
    Case("Scale", {"X": normal(*SHAPE), "scale": np.array(3.0, np.float32)}, attrs={"scale_down": 1},
         floats=("X",), id="down"),
    Case("Scale", {"X": normal(*SHAPE), "scale": np.array([3], np.int64)}, attrs={"scale_down": 1},
         floats=("X",), id="int64-scale"),
    Case("DivGrad", {"dY": normal(2, 3, 4), "A": normal(2, 3, 4), "B": normal(3, 1) + 3}, outputs=2,
         id="B-broadcast"),
    Case("DivGrad", {"dY": normal(2, 3, 4), "A": normal(4), "B": normal(2, 3, 4) + 3}, outputs=2, id="A-broadcast"),
    Case("DivGrad", {"dY": normal(2, 3), "A": normal(2, 3), "B": np.array(2.5, np.float32)}, outputs=2,
         id="scalar"),
    Case("BroadcastGradientArgs", {"a": np.array([2, 3, 4]), "b": np.array([3, 1])}, outputs=2),
    Case("BroadcastGradientArgs", {"a": np.array([1, 3, 1]), "b": np.array([5, 1, 4])}, outputs=2, id="ones"),
    Case("BroadcastGradientArgs", {"a": np.array([2, 3]), "b": np.array([2, 3])}, outputs=2, id="equal"),
    Case("BroadcastGradientArgs", {"a": np.array([3]), "b": np.array([1, 1, 3])}, outputs=2, id="leading-ones"),
    Case("BroadcastGradientArgs", {"a": np.array([1, 1]), "b": np.array([1])}, outputs=2, id="all-ones"),
    Case("BroadcastGradientArgs", {"a": np.array([1]), "b": np.array([5, 1])}, outputs=2, id="shorter-ones"),
    Case("BroadcastGradientArgs", {"a": np.array([], np.int64), "b": np.array([4, 2])}, outputs=2, id="scalar"),
    Case("ConcatTraining", {"a": normal(2, 3), "b": normal(2, 1), "c": normal(2, 4)}, outputs=2, attrs={"axis": 1}),
    Case("ConcatTraining", {"a": normal(2, 3), "b": normal(1, 3)}, outputs=2, attrs={"axis": -2},
         id="negative-axis"),
    Case("SplitTraining", {"x": normal(2, 7), "split": np.array([3, 4])}, outputs=2, attrs={"axis": -1}),
    Case("SplitTraining", {"x": normal(6, 2), "split": np.array([6])}, outputs=1, id="one-piece"),
    Case("ReduceSumTraining", {"x": normal(2, 3, 4), "axes": np.array([0, -1])}, attrs={"keepdims": 0}),
    Case("ReduceSumTraining", {"x": normal(2, 3), "axes": np.array([], np.int64)},
         attrs={"noop_with_empty_axes": 1}, id="noop"),
    Case("GatherGrad", {"shape": np.array([6, 4]), "indices": ids, "dY": normal(2, 3, 4)}, floats=("dY",),
         id="repeated-rows"),
    Case("GatherGrad", {"shape": np.array([2, 5, 3]), "indices": ids.astype(np.int32), "dY": normal(2, 2, 3, 3)},
         attrs={"axis": 1}, floats=("dY",), id="axis1-int32"),
    Case("GatherGrad", {"shape": np.array([2, 5]), "indices": np.array([4, -1, 0]), "dY": normal(2, 3)},
         attrs={"axis": -1}, floats=("dY",), id="negative-axis-and-index"),
    Case("GatherElementsGrad", {"dY": normal(3, 4), "shape": np.array([3, 5]),
                                "indices": RNG.integers(0, 5, (3, 4))}, attrs={"axis": -1}),
    Case("GatherNDGrad", {"shape": np.array([4, 3]), "indices": np.array([[1], [3], [1]]), "update": normal(3, 3)},
         floats=("update",)),
    Case("GatherNDGrad", {"shape": np.array([4, 3, 2]), "indices": np.array([[[1, 2], [3, 0]], [[1, 2], [0, 1]]]),
                          "update": normal(2, 2, 2)}, floats=("update",), id="depth2-repeated"),
    Case("GatherNDGrad", {"shape": np.array([2, 3]), "indices": np.array([[0, 2], [-1, 1], [0, -1]]),
                          "update": normal(3)}, floats=("update",), id="full-depth"),
    Case("SliceGrad", {"dY": normal(2, 2), "shape": np.array([4, 5]), "starts": np.array([1, 0]),
                       "ends": np.array([3, 5]), "axes": np.array([0, 1]), "steps": np.array([1, 3])},
         floats=("dY",)),
    Case("SliceGrad", {"dY": normal(2, 5), "shape": np.array([4, 5]), "starts": np.array([-1], np.int32),
                       "ends": np.array([-100], np.int32), "axes": np.array([0], np.int32),
                       "steps": np.array([-2], np.int32)}, floats=("dY",), id="negative-steps-int32"),
    Case("LayerNormalizationGrad", {"dY": normal(2, 3, 8), "X": np.concatenate([normal(2, 2, 8), np.zeros(
        (2, 1, 8), np.float32)], 1), "scale": normal(8), "_mean": None, "_inv_std": None}, outputs=3,
         attrs={"axis": -1, "epsilon": 1e-5}, id="with-constant-rows"),
    Case("LayerNormalizationGrad", {"dY": normal(2, 3, 4), "X": normal(2, 3, 4), "scale": normal(3, 4),
                                    "_mean": None, "_inv_std": None}, outputs=3, attrs={"axis": 1}, id="axis1"),
    Case("ConvGrad", {"dY": normal(2, 4, 3, 3), "X": normal(2, 2, 7, 7), "W": normal(4, 2, 3, 3)}, outputs=3,
         attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 0, 1]}, id="stride-not-dividing"),
    Case("ConvGrad", {"dY": normal(2, 6, 5, 5), "X": normal(2, 6, 5, 5), "W": normal(6, 1, 3, 3)}, outputs=3,
         attrs={"kernel_shape": [3, 3], "group": 6, "pads": [1, 1, 1, 1]}, id="depthwise"),
    Case("ConvGrad", {"dY": normal(1, 4, 4), "X": normal(1, 4, 9), "W": normal(4, 2, 2)}, outputs=2,
         attrs={"kernel_shape": [2], "group": 2, "dilations": [2], "strides": [2]}, id="1d-groups-dilated"),
    Case("SoftmaxCrossEntropyLossGrad", {"dY": np.array(1.7, np.float32), "log_prob": None,
                                         "label": np.array([1, 0, 3, 3])}, floats=("dY", "log_prob")),
    Case("SoftmaxCrossEntropyLossGrad", {"dY": np.array(0.3, np.float32), "log_prob": None,
                                         "label": np.array([1, -100, 3, -100])}, attrs={"ignore_index": -100},
         floats=("dY", "log_prob"), id="ignore-index"),
    Case("SoftmaxCrossEntropyLossGrad", {"dY": np.array(1.0, np.float32), "log_prob": None,
                                         "label": np.array([2, 0, 3, 1]), "weight": RNG.random(4).astype(np.float32)},
         attrs={"ignore_index": 0}, floats=("dY", "log_prob", "weight"), id="weights-ignore-index"),
    Case("SoftmaxCrossEntropyLossGrad", {"dY": np.array(0.3, np.float32), "log_prob": None,
                                         "label": np.array([-100, -100, -100, -100])}, attrs={"ignore_index": -100},
         floats=("dY", "log_prob"), id="every-label-ignored"),
    Case("SoftmaxCrossEntropyLossGrad", {"dY": np.array(1.5, np.float32),
                                         "log_prob": np.log(RNG.dirichlet(np.ones(3), (2, 2))).transpose(0, 2, 1).astype(
                                             np.float32), "label": np.array([[0, 2], [1, -1]])},
         attrs={"ignore_index": -1}, floats=("dY", "log_prob"), id="spatial-ignore-index"),
    Case("SoftmaxCrossEntropyLossGrad", {"dY": np.array(2.0, np.float32), "log_prob": None,
                                         "label": np.array([1, 0, 3, 3])}, attrs={"reduction": "sum"},
         floats=("dY", "log_prob"), id="sum"),
    Case("SoftmaxCrossEntropyLossGrad", {"dY": normal(4), "log_prob": None, "label": np.array([1, 0, 3, 3])},
         attrs={"reduction": "none"}, floats=("dY", "log_prob"), id="none"),
    Case("InPlaceAccumulatorV2", {"buffer": normal(3, 4), "value": normal(3, 4), "flag": np.array([False])}),
    Case("InPlaceAccumulatorV2", {"buffer": normal(3, 4), "value": normal(3, 4), "flag": np.array([True])},
         id="overwrite"),
    Case("InPlaceAccumulatorV2", {"buffer": normal(3, 4), "value": normal(3, 4)}, id="no-flag"),
]
_logits = normal(4, 4) * 2
_log_prob = (_logits - np.log(np.exp(_logits).sum(1, keepdims=True))).astype(np.float32)
for case in CASES:
    if case.op == "SoftmaxCrossEntropyLossGrad" and case.inputs["log_prob"] is None:
        case.inputs["log_prob"] = _log_prob
    if case.op == "LayerNormalizationGrad":
        x = case.inputs["X"]
        axes = tuple(range(case.attrs["axis"] % x.ndim, x.ndim))
        mean = x.mean(axes, keepdims=True)
        case.inputs = {**{k: v for k, v in case.inputs.items() if not k.startswith("_")}, "mean": mean,
                       "inv_std": (1 / np.sqrt(x.var(axes, keepdims=True) + 1e-5)).astype(np.float32)}
        case.floats = ("dY", "X", "scale")
    if case.op == "ConvGrad":
        case.output_shapes = (case.inputs["X"].shape, case.inputs["W"].shape, (case.inputs["W"].shape[0],))[
            :case.outputs]


def _id(case: Case) -> str:
    return f"{case.op}-{case.id}" if case.id else case.op


def _native_and_lowered(case: Case):
    model = model_of(case)
    if case.op == "InPlaceAccumulatorV2":  # the kernel's optional second output is the accumulated buffer
        model.graph.node[0].output.append("accumulated")
        model.graph.output.append(helper.make_tensor_value_info("accumulated", TensorProto.FLOAT, None))
    lowered = lower_model(model)
    return model, lowered


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_lowering_equals_ort_kernel(case):
    model, lowered = _native_and_lowered(case)
    assert not any(n.domain == MS for n in lowered.graph.node), "the lowering fired"
    check_lowered(lowered)
    onnx.checker.check_model(lowered, full_check=True)
    want = _session(model).run(None, _feeds(case))
    got = _session(lowered).run(None, _feeds(case))
    if case.op == "InPlaceAccumulatorV2":  # the portable contract: the output is the new buffer
        _close(want[1], got[0], what="new buffer")
        assert lowered.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
        return
    for i, (w, g) in enumerate(zip(want, got)):
        _close(w, g, what=f"output {i}")


# BroadcastGradientArgs has no float input; the accumulator's buffers are float32 master gradients.
LOW_CASES = [c for c in CASES if c.op not in ("InPlaceAccumulatorV2", "BroadcastGradientArgs")]


@pytest.mark.parametrize("case", LOW_CASES, ids=_id)
def test_lowering_in_float16_matches_the_float32_kernel(case):
    """float16 in and out, against ORT's float32 kernel on the same (rounded) inputs."""
    rounded = Case(case.op, {k: (v.astype(np.float16).astype(np.float32) if v.dtype == np.float32 else v)
                             for k, v in case.inputs.items()}, case.outputs, case.attrs, case.floats,
                   output_shapes=case.output_shapes)
    want = _session(model_of(rounded)).run(None, _feeds(rounded))
    lowered = lower_model(_low_model(case, TensorProto.FLOAT16))
    check_lowered(lowered)
    onnx.checker.check_model(lowered, full_check=True)
    floats = case.float_inputs
    feeds = {k: (v.astype(np.float16) if k in floats else v) for k, v in _feeds(rounded).items()}
    if case.op == "ConvGrad":
        return  # ORT's CPU build has no float16 Conv/ConvTranspose: checked, not run (CUDA runs it)
    got = _session(lowered).run(None, feeds)
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.dtype == (np.float16 if w.dtype == np.float32 else w.dtype), f"output {i}"
        _close(w, g, rtol=4e-3, what=f"output {i}")


@pytest.mark.parametrize("case", LOW_CASES, ids=_id)
def test_lowering_in_bfloat16_is_valid(case):
    lowered = lower_model(_low_model(case, TensorProto.BFLOAT16))
    check_lowered(lowered)
    onnx.checker.check_model(lowered, full_check=True)
    floats = case.float_inputs
    for value in lowered.graph.output:
        if value.type.tensor_type.elem_type in (TensorProto.FLOAT, TensorProto.FLOAT16):
            pytest.fail(f"{value.name} left bfloat16")
    if case.op != "ConvGrad":
        _session(lowered)  # the CPU build has the kernels of every lowered node in bfloat16
    assert any(i.type.tensor_type.elem_type == TensorProto.BFLOAT16 for i in lowered.graph.input if i.name in floats)


def _low_model(case: Case, elem: int) -> onnx.ModelProto:
    """The case's graph in ``elem``, its outputs typed as in the float32 graph with float moved to ``elem``."""
    low = _graph(case, elem)
    for value, ref in zip(low.graph.output, model_of(case).graph.output):
        t = ref.type.tensor_type.elem_type
        value.CopyFrom(ref)
        value.type.tensor_type.elem_type = elem if t == TensorProto.FLOAT else t
    return low


def test_every_lowering_has_a_case():
    assert {c.op for c in CASES} | {"MaxPoolGrad"} == set(LOWERINGS)


@pytest.mark.parametrize("op", sorted(LOWERINGS))
def test_a_lowering_fires_only_on_its_op_in_com_microsoft(op):
    # The same op type in another domain is not ORT's op: no lowering takes it, it is refused by name.
    case = next((c for c in CASES if c.op == op), None)
    node = helper.make_node(op, ["x"], ["y"], domain="org.example", name="mine")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("org.example", 1)])
    with pytest.raises(OnnxMPError, match=rf"org.example:{op} \(node 'mine'\)"):
        lower_model(model)
    assert case is not None or op == "MaxPoolGrad"


def test_standard_and_registered_ops_stay_as_they_are():
    graph = helper.make_graph(
        [helper.make_node("FusedMatMul", ["a", "b"], ["c"], domain=MS, name="mm", transB=1),
         helper.make_node("Gelu", ["c"], ["d"], domain=MS, name="gelu"),
         helper.make_node("Relu", ["d"], ["e"], name="relu")], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in "ab"],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    lowered = lower_model(model)
    assert lowered.graph.node == model.graph.node and lowered.opset_import == model.opset_import


def test_an_unknown_training_op_is_a_named_error():
    node = helper.make_node("YieldOp", ["x"], ["y"], domain=MS, name="yield_0")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    with pytest.raises(OnnxMPError, match=r"com.microsoft:YieldOp \(node 'yield_0'\)"):
        lower_model(model)


def test_an_ai_onnx_op_onnx_does_not_define_is_a_named_error():
    node = helper.make_node("AveragePoolGrad", ["x"], ["y"], name="pool_grad")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(OnnxMPError, match=r"cannot lower AveragePoolGrad \(node 'pool_grad'\)"):
        lower_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_lowering_walks_subgraphs():
    inner = helper.make_graph([helper.make_node("TanhGrad", ["dy", "y"], ["dx"], domain=MS, name="inner")], "body",
                              [], [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [3])])
    outer = helper.make_graph(
        [helper.make_node("If", ["c"], ["out"], name="if", then_branch=inner, else_branch=inner)], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("dy", TensorProto.FLOAT, [3]), helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3])])
    model = helper.make_model(outer, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                              ir_version=8)
    lowered = lower_model(model)
    check_lowered(lowered)
    dy, y = normal(3), np.tanh(normal(3))
    want = _session(model).run(None, {"c": np.array(True), "dy": dy, "y": y})[0]
    got = _session(lowered).run(None, {"c": np.array(True), "dy": dy, "y": y})[0]
    _close(want, got)


def _accumulators(count: int, second_flag: bool = False) -> onnx.ModelProto:
    nodes, inputs, outputs = [], [], []
    for i in range(count):
        flag = "flag2" if second_flag and i == count - 1 else "flag"
        nodes.append(helper.make_node("InPlaceAccumulatorV2", [f"buffer{i}", f"value{i}", flag], [f"out{i}"],
                                      domain=MS))
        inputs += [helper.make_tensor_value_info(f"buffer{i}", TensorProto.FLOAT, [3, i + 1]),
                   helper.make_tensor_value_info(f"value{i}", TensorProto.FLOAT, [3, i + 1])]
        outputs.append(helper.make_tensor_value_info(f"out{i}", TensorProto.BOOL, [1]))
    inputs += [helper.make_tensor_value_info(f, TensorProto.BOOL, [1]) for f in ("flag", "flag2")[:1 + second_flag]]
    graph = helper.make_graph(nodes, "accumulate", inputs, outputs)
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])


@pytest.mark.parametrize("reset", [True, False])
def test_accumulators_sharing_the_reset_flag_are_one_if(reset):
    model = _accumulators(3)
    lowered = lower_model(model)
    check_lowered(lowered)
    onnx.checker.check_model(lowered, full_check=True)
    assert [n.op_type for n in lowered.graph.node].count("If") == 1
    assert not {"Where", "Add"} & {n.op_type for n in lowered.graph.node}
    # the If reads the [1] flag itself: no device-side Reshape whose result the CUDA EP copies to the host
    assert next(n for n in lowered.graph.node if n.op_type == "If").input[0] == "flag"
    rng = np.random.default_rng(0)
    feeds = {v.name: rng.normal(size=(3, i // 2 + 1)).astype(np.float32)
             for i, v in enumerate(model.graph.input) if v.name != "flag"}
    feeds["flag"] = np.array([reset])
    got = _session(lowered).run(None, feeds)
    for i, value in enumerate(got):
        want = feeds[f"value{i}"] if reset else feeds[f"buffer{i}"] + feeds[f"value{i}"]
        _close(want, value, what=f"out{i}")
        assert value.dtype == np.float32


def test_a_lone_accumulator_or_another_flag_is_lowered_on_its_own():
    for model, ifs in ((_accumulators(1), 0), (_accumulators(3, second_flag=True), 1)):
        lowered = lower_model(model)
        check_lowered(lowered)
        ops = [n.op_type for n in lowered.graph.node]
        assert ops.count("If") == ifs and ops.count("Where") == 1


@pytest.mark.parametrize("reset", [True, False])
def test_an_unscale_read_by_its_accumulator_alone_moves_into_the_if(reset):
    """value = raw * scale, read by the accumulator only: multiplied inside the If's branches; a
    product read elsewhere too stays where it was."""
    model = _accumulators(3)
    graph = model.graph
    for i in range(3):
        graph.node.insert(0, helper.make_node("Mul", [f"raw{i}", "scale"], [f"value{i}"]))
        graph.input.append(helper.make_tensor_value_info(f"raw{i}", TensorProto.FLOAT, [3, i + 1]))
    graph.input.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT, []))
    kept = [v for v in graph.input if not v.name.startswith("value")]
    graph.ClearField("input")
    graph.input.extend(kept)
    graph.output.append(helper.make_tensor_value_info("value2", TensorProto.FLOAT, [3, 3]))  # read elsewhere
    lowered = lower_model(model)
    check_lowered(lowered)
    onnx.checker.check_model(lowered, full_check=True)
    top = [n.op_type for n in lowered.graph.node]
    assert top.count("Mul") == 1 and top.count("If") == 1
    rng = np.random.default_rng(0)
    feeds = {v.name: rng.normal(size=[d.dim_value for d in v.type.tensor_type.shape.dim]).astype(np.float32)
             for v in model.graph.input if v.name != "flag"}
    feeds["flag"] = np.array([reset])
    got = _session(lowered).run([f"out{i}" for i in range(3)], feeds)
    for i, value in enumerate(got):
        product = feeds[f"raw{i}"] * feeds["scale"]
        _close(product if reset else feeds[f"buffer{i}"] + product, value, what=f"out{i}")
