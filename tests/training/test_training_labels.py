"""Labels are checked against the loss before onnxruntime sees them."""
import numpy as np
import pytest

from onnxmp.errors import OnnxMPError
from onnxmp.training import Trainer
from onnxmp.training.labels import check_labels

X = np.zeros((4, 8), np.float32)


@pytest.mark.parametrize("labels,message", [
    (np.array([0.7, 1, 2, 3]), "non-integer values"),
    (np.array([7, 1, 2, 3]), "class id 7, outside \\[0, 4\\)"),
    (np.array([-5, 1, 2, 3]), "class id -5"),
    (np.array([100000, 1, 2, 3]), "class id 100000"),
    (np.array(["a", "b", "c", "d"]), "dtype <U1"),
    (np.array([True, False, True, False]), "booleans"),
    (np.array([0, 1, 2]), "3 rows but the inputs have 4"),
    (np.eye(4, dtype=np.int64), "one class id per row"),
])
def test_bad_cross_entropy_labels_never_reach_a_step(fp32_artifacts, labels, message):
    trainer = Trainer(fp32_artifacts)
    before = trainer.parameters()
    with pytest.raises(OnnxMPError, match=message):
        trainer.train_step(X, labels)
    assert trainer.optimizer_steps == 0
    assert all(np.array_equal(before[k], v) for k, v in trainer.parameters().items())


def test_integral_float_labels_are_class_ids(fp32_artifacts):
    assert Trainer(fp32_artifacts).train_step(X, np.array([0.0, 1.0, 2.0, 3.0])).stepped


@pytest.mark.parametrize("loss", ["mse", "l1", "bce_with_logits"])
def test_targets_must_have_the_output_shape(loss):
    check_labels(loss, np.zeros((4, 3)), rows=4, shape=[None, 3])
    with pytest.raises(OnnxMPError, match="shape \\[N, 3\\]"):
        check_labels(loss, np.zeros(4), rows=4, shape=[None, 3])
    with pytest.raises(OnnxMPError, match="shape \\[N, 3\\]"):
        check_labels(loss, np.zeros((4, 2)), rows=4, shape=[None, 3])


def test_ort_run_errors_lead_with_ort_reason(fp32_artifacts, monkeypatch):
    import onnxmp.training.run.feeds as feeds_module

    trainer = Trainer(fp32_artifacts)
    monkeypatch.setattr(feeds_module, "check_labels", lambda loss, labels, **_: np.asarray(labels))
    with pytest.raises(OnnxMPError) as info:
        trainer.train_step(X, np.array([0, 1, 2]))
    first = str(info.value).splitlines()[0]
    # The loss graph checks the labels' positions itself (labels_like_logits), and the Trainer
    # (label_run_error) turns onnxruntime's error there into the batch's fault.
    assert "do not have the logits' positions" in first and "onnxruntime_src" not in first


def test_ort_errors_inside_the_graph_are_not_blamed_on_the_batch(fp32_artifacts):
    # What a broken graph gave (ORT's DivGrad, inlined into unnamed nodes, fed a mis-shaped gradient).
    text = ("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Reshape node. Name:'' "
            "Status Message: /onnxruntime_src/onnxruntime/core/providers/cpu/tensor/reshape_helper.h:45 "
            "onnxruntime::ReshapeHelper::ReshapeHelper(const onnxruntime::TensorShape&, "
            "onnxruntime::TensorShapeVector&, bool) input_shape_size == size was false. The input tensor cannot "
            "be reshaped to the requested shape. Input shape:{1,32,1536}, requested shape:{}")
    error = Trainer(fp32_artifacts).feeds.run_error(text, "training")
    first = str(error).splitlines()[0]
    assert "rejected the batch" not in first and "Reshape node" in first and "training graph" in first
    assert "cannot be reshaped" in first and "onnxruntime_src" not in first and "rebuild" in error.hint
    named = Trainer(fp32_artifacts).feeds.run_error(text.replace("Name:''", "Name:'head/Gemm'"), "eval")
    assert "Reshape node 'head/Gemm' of the eval graph" in str(named)
