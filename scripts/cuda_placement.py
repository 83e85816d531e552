#!/usr/bin/env python
"""Host-to-device traffic of the CUDA training step, per export of the matrix (no GPU needed).

For each entry of ``models/exports/matrix.json``, the float16 (``--precision``) target-``cuda`` training graph (the
lowered graph the portable engine runs) is placed as onnxruntime's CUDA EP would place it
(:func:`onnxmp.training.build.placement.place`):

- ``copies``: values copied host to device inside every step (a CPU-placed value read by a CUDA
  kernel's device-memory input);
- ``feed``: the CPU-placed nodes whose results reach such a copy: shape arithmetic feeding device data;
- ``to host``: values copied device to host (a device tensor read by a CPU node, or by a CUDA
  kernel's CPU-memory input), a stall too;

for (a) ORT's builder, lowered to standard ops (the portable path before onnxmp's builder; needs
onnxruntime-training: Python 3.11), (b) onnxmp's builder without the ``device_values`` stage, (c) with
it (what ``build_artifacts(target="cuda")`` writes).

    python scripts/cuda_placement.py [--entries bert2.torchscript17 ...] [--markdown table.md] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

COLUMNS = ("a", "b", "c")


def lowered(entry: str, builder: str, folder: Path, precision: str = "float16"):
    """The CUDA training graph of ``entry`` by ``builder``, as lowered (no device_values stage)."""
    import onnx

    import bench_builders
    from onnxmp.training.build import pipeline

    stages = pipeline.STAGES
    pipeline.STAGES = tuple(s for s in stages if s is not pipeline.DeviceValues)
    try:
        artifacts, _ = bench_builders.build(entry, builder, precision, "cuda", "adamw", folder)
    finally:
        pipeline.STAGES = stages
    return onnx.load(str(artifacts.portable_path("training_model")))


def measure(entry: str, tmp: Path, with_ort: bool, precision: str = "float16") -> dict:
    from onnxmp.training.build.device_values import keep_on_device
    from onnxmp.training.build.placement import place

    row = {}
    if with_ort:
        (tmp / f"{entry}.ort").mkdir()
        row["a"] = place(lowered(entry, "ort", tmp / f"{entry}.ort", precision)).summary()
    (tmp / f"{entry}.onnxmp").mkdir()
    model = lowered(entry, "onnxmp", tmp / f"{entry}.onnxmp", precision)
    row["b"] = place(model).summary()
    row["rewritten"] = keep_on_device(model)["rewritten"]
    row["c"] = place(model).summary()
    return row


def main(argv=None) -> int:
    from onnxmp.training import _ort

    matrix = json.loads((ROOT / "models" / "exports" / "matrix.json").read_text())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", nargs="*", default=[k for k, e in matrix.items() if "file" in e])
    parser.add_argument("--precision", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--markdown", type=Path, help="also write the table here (markdown)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    with_ort = _ort.available()
    rows, failed = {}, 0
    head = ("| entry | copies a | b | c | feed a | b | c | to host a | b | c | rewritten |\n"
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    kinds = ("copies", "feed", "to_host")
    print(head, flush=True)
    lines = [head]
    with tempfile.TemporaryDirectory(prefix="onnxmp-cuda-placement-") as tmp:
        for entry in args.entries:
            try:
                row = rows[entry] = measure(entry, Path(tmp), with_ort, args.precision)
            except Exception as exc:  # one entry's failure must not hide the others
                failed += 1
                line = f"| {entry} | error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} |"
            else:
                cell = lambda c, k: str(row[c][k]) if c in row else "-"  # noqa: E731
                line = (f"| {entry} | " + " | ".join(cell(c, k) for k in kinds for c in COLUMNS)
                        + f" | {row['rewritten']} |")
            print(line, flush=True)
            lines.append(line)
    done = [r for r in rows.values()]
    total = ("| **total** | " + " | ".join(str(sum(r[c][k] for r in done)) if all(c in r for r in done) else "-"
                                           for k in kinds for c in COLUMNS)
             + f" | {sum(r['rewritten'] for r in done)} |")
    print(total)
    lines.append(total)
    from onnxmp.files import write_text_atomic

    if args.markdown:
        write_text_atomic(args.markdown, "\n".join(lines) + "\n")
    if args.json:
        write_text_atomic(args.json, json.dumps(rows, indent=1) + "\n")
    return 1 if failed or any(r["c"]["copies"] for r in done) else 0


if __name__ == "__main__":
    sys.exit(main())
