"""`onnxmp train` end to end, resume included."""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxmp.cli import main
from onnxmp.training.models import mlp


@pytest.fixture()
def files(tmp_path):
    onnx.save(mlp((8, 16, 4), seed=3), tmp_path / "model.onnx")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 8))  # float64 on purpose: the CLI casts to the model's dtype
    y = x[:, :4].argmax(axis=1)
    np.savez(tmp_path / "train.npz", feat=x[:128], lab=y[:128])
    np.savez(tmp_path / "eval.npz", feat=x[128:], lab=y[128:])
    return tmp_path


def _args(files, out, epochs, *extra):
    return ["train", str(files / "model.onnx"), "--data", str(files / "train.npz"), "--eval",
            str(files / "eval.npz"), "--inputs", "feat", "--labels", "lab", "--loss", "cross_entropy",
            "--epochs", str(epochs), "--batch-size", "16", "--lr", "0.01", "--out", str(out), "--no-progress",
            *extra]


def test_train_exports_and_resumes_exactly(files, capsys):
    assert main(_args(files, files / "full", 4)) == 0
    printed = capsys.readouterr().out
    assert "eval_accuracy" in printed and "skipped steps: 0" in printed
    full = json.loads((files / "full" / "history.json").read_text())
    assert [e["epoch"] for e in full["epochs"]] == [1, 2, 3, 4]
    assert full["epochs"][-1]["eval_accuracy"] > 0.5

    for name in ("model.onnx", "model.float16.onnx"):
        onnx.checker.check_model(str(files / "full" / name), full_check=True)
    session = ort.InferenceSession(str(files / "full" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": np.zeros((2, 8), np.float32)})[0].shape == (2, 4)

    assert main(_args(files, files / "part", 2)) == 0
    assert main(_args(files, files / "part", 4, "--resume", str(files / "part"))) == 0
    resumed = json.loads((files / "part" / "history.json").read_text())
    assert [e["epoch"] for e in resumed["epochs"]] == [3, 4]
    assert resumed["epochs"] == full["epochs"][2:]  # bit-identical losses and metrics


def test_train_float32_with_accumulation_and_clipping(files, capsys):
    out = files / "fp32"
    assert main(_args(files, out, 1, "--precision", "float32", "--optimizer", "sgd", "--grad-accum-steps", "2",
                      "--clip-global-norm", "1.0")) == 0
    assert (out / "model.onnx").is_file() and not (out / "model.float16.onnx").exists()
    manifest = json.loads((out / "state" / "manifest.json").read_text())
    assert manifest["precision"] == "float32" and manifest["optimizer"] == "sgd"
    assert json.loads((out / "history.json").read_text())["optimizer_steps"] == 4


@pytest.mark.parametrize("extra,message", [
    (["--labels", "nope"], "has no array nope"),
    (["--inputs", "feat", "lab"], "names 2 arrays"),
    (["--data", "missing.npz"], "cannot read"),
])
def test_bad_input_is_a_one_line_error(files, capsys, extra, message):
    assert main(_args(files, files / "bad", 1, *extra)) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
