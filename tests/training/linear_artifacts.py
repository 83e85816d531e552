"""TEST FIXTURE: an artifacts folder (format 2) written by hand, without the training build, so
that the portable engine's tests run where onnxruntime-training does not (Python 3.12+).

The model is linear regression, ``y = x @ W + b`` with the mean squared error; its portable
training graph is written here in standard ops to the contract of
:mod:`onnxmp.training.contract` (scaled loss, gradients unscaled and weighted by
``grad_weight``, ``all_finite``, the accumulation ``Where(reset, grad, buffer + grad)``).
The native files are copies of the portable graphs and an empty checkpoint: the folder is for
the portable engine only.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxmp.training.artifacts import write_parameters
from onnxmp.training.contract import FILES, FORMAT, MANIFEST, PORTABLE_FILES
from onnxmp.training.optimizer_settings import optimizer_named
from onnxmp.training.update_graph import build_portable_optimizer
from onnxmp.training.contract import portable_entry


OPSET = 17


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "linear", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _value(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def forward_nodes():
    return [helper.make_node("MatMul", ["x", "W"], ["xW"]), helper.make_node("Add", ["xW", "b"], ["y"])]


def loss_nodes():
    return [helper.make_node("Sub", ["y", "target"], ["diff"]),
            helper.make_node("Mul", ["diff", "diff"], ["sq"]),
            helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]


def training_model(n_in: int, n_out: int) -> onnx.ModelProto:
    consts = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in (("two", 2.0), ("zero", 0.0))]
    nodes = [*forward_nodes(), *loss_nodes(),
             helper.make_node("Mul", ["loss", "loss_scale"], ["loss_scaled"]),
             helper.make_node("Size", ["diff"], ["n_int"]),
             helper.make_node("Cast", ["n_int"], ["n"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["two", "loss_scale"], ["two_scale"]),
             helper.make_node("Div", ["two_scale", "n"], ["dscale"]),
             helper.make_node("Mul", ["diff", "dscale"], ["dy"]),             # d loss_scaled / d y
             helper.make_node("Transpose", ["x"], ["xT"], perm=[1, 0]),
             helper.make_node("MatMul", ["xT", "dy"], ["W_grad.scaled"]),
             helper.make_node("ReduceSum", ["dy", "axis0"], ["b_grad.scaled"], keepdims=0),
             helper.make_node("Div", ["grad_weight", "loss_scale"], ["unscale"])]
    consts.append(numpy_helper.from_array(np.array([0], np.int64), "axis0"))
    checks = []
    for p in ("W", "b"):
        g = f"{p}_grad.unscaled"
        nodes += [helper.make_node("Mul", [f"{p}_grad.scaled", "unscale"], [g]),
                  # inf * 0 and NaN * 0 are NaN: one NaN check per gradient
                  helper.make_node("Mul", [g, "zero"], [f"{p}/zeroed"]),
                  helper.make_node("ReduceSum", [f"{p}/zeroed"], [f"{p}/probe"], keepdims=0),
                  helper.make_node("Add", [f"{p}_grad.accumulation.buffer", g], [f"{p}/sum"]),
                  helper.make_node("Where", ["lazy_reset_grad", g, f"{p}/sum"], [f"{p}_grad.accumulation.out"])]
        checks.append(f"{p}/probe")
    nodes += [helper.make_node("Sum", checks, ["probe"]), helper.make_node("IsNaN", ["probe"], ["nan"]),
              helper.make_node("Not", ["nan"], ["all_finite"])]
    inputs = [_value("x", ["N", n_in]), _value("target", ["N", n_out]), _value("loss_scale", []),
              _value("W", [n_in, n_out]), _value("b", [n_out]),
              _value("W_grad.accumulation.buffer", [n_in, n_out]), _value("b_grad.accumulation.buffer", [n_out]),
              _value("lazy_reset_grad", [1], TensorProto.BOOL), _value("grad_weight", [])]
    outputs = [_value("loss_scaled", []), _value("loss", []), _value("all_finite", [], TensorProto.BOOL),
               _value("W_grad.accumulation.out", [n_in, n_out]), _value("b_grad.accumulation.out", [n_out])]
    return _model(nodes, inputs, outputs, consts)


def eval_model(n_in: int, n_out: int) -> onnx.ModelProto:
    inputs = [_value("x", ["N", n_in]), _value("target", ["N", n_out]), _value("W", [n_in, n_out]), _value("b", [n_out])]
    return _model([*forward_nodes(), *loss_nodes()], inputs, [_value("loss", []), _value("y", ["N", n_out])])


def forward_model(params) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(v, k) for k, v in params.items()]
    n_in, n_out = params["W"].shape
    return _model(forward_nodes(), [_value("x", ["N", n_in])], [_value("y", ["N", n_out])], inits)


def write_linear_artifacts(out: Path, *, optimizer: str = "sgd", n_in: int = 6, n_out: int = 3,
                           seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    params = {"W": rng.normal(scale=0.5, size=(n_in, n_out)).astype(np.float32),
              "b": np.zeros(n_out, np.float32)}
    requires_grad = ["W", "b"]
    optimizer_model = build_portable_optimizer(optimizer, [(p, list(params[p].shape)) for p in requires_grad], OPSET)
    models = {"training_model": training_model(n_in, n_out), "eval_model": eval_model(n_in, n_out),
              "optimizer_model": optimizer_model}
    for kind, model in models.items():
        onnx.save(model, out / PORTABLE_FILES[kind])
        shutil.copyfile(out / PORTABLE_FILES[kind], out / FILES[kind])
    onnx.save(forward_model(params), out / FILES["forward_model"])
    (out / FILES["checkpoint"]).write_bytes(b"")
    write_parameters(out / FILES["parameters"], params)
    manifest = {
        "format": FORMAT, "precision": "float32", "target": "cpu", "loss": "mse",
        "optimizer": optimizer_named(optimizer).manifest_entry(requires_grad), "opset": OPSET,
        "inputs": ["x", "target"], "input_dtypes": {"x": "float32", "target": "float32"},
        "model_inputs": ["x"], "label_input": "target", "forward_outputs": ["y"], "output_shape": [None, n_out],
        "training_outputs": ["loss_scaled", "loss", "all_finite"], "eval_outputs": ["loss", "y"],
        "loss_scale_input": "loss_scale", "grad_weight_input": "grad_weight",
        "requires_grad": requires_grad, "frozen": [], "files": dict(FILES),
        "portable": portable_entry(optimizer_model, requires_grad),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def linear_data(n_in: int = 6, n_out: int = 3, rows: int = 64, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, n_in)).astype(np.float32)
    true_w = rng.normal(size=(n_in, n_out)).astype(np.float32)
    return x, (x @ true_w + 0.5).astype(np.float32)
