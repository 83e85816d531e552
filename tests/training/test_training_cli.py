"""`onnxmp train` end to end, resume included."""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxmp.cli import main
from onnxmp.training.models import mlp

from builders import needs_training_build


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
    assert manifest["precision"] == "float32" and manifest["optimizer"]["name"] == "sgd"
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


@pytest.mark.parametrize("labels,message", [
    (lambda y: y + 0.5, "non-integer"),
    (lambda y: y + 4, "class id"),
    (lambda y: y.astype(str), "dtype"),
    (lambda y: np.eye(4)[y], "one class id per row"),
])
def test_bad_labels_are_refused_before_anything_is_written(files, capsys, labels, message):
    data = np.load(files / "train.npz")
    np.savez(files / "bad.npz", feat=data["feat"], lab=labels(data["lab"]))
    out = files / "never"
    assert main(_args(files, out, 1, "--data", str(files / "bad.npz"))) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists() and not [p for p in files.iterdir() if p.name.startswith(".never")]


def test_rows_must_agree_across_arrays(files, capsys):
    data = np.load(files / "train.npz")
    np.savez(files / "ragged.npz", feat=data["feat"], lab=data["lab"][:-3])
    assert main(_args(files, files / "never", 1, "--data", str(files / "ragged.npz"))) == 1
    assert "different numbers of rows" in capsys.readouterr().err and not (files / "never").exists()


def test_a_failed_build_leaves_no_output_folder(files, capsys):
    # Det: neither gradient builder has a rule for it (ORT's refuses it in prepare, onnxmp's in its walk)
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
g (float[N,8] x) => (float[N,4] y) {
  h = MatMul(x, W)
  s = Reshape(h, shape)
  d = Det(s)
  e = Unsqueeze(d, one)
  y = Mul(h, e)
}""")
    model.graph.initializer.extend([onnx.numpy_helper.from_array(np.ones((8, 4), np.float32), "W"),
                                    onnx.numpy_helper.from_array(np.array([-1, 2, 2], np.int64), "shape"),
                                    onnx.numpy_helper.from_array(np.array([1], np.int64), "one")])
    onnx.save(model, files / "model.onnx")
    assert main(_args(files, files / "never", 1)) == 1
    err = capsys.readouterr().err
    assert "no gradient for Det" in err, err
    assert not (files / "never").exists() and not [p for p in files.iterdir() if p.name.startswith(".never")]


def test_train_the_bundled_transformer_classifier(tmp_path, capsys):
    from models import zoo

    onnx.save(zoo.transformer_classifier(), tmp_path / "classifier.onnx")
    np.savez(tmp_path / "train.npz", **zoo.classifier_task(256, seed=0))
    np.savez(tmp_path / "eval.npz", **zoo.classifier_task(64, seed=1))
    out = tmp_path / "out"
    assert main(["train", str(tmp_path / "classifier.onnx"), "--data", str(tmp_path / "train.npz"), "--eval",
                 str(tmp_path / "eval.npz"), "--inputs", "input_ids", "attention_mask", "--labels", "labels",
                 "--epochs", "3", "--batch-size", "32", "--lr", "3e-3", "--out", str(out), "--no-progress"]) == 0
    history = json.loads((out / "history.json").read_text())
    assert history["epochs"][-1]["eval_loss"] < history["epochs"][0]["eval_loss"]
    assert history["epochs"][-1]["eval_accuracy"] > 0.9
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = zoo.inputs_for("transformer_classifier", 3)
    assert session.run(None, feeds)[0].shape == (3, 2)


def test_constants_stored_as_initializers_are_not_trained(files, capsys):
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
g (float[N,8] x) => (float[N,4] y) {
  h = MatMul(x, W)
  y = Clip(h, lo)
}""")
    model.graph.initializer.extend([onnx.numpy_helper.from_array(np.eye(8, 4, dtype=np.float32), "W"),
                                    onnx.numpy_helper.from_array(np.array(-5.0, np.float32), "lo")])
    onnx.save(model, files / "model.onnx")
    assert main(_args(files, files / "out", 1, "--precision", "float32")) == 0
    manifest = json.loads((files / "out" / "state" / "manifest.json").read_text())
    assert manifest["requires_grad"] == ["W"] and manifest["frozen"] == ["lo"]


