"""GPU check, run by scripts/gpu_check.sh inside its own onnxruntime-gpu venv.

    python scripts/gpu_check.py [--dry-run] [--json FILE] [--iters N] [--skip-latency]

``--precision bfloat16`` checks onnxmp's bfloat16 models instead (onnxconverter-common
has no bfloat16 converter: its columns are left out).

1. parity: every ``models/*.onnx`` converted by onnxmp, run in real float16 on
   the CUDA EP against the float32 model on the CPU (``onnxmp.validate``).
2. latency: fp32 vs fp16 inference on the CUDA EP for a BERT-base-sized
   encoder (12 layers, hidden 768, 12 heads, batch 32, seq 128) and a
   ResNet-50-sized CNN (batch 64, 224x224), random weights, and for real torch
   exports of BERT-base at opsets 14 and 17 and MPNet-base (float32.min mask
   fills) at 32 x 128 (``models/exports/speed/``, ``--speed-models``), each as
   fp32, onnxmp fp16 and onnxconverter-common (occ) fp16; inputs and outputs
   stay on the GPU (I/O binding), so the times are the model's, not PCIe
   copies.  Their fp16 parity at batch 2 is reported too, for information.
3. placement: one profiled run of each of those models; a converted model
   fails when ops of some type run on the CPU EP more often than in the
   float32 model (a node whose mixed types no CUDA kernel takes falls back
   to the CPU, with copies around it: fast-looking parity, 100x latency).
4. exports: every real export in ``models/exports/`` (BERT family at opsets 14
   and 17, GPT-2, T5, ViT, Swin, CNNs, wav2vec2; masks filled with float32.min
   and -1e9) converted for the CUDA EP by onnxmp and by occ, on 8 rows of its
   task: real-fp16 parity against fp32 on the CPU, and placement.  onnxmp's
   failures fail the check; occ's are information.  ``--dry-run`` takes only
   the two bert_m1e9 exports.

Prints one summary table; exits 1 if a models/ or export parity or a placement check fails, 2 if a step
crashed (no usable CUDA EP, a model that cannot be built or run).  ``--dry-run``
does the same on the CPU EP with emulated fp16 and tiny versions of the two big
models: latencies are then meaningless, it only proves every step runs.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from onnxmp.naming import json_safe
import onnxmp  # noqa: E402
from onnxmp.errors import first_line  # noqa: E402
from onnxmp.files import guard_arguments, write_text_atomic  # noqa: E402
from models import zoo  # noqa: E402
from onnxmp.parity.emulate import emulate  # noqa: E402
from onnxmp.parity.validate import validate  # noqa: E402

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
PARITY_BATCH = 2


# --- models ---------------------------------------------------------------------------


def bert_like(tiny: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, np.ndarray], str]:
    """zoo.transformer_stack has BERT's layer (4x FFN, Erf GELU, additive mask); BERT-base sizes it."""
    layers, hidden, heads, seq, batch = (1, 16, 2, 8, 2) if tiny else (12, 768, 12, 128, 32)
    model = zoo.transformer_stack(layers, hidden=hidden, seq=seq, heads=heads)
    feeds = zoo.inputs_for("transformer_stack", batch, seq=seq, hidden=hidden)
    small = zoo.inputs_for("transformer_stack", PARITY_BATCH, seq=seq, hidden=hidden)
    return model, feeds, small, f"bert_base b{batch} s{seq}" if not tiny else f"bert_tiny b{batch} s{seq}"


