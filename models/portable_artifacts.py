#!/usr/bin/env python
"""Training artifacts committed for CI's Python 3.12 leg: built here (Python 3.11, onnxruntime-training),
trained there with plain onnxruntime on the portable engine (tests/training/test_training_portable_committed.py).

One text, one vision and one audio export of the matrix, in float32, float16 and bfloat16, built for
``target="cpu"`` (low precision emulated: float32 compute with rounding Casts, which plain
onnxruntime's CPU EP runs; a ``target="cuda"`` build holds real float16/bfloat16 ops the CPU EP
lacks kernels for) into ``models/artifacts/<entry>.<precision>/``.

    python models/portable_artifacts.py            # rebuild them all (replaces the folders)
    python models/portable_artifacts.py --check    # exit 1 if a committed folder differs from a fresh build
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPORTS = HERE / "exports"
OUT = HERE / "artifacts"
ENTRIES = ("bert2.torchscript17", "resnet.torchscript17", "wav2vec2.torchscript17")  # text, vision, audio
PRECISIONS = ("float32", "float16", "bfloat16")


def build(entry: str, precision: str, out: Path):
    import onnx

    from onnxmp.training import build_artifacts
    from onnxmp.training.build.prepare import without_gradient

    matrix = json.loads((EXPORTS / "matrix.json").read_text())
    model = onnx.load(str(EXPORTS / matrix[entry]["file"]))
    names = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    frozen = without_gradient(model, names)
    return build_artifacts(model, requires_grad=[n for n in names if n not in frozen], frozen=list(frozen),
                           loss="cross_entropy", optimizer="adamw", precision=precision, target="cpu", out_dir=out,
                           builder="ort")  # the reference builder, whose folders both engines run


UNCOMPARED = {"optimizer_model.onnx"}  # onnxblock's: no engine runs it, its names vary (below)


def _graph_summary(path: Path):
    import collections

    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return ([i.name for i in graph.input], [o.name for o in graph.output],
            sorted(collections.Counter(n.op_type for n in graph.node).items()))


def differences(committed: Path, fresh: Path) -> list[str]:
    """Files that differ between two artifacts folders: by bytes, except the ONNX graphs, compared
    by their inputs, outputs and op counts.  Builds are byte-reproducible but for two things:
    onnxblock names its optimizer model from a counter global to the process (not compared), and
    onnxruntime-training's gradient builder now and then orders a float16 graph's nodes
    (wav2vec2's) differently."""
    names = sorted(({p.name for p in committed.iterdir()} | {p.name for p in fresh.iterdir()}) - UNCOMPARED)
    changed = []
    for name in names:
        a, b = committed / name, fresh / name
        if not a.is_file() or not b.is_file():
            changed.append(name)
        elif name.endswith(".onnx"):
            if _graph_summary(a) != _graph_summary(b):
                changed.append(name)
        elif a.read_bytes() != b.read_bytes():
            changed.append(name)
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare the committed folders with a fresh build")
    args = parser.parse_args(argv)
    stale = []
    with tempfile.TemporaryDirectory(prefix="onnxmp-portable-artifacts-") as scratch:
        for entry in ENTRIES:
            for precision in PRECISIONS:
                name = f"{entry}.{precision}"
                if args.check:
                    diff = differences(OUT / name, build(entry, precision, Path(scratch) / name).directory)
                    if diff:
                        stale.append(f"{name}: {', '.join(diff)}")
                else:
                    OUT.mkdir(exist_ok=True)
                    build(entry, precision, OUT / name)
                    print(f"built {OUT / name}")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file()) if OUT.exists() else 0
    print(f"models/artifacts: {total / 2**20:.1f} MiB")
    for line in stale:
        print(f"stale: {line}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
