"""Lowering on the export matrix: the lowered training and eval models against ORT's own.

For each entry of ``models/exports/matrix.json``, target and precision, builds the artifacts
(onnxruntime-training 1.19.2, Python 3.11), lowers the training and eval models
(:func:`onnxmp.training.build.lower.lower_model`) and runs both on one batch with onnxruntime-training's
``InferenceSession`` on the CPU (which registers ORT's training kernels: the native graph is the
oracle).  The native ``InPlaceAccumulatorV2`` nodes are given their optional second output, the
accumulated buffer, so that the new buffer values are the kernel's own.  Prints, per model, the
largest difference of ``loss_scaled``, ``loss``, ``all_finite``, the new buffers and the eval
outputs (relative to the largest magnitude of each), then the lowering table: each op lowered,
the standard ops it became, and in how many graphs it was proven equal.

cuda-target graphs use float16/bfloat16 kernels the CPU build lacks: they are lowered and checked
(onnx's full check, every op standard or registered by plain onnxruntime) but not run.
``--plain PYTHON`` also runs every lowered CPU-target training model in another interpreter (a
plain onnxruntime, e.g. Python 3.12) against onnxruntime-training's outputs for the same lowered
model, and loads its eval model.

    python scripts/check_lowering.py [--entries bert2.torchscript17 ...] [--targets cpu cuda]
        [--precisions float32 float16 bfloat16] [--cache DIR] [--plain /path/to/python]
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
EXPORTS = ROOT / "models" / "exports"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(EXPORTS))

from onnxmp.domains import is_onnx_domain  # noqa: E402
from onnxmp.training.build.lower import LOWERINGS, check_lowered, lower_model, standard  # noqa: E402

MATRIX = json.loads((EXPORTS / "matrix.json").read_text())
ACCUMULATOR = "InPlaceAccumulatorV2"
# float32: the two graphs differ only in the order of float32 operations.  float16/bfloat16 on
# the CPU are emulated (values rounded at each low-precision op): a float32 difference of one
# ulp before a rounding can move a value by one low-precision ulp (2^-10, 2^-7), so two ulps.
TOLERANCE = {"float32": 1e-5, "float16": 2 * 2.0**-10, "bfloat16": 2 * 2.0**-7}


def build(entry: str, target: str, precision: str, cache: Path) -> Path:
    from onnxmp.training import build_artifacts
    from onnxmp.training.build.prepare import without_gradient

    out = cache / f"{entry}.{target}.{precision}"
    if not (out / "manifest.json").exists():
        model = onnx.load(str(EXPORTS / MATRIX[entry]["file"]))
        names = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
        frozen = without_gradient(model, names)
        build_artifacts(model, requires_grad=[n for n in names if n not in frozen], loss="cross_entropy",
                        optimizer="adamw", precision=precision, target=target, out_dir=out)
    return out


def feeds(directory: Path, entry: str, seed: int = 0, reset: bool = False) -> dict[str, np.ndarray]:
    """One batch, the initial parameters, random accumulation buffers and a loss scale."""
    import tasks

    manifest = json.loads((directory / "manifest.json").read_text())
    training = onnx.load(str(directory / "training_model.onnx"), load_external_data=False)
    forward = onnx.load(str(directory / "forward_model.onnx"))
    params = {t.name: onnx.numpy_helper.to_array(t) for t in forward.graph.initializer}
    batch = tasks.batches(MATRIX[entry]["arch"], MATRIX[entry]["inputs"], tasks.BATCH, seed)[0]
    rng = np.random.default_rng(seed)
    out = dict(zip(manifest["inputs"], batch))
    for value in training.graph.input:
        name = value.name
        if name in out:
            continue
        if name in params:
            out[name] = params[name]
        elif name.endswith(".accumulation.buffer"):
            shape = params[name[:-len("_grad.accumulation.buffer")]].shape
            out[name] = np.asarray(rng.standard_normal(shape) * 1e-3, dtype=np.float32)
        elif name == "lazy_reset_grad":
            out[name] = np.array([reset], dtype=bool)
        elif name == "loss_scale":
            out[name] = np.array(1.0 if manifest["precision"] == "float32" else 1024.0, np.float32)
        elif name == "grad_weight":
            out[name] = np.array(0.5, np.float32)
        else:
            raise KeyError(f"no feed for {name}")
    return out


def with_buffers_out(training: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The native model with each accumulator's accumulated buffer as an output: flag name -> it."""
    native = onnx.ModelProto()
    native.CopyFrom(training)
    types = {v.name: v.type for v in native.graph.input}
    pairs = {}
    for node in native.graph.node:
        if node.op_type == ACCUMULATOR:
            name = f"{node.input[0]}.native_out"
            if len(node.output) < 2:
                node.output.append(name)
            else:
                node.output[1] = name
            pairs[node.output[0]] = name
            native.graph.output.append(onnx.helper.make_value_info(name, types[node.input[0]]))
    return native, pairs