def resnet(width: int = 64, blocks=(3, 4, 6, 3), image: int = 224, classes: int = 1000,
           seed: int = 0) -> onnx.ModelProto:
    """ResNet-50 v1.5 shape (bottlenecks, stride on the 3x3) with He-initialized random weights.

    BatchNorm stays a separate node (running mean 0, var 1) as in an eval export.
    The last BN of each bottleneck scales by 0.2, so the residual stream grows
    ~4% per block instead of doubling: random weights stay well inside fp16.
    """
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    count = [0]

    def name(kind: str) -> str:
        count[0] += 1
        return f"{kind}_{count[0]}"

    def init(prefix: str, array: np.ndarray) -> str:
        n = name(prefix)
        inits.append(numpy_helper.from_array(array.astype(np.float32), n))
        return n

    def node(op: str, inputs: list[str], **attrs) -> str:
        n = name(op)
        nodes.append(helper.make_node(op, inputs, [n + "_out"], name=n, **attrs))
        return n + "_out"

    def conv(x: str, cin: int, cout: int, k: int, stride: int = 1) -> str:
        w = init("w", rng.standard_normal((cout, cin, k, k)) * math.sqrt(2.0 / (cin * k * k)))
        return node("Conv", [x, w], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4)

    def bn(x: str, c: int, gamma: float = 1.0) -> str:
        params = [init("bn_scale", np.full(c, gamma)), init("bn_bias", np.zeros(c)),
                  init("bn_mean", np.zeros(c)), init("bn_var", np.ones(c))]
        return node("BatchNormalization", [x, *params], epsilon=1e-5)

    x = node("Relu", [bn(conv("x", 3, width, 7, 2), width)])
    x = node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = width
    for stage, n_blocks in enumerate(blocks):
        planes = width * 2 ** stage
        cout = planes * 4
        for b in range(n_blocks):
            stride = 2 if b == 0 and stage > 0 else 1
            shortcut = bn(conv(x, cin, cout, 1, stride), cout) if b == 0 else x
            h = node("Relu", [bn(conv(x, cin, planes, 1), planes)])
            h = node("Relu", [bn(conv(h, planes, planes, 3, stride), planes)])
            h = bn(conv(h, planes, cout, 1), cout, gamma=0.2)
            x = node("Relu", [node("Add", [h, shortcut])])
            cin = cout
    x = node("Flatten", [node("GlobalAveragePool", [x])], axis=1)
    fc_w = init("fc_w", rng.standard_normal((classes, cin)) * math.sqrt(1.0 / cin))
    fc_b = init("fc_b", np.zeros(classes))
    nodes.append(helper.make_node("Gemm", [x, fc_w, fc_b], ["logits"], name="fc", transB=1))
    graph = helper.make_graph(nodes, "resnet", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                              ["N", 3, image, image])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", zoo.OPSET)],
                              producer_name="onnxmp.scripts.gpu_check")
    model.ir_version = zoo.IR_VERSION  # onnxruntime 1.19 refuses newer IRs
    onnx.checker.check_model(model)
    return model


def resnet_like(tiny: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, np.ndarray], str]:
    if tiny:
        model, batch, image = resnet(width=4, blocks=(1, 1, 1, 1), image=32, classes=10), 2, 32
    else:
        model, batch, image = resnet(), 64, 224
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((batch, 3, image, image)).astype(np.float32)}
    small = {"x": feeds["x"][:PARITY_BATCH].copy()}
    return model, feeds, small, f"resnet50 b{batch} {image}px" if not tiny else f"resnet_tiny b{batch} {image}px"


# --- running ----------------------------------------------------------------------------


def environment(provider: str, info: dict) -> None:
    """Fill ``info`` with what runs where; raise if ``provider`` cannot run a session."""
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls") and provider == "cuda":
        # onnxruntime >= 1.21 finds the CUDA/cuDNN libs of the nvidia-* wheels this way.
        ort.preload_dlls()
    info.update(python=platform.python_version(), onnxruntime=ort.__version__, onnx=onnx.__version__,
                available_providers=ort.get_available_providers(), provider=provider)
    try:
        info["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                      "--format=csv,noheader"], capture_output=True, text=True,
                                     timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    if PROVIDERS[provider] not in info["available_providers"]:
        raise RuntimeError(f"{PROVIDERS[provider]} is not available in onnxruntime {ort.__version__} "
                           f"(providers: {info['available_providers']})")
    # The EP is listed even without a usable GPU; one tiny session tells for sure, once.
    probe = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]),
        opset_imports=[helper.make_opsetid("", zoo.OPSET)])
    probe.ir_version = zoo.IR_VERSION
    session(probe, provider)


def session(model: onnx.ModelProto, provider: str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    providers = [PROVIDERS[provider]] + ([PROVIDERS["cpu"]] if provider == "cuda" else [])
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    if PROVIDERS[provider] not in sess.get_providers():
        raise RuntimeError(f"{PROVIDERS[provider]} failed to initialize")
    return sess


def latency_ms(model: onnx.ModelProto, feeds: dict[str, np.ndarray], provider: str, warmup: int,
               iters: int) -> float:
    import onnxruntime as ort

    sess = session(model, provider)
    binding = sess.io_binding()
    device = "cuda" if provider == "cuda" else "cpu"
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, device, 0))
    for out in sess.get_outputs():
        binding.bind_output(out.name, device)
    for _ in range(warmup):  # also cuDNN's algorithm search on the first run
        sess.run_with_iobinding(binding)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        sess.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def cpu_placed(model: onnx.ModelProto, feeds: dict[str, np.ndarray], provider: str) -> dict[str, int]:
    """Op type -> nodes ORT ran on the CPU EP in one profiled run (an EP's own copies left out)."""
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="onnxmp-gpu-check-") as folder:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(folder) / "profile")
        providers = [PROVIDERS[provider]] + ([PROVIDERS["cpu"]] if provider == "cuda" else [])
        sess = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
        sess.run(None, feeds)
        events = json.loads(Path(sess.end_profiling()).read_text())
    nodes: dict[str, str] = {}
    for event in events:
        args = event.get("args", {})
        if event.get("cat") == "Node" and args.get("provider") == PROVIDERS["cpu"] and args.get("op_name"):
            nodes[event["name"].rsplit("_kernel_time", 1)[0]] = args["op_name"]
    counts: dict[str, int] = {}
    for op in nodes.values():
        if not op.startswith("Memcpy"):
            counts[op] = counts.get(op, 0) + 1
    return counts


