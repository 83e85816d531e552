#!/usr/bin/env python
"""OPTIONAL real-export check (not run in CI): fine-tune what scripts/export_minilm.py wrote.

    python scripts/check_real_export.py DIR [--build-only] [--epochs 1] [--batch-size 16] [--lr 2e-4]

Builds training artifacts with every float initializer trainable (but those
:func:`onnxmp.training.build.prepare.without_gradient` names: constants some exporters
store as initializers) for float32,
float16 and bfloat16 (CPU target), then trains float32 and float16 (dynamic
loss scaling) for the same steps on the same batches and prints loss, skipped
steps, NaN count and eval accuracy side by side.  Each training run happens in
a fresh subprocess, so a crash of one shows as its exit code.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def train_one(folder: Path, precision: str, args) -> dict:
    import onnx

    from onnxmp.training import Trainer, build_artifacts
    from onnxmp.training.models import trainable

    model = onnx.load(folder / "minilm_cls.onnx")
    columns = [v.name for v in model.graph.input]
    start = time.perf_counter()
    from onnxmp.training.build.prepare import without_gradient

    # Constants an exporter stored as initializers (dynamo: a clamp minimum) cannot have a gradient.
    weights = trainable(model)
    constant = without_gradient(model, weights)
    if args.freeze_scalars:  # torch's dynamo exporter stores scalar constants as initializers
        float_weights = set(weights)
        constant.update({t.name: "a scalar constant" for t in model.graph.initializer
                         if not t.dims and t.name in float_weights})
    artifacts = build_artifacts(model, requires_grad=[n for n in weights if n not in constant],
                                frozen=list(constant), precision=precision, target="cpu",
                                out_dir=Path(args.work) / precision)
    build_s = time.perf_counter() - start
    if args.build_only:
        return {"precision": precision, "build_s": build_s, "frozen": constant,
                "prepared": artifacts.manifest["prepared_for_gradient"]}
    train, evaluation = np.load(folder / "train.npz"), np.load(folder / "eval.npz")
    scaler = None
    if args.initial_scale and precision == "float16":
        from onnxmp.training import DynamicLossScaler

        # Start far too high, so the first steps overflow and are skipped: what follows must stay finite.
        scaler = DynamicLossScaler(args.initial_scale, max_scale=max(args.initial_scale, 2.0**24))
    trainer = Trainer(artifacts, lr=args.lr, scaler=scaler)
    rows = len(train["labels"])
    losses, skipped = [], 0
    start = time.perf_counter()
    nan_after_skip = 0
    for i in range(0, rows - args.batch_size + 1, args.batch_size):
        r = trainer.train_step(*[train[k][i:i + args.batch_size] for k in columns],
                               train["labels"][i:i + args.batch_size])
        losses.append(r.loss)
        nan_after_skip += bool(skipped) and not math.isfinite(r.loss)
        skipped += r.skipped
    train_s = time.perf_counter() - start
    batches = [tuple(evaluation[k][i:i + 64] for k in [*columns, "labels"])
               for i in range(0, len(evaluation["labels"]), 64)]
    result = trainer.evaluate(batches, ["accuracy"])
    weights_finite = all(np.isfinite(v).all() for v in trainer.parameters().values())
    return {"precision": precision, "build_s": build_s, "train_s": train_s, "steps": len(losses),
            "first_loss": losses[0], "last_loss": losses[-1],
            "nan_losses": sum(not math.isfinite(x) for x in losses), "skipped": skipped,
            "nan_after_a_skip": nan_after_skip, "final_scale": trainer.scaler.scale, "eval_loss": result["loss"],
            "eval_accuracy": result["accuracy"], "weights_finite": weights_finite,
            "frozen": constant, "losses": losses, "prepared": artifacts.manifest["prepared_for_gradient"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--precision", help="run only this one (used for the subprocesses)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--work", default=None)
    ap.add_argument("--initial-scale", type=float, default=None,
                    help="float16 run: initial loss scale (2**40 forces skipped steps at the start)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--freeze-scalars", action="store_true", help="do not train 0-d float initializers")
    ap.add_argument("--same-process", action="store_true",
                    help="train float32 then float16 in this process (the order the issue saw NaN in)")
    args = ap.parse_args(argv)
    from onnxmp.files import guard_arguments

    guard_arguments(ap, {"--json": args.json}, {"model": args.folder / "minilm_cls.onnx"})
    if args.work:
        return run(args)
    # The artifacts (several copies of the model) are scratch: they go when the run ends, even on error.
    with tempfile.TemporaryDirectory(prefix="onnxmp-real-") as work:
        args.work = work
        return run(args)


def run(args) -> int:
    from onnxmp.files import write_text_atomic

    if args.precision:
        print(json.dumps(train_one(args.folder, args.precision, args)))
        return 0
    results = []
    precisions = ("float32", "float16", "bfloat16") if args.build_only else ("float32", "float16")
    for precision in precisions:
        if args.same_process:
            results.append(train_one(args.folder, precision, args))
            print({k: v for k, v in results[-1].items() if k not in ("losses", "prepared")}, flush=True)
            continue
        cmd = [sys.executable, __file__, str(args.folder), "--precision", precision, "--work", args.work,
               "--batch-size", str(args.batch_size), "--lr", str(args.lr)] + (["--build-only"] if args.build_only else []) + (
                   ["--initial-scale", str(args.initial_scale)] if args.initial_scale else []) + (
                   ["--freeze-scalars"] if args.freeze_scalars else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            results.append({"precision": precision, "exit_code": proc.returncode, "error": proc.stderr[-2000:]})
        else:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print({k: v for k, v in r.items() if k not in ("losses", "prepared")}, flush=True)
    if results and "prepared" in results[0]:
        print("prepared for the gradient builder:")
        for row in results[0]["prepared"]:
            print(f"  {row['op_type']:<20} x{row['nodes']:<4} {row['action']}")
    if args.json:
        write_text_atomic(args.json, json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
