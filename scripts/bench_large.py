"""Time and peak memory of every command on a generated model over 2 GB.

    python scripts/bench_large.py [--layers 36] [--width 4096] [--folder DIR] [--keep]

Writes ``models/large.py``'s model (36 x 4096 blocks: 2.42 GB, one block losing float16 parity)
into a temporary folder (or ``--folder``), then runs, each in a fresh process, ``convert``,
``convert --calibrate``, ``validate`` (reference against the calibrated model), ``emulate`` and
``explain``, and prints wall seconds and peak RSS (the child's own ``ru_maxrss``), also as a
multiple of the float32 weights.  What it wrote is deleted afterwards unless ``--keep``.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from models.large import NAME, inputs, run_measured, write_large_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--folder", type=Path, help="where to write the model (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the folder and what the commands wrote")
    args = parser.parse_args(argv)
    if args.folder is not None and args.folder.exists() and any(args.folder.iterdir()):
        parser.error(f"--folder {args.folder} is not empty")
    created = args.folder is None or not args.folder.exists()  # a folder we made goes whole
    folder = args.folder or Path(tempfile.mkdtemp(prefix="onnxmp-bench-large-"))
    written = [NAME, f"{NAME}.data", "x.npz", "cal.onnx", "cal.onnx.data"]
    try:
        model = write_large_model(folder, layers=args.layers, width=args.width, culprit=args.layers // 2)
        np.savez(folder / "x.npz", **inputs(args.width))
        weights = (folder / f"{NAME}.data").stat().st_size
        size = weights + model.stat().st_size
        f = lambda name: str(folder / name)  # noqa: E731
        steps = [
            ("convert", ["convert", f(NAME), "-o", f("plain.onnx")]),
            ("convert --calibrate", ["convert", f(NAME), "-o", f("cal.onnx"), "--calibrate", f("x.npz")]),
            ("validate (fp32 vs calibrated)", ["validate", f(NAME), f("cal.onnx"), "--inputs", f("x.npz")]),
            ("emulate (calibrated)", ["emulate", f("cal.onnx"), "-o", f("cal.emu.onnx")]),
            ("explain", ["explain", f(NAME)]),
        ]
        print(f"model: {args.layers} x MatMul {args.width}x{args.width} + LayerNormalization + Relu, "
              f"{size / 1e9:.2f} GB ({weights / 2**30:.2f} GiB of float32 weights); "
              f"{platform.machine()}, {os.cpu_count()} cores")
        print(f"{'command':32} {'seconds':>8} {'peak RSS':>10} {'x weights':>10}  exit")
        for label, command in steps:
            run = run_measured(["-m", "onnxmp", *command], cwd=ROOT)
            print(f"{label:32} {run.seconds:8.1f} {run.peak_rss / 2**30:8.2f} GiB {run.peak_rss / weights:9.2f}x  "
                  f"{run.returncode}", flush=True)
            if run.returncode not in (0,):
                print("   " + (run.stderr.strip().splitlines() or ["?"])[-1])
            for name in ("plain.onnx", "plain.onnx.data", "cal.emu.onnx", "cal.emu.onnx.data"):
                if not args.keep:  # the disk holds the model and one output at a time
                    (folder / name).unlink(missing_ok=True)
    finally:
        if not args.keep and created:
            shutil.rmtree(folder, ignore_errors=True)
        elif not args.keep:
            for name in written:
                (folder / name).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