def moved_to_cpu(reference: dict[str, int], converted: dict[str, int]) -> dict[str, int]:
    """Op types the converted model runs on the CPU more often than the float32 model does.
    Casts count too: the ones onnxmp adds must run where their neighbours run."""
    return {op: n - reference.get(op, 0) for op, n in sorted(converted.items()) if n > reference.get(op, 0)}


def convert_occ(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxconverter_common import float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one warning per clamped constant
        return float16.convert_float_to_float16(model, keep_io_types=True)


def error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {first_line(exc, 300)}"


def parity_cell(report) -> dict:
    floats = [o for o in report.outputs if not o.exact]
    errs = [o.max_abs_err for o in floats if o.max_abs_err is not None]
    cosines = [o.cosine for o in floats if o.cosine is not None]
    return {"passed": report.passed, "max_abs_err": max(errs) if errs else None,
            "cosine": min(cosines) if cosines else None, "failures": report.failures()}


def check_parity(provider: str, precision: str = "float16") -> list[dict]:
    rows = []
    for path in sorted((ROOT / "models").glob("*.onnx")):
        npz = path.with_name(path.stem + ".inputs.npz")
        row = {"model": path.stem}
        try:
            converted = onnxmp.convert(str(path), precision=precision).model
            report = validate(str(path), converted, inputs=str(npz) if npz.is_file() else None, provider=provider)
            row.update(parity_cell(report))
        except Exception as exc:
            row.update(passed=False, error=error_text(exc))
        rows.append(row)
    return rows


def check_exports(provider: str, precision: str, dry_run: bool) -> list[dict]:
    from models.exports import tasks

    rows = []
    paths = sorted((ROOT / "models" / "exports").glob("*.onnx"))
    for path in paths if not dry_run else [p for p in paths if p.name.startswith("bert_m1e9.")]:
        arch = path.name.split(".")[0]
        row: dict = {"model": path.stem}
        try:
            data = tasks.make(arch, 8, seed=1)
            feeds = {name: data[name] for name in tasks.SPECS[arch]["inputs"]}
            model = onnx.load(str(path))
            reference = cpu_placed(model, feeds, provider) if provider == "cuda" else None
            tools = ("ours", "occ") if precision == "float16" else ("ours",)
            for tool in tools:
                try:
                    low = (onnxmp.convert(model, target="cuda", precision=precision).model if tool == "ours"
                           else convert_occ(onnx.load(str(path))))
                    row[f"parity_{tool}"] = parity_cell(validate(model, low, inputs=feeds, provider=provider))
                    if reference is not None:
                        row[f"moved_to_cpu_{tool}"] = moved_to_cpu(reference, cpu_placed(low, feeds, provider))
                except Exception as exc:
                    if tool == "ours":
                        raise
                    row["error_occ"] = error_text(exc)  # occ's models are information (ViT's do not load)
            row["passed"] = export_passed(row)
        except Exception as exc:
            row["error"] = error_text(exc)
            traceback.print_exc()
        rows.append(row)
    return rows


def export_passed(row: dict) -> bool:
    """onnxmp's conversion of an export passes when nothing moved to the CPU EP and its parity
    passes, or fails only where occ's fails too (random-init logits near zero inflate the relative
    error of both: mpnet's 1.2e-2 against 1e-2).  An occ model onnxruntime does not load (validate
    loads the candidate itself: mpnet's, with its Casts left float16) fails too."""
    ours, occ = row["parity_ours"], row.get("parity_occ")
    occ_failed = (occ is not None and not occ["passed"]) or "error_occ" in row
    return not row.get("moved_to_cpu_ours") and (ours["passed"] or occ_failed)


# The base-size torch exports timed by default (the set: BERTs at opsets 14 and 17, an
# MPNet with float32.min masks); ``--speed-models all`` times every one in models/exports/speed/.
SPEED_DEFAULT = ("bert_base.torchscript14", "bert_base.torchscript17", "mpnet_base.torchscript17")
SPEED_DRY_RUN = ("mobilenetv2.torchscript17",)  # the smallest: a dry run stays short


def speed_export_builders(which: str, tiny: bool) -> list:
    """Builders like :func:`bert_like` for the skeletons of ``models/exports/speed/`` (weights drawn
    again, ``models/exports/skeleton.py``) at their benchmark shapes (text 32 x 128); with ``tiny``
    (a dry run) one model at its trace shapes."""
    if which == "none":
        return []
    sys.path.insert(0, str(ROOT / "models" / "exports"))
    import export_speed
    import skeleton

    entries = skeleton.manifest()
    keys = SPEED_DRY_RUN if tiny else (SPEED_DEFAULT if which == "default" else tuple(entries))

    def builder(key: str):
        def build(_tiny: bool):
            entry = entries[key]
            model = skeleton.load(skeleton.SPEED_DIR / entry["file"])
            feeds = export_speed.feeds(entry, shapes="trace" if tiny else "benchmark")
            small = export_speed.feeds(entry, seed=1, shapes="trace")
            shape = "x".join(map(str, entry["inputs"][0]["trace_shape" if tiny else "shape"]))
            return model, feeds, small, f"{key} {shape}"
        build.__name__ = key
        return build

    return [builder(key) for key in keys]


def check_latency(provider: str, tiny: bool, warmup: int, iters: int, precision: str = "float16",
                  speed_models: str = "default") -> list[dict]:
    rows = []
    for build in (bert_like, resnet_like, *speed_export_builders(speed_models, tiny)):
        row: dict = {}
        try:
            model, feeds, small, label = build(tiny)
            row["model"] = label
            candidates = {"ours": onnxmp.convert(model, precision=precision).model}
            if precision == "float16":
                candidates["occ"] = convert_occ(model)
            runnable = {"fp32": model}
            for tool, fp16 in candidates.items():
                # The CPU EP lacks most fp16 kernels: a dry run times the emulated model instead.
                runnable[tool] = fp16 if provider == "cuda" else emulate(fp16, precision)
            for key, m in runnable.items():
                row[f"{key}_ms"] = latency_ms(m, feeds, provider, warmup, iters)
            row["speedup_ours"] = row["fp32_ms"] / row["ours_ms"]
            if "occ" in candidates:
                row["speedup_occ"] = row["fp32_ms"] / row["occ_ms"]
                row["ours_over_occ"] = row["ours_ms"] / row["occ_ms"]
            for tool, fp16 in candidates.items():
                row[f"parity_{tool}"] = parity_cell(validate(model, fp16, inputs=small, provider=provider))
            if provider == "cuda":  # on the CPU EP everything runs on the CPU: nothing to compare
                reference = cpu_placed(model, small, provider)
                for tool, fp16 in candidates.items():
                    row[f"moved_to_cpu_{tool}"] = moved_to_cpu(reference, cpu_placed(fp16, small, provider))
        except Exception as exc:
            row.setdefault("model", build.__name__)
            row["error"] = error_text(exc)
            traceback.print_exc()
        rows.append(row)
    return rows


# --- output -----------------------------------------------------------------------------


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _parity_text(p: dict) -> str:
    return f"max|err| {_num(p.get('max_abs_err'), '.2e')} cosine {_num(p.get('cosine'), '.7f')}"


def print_summary(result: dict) -> None:
    env = result.get("environment") or {}
    print(f"\nonnxruntime {env.get('onnxruntime')} on {env.get('provider')} "
          f"({env.get('gpu') or 'no GPU'}), {result.get('precision', 'float16')}"
          f"{' [dry run: emulated, tiny models]' if result['dry_run'] else ''}")
    rows = [("check", "model", "result", "detail")]
    for p in result["parity"]:
        detail = p.get("error") or _parity_text(p)
        if p.get("failures"):
            detail += "; " + "; ".join(p["failures"])
        rows.append(("parity", p["model"], "ok" if p["passed"] else "FAIL", detail))
    for r in result["latency"]:
        if "error" in r:
            rows.append(("latency", r["model"], "ERROR", r["error"]))
            continue
        detail = f"fp32 {r['fp32_ms']:.2f} ms | onnxmp {r['ours_ms']:.2f} ms ({r['speedup_ours']:.2f}x)"
        if "occ_ms" in r:
            detail += f" | occ {r['occ_ms']:.2f} ms ({r['speedup_occ']:.2f}x) | onnxmp/occ {r['ours_over_occ']:.2f}"
        rows.append(("latency", r["model"], "ok", detail))
        for tool in ("ours", "occ"):
            if f"parity_{tool}" not in r:
                continue
            p = r[f"parity_{tool}"]
            label = f"{r['model'].split()[0]} ({'onnxmp' if tool == 'ours' else tool})"
            rows.append((f"parity b{PARITY_BATCH}", label, "ok" if p["passed"] else "fail (info)", _parity_text(p)))
            moved = r.get(f"moved_to_cpu_{tool}")
            if moved is not None:
                failing = tool == "ours"  # occ's placement is information
                rows.append(("placement", label, "ok" if not moved else ("FAIL" if failing else "info"),
                             "no op moved to the CPU EP" if not moved else
                             "on the CPU EP (more than fp32): " + ", ".join(f"{op} x{n}" for op, n in moved.items())))
    for r in result.get("exports", []):
        if "error" in r:
            rows.append(("export", r["model"], "ERROR", r["error"]))
            continue
        for tool in ("ours", "occ"):
            if f"parity_{tool}" not in r:
                continue
            p, moved = r[f"parity_{tool}"], r.get(f"moved_to_cpu_{tool}")
            if tool == "ours":
                verdict = ("ok" if p["passed"] else "ok (occ fails too)") if r["passed"] else "FAIL"
            else:
                verdict = "ok" if p["passed"] and not moved else "fail (info)"
            detail = _parity_text(p) + ("; " + "; ".join(p["failures"]) if p.get("failures") else "")
            if moved:
                detail += "; on the CPU EP: " + ", ".join(f"{op} x{n}" for op, n in moved.items())
            rows.append(("export", f"{r['model']} ({'onnxmp' if tool == 'ours' else tool})", verdict, detail))
        if "error_occ" in r:
            rows.append(("export", f"{r['model']} (occ)", "error (info)", r["error_occ"]))
    for step, error in result.get("errors", {}).items():
        rows.append((step, "-", "ERROR", error))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
    print(f"\n{'PASSED' if result['passed'] else 'FAILED'} ({result['seconds']:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU EP, emulated fp16, tiny models")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per model (default 50; 3 with --dry-run)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 10; 1 with --dry-run)")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-exports", action="store_true", help="leave out the models/exports/ check")
    ap.add_argument("--speed-models", choices=("default", "all", "none"), default="default",
                    help="base-size torch exports timed beside the two built models: "
                         f"default {', '.join(SPEED_DEFAULT)}; all of models/exports/speed/; none")
    ap.add_argument("--precision", choices=("float16", "bfloat16"), default="float16",
                    help="low precision of the onnxmp models (default float16; occ only converts to float16)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    guard_arguments(ap, {"--json": args.json})
    provider = "cpu" if args.dry_run else "cuda"
    iters = args.iters or (3 if args.dry_run else 50)
    warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 10)

    start = time.perf_counter()
    result: dict = {"dry_run": args.dry_run, "precision": args.precision, "environment": {}, "parity": [], "latency": [], "exports": [], "errors": {}}
    try:
        environment(provider, result["environment"])
    except Exception as exc:
        result["errors"]["environment"] = error_text(exc)
    if not result["errors"]:
        print("parity of models/ ...", flush=True)
        result["parity"] = check_parity(provider, args.precision)
        if not args.skip_latency:
            print("latency ...", flush=True)
            result["latency"] = check_latency(provider, args.dry_run, warmup, iters, args.precision,
                                              args.speed_models)
        if not args.skip_exports:
            print("exports ...", flush=True)
            result["exports"] = check_exports(provider, args.precision, args.dry_run)
    crashed = bool(result["errors"]) or any("error" in r for r in result["latency"] + result["exports"])
    parity_ok = bool(result["parity"]) and all(p["passed"] for p in result["parity"])
    parity_ok = parity_ok and not any(r.get("moved_to_cpu_ours") for r in result["latency"])
    parity_ok = parity_ok and all(r["passed"] for r in result["exports"] if "passed" in r)
    result["passed"] = parity_ok and not crashed
    result["seconds"] = time.perf_counter() - start
    print_summary(result)
    if args.json:
        write_text_atomic(args.json, json.dumps(json_safe(result), indent=2))
        print(f"wrote {args.json}")
    if crashed:
        return 2
    return 0 if parity_ok else 1


if __name__ == "__main__":
    sys.exit(main())
