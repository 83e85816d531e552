"""Write the training demo's data: ``transformer_classifier``'s task (``zoo.classifier_task``).

    python models/demo_data.py [--out models/]

``transformer_classifier.train.npz`` (512 rows) and ``transformer_classifier.eval.npz`` (128 rows,
another seed) hold ``input_ids``, ``attention_mask`` and ``labels``: does the unpadded text hold
token 2.  The README's and docs/training.md's one-line training demo reads them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run as a script, sys.path[0] is models/, which hides the package

from models import zoo  # noqa: E402
from onnxmp.files import atomic_write  # noqa: E402

SPLITS = {"train": (512, 0), "eval": (128, 1)}  # rows, seed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE, help="output directory (default: models/)")
    args = ap.parse_args(argv)
    for split, (rows, seed) in SPLITS.items():
        path = args.out / f"transformer_classifier.{split}.npz"

        def write(tmp, arrays=zoo.classifier_task(rows, seed=seed)):
            with open(tmp, "wb") as stream:  # a file object: np.savez would append .npz to a temporary's name
                np.savez(stream, **arrays)

        atomic_write(path, write)
        print(f"wrote {path} ({rows} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
