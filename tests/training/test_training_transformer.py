"""The bundled BERT-style classifier (models.zoo.transformer_classifier) trains in fp32 and fp16,
reproducibly, and a non-finite step never reaches its weights."""
import hashlib
import subprocess
import sys

import numpy as np
import onnx
from onnx import numpy_helper
import pytest

from models import zoo
from onnxmp.errors import OnnxMPError
from onnxmp.training import DynamicLossScaler, Trainer, build_artifacts
from onnxmp.training.models import trainable

from builders import needs_training_build

ROWS, BATCH = 256, 32


@pytest.fixture(scope="module")
def classifier():
    return zoo.transformer_classifier()


@pytest.fixture(scope="module")
def task():
    data = zoo.classifier_task(ROWS, seed=0)
    return [tuple(data[k][i:i + BATCH] for k in ("input_ids", "attention_mask", "labels"))
            for i in range(0, ROWS, BATCH)]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, classifier):
    return {precision: build_artifacts(classifier, requires_grad=trainable(classifier), precision=precision,
                                       target="cpu", out_dir=tmp_path_factory.mktemp(precision))
            for precision in ("float32", "float16")}


def _digest(trainer):
    return hashlib.sha256(b"".join(v.tobytes() for _, v in sorted(trainer.parameters().items()))).hexdigest()


def test_the_exported_inference_model_is_unchanged(artifacts, classifier):
    forward = onnx.load(artifacts["float32"].path("forward_model"))
    assert forward.graph == classifier.graph  # still single-output LayerNormalization
    prepared = artifacts["float32"].manifest["prepared_for_gradient"]
    rows = {row["op_type"]: row["nodes"] for row in prepared}
    if artifacts["float32"].builder == "onnxmp":
        # onnxmp's builder differentiates LayerNormalization and sums broadcasts back from the symbolic
        # shapes itself: a float32 build skips every rewrite only ORT's builder needs (prepare.ORT_ONLY);
        # what is left is each layer's exported erf GELU fused into one Gelu (build/fuse.py)
        assert rows == {"Gelu": zoo.TC_LAYERS}
        return
    assert rows.pop("LayerNormalization") == 1 + 2 * zoo.TC_LAYERS
    # The residual and mask Adds of tensors whose dims onnx could not name alike: summed back by
    # runtime shapes (prepare._runtime_broadcast).
    assert set(rows) == {"Add"}


def test_fp32_and_fp16_both_learn_and_agree(artifacts, task):
    evaluation = zoo.classifier_task(128, seed=1)
    eval_batches = [(evaluation["input_ids"], evaluation["attention_mask"], evaluation["labels"])]
    results = {}
    for precision, folder in artifacts.items():
        trainer = Trainer(folder, lr=3e-3)
        initial = trainer.evaluate(eval_batches)["loss"]
        history = trainer.fit(task, 3, eval_batches, ["accuracy"], progress=False)
        results[precision] = (initial, history.epochs[-1])
    initial = results["float32"][0]
    for precision, (_, last) in results.items():
        assert last["eval_loss"] < 0.3 * initial, precision
        assert last["eval_accuracy"] >= 0.95, precision
    gap = abs(results["float16"][1]["eval_loss"] - results["float32"][1]["eval_loss"])
    assert gap <= 0.1 * initial


def test_non_finite_step_reaches_neither_weights_nor_optimizer_state(artifacts, task):
    # A scale of 2**127 overflows float16 in the emulated backward pass: the step must be skipped,
    # and the next (finite) step must then give exactly what a trainer that never saw it gives.
    poisoned = Trainer(artifacts["float16"], lr=1e-3,
                       scaler=DynamicLossScaler(2.0**127, backoff_factor=2.0**-127, min_scale=1.0,
                                                max_scale=2.0**127))
    before = _digest(poisoned)
    bad = poisoned.train_step(*task[0])
    assert not bad.all_finite and bad.skipped and _digest(poisoned) == before
    good = poisoned.train_step(*task[1])
    assert good.all_finite and good.stepped and np.isfinite(good.loss)

    clean = Trainer(artifacts["float16"], lr=1e-3, scaler=DynamicLossScaler.static(1.0))
    clean.train_step(*task[1])
    assert _digest(poisoned) == _digest(clean)  # moments and step count were untouched too
    for _ in range(3):
        assert np.isfinite(poisoned.train_step(*task[2]).loss)


def test_runs_with_clipping_are_bit_identical(artifacts, task):
    digests = set()
    for _ in range(3):
        trainer = Trainer(artifacts["float32"], lr=1e-2, clip_global_norm=0.05)
        for batch in task:
            trainer.train_step(*batch)
        digests.add(_digest(trainer))
    assert len(digests) == 1


