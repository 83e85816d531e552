"""The training artifacts folder: written whole (the last stage of the training build), read back
by the trainer.

A folder holds the forward model, ``parameters.npz`` (the float32 parameters, readable without
the training build), ``manifest.json`` (what the trainer needs to know: inputs, loss, precision,
the gradient builder...) and the portable form of the training, eval and optimizer graphs, which
plain ``onnxruntime.InferenceSession`` runs (``manifest["portable"]``: its files and the state pairs
the portable engine feeds back between runs).  Built by ORT's builder, it also holds the native
engine's files (:data:`NATIVE_FILES`: onnxruntime-training's graphs, onnxblock's optimizer model
and ORT's checkpoint); ``manifest["files"]`` lists the files there are.  It is filled in a temporary folder beside its
destination and renamed into place only once complete, and it replaces only an empty folder or
one onnxmp wrote.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from onnxmp.errors import OnnxMPError
from onnxmp.training.contract import FILES, FORMAT, MANIFEST, NATIVE_FILES, OLD_FORMATS

_REBUILD = ("rebuild the artifacts with this onnxmp version (on Python 3.11 with the training build: "
            "onnxmp.training.build_artifacts or `onnxmp train MODEL ...`)")


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
            from onnxmp.files import recover_folder

            # A run killed while replacing the folder (or DIR, for DIR/state) left it beside.
            for folder in (directory.parent, directory):
                recover_folder(folder)
        if not path.is_file():
            raise OnnxMPError(f"{directory} is not an onnxmp training folder (no {MANIFEST})",
                              "build one with onnxmp.training.build_artifacts or `onnxmp train`")
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise OnnxMPError(f"cannot read {path}: {exc}", "rebuild the artifacts") from None
        if manifest.get("format") in OLD_FORMATS:
            raise OnnxMPError(f"{path} has the old format {manifest['format']!r}, which holds neither portable "
                              "parameters nor portable graphs", _REBUILD)
        if manifest.get("format") != FORMAT:
            raise OnnxMPError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}", _REBUILD)
        names = [*manifest["files"].values(), *manifest.get("portable", {}).get("files", {}).values()]
        missing = [name for name in names if not (directory / name).exists()]
        if missing:
            raise OnnxMPError(f"{directory} lacks {', '.join(missing)}", "rebuild the artifacts")
        return cls(directory, manifest)

    def path(self, kind: str) -> Path:
        """Path of one file: ``training_model``, ``eval_model``, ``optimizer_model``,
        ``forward_model``, ``checkpoint`` or ``parameters``."""
        files = self.manifest["files"]
        if kind not in files and kind in NATIVE_FILES:
            raise OnnxMPError(f"the artifacts in {self.directory} have no native-engine files (no {FILES[kind]}): "
                              f"onnxmp's gradient builder made them, for the portable engine",
                              "train them with engine='portable' (or 'auto'), or rebuild them with builder='ort' "
                              "on Python 3.11 with the training build for the native engine")
        return self.directory / files[kind]

    @property
    def has_native(self) -> bool:
        """Whether the native engine (onnxruntime-training) can run the folder: ORT's builder made it."""
        return all(kind in self.manifest["files"] for kind in NATIVE_FILES)

    @property
    def builder(self) -> str:
        """The gradient builder that made the graphs: ``onnxmp`` or ``ort`` (folders from before the
        switch: ``ort``)."""
        return self.manifest.get("builder", "ort")

    def portable_path(self, kind: str) -> Path:
        """Path of one portable model (``training_model``, ``eval_model``, ``optimizer_model``)."""
        if not self.has_portable:
            raise OnnxMPError(f"the artifacts in {self.directory} have no portable graphs (the build could not "
                              "lower them)", "train them with engine='native' (Python 3.11 and the training "
                              "build), or rebuild them with an onnxmp that lowers the training graphs")
        return self.directory / self.manifest["portable"]["files"][kind]

    @property
    def has_portable(self) -> bool:
        return bool(self.manifest.get("portable"))

    @property
    def state_pairs(self) -> dict[str, str]:
        """Portable training graph: input name -> the output that is its next value."""
        return dict(self.manifest["portable"]["state_pairs"]) if self.has_portable else {}

    def parameters(self) -> dict[str, np.ndarray]:
        """The float32 parameters (trainable and frozen) of ``parameters.npz``, by name."""
        return read_parameters(self.path("parameters"))

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
    def optimizer_name(self) -> str:
        return optimizer_name(self.manifest)

    @property
    def inputs(self) -> list[str]:
        """What a batch holds, in order: the model inputs, then the label input."""
        return list(self.manifest["inputs"])


def optimizer_name(manifest: Mapping[str, Any]) -> str:
    """``adamw`` or ``sgd``: format 2 describes the optimizer as a dict, with its name."""
    optimizer = manifest["optimizer"]
    return optimizer["name"] if isinstance(optimizer, Mapping) else optimizer


def read_parameters(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError) as exc:
        raise OnnxMPError(f"cannot read the parameters in {path}: {exc}", "rebuild the artifacts") from None


def write_parameters(path: Path, parameters: Mapping[str, np.ndarray]) -> None:
    """``np.savez`` (no pickles: any numpy reads it back) through the atomic writer."""
    from onnxmp.files import atomic_write

    def write(tmp):
        with open(tmp, "wb") as stream:
            np.savez(stream, **{name: np.require(value, requirements="C") for name, value in parameters.items()})

    atomic_write(path, write)


def write_artifacts(out: Path, manifest: dict, *, native: Mapping[str, Any] | None, forward,
                    parameters, portable: Mapping[str, Any] | None = None) -> None:
    """Write every file into a temporary folder beside ``out``, renamed into place once complete:
    a folder with a manifest is always whole, and a failure leaves nothing behind.

    ``parameters`` is the builder's (trainable, frozen) pair of TensorProto lists; ``native`` maps
    ``training_model``, ``eval_model`` and ``optimizer_model`` to onnxruntime-training's models,
    written with ORT's checkpoint (None: no native-engine files); ``portable`` maps
    ``PORTABLE_FILES``' kinds to their models (None: the folder has no portable form)."""
    from onnx import numpy_helper

    from onnxmp.files import atomic_directory, guard_outputs, write_text_atomic
    from onnxmp.save import save

    check_replaceable(out)
    guard_outputs({"out_dir": out}, folders=["out_dir"])
    files = manifest["files"]
    with atomic_directory(out) as folder:
        for kind, model in (native or {}).items():
            save(model, folder / files[kind])
        if native is not None:
            from onnxmp.training import _ort

            _ort.onnxblock().save_checkpoint(parameters, str(folder / files["checkpoint"]))
        save(forward, folder / files["forward_model"])
        write_parameters(folder / files["parameters"],
                         {t.name: numpy_helper.to_array(t) for group in parameters for t in group})
        for kind, model in (portable or {}).items():
            save(model, folder / manifest["portable"]["files"][kind])
        write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def check_replaceable(folder: Path, *, marker: str = MANIFEST, what: str = "training folder") -> None:
    """A folder written whole may only replace nothing, an empty folder or one onnxmp wrote
    (``marker`` inside): never a folder of the user's other files."""
    folder = Path(folder)
    if folder.is_dir() and any(folder.iterdir()) and not (folder / marker).exists():
        raise OnnxMPError(f"{folder} exists and is not an onnxmp {what}; writing it would replace the folder",
                          "choose a new or empty folder")
