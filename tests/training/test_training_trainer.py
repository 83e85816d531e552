"""Trainer semantics: skipped steps, scale growth, resume, accumulation, clipping."""
import math

import numpy as np
import onnx
import pytest

from onnxmp.errors import OnnxMPError
from onnxmp.training import DynamicLossScaler, Trainer, build_artifacts
from onnxmp.training.models import scaled_cross_entropy, trainable


def with_nan(batch, value=np.nan):
    x, y = batch
    x = x.copy()
    x[0, 0] = value
    return x, y


def assert_same_parameters(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_batch_skips_the_step(fp16_artifacts, batches, bad):
    trainer = Trainer(fp16_artifacts, scaler=DynamicLossScaler(2.0**10))
    trainer.train_step(*batches[0])
    before = trainer.parameters()
    steps = trainer.optimizer_steps

    result = trainer.train_step(*with_nan(batches[1], bad))

    assert not result.all_finite and not result.stepped and result.skipped
    assert result.loss_scale == 2.0**10
    assert_same_parameters(before, trainer.parameters())  # bit-identical
    assert trainer.optimizer_steps == steps and trainer.skipped_steps == 1
    assert trainer.scaler.scale == 2.0**9


def test_skipped_step_leaves_optimizer_state_untouched(fp32_artifacts, batches):
    """AdamW's bias correction reads ORT's step count and moments: if the skipped
    step had moved them, the next update would differ from a run without it.
    Power-of-two loss scales are exact in float32, so the comparison is bit for bit."""
    clean = Trainer(fp32_artifacts, scaler=DynamicLossScaler(4.0))
    with_skip = Trainer(fp32_artifacts, scaler=DynamicLossScaler(4.0))
    for batch in batches[:3]:
        clean.train_step(*batch)
    # Non-finite through the gradients only (an infinite scale): a NaN loss in float32 is an error now.
    with_skip.train_step(*batches[0])
    with_skip.scaler.scale = math.inf
    assert with_skip.train_step(*batches[5]).skipped
    with_skip.scaler.scale = 4.0
    for batch in batches[1:3]:
        with_skip.train_step(*batch)
    assert clean.scaler.scale == 4.0
    assert_same_parameters(clean.parameters(), with_skip.parameters())
    assert clean.optimizer_steps == with_skip.optimizer_steps == 3


def test_good_steps_double_the_scale(fp16_artifacts, batches):
    trainer = Trainer(fp16_artifacts, scaler=DynamicLossScaler(2.0**8, growth_steps=3))
    scales = [trainer.train_step(*b).loss_scale for b in batches[:7]]
    assert scales == [256.0] * 3 + [512.0] * 3 + [1024.0]
    assert trainer.scaler.scale == 1024.0


def test_overflowing_scale_backs_off_then_trains(fp16_artifacts, batches):
    """fp16 emulation overflows gradients at a huge scale: steps skip until it fits."""
    trainer = Trainer(fp16_artifacts, scaler=DynamicLossScaler(2.0**24, max_scale=2.0**24), lr=0.01)
    results = [trainer.train_step(*b) for b in batches]
    assert results[0].skipped
    assert any(r.stepped for r in results)
    assert trainer.scaler.scale < 2.0**24


def test_resume_reproduces_the_uninterrupted_run(tmp_path, fp16_artifacts, batches):
    sequence = [*batches[:3], with_nan(batches[3]), *batches[4:10]]

    def make(path=None):
        if path is not None:
            return Trainer.resume(path)
        return Trainer(fp16_artifacts, scaler=DynamicLossScaler(2.0**12, growth_steps=2), lr=0.01)

    reference = make()
    expected = [reference.train_step(*b) for b in sequence]

    first = make()
    got = [first.train_step(*b) for b in sequence[:5]]
    first.save(tmp_path / "saved")
    del first
    resumed = make(tmp_path / "saved")
    assert resumed.optimizer_steps == 4 and resumed.skipped_steps == 1
    got += [resumed.train_step(*b) for b in sequence[5:]]

    assert np.array_equal([r.loss for r in got], [r.loss for r in expected], equal_nan=True)
    assert [r.loss_scale for r in got] == [r.loss_scale for r in expected]
    assert_same_parameters(reference.parameters(), resumed.parameters())
    assert resumed.learning_rate == reference.learning_rate


def test_resume_keeps_settings_and_refuses_plain_artifacts(tmp_path, fp32_artifacts, batches):
    trainer = Trainer(fp32_artifacts, grad_accum_steps=2, clip_global_norm=0.5, lr=0.02)
    trainer.train_step(*batches[0])
    with pytest.raises(OnnxMPError, match="middle of an accumulated batch"):
        trainer.save(tmp_path / "s")
    trainer.train_step(*batches[1])
    trainer.save(tmp_path / "s")
    resumed = Trainer.resume(tmp_path / "s")
    assert (resumed.grad_accum_steps, resumed.clip_global_norm) == (2, 0.5)
    assert resumed.learning_rate == pytest.approx(0.02)
    with pytest.raises(OnnxMPError, match="no saved training state"):
        Trainer.resume(fp32_artifacts.directory)


@pytest.mark.parametrize("which", ["sgd_artifacts", "fp32_artifacts"])
def test_accumulation_equals_one_big_batch(which, request, batches):
    artifacts = request.getfixturevalue(which)
    k = 4
    micro = batches[:k]
    big = (np.concatenate([b[0] for b in micro]), np.concatenate([b[1] for b in micro]))

    accumulated = Trainer(artifacts, grad_accum_steps=k, lr=0.05)
    results = [accumulated.train_step(*b) for b in micro]
    assert [r.stepped for r in results] == [False] * (k - 1) + [True]
    single = Trainer(artifacts, lr=0.05)
    single.train_step(*big)

    a, b = accumulated.parameters(), single.parameters()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert accumulated.optimizer_steps == single.optimizer_steps == 1


def test_accumulation_skips_the_whole_effective_batch(fp16_artifacts, batches):
    trainer = Trainer(fp16_artifacts, grad_accum_steps=3, scaler=DynamicLossScaler(2.0**10))
    before = trainer.parameters()
    results = [trainer.train_step(*b) for b in (batches[0], with_nan(batches[1]), batches[2])]
    assert [r.all_finite for r in results] == [True, False, True]
    assert results[-1].skipped and not any(r.stepped for r in results)
    assert_same_parameters(before, trainer.parameters())
    assert trainer.scaler.scale == 2.0**9
    # the buffers were reset: the next effective batch equals a fresh trainer's first one
    fresh = Trainer(fp16_artifacts, grad_accum_steps=3, scaler=DynamicLossScaler(2.0**9))
    for t in (trainer, fresh):
        for b in batches[3:6]:
            t.train_step(*b)
    assert_same_parameters(fresh.parameters(), trainer.parameters())


def test_global_norm_clipping_on_unscaled_gradients(sgd_artifacts, batches):
    """SGD: w' = w - lr * g * min(1, c / (|g| + 1e-6)), with g the unscaled mean gradient."""
    lr, clip = 0.5, 0.01
    probe = Trainer(sgd_artifacts, lr=lr, scaler=DynamicLossScaler.static(2.0**10), grad_accum_steps=2)
    before = probe.parameters()
    for b in batches[:2]:
        probe.engine.train(_feeds(probe, b))  # accumulate without stepping, to read the gradients
    grads = probe.gradients()
    norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    assert norm > clip

    trainer = Trainer(sgd_artifacts, lr=lr, scaler=DynamicLossScaler.static(2.0**10), grad_accum_steps=2,
                      clip_global_norm=clip)
    for b in batches[:2]:
        result = trainer.train_step(*b)
    assert result.stepped
    after = trainer.parameters()
    factor = clip / (norm + 1e-6)
    for name in before:
        np.testing.assert_allclose(after[name], before[name] - lr * factor * grads[name], rtol=1e-4, atol=1e-7)


def _feeds(trainer, batch):
    feeds = trainer.feeds(batch)
    feeds["loss_scale"] = np.array(trainer.scaler.scale, np.float32)
    feeds["grad_weight"] = np.array(1.0 / trainer.grad_accum_steps, np.float32)
    return feeds


def test_emulated_fp16_underflow_needs_loss_scaling(tmp_path, model, batches):
    """A loss scaled by 2**-20 has gradients below fp16's range: with scale 1
    the emulated fp16 backward flushes them to zero, a large scale keeps them."""
    def build(precision):
        return build_artifacts(model, requires_grad=trainable(model), loss=scaled_cross_entropy(2.0**-20),
                               optimizer="sgd", precision=precision, target="cpu", out_dir=tmp_path / precision)

    def first_layer_grad(artifacts, scale):
        trainer = Trainer(artifacts, scaler=DynamicLossScaler.static(scale))
        trainer.engine.train(_feeds(trainer, batches[0]))
        return trainer.gradients()["W0"]

    def error(grad):
        return np.linalg.norm(grad - reference) / np.linalg.norm(reference)

    reference = first_layer_grad(build("float32"), 1.0)
    half = build("float16")
    assert error(first_layer_grad(half, 1.0)) > 0.3  # flushed to zero or to a few subnormal steps
    assert error(first_layer_grad(half, 2.0**15)) < 0.01


def test_fit_evaluate_and_history(fp16_artifacts, batches):
    trainer = Trainer(fp16_artifacts, lr=0.01, scaler=DynamicLossScaler(2.0**10, growth_steps=5))
    before = trainer.evaluate(batches[10:], ["accuracy"])
    history = trainer.fit(batches[:10], epochs=3, eval_batches=batches[10:], metrics=["accuracy"], progress=False)
    assert len(history.step_loss) == 30 and len(history.epochs) == 3
    assert history.step_loss_scale[::5] == [2.0**k for k in range(10, 16)]  # grew every 5 steps
    assert trainer.scaler.scale == 2.0**16
    last = history.epochs[-1]
    assert last["eval_loss"] < before["loss"] and 0 <= last["eval_accuracy"] <= 1
    assert trainer.epoch == 3
    again = trainer.fit(batches[:10], epochs=3, progress=False)
    assert again.step_loss == []  # epochs counts the total


def test_fit_with_a_batch_function_and_partial_accumulation(fp32_artifacts, batches):
    seen = []

    def epoch_batches(epoch):
        seen.append(epoch)
        return batches[:5]

    trainer = Trainer(fp32_artifacts, grad_accum_steps=2)
    trainer.fit(epoch_batches, epochs=2, progress=False)
    assert seen == [0, 1]
    assert trainer.optimizer_steps == 6  # 2 full + 1 partial effective batch per epoch


def test_export_inference(tmp_path, fp16_artifacts, batches):
    import onnxruntime as ort

    from onnxmp.parity.emulate import emulate

    trainer = Trainer(fp16_artifacts, lr=0.01)
    for b in batches[:4]:
        trainer.train_step(*b)
    fp32 = trainer.export_inference(tmp_path / "fp32.onnx", precision="float32")
    fp16 = trainer.export_inference(tmp_path / "fp16.onnx", precision="float16")

    model = onnx.load(fp32)
    trained = trainer.parameters()
    for init in model.graph.initializer:
        assert np.array_equal(onnx.numpy_helper.to_array(init), trained[init.name])
    half = onnx.load(fp16)
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in half.graph.initializer) or any(
        n.op_type == "Cast" for n in half.graph.node)

    x = batches[11][0]
    want = ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    emulated = emulate(half).SerializeToString()  # real fp16 cannot run on the CPU EP
    got = ort.InferenceSession(emulated, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    eval_logits = trainer.evaluate([batches[11]], [("logits", lambda y, p: float(np.abs(p - got).max()))])
    assert eval_logits["logits"] < 1e-2  # the emulated training graph computes what the export computes


def test_device_and_batch_errors(fp16_artifacts, tmp_path, model, batches):
    with pytest.raises(OnnxMPError, match="unknown device"):
        Trainer(fp16_artifacts, device="tpu")
    with pytest.raises(OnnxMPError, match="needs 2 arrays"):
        Trainer(fp16_artifacts).train_step(batches[0][0])
    with pytest.raises(OnnxMPError, match="rejected the batch"):
        Trainer(fp16_artifacts).train_step(np.zeros((4, 3), np.float32), np.zeros(4, np.int64))
    cuda = build_artifacts(model, requires_grad=trainable(model), precision="float16", target="cuda",
                           out_dir=tmp_path)
    with pytest.raises(OnnxMPError, match="(no CUDA|CPU EP cannot run)"):
        Trainer(cuda, device="cpu")


def test_lr_schedule_counts_applied_updates_only(fp32_artifacts, batches):
    calls = []

    def schedule(step):
        calls.append(step)
        return 0.1 / (step + 1)

    trainer = Trainer(fp32_artifacts, lr_schedule=schedule)
    trainer.train_step(*batches[0])
    skip_through_gradients(trainer, batches[1])
    for b in batches[2:4]:
        trainer.train_step(*b)
    assert calls == [0, 1, 2]
    assert trainer.learning_rate == pytest.approx(0.1 / 3)


def skip_through_gradients(trainer, batch):
    """A skipped update whose loss is finite: an infinite scale overflows only the gradients."""
    scale = trainer.scaler.scale
    trainer.scaler.scale = math.inf
    assert trainer.train_step(*batch).skipped
    trainer.scaler.scale = scale


def test_named_schedule_sets_lr_per_applied_update_and_resumes(fp32_artifacts, batches, tmp_path):
    """Hugging Face's warmup: the first update runs at lr 0 (weights unchanged), then linear decay;
    a skipped update does not advance it; the schedule and base lr are saved with the state."""
    from onnxmp.training.run.schedules import Schedule

    trainer = Trainer(fp32_artifacts, lr=0.1, schedule="linear", warmup_steps=2, total_steps=6)
    before = trainer.parameters()
    trainer.train_step(*batches[0])
    assert trainer.learning_rate == 0.0
    assert_same_parameters(before, trainer.parameters())
    skip_through_gradients(trainer, batches[1])
    trainer.train_step(*batches[2])
    assert trainer.learning_rate == pytest.approx(0.05)
    trainer.save(tmp_path / "state")
    resumed = Trainer.resume(tmp_path / "state")
    assert resumed.schedule == Schedule("linear", 2, 6) and resumed.base_lr == 0.1
    for t in (trainer, resumed):
        for b in batches[3:5]:
            t.train_step(*b)
    assert trainer.learning_rate == resumed.learning_rate == pytest.approx(0.1 * 3 / 4)
    assert_same_parameters(trainer.parameters(), resumed.parameters())
    with pytest.raises(OnnxMPError, match="both set the learning rate"):
        Trainer(fp32_artifacts, schedule="constant", lr_schedule=lambda step: 0.1)
    with pytest.raises(OnnxMPError, match="needs total_steps"):
        Trainer(fp32_artifacts, schedule="cosine")


def test_nan_loss_in_float32_is_an_error_not_a_silent_skip(fp32_artifacts, batches):
    trainer = Trainer(fp32_artifacts)
    trainer.train_step(*batches[0])
    with pytest.raises(OnnxMPError, match="the loss is nan in float32"):
        trainer.train_step(*with_nan(batches[1]))


def test_scaler_settings_and_threads(fp16_artifacts, batches):
    trainer = Trainer(fp16_artifacts, scaler={"init_scale": 2.0**24, "growth_interval": 2}, threads=1)
    assert trainer.train_step(*batches[0]).loss_scale == 2.0**24
    assert trainer.scaler.growth_interval == 2 and trainer.scaler.init_scale == 2.0**24
    with pytest.raises(OnnxMPError, match="threads must be"):
        Trainer(fp16_artifacts, threads=-1)


def test_accuracy_skips_ignored_labels():
    from onnxmp.training.run.metrics import accuracy, metric_functions, token_accuracy

    logits = np.eye(3, dtype=np.float32)[None].repeat(2, 0)  # position t predicts class t
    labels = np.array([[0, 1, -100], [0, 2, 2]])
    assert accuracy(labels, logits) == pytest.approx(4 / 5)
    assert accuracy(np.array([[-100, -100, -100]]), logits[:1]) != accuracy(np.array([[-100, -100, -100]]),
                                                                             logits[:1])  # NaN: none labelled
    # Shifted: logits at t against labels at t + 1 -> [1, -100] and [2, 2] against predictions [0, 1].
    assert token_accuracy(labels, logits) == pytest.approx(0 / 3)
    assert token_accuracy(np.array([[5, 0, 1]]), logits[:1]) == 1.0
    (name, fn), = metric_functions(["accuracy"], ignore_index=2)
    assert name == "accuracy" and fn(labels, logits) == pytest.approx(3 / 4)  # -100 counts, 2 not


def test_fit_shows_a_progress_bar(fp16_artifacts, batches, capsys):
    Trainer(fp16_artifacts).fit(batches[:3], epochs=1, progress=True)
    err = capsys.readouterr().err
    assert "epoch 1/1" in err and "scale=" in err and "skipped=" in err


def test_unloadable_artifacts_give_one_line_without_ort_source_location(fp32_artifacts, tmp_path):
    """onnxruntime prefixes its reason with a C++ file and signature; the error keeps the reason only."""
    import shutil

    copy = tmp_path / "artifacts"
    shutil.copytree(fp32_artifacts.directory, copy)
    # The graph the engine loads: the native one where ORT's builder made the folder, else the portable one.
    training = copy / (fp32_artifacts.training_model if fp32_artifacts.has_native
                       else fp32_artifacts.portable_path("training_model")).name
    training.write_bytes(training.read_bytes()[:100])
    with pytest.raises(OnnxMPError) as info:
        Trainer(copy)
    message = info.value.message
    assert ("cannot load the artifacts" in message or "cannot load the portable graphs" in message) and "\n" not in message
    assert "onnxruntime_src" not in message and "::" not in message
