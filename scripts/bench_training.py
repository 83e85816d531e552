#!/usr/bin/env python
"""Training throughput: steps/s of float32 vs mixed precision on one device.

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split("-")], default=[1024, 4096, 4096, 1024, 10],
                        help="MLP layer sizes, e.g. 1024-4096-4096-1024-10")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--precision", choices=["float16", "bfloat16"], default="float16",
                        help="the mixed precision to compare with float32")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    guard_arguments(parser, {"--json": args.json})

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
