#!/usr/bin/env python
"""onnxmp's builder on the portable engine against ORT's on the native engine, in one process,
step by step in turn (the order swapped every step), on one intra-op thread: the CPU time of each
step (``time.process_time()``), its least and median over the steps, and their ratios.

``scripts/bench_training.py --builders`` runs each variant in a process of its own (for its peak
RSS); the load on a shared machine moves from one process to the next, which this interleaving
leaves out: both variants see the same minute.  Python 3.11 with the training build.

    PYTHONPATH=. python scripts/step_ab.py gpt2.torchscript17 [resnet.torchscript17 ...] [--steps 60]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "models" / "exports"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("entries", nargs="+")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--optimizer", default="adamw")
    args = parser.parse_args(argv)
    import tasks
    from bench_builders import _matrix, build

    from onnxmp.training import Trainer

    print(f"{'export':<28}{'cpu ms min: ort':>16}{'onnxmp':>8}{'ratio':>7}{'median: ort':>13}{'onnxmp':>8}{'ratio':>7}")
    for key in args.entries:
        entry = _matrix()[key]
        with tempfile.TemporaryDirectory(prefix="onnxmp-step-ab-") as tmp:
            trainers = {}
            for builder, engine in (("ort", "native"), ("onnxmp", "portable")):
                artifacts, _ = build(key, builder, "float32", "cpu", args.optimizer, Path(tmp) / builder)
                trainers[builder] = Trainer(artifacts, engine=engine, threads=1,
                                            lr=tasks.LR.get(entry["arch"], tasks.DEFAULT_LR))
            batches = tasks.batches(entry["arch"], entry["inputs"], 32)
            times: dict[str, list[float]] = {name: [] for name in trainers}
            for i in range(args.warmup + args.steps):
                order = list(trainers.items()) if i % 2 else list(reversed(trainers.items()))
                for name, trainer in order:
                    start = time.process_time()
                    trainer.train_step(*batches[i % len(batches)])
                    if i >= args.warmup:
                        times[name].append(time.process_time() - start)
            least = {name: min(t) * 1e3 for name, t in times.items()}
            middle = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            print(f"{key:<28}{least['ort']:>16.2f}{least['onnxmp']:>8.2f}{least['onnxmp'] / least['ort']:>7.2f}"
                  f"{middle['ort']:>13.2f}{middle['onnxmp']:>8.2f}{middle['onnxmp'] / middle['ort']:>7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
