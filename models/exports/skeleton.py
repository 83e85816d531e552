#!/usr/bin/env python
"""Base-size exports without their weights: small enough to commit and to carry to a GPU machine.

``export_speed.py`` exports BERT-base-sized models from random-init configs: 100-440 MB each,
almost all of it random weights.  A *skeleton* keeps everything else of the export (the graph as
torch wrote it, every non-float tensor, every float tensor of up to ``KEEP`` elements: LayerNorm
scales, biases, mask constants) and, for each larger float tensor, only its dims and the mean and
standard deviation of its values (``metadata_props["onnxmp.skeleton"]``).  :func:`inflate`
draws those from a normal distribution with that mean and deviation, seeded by the tensor's name,
which is how the configs initialised them (``normal(0, 0.02)`` for transformers' linear and
embedding weights): the speed and the numerics of the model are those of the export, not of its
exact draw.

    python models/exports/skeleton.py /work/scratch/speed-models models/exports/speed

writes ``<name>.skeleton.onnx`` for every file ``speed.json`` lists, and the manifest beside them.
Needs only numpy and onnx, like its readers (``scripts/bench_speed.py --speed-models``,
``scripts/gpu_check.py``).
"""
from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

KEY = "onnxmp.skeleton"
KEEP = 4096  # float tensors up to this many elements are kept as they are
SPEED_DIR = Path(__file__).resolve().parent / "speed"
FLOATS = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.DOUBLE: np.float64}


def shrink(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (loaded with its weights) with every float initializer over ``KEEP`` elements
    replaced by its dims, type, mean and deviation."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    recipes, kept = {}, []
    for init in out.graph.initializer:
        size = int(np.prod(init.dims))
        if init.data_type in FLOATS and size > KEEP:
            values = numpy_helper.to_array(init).astype(np.float64)
            recipes[init.name] = {"dims": list(init.dims), "type": init.data_type,
                                  "mean": float(values.mean()), "std": float(values.std())}
        else:
            kept.append(init)
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    entry = out.metadata_props.add()
    entry.key, entry.value = KEY, json.dumps(recipes)
    return out


def inflate(model: onnx.ModelProto) -> onnx.ModelProto:
    """A skeleton with its weights drawn again (the same on every call and machine); a model that
    is no skeleton comes back as it is."""
    recipes = next((json.loads(p.value) for p in model.metadata_props if p.key == KEY), None)
    if recipes is None:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    props = [p for p in out.metadata_props if p.key != KEY]
    del out.metadata_props[:]
    out.metadata_props.extend(props)
    for name, r in recipes.items():
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        values = rng.normal(r["mean"], r["std"], r["dims"]).astype(FLOATS[r["type"]])
        out.graph.initializer.append(numpy_helper.from_array(values, name))
    return out


def load(path: str | Path) -> onnx.ModelProto:
    return inflate(onnx.load(str(path)))


def manifest(folder: Path = SPEED_DIR) -> dict:
    """``speed.json`` of ``folder``: per model, its skeleton file, inputs and benchmark shapes."""
    return json.loads((folder / "speed.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, help="export_speed.py's folder (the models and speed.json)")
    ap.add_argument("out", type=Path, nargs="?", default=SPEED_DIR, help="default: %(default)s")
    args = ap.parse_args(argv)
    entries = json.loads((args.source / "speed.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for key, entry in entries.items():
        skeleton = shrink(onnx.load(str(args.source / entry["file"])))
        entry["file"] = f"{key}.skeleton.onnx"
        onnx.save(skeleton, str(args.out / entry["file"]))
        print(f"{key}: {(args.out / entry['file']).stat().st_size / 1e6:.2f} MB")
    (args.out / "speed.json").write_text(json.dumps(entries, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
