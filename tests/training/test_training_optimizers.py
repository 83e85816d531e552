"""torch's optimizers as a portable ONNX graph: AdamW / SGD equal to torch.optim step for step.

The references come from torch itself (``scripts/make_optimizer_references.py``, run where torch is
installed; torch is not an onnxmp dependency): 11 cases, 4 parameters of different shapes (a scalar
among them), 12 steps, the learning rate changing at every step.  Here the graph runs in a plain
``onnxruntime.InferenceSession``, its outputs fed back as the next step's state, and every step's
parameters and state are compared with torch's.

Tolerance, stated: every element within 1e-6 x the largest magnitude torch's tensor reaches over the
trajectory (measured: at most 1.6e-7; about 3/4 of all elements are bit-identical, plain SGD all of
them).  The graph cannot be bit-exact everywhere: torch's CPU kernels for ``lerp``, ``addcmul`` and
``add(alpha=)`` are fused multiply-adds, which ONNX has no op for, and where a result cancels (a
moment that changes sign) one rounding of the inputs is many ulps of the result.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxmp.errors import OnnxMPError
from onnxmp.training import SGD, AdamW
from onnxmp.training.optimizer_settings import ByName, optimizer_named
from onnxmp.training.build.optimizer_graphs import build_optimizer_model, build_portable_optimizer

from builders import needs_training_build

# The portable graph needs no training build (these tests run on Python 3.12 with plain onnxruntime);
# building artifacts and the native optimizer model do.
DATA = Path(__file__).parent / "data"
REFERENCES = json.loads((DATA / "optimizer_references.json").read_text())["cases"]
RTOL = 1e-6
STANDARD = {"", "ai.onnx"}


@pytest.fixture(scope="module")
def arrays():
    with np.load(DATA / "optimizer_references.npz", allow_pickle=False) as data:
        return dict(data)


def _optimizer(case: dict):
    cls = AdamW if case["optimizer"] == "adamw" else SGD
    return cls(**case["kwargs"], no_decay=case["no_decay"])


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run_case(name: str, arrays: dict, opset: int = 17):
    """Yield (step, ours, torch's) per step and per tensor, the graph's outputs fed back each step."""
    case = REFERENCES[name]
    optimizer = _optimizer(case)
    params = list(case["parameters"])
    model = build_portable_optimizer(optimizer, [(p, case["parameters"][p]) for p in params], opset,
                                     clip_global_norm=case["clip_global_norm"])
    assert {n.domain for n in model.graph.node} <= STANDARD
    session = _session(model)
    state = {}
    for p in params:
        state[p] = arrays[f"{name}/init/{p}"]
        for slot in optimizer.slots:
            state[f"{p}.{slot}"] = np.zeros_like(state[p])
    for step in range(case["steps"]):
        feeds = {"learning_rate": np.array(case["lrs"][step], np.float32), "step": np.array(step + 1, np.int64)}
        for p in params:
            feeds[p] = state[p]
            feeds[f"{p}.grad"] = np.asarray(arrays[f"{name}/grad/{p}"][step])
            for slot in optimizer.slots:
                feeds[f"{p}.{slot}"] = state[f"{p}.{slot}"]
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        for p in params:
            state[p] = outputs[f"{p}.out"]
            yield step, p, state[p], np.asarray(arrays[f"{name}/param/{p}"][step])
            for slot in optimizer.slots:
                state[f"{p}.{slot}"] = outputs[f"{p}.{slot}.out"]
                yield step, f"{p}.{slot}", state[f"{p}.{slot}"], np.asarray(arrays[f"{name}/{slot}/{p}"][step])


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_equals_torch_step_for_step(name, arrays):
    runs = list(_run_case(name, arrays))
    scale = {}
    for _, tensor, _, theirs in runs:
        scale[tensor] = max(scale.get(tensor, 0.0), float(np.abs(theirs).max()))
    for step, tensor, ours, theirs in runs:
        assert ours.shape == theirs.shape and ours.dtype == np.float32
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=RTOL * scale[tensor],
                                   err_msg=f"{name} step {step + 1} {tensor}")
    assert len(runs) >= 12 * 4 and all(scale.values())


def test_references_cover_the_contract():
    cases = REFERENCES.values()
    assert all(c["steps"] >= 10 and len(set(c["lrs"])) == c["steps"] for c in cases)
    assert any(shape == [] for c in cases for shape in c["parameters"].values())
    kwargs = [(c["optimizer"], c["kwargs"], c["no_decay"], c["clip_global_norm"]) for c in cases]
    assert any(k == "adamw" and kw.get("weight_decay", 0.01) > 0 and nd for k, kw, nd, _ in kwargs)
    assert any(k == "adamw" and kw.get("weight_decay") == 0 for k, kw, _, _ in kwargs)
    assert any(k == "adamw" and kw.get("amsgrad") for k, kw, _, _ in kwargs)
    assert any(k == "sgd" and kw.get("nesterov") for k, kw, _, _ in kwargs)
    assert any(k == "sgd" and kw.get("dampening") and kw.get("weight_decay") for k, kw, _, _ in kwargs)
    assert {k for k, _, _, clip in kwargs if clip} == {"adamw", "sgd"}


def test_no_decay_leaves_exempt_parameters_undecayed(arrays):
    """With a zero gradient, AdamW's only change at step 1 is the decay (the moments stay zero)."""
    shapes = [("enc.dense.weight", [3]), ("enc.dense.bias", [3]), ("enc.LayerNorm.weight", [3])]
    opt = AdamW(weight_decay=0.5, no_decay=("bias", "LayerNorm.weight"))
    session = _session(build_portable_optimizer(opt, shapes, 17))
    ones = np.ones(3, np.float32)
    feeds = {"learning_rate": np.array(0.1, np.float32), "step": np.array(1, np.int64)}
    for name, _ in shapes:
        feeds.update({name: ones, f"{name}.grad": 0 * ones, f"{name}.exp_avg": 0 * ones,
                      f"{name}.exp_avg_sq": 0 * ones})
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    np.testing.assert_array_equal(out["enc.dense.weight.out"], np.float32(0.95) * ones)
    np.testing.assert_array_equal(out["enc.dense.bias.out"], ones)
    np.testing.assert_array_equal(out["enc.LayerNorm.weight.out"], ones)
    entry = opt.manifest_entry([n for n, _ in shapes])
    assert entry["hyperparameters"]["no_decay"] == ["enc.dense.bias", "enc.LayerNorm.weight"]
    # a callable works as well, and the manifest's entry rebuilds the same exemptions by name
    by_callable = AdamW(no_decay=lambda n: n.endswith("bias"))
    assert [by_callable.decays(n) for n, _ in shapes] == [True, False, True]
    restored = optimizer_named(entry)
    assert [restored.decays(n) for n, _ in shapes] == [True, False, False]
    assert restored.weight_decay == 0.5 and restored.betas == (0.9, 0.999)


def test_decay_applies_to_everything_by_default():
    assert all(AdamW().decays(n) for n in ("a.bias", "LayerNorm.weight", "w"))
    assert not any(AdamW(weight_decay=0).decays(n) for n in ("a.bias", "w"))
    assert not SGD().decays("w") and SGD(weight_decay=0.1).decays("w")


def test_strings_are_torch_defaults():
    assert optimizer_named("adamw") == AdamW()
    assert (AdamW().lr, AdamW().betas, AdamW().eps, AdamW().weight_decay) == (1e-3, (0.9, 0.999), 1e-8, 1e-2)
    assert optimizer_named("sgd") == SGD()
    assert (SGD().lr, SGD().momentum, SGD().dampening, SGD().weight_decay, SGD().nesterov) == (1e-3, 0, 0, 0, False)
    adamw = AdamW(lr=0.01)
    assert optimizer_named(adamw) is adamw


def test_slots_and_signature():
    assert AdamW().slots == ("exp_avg", "exp_avg_sq")
    assert AdamW(amsgrad=True).slots == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert SGD().slots == () and SGD(momentum=0.9).slots == ("momentum_buffer",)
    model = build_portable_optimizer(SGD(momentum=0.9), [("w", [2, 3]), ("b", [])], 13)
    assert [v.name for v in model.graph.input] == ["learning_rate", "step", "w", "w.grad", "w.momentum_buffer",
                                                   "b", "b.grad", "b.momentum_buffer"]
    assert [v.name for v in model.graph.output] == ["w.out", "w.momentum_buffer.out", "b.out", "b.momentum_buffer.out"]
    assert model.opset_import[0].version == 13
    plain = build_portable_optimizer("sgd", [("w", [2])], 17)
    assert [v.name for v in plain.graph.output] == ["w.out"]
    assert "Where" not in {n.op_type for n in plain.graph.node}  # no buffer without momentum


def test_manifest_entry():
    entry = AdamW(lr=3e-4, amsgrad=True).manifest_entry(["w"], clip_global_norm=1.0)
    assert entry == {"name": "adamw", "slots": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
                     "hyperparameters": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                         "amsgrad": True, "maximize": False, "no_decay": [],
                                         "clip_global_norm": 1.0}}
    assert json.loads(json.dumps(entry)) == entry
    assert optimizer_named(entry) == AdamW(lr=3e-4, amsgrad=True, no_decay=ByName(frozenset()))
    sgd = SGD(lr=0.1, momentum=0.9, nesterov=True).manifest_entry(["w"])
    assert sgd["slots"] == ["momentum_buffer"] and optimizer_named(sgd).nesterov


