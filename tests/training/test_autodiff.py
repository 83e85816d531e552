"""onnxmp's gradient builder as a whole (onnxmp.training.build.autodiff): the engine's walk (sums once,
no gradient through integer paths, frozen weights or nodes off the path), its errors, the lean
forms the rules promise, and gradient_graph's contract against onnxruntime-training's onnxblock
builder (on Python 3.11) and finite differences (on any Python)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxmp.errors import OnnxMPError
from onnxmp.training.build.autodiff import backward, gradient_graph
from onnxmp.training.losses import table_loss

from builders import needs_training_build


def parse(text: str, weights: dict[str, np.ndarray] | None = None, opset: int = 17) -> onnx.ModelProto:
    model = onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : {opset}]>\n' + text)
    for name, value in (weights or {}).items():
        model.graph.initializer.append(numpy_helper.from_array(value, name))
    return model


def run(model: onnx.ModelProto, feeds: dict, outputs: list[str]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds)


def added_ops(before: onnx.ModelProto, after: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in after.graph.node[len(before.graph.node):])


RNG = np.random.default_rng(0)
W = RNG.normal(size=(4, 4)).astype(np.float32)


def test_a_tensor_read_by_several_nodes_gets_one_sum():
    model = parse("""g (float[N, 4] x) => (float l) {
        a = MatMul(x, w)
        b = Tanh(a)
        c = Sigmoid(a)
        d = Exp(a)
        e = Sum(b, c, d)
        l = ReduceSum<keepdims=0>(e)
    }""", {"w": W})
    grad, _ = backward(model, "l", ["w"])
    sums = [n for n in grad.graph.node[len(model.graph.node):] if n.op_type == "Sum"]
    assert len(sums) == 1 and len(sums[0].input) == 3
    assert added_ops(model, grad)["Add"] == 0


def test_two_parameters_with_one_gradient_value_each_get_their_output():
    model = parse("""g (float[N, 4] x) => (float l) {
        s = Add(a, b)
        h = Mul(x, s)
        l = ReduceSum<keepdims=0>(h)
    }""", {"a": W[0].copy(), "b": W[1].copy()})
    grad, _ = backward(model, "l", ["a", "b"])
    x = RNG.normal(size=(3, 4)).astype(np.float32)
    ga, gb = run(grad, {"x": x}, ["a_grad", "b_grad"])
    np.testing.assert_allclose(ga, x.sum(axis=0), rtol=1e-6)
    np.testing.assert_allclose(gb, x.sum(axis=0), rtol=1e-6)


def test_integer_paths_frozen_weights_and_dead_branches_get_no_gradient():
    # The loss reads x's shape (an int path), a frozen weight f, and w; a branch from w that does not
    # reach the loss (dead) is not differentiated.
    model = parse("""g (float[N, 4] x) => (float l, float[N, 4] dead) {
        h = MatMul(x, w)
        s = Shape(h)
        n = Cast<to=1>(s)
        m = ReduceSum<keepdims=0>(n)
        k = Mul(h, f)
        t = ReduceSum<keepdims=0>(k)
        l = Mul(t, m)
        dead = Sigmoid(h)
    }""", {"w": W, "f": RNG.normal(size=(4,)).astype(np.float32)})
    grad, report = backward(model, "l", ["w"])
    assert [o.name for o in grad.graph.output][-1] == "w_grad"
    assert "f" in {t.name for t in grad.graph.initializer} and "f_grad" not in {o.name for o in grad.graph.output}
    assert "Sigmoid" not in report.ops and "Shape" not in report.ops and "Cast" not in report.ops
    assert set(report.ops) == {"MatMul", "Mul", "ReduceSum"}
    x = RNG.normal(size=(3, 4)).astype(np.float32)
    (got,) = run(grad, {"x": x}, ["w_grad"])
    f = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "f"))
    want = x.T @ np.broadcast_to(f * 7.0, (3, 4))  # d/dw sum((x @ w) * f) * (3 + 4)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_parameter_reached_only_through_integers_is_an_error():
    model = parse("""g (float[N, 4] x) => (float l) {
        h = MatMul(x, w)
        a = ArgMax<axis=1, keepdims=0>(h)
        b = Cast<to=1>(a)
        l = ReduceSum<keepdims=0>(b)
    }""", {"w": W})
    with pytest.raises(OnnxMPError, match="'w'.*no gradient|no gradient"):
        backward(model, "l", ["w"])


def test_an_op_without_a_rule_names_the_op_the_node_and_the_parameters_to_freeze():
    model = parse("""g (float[N, 4] x) => (float l) {
        h = MatMul(x, w)
        r = Relu(h)
        k = MatMul(r, v)
        d = LpNormalization<axis=1>(k)
        l = ReduceSum<keepdims=0>(d)
    }""", {"w": W, "v": W.copy()})
    model.graph.node[3].name = "the_norm"
    with pytest.raises(OnnxMPError) as err:
        backward(model, "l", ["w", "v"])
    text = str(err.value)
    assert "LpNormalization" in text and "ai.onnx" in text and "the_norm" in text
    assert "frozen" in text and "w" in text and "v" in text


def test_a_node_off_the_path_needs_no_rule():
    model = parse("""g (float[N, 4] x) => (float l, float[N, 4] other) {
        h = MatMul(x, w)
        l = ReduceSum<keepdims=0>(h)
        other = LpNormalization<axis=1>(h)
    }""", {"w": W})
    grad, report = backward(model, "l", ["w"])
    assert "LpNormalization" not in report.ops


def test_batched_matmul_weight_gradient_is_one_flattened_gemm():
    model = parse("""g (float[B, S, 4] x) => (float l) {
        h = MatMul(x, w)
        l = ReduceSum<keepdims=0>(h)
    }""", {"w": W})
    grad, report = backward(model, "l", ["w"])
    ops = added_ops(model, grad)
    assert ops["Gemm"] == 1 and ops["Flatten"] == 2 and ops["MatMul"] == 0
    # the only runtime shape: the loss's sum over symbolic dims, spread back by Expand
    assert "ReduceSum" not in ops and report.runtime_places == ["l: extents of the reduced axes of h"]
    x = RNG.normal(size=(2, 3, 4)).astype(np.float32)
    (got,) = run(grad, {"x": x}, ["w_grad"])
    np.testing.assert_allclose(got, x.reshape(-1, 4).T @ np.ones((6, 4), np.float32), rtol=1e-5)


def test_broadcasts_are_decided_from_symbolic_shapes_and_counted_where_they_cannot_be():
    static = parse("""g (float[B, S, 4] x) => (float l) {
        h = Add(x, b)
        l = ReduceSum<keepdims=0>(h)
    }""", {"b": np.zeros((1, 1, 4), np.float32)})
    grad, report = backward(static, "l", ["b"])
    assert not [p for p in report.runtime_places if "broadcast" in p]
    assert added_ops(static, grad)["ReduceSum"] == 1
    # b's first dim against x's symbolic one: b may be 1 (summed) or M == B (not) at run time.
    hidden = parse("""g (float[B, 4] x, float[M, 4] b) => (float l) {
        h = Add(x, b)
        l = ReduceSum<keepdims=0>(h)
    }""")
    grad, report = backward(hidden, "l", ["b"])
    assert len([p for p in report.runtime_places if "broadcast of b" in p]) == 1
    x = RNG.normal(size=(3, 4)).astype(np.float32)
    for rows in (1, 3):
        (got,) = run(grad, {"x": x, "b": np.zeros((rows, 4), np.float32)}, ["b_grad"])
        np.testing.assert_allclose(got, np.full((rows, 4), 3.0 / rows, np.float32))


def test_layer_normalization_reuses_the_forward_statistics():
    model = parse("""g (float[B, S, 4] x) => (float l) {
        y = LayerNormalization<axis=-1>(x, s, b)
        l = ReduceSum<keepdims=0>(y)
    }""", {"s": np.ones(4, np.float32), "b": np.zeros(4, np.float32)})
    grad, _ = backward(model, "l", ["s", "b"])
    forward = grad.graph.node[0]
    assert forward.op_type == "LayerNormalization" and len([o for o in forward.output if o]) == 3
    ops = added_ops(model, grad)
    assert ops["Sqrt"] == 0 and ops["ReduceMean"] == 0  # dS and dB need no statistics of their own


def test_conv_gradients_are_one_conv_transpose_and_one_conv_without_scaffolding():
    model = parse("""g (float[N, 2, 8, 8] x) => (float l) {
        y = Conv<strides=[2, 2], pads=[1, 1, 1, 1]>(x, w)
        l = ReduceSum<keepdims=0>(y)
    }""", {"w": RNG.normal(size=(3, 2, 3, 3)).astype(np.float32)})
    grad, report = backward(model, "l", ["x", "w"])
    ops = added_ops(model, grad)
    assert ops["ConvTranspose"] == 1 and ops["Conv"] == 1 and ops["Pad"] == 0 and ops["Slice"] == 0
    assert report.runtime_places == ["l: extents of the reduced axes of y"]  # the loss's sum, not the Conv


def test_low_precision_gradients_stay_low_until_the_cast_back_to_the_float32_master_weight():
    model = parse("""g (float16[N, 4] x) => (float16 l) {
        w16 = Cast<to=10>(w)
        h = MatMul(x, w16)
        l = ReduceSum<keepdims=0>(h)
    }""", {"w": W})
    grad, _ = backward(model, "l", ["w"])
    casts = [n for n in grad.graph.node[len(model.graph.node):] if n.op_type == "Cast"]
    assert [a.i for n in casts for a in n.attribute] == [TensorProto.FLOAT]
    assert grad.graph.output[-1].type.tensor_type.elem_type == TensorProto.FLOAT


def test_embedding_gradient_is_a_float32_scatter_add():
    model = parse("""g (int64[B, S] ids) => (float16 l) {
        e16 = Cast<to=10>(e)
        h = Gather(e16, ids)
        l = ReduceSum<keepdims=0>(h)
    }""", {"e": RNG.normal(size=(5, 3)).astype(np.float32)})
    grad, _ = backward(model, "l", ["e"])
    scatter = next(n for n in grad.graph.node if n.op_type == "ScatterND")
    assert helper.get_attribute_value(scatter.attribute[0]) == b"add"
    assert grad.opset_import[0].version >= 16
    ids = np.array([[0, 4, 4], [1, 4, 0]], np.int64)
    (got,) = run(grad, {"ids": ids}, ["e_grad"])
    np.testing.assert_array_equal(got[:, 0], np.bincount(ids.ravel(), minlength=5).astype(np.float32))


def test_training_mode_dropout_reuses_its_mask():
    model = parse("""g (float[N, 4] x) => (float l) {
        h = MatMul(x, w)
        d = Dropout(h, r, t)
        l = ReduceSum<keepdims=0>(d)
    }""", {"w": W, "r": np.array(0.5, np.float32), "t": np.array(True)})
    grad, _ = backward(model, "l", ["w"])
    dropout = next(n for n in grad.graph.node if n.op_type == "Dropout")
    assert len(dropout.output) == 2 and dropout.output[1]
    grad.graph.output.append(helper.make_tensor_value_info(dropout.output[1], TensorProto.BOOL, None))
    x = RNG.normal(size=(3, 4)).astype(np.float32)
    got, mask = run(grad, {"x": x}, ["w_grad", dropout.output[1]])
    np.testing.assert_allclose(got, x.T @ (mask * 2.0), rtol=1e-5)


def test_max_and_reduce_max_split_the_gradient_between_ties_as_torch_does():
    model = parse("""g (float[3] a, float[3] b) => (float l) {
        m = Max(a, b)
        r = ReduceMax<keepdims=0>(a)
        s = Add(m, r)
        l = ReduceSum<keepdims=0>(s)
    }""")
    grad, _ = backward(model, "l", ["a", "b"])
    a, b = np.array([1.0, 2.0, 2.0], np.float32), np.array([1.0, 3.0, 0.0], np.float32)
    ga, gb = run(grad, {"a": a, "b": b}, ["a_grad", "b_grad"])
    # torch: maximum gives ties half each; amax splits evenly among the tied maxima (2.0 twice) the
    # gradient of r, which is 3 (r is added to all three elements of m)
    np.testing.assert_allclose(ga, [0.5, 0.0 + 1.5, 1.0 + 1.5])
    np.testing.assert_allclose(gb, [0.5, 1.0, 0.0])


# --- gradient_graph: the onnxblock contract ----------------------------------------------------

def _mlp() -> onnx.ModelProto:
    from onnxmp.training.models import mlp

    return mlp((8, 16, 4), seed=0)


def _trainable(model):
    from onnxmp.training.models import trainable

    return trainable(model)


def _feeds(model: onnx.ModelProto, parameters, rows: int = 5) -> dict:
    rng = np.random.default_rng(3)
    feeds = {"labels": rng.integers(0, 4, rows).astype(np.int64), "loss_scale": np.array(1.0, np.float32),
             "lazy_reset_grad": np.array([True])}
    params = {t.name: numpy_helper.to_array(t) for group in parameters for t in group}
    for value in model.graph.input:
        if value.name in params:
            feeds[value.name] = params[value.name]
        elif value.name.endswith(".accumulation.buffer"):
            feeds[value.name] = np.zeros(params[value.name[:-len("_grad.accumulation.buffer")]].shape, np.float32)
        elif value.name not in feeds:
            feeds[value.name] = rng.normal(size=(rows, 8)).astype(np.float32)
    return {v.name: feeds[v.name] for v in model.graph.input}


def _gradients(training: onnx.ModelProto, feeds: dict, names: list[str]) -> dict[str, np.ndarray]:
    """The ``<P>_grad`` values, the accumulators left out (plain onnxruntime has no kernel for them)."""
    model = onnx.ModelProto()
    model.CopyFrom(training)
    graph = model.graph
    kept = [n for n in graph.node if n.op_type != "InPlaceAccumulatorV2"]
    graph.ClearField("node")
    graph.node.extend(kept)
    outputs = [o for o in graph.output if not o.name.endswith(".accumulation.out")]
    graph.ClearField("output")
    graph.output.extend(outputs + [helper.make_empty_tensor_value_info(f"{n}_grad") for n in names])
    inputs = [v for v in graph.input if not v.name.endswith(".accumulation.buffer") and v.name != "lazy_reset_grad"]
    graph.ClearField("input")
    graph.input.extend(inputs)
    feeds = {v.name: feeds[v.name] for v in inputs}
    return dict(zip(names, run(model, feeds, [f"{n}_grad" for n in names])))



@needs_training_build
def test_gradient_graph_has_onnxblocks_contract():
    from onnxmp.training.build.gradient import gradient_graph as ort_gradient_graph
    model = _mlp()
    names = _trainable(model)
    requires_grad, frozen = names[:-1], names[-1:]
    ours = gradient_graph(model, table_loss("cross_entropy"), "labels", requires_grad, frozen)
    theirs = ort_gradient_graph(model, table_loss("cross_entropy"), "labels", requires_grad, frozen)
    for mine, want in zip(ours[:2], theirs[:2]):
        assert [(v.name, v.type.tensor_type.elem_type) for v in mine.graph.input] == \
               [(v.name, v.type.tensor_type.elem_type) for v in want.graph.input]
        assert [v.name for v in mine.graph.output] == [v.name for v in want.graph.output]
    assert [[t.name for t in g] for g in ours[2]] == [[t.name for t in g] for g in theirs[2]]
    feeds = _feeds(ours[0], ours[2])
    got, want = _gradients(ours[0], feeds, requires_grad), _gradients(theirs[0], feeds, requires_grad)
    for name in requires_grad:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7)


def test_gradient_graph_matches_finite_differences_without_onnxruntime_training():
    model = _mlp()
    names = _trainable(model)
    training, evaluation, parameters = gradient_graph(model, table_loss("cross_entropy"), "labels", names, [])
    assert any(n.op_type == "InPlaceAccumulatorV2" for n in training.graph.node)
    assert [v.name for v in evaluation.graph.output] == ["loss_scaled", "loss"]
    feeds = _feeds(training, parameters)
    grads = _gradients(training, feeds, names)
    eval_feeds = {v.name: feeds[v.name] for v in evaluation.graph.input}
    session = ort.InferenceSession(evaluation.SerializeToString(), providers=["CPUExecutionProvider"])
    for name in names:
        value = eval_feeds[name].astype(np.float64)
        index = np.unravel_index(int(np.argmax(np.abs(grads[name]))), value.shape)
        losses = []
        for h in (1e-3, -1e-3):
            moved = value.copy()
            moved[index] += h
            losses.append(float(session.run(["loss"], {**eval_feeds, name: moved.astype(np.float32)})[0]))
        fd = (losses[0] - losses[1]) / 2e-3
        # float32 losses: the difference quotient is good to about 1e-4 / 1e-3
        assert abs(fd - grads[name][index]) <= 1e-2 * abs(grads[name][index]) + 1e-3, name


def test_gradient_graph_trains_dropout_and_evaluates_without_it():
    model = parse("""g (float[N, 4] x) => (float[N, 4] y) {
        h = MatMul(x, w)
        y = Dropout(h, r, t)
    }""", {"w": W, "r": np.array(0.5, np.float32), "t": np.array(True)})
    training, evaluation, _ = gradient_graph(model, table_loss("mse"), "target", ["w"], [])
    dropout = next(n for n in training.graph.node if n.op_type == "Dropout")
    assert dropout.input[2] == "t" and dropout.output[1]  # training mode, its mask reused
    assert next(n for n in evaluation.graph.node if n.op_type == "Dropout").input[2] == ""


def test_a_custom_loss_must_declare_its_label():
    model = _mlp()

    def forgetful(graph, output, label):
        graph.node.append(helper.make_node("ReduceMean", [output], ["l"], keepdims=0))
        return "l"

    # named by the function's name (not "LossWriter", the wrapper that checks it)
    with pytest.raises(OnnxMPError, match="loss block forgetful did not declare its label input"):
        gradient_graph(model, forgetful, "labels", _trainable(model), [])


def test_proven_gradient_shapes_skip_the_runtime_shape_check():
    """onnxmp's gradients have their parameters' shapes, which the symbolic shapes prove: the
    unscale reads no runtime Shape/Reshape for them.  A gradient whose shape the graph does not
    tell keeps the check (the Reshape that fails cleanly instead of writing past the buffer)."""
    from onnxmp.training.build.unscale import add_loss_scaling, proven_gradients
    from onnxmp.training.contract import GRAD_SHAPE

    model = _mlp()
    names = _trainable(model)
    training, _, _ = gradient_graph(model, table_loss("cross_entropy"), "labels", names, [])
    proven = proven_gradients(training)
    assert proven == {f"{n}_grad" for n in names}

    # A gradient read through an op of unknown shape (a domain onnx does not know) stays checked.
    first = f"{names[0]}_grad"
    unknown = onnx.ModelProto()
    unknown.CopyFrom(training)
    nodes = list(unknown.graph.node)
    at = next(i for i, n in enumerate(nodes) if first in n.output)
    nodes[at].output[list(nodes[at].output).index(first)] = "hidden"
    nodes.insert(at + 1, helper.make_node("Opaque", ["hidden"], [first], domain="example.unknown"))
    unknown.graph.ClearField("node")
    unknown.graph.node.extend(nodes)
    unknown.opset_import.append(helper.make_opsetid("example.unknown", 1))
    assert proven_gradients(unknown) == proven - {first}

    checked = onnx.ModelProto()
    checked.CopyFrom(training)
    add_loss_scaling(checked)
    add_loss_scaling(training, proven)
    shape_checks = [n for n in checked.graph.node if n.name.startswith(GRAD_SHAPE)]
    assert len(shape_checks) == len(names)
    assert not any(n.name.startswith(GRAD_SHAPE) or n.op_type == "Shape" and n.name.startswith("onnxmp/Shape/")
                   for n in training.graph.node)
    # the same accumulated gradients, checked or not (lowered: plain onnxruntime runs them)
    from onnxmp.training.build.lower import lower_model

    feeds = _feeds(training, gradient_graph(model, table_loss("cross_entropy"), "labels", names, [])[2])
    feeds["grad_weight"] = np.array(0.5, np.float32)
    outputs = [o.name for o in training.graph.output]
    want = run(lower_model(checked), feeds, outputs)
    got = run(lower_model(training), feeds, outputs)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w)
