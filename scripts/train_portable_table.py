#!/usr/bin/env python
"""Build once, train anywhere: artifacts built here (Python 3.11 with onnxruntime-training) are
trained by another Python (e.g. 3.12 with plain onnxruntime, ``--python``) on the portable
engine, and a table of the runs is printed.

For each export (BERT with 2 inputs, GPT-2, a dynamo BERT, ViT, ResNet: all with dynamic axes)
and precision, the build targets the CPU (``target="cpu"``: float16/bfloat16 are emulated, float32
compute with rounding Casts, since plain onnxruntime's CPU EP lacks most low-precision training
kernels); the other interpreter loads each folder with ``Trainer(engine="portable")``, evaluates
the loss on the task's batches, trains ``--epochs`` epochs and evaluates again.

Columns: the loss on the training batches before and after, the drop, the applied updates and the
seconds per update.  ``check``: float32 must drop by >= 10%, float16/bfloat16 must end within
10% of float32's initial loss (issue 28's bar).

    python scripts/train_portable_table.py --python /path/to/py312/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPORTS = ROOT / "models" / "exports"
ENTRIES = ("bert2.torchscript17", "gpt2.torchscript17", "bert2.dynamo18", "vit.torchscript17", "resnet.torchscript17")
PRECISIONS = ("float32", "float16", "bfloat16")
ROWS = 32


def _matrix() -> dict:
    return json.loads((EXPORTS / "matrix.json").read_text())


def build(entries, precisions, folder: Path) -> list[Path]:
    import onnx

    from onnxmp.training import build_artifacts
    from onnxmp.training.build.prepare import without_gradient

    matrix, built = _matrix(), []
    for entry in entries:
        model = onnx.load(str(EXPORTS / matrix[entry]["file"]))
        names = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
        frozen = without_gradient(model, names)
        for precision in precisions:
            out = folder / f"{entry}.{precision}"
            start = time.perf_counter()
            build_artifacts(model, requires_grad=[n for n in names if n not in frozen], frozen=list(frozen),
                            loss="cross_entropy", optimizer="adamw", precision=precision, target="cpu", out_dir=out)
            print(f"built {out.name} in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
            built.append(out)
    return built


def train(folders, epochs: int) -> None:
    """Runs in the other interpreter: one JSON line per folder on stdout."""
    import onnxruntime

    sys.path.insert(0, str(EXPORTS))
    import tasks

    from onnxmp.training import Trainer

    matrix = _matrix()
    for folder in map(Path, folders):
        entry, precision = folder.name.rsplit(".", 1)
        arch = matrix[entry]["arch"]
        batches = tasks.batches(arch, matrix[entry]["inputs"], ROWS)
        trainer = Trainer(folder, engine="portable", lr=tasks.LR.get(arch, tasks.DEFAULT_LR))
        initial = trainer.evaluate(batches)["loss"]
        start = time.perf_counter()
        trainer.fit(batches, epochs, progress=False)
        seconds = time.perf_counter() - start
        final = trainer.evaluate(batches)["loss"]
        print(json.dumps({"entry": entry, "precision": precision, "initial": initial, "final": final,
                          "steps": trainer.optimizer_steps, "skipped": trainer.skipped_steps,
                          "s_per_step": seconds / max(trainer.micro_steps, 1), "engine": trainer.engine.name,
                          "python": sys.version.split()[0], "onnxruntime": onnxruntime.__version__}), flush=True)


def table(rows: list[dict]) -> tuple[str, bool]:
    fp32_initial = {r["entry"]: r["initial"] for r in rows if r["precision"] == "float32"}
    lines = [f"{'entry':<22}{'precision':>10}{'initial':>9}{'final':>9}{'drop %':>8}{'steps':>7}{'skipped':>8}"
             f"{'s/step':>8}  check"]
    ok = True
    for r in rows:
        drop = 100 * (r["initial"] - r["final"]) / r["initial"]
        if r["precision"] == "float32":
            good = drop >= 10
        else:
            good = r["final"] <= 1.1 * fp32_initial.get(r["entry"], r["initial"])
        ok &= good
        lines.append(f"{r['entry']:<22}{r['precision']:>10}{r['initial']:>9.4f}{r['final']:>9.4f}{drop:>8.1f}"
                     f"{r['steps']:>7}{r['skipped']:>8}{r['s_per_step']:>8.3f}  {'ok' if good else 'FAIL'}")
    return "\n".join(lines), ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter that trains (default: this one), e.g. a Python 3.12 venv with "
                             "`pip install -e .[cpu]`")
    parser.add_argument("--entries", nargs="+", default=list(ENTRIES))
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--keep", type=Path, help="build into this folder and keep it")
    parser.add_argument("--train", nargs="+", metavar="FOLDER", help=argparse.SUPPRESS)  # the child's side
    args = parser.parse_args(argv)
    if args.train:
        train(args.train, args.epochs)
        return 0
    with tempfile.TemporaryDirectory(prefix="onnxmp-portable-table-") as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        folders = build(args.entries, args.precisions, folder)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        child = subprocess.run([args.python, __file__, "--epochs", str(args.epochs), "--train", *map(str, folders)],
                               env=env, capture_output=True, text=True)
        rows = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
        if child.returncode != 0:
            print(child.stderr[-4000:], file=sys.stderr)
    if rows:
        print(f"built on Python {sys.version.split()[0]}; trained on Python {rows[0]['python']}, onnxruntime "
              f"{rows[0]['onnxruntime']}, engine {rows[0]['engine']}, {args.epochs} epochs of {ROWS} rows")
        text, ok = table(rows)
        print(text)
    else:
        ok = False
    return 0 if ok and child.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
