"""The table's losses against torch: values and parameter gradients of a tiny model ``x @ W + b``.

The references (tests/training/data/loss_references.npz) are torch's and Hugging Face's, written by
scripts/make_training_references.py; each loss has a case where its special path fires (ignored
labels, confident or zero logits, pos_weight) and one where it does not.  Each runs through both
gradient builders where onnxruntime-training installs, through onnxmp's elsewhere.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxmp.errors import OnnxMPError
from onnxmp.training import build_artifacts
from onnxmp.training import losses as losses_module
from onnxmp.training.labels import check_labels

from builders import HERE, needs_training_build

REFERENCES = np.load(Path(__file__).parent / "data" / "loss_references.npz")
CASES = sorted({key.split("/")[0] for key in REFERENCES.files} - {"custom_token_loss"})
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "token_loss.py"


def tiny_model(x: np.ndarray, w: np.ndarray, b: np.ndarray, batch: str = "N") -> onnx.ModelProto:
    x_shape = [batch, *x.shape[1:]]
    out_shape = [batch, *x.shape[1:-1], w.shape[1]]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
         helper.make_node("Add", ["xw", "b"], ["out"], name="add")],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, out_shape)],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def case(name: str) -> dict[str, np.ndarray]:
    return {key.split("/")[1]: REFERENCES[key] for key in REFERENCES.files if key.split("/")[0] == name}


def loss_of(name: str, data: dict):
    table = next(loss for loss in losses_module.LOSSES if name.startswith(loss))
    options = {"pos_weight": data["pos_weight"]} if "pos_weight" in data else {}
    return table, losses_module.table_loss(table, **options) if options else table


def run_training_graph(artifacts, x, labels):
    """The loss and the parameter gradients of one micro-step, read from onnxruntime's checkpoint state."""
    from onnxmp.training import _ort

    api = _ort.api()
    state = api.CheckpointState.load_checkpoint(str(artifacts.checkpoint))
    module = api.Module(str(artifacts.training_model), state, str(artifacts.eval_model))
    module.train()
    label = artifacts.manifest["label_input"]
    feeds = {"x": x, label: np.asarray(labels, dtype=artifacts.manifest["input_dtypes"][label]),
             "loss_scale": np.array(1.0, np.float32), "grad_weight": np.array(1.0, np.float32)}
    outputs = module(*[feeds[name] for name in module.input_names()])
    loss = float(outputs[module.output_names().index("loss")])
    grads = {name: np.array(state.parameters[name].grad) for name in ("W", "b")}
    module.eval()
    eval_feeds = [feeds[name] for name in module.input_names()]
    eval_loss = float(module(*eval_feeds)[module.output_names().index("loss")])
    return loss, grads, eval_loss


