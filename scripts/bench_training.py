#!/usr/bin/env python
"""Training throughput: steps/s of float32 vs mixed precision on one device, and the portable
engine against the native one on the matrix's exports.

``--engines`` times the two engines side by side, in one run, on exports of the matrix
(models/exports/; a few by default, ``--all`` for every entry, or names): the same artifacts,
batches and settings, ``--steps`` timed micro-steps each (an update every step) after a warm-up;
it prints the per-step time of each, the portable/native ratio, and how far the two runs'
per-step losses are apart.  Ratios, not timed tests: the machine's load moves them.

``--builders`` sets onnxmp's gradient builder against onnxruntime-training's (Python 3.11 with the
training build), side by side in one run, per export (:mod:`bench_builders`): the training graph's
node count after onnxruntime's optimizations, the int64 nodes left in the CUDA-target float16 graph,
the step time of onnxmp's builder on the portable engine, ORT's builder on the native engine and
PyTorch (``--torch-python``) on 1 and 2 threads, and each one's peak RSS.

Builds an MLP (``--sizes``, default 1024-4096-4096-1024-10, ~25M parameters),
training artifacts for float32 and for mixed precision, then times
``Trainer.train_step`` (forward, backward, unscale, finite check, optimizer
step) on random data after a warm-up.

On ``--device cpu`` the mixed model is the *emulated* one (float32 compute plus
rounding Casts), so it is slower than float32 by construction: the CPU figure
measures emulation overhead, not a speed-up.  The speed-up of real float16 is
measured with ``--device cuda`` (needs the onnxruntime-training GPU build).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from onnxmp.training import DynamicLossScaler, Trainer, build_artifacts
from onnxmp.files import guard_arguments, write_text_atomic
from onnxmp.training.models import mlp, trainable


def measure(model, precision, args, workdir):
    artifacts = build_artifacts(model, requires_grad=trainable(model), precision=precision, target=args.device,
                                out_dir=workdir / precision)
    scaler = DynamicLossScaler() if precision == "float16" else DynamicLossScaler.static(1.0)
    trainer = Trainer(artifacts, device=args.device, scaler=scaler, lr=1e-4)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch_size, args.sizes[0])).astype(np.float32)
    y = rng.integers(0, args.sizes[-1], args.batch_size)
    for _ in range(args.warmup):
        trainer.train_step(x, y)
    start = time.perf_counter()
    for _ in range(args.steps):
        result = trainer.train_step(x, y)
    seconds = time.perf_counter() - start
    return {"steps_per_s": args.steps / seconds, "samples_per_s": args.steps * args.batch_size / seconds,
            "skipped_steps": trainer.skipped_steps, "last_loss": result.loss}


ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ENTRIES = ("bert2.torchscript17", "vit.torchscript17", "wav2vec2.torchscript17", "resnet.torchscript17-bn")


def time_engines(artifacts, batches, lr, args):
    """Both engines step by step in turn, each step timed: the machine's load falls on both alike
    (medians, not means, so a stall of the machine moves neither)."""
    def scaler():
        return DynamicLossScaler(2.0**16, growth_steps=5) if artifacts.precision == "float16" else None

    trainers = {engine: Trainer(artifacts, engine=engine, lr=lr, scaler=scaler()) for engine in ENGINES}
    times = {engine: [] for engine in ENGINES}
    results = {engine: [] for engine in ENGINES}
    for i in range(args.warmup + args.steps):
        batch = batches[i % len(batches)]
        for engine, trainer in trainers.items():
            start = time.perf_counter()
            result = trainer.train_step(*batch)
            if i >= args.warmup:
                times[engine].append(time.perf_counter() - start)
                results[engine].append(result)
    return {engine: statistics.median(t) for engine, t in times.items()}, results


def torch_times(args, names) -> dict:
    """Seconds per step of PyTorch on the same models (scripts/torch_step_time.py in ``--torch-python``)."""
    if not args.torch_python:
        return {}
    command = [args.torch_python, str(ROOT / "scripts" / "torch_step_time.py"), *names, "--optimizer", args.optimizer,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    child = subprocess.run(command, capture_output=True, text=True)
    rows = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0:
        print(f"note: {args.torch_python} failed: {child.stderr.strip().splitlines()[-1:]}")
    return {row["entry"]: row for row in rows}


ENGINES = ("native", "portable")


def bench_engines(args) -> int:
    import onnx

    sys.path[:0] = [str(ROOT / "models" / "exports")]
    import tasks
    from onnxmp.errors import OnnxMPError
    from onnxmp.training.build.prepare import without_gradient

    matrix = json.loads((ROOT / "models" / "exports" / "matrix.json").read_text())
    names = list(matrix) if args.all else [n for n in matrix if any(w in n for w in args.entries or DEFAULT_ENTRIES)]
    rows = {}
    torch = torch_times(args, names)
    print(f"{args.optimizer}, median of {args.steps} timed steps after {args.warmup} of warm-up, an update every "
          f"step, the engines in turn{'; torch: ' + args.torch_python if args.torch_python else ''}")
    print(f"{'export':<28}{'precision':>10}{'native ms':>11}{'portable ms':>13}{'ratio':>7}"
          f"{'max rel loss diff':>19}{'same skips':>11}{'torch ms':>10}{'portable/torch steps/s':>24}")
    with tempfile.TemporaryDirectory(prefix="onnxmp-bench-engines-") as folder:
        for key in names:
            entry = matrix[key]
            model = onnx.load(str(ROOT / "models" / "exports" / entry["file"]))
            params = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
            frozen = without_gradient(model, params)
            try:
                artifacts = build_artifacts(model, requires_grad=[n for n in params if n not in frozen],
                                            frozen=list(frozen), precision=args.precision, target="cpu",
                                            optimizer=args.optimizer, out_dir=Path(folder) / key)
                batches = tasks.batches(entry["arch"], entry["inputs"], 32)
                lr = tasks.LR.get(entry["arch"], tasks.DEFAULT_LR)
                seconds, runs = time_engines(artifacts, batches, lr, args)
            except OnnxMPError as exc:
                print(f"{key:<28}refused: {str(exc).splitlines()[0][:120]}")
                rows[key] = {"refused": str(exc).splitlines()[0]}
                continue
            native, portable = seconds["native"], seconds["portable"]
            a, b = runs["native"], runs["portable"]
            diff = max(abs(x.loss - y.loss) / max(abs(x.loss), 1e-12) for x, y in zip(a, b)
                       if np.isfinite(x.loss) and np.isfinite(y.loss))
            same = [(x.skipped, x.loss_scale) for x in a] == [(y.skipped, y.loss_scale) for y in b]
            rows[key] = {"native_s": native, "portable_s": portable, "ratio": portable / native,
                         "max_rel_loss_diff": diff, "same_skips_and_scales": same,
                         "skipped": sum(x.skipped for x in a)}
            theirs = torch.get(key, {})
            if "torch_s" in theirs:
                rows[key]["torch_s"] = theirs["torch_s"]
                versus = f"{theirs['torch_s'] * 1e3:>10.1f}{theirs['torch_s'] / portable:>24.2f}"
            else:
                versus = f"{'-':>10}{theirs.get('error', '-')[:40]:>24}"
            print(f"{key:<28}{args.precision:>10}{native * 1e3:>11.1f}{portable * 1e3:>13.1f}"
                  f"{portable / native:>7.2f}{diff:>19.2e}{str(same):>11}{versus}", flush=True)
    if args.json:
        write_text_atomic(args.json, json.dumps({"steps": args.steps, "precision": args.precision,
                                                 "optimizer": args.optimizer, "rows": rows}, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", action="store_true",
                        help="portable vs native step time on exports of the matrix (CPU)")
    parser.add_argument("--builders", action="store_true",
                        help="onnxmp's gradient builder vs ORT's (and PyTorch): graph sizes, int64 nodes of the "
                             "CUDA graph, step time on 1 and 2 threads, peak RSS (scripts/bench_builders.py)")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw", help="with --engines (default adamw)")
    parser.add_argument("--all", action="store_true", help="with --engines: every entry of the matrix")
    parser.add_argument("--entries", nargs="+", metavar="NAME",
                        help=f"with --engines: entries whose name contains one of these "
                             f"(default: {' '.join(DEFAULT_ENTRIES)})")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split("-")], default=[1024, 4096, 4096, 1024, 10],
                        help="MLP layer sizes, e.g. 1024-4096-4096-1024-10")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--precision", choices=["float32", "float16", "bfloat16"], default=None,
                        help="the mixed precision to compare with float32 (default float16); with --engines "
                             "the precision of both runs (default float32)")
    parser.add_argument("--torch-python", metavar="PYTHON",
                        help="with --engines: an interpreter with torch and transformers (e.g. "
                             "/work/scratch/torchenv/bin/python) that times PyTorch on the same models and batches")
    parser.add_argument("--repeat", type=int, default=1,
                        help="with --builders: runs of each variant, in turn; the median counts (default 1)")
    parser.add_argument("--alternate", action="store_true",
                        help="with --builders: swap the builders' order every round (with --repeat)")
    parser.add_argument("--no-cuda", action="store_true",
                        help="with --builders: skip the CUDA float16 builds (int64/copies/feed columns), which "
                             "double the build time and do not bear on the CPU step time")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    guard_arguments(parser, {"--json": args.json})
    if args.builders:
        if "--steps" not in (argv or sys.argv):
            args.steps = 20
        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_builders import bench_builders

        return bench_builders(args)
    if args.engines:
        args.precision = args.precision or "float32"
        if "--steps" not in (argv or sys.argv):
            args.steps = 30
        return bench_engines(args)
    args.precision = args.precision or "float16"
    if args.precision == "float32":
        parser.error("--precision float32 is the baseline; name the mixed precision to compare with it")

    model = mlp(args.sizes, seed=0)
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    with tempfile.TemporaryDirectory(prefix="onnxmp-bench-") as folder:
        results = {p: measure(model, p, args, Path(folder)) for p in ("float32", args.precision)}
    speedup = results[args.precision]["steps_per_s"] / results["float32"]["steps_per_s"]
    mode = "emulated (CPU: overhead, not speed-up)" if args.device == "cpu" else "real"
    print(f"MLP {'-'.join(map(str, args.sizes))} ({params / 1e6:.1f}M parameters), batch {args.batch_size}, "
          f"{args.steps} timed steps on {args.device}; mixed = {mode}")
    print(f"{'precision':<12}{'steps/s':>10}{'samples/s':>12}{'skipped':>9}")
    for name, r in results.items():
        print(f"{name:<12}{r['steps_per_s']:>10.2f}{r['samples_per_s']:>12.0f}{r['skipped_steps']:>9}")
    print(f"mixed / fp32 steps/s: {speedup:.2f}x")
    if args.json:
        write_text_atomic(args.json, json.dumps({"device": args.device, "sizes": args.sizes,
                                                 "batch_size": args.batch_size, "parameters": params,
                                                 "results": results, "speedup": speedup}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