@pytest.mark.parametrize("flag, value, message", [
    ("--lr", "-1", "argument --lr: must be a positive number, got -1"),  # trained uphill, exit 0
    ("--grad-accum-steps", "0", "argument --grad-accum-steps: must be at least 1, got 0"),  # after the build
    ("--clip-global-norm", "-1", "argument --clip-global-norm: must be a positive number"),  # after the build
    ("--epochs", "0", "argument --epochs: must be at least 1, got 0"),
])
def test_out_of_range_numbers_are_usage_errors_before_any_work(files, capsys, flag, value, message):
    assert main(_args(files, files / "out", 1, flag, value)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"onnxmp train: error: {message}") and "Traceback" not in err
    assert sorted(p.name for p in files.iterdir()) == ["eval.npz", "model.onnx", "train.npz"]


def test_an_unrelated_out_folder_is_refused_and_kept(files, capsys):
    (files / "mine").mkdir()
    (files / "mine" / "notes.txt").write_text("precious")
    assert main(_args(files, files / "mine", 1)) == 1
    err = capsys.readouterr().err
    assert "mine exists and is not an onnxmp train output folder;" in err  # was "an onnxmp `onnxmp train` ..."
    assert (files / "mine" / "notes.txt").read_text() == "precious"


def test_no_progress_bar_when_stderr_is_not_a_terminal(files, capsys):
    """A log file got tqdm's bars ('epoch 1/1: 100%|...') unless --no-progress was given."""
    argv = [a for a in _args(files, files / "out", 1) if a != "--no-progress"]
    assert main(argv) == 0
    assert "it/s" not in capsys.readouterr().err


def test_log_names_the_final_paths_not_the_temporary_folder(files, capsys, caplog):
    """The INFO lines named `.out.x1y2.tmp/...`, a folder renamed away before the run ends."""
    import logging

    caplog.set_level(logging.INFO, logger="onnxmp")
    out = files / "out"
    assert main(_args(files, out, 1)) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if ".tmp" in m], messages
    assert f"saved {out / 'artifacts' / 'forward_model.onnx'}" in messages
    assert any(m.endswith(f"written to {out / 'artifacts'}") for m in messages)
    assert any(m.endswith(f"to {out / 'state'}") and "trainer state" in m for m in messages)
    assert f"saved {out / 'model.onnx'}" in messages


def test_a_model_over_2gb_is_refused_before_its_weights_or_data_are_read(files, capsys):
    from models.large import write_sparse_model

    big = write_sparse_model(files / "big", int(2.2 * 2**30))  # sparse: reading it would take seconds
    args = _args(files, files / "never", 1)
    args[1] = str(big)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "cannot build training artifacts over 2 GB" in err and err.count("\n") <= 2, err
    assert not (files / "never").exists()


@needs_training_build  # the native engine, on a folder ORT's builder made (builder auto there)
def test_train_prebuilt_artifacts_on_either_engine(files, capsys):
    """A run's artifacts/ trained again with --artifacts: natively, and on the portable engine
    (its graphs lowered) with the same losses."""
    assert main(_args(files, files / "built", 1, "--precision", "float32", "--optimizer", "sgd")) == 0
    histories = {}
    for engine in ("native", "portable"):
        args = _args(files, files / engine, 2, "--engine", engine, "--artifacts", str(files / "built" / "artifacts"))
        args.remove(str(files / "model.onnx"))
        assert main(args) == 0
        histories[engine] = json.loads((files / engine / "history.json").read_text())
        state = json.loads((files / engine / "state" / "manifest.json").read_text())["state"]
        assert state["engine"] == engine and not (files / engine / "artifacts").exists()
    native, portable = (h["epochs"] for h in histories.values())
    assert [e["epoch"] for e in native] == [1, 2] and histories["native"]["optimizer_steps"] == 16
    for a, b in zip(native, portable):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
    capsys.readouterr()
