"""The portable engine on plain onnxruntime (no training build): these run on Python 3.10-3.13.

The artifacts are written by hand (:mod:`linear_artifacts`), so each step can be checked
against numpy's gradient of the mean squared error."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from onnxmp.errors import OnnxMPError
from onnxmp.training import DynamicLossScaler, Trainer
from onnxmp.training.run import engines
from onnxmp.training.artifacts import Artifacts

from linear_artifacts import linear_data, write_linear_artifacts


@pytest.fixture(scope="module")
def sgd_linear(tmp_path_factory):
    return write_linear_artifacts(tmp_path_factory.mktemp("linear_sgd"), optimizer="sgd")


@pytest.fixture(scope="module")
def adamw_linear(tmp_path_factory):
    return write_linear_artifacts(tmp_path_factory.mktemp("linear_adamw"), optimizer="adamw")


@pytest.fixture(scope="module")
def data():
    x, y = linear_data()
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, len(x), 8)]


def _mse_grads(w, b, x, y):
    diff = x.astype(np.float64) @ w + b - y
    n = diff.size
    return 2 * x.T.astype(np.float64) @ diff / n, 2 * diff.sum(axis=0) / n


def test_sgd_steps_equal_numpy(sgd_linear, data):
    lr, k = 0.2, 2
    trainer = Trainer(sgd_linear, engine="portable", lr=lr, grad_accum_steps=k)
    assert trainer.engine.name == "portable"
    start = Artifacts.load(sgd_linear).parameters()
    w, b = start["W"].astype(np.float64), start["b"].astype(np.float64)
    losses = []
    for i, batch in enumerate(data):
        result = trainer.train_step(*batch)
        losses.append(result.loss)
        gw, gb = _mse_grads(w, b, *batch)
        if i % k == 0:
            acc_w, acc_b = gw / k, gb / k
        else:
            acc_w, acc_b = acc_w + gw / k, acc_b + gb / k
            np.testing.assert_allclose(trainer.gradients()["W"], acc_w, rtol=1e-4, atol=1e-6)
            w, b = w - lr * acc_w, b - lr * acc_b
            assert result.stepped
    params = trainer.parameters()
    np.testing.assert_allclose(params["W"], w, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(params["b"], b, rtol=1e-4, atol=1e-6)
    assert trainer.optimizer_steps == len(data) // k and losses[-1] < 0.8 * losses[0]


def _digest(trainer):
    engine = trainer.engine
    return (json.dumps({k: v.tolist() for k, v in engine.parameters().items()}),
            json.dumps({k: v.numpy().tolist() for k, v in engine._update._state.items()}), engine._update.step)


def test_non_finite_step_is_skipped_bit_for_bit(adamw_linear, data):
    # A scale of 2**127 turns the scaled gradients into inf in float32: skip, then back off.
    trainer = Trainer(adamw_linear, engine="portable", lr=1e-2,
                      scaler=DynamicLossScaler(2.0**127, backoff_factor=2.0**-127, min_scale=1.0, max_scale=2.0**127))
    before = _digest(trainer)
    bad = trainer.train_step(*data[0])
    assert not bad.all_finite and bad.skipped and trainer.skipped_steps == 1
    assert _digest(trainer) == before and trainer.scaler.scale == 1.0
    good = trainer.train_step(*data[1])
    assert good.stepped and trainer.engine._update.step == 1

    clean = Trainer(adamw_linear, engine="portable", lr=1e-2)
    clean.train_step(*data[1])
    assert _digest(clean) == _digest(trainer)


def test_kept_bindings_step_as_fresh_ones(adamw_linear, data):
    # The engine keeps one training and one optimizer binding per pairing of its swapped state
    # sets; binding everything anew each step must give the same bits (the learning rate and step
    # count, rebound per run, included).
    kept = Trainer(adamw_linear, engine="portable", lr=1e-2)
    fresh = Trainer(adamw_linear, engine="portable", lr=1e-2)
    for i, batch in enumerate(data):
        if i == 3:
            kept.engine.learning_rate = fresh.engine.learning_rate = 5e-3
        fresh.engine._bindings.clear()
        fresh.engine._update._bindings.clear()
        assert kept.train_step(*batch).loss == fresh.train_step(*batch).loss
    assert _digest(kept) == _digest(fresh)
    assert len(kept.engine._bindings) == len(kept.engine._update._bindings) == 2


def test_save_and_resume_continue_bit_for_bit(adamw_linear, data, tmp_path):
    straight = Trainer(adamw_linear, engine="portable", lr=1e-2, grad_accum_steps=2)
    for batch in data:
        straight.train_step(*batch)

    first = Trainer(adamw_linear, engine="portable", lr=1e-2, grad_accum_steps=2)
    for batch in data[:4]:
        first.train_step(*batch)
    first.save(tmp_path / "state")
    manifest = json.loads((tmp_path / "state" / "manifest.json").read_text())
    assert manifest["state"]["engine"] == "portable"
    resumed = Trainer.resume(tmp_path / "state")  # auto: the engine that saved it
    assert resumed.engine.name == "portable" and resumed.optimizer_steps == 2
    for batch in data[4:]:
        resumed.train_step(*batch)
    assert _digest(resumed) == _digest(straight)

    with pytest.raises(OnnxMPError, match="portable engine saved"):
        Trainer.resume(tmp_path / "state", engine="native")


def test_state_dicts_carry_a_run_in_memory_bit_for_bit(adamw_linear, data):
    # torch's pattern: trainer, scaler, schedule and engine each give and take their state.
    settings = dict(engine="portable", lr=1e-2, grad_accum_steps=2, schedule="linear", total_steps=8,
                    scaler={"init_scale": 2.0**10, "growth_interval": 1})
    straight = Trainer(adamw_linear, **settings)
    for batch in data:
        straight.train_step(*batch)

    first = Trainer(adamw_linear, **settings)
    for batch in data[:4]:
        first.train_step(*batch)
    trainer_state, engine_state = first.state_dict(), first.engine.state_dict()
    assert trainer_state["optimizer_steps"] == 2 and trainer_state["scaler"]["scale"] == 2.0**12
    assert engine_state["optimizer"]["onnxmp.optimizer.step"] == 2
    second = Trainer(adamw_linear, **{**settings, "schedule": "constant"})
    second.load_state_dict(trainer_state)
    second.engine.load_state_dict(engine_state)
    assert second.schedule == first.schedule and second.scaler.scale == 2.0**12
    for batch in data[4:]:
        second.train_step(*batch)
    assert _digest(second) == _digest(straight)

    with pytest.raises(OnnxMPError, match="not a trainer state"):
        second.load_state_dict({"epoch": 1})
    with pytest.raises(OnnxMPError, match="lacks the optimizer state"):
        second.engine.load_state_dict({"parameters": {}, "optimizer": {}})


def test_clipping_rebuilds_the_optimizer_graph(sgd_linear, data):
    lr, clip = 0.5, 0.01
    probe = Trainer(sgd_linear, engine="portable", lr=lr)
    before = probe.parameters()
    probe.engine.train({**probe.feeds(data[0]), "loss_scale": np.array(1.0, np.float32),
                        "grad_weight": np.array(1.0, np.float32)})
    grads = probe.gradients()
    norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    assert norm > clip
    trainer = Trainer(sgd_linear, engine="portable", lr=lr, clip_global_norm=clip)
    assert trainer.train_step(*data[0]).stepped
    after = trainer.parameters()
    for name in before:
        np.testing.assert_allclose(after[name], before[name] - lr * clip / (norm + 1e-6) * grads[name],
                                   rtol=1e-4, atol=1e-7)


def test_evaluate_and_export(sgd_linear, data, tmp_path):
    trainer = Trainer(sgd_linear, engine="portable", lr=0.05)
    initial = trainer.evaluate(data)["loss"]
    trainer.fit(data, 2, progress=False)
    assert trainer.evaluate(data)["loss"] < initial
    path = trainer.export_inference(tmp_path / "model.onnx", precision="float32")
    import onnxruntime as ort

    x = data[0][0]
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    params = trainer.parameters()
    np.testing.assert_allclose(got, x @ params["W"] + params["b"], rtol=1e-5, atol=1e-6)


def test_engine_choice(sgd_linear, monkeypatch, tmp_path):
    artifacts = Artifacts.load(sgd_linear)
    monkeypatch.setattr(engines, "native_available", lambda: False)
    assert engines.resolve("auto", artifacts) == "portable"
    monkeypatch.setattr(engines, "native_available", lambda: True)
    assert engines.resolve("auto", artifacts) == "native"
    with pytest.raises(OnnxMPError, match="unknown engine"):
        Trainer(sgd_linear, engine="fast")
    bare = json.loads((sgd_linear / "manifest.json").read_text())
    del bare["portable"]
    folder = tmp_path / "bare"
    folder.mkdir()
    for item in sgd_linear.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    (folder / "manifest.json").write_text(json.dumps(bare))
    with pytest.raises(OnnxMPError, match="no portable graphs"):
        Trainer(folder, engine="portable")


def test_old_format_is_a_clear_error(sgd_linear, tmp_path):
    manifest = json.loads((sgd_linear / "manifest.json").read_text())
    manifest["format"] = "onnxmp-training/1"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(OnnxMPError, match="old format.*") as info:
        Artifacts.load(tmp_path)
    assert "Python 3.11" in info.value.hint


@pytest.mark.skipif(engines.native_available(), reason="the training build is installed here")
def test_native_without_the_training_build_names_the_python_311_step(sgd_linear):
    with pytest.raises(OnnxMPError) as info:
        Trainer(sgd_linear, engine="native")
    assert "3.11" in str(info.value) + (info.value.hint or "")


@pytest.mark.skipif(engines.native_available(), reason="the training build is installed here")
def test_ort_builder_without_the_training_build_names_the_python_311_step(tmp_path):
    from onnxmp.training import build_artifacts
    from onnxmp.training.models import mlp, trainable

    model = mlp((4, 3), seed=0)
    with pytest.raises(OnnxMPError) as info:
        build_artifacts(model, requires_grad=trainable(model), out_dir=tmp_path / "a", builder="ort")
    assert "Python 3.11" in info.value.hint and "--artifacts" in info.value.hint
    assert not (tmp_path / "a").exists()
    x, y = linear_data(n_in=4, n_out=3)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    import onnx

    onnx.save(model, tmp_path / "m.onnx")
    command = [sys.executable, "-m", "onnxmp", "train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "data.npz"),
               "--inputs", "x", "--labels", "y", "--epochs", "1", "--batch-size", "8", "--out", str(tmp_path / "run"),
               "--loss", "mse"]
    done = subprocess.run([*command, "--builder", "ort"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 2, done.stderr
    assert "building training artifacts" in done.stderr and "Python 3.11" in done.stderr
    assert not (tmp_path / "run").exists()
    # The default builder (auto) is onnxmp's here: the same command builds and trains.
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "run" / "artifacts" / "manifest.json").read_text())["builder"] == "onnxmp"


def test_cli_trains_prebuilt_artifacts(sgd_linear, tmp_path):
    x, y = linear_data()
    np.savez(tmp_path / "data.npz", x=x, y=y)
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "onnxmp", "train", "--artifacts", str(sgd_linear),
                           "--data", str(tmp_path / "data.npz"), "--inputs", "x", "--labels", "y",
                           "--epochs", "2", "--batch-size", "16", "--lr", "0.05", "--engine", "portable",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (out / "model.onnx").is_file() and (out / "state" / "optimizer_state.npz").is_file()
    history = json.loads((out / "history.json").read_text())
    assert history["optimizer_steps"] == 8
