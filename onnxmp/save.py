"""Stage 6: save.  Atomic: a temporary file in the target folder, then a rename,
so a crash or full disk never leaves a half-written model behind."""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import onnx

from onnxmp.errors import OnnxMPError

log = logging.getLogger("onnxmp.save")

# Protobuf cannot serialize a message over 2 GiB; stay well below it.
EXTERNAL_DATA_THRESHOLD = 1 << 30


def save(model: onnx.ModelProto, path: str | os.PathLike, *, external_data: bool | None = None) -> Path:
    """Write ``model`` to ``path``; large models put initializers in ``<name>.data`` beside it."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise OnnxMPError(f"output folder {folder} does not exist", hint="create it first or choose another -o")
    if external_data is None:
        external_data = model.ByteSize() > EXTERNAL_DATA_THRESHOLD
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    data_name = f"{path.name}.data"
    tmp_data = folder / f".{data_name}.tmp"
    try:
        if external_data:
            # Written under a temporary data file name first, then renamed with the model.
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
            onnx.save_model(copy, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=tmp_data.name, size_threshold=1024)
            _rename_external_location(tmp, tmp_data.name, data_name)
            os.replace(tmp_data, folder / data_name)
        else:
            onnx.save_model(model, tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise OnnxMPError(f"cannot write {path}: {exc.strerror or exc}", hint="check free space and permissions") \
            from None
    finally:
        for leftover in (Path(tmp), tmp_data):
            if leftover.exists():
                leftover.unlink()
    log.info("saved %s%s", path, " (+ external data)" if external_data else "")
    return path


def _rename_external_location(model_path: str, old: str, new: str) -> None:
    proto = onnx.load(model_path, load_external_data=False)
    for tensor in onnx.external_data_helper._get_all_tensors(proto):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == old:
                entry.value = new
    onnx.save_model(proto, model_path)
