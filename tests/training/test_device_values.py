"""The device_values stage: shape arithmetic that would feed device data computed on the device."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

from onnxmp.training.build.device_values import keep_on_device
from onnxmp.training.build.placement import place
from placement_graphs import divide_by_first_dim, parsed

ROOT = Path(__file__).resolve().parents[2]
_model = parsed


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    # onnx's reference evaluator: the CPU EP of onnxruntime 1.19 has no float64 ArgMax, CUDA's has
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)


def _rewritten(text: str, feeds: dict) -> tuple[dict, onnx.ModelProto]:
    model = _model(text)
    before = _run(model, feeds)
    found = keep_on_device(model)
    onnx.checker.check_model(model)
    for want, got in zip(before, _run(model, feeds)):
        np.testing.assert_array_equal(want, got)  # the same integers: the same numbers
    return found, model


MEAN = divide_by_first_dim()


def test_a_count_dividing_device_data_is_computed_on_the_device():
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    assert list(place(_model(MEAN)).copies) == ["f"]
    found, model = _rewritten(MEAN, {"x": x})
    assert found == {"rewritten": 1, "copies": 0}
    assert not place(model).copies and not place(model).feed
    assert {"ConstantOfShape", "ReduceSum"} <= {n.op_type for n in model.graph.node}


def test_the_last_dimension_of_a_tensor_of_unknown_rank_is_counted_on_the_device():
    # Slice(Shape(t), -1, INT64_MAX): no rank is needed, the picked CPU value sizes a ConstantOfShape
    text = """
    g (float[N, 4] x, int64[K] reps) => (float[N, 4] y) {
        t = Tile(x, reps)
        s = Shape(t)
        last = Constant<value = int64[1] {-1}>()
        end = Constant<value = int64[1] {9223372036854775807}>()
        n = Slice(s, last, end)
        f = Cast<to = 1>(n)
        r = Relu(x)
        y = Div(r, f)
    }"""
    model = _model(text)
    model.graph.value_info.clear()
    assert list(place(model).copies) == ["f"]
    found, _ = _rewritten(text, {"x": np.ones((3, 4), np.float32), "reps": np.array([1, 2], np.int64)})
    assert found == {"rewritten": 1, "copies": 0}


def test_a_size_is_multiplied_on_the_device():
    text = """
    g (float[N, M] x) => (float[N, M] y) {
        r = Relu(x)
        n = Size(r)
        f = Cast<to = 1>(n)
        y = Div(r, f)
    }"""
    found, model = _rewritten(text, {"x": np.ones((3, 5), np.float32)})
    assert found == {"rewritten": 1, "copies": 0}


def test_shapes_read_in_cpu_memory_are_left_alone():
    text = """
    g (float[N, 4] x) => (float[M] y) {
        r = Relu(x)
        s = Shape(r)
        zero = Constant<value = int64 {0}>()
        n = Gather<axis = 0>(s, zero)
        four = Constant<value = int64[1] {4}>()
        n1 = Unsqueeze(n, zero1)
        zero1 = Constant<value = int64[1] {0}>()
        shape = Concat<axis = 0>(n1, four)
        y = Reshape(r, shape)
    }""".replace("=> (float[M] y)", "=> (float[N, 4] y)")
    model = _model(text)
    nodes = len(model.graph.node)
    assert keep_on_device(model) == {"rewritten": 0, "copies": 0}
    assert len(model.graph.node) == nodes


ARGMAX = """
g (float[N, T] x, int64[N, T] ids) => (int64[N] last) {
    r = Relu(x)
    s = Shape(r)
    one = Constant<value = int64 {1}>()
    t = Gather<axis = 0>(s, one)
    zero = Constant<value = int64 {0}>()
    pos = Range(zero, t, one)
    pad = Constant<value = int64 {0}>()
    eq = Equal(ids, pad)
    keep = Not(eq)
    mask = Cast<to = 7>(keep)
    masked = Mul(pos, mask)
    last = ArgMax<axis = 1, keepdims = 0>(masked)
    %s
}"""


def test_an_argmax_over_positions_runs_on_the_device_in_float64():
    text = ARGMAX.replace("=> (int64[N] last)", "=> (int64[N] out)") % "ids0 = ReduceMin<axes = [1], keepdims = 0>(ids)\n    out = Add(last, ids0)"
    feeds = {"x": np.ones((2, 5), np.float32), "ids": np.array([[3, 4, 0, 0, 0], [5, 6, 7, 8, 0]], np.int64)}
    assert "last" in place(_model(text)).copies
    found, model = _rewritten(text, feeds)
    assert found["copies"] == 0 and found["rewritten"] >= 1


def test_an_argmax_over_arbitrary_integers_stays_on_the_cpu():
    # int64 data of any size: float64 need not hold it exactly, so nothing is rewritten
    text = """
    g (int64[N, T] ids) => (int64[N] out) {
        twice = Add(ids, ids)
        last = ArgMax<axis = 1, keepdims = 0>(twice)
        low = ReduceMin<axes = [1], keepdims = 0>(ids)
        out = Add(last, low)
    }"""
    model = _model(text)
    assert "last" in place(model).copies
    assert keep_on_device(model) == {"rewritten": 0, "copies": 1}


# -- the export matrix -------------------------------------------------------------------------------

sys.path.insert(0, str(ROOT / "scripts"))


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["deberta_v2.torchscript17", "wav2vec2.torchscript17"])
def test_gradients_are_the_same_with_and_without_the_stage(entry):
    import check_autodiff
    from onnxmp.training import contract
    from onnxmp.training.build import autodiff
    from onnxmp.training.build.lower import lower_model
    from onnxmp.training.losses import table_loss

    forward, requires_grad, frozen = check_autodiff.forward_of(entry, "float32", "cuda")
    training, _, parameters = autodiff.gradient_graph(forward, table_loss("cross_entropy"), "labels",
                                                      requires_grad, frozen, target="cuda")
    before = lower_model(training)
    after = onnx.ModelProto()
    after.CopyFrom(before)
    assert keep_on_device(after)["rewritten"] > 0
    grads = ["loss", *(contract.gradient_output(p) for p in requires_grad)]
    feeds = check_autodiff.feeds(entry, before, parameters, "float32")
    want = check_autodiff.execute(before, feeds, grads)
    got = check_autodiff.execute(after, feeds, grads)
    for name in grads:
        np.testing.assert_array_equal(want[name], got[name], err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["bert2.torchscript17", "gpt2.dynamo18", "deberta_v2.torchscript17",
                                   "wav2vec2.torchscript17", "t5_encoder.torchscript17"])
def test_the_cuda_training_graphs_copy_nothing_host_to_device(entry, tmp_path):
    import bench_builders

    artifacts, _ = bench_builders.build(entry, "onnxmp", "float16", "cuda", "adamw", tmp_path)
    for part in ("training_model", "eval_model"):
        placed = place(onnx.load(str(artifacts.portable_path(part))))
        assert not placed.copies and not placed.feed, (part, sorted(placed.copies))
        assert not placed.to_host, (part, sorted(placed.to_host))  # nor device to host (If's flag)


def test_the_stage_leaves_cpu_builds_alone():
    from onnxmp.training.build.pipeline import DeviceValues, TrainingBuild

    model = _model(MEAN)
    state = TrainingBuild(model, [], [], "cross_entropy", None, None, "float16", "cpu", Path("unused"))
    state.lowered_training, state.lowered_evaluation = model, model
    assert DeviceValues().call(state).modified is False
    assert list(place(model).copies) == ["f"]  # what a cuda build's stage would have rewritten
    state.target = "cuda"
    result = DeviceValues().call(state)
    assert result.modified and result.details["training"] == {"rewritten": 1, "copies": 0}
