"""Custom losses in every form (onnxmp/training/build/loss_forms.py), none needing onnxruntime-training:
an ONNX graph or model, an ONNX function, a Python function writing nodes with LossGraph.  Each is
held to torch's mean squared error / cross entropy on the tiny model of test_training_losses, through
every gradient builder here, and each has a malformed twin that is refused with one clear error."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import parser

from onnxmp.errors import OnnxMPError
from onnxmp.training import build_artifacts
from onnxmp.training.build.loss_forms import function_loss, loss_writer
from onnxmp.training.losses import declare_label

from builders import HERE
from test_training_losses import case, one_step, tiny_model

MSE_GRAPH = """mse_graph (float[N, K] out, float[N, K] target) => (float loss) {
  d = Sub(out, target)
  sq = Mul(d, d)
  loss = ReduceMean<keepdims=0>(sq)
}"""
MSE_FUNCTION = """<domain: "custom", opset_import: ["": 17]> mse_function (out, target) => (loss) {
  d = Sub(out, target)
  sq = Mul(d, d)
  loss = ReduceMean<keepdims=0>(sq)
}"""
# Cross entropy over [N, C] logits and [N] class ids: GatherElements takes no float indices, which is how
# the label's kind is told from the function (int64 class ids).
NLL_FUNCTION = """<domain: "custom", opset_import: ["": 17]> nll_function (logits, labels) => (loss) {
  axis = Constant<value = int64[1] {-1}>()
  log_probs = LogSoftmax<axis = -1>(logits)
  index = Unsqueeze(labels, axis)
  picked = GatherElements<axis = -1>(log_probs, index)
  mean = ReduceMean<keepdims = 0>(picked)
  loss = Neg(mean)
}"""


def mse_function_of_python(g, output, label):
    declare_label(g.graph, output, label, classes=False)
    diff = g.op("Sub", output, label)
    return g.op("ReduceMean", g.op("Mul", diff, diff), keepdims=0)


def _build(tmp_path, name, loss, builder, **kwargs):
    data = case(name)
    artifacts = build_artifacts(tiny_model(data["x"], data["W"], data["b"]), requires_grad=["W", "b"], loss=loss,
                                precision="float32", optimizer="sgd", out_dir=tmp_path / "a", builder=builder,
                                **kwargs)
    return data, artifacts


def _equal_torch(data, artifacts, labels):
    loss, grads = one_step(artifacts, data, labels)
    assert loss == pytest.approx(float(data["loss"]), rel=1e-5, abs=1e-6)
    for param in ("W", "b"):
        np.testing.assert_allclose(grads[param], data[f"grad_{param}"], rtol=1e-4, atol=1e-6, err_msg=param)


def _at_opset(graph: onnx.GraphProto, opset: int) -> onnx.ModelProto:
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])


@pytest.mark.parametrize("builder", HERE)
@pytest.mark.parametrize("form", ["graph", "model_opset18", "function", "python"])
def test_an_mse_written_in_each_form_equals_torch(tmp_path, builder, form):
    loss = {"graph": lambda: parser.parse_graph(MSE_GRAPH),
            # at opset 18 (ReduceMean's axes became an input there): converted to the model's 17
            "model_opset18": lambda: _at_opset(parser.parse_graph(MSE_GRAPH), 18),
            "function": lambda: parser.parse_function(MSE_FUNCTION),
            "python": lambda: mse_function_of_python}[form]()
    data, artifacts = _build(tmp_path, "mse_plain", loss, builder, label_name="target")
    assert artifacts.manifest["loss"] in ("mse_graph", "mse_function", "mse_function_of_python")
    assert artifacts.manifest["input_dtypes"]["target"] == "float32"
    _equal_torch(data, artifacts, data["labels"].astype(np.float32))


@pytest.mark.parametrize("builder", HERE)
def test_a_function_reading_class_ids_gets_int64_labels(tmp_path, builder):
    data, artifacts = _build(tmp_path, "cross_entropy_rows", parser.parse_function(NLL_FUNCTION), builder)
    assert artifacts.manifest["input_dtypes"]["labels"] == "int64"
    _equal_torch(data, artifacts, data["labels"])


def test_a_loss_graph_must_have_two_inputs_and_one_scalar_output():
    two_outputs = parser.parse_graph("""two (float[N, K] out, float[N, K] target) => (float loss, float[N, K] d) {
      d = Sub(out, target)
      sq = Mul(d, d)
      loss = ReduceMean<keepdims=0>(sq)
    }""")
    with pytest.raises(OnnxMPError, match="has 2 input\\(s\\) and 2 output\\(s\\)"):
        loss_writer(two_outputs)
    not_scalar = parser.parse_graph("""rows (float[N, K] out, float[N, K] target) => (float[N] loss) {
      d = Sub(out, target)
      sq = Mul(d, d)
      loss = ReduceMean<axes = [1], keepdims = 0>(sq)
    }""")
    with pytest.raises(OnnxMPError, match="has rank 1, not a scalar"):
        loss_writer(not_scalar)
    double = parser.parse_graph("""dbl (double[N, K] out, double[N, K] target) => (double loss) {
      d = Sub(out, target)
      sq = Mul(d, d)
      loss = ReduceMean<keepdims=0>(sq)
    }""")
    with pytest.raises(OnnxMPError, match="is DOUBLE, not a float32 scalar"):
        loss_writer(double)


def test_a_loss_function_is_refused_when_it_cannot_be_a_loss():
    three = parser.parse_function("""<domain: "custom", opset_import: ["": 17]> three (a, b, c) => (loss) {
      s = Add(b, c)
      d = Sub(a, s)
      loss = ReduceMean<keepdims=0>(d)
    }""")
    with pytest.raises(OnnxMPError, match="has 3 input\\(s\\) and 1 output\\(s\\)"):
        loss_writer(three)
    # Neither label kind type-checks: a float label and an int64 one cannot both be Sub's partner of int32.
    neither = parser.parse_function("""<domain: "custom", opset_import: ["": 17]> neither (out, label) => (loss) {
      i = Cast<to = 6>(out)
      d = Sub(i, label)
      loss = ReduceMean<keepdims=0>(d)
    }""")
    graph = tiny_model(np.zeros((2, 3), np.float32), np.zeros((3, 4), np.float32), np.zeros(4, np.float32)).graph
    with pytest.raises(OnnxMPError, match="type-checks neither with int64 class labels nor with float targets"):
        function_loss(neither, [onnx.helper.make_opsetid("", 17)])(graph, "out", "labels")


def test_a_python_loss_is_refused_when_it_takes_other_arguments_or_forgets_its_label(tmp_path):
    def two_arguments(output, label):
        return output

    with pytest.raises(OnnxMPError, match="does not take \\(builder, output, label\\)"):
        loss_writer(two_arguments)

    def forgetful(g, output, label):
        return g.op("ReduceMean", g.op("Sub", output, label), keepdims=0)

    with pytest.raises(OnnxMPError, match="did not declare its label input 'labels'"):
        _build(tmp_path, "mse_plain", forgetful, "auto")
    assert not (tmp_path / "a").exists()

    def returns_nothing(g, output, label):
        declare_label(g.graph, output, label, classes=False)
        g.op("Sub", output, label)

    with pytest.raises(OnnxMPError, match="returned NoneType, not the name of its loss"):
        _build(tmp_path, "mse_plain", returns_nothing, "auto")
