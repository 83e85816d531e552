"""onnxmp's gradient builder against onnxruntime-training 1.19.2's on the export matrix (Python 3.11).

For each entry of ``models/exports/matrix.json`` and precision, the build's first stages (load,
prepare, convert; target cpu, so float16/bfloat16 are emulated in float32) give the training
forward; both builders (:func:`onnxmp.training.build.gradient.gradient_graph`, ORT's onnxblock, and
:func:`onnxmp.training.build.autodiff.gradient_graph`) differentiate it with the cross-entropy loss; both
training models run on one batch with onnxruntime-training's CPU session (ORT's graph needs its
training kernels), and the eval models too.  Prints per model the largest difference of the loss,
of the eval outputs and of the gradients, each relative to that tensor's largest magnitude (at least
FLOOR times the model's largest gradient: a gradient that is zero in exact arithmetic is rounding
noise in both graphs), and both graphs' node counts.

PASS: float32 within 1e-5.  float16 and bfloat16 (emulated on the CPU): within two ulps of the type,
or onnxmp's gradients (unscaled) at most 1.25 times as far from ORT's float32 gradients as ORT's own
low-precision ones are.  Where float32 gradients disagree, a central difference of the loss at the
worst element says which builder it sides with.

    python scripts/check_autodiff.py [--entries bert2.torchscript17 ...] [--precisions float32 float16 bfloat16]
    python scripts/check_autodiff.py --cuda    # the target-cuda graphs: valid, with CUDA kernels
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

ROOT = Path(__file__).resolve().parents[1]
EXPORTS = ROOT / "models" / "exports"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(EXPORTS))

from onnxmp.training import contract  # noqa: E402

MATRIX = json.loads((EXPORTS / "matrix.json").read_text())
FLOOR = 1e-3
TOLERANCE = {"float32": 1e-5, "float16": 2 * 2.0**-10, "bfloat16": 2 * 2.0**-7}


def forward_of(entry: str, precision: str, target: str = "cpu", builder: str = "ort"):
    """(training forward, requires_grad, frozen) as the build's load/prepare/convert stages make them
    for ``builder`` (the prepare stage skips the rewrites only ORT's builder needs for onnxmp's)."""
    from onnxmp.training.build.pipeline import Convert, Load, Prepare, TrainingBuild
    from onnxmp.training.optimizer_settings import optimizer_named
    from onnxmp.training.build.prepare import without_gradient

    model = onnx.load(str(EXPORTS / MATRIX[entry]["file"]))
    names = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    frozen = without_gradient(model, names)
    requires_grad = [n for n in names if n not in frozen]
    state = TrainingBuild(model, requires_grad, list(frozen), "cross_entropy", None, optimizer_named("adamw"),
                          precision, target, Path("unused"), builder)
    for stage in (Load, Prepare, Convert):
        stage().call(state)
    return state.train_forward, requires_grad, list(frozen)


def both(entry: str, precision: str, ours: bool = True, target: str = "cpu"):
    from onnxmp.training.build import autodiff
    from onnxmp.training.build.gradient import gradient_graph as ort_gradient_graph
    from onnxmp.training.losses import table_loss

    forward, requires_grad, frozen = forward_of(entry, precision)
    started = time.perf_counter()
    if ours:
        own, _, _ = forward_of(entry, precision, builder="onnxmp")
        ours = autodiff.gradient_graph(own, table_loss("cross_entropy"), "labels", requires_grad, frozen,
                                       target=target)
    seconds = time.perf_counter() - started
    theirs = ort_gradient_graph(forward, table_loss("cross_entropy"), "labels", requires_grad, frozen)
    return forward, requires_grad, ours, theirs, seconds


def feeds(entry: str, model: onnx.ModelProto, parameters, precision: str) -> dict[str, np.ndarray]:
    import tasks

    batch = tasks.batches(MATRIX[entry]["arch"], MATRIX[entry]["inputs"], tasks.BATCH, 0)[0]
    out = dict(zip([*MATRIX[entry]["inputs"], "labels"], batch))
    params = {t.name: onnx.numpy_helper.to_array(t) for group in parameters for t in group}
    for value in model.graph.input:
        if value.name in params:
            out[value.name] = params[value.name]
        elif value.name == contract.LOSS_SCALE:
            out[value.name] = np.array(1.0 if precision == "float32" else 1024.0, np.float32)
        elif contract.is_accumulation_buffer(value.name):
            out[value.name] = np.zeros(params[contract.buffer_parameter(value.name)].shape, np.float32)
        elif value.name == contract.LAZY_RESET_GRAD:
            out[value.name] = np.array([True])
    return {v.name: out[v.name] for v in model.graph.input}


def execute(model: onnx.ModelProto, inputs: dict, outputs: list[str]) -> dict[str, np.ndarray]:
    """``outputs`` of ``model`` (made graph outputs) on ``inputs``, every graph optimization off (so
    that both graphs' forward passes round alike)."""
    import onnxruntime as ort

    result = onnx.ModelProto()
    result.CopyFrom(model)
    have = {o.name for o in result.graph.output}
    result.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in outputs if n not in have)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(result.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip(outputs, session.run(outputs, inputs)))


