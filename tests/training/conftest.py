"""Fixtures for the training tests: a tiny MLP, its data and prebuilt artifacts.

Artifacts are built once per session (the Trainer never writes into them);
each test makes its own Trainer, which starts from the same initial weights.
"""
from __future__ import annotations

import numpy as np
import pytest

from onnxmp.training import build_artifacts
from onnxmp.training.models import mlp, trainable

SIZES = (8, 16, 4)


@pytest.fixture(scope="session")
def model():
    return mlp(SIZES, seed=0)


@pytest.fixture(scope="session")
def batches():
    """Twelve batches of 16 rows: ``[(x, labels), ...]``."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12 * 16, SIZES[0])).astype(np.float32)
    y = (x[:, :SIZES[-1]].argmax(axis=1)).astype(np.int64)  # learnable labels
    return [(x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16)]


def _build(tmp_path_factory, model, name, **kwargs):
    return build_artifacts(model, requires_grad=trainable(model), out_dir=tmp_path_factory.mktemp(name), **kwargs)


@pytest.fixture(scope="session")
def fp32_artifacts(tmp_path_factory, model):
    return _build(tmp_path_factory, model, "fp32", precision="float32")


@pytest.fixture(scope="session")
def fp16_artifacts(tmp_path_factory, model):
    """Emulated float16 (convert + emulate) for the CPU."""
    return _build(tmp_path_factory, model, "fp16", precision="float16", target="cpu")


@pytest.fixture(scope="session")
def sgd_artifacts(tmp_path_factory, model):
    return _build(tmp_path_factory, model, "sgd", precision="float32", optimizer="sgd")



@pytest.fixture(scope="session")
def cuda16_artifacts(tmp_path_factory, model):
    """Real float16 (for the CUDA EP); built and inspected here, run only on a GPU."""
    return _build(tmp_path_factory, model, "cuda16", precision="float16", target="cuda")
