"""Stage 6: save, through :mod:`onnxmp.files`: the destination is checked first and written
atomically, so a crash or full disk never leaves a half-written model behind."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import onnx

from onnxmp.errors import OnnxMPError
from onnxmp.external import EXTERNAL_DATA_THRESHOLD, is_large, read_locations, write_with_external_data
from onnxmp.files import atomic_write, destination, guard_outputs

log = logging.getLogger("onnxmp.save")

__all__ = ["EXTERNAL_DATA_THRESHOLD", "external_data_path", "save"]


def external_data_path(path: str | os.PathLike) -> Path:
    """Where :func:`save` puts the initializers of a large model saved to ``path``: ``<name>.data`` beside it."""
    path = Path(path)
    return path.with_name(f"{path.name}.data")


def save(model: onnx.ModelProto, path: str | os.PathLike, *, external_data: bool | None = None,
         source: str | os.PathLike | None = None, location: str | None = None) -> Path:
    """Write ``model`` to ``path``; large models put initializers in ``<name>.data`` beside it.

    ``location`` names that file instead (a bare file name: it lies beside ``path``, as
    onnx records external data relative to the model).

    The destination is checked before anything is written (see
    :func:`onnxmp.files.guard_outputs`); ``source``, the file the model was
    read from, is refused as the destination, through symlinks and hard links,
    and so is any file the model still reads its weights from, ``source`` given or not.
    """
    path = Path(path)
    if external_data is None:
        external_data = is_large(model)
    if location is not None and Path(location).name != location:
        raise OnnxMPError(f"external data location {location!r} is not a bare file name",
                          hint="the data file is written beside the model; pass its name only")
    data_path = (path.with_name(location) if location else external_data_path(path)) if external_data else None
    guard_outputs({"output": path, "external data": data_path},
                  {"source model": source, "weights file the model reads": read_locations(model)})
    if external_data:
        # Tensor by tensor into a temporary data file, so neither the weights nor the serialized
        # proto are ever whole in memory; the data is renamed into place first, then the model
        # that records its final name.
        def write_model(tmp: Path) -> None:
            atomic_write(data_path, lambda tmp_data: write_with_external_data(model, tmp, tmp_data, data_path.name))

        atomic_write(path, write_model)
    else:
        atomic_write(path, lambda tmp: onnx.save_model(model, tmp))
    log.info("saved %s%s", destination(path), " (+ external data)" if external_data else "")
    return path
