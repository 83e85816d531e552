"""onnxmp's gradient builder against torch's autograd on exports outside the matrix.

The fixtures (``models/exports/oracle/``, made by ``models/exports/export_oracle.py``) are small
random-init exports (MobileBERT, ViT, Llama, Qwen2, ConvNeXt, BART, T5, diffusers' UNet2DModel, and
CNN / op / pooling / UNet / EfficientNet zoos, training-mode Dropout and BatchNorm; TorchScript and dynamo,
opsets 17, 18 and 21) with one batch and torch's gradients of ``mean(output * proj)``.  Here the same loss is
appended to the ONNX graph, :func:`~onnxmp.training.build.autodiff.backward` differentiates it, plain
onnxruntime runs it, and every compared parameter's gradient must be within 1e-5 of torch's float64
gradient, relative to that gradient's largest magnitude, or to 1e-3 of the model's largest gradient
where that is more (a tiny gradient is mostly rounding), or to the model's largest gradient where
torch's float64 gradient is zero (a key bias's under softmax, a conv bias before InstanceNorm: both
sides hold rounding noise only).
No torch is needed: the test runs on Python 3.11 and 3.12 alike.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxmp.training.build.autodiff import backward

ORACLE = Path(__file__).resolve().parents[2] / "models" / "exports" / "oracle"
MANIFEST = json.loads((ORACLE / "oracle.json").read_text())
TOLERANCE = 1e-5
FLOOR = 1e-3
ZERO = 1e-9  # a float64 gradient this small (relative to the model's largest) is zero in exact arithmetic
LOSS = "oracle/loss"


def _runtime_pool_bug(model: onnx.ModelProto) -> bool:
    """onnxruntime's CPU AveragePool at opset 7-18 with ceil_mode=1 and count_include_pad=1 divides the
    trailing windows by the whole kernel (microsoft/onnxruntime#29629, fixed in 2026; 1.19.2 has it,
    1.32 does not): torch's forward differs there, while the gradients do not depend on it."""
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    pools = [n for n in model.graph.node if n.op_type == "AveragePool"
             and {a.name: a.i for a in n.attribute if a.name in ("ceil_mode", "count_include_pad")}
             == {"ceil_mode": 1, "count_include_pad": 1}]
    version = tuple(int(v) for v in ort.__version__.split(".")[:2])
    return bool(pools) and opset < 19 and version < (1, 32)


def with_loss(name: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict]:
    """The fixture's model with ``mean(output * proj)`` appended as ``oracle/loss``, its feeds, its arrays."""
    entry = MANIFEST[name]
    model = onnx.load(str(ORACLE / entry["file"]))
    data = dict(np.load(ORACLE / f"{name}.npz"))
    output = entry["output"]
    assert model.graph.output[0].name == output
    graph = model.graph
    # proj is fixed-size: with dynamic axes the loss's Mul is one runtime-shape place of the counts
    graph.initializer.append(numpy_helper.from_array(data["proj"], "oracle/proj"))
    graph.node.append(helper.make_node("Mul", [output, "oracle/proj"], ["oracle/product"], name="oracle/mul"))
    graph.node.append(helper.make_node("ReduceMean", ["oracle/product"], [LOSS], name="oracle/mean", keepdims=0))
    graph.output.append(helper.make_tensor_value_info(LOSS, TensorProto.FLOAT, []))
    feeds = {k[len("input:"):]: v for k, v in data.items() if k.startswith("input:")}
    return model, feeds, data


def static_copy(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with its inputs' dims fixed to the batch's."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    sizes = {}
    for value in fixed.graph.input:
        if value.name in feeds:
            for dim, size in zip(value.type.tensor_type.shape.dim, feeds[value.name].shape):
                if dim.dim_param:
                    sizes[dim.dim_param] = size
    # the exporter's symbols in value_info and outputs take the batch's sizes too
    for value in (*fixed.graph.input, *fixed.graph.value_info, *fixed.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in sizes:
                size = sizes[dim.dim_param]
                dim.Clear()
                dim.dim_value = size
    return fixed


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip(names, session.run(names, feeds)))


def difference(want: np.ndarray, got: np.ndarray, floor: float) -> float:
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    assert want.shape == got.shape, (want.shape, got.shape)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(want - got).max()) / max(float(np.abs(want).max()), floor)


