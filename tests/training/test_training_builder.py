"""The gradient-builder switch: build_artifacts(builder=...) and `onnxmp train --builder`.

``auto`` is ORT's builder where onnxruntime-training imports and onnxmp's elsewhere; the manifest
records which made the folder; onnxmp's writes no native-engine files, and the engines say so."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from onnxmp.errors import OnnxMPError
from onnxmp.training import Trainer, build_artifacts
from onnxmp.training.run import engines
from onnxmp.training.artifacts import NATIVE_FILES, Artifacts
from onnxmp.training.build import resolve_builder
from onnxmp.training.models import mlp, trainable

from builders import HERE, needs_training_build, training_build
from mlp_cli import train_args, write_mlp_job


def test_auto_is_ort_where_the_training_build_imports_else_onnxmp():
    assert resolve_builder("auto") == ("ort" if training_build() else "onnxmp")
    assert resolve_builder("onnxmp") == "onnxmp"
    with pytest.raises(OnnxMPError, match="unknown gradient builder 'torch'"):
        resolve_builder("torch")


@pytest.mark.skipif(training_build(), reason="the training build is installed here")
def test_ort_without_the_training_build_names_the_python_311_step():
    with pytest.raises(OnnxMPError) as info:
        resolve_builder("ort")
    assert "Python 3.11" in info.value.hint


@pytest.mark.parametrize("builder", HERE)
def test_the_manifest_records_the_builder_and_the_files_there_are(tmp_path, builder, batches):
    model = mlp((8, 16, 4), seed=0)
    artifacts = build_artifacts(model, requires_grad=trainable(model), precision="float16", out_dir=tmp_path / "a",
                                builder=builder)
    assert artifacts.builder == builder and artifacts.has_portable
    assert artifacts.has_native == (builder == "ort")
    on_disk = {p.name for p in (tmp_path / "a").iterdir()}
    assert set(artifacts.manifest["files"].values()) <= on_disk
    assert ("checkpoint" in on_disk) == (builder == "ort")
    trainer = Trainer(artifacts, lr=0.01)
    assert trainer.engine.name == ("native" if builder == "ort" else "portable")
    losses = [trainer.train_step(*batch).loss for batch in batches for _ in range(2)]
    assert losses[-1] < losses[0]


def _without_native_files(source: Artifacts, folder):
    """An ORT-built folder as onnxmp's builder writes it: no native-engine files."""
    shutil.copytree(source.directory, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    for kind in NATIVE_FILES:
        if kind in manifest["files"]:  # ORT's builder made the session's folders (Python 3.11)
            (folder / manifest["files"].pop(kind)).unlink()
    manifest["builder"] = "onnxmp"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return Artifacts.load(folder)


def test_folders_without_native_files_train_on_the_portable_engine_and_refuse_the_native_one(
        fp32_artifacts, tmp_path, batches):
    portable_only = _without_native_files(fp32_artifacts, tmp_path / "a")
    assert not portable_only.has_native and portable_only.builder == "onnxmp"
    assert engines.resolve("auto", portable_only) == "portable"
    assert Trainer(portable_only).train_step(*batches[0]).stepped
    with pytest.raises(OnnxMPError, match="built by onnxmp's gradient builder and have no native-engine files") as info:
        Trainer(portable_only, engine="native")
    assert "engine='portable'" in info.value.hint
    with pytest.raises(OnnxMPError, match="no native-engine files \\(no checkpoint\\)"):
        portable_only.checkpoint
    assert fp32_artifacts.has_native == (fp32_artifacts.builder == "ort") == training_build()


@pytest.mark.parametrize("builder", HERE)
def test_cli_builder_flag_builds_trains_and_resumes(tmp_path, builder):
    files = write_mlp_job(tmp_path, rows=64)
    run = lambda *args: subprocess.run([sys.executable, "-m", "onnxmp", *args], capture_output=True, text=True,
                                       timeout=600)
    done = run(*train_args(files, tmp_path / "run", 1, "--builder", builder))
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "run" / "artifacts" / "manifest.json").read_text())
    assert manifest["builder"] == builder
    state = json.loads((tmp_path / "run" / "state" / "manifest.json").read_text())
    assert state["state"]["engine"] == ("native" if builder == "ort" else "portable")
    again = run(*train_args(files, tmp_path / "run", 2), "--resume", str(tmp_path / "run"))
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "run" / "history.json").read_text())


@needs_training_build
def test_cli_refuses_the_native_engine_on_onnxmp_artifacts(tmp_path):
    files = write_mlp_job(tmp_path, rows=32)
    done = subprocess.run([sys.executable, "-m", "onnxmp", *train_args(files, tmp_path / "run", 1, "--builder",
                                                                      "onnxmp", "--engine", "native")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "--engine native runs the files ORT's gradient builder writes" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 2, done.stderr  # the error and its hint, before any work
    assert not (tmp_path / "run").exists()


def _reduce_max_head(model):
    """The MLP with a max over its logits' last axis added to them: ReduceMax lies between the
    parameters and the loss (onnxruntime-training 1.19 has no gradient for it; onnxmp's builder has)."""
    import onnx
    from onnx import helper

    graph = model.graph
    out = graph.output[0].name
    graph.node.extend([
        helper.make_node("ReduceMax", [out], ["peak"], keepdims=1, axes=[-1]),
        helper.make_node("Add", [out, "peak"], ["logits_peaked"])])
    graph.output[0].name = "logits_peaked"
    return onnx.shape_inference.infer_shapes(model)


def test_onnxmp_builds_ops_ort_has_no_gradient_for(tmp_path, batches):
    model = _reduce_max_head(mlp((8, 16, 4), seed=0))
    artifacts = build_artifacts(model, requires_grad=trainable(model), precision="float32", out_dir=tmp_path / "a",
                                builder="onnxmp")
    trainer = Trainer(artifacts, lr=0.01)
    losses = [trainer.train_step(*batch).loss for batch in batches for _ in range(2)]
    assert losses[-1] < losses[0]


@needs_training_build
def test_ort_builder_still_refuses_what_it_cannot_differentiate(tmp_path):
    model = _reduce_max_head(mlp((8, 16, 4), seed=0))
    with pytest.raises(OnnxMPError, match="ReduceMax"):
        build_artifacts(model, requires_grad=trainable(model), precision="float32", out_dir=tmp_path / "a",
                        builder="ort")
