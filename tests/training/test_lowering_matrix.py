"""The lowered training and eval models of real exports give the native models' outputs.

A handful of the export matrix, chosen to cover every op the matrix's graphs lower (the whole
matrix: ``scripts/check_lowering.py``, whose functions these tests call).  The native graph runs
on onnxruntime-training's CPU kernels (the oracle); the lowered one has only standard ops and the
com.microsoft ops plain onnxruntime registers.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxmp.passes import PassManager
from onnxmp.training.build.pipeline import STAGES, TrainingBuild, Write
from onnxmp.training.build.lower import check_lowered

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_lowering", ROOT / "scripts" / "check_lowering.py")
check = importlib.util.module_from_spec(_spec)
sys.modules["check_lowering"] = check
_spec.loader.exec_module(check)

pytestmark = pytest.mark.slow

# Between them: ConvGrad, MaxPoolGrad, ReluGrad (resnet); SliceGrad, Scale, DivGrad, GeluGrad,
# TanhGrad (bert_masked_fill); GatherElementsGrad, LayerNormalizationGrad (deberta); GatherNDGrad
# (gpt2 dynamo); FastGeluGrad, SplitTraining (gpt2); ConcatTraining, SoftmaxGrad_13, BroadcastGradientArgs,
# SoftmaxCrossEntropyLossGrad and InPlaceAccumulatorV2 everywhere.
ENTRIES = [("resnet.torchscript17", "float32"), ("bert_masked_fill.torchscript14", "float32"),
           ("deberta_v2.torchscript17", "float16"), ("gpt2.dynamo18", "bfloat16"), ("gpt2.torchscript14", "float32")]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("lowering")


@pytest.mark.parametrize("entry,precision", ENTRIES)
def test_lowered_models_equal_native_ones(entry, precision, cache):
    directory = check.build(entry, "cpu", precision, cache)
    tolerance = check.TOLERANCE[precision]
    result = check.compare_training(directory, entry)
    assert set(result) == {"loss_scaled", "loss", "all_finite", "buffers", "reset", "native_self"}
    assert all(v <= tolerance for v in result.values()), result
    assert all(v <= tolerance for v in check.compare_eval(directory, entry).values())


def test_cuda_target_float16_graph_is_lowered_and_valid(cache):
    directory = check.build("vit.torchscript17", "cuda", "float16", cache)
    for kind in ("training_model", "eval_model"):
        model = onnx.load(str(directory / f"{kind}.onnx"))
        lowered = check.lower_model(model)
        check.structural(lowered)
        assert any(n.domain == "com.microsoft" and n.op_type not in ("FusedMatMul", "Gelu", "FastGelu")
                   for n in model.graph.node) or kind == "eval_model"


def test_the_build_has_a_lower_stage(model, tmp_path):
    """The stage fires in the build: its models load in a plain session and match the native ones."""
    from onnxmp.training.models import trainable

    state = TrainingBuild(model, trainable(model), [], "cross_entropy", None, "adamw", "float16", "cpu",
                          tmp_path / "out")
    PassManager([stage() for stage in STAGES if stage is not Write])(state)
    assert "lower" in [stage.name for stage in (s() for s in STAGES)]
    for native, lowered in ((state.training, state.lowered_training), (state.evaluation, state.lowered_evaluation)):
        check_lowered(lowered)
        assert [v.name for v in lowered.graph.input] == [v.name for v in native.graph.input]
        assert [v.name for v in lowered.graph.output] == [v.name for v in native.graph.output]
    assert any(n.op_type == "InPlaceAccumulatorV2" for n in state.training.graph.node)
    buffers = [v for v in state.lowered_training.graph.output if v.name.endswith(".accumulation.out")]
    assert buffers and all(v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for v in buffers)
    rng = np.random.default_rng(0)
    params = {t.name: onnx.numpy_helper.to_array(t) for t in state.trainable.graph.initializer}
    feeds = {}
    for value in state.training.graph.input:
        name = value.name
        if name in params:
            feeds[name] = params[name]
        elif name.endswith(".accumulation.buffer"):
            feeds[name] = rng.normal(size=params[name[:-len("_grad.accumulation.buffer")]].shape).astype(np.float32)
        elif name == "lazy_reset_grad":
            feeds[name] = np.array([False])
        elif name in ("loss_scale", "grad_weight"):
            feeds[name] = np.array(1.0 if name == "grad_weight" else 512.0, np.float32)
        elif name == "labels":
            feeds[name] = rng.integers(0, 4, 6)
        else:
            feeds[name] = rng.normal(size=(6, 8)).astype(np.float32)
    native, pairs = check.with_buffers_out(state.training)
    want = dict(zip([o.name for o in native.graph.output], check.session(native).run(None, check._copies(feeds))))
    got = dict(zip([o.name for o in state.lowered_training.graph.output],
                   check.session(state.lowered_training).run(None, check._copies(feeds))))
    assert check.difference(want["loss"], got["loss"]) <= 1e-6
    for flag, native_out in pairs.items():
        assert check.difference(want[native_out], got[flag]) <= check.TOLERANCE["float16"], flag