def compare(name: str) -> dict:
    """What the per-fixture table shows: params compared, worst relative errors, runtime-shape places."""
    model, feeds, data = with_loss(name)
    wrt = [k[len("grad64:"):] for k in data if k.startswith("grad64:")]
    trained, report = backward(model, LOSS, wrt)
    grads = [f"{w}_grad" for w in wrt]
    masks = [n.output[1] for n in model.graph.node if n.op_type == "Dropout" and len(n.output) > 1]
    got = run(trained, feeds, [MANIFEST[name]["output"], LOSS, *grads, *masks])
    if masks:
        # Dropout in training mode: the loss is affine in the mask the step drew, so torch's output and
        # gradients for that mask are the fixture's m = 0 values plus the mask times its basis
        mask = got[masks[0]].astype(np.float32).reshape(-1)
        assert 0 < mask.mean() < 1, "the dropout mask is all ones or all zeros"
        data["output"] = data["output"] + np.tensordot(mask, data["output_basis"], 1)
        for w in wrt:
            for key in ("grad", "grad64"):
                data[f"{key}:{w}"] = data[f"{key}:{w}"] + np.tensordot(mask, data[f"basis{key[4:]}:{w}"], 1)
    forward = difference(data["output"], got[MANIFEST[name]["output"]], 0.0)
    largest = max(float(np.abs(data[f"grad64:{w}"]).max()) for w in wrt)
    floors = {w: largest if np.abs(data[f"grad64:{w}"]).max() <= ZERO * largest else FLOOR * largest for w in wrt}
    errors = {w: difference(data[f"grad64:{w}"], got[f"{w}_grad"], floors[w]) for w in wrt}
    errors32 = {w: difference(data[f"grad:{w}"], got[f"{w}_grad"], floors[w]) for w in wrt}
    _, static = backward(static_copy(model, feeds), LOSS, wrt)
    return {"forward": forward, "pool_bug": _runtime_pool_bug(model), "errors": errors, "errors32": errors32, "report": report, "static": static}


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_gradients_equal_torch(name):
    result = compare(name)
    if not result["pool_bug"]:
        assert result["forward"] < 1e-4, f"the export disagrees with torch's forward: {result['forward']:.2e}"
    worst = max(result["errors"], key=result["errors"].get)
    bad = {w: f"{e:.2e}" for w, e in result["errors"].items() if e > TOLERANCE}
    print(f"{name}: {len(result['errors'])} params, max relative error {result['errors'][worst]:.2e} ({worst}); "
          f"vs torch float32 {max(result['errors32'].values()):.2e}; runtime-shape places "
          f"{result['report'].runtime_shapes} dynamic, {result['static'].runtime_shapes} static")
    assert not bad, f"gradients off torch's by more than {TOLERANCE}: {bad}"


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_static_shapes_need_no_runtime_shapes(name):
    """With every input dim fixed, shape inference knows every shape: no gradient reads one at run time."""
    model, feeds, data = with_loss(name)
    wrt = [k[len("grad64:"):] for k in data if k.startswith("grad64:")]
    _, report = backward(static_copy(model, feeds), LOSS, wrt)
    assert report.runtime_shapes == 0, report.runtime_places[:10]


def test_the_comparison_can_fail():
    """A gradient off by one part in 1e4 is caught; a zero gradient's rounding noise is not."""
    want = np.array([1.0, -2.0, 0.5], np.float32)
    assert difference(want, want * (1 + 1e-4), 0.0) > TOLERANCE
    assert difference(np.zeros(3), np.full(3, 1e-9), FLOOR * 2.0) < TOLERANCE


def table() -> str:
    """The per-fixture table (``python tests/training/test_autodiff_oracle.py``)."""
    rows = ["| fixture | arch | exporter | opset | params compared | max rel. error (vs f64 / vs f32) | "
            "runtime-shape places (dynamic / static) | result |", "|" + "---|" * 8]
    for name in sorted(MANIFEST):
        entry = MANIFEST[name]
        head = f"| {name} | {entry['arch']} | {entry['exporter']} | {entry['opset']} | "
        try:
            result = compare(name)
        except Exception as error:  # the table shows what a failing fixture says
            why = str(error).splitlines()[0][:140].replace("|", "/")
            rows.append(f"{head}{entry['params_compared']}/{entry['params_total']} | - | - | FAIL: {why} |")
            continue
        worst, worst32 = max(result["errors"].values()), max(result["errors32"].values())
        ok = worst <= TOLERANCE and (result["forward"] < 1e-4 or result["pool_bug"])
        rows.append(f"{head}{entry['params_compared']}/{entry['params_total']} | {worst:.1e} / {worst32:.1e} | "
                    f"{result['report'].runtime_shapes} / {result['static'].runtime_shapes} | "
                    f"{'pass' if ok else 'FAIL'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
