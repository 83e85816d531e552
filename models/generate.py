"""Write the committed test models and their sample inputs.

    python models/generate.py [--out models/]

Output is deterministic for the .onnx files (tests compare them byte for byte
with models.zoo); the .npz zip headers carry timestamps, so tests compare their
arrays instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
# Run as a script, sys.path[0] is models/, which would hide the `models` package.
sys.path.insert(0, str(HERE.parent))

from models import zoo  # noqa: E402
from onnxmp.files import atomic_write, write_bytes_atomic  # noqa: E402

MAX_BYTES = 2 * 1024 * 1024


def count_nodes(graph: onnx.GraphProto) -> int:
    n = 0
    for node in graph.node:
        n += 1
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                n += count_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                n += sum(count_nodes(sub) for sub in attr.graphs)
    return n


def _savez(path: Path, arrays: dict) -> None:
    with open(path, "wb") as f:  # a file object: np.savez would append .npz to a temporary's name
        np.savez(f, **arrays)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE, help="output directory (default: models/)")
    args = ap.parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file of that name, a read-only parent
        ap.error(f"cannot create --out {args.out}: {exc.strerror or exc}")

    print(f"{'model':<20}{'nodes':>7}{'(+sub)':>8}{'bytes':>10}  inputs")
    for name in zoo.COMMITTED:
        model = zoo.build(name)
        data = model.SerializeToString()
        if len(data) >= MAX_BYTES:
            raise SystemExit(f"{name}: {len(data)} bytes, over the {MAX_BYTES} byte limit")
        write_bytes_atomic(args.out / f"{name}.onnx", data)
        feeds = zoo.inputs_for(name)
        atomic_write(args.out / f"{name}.inputs.npz", lambda tmp: _savez(tmp, feeds))
        shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in feeds.items())
        print(f"{name:<20}{len(model.graph.node):>7}{count_nodes(model.graph):>8}{len(data):>10}  {shapes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
