"""What build_artifacts writes: the loss-scaling contract inside training_model.onnx.

The fixtures' builder is ``auto``: ORT's on Python 3.11 with the training build, onnxmp's elsewhere
(whose folders hold the portable graphs only, which :func:`_graph` reads then)."""
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from onnxmp.errors import OnnxMPError
from onnxmp.training import Artifacts, Trainer, build_artifacts
from onnxmp.training.build.load import runtime_loads_opset
from onnxmp.training.models import mlp, scaled_cross_entropy, trainable

from builders import HERE, needs_training_build


def _graph(artifacts, kind="training_model"):
    """The native graph where the folder has one (ORT's builder), else the portable one."""
    return onnx.load(artifacts.path(kind) if artifacts.has_native else artifacts.portable_path(kind))


def _producers(graph):
    return {out: node for node in graph.node for out in node.output}


def _check_topological(graph):
    known = {v.name for v in graph.input} | {t.name for t in graph.initializer} | {""}
    for node in graph.node:
        missing = [i for i in node.input if i not in known]
        assert not missing, f"{node.op_type} {node.name} reads {missing} before they exist"
        known.update(node.output)


@needs_training_build  # ORT's InPlaceAccumulatorV2 (the portable graph's contract: test_training_portable)
@pytest.mark.parametrize("which", ["fp32_artifacts", "fp16_artifacts", "cuda16_artifacts"])
def test_training_model_holds_the_loss_scaling_contract(which, request):
    artifacts = request.getfixturevalue(which)
    model = onnx.load(artifacts.training_model)
    graph = model.graph
    producers = _producers(graph)
    inputs = {v.name: v for v in graph.input}
    outputs = [v.name for v in graph.output]

    # The scaled loss is the first output (backprop starts there), the unscaled one next.
    assert outputs[:3] == ["loss_scaled", "loss", "all_finite"]
    scale_mul = producers["loss_scaled"]
    assert scale_mul.op_type == "Mul" and set(scale_mul.input) == {"loss", "loss_scale"}
    assert inputs["loss_scale"].type.tensor_type.elem_type == TensorProto.FLOAT
    assert graph.output[2].type.tensor_type.elem_type == TensorProto.BOOL

    # Every accumulator reads Reshape(Mul(grad, grad_weight * Reciprocal(loss_scale)), Shape(its buffer)).
    accumulators = [n for n in graph.node if n.op_type == "InPlaceAccumulatorV2"]
    assert len(accumulators) == len(artifacts.manifest["requires_grad"])
    reciprocals = [n for n in graph.node if n.op_type == "Reciprocal" and list(n.input) == ["loss_scale"]]
    assert len(reciprocals) == 1  # computed once
    unscale = producers[next(o for o in reciprocals[0].output)]
    assert unscale.op_type == "Reciprocal"
    for acc in accumulators:
        reshape = producers[acc.input[1]]
        assert reshape.op_type == "Reshape" and list(producers[reshape.input[1]].input) == [acc.input[0]]
        mul = producers[reshape.input[0]]
        assert mul.op_type == "Mul"
        factor = producers[mul.input[1]]
        assert factor.op_type == "Mul" and reciprocals[0].output[0] in factor.input
        assert "grad_weight" in factor.input
        assert producers[mul.input[0]].op_type != "InPlaceAccumulatorV2"

    # all_finite = Not(Or(IsInf(s), IsNaN(s))), s = Sum of per-gradient ReduceSums of unscaled grads.
    not_node = producers["all_finite"]
    assert not_node.op_type == "Not"
    or_node = producers[not_node.input[0]]
    assert or_node.op_type == "Or"
    assert {producers[i].op_type for i in or_node.input} == {"IsInf", "IsNaN"}
    total = producers[producers[or_node.input[0]].input[0]]
    assert total.op_type == "Sum" and len(total.input) == len(accumulators)
    unscaled = {acc.input[1] for acc in accumulators}
    assert {producers[i].input[0] for i in total.input} == unscaled
    _check_topological(graph)