def difference(want, got, floor: float = 0.0) -> float:
    """Largest |want - got| over the largest |want| (at least ``floor``: a gradient that is zero in
    exact arithmetic, as a key bias's under softmax, is rounding noise on both sides)."""
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    if want.shape != got.shape or not np.array_equal(np.isfinite(want), np.isfinite(got)):
        return float("inf")
    finite = np.isfinite(want)
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(want[finite]).max()), floor)
    error = float(np.abs(want[finite] - got[finite]).max())
    return error / scale if scale else error


_FLOAT32: dict[str, dict[str, np.ndarray]] = {}


def float32_gradients(entry: str) -> dict[str, np.ndarray]:
    """ORT's float32 gradients of ``entry`` (the reference the low-precision ones are held to)."""
    if entry not in _FLOAT32:
        _, requires_grad, _, (native, _, parameters), _ = both(entry, "float32", ours=False)
        grads = [contract.gradient_output(p) for p in requires_grad]
        _FLOAT32[entry] = execute(native, feeds(entry, native, parameters, "float32"), grads)
    return _FLOAT32[entry]


def check(entry: str, precision: str) -> dict:
    from onnxmp.training.build.determinism import float32_cpu_grad_kernels
    from onnxmp.training.build.gradient import make_eval_outputs

    forward, requires_grad, ours, theirs, seconds = both(entry, precision)
    (training, evaluation, parameters), (native, native_eval, _) = ours, theirs
    float32_cpu_grad_kernels(native)  # as the build's determinism stage does for the CPU
    grads = [contract.gradient_output(p) for p in requires_grad]
    inputs = feeds(entry, training, parameters, precision)
    mine = execute(training, inputs, ["loss", *grads])
    want = execute(native, feeds(entry, native, parameters, precision), ["loss", *grads])
    accuracy = ""
    if precision != "float32":
        # Both against the float32 gradients: is onnxmp's low-precision gradient as close as ORT's?
        exact = float32_gradients(entry)
        scale = float(inputs[contract.LOSS_SCALE])
        top = FLOOR * max(float(np.abs(exact[g]).max()) for g in grads)
        ours_error = max(difference(exact[g], mine[g] / scale, top) for g in grads)
        ort_error = max(difference(exact[g], want[g] / scale, top) for g in grads)
        accuracy = (ours_error, ort_error)
    # A gradient that is zero in exact arithmetic (a key projection's bias under softmax) is
    # rounding noise in both graphs: gradients are compared at a scale of at least FLOOR times
    # the model's largest gradient.
    floor = FLOOR * max((float(np.abs(want[g]).max()) for g in grads), default=0.0)
    worst = max(((difference(want[g], mine[g], floor), g) for g in grads), default=(0.0, ""))
    make_eval_outputs(evaluation, forward)
    make_eval_outputs(native_eval, forward)
    eval_names = [o.name for o in evaluation.graph.output]
    eval_mine = execute(evaluation, feeds(entry, evaluation, parameters, precision), eval_names)
    eval_want = execute(native_eval, feeds(entry, native_eval, parameters, precision), eval_names)
    eval_diff = max(difference(eval_want[n], eval_mine[n]) for n in eval_names)
    referee = ""
    if worst[0] > TOLERANCE[precision] and precision == "float32":
        referee = finite_difference(evaluation, feeds(entry, evaluation, parameters, precision), worst[1],
                                    mine[worst[1]], want[worst[1]])
    return {"loss": difference(want["loss"], mine["loss"]), "grad": worst[0], "worst": worst[1], "eval": eval_diff,
            "nodes": len(training.graph.node), "native_nodes": len(native.graph.node), "seconds": seconds,
            "referee": referee, "accuracy": accuracy}