def run_portable_graph(artifacts, x, labels, state):
    """The same micro-step through the artifacts' portable training graph on a plain InferenceSession:
    the loss and the new accumulation buffers, which hold the gradients after a reset."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(artifacts.portable_path("training_model")),
                                           providers=["CPUExecutionProvider"])
    label = artifacts.manifest["label_input"]
    feeds = {"x": x, label: np.asarray(labels, dtype=artifacts.manifest["input_dtypes"][label]),
             "loss_scale": np.array(1.0, np.float32), "grad_weight": np.array(1.0, np.float32),
             "lazy_reset_grad": np.array([True]), **state,
             **{f"{p}_grad.accumulation.buffer": np.zeros_like(v) for p, v in state.items()}}
    outputs = dict(zip([o.name for o in session.get_outputs()],
                       session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})))
    return float(outputs["loss"]), {p: outputs[f"{p}_grad.accumulation.out"] for p in state}


def one_step(artifacts, data, labels):
    """(loss, gradients) of one micro-step: always the portable graph, and where ORT's builder made the
    folder the native one too (its eval loss checked equal), which the portable one must agree with."""
    loss, grads = run_portable_graph(artifacts, data["x"], labels, {"W": data["W"], "b": data["b"]})
    if artifacts.has_native:
        native_loss, native_grads, eval_loss = run_training_graph(artifacts, data["x"], labels)
        assert (math.isnan(native_loss) and math.isnan(eval_loss)) or eval_loss == pytest.approx(native_loss, rel=1e-6)
        assert (math.isnan(loss) and math.isnan(native_loss)) or loss == pytest.approx(native_loss, rel=1e-5)
        for param in ("W", "b"):
            np.testing.assert_allclose(grads[param], native_grads[param], rtol=1e-4, atol=1e-6, err_msg=param)
    return loss, grads


@pytest.mark.parametrize("builder", HERE)
@pytest.mark.parametrize("name", CASES)
def test_loss_value_and_gradients_equal_torch(tmp_path, name, builder):
    data = case(name)
    table, loss = loss_of(name, data)
    artifacts = build_artifacts(tiny_model(data["x"], data["W"], data["b"]), requires_grad=["W", "b"], loss=loss,
                                precision="float32", optimizer="sgd", out_dir=tmp_path / "a", builder=builder)
    assert artifacts.manifest["loss"] == table and artifacts.builder == builder
    labels = check_labels(table, data["labels"], rows=len(data["x"]), shape=artifacts.manifest["output_shape"],
                          options=artifacts.manifest["loss_options"])
    loss_value, grads = one_step(artifacts, data, labels)
    if math.isnan(float(data["loss"])):  # every label ignored: torch's NaN, and zero gradients
        assert math.isnan(loss_value)
    else:
        assert loss_value == pytest.approx(float(data["loss"]), rel=1e-5, abs=1e-6)
    for param in ("W", "b"):
        np.testing.assert_allclose(grads[param], data[f"grad_{param}"], rtol=1e-4, atol=1e-6, err_msg=param)


def test_the_references_exercise_what_they_claim():
    # The special paths fire in their cases and not in the plain ones.
    assert (case("cross_entropy_tokens_ignored")["labels"] == -100).any()
    assert not (case("cross_entropy_tokens")["labels"] == -100).any()
    tokens = case("cross_entropy_tokens")
    assert tokens["x"].shape[1] == tokens["W"].shape[1]  # S == V, the case the old loss got wrong silently
    confident = case("bce_with_logits_confident")
    assert float(confident["loss"]) == pytest.approx(10.0) and np.abs(confident["b"]).min() == 20
    zero = case("bce_with_logits_zero_logits")
    assert not np.any(zero["W"]) and not np.any(zero["b"]) and np.any(zero["grad_b"])


@pytest.mark.parametrize("builder", HERE)
def test_worked_custom_loss_equals_torch_and_loads_like_the_cli(tmp_path, builder):
    data = case("custom_token_loss")
    function = losses_module.resolve_loss(f"{EXAMPLE}:token_loss")
    artifacts = build_artifacts(tiny_model(data["x"], data["W"], data["b"]), requires_grad=["W", "b"],
                                loss=function, precision="float32", optimizer="sgd", out_dir=tmp_path / "a",
                                builder=builder)
    assert artifacts.manifest["loss"] == "token_loss" and artifacts.inputs == ["x", "labels"]
    loss_value, grads = one_step(artifacts, data, data["labels"])
    assert loss_value == pytest.approx(float(data["loss"]), rel=1e-5)
    np.testing.assert_allclose(grads["W"], data["grad_W"], rtol=1e-4, atol=1e-6)
    # The string spelling works in build_artifacts too, and custom losses get the generic label checks.
    again = build_artifacts(tiny_model(data["x"], data["W"], data["b"]), requires_grad=["W", "b"],
                            loss=f"{EXAMPLE}:token_loss", precision="float32", out_dir=tmp_path / "b",
                            builder=builder)
    assert again.manifest["loss"] == "token_loss"
    assert check_labels(f"{EXAMPLE}:token_loss", data["labels"], rows=2, shape=[None, 5, 6]) is not None


@needs_training_build
def test_the_block_form_of_the_worked_loss_still_builds(tmp_path):
    data = case("custom_token_loss")
    block = losses_module.resolve_loss(f"{EXAMPLE}:token_loss_block")
    assert type(block).__name__ == "SmoothedTokenLoss"
    for builder in HERE:  # onnxmp's builder runs a Block too, where onnxblock installs
        artifacts = build_artifacts(tiny_model(data["x"], data["W"], data["b"]), requires_grad=["W", "b"],
                                    loss=block, precision="float32", optimizer="sgd", out_dir=tmp_path / builder,
                                    builder=builder)
        assert artifacts.manifest["loss"] == "SmoothedTokenLoss"
        loss_value, grads = one_step(artifacts, data, data["labels"])
        assert loss_value == pytest.approx(float(data["loss"]), rel=1e-5)
        np.testing.assert_allclose(grads["W"], data["grad_W"], rtol=1e-4, atol=1e-6)


def test_resolve_loss_spellings_and_errors(tmp_path, monkeypatch):
    assert losses_module.resolve_loss("causal_lm") == "causal_lm"
    (tmp_path / "i29_my_losses.py").write_text(EXAMPLE.read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    function = losses_module.resolve_loss("i29_my_losses:token_loss")  # module:function: the loss itself
    assert function.__name__ == "token_loss"
    assert losses_module.resolve_loss(function) is function
    with pytest.raises(OnnxMPError, match="unknown loss 'crossentropy'"):
        losses_module.resolve_loss("crossentropy")
    with pytest.raises(OnnxMPError, match="no loss file"):
        losses_module.resolve_loss(str(tmp_path / "missing.py") + ":f")
    with pytest.raises(OnnxMPError, match="cannot import the loss module"):
        losses_module.resolve_loss("no_such_module_i29:f")
    with pytest.raises(OnnxMPError, match="has no 'nothing'"):
        losses_module.resolve_loss(f"{EXAMPLE}:nothing")
    bad = tmp_path / "bad.py"
    bad.write_text("def not_a_loss():\n    return 3\n")  # a factory (no arguments) of something else
    from onnxmp.training.build.loss_forms import loss_writer

    with pytest.raises(OnnxMPError, match="unsupported loss 3"):
        loss_writer(f"{bad}:not_a_loss")


@needs_training_build
def test_a_custom_block_must_declare_its_label(tmp_path):
    ob = losses_module.onnxblock()

    class Forgetful(ob.Block):
        def build(self, output, label):
            g = losses_module.LossGraph(self.base.graph, "forgetful")
            return g.op("ReduceMean", g.op("Sub", output, label), keepdims=0)

    data = case("mse_plain")
    with pytest.raises(OnnxMPError, match="did not declare its label input 'labels'"):
        build_artifacts(tiny_model(data["x"], data["W"], data["b"]), requires_grad=["W", "b"], loss=Forgetful(),
                        precision="float32", out_dir=tmp_path / "a")


@pytest.mark.parametrize("loss,shape,message", [
    ("causal_lm", (6, 3), "causal_lm loss needs \\[batch, sequence, vocab\\] logits"),
    ("cross_entropy", (6,), "cross_entropy loss needs logits with the classes on the last axis"),
])
def test_an_output_the_loss_cannot_read_is_refused_at_build_time(tmp_path, loss, shape, message):
    x = np.zeros((2, *shape[1:-1], 3) if len(shape) > 1 else (2, 3), np.float32)
    w = np.zeros((3, shape[-1] if len(shape) > 1 else 1), np.float32)
    model = tiny_model(x, w, np.zeros(w.shape[1], np.float32))
    if len(shape) == 1:  # squeeze the output to rank 1
        model.graph.node.append(helper.make_node("Flatten", ["out"], ["flat"], axis=0))
        model.graph.output[0].CopyFrom(helper.make_tensor_value_info("flat", TensorProto.FLOAT, [1, None]))
        model.graph.node.append(helper.make_node("Reshape", ["flat", "minus1"], ["vec"]))
        model.graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), "minus1"))
        model.graph.output[0].CopyFrom(helper.make_tensor_value_info("vec", TensorProto.FLOAT, [None]))
    with pytest.raises(OnnxMPError, match=message):
        build_artifacts(model, requires_grad=["W"], loss=loss, precision="float32", out_dir=tmp_path / "a")


def test_class_id_labels_with_the_ignore_index():
    shape = [None, 5, 7]
    labels = np.array([[1, 2, -100, -100, 6]])
    assert check_labels("causal_lm", labels, rows=1, shape=shape).dtype == np.int64
    assert check_labels("cross_entropy", labels, rows=1, shape=shape).dtype == np.int64
    with pytest.raises(OnnxMPError, match="class id -1, outside \\[0, 7\\).*not the ignore index -100"):
        check_labels("cross_entropy", np.array([[1, 2, -1, 3, 4]]), rows=1, shape=shape)
    # Another ignore index, as the manifest's loss_options record it.
    assert check_labels("cross_entropy", np.array([[1, 2, -1, 3, 4]]), rows=1, shape=shape,
                        options={"ignore_index": -1}) is not None
    with pytest.raises(OnnxMPError, match="class id -100"):
        check_labels("cross_entropy", labels, rows=1, shape=shape, options={"ignore_index": -1})


def test_labels_in_torchs_layout_are_refused_not_computed_over_the_wrong_axis():
    # A head with the classes on axis 1 ([B, C, S] = [2, 7, 5]) and [B, S] labels: torch's layout.
    with pytest.raises(OnnxMPError, match="classes on the last axis") as info:
        check_labels("cross_entropy", np.zeros((2, 5), np.int64), rows=2, shape=[None, 7, 5])
    assert "transpose" in info.value.hint
    with pytest.raises(OnnxMPError, match="one class id per position"):
        check_labels("cross_entropy", np.zeros((2, 5, 7), np.int64), rows=2, shape=[None, 5, 7])


def test_labels_with_other_positions_fail_at_the_first_step(tmp_path):
    from onnxmp.training import Trainer
    from onnxmp.training.labels import label_run_error

    data = case("cross_entropy_tokens")
    model = tiny_model(data["x"], data["W"], data["b"])
    for value in (*model.graph.input, *model.graph.output):  # a dynamic sequence axis
        value.type.tensor_type.shape.dim[1].dim_param = "S"
    artifacts = build_artifacts(model, requires_grad=["W", "b"], precision="float32", out_dir=tmp_path / "a")
    trainer = Trainer(artifacts)
    short = data["labels"][:, :3]  # 3 labels for 5 positions: GatherElements alone would read a prefix
    with pytest.raises(OnnxMPError) as info:
        trainer.train_step(data["x"], short)
    # The Trainer turns onnxruntime's error in the labels_like_logits check into the batch's fault.
    assert "do not have the logits' positions" in str(info.value) and "a batch is x, labels" in str(info.value)
    assert label_run_error("onnxruntime failed in a Reshape node 'onnxmp/loss/causal_lm/labels_like_logits'") \
        is not None and label_run_error("onnxruntime failed in a MatMul node 'm'") is None
    assert trainer.train_step(data["x"], data["labels"]).stepped


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_causal_lm_and_confident_bce_train_in_low_precision(tmp_path, precision):
    from onnxmp.training import Trainer

    data = case("causal_lm_tokens_ignored")
    artifacts = build_artifacts(tiny_model(data["x"], data["W"], data["b"]), requires_grad=["W", "b"],
                                loss="causal_lm", precision=precision, out_dir=tmp_path / "lm")
    result = Trainer(artifacts).train_step(data["x"], data["labels"])
    assert result.stepped and result.loss == pytest.approx(float(data["loss"]), rel=2e-2)
    data = case("bce_with_logits_confident")
    artifacts = build_artifacts(tiny_model(data["x"], data["W"], data["b"]), requires_grad=["W", "b"],
                                loss="bce_with_logits", precision=precision, out_dir=tmp_path / "bce")
    result = Trainer(artifacts).train_step(data["x"], data["labels"])
    assert result.stepped and result.loss == pytest.approx(10.0, rel=1e-3)  # ORT's block: NaN, every step skipped


def test_loss_options_are_checked_and_recorded(tmp_path):
    with pytest.raises(OnnxMPError, match="the mse loss has no option ignore_index"):
        losses_module.table_loss("mse", ignore_index=1)
    with pytest.raises(OnnxMPError, match="pos_weight must be"):
        losses_module.table_loss("bce_with_logits", pos_weight=[[1.0]])
    data = case("cross_entropy_rows")
    artifacts = build_artifacts(tiny_model(data["x"], data["W"], data["b"]), requires_grad=["W", "b"],
                                loss=losses_module.table_loss("cross_entropy", ignore_index=3), precision="float32",
                                out_dir=tmp_path / "a")
    assert artifacts.manifest["loss"] == "cross_entropy"
    assert artifacts.manifest["loss_options"] == {"ignore_index": 3}


@needs_training_build
def test_the_table_block_of_before_is_still_taken(tmp_path):
    data = case("cross_entropy_rows")
    artifacts = build_artifacts(tiny_model(data["x"], data["W"], data["b"]), requires_grad=["W", "b"],
                                loss=losses_module.block("cross_entropy", ignore_index=3), precision="float32",
                                out_dir=tmp_path / "a")
    assert artifacts.manifest["loss"] == "cross_entropy"
    assert artifacts.manifest["loss_options"] == {"ignore_index": 3}


def test_a_batch_with_every_label_ignored_trains_on_as_torch_does(tmp_path):
    # torch: loss NaN, gradients zero, and the optimizer steps; the scaler sees finite gradients.
    from onnxmp.training import DynamicLossScaler, Trainer

    data = case("cross_entropy_all_ignored")
    artifacts = build_artifacts(tiny_model(data["x"], data["W"], data["b"]), requires_grad=["W", "b"],
                                optimizer="sgd", precision="float32", out_dir=tmp_path / "a")
    trainer = Trainer(artifacts, scaler=DynamicLossScaler.static(1.0))
    result = trainer.train_step(data["x"], data["labels"])
    assert math.isnan(result.loss) and result.all_finite and result.stepped
    trainer.scaler.check_progress([result.loss], precision="float32")  # no error: the update ran
    assert all(np.array_equal(v, data[k]) for k, v in trainer.parameters().items())  # zero gradients: SGD keeps them


def test_causal_lm_evaluates_a_token_accuracy_on_the_shifted_labelled_positions(tmp_path):
    from onnxmp.training import Trainer
    from onnxmp.training.run.metrics import token_accuracy

    data = case("causal_lm_tokens_ignored")
    artifacts = build_artifacts(tiny_model(data["x"], data["W"], data["b"]), requires_grad=["W", "b"],
                                loss="causal_lm", precision="float32", out_dir=tmp_path / "lm")
    assert losses_module.LOSSES["causal_lm"].metrics == ("token_accuracy",)
    result = Trainer(artifacts).evaluate([(data["x"], data["labels"])], ["token_accuracy"])
    logits = data["x"] @ data["W"] + data["b"]
    labels = np.asarray(data["labels"])
    shifted, predicted = labels[:, 1:], logits[:, :-1].argmax(-1)
    keep = shifted != -100
    assert keep.sum() < shifted.size  # the case has ignored positions, and they do not count
    assert result["token_accuracy"] == pytest.approx(float(np.mean(predicted[keep] == shifted[keep])))
    assert result["token_accuracy"] == pytest.approx(token_accuracy(labels, logits))
    assert result["loss"] == pytest.approx(float(data["loss"]), rel=1e-5)