@needs_training_build  # the native engine's files
@pytest.mark.parametrize("which", ["fp32_artifacts", "fp16_artifacts", "sgd_artifacts", "cuda16_artifacts"])
def test_versions_load_in_ort_1_19(which, request):
    artifacts = request.getfixturevalue(which)
    for path in (artifacts.training_model, artifacts.eval_model, artifacts.optimizer_model):
        model = onnx.load(path)
        assert model.ir_version <= 10, path
        default = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
        assert default and max(default) <= 21, path
        onnx.checker.check_model(model)
    if artifacts.target == "cpu":
        Trainer(artifacts)  # ORT itself accepts all of them


def test_cuda_artifacts_hold_real_float16(cuda16_artifacts):
    model = _graph(cuda16_artifacts)
    types = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert matmuls and all(types.get(n.output[0]) == TensorProto.FLOAT16 for n in matmuls)
    inputs = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    assert all(inputs[p] == TensorProto.FLOAT for p in cuda16_artifacts.manifest["requires_grad"])


def test_fp16_forward_is_emulated_with_fp32_master_weights(fp16_artifacts):
    model = _graph(fp16_artifacts)
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    to_half = [n for n in casts if n.attribute[0].i == TensorProto.FLOAT16]
    assert to_half, "emulation rounds through float16 Casts"
    params = set(fp16_artifacts.manifest["requires_grad"])
    inputs = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    assert all(inputs[p] == TensorProto.FLOAT for p in params)
    # MatMul weights (allow list) are read through a Cast to float16; the
    # last bias may stay float32 (its Add feeds only the float32 output).
    for weight in ("W0", "W1"):
        readers = [n for n in model.graph.node if weight in n.input]
        assert readers and all(n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT16 for n in readers)


def test_eval_model_and_manifest(fp16_artifacts):
    evaluation = _graph(fp16_artifacts, "eval_model")
    assert [v.name for v in evaluation.graph.output] == ["loss", "logits"]
    assert "loss_scale" not in {v.name for v in evaluation.graph.input}
    manifest = json.loads((fp16_artifacts.directory / "manifest.json").read_text())
    assert manifest["inputs"] == ["x", "labels"]
    assert manifest["input_dtypes"] == {"x": "float32", "labels": "int64"}
    assert manifest["precision"] == "float16" and manifest["target"] == "cpu"
    import onnxmp

    assert manifest["onnxmp_version"] == onnxmp.__version__
    assert Artifacts.load(fp16_artifacts.directory).manifest == manifest


@pytest.mark.parametrize("loss,labels", [
    ("mse", lambda y: np.eye(4, dtype=np.float32)[y]),
    ("l1", lambda y: np.eye(4, dtype=np.float32)[y]),
    ("bce_with_logits", lambda y: np.eye(4, dtype=np.float32)[y]),
])
def test_other_losses_train(tmp_path, model, batches, loss, labels):
    artifacts = build_artifacts(model, requires_grad=trainable(model), loss=loss, precision="float32",
                                out_dir=tmp_path)
    assert artifacts.inputs == ["x", "target"]
    trainer = Trainer(artifacts, lr=0.01)
    x, y = batches[0]
    first = trainer.train_step(x, labels(y)).loss
    for _ in range(5):
        last = trainer.train_step(x, labels(y)).loss
    assert last < first


def test_custom_loss_block(tmp_path, model, batches):
    artifacts = build_artifacts(model, requires_grad=trainable(model), loss=scaled_cross_entropy(2.0),
                                precision="float32", out_dir=tmp_path / "custom")
    plain = build_artifacts(model, requires_grad=trainable(model), precision="float32", out_dir=tmp_path / "plain")
    x, y = batches[0]
    doubled = Trainer(artifacts).train_step(x, y).loss
    assert doubled == pytest.approx(2 * Trainer(plain).train_step(x, y).loss, rel=1e-6)


def test_frozen_parameters_do_not_change(tmp_path, model, batches):
    artifacts = build_artifacts(model, requires_grad=["W0", "b0"], frozen=["W1", "b1"], precision="float32",
                                out_dir=tmp_path)
    trainer = Trainer(artifacts, lr=0.1)
    before = trainer.parameters()
    trainer.train_step(*batches[0])
    after = trainer.parameters()
    assert np.array_equal(before["W1"], after["W1"]) and not np.array_equal(before["W0"], after["W0"])