@pytest.mark.parametrize("make, message", [
    (lambda: optimizer_named("adam"), "unknown optimizer 'adam'"),
    (lambda: optimizer_named(3), "unsupported optimizer 3"),
    (lambda: AdamW(betas=(0.9, 1.0)), "Invalid beta parameter at index 1"),
    (lambda: AdamW(lr=-1), "Invalid learning rate"),
    (lambda: SGD(nesterov=True), "Nesterov momentum requires a momentum and zero dampening"),
    (lambda: SGD(momentum=0.9, dampening=0.1, nesterov=True), "Nesterov momentum requires"),
    (lambda: AdamW(no_decay=[""]), "no_decay must be non-empty strings"),
    (lambda: build_portable_optimizer("adamw", [], 17), "no parameters"),
    (lambda: build_portable_optimizer("adamw", [("w", [1]), ("w", [1])], 17), "named twice"),
    (lambda: build_portable_optimizer("adamw", [("w", [1]), ("w.grad", [1])], 17), "clash"),
    (lambda: build_portable_optimizer("sgd", [("w", [1])], 17, clip_global_norm=0.0), "must be positive"),
])
def test_refusals(make, message):
    with pytest.raises(OnnxMPError, match=message):
        make()


def test_unmatched_no_decay_pattern_warns(caplog):
    AdamW(no_decay=("bias", "Norm")).manifest_entry(["w", "b.bias"])
    assert "'Norm'" in caplog.text and "match no trainable parameter" in caplog.text


