"""The small MLP training job the CLI tests run (`onnxmp train` on a model and an .npz)."""
from __future__ import annotations

import numpy as np
import onnx

from onnxmp.training.models import mlp


def write_mlp_job(folder, rows: int):
    """An 8-16-4 MLP and ``rows`` rows of data whose label is the argmax of the first 4 features."""
    onnx.save(mlp((8, 16, 4), seed=3), folder / "model.onnx")
    x = np.random.default_rng(0).normal(size=(rows, 8)).astype(np.float32)
    np.savez(folder / "train.npz", feat=x, lab=x[:, :4].argmax(axis=1))
    return folder


def train_args(files, out, epochs, *extra):
    return ["train", str(files / "model.onnx"), "--data", str(files / "train.npz"), "--inputs", "feat",
            "--labels", "lab", "--epochs", str(epochs), "--batch-size", "16", "--lr", "0.01", "--out", str(out),
            "--no-progress", "--precision", "float32", *extra]