@pytest.mark.parametrize("builder", HERE)
def test_high_opset_and_ir_are_brought_down_for_ort_only(tmp_path, batches, builder):
    model = mlp((8, 16, 4), opset=22, ir_version=11)
    artifacts = build_artifacts(model, requires_grad=trainable(model), precision="float32", out_dir=tmp_path,
                                builder=builder)
    forward = onnx.load(artifacts.path("forward_model"))
    # ORT 1.19 loads opset <= 21; onnxmp's graphs keep the model's opset where the installed onnxruntime
    # (the portable engine's) loads it. Both IR <= 10 (onnxruntime 1.19+).
    kept = builder == "onnxmp" and runtime_loads_opset(22)
    assert forward.opset_import[0].version == (22 if kept else 21) and forward.ir_version == 10
    assert np.isfinite(Trainer(artifacts).train_step(*batches[0]).loss)


@pytest.mark.parametrize("kwargs,message", [
    ({"requires_grad": ["nope"]}, "not initializers"),
    ({"requires_grad": []}, "empty"),
    ({"requires_grad": ["W0"], "frozen": ["W0"]}, "both trainable and frozen"),
    ({"requires_grad": ["W0"], "loss": "hinge"}, "unknown loss"),
    ({"requires_grad": ["W0"], "precision": "float8"}, "unknown precision"),
    ({"requires_grad": ["W0"], "target": "tpu"}, "unknown target"),
    ({"requires_grad": ["W0"], "optimizer": "lamb"}, "unknown optimizer"),
    ({"requires_grad": ["W0"], "label_name": "x"}, "already uses"),
])
def test_user_errors(tmp_path, model, kwargs, message):
    with pytest.raises(OnnxMPError, match=message):
        build_artifacts(model, out_dir=tmp_path, **{"precision": "float32", "requires_grad": ["W0"], **kwargs})


def test_loading_a_folder_without_manifest(tmp_path):
    with pytest.raises(OnnxMPError, match="not an onnxmp training folder"):
        Artifacts.load(tmp_path)


def test_artifacts_never_replace_a_folder_of_other_files(tmp_path, model):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OnnxMPError, match="not an onnxmp training folder"):
        build_artifacts(model, requires_grad=trainable(model), precision="float32", out_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_rebuilding_replaces_an_artifacts_folder_whole(tmp_path, model):
    out = tmp_path / "art"
    build_artifacts(model, requires_grad=trainable(model), precision="float32", out_dir=out)
    (out / "stale.onnx").write_bytes(b"old")
    build_artifacts(model, requires_grad=trainable(model), precision="float32", out_dir=out)
    assert not (out / "stale.onnx").exists() and (out / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no temporary folder left


def test_a_failed_build_leaves_no_folder(tmp_path, model):
    with pytest.raises(OnnxMPError):
        build_artifacts(model, requires_grad=["W0"], frozen=["W0"], precision="float32", out_dir=tmp_path / "x")
    unused = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
g (float[N,8] x) => (float[N,4] y) { y = MatMul(x, W) }""")
    unused.graph.initializer.extend([onnx.numpy_helper.from_array(np.ones((8, 4), np.float32), "W"),
                                     onnx.numpy_helper.from_array(np.ones(4, np.float32), "b")])
    with pytest.raises(OnnxMPError, match="does not depend on.*b"):
        build_artifacts(unused, requires_grad=["W", "b"], precision="float32", out_dir=tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


def test_training_refuses_a_model_over_2gb_before_reading_a_weight(tmp_path):
    from models.large import write_sparse_model

    path = write_sparse_model(tmp_path / "m", int(2.2 * 2**30))
    with pytest.raises(OnnxMPError, match=r"2\.\d+ GB; onnxmp cannot build training artifacts over 2 GB "
                                          r"\(each gradient builder takes or writes the whole model"):
        build_artifacts(path, requires_grad=["w0"], loss="mse", out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()
