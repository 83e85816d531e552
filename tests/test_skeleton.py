"""models/exports/skeleton.py: base-size exports committed without their weights."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnxmp

EXPORTS = Path(__file__).resolve().parents[1] / "models" / "exports"
sys.path.insert(0, str(EXPORTS))
import skeleton  # noqa: E402


def signature(model: onnx.ModelProto):
    """What a conversion decides: the ops with their Cast targets, and every initializer's type."""
    ops = Counter((n.op_type, tuple(a.i for a in n.attribute if a.name == "to")) for n in model.graph.node)
    return ops, sorted((t.name, t.data_type, tuple(t.dims)) for t in model.graph.initializer)


@pytest.mark.parametrize("name", ["bert2.torchscript14", "mpnet.torchscript17", "resnet.torchscript17"])
def test_inflated_skeleton_converts_like_the_export(monkeypatch, name):
    monkeypatch.setattr(skeleton, "KEEP", 16)  # the small exports' weights would all be kept otherwise
    original = onnx.load(str(EXPORTS / f"{name}.onnx"))
    shrunk = skeleton.shrink(original)
    assert len(shrunk.graph.initializer) < len(original.graph.initializer)
    first, second = skeleton.inflate(shrunk), skeleton.inflate(shrunk)
    assert [p.key for p in first.metadata_props] == [p.key for p in original.metadata_props]
    for a, b in zip(first.graph.initializer, second.graph.initializer):
        assert a.name == b.name and np.array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))
    drawn = {t.name: numpy_helper.to_array(t) for t in first.graph.initializer}
    for t in original.graph.initializer:
        values = numpy_helper.to_array(t)
        assert drawn[t.name].shape == values.shape and drawn[t.name].dtype == values.dtype
        if values.size > 16 and values.dtype == np.float32 and values.std() > 0:
            assert abs(drawn[t.name].std() / values.std() - 1) < 0.5  # the same scale, drawn again
    assert signature(onnxmp.convert(first).model) == signature(onnxmp.convert(original).model)


def test_a_model_that_is_no_skeleton_inflates_to_itself():
    model = onnx.load(str(EXPORTS / "bert2.torchscript17.onnx"))
    assert skeleton.inflate(model) is model


def test_committed_skeletons_are_small_and_complete():
    entries = skeleton.manifest()
    assert {e["arch"] for e in entries.values()} >= {"bert_base", "bert_base_m1e9", "mpnet_base", "resnet50"}
    for key, entry in entries.items():
        path = skeleton.SPEED_DIR / entry["file"]
        assert path.stat().st_size < 1_000_000, key
        model = onnx.load(str(path))
        assert any(p.key == skeleton.KEY for p in model.metadata_props), key
        assert {i["name"] for i in entry["inputs"]} == {i.name for i in model.graph.input}, key


def test_inflated_base_model_runs():
    import onnxruntime as ort
    import export_speed

    entry = skeleton.manifest()["mobilenetv2.torchscript17"]
    model = skeleton.load(skeleton.SPEED_DIR / entry["file"])
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, export_speed.feeds(entry, shapes="trace"))
    assert logits.shape == (2, 1000) and np.isfinite(logits).all()
