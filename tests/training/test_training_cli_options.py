"""`onnxmp train`'s flags for losses, schedules, the loss scaler, threads and choosing parameters."""
import json

import numpy as np
import onnx
import pytest

from onnxmp.cli import main
from onnxmp.training import Trainer
from mlp_cli import train_args, write_mlp_job


@pytest.fixture()
def files(tmp_path):
    return write_mlp_job(tmp_path, rows=96)


def _state(out):
    return json.loads((out / "state" / "trainer_state.json").read_text())


def _weights(path):
    model = onnx.load(str(path))
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def test_list_params_shows_shapes_and_the_readers_of_folded_names(tmp_path, capsys):
    from onnx import TensorProto, helper

    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "onnx::MatMul_356"], ["h"], name="/layer/MatMul"),
         helper.make_node("Add", ["h", "layer.bias"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])]), opset_imports=[helper.make_opsetid("", 17)])
    model.graph.initializer.extend([
        onnx.numpy_helper.from_array(np.zeros((8, 4), np.float32), "onnx::MatMul_356"),
        onnx.numpy_helper.from_array(np.zeros(4, np.float32), "layer.bias"),
        onnx.numpy_helper.from_array(np.zeros(2, np.int64), "shape")])
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["train", str(tmp_path / "m.onnx"), "--list-params"]) == 0
    lines = capsys.readouterr().out.splitlines()
    folded = next(line for line in lines if line.startswith("onnx::MatMul_356"))
    assert "[8, 4]" in folded and "float32" in folded and " 32 " in folded and "MatMul '/layer/MatMul'" in folded
    bias = next(line for line in lines if line.startswith("layer.bias"))
    assert "[4]" in bias and "MatMul" not in bias and not any(line.startswith("shape") for line in lines)
    assert lines[-1] == "2 float initializers, 36 elements"
    assert main(["train", "--list-params"]) == 2  # it needs the model


def test_train_and_freeze_patterns_choose_the_parameters(files, capsys):
    out = files / "out"
    assert main(train_args(files, out, 1, "--train", r"^W", "--freeze", "W1")) == 0
    manifest = json.loads((out / "state" / "manifest.json").read_text())
    assert manifest["requires_grad"] == ["W0"] and sorted(manifest["frozen"]) == ["W1", "b0", "b1"]
    before, after = _weights(files / "model.onnx"), _weights(out / "model.onnx")
    assert all(np.array_equal(before[n], after[n]) for n in ("W1", "b0", "b1"))  # bit-identical
    assert not np.array_equal(before["W0"], after["W0"])

    capsys.readouterr()
    assert main(train_args(files, files / "never", 1, "--freeze", "decoder")) == 1
    err = capsys.readouterr().err
    assert "--freeze 'decoder' matches no parameter" in err and not (files / "never").exists()
    assert main(train_args(files, files / "never", 1, "--train", "W", "--freeze", ".")) == 1
    assert "leave no parameter to train" in capsys.readouterr().err


def test_schedule_warmup_scaler_and_threads_flags(files):
    out = files / "out"
    # 96 rows / 16 = 6 batches, 2 per update -> 3 updates an epoch, 6 in all.
    assert main(train_args(files, out, 2, "--schedule", "cosine", "--warmup-steps", "2", "--grad-accum-steps", "2",
                      "--init-scale", "1024", "--growth-interval", "3", "--threads", "1")) == 0
    state = _state(out)
    assert state["schedule"] == {"name": "cosine", "warmup_steps": 2, "total_steps": 6, "num_cycles": 0.5}
    assert state["base_learning_rate"] == 0.01 and state["optimizer_steps"] == 6
    assert state["scaler"]["initial_scale"] == 1024 and state["scaler"]["growth_steps"] == 3
    assert state["scaler"]["scale"] == 4096  # dynamic on float32 when asked: 6 finite updates, 2 growths
    resumed = Trainer.resume(out / "state")
    assert resumed.schedule.name == "cosine" and resumed.base_lr == 0.01

    assert main(train_args(files, files / "static", 1, "--no-loss-scaling")) == 0
    assert _state(files / "static")["scaler"]["dynamic"] is False


def test_custom_loss_from_a_file_and_ignore_index(files, capsys):
    (files / "myloss.py").write_text(
        "from onnxmp.training import losses\n\n"
        "def token_loss():\n"
        "    return losses.table_loss('cross_entropy', ignore_index=3)\n")
    out = files / "custom"
    assert main(train_args(files, out, 1, "--loss", f"{files / 'myloss.py'}:token_loss")) == 0
    manifest = json.loads((out / "state" / "manifest.json").read_text())
    assert manifest["loss"] == "cross_entropy" and manifest["loss_options"] == {"ignore_index": 3}

    assert main(train_args(files, files / "ignore", 1, "--ignore-index", "0")) == 0
    manifest = json.loads((files / "ignore" / "state" / "manifest.json").read_text())
    assert manifest["loss_options"] == {"ignore_index": 0}
    assert main(train_args(files, files / "never", 1, "--loss", "nope")) == 1
    assert "unknown loss 'nope'" in capsys.readouterr().err
    assert main(train_args(files, files / "never", 1, "--pos-weight", "2")) == 1
    assert "has no option pos_weight" in capsys.readouterr().err


def test_builder_with_a_built_folder_is_said_unused(files, tmp_path, caplog):
    out = tmp_path / "out"
    assert main(train_args(files, out, 1)) == 0
    with caplog.at_level("WARNING", logger="onnxmp"):
        assert main(train_args(files, out, 2, "--resume", str(out / "state"))) == 0
    assert "--builder" not in caplog.text  # not asked for: nothing to say
    caplog.clear()
    with caplog.at_level("WARNING", logger="onnxmp"):
        assert main(train_args(files, out, 3, "--resume", str(out / "state"), "--builder", "onnxmp")) == 0
    assert "--builder onnxmp is not used with --resume" in caplog.text
