"""The training artifacts folder: written whole (the last stage of the training build), read back
by the trainer.

A folder holds the training, eval and optimizer models, the forward model, onnxruntime's
checkpoint and ``manifest.json`` (what the trainer needs to know: inputs, loss, precision...).
It is filled in a temporary folder beside its destination and renamed into place only once
complete, and it replaces only an empty folder or one onnxmp wrote.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxmp.errors import OnnxMPError
from onnxmp.training import _ort

MANIFEST = "manifest.json"
FORMAT = "onnxmp-training/1"
FILES = {
    "training_model": "training_model.onnx",
    "eval_model": "eval_model.onnx",
    "optimizer_model": "optimizer_model.onnx",
    "forward_model": "forward_model.onnx",
    "checkpoint": "checkpoint",
}


@dataclass(frozen=True)
class Artifacts:
    """An artifacts folder and its manifest."""

    directory: Path
    manifest: dict[str, Any]

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Artifacts":
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.is_file():
            raise OnnxMPError(f"{directory} is not an onnxmp training folder (no {MANIFEST})",
                              "build one with onnxmp.training.build_artifacts or `onnxmp train`")
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise OnnxMPError(f"cannot read {path}: {exc}", "rebuild the artifacts") from None
        if manifest.get("format") != FORMAT:
            raise OnnxMPError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}",
                              "rebuild the artifacts with this onnxmp version")
        missing = [name for name in manifest["files"].values() if not (directory / name).exists()]
        if missing:
            raise OnnxMPError(f"{directory} lacks {', '.join(missing)}", "rebuild the artifacts")
        return cls(directory, manifest)

    def path(self, kind: str) -> Path:
        """Path of one file: ``training_model``, ``eval_model``, ``optimizer_model``,
        ``forward_model`` or ``checkpoint``."""
        return self.directory / self.manifest["files"][kind]

    @property
    def training_model(self) -> Path:
        return self.path("training_model")

    @property
    def eval_model(self) -> Path:
        return self.path("eval_model")

    @property
    def optimizer_model(self) -> Path:
        return self.path("optimizer_model")

    @property
    def checkpoint(self) -> Path:
        return self.path("checkpoint")

    @property
    def precision(self) -> str:
        return self.manifest["precision"]

    @property
    def target(self) -> str:
        return self.manifest["target"]

    @property
    def inputs(self) -> list[str]:
        """What a batch holds, in order: the model inputs, then the label input."""
        return list(self.manifest["inputs"])


def write_artifacts(out: Path, manifest: dict, *, training, evaluation, optimizer_model, forward,
                    parameters) -> None:
    """Write every file into a temporary folder beside ``out``, renamed into place once complete:
    a folder with a manifest is always whole, and a failure leaves nothing behind."""
    from onnxmp.files import atomic_directory, guard_outputs, write_text_atomic
    from onnxmp.save import save

    check_replaceable(out)
    guard_outputs({"out_dir": out}, folders=["out_dir"])
    files = manifest["files"]
    with atomic_directory(out) as folder:
        save(training, folder / files["training_model"])
        save(evaluation, folder / files["eval_model"])
        save(optimizer_model, folder / files["optimizer_model"])
        save(forward, folder / files["forward_model"])
        _ort.onnxblock().save_checkpoint(parameters, str(folder / files["checkpoint"]))
        write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def check_replaceable(folder: Path, *, marker: str = MANIFEST, what: str = "training folder") -> None:
    """A folder written whole may only replace nothing, an empty folder or one onnxmp wrote
    (``marker`` inside): never a folder of the user's other files."""
    folder = Path(folder)
    if folder.is_dir() and any(folder.iterdir()) and not (folder / marker).exists():
        raise OnnxMPError(f"{folder} exists and is not an onnxmp {what}; writing it would replace the folder",
                          "choose a new or empty folder")