def session(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    # ORT's fusions depend on the consumers around a node, which the lowering changes: with them the
    # two forward passes can differ in float32 rounding, which emulated float16 then amplifies.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def difference(want: np.ndarray, got: np.ndarray, scale: float | None = None) -> float:
    """Largest |want - got| over ``scale`` (default: the largest |want|; 0 when both are all zeros);
    inf on a shape or finiteness mismatch."""
    want, got = np.asarray(want), np.asarray(got)
    if want.shape != got.shape:
        return float("inf")
    if want.dtype == bool:
        return float(np.any(want != got))
    want, got = want.astype(np.float64), got.astype(np.float64)
    if not np.array_equal(np.isfinite(want), np.isfinite(got)):
        return float("inf")
    finite = np.isfinite(want)
    if scale is None:
        scale = float(np.abs(want[finite]).max()) if finite.any() else 0.0
    error = float(np.abs(want[finite] - got[finite]).max()) if finite.any() else 0.0
    return error / scale if scale else error


def compare_training(directory: Path, entry: str, lowered: onnx.ModelProto | None = None,
                     keep: Path | None = None) -> dict[str, float]:
    """Largest relative differences of the lowered training model's outputs against the native,
    accumulating into the buffers (``buffers``) and overwriting them (``reset``).  ``keep``: a
    folder where the accumulating run's feeds and native outputs (under the lowered model's output
    names) are saved, for :func:`plain_runs`."""
    training = onnx.load(str(directory / "training_model.onnx"))
    native, pairs = with_buffers_out(training)
    lowered = lowered if lowered is not None else lower_model(training)
    sessions = session(native), session(lowered)
    result: dict[str, float] = {}
    runs = {}
    buffer_of = {n.output[0]: n.input[0] for n in training.graph.node if n.op_type == ACCUMULATOR}
    for reset in (False, True):
        inputs = feeds(directory, entry, reset=reset)
        # ORT's accumulator writes into the fed buffer's memory: each run gets its own copies.
        want = dict(zip([o.name for o in native.graph.output], sessions[0].run(None, _copies(inputs))))
        got = dict(zip([o.name for o in lowered.graph.output], sessions[1].run(None, _copies(inputs))))
        if keep is not None and not reset:
            np.savez(keep / "feeds.npz", **inputs)
            # The lowered model's outputs here: the plain run must reproduce what the training build's
            # onnxruntime computes for the same graph (the native graph is compared above).
            np.savez(keep / "want.npz", **{flag: got[flag] for flag in pairs},
                     **{name: got[name] for name in ("loss_scaled", "loss", "all_finite")})
        if not reset:
            result.update({name: difference(want[name], got[name]) for name in ("loss_scaled", "loss", "all_finite")})
        # Against the largest gradient of all: a gradient that is zero in exact arithmetic (a key
        # bias under softmax) is rounding noise in both, with no scale of its own.
        scale = max(float(np.abs(want[native_out]).max()) for native_out in pairs.values())
        result["reset" if reset else "buffers"] = max(difference(want[native_out], got[flag], scale)
                                                      for flag, native_out in pairs.items())
        runs[reset] = inputs, want
    # ORT's own accumulation against its own gradient (the overwrite run) plus the fed buffer: where
    # this is not 0, the native kernels wrote into the buffers' memory (a write past a buffer).
    (inputs, accumulated), (_, overwritten) = runs[False], runs[True]
    result["native_self"] = max(difference(accumulated[out], inputs[buffer_of[flag]] + overwritten[out], scale)
                                for flag, out in pairs.items())
    return result


def _copies(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in arrays.items()}


def compare_eval(directory: Path, entry: str, lowered: onnx.ModelProto | None = None) -> dict[str, float]:
    """``eval``: the lowered eval model's outputs against the native one's.  ``native_loss``: the
    native TRAINING model's loss against the native eval model's on the same batch and weights,
    which should be equal: where it is not, ORT's training graph itself computed a wrong loss."""
    evaluation = onnx.load(str(directory / "eval_model.onnx"))
    lowered = lowered if lowered is not None else lower_model(evaluation)
    inputs = feeds(directory, entry)
    names = {v.name for v in evaluation.graph.input}
    want, got = (session(m).run(None, {k: v for k, v in inputs.items() if k in names}) for m in (evaluation, lowered))
    training = onnx.load(str(directory / "training_model.onnx"))
    train_loss = session(training).run(["loss"], _copies(inputs))[0]
    loss_at = [v.name for v in evaluation.graph.output].index("loss")
    return {"eval": max(difference(w, g) for w, g in zip(want, got)),
            "native_loss": difference(want[loss_at], train_loss)}


def lowered_ops(model: onnx.ModelProto, lowered: onnx.ModelProto) -> dict[str, set[str]]:
    """Op lowered -> the op types of the nodes that replaced it (named after it)."""
    result: dict[str, set[str]] = collections.defaultdict(set)
    scopes = {n.name: n.op_type for n in model.graph.node if n.op_type in LOWERINGS and not standard(n)}
    for node in lowered.graph.node:
        scope = node.name.rsplit("/", 1)[0]
        if scope in scopes and node.op_type != "Constant":
            result[scopes[scope]].add(node.op_type if is_onnx_domain(node.domain) else f"{node.domain}:{node.op_type}")
    return result


def structural(model: onnx.ModelProto) -> None:
    """onnx's full check, and every op standard or registered by plain onnxruntime CPU and CUDA."""
    check_lowered(model)
    onnx.checker.check_model(model, full_check=True)


_PLAIN = """
import sys, numpy as np, onnxruntime as ort
worst = 0.0
for folder in sys.argv[1:]:
    session = ort.InferenceSession(folder + "/training_model.lowered.onnx", providers=["CPUExecutionProvider"])
    ort.InferenceSession(folder + "/eval_model.lowered.onnx", providers=["CPUExecutionProvider"])
    feeds, want = dict(np.load(folder + "/feeds.npz")), dict(np.load(folder + "/want.npz"))
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    buffers = [k for k in want if k.endswith(".accumulation.out")]
    scale = max(float(np.abs(want[k]).max()) for k in buffers)
    for name, value in want.items():
        ref = scale if name in buffers else max(float(np.abs(value.astype(np.float64)).max()), 1e-30)
        error = float(np.abs(value.astype(np.float64) - got[name].astype(np.float64)).max()) / ref
        worst = max(worst, error)
        if not error <= float(TOLERANCE[folder]):
            sys.exit(f"{folder}: {name} differs by {error:.2e}")
print(f"onnxruntime {ort.__version__} on Python {sys.version.split()[0]}: {len(sys.argv) - 1} lowered training models "
      f"run and give onnxruntime-training's outputs for them (largest relative difference {worst:.1e}); "
      f"their eval models load")
"""


def plain_runs(folders: list[Path], tolerances: dict[Path, float], python: str) -> str:
    """Run each lowered training model in another interpreter (a plain onnxruntime) on the kept
    feeds, against what onnxruntime-training 1.19.2 computed for it, and create a session of each
    lowered eval model."""
    code = _PLAIN.replace("float(TOLERANCE[folder])", repr({str(k): v for k, v in tolerances.items()}) +
                          "[folder]")
    done = subprocess.run([python, "-c", code, *map(str, folders)], capture_output=True, text=True, timeout=3000)
    if done.returncode:
        return f"PLAIN ONNXRUNTIME ({python}) DISAGREES: {done.stderr.strip()[-1500:]}"
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", nargs="*", default=sorted(k for k, e in MATRIX.items() if "file" in e))
    parser.add_argument("--targets", nargs="*", default=["cpu", "cuda"])
    parser.add_argument("--precisions", nargs="*", default=["float32", "float16", "bfloat16"])
    parser.add_argument("--cache", type=Path, default=None, help="folder of built artifacts to reuse")
    parser.add_argument("--plain", action="append", default=[], help="python of a plain onnxruntime")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest relative difference allowed (default: per precision, TOLERANCE)")
    args = parser.parse_args(argv)
    cache = args.cache or Path(tempfile.mkdtemp(prefix="check_lowering-"))
    cache.mkdir(parents=True, exist_ok=True)
    proven: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    became: dict[str, set[str]] = collections.defaultdict(set)
    failures, kept, native_failed = [], {}, []
    for target in args.targets:
        for precision in args.precisions:
            if target == "cuda" and precision == "float32":
                continue  # float32 has no device-specific graph: the cpu build is the same model
            for entry in args.entries:
                key = f"{entry} {target} {precision}"
                try:
                    directory = build(entry, target, precision, cache)
                except Exception as exc:  # the build itself failing is another helper's issue: say so
                    print(f"{key:48s} BUILD FAILED: {str(exc).splitlines()[0][:150]}", flush=True)
                    continue
                row, seen, lowered_of = {}, {}, {}
                for kind in ("training_model", "eval_model"):
                    model = onnx.load(str(directory / f"{kind}.onnx"))
                    lowered = lowered_of[kind] = lower_model(model)
                    structural(lowered)
                    path = directory / f"{kind}.lowered.onnx"
                    onnx.save(lowered, str(path))
                    for op, ops in lowered_ops(model, lowered).items():
                        became[op] |= ops
                        seen[op] = seen.get(op, 0) + 1
                outcome = "structural"
                if target == "cpu":
                    try:
                        row = compare_training(directory, entry, lowered_of["training_model"],
                                               keep=directory if args.plain else None)
                    except Exception as exc:  # onnxruntime-training failing on its own graph: its bug, said so
                        if "onnxruntime" not in type(exc).__module__:
                            raise
                        print(f"{key:48s} NATIVE GRAPH FAILED in onnxruntime-training: {str(exc)[-200:]}", flush=True)
                        for op in seen:
                            proven[op]["native_failed"] += 1
                        native_failed.append(key)
                        continue
                    row.update(compare_eval(directory, entry, lowered_of["eval_model"]))
                    tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[precision]
                    bad = {k: v for k, v in row.items() if not v <= tolerance}
                    if bad:
                        failures.append((key, bad))
                    outcome = "differs" if bad else "checked"
                    if bad and "eval" not in bad and (row["native_loss"] > 0 or row["native_self"] > tolerance):
                        # the lowered graph agrees with the eval model, or ORT's accumulators disagree with
                        # ORT's own gradients: the native graph is the one that is wrong
                        outcome = "native_wrong"
                    kept[directory] = tolerance
                for op in seen:
                    proven[op][outcome] += 1
                print(f"{key:48s} " + (" ".join(f"{k}={v:.1e}" for k, v in row.items()) or "lowered, checked"),
                      flush=True)
    for python in args.plain:
        print(plain_runs(list(kept), kept, python))
    print("\n| op | standard ops | evidence |\n|---|---|---|")
    for op in sorted(became):
        counts = proven[op]
        differs = f"; DIFFERS in {counts['differs']}" if counts["differs"] else ""
        if counts["native_failed"]:
            differs += f"; in {counts['native_failed']} more onnxruntime-training failed to run its own graph"
        if counts["native_wrong"]:
            differs += (f"; in {counts['native_wrong']} more the native graph is inconsistent with itself (its loss "
                        f"against its eval model's, or its accumulation against its own gradient)")
        print(f"| {op} | {', '.join(sorted(became[op]))} | outputs equal to native in {counts['checked']} cpu "
              f"models{differs}; lowered + full check + registry in {counts['structural']} cuda models |")
    if native_failed:
        print(f"\nonnxruntime-training failed to run its own training graph of: {', '.join(native_failed)}")
    if failures:
        print(f"\n{len(failures)} model(s) differ beyond the tolerance (native_loss: ORT's training graph's loss "
              f"against its own eval model's; native_self: ORT's accumulated buffers against its own gradients):")
        for key, bad in failures:
            print(f"  {key}: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
