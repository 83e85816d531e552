"""The committed test models: current with models.zoo, valid, and runnable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from models import zoo

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
REGEN = "stale; run `python models/generate.py`"


def _session(model: onnx.ModelProto | bytes) -> ort.InferenceSession:
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


def _load_npz(name: str) -> dict[str, np.ndarray]:
    with np.load(MODELS_DIR / f"{name}.inputs.npz") as npz:
        return {k: npz[k] for k in npz.files}


@pytest.mark.parametrize("name", zoo.COMMITTED)
def test_committed_file_matches_zoo(name):
    path = MODELS_DIR / f"{name}.onnx"
    assert path.exists(), REGEN
    assert path.read_bytes() == zoo.build(name).SerializeToString(), f"{path.name} {REGEN}"
    assert path.stat().st_size < 2 * 1024 * 1024


@pytest.mark.parametrize("name", zoo.COMMITTED)
def test_committed_inputs_match_zoo(name):
    stored = _load_npz(name)
    fresh = zoo.inputs_for(name)
    assert stored.keys() == fresh.keys(), REGEN
    for k in fresh:
        assert stored[k].dtype == fresh[k].dtype and np.array_equal(stored[k], fresh[k]), f"{name}.{k} {REGEN}"


@pytest.mark.parametrize("name", zoo.COMMITTED)
def test_builders_are_deterministic(name):
    assert zoo.build(name).SerializeToString() == zoo.build(name).SerializeToString()


@pytest.mark.parametrize("name", zoo.COMMITTED)
def test_committed_model_is_valid_and_runs(name):
    model = onnx.load(MODELS_DIR / f"{name}.onnx")
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == zoo.IR_VERSION
    assert [(o.domain, o.version) for o in model.opset_import] == [("", zoo.OPSET)]

    feeds = _load_npz(name)
    assert {i.name for i in model.graph.input} == set(feeds)
    for vi in model.graph.input:
        dims = [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim]
        assert len(dims) == feeds[vi.name].ndim
        for declared, actual in zip(dims, feeds[vi.name].shape):
            assert declared == actual or isinstance(declared, str)

    outs = _session(model).run(None, feeds)
    assert len(outs) == len(model.graph.output)
    for out in outs:
        assert out.dtype == np.float32
        assert np.isfinite(out).all()
        # Realistic weights keep logits/activations O(1); fp16 tests rely on it.
        assert 0 < np.abs(out).max() < 100


def test_bigvar_really_exceeds_fp16():
    inits = {t.name: numpy_helper.to_array(t) for t in zoo.cnn_bn_bigvar().graph.initializer}
    var = inits[f"{zoo.BIGVAR_LAYER}.running_var"]
    assert var.max() > zoo.FP16_MAX
    with np.errstate(over="ignore"):
        assert np.isinf(var.astype(np.float16)).any()
    # Everything else stays fp16-representable, so only that BN must stay fp32.
    for name, arr in inits.items():
        if name != f"{zoo.BIGVAR_LAYER}.running_var":
            assert np.abs(arr).max() < zoo.FP16_MAX, name


def test_bigvar_computes_same_function_as_cnn_bn():
    feeds = zoo.inputs_for("cnn_bn")
    a = _session(zoo.cnn_bn()).run(None, feeds)[0]
    b = _session(zoo.cnn_bn_bigvar()).run(None, feeds)[0]
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_loop_if_both_branches_run():
    sess = _session(zoo.loop_if())
    x = zoo.inputs_for("loop_if")["x"]
    assert x.sum() > 0  # sample input takes then_branch
    then_out = sess.run(None, {"x": x})[0]
    else_out = sess.run(None, {"x": -x})[0]
    assert np.isfinite(then_out).all() and np.isfinite(else_out).all()
    assert not np.allclose(then_out, else_out)


def test_transformer_mask_is_applied():
    feeds = zoo.inputs_for("transformer_block")
    mask = feeds["mask"]
    assert set(np.unique(mask)) == {0.0, 1.0} and (mask == 0).any()
    sess = _session(zoo.transformer_block())
    y = sess.run(None, feeds)[0]
    # Changing a padded position must not affect unpadded ones in that row.
    row = int(np.nonzero((mask == 0).any(axis=1))[0][0])
    pad = int(np.nonzero(mask[row] == 0)[0][0])
    x2 = feeds["x"].copy()
    x2[row, pad] += 5.0
    y2 = sess.run(None, {"x": x2, "mask": mask})[0]
    keep = mask[row] == 1
    np.testing.assert_allclose(y[row, keep], y2[row, keep], atol=1e-5)


def test_transformer_stack_17_has_1000_nodes_and_runs():
    model = zoo.transformer_stack(17)
    assert len(model.graph.node) >= 1000
    feeds = zoo.inputs_for("transformer_stack")
    y = _session(model).run(None, feeds)[0]
    assert y.shape == feeds["x"].shape
    assert np.isfinite(y).all() and np.abs(y).max() < 100


def test_transformer_stack_custom_dims():
    model = zoo.transformer_stack(2, hidden=32, seq=8, heads=2)
    feeds = zoo.inputs_for("transformer_stack", batch=3, seq=8, hidden=32)
    y = _session(model).run(None, feeds)[0]
    assert y.shape == (3, 8, 32) and np.isfinite(y).all()


def test_generate_into_a_file_is_a_usage_error(tmp_path, capsys):
    from models.generate import main

    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "file")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and "cannot create --out" in err
