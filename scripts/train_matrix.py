#!/usr/bin/env python
"""Train every export of the matrix (models/exports/) in float32, float16 and bfloat16 and print the table.

    python scripts/train_matrix.py                 # all entries, markdown table
    python scripts/train_matrix.py bert vit --json # entries whose name contains "bert" or "vit"

Each cell is the loss on the task's training data before and after 4 epochs
(32 rows, batches of 8, AdamW), as tests/training/test_training_exports.py
trains them, with the number of skipped steps; low precision is emulated on
the CPU.  An entry onnxmp refuses shows the error's first line instead.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPORTS = ROOT / "models" / "exports"
sys.path[:0] = [str(ROOT), str(EXPORTS)]

import onnx  # noqa: E402

import tasks  # noqa: E402
from onnxmp.errors import OnnxMPError  # noqa: E402
from onnxmp.training import Trainer, build_artifacts  # noqa: E402
from onnxmp.training.build.prepare import without_gradient  # noqa: E402

PRECISIONS = ("float32", "float16", "bfloat16")


def run(entry: dict, precision: str, folder: Path) -> dict:
    model = onnx.load(str(EXPORTS / entry["file"]))
    names = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    frozen = without_gradient(model, names)
    start = time.perf_counter()
    try:
        artifacts = build_artifacts(model, requires_grad=[n for n in names if n not in frozen],
                                    frozen=list(frozen), precision=precision, target="cpu",
                                    out_dir=folder / precision)
        batches = tasks.batches(entry["arch"], entry["inputs"], 32)
        trainer = Trainer(artifacts, lr=tasks.LR.get(entry["arch"], tasks.DEFAULT_LR))
        initial = trainer.evaluate(batches)["loss"]
        trainer.fit(batches, 4, progress=False)
        final = trainer.evaluate(batches)["loss"]
    except OnnxMPError as exc:
        return {"refused": str(exc).splitlines()[0]}
    return {"initial": initial, "final": final, "skipped": trainer.skipped_steps,
            "seconds": time.perf_counter() - start, "frozen": len(frozen), "trained": len(names) - len(frozen)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="only entries whose name contains one of these")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    matrix = json.loads((EXPORTS / "matrix.json").read_text())
    rows = {}
    with tempfile.TemporaryDirectory(prefix="onnxmp-matrix-") as tmp:
        for key, entry in matrix.items():
            if args.names and not any(n in key for n in args.names):
                continue
            (Path(tmp) / key).mkdir()
            rows[key] = {p: run(entry, p, Path(tmp) / key) for p in PRECISIONS}
            rows[key]["nodes"] = entry["nodes"]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| export | nodes | trained / frozen | " + " | ".join(PRECISIONS) + " |")
    print("|---|---|---|" + "---|" * len(PRECISIONS))
    for key, row in rows.items():
        cells = []
        for p in PRECISIONS:
            r = row[p]
            cells.append(f"refused: {r['refused']}" if "refused" in r else
                         f"{r['initial']:.3f} → {r['final']:.3f}" + (f" ({r['skipped']} skipped)" if r["skipped"] else ""))
        first = row[PRECISIONS[0]]
        params = f"{first.get('trained', '-')} / {first.get('frozen', '-')}"
        print(f"| `{key}` | {row['nodes']} | {params} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