@needs_training_build
def test_native_model_takes_the_objects():
    """The native (onnxblock) optimizer model is built from an object or a manifest entry as from the
    string: the native engine's update stays onnxruntime's own."""
    ops = {n.op_type for n in build_optimizer_model(AdamW(weight_decay=0.1), opset=17).graph.node}
    assert "AdamWOptimizer" in ops
    entry = SGD(momentum=0.9).manifest_entry(["w"])
    assert "SGDOptimizerV2" in {n.op_type for n in build_optimizer_model(entry, opset=17).graph.node}


@pytest.mark.parametrize("opset", [13, 17, 21])
def test_every_node_has_a_cpu_and_a_cuda_kernel(opset):
    """Plain onnxruntime's CPU and CUDA builds both register every op at its float types (the kernel
    table onnxmp ships), so the graph runs on the device that holds the parameters."""
    from onnxmp.kernels import KernelTable

    table = KernelTable.default()
    names = {onnx.TensorProto.FLOAT: "float", onnx.TensorProto.DOUBLE: "double"}
    for opt in (AdamW(amsgrad=True, maximize=True, no_decay=["b"]), SGD(momentum=0.9, nesterov=True, weight_decay=0.1)):
        model = build_portable_optimizer(opt, [("w", [2, 3]), ("b", [])], opset, clip_global_norm=1.0)
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        graph = model.graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}
        for node in graph.node:
            if node.op_type == "Constant":
                continue
            floats = {names[types[i]] for i in node.input if types.get(i) in names}
            for provider in ("CPUExecutionProvider", "CUDAExecutionProvider"):
                assert table.has_kernel(provider, "", node.op_type, opset), (provider, node.op_type)
                assert all(table.supports(provider, "", node.op_type, opset, None, t) for t in floats), \
                    (provider, node.op_type, floats)


@needs_training_build
def test_build_artifacts_takes_the_objects_and_the_manifest_rebuilds_them(tmp_path, model):
    """build_artifacts(optimizer=AdamW(...)) records the optimizer; the manifest's entry alone rebuilds
    the same portable graph (what the portable engine does), exemptions included."""
    from onnxmp.training import build_artifacts
    from onnxmp.training.models import trainable

    names = trainable(model)
    optimizer = AdamW(lr=0.01, weight_decay=0.1, no_decay=lambda n: n.startswith("b"))
    art = build_artifacts(model, requires_grad=names, optimizer=optimizer, precision="float32",
                          out_dir=tmp_path / "a")
    entry = art.manifest["optimizer"]
    assert entry["name"] == "adamw" and entry["slots"] == ["exp_avg", "exp_avg_sq"]
    assert entry["hyperparameters"]["lr"] == 0.01 and entry["hyperparameters"]["weight_decay"] == 0.1
    assert entry["hyperparameters"]["no_decay"] == [n for n in names if n.startswith("b")] != []
    shapes = [(t.name, list(t.dims)) for t in model.graph.initializer if t.name in names]
    rebuilt = build_portable_optimizer(entry, shapes, art.manifest["opset"])
    original = build_portable_optimizer(optimizer, shapes, art.manifest["opset"])
    assert rebuilt.SerializeToString() == original.SerializeToString()
    sgd = build_artifacts(model, requires_grad=names, optimizer="sgd", precision="float32", out_dir=tmp_path / "s")
    assert sgd.manifest["optimizer"] == SGD().manifest_entry(names)
    with pytest.raises(OnnxMPError, match="unknown optimizer 'adam'"):
        build_artifacts(model, requires_grad=names, optimizer="adam", precision="float32", out_dir=tmp_path / "x")


def test_a_recorded_clip_is_kept():
    entry = AdamW().manifest_entry(["w"], clip_global_norm=0.5)
    ops = {n.op_type for n in build_portable_optimizer(entry, [("w", [3])], 17).graph.node}
    assert "ReduceSumSquare" in ops
    assert "ReduceSumSquare" not in {n.op_type for n in build_portable_optimizer("adamw", [("w", [3])], 17).graph.node}
