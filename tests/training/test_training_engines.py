"""Native against portable on artifacts the training build writes (Python 3.11): both step with
torch's update (the portable optimizer graph), so they differ only in the training graph's
kernels, onnxruntime-training's against their lowering."""
from __future__ import annotations

import numpy as np
import pytest

from onnxmp.training import DynamicLossScaler, Trainer, build_artifacts
from onnxmp.training.models import mlp, trainable

STEPS = 30


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(STEPS * 16, 8)).astype(np.float32)
    y = x[:, :4].argmax(axis=1).astype(np.int64)
    return [(x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    model = mlp((8, 16, 4), seed=0)
    cache = {}

    def get(optimizer, precision):
        if (optimizer, precision) not in cache:
            cache[optimizer, precision] = build_artifacts(
                model, requires_grad=trainable(model), optimizer=optimizer, precision=precision, target="cpu",
                out_dir=tmp_path_factory.mktemp(f"{optimizer}-{precision}"))
        return cache[optimizer, precision]
    return get


def _run(artifacts, engine, data, **kwargs):
    trainer = Trainer(artifacts, engine=engine, lr=1e-2, grad_accum_steps=2, **kwargs)
    return trainer, [trainer.train_step(*batch) for batch in data]


def test_the_build_writes_the_portable_form(built):
    artifacts = built("adamw", "float32")
    assert artifacts.has_portable and artifacts.manifest["optimizer"]["slots"] == ["exp_avg", "exp_avg_sq"]
    assert set(artifacts.parameters()) == set(trainable(mlp((8, 16, 4), seed=0)))
    pairs = artifacts.manifest["portable"]["state_pairs"]
    assert pairs["training_model"]["W0_grad.accumulation.buffer"] == "W0_grad.accumulation.out"
    assert pairs["optimizer_model"]["W0.exp_avg"] == "W0.exp_avg.out"


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_float32_losses_agree_over_30_steps(built, data, optimizer):
    artifacts = built(optimizer, "float32")
    native, a = _run(artifacts, "native", data)
    portable, b = _run(artifacts, "portable", data)
    assert native.engine.name == "native" and portable.engine.name == "portable"
    np.testing.assert_allclose([r.loss for r in b], [r.loss for r in a], rtol=1e-4)
    for name, value in native.parameters().items():
        np.testing.assert_allclose(portable.parameters()[name], value, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_float16_skips_and_scales_agree(built, data, optimizer):
    artifacts = built(optimizer, "float16")
    runs = [_run(artifacts, engine, data, scaler=DynamicLossScaler(2.0**20, growth_steps=3))[1]
            for engine in ("native", "portable")]
    native, portable = ([(r.skipped, r.loss_scale, r.stepped) for r in run] for run in runs)
    assert native == portable and any(s for s, _, _ in native)
    np.testing.assert_allclose([r.loss for r in runs[1]], [r.loss for r in runs[0]], rtol=1e-3)


def test_accumulated_gradients_and_clipping_agree(built, data):
    artifacts = built("sgd", "float32")
    trainers = {engine: Trainer(artifacts, engine=engine, lr=0.5, grad_accum_steps=3, clip_global_norm=0.01)
                for engine in ("native", "portable")}
    for engine, trainer in trainers.items():
        for batch in data[:2]:
            trainer.train_step(*batch)
    grads = {engine: t.gradients() for engine, t in trainers.items()}
    for name, value in grads["native"].items():
        np.testing.assert_allclose(grads["portable"][name], value, rtol=1e-5, atol=1e-8)
    for trainer in trainers.values():
        for batch in data[2:8]:
            trainer.train_step(*batch)
    for name, value in trainers["native"].parameters().items():
        np.testing.assert_allclose(trainers["portable"].parameters()[name], value, rtol=1e-4, atol=1e-7)


def test_native_state_resumes_natively_and_refuses_portable(built, data, tmp_path):
    artifacts = built("adamw", "float32")
    trainer, _ = _run(artifacts, "native", data[:4])
    trainer.save(tmp_path / "state")
    resumed = Trainer.resume(tmp_path / "state")
    assert resumed.engine.name == "native"
    np.testing.assert_array_equal(resumed.parameters()["W0"], trainer.parameters()["W0"])
    from onnxmp.training.artifacts import read_parameters

    saved = read_parameters(tmp_path / "state" / "parameters.npz")  # the portable format, readable anywhere
    np.testing.assert_array_equal(saved["W0"], trainer.parameters()["W0"])
    from onnxmp.errors import OnnxMPError

    with pytest.raises(OnnxMPError, match="native engine saved"):
        Trainer.resume(tmp_path / "state", engine="portable")


def test_a_scalar_parameter_trains_alike(tmp_path, data):
    # A 0-d initializer (dynamo exports have them) keeps its shape [] in every engine buffer.
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Mul", ["h", "s"], ["logits"])], "scalar",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(rng.normal(size=(8, 4)).astype(np.float32), "W"),
         numpy_helper.from_array(np.array(1.5, np.float32), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    artifacts = build_artifacts(model, requires_grad=["W", "s"], target="cpu", out_dir=tmp_path / "a")
    runs = {engine: _run(artifacts, engine, data[:6]) for engine in ("native", "portable")}
    np.testing.assert_allclose([r.loss for r in runs["portable"][1]], [r.loss for r in runs["native"][1]], rtol=1e-5)
    for trainer, _ in runs.values():
        assert trainer.parameters()["s"].shape == () and trainer.parameters()["s"] != 1.5