def finite_difference(evaluation: onnx.ModelProto, inputs: dict, grad: str, mine, want) -> str:
    """Which builder a central difference of the loss (h = 1e-2, float32) sides with, at the element
    where the two disagree most."""
    param = contract.gradient_parameter(grad)
    index = np.unravel_index(int(np.argmax(np.abs(mine - want))), np.shape(mine))
    losses = []
    for h in (1e-2, -1e-2):
        moved = dict(inputs)
        moved[param] = inputs[param].copy()
        moved[param][index] += h
        losses.append(float(execute(evaluation, moved, ["loss"])["loss"]))
    fd = (losses[0] - losses[1]) / 2e-2
    closer = "onnxmp" if abs(fd - float(mine[index])) < abs(fd - float(want[index])) else "ORT"
    return f"finite difference {fd:.3e}: onnxmp {float(mine[index]):.3e}, ORT {float(want[index]):.3e} -> {closer}"


def cuda_check(entry: str, precision: str) -> str:
    """The target-"cuda" build's training graph, loss-scaled, lowered and kept on the device:
    onnxmp.training.build.graph_check's verdict (valid, resolved, every node a kernel of plain
    onnxruntime's CUDA EP), and no value copied host to device inside the step under the CUDA EP's
    placement (onnxmp.training.build.placement)."""
    from onnxmp.training.build import autodiff
    from onnxmp.training.build.device_values import keep_on_device
    from onnxmp.training.build.graph_check import check_graph
    from onnxmp.training.build.placement import place
    from onnxmp.training.build.unscale import add_loss_scaling, proven_gradients
    from onnxmp.training.build.lower import lower_model
    from onnxmp.training.losses import table_loss

    forward, requires_grad, frozen = forward_of(entry, precision, "cuda", builder="onnxmp")
    reports: list = []
    training, _, _ = autodiff.gradient_graph(forward, table_loss("cross_entropy"), "labels",
                                             requires_grad, frozen, reports=reports, target="cuda")
    add_loss_scaling(training, proven_gradients(training))
    lowered = lower_model(training)
    keep_on_device(lowered)  # the build's device_values stage
    verdict = check_graph(lowered, "cuda")
    copies = sorted(place(lowered).copies)
    ok = verdict.ok and not verdict.without_kernel and not copies
    float32 = ", ".join(f"{k} x{v}" for k, v in reports[0].float32_ops.items())
    return (f"{'ok' if ok else 'NOT OK'}: {len(lowered.graph.node)} nodes, "
            f"{reports[0].runtime_shapes} runtime-shape places" + (f", in float32: {float32}" if float32 else "")
            + ("" if ok else f"; {verdict}") + (f"; copied host to device: {', '.join(copies[:5])}" if copies else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", nargs="*", default=sorted(k for k, e in MATRIX.items() if "file" in e))
    parser.add_argument("--precisions", nargs="*", default=["float32", "float16", "bfloat16"])
    parser.add_argument("--cuda", action="store_true",
                        help="instead: check the target-cuda float16/bfloat16 training graphs (no GPU needed)")
    args = parser.parse_args(argv)
    failures = 0
    if args.cuda:
        for entry in args.entries:
            for precision in [p for p in args.precisions if p != "float32"]:
                verdict = cuda_check(entry, precision)
                failures += not verdict.startswith("ok")
                print(f"{entry:30} {precision:9} {verdict}", flush=True)
        return 1 if failures else 0
    print(f"{'entry':28} {'precision':9} {'loss':>8} {'eval':>8} {'grad':>8}  {'nodes':>6} {'ORT':>6} "
          f"{'build s':>7}  result  (worst gradient)")
    for entry in args.entries:
        for precision in args.precisions:
            try:
                r = check(entry, precision)
            except Exception as exc:  # one failing entry must not hide the others
                failures += 1
                print(f"{entry:28} {precision:9} ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                      flush=True)
                continue
            ok = max(r["loss"], r["grad"], r["eval"]) <= TOLERANCE[precision]
            note = r["referee"]
            if r["accuracy"]:
                ours_error, ort_error = r["accuracy"]
                # low precision: as close to the float32 gradients as ORT's (within 25%) also passes
                ok = ok or (max(r["loss"], r["eval"]) <= TOLERANCE[precision] and ours_error <= 1.25 * ort_error)
                note = f"vs float32: onnxmp {ours_error:.1e}, ORT {ort_error:.1e}"
            failures += not ok
            print(f"{entry:28} {precision:9} {r['loss']:8.1e} {r['eval']:8.1e} {r['grad']:8.1e}  {r['nodes']:6d} "
                  f"{r['native_nodes']:6d} {r['seconds']:7.2f}  {'PASS' if ok else 'FAIL'}    {r['worst']}  {note}",
                  flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