def test_fp16_first_step_in_a_fresh_process(artifacts, task, tmp_path):
    np.savez(tmp_path / "batch.npz", *task[0])
    code = (f"import numpy as np; from onnxmp.training import Trainer\n"
            f"b = np.load({str(tmp_path / 'batch.npz')!r}); t = Trainer({str(artifacts['float16'].directory)!r})\n"
            f"r = t.train_step(b['arr_0'], b['arr_1'], b['arr_2']); print(r.loss, r.all_finite)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loss, finite = proc.stdout.split()
    assert np.isfinite(float(loss)) and finite == "True"


@pytest.mark.parametrize("fill", ["mul", "where"])
def test_the_mask_fill_is_replaced_within_float16_range_in_the_fp16_training_graph(artifacts, fill, tmp_path, task):
    # (1 - mask) * finfo.min or Where(..., finfo.min, ...): -inf in float16, and 0 * -inf is NaN.
    # The conversion replaces the fill (docs/coloring.md, mask fills), so attention trains in float16.
    folder = artifacts["float16"] if fill == "mul" else build_artifacts(
        zoo.transformer_classifier(mask_fill=fill), requires_grad=trainable(zoo.transformer_classifier(fill)),
        precision="float16", target="cpu", out_dir=tmp_path / fill)
    # The graph the engine runs: ORT's native one where its builder made the folder, else the portable one.
    model = onnx.load(folder.training_model if folder.has_native else folder.portable_path("training_model"))
    constants = [numpy_helper.to_array(t) for t in model.graph.initializer]
    constants += [numpy_helper.to_array(a.t) for n in model.graph.node if n.op_type == "Constant"
                  for a in n.attribute if a.name == "value"]
    floats = [c for c in constants if c.dtype.kind == "f" and c.size]
    assert min(float(c.min()) for c in floats) >= -65504  # no fill left below float16's range
    assert any((c == -49152).any() for c in floats)  # the fill, replaced (one mask: -1.5 * 2**15)
    assert len([n for n in model.graph.node if n.op_type == "Softmax"]) == zoo.TC_LAYERS
    trainer = Trainer(folder, lr=1e-3)
    for batch in task[:3]:
        result = trainer.train_step(*batch)
        assert result.all_finite and np.isfinite(result.loss)


def test_resume_refuses_to_drop_an_lr_schedule(artifacts, task, tmp_path):
    trainer = Trainer(artifacts["float32"], lr_schedule=lambda step: 1e-3 / (1 + step))
    trainer.train_step(*task[0])
    trainer.save(tmp_path / "state")
    with pytest.raises(OnnxMPError, match="lr_schedule"):
        Trainer.resume(tmp_path / "state")
    resumed = Trainer.resume(tmp_path / "state", lr_schedule=lambda step: 1e-3 / (1 + step))
    assert resumed.optimizer_steps == 1


@needs_training_build  # ORT's GatherGrad is the reference
def test_deterministic_embedding_gradient_equals_ort_gather_grad(classifier, task, tmp_path, monkeypatch):
    import onnxmp.training.build.pipeline as module

    def one_sgd_step(folder):
        trainer = Trainer(folder, lr=1.0)
        before = trainer.parameters()
        trainer.train_step(*task[0])
        return {k: v - before[k] for k, v in trainer.parameters().items()}

    ours = build_artifacts(classifier, requires_grad=trainable(classifier), precision="float32",
                           optimizer="sgd", out_dir=tmp_path / "ours")
    assert "GatherGrad" not in {n.op_type for n in onnx.load(ours.training_model).graph.node}
    monkeypatch.setattr(module, "deterministic_gather_grads", lambda model: 0)
    theirs = build_artifacts(classifier, requires_grad=trainable(classifier), precision="float32",
                             optimizer="sgd", out_dir=tmp_path / "theirs")
    assert "GatherGrad" in {n.op_type for n in onnx.load(theirs.training_model).graph.node}
    a, b = one_sgd_step(ours), one_sgd_step(theirs)
    for name in ("embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight"):
        assert np.abs(a[name]).max() > 0
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-7)


def test_clipping_scales_by_the_global_norm(tmp_path, model, batches):
    # SGD with lr 1: an update is minus the (clipped) gradient.
    from onnxmp.training.models import trainable as names

    folder = build_artifacts(model, requires_grad=names(model), precision="float32", optimizer="sgd",
                             out_dir=tmp_path)

    def update(clip):
        trainer = Trainer(folder, lr=1.0, clip_global_norm=clip)
        before = trainer.parameters()
        trainer.train_step(*batches[0])
        return {k: before[k] - v for k, v in trainer.parameters().items()}

    grads = update(None)
    norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    clipped = update(norm / 4)
    for name, g in grads.items():
        np.testing.assert_allclose(clipped[name], g * (norm / 4) / (norm + 1e-6), rtol=1e-4, atol=1e-7)
    unclipped = update(norm * 4)
    for name, g in grads.items():
        np.testing.assert_array_equal(unclipped[name], g)
