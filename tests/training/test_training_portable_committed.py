"""The committed artifacts (models/artifacts/, built by models/portable_artifacts.py on Python 3.11)
train with plain onnxruntime on the portable engine: CI's Python 3.12 leg runs this with no
training build.  Text, vision and audio, in float32, float16 and bfloat16 (CPU-target builds:
low precision emulated in float32 with rounding Casts, which the CPU EP runs)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from onnxmp.training import Trainer
from onnxmp.training.run import engines
from onnxmp.training.artifacts import Artifacts
from onnxmp.training.contract import FORMAT

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "models"), str(ROOT / "models" / "exports")]
import portable_artifacts  # noqa: E402
import tasks  # noqa: E402

MATRIX = json.loads((ROOT / "models" / "exports" / "matrix.json").read_text())
FOLDERS = [f"{e}.{p}" for e in portable_artifacts.ENTRIES for p in portable_artifacts.PRECISIONS]
STEPS = 6


def test_every_entry_and_precision_is_committed_and_current():
    kinds = {tasks.SPECS[MATRIX[e]["arch"]]["kind"] for e in portable_artifacts.ENTRIES}
    assert kinds == {"text", "image", "audio"}
    for name in FOLDERS:
        artifacts = Artifacts.load(portable_artifacts.OUT / name)
        assert artifacts.manifest["format"] == FORMAT and artifacts.has_portable and artifacts.target == "cpu"
    total = sum(p.stat().st_size for p in portable_artifacts.OUT.rglob("*") if p.is_file())
    assert total < 15 * 2**20, f"models/artifacts holds {total / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", FOLDERS)
def test_committed_artifacts_train_on_the_portable_engine(name):
    entry, precision = name.rsplit(".", 1)
    arch = MATRIX[entry]["arch"]
    batches = tasks.batches(arch, MATRIX[entry]["inputs"], 16)
    trainer = Trainer(portable_artifacts.OUT / name, engine="portable", lr=tasks.LR.get(arch, tasks.DEFAULT_LR))
    assert trainer.engine.name == "portable"
    initial = trainer.evaluate(batches)["loss"]
    results = [trainer.train_step(*batches[i % len(batches)]) for i in range(STEPS)]
    assert all(np.isfinite(r.loss) for r in results if r.stepped)
    assert trainer.optimizer_steps >= STEPS - 2  # float16's scaler may skip the first steps
    final = trainer.evaluate(batches)["loss"]
    assert np.isfinite(final) and final < initial, f"{name}: {initial:.4f} -> {final:.4f}"


@pytest.mark.slow
@pytest.mark.skipif(not engines.native_available(), reason="building needs onnxruntime-training (Python 3.11)")
def test_committed_artifacts_equal_a_fresh_build(tmp_path):
    for name in FOLDERS:
        entry, precision = name.rsplit(".", 1)
        fresh = portable_artifacts.build(entry, precision, tmp_path / name)
        assert portable_artifacts.differences(portable_artifacts.OUT / name, fresh.directory) == [], (
            f"{name} is stale: run python models/portable_artifacts.py")
