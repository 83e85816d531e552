"""Stage 6: save.  Atomic: a temporary file in the target folder, then a rename,
so a crash or full disk never leaves a half-written model behind."""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import onnx

from onnxmp.errors import OnnxMPError
from onnxmp.external import has_external_data, write_with_external_data

log = logging.getLogger("onnxmp.save")

# Protobuf cannot serialize a message over 2 GiB; stay well below it.
EXTERNAL_DATA_THRESHOLD = 1 << 30


def _publish(tmp: Path, final: Path) -> None:
    # mkstemp creates 0600 files; a saved model gets the usual permissions.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, final)


def save(model: onnx.ModelProto, path: str | os.PathLike, *, external_data: bool | None = None) -> Path:
    """Write ``model`` to ``path``; large models put initializers in ``<name>.data`` beside it."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise OnnxMPError(f"output folder {folder} does not exist", hint="create it first or choose another -o")
    if external_data is None:
        external_data = has_external_data(model) or model.ByteSize() > EXTERNAL_DATA_THRESHOLD
    data_name = f"{path.name}.data"
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
        fd, tmp_data_name = tempfile.mkstemp(prefix=f".{data_name}.", suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError as exc:
        raise OnnxMPError(f"cannot write into {folder}: {exc.strerror or exc}",
                          hint="check the folder's permissions or choose another -o") from None
    tmp_data = Path(tmp_data_name)
    try:
        if external_data:
            # Data goes to a temporary file first and is renamed with the model, tensor by
            # tensor, so neither the weights nor the serialized proto are ever whole in memory.
            write_with_external_data(model, Path(tmp), tmp_data, data_name)
            _publish(tmp_data, folder / data_name)
        else:
            onnx.save_model(model, tmp)
        _publish(Path(tmp), path)
    except OSError as exc:
        raise OnnxMPError(f"cannot write {path}: {exc.strerror or exc}", hint="check free space and permissions") \
            from None
    finally:
        for leftover in (Path(tmp), tmp_data):
            if leftover.exists():
                leftover.unlink()
    log.info("saved %s%s", path, " (+ external data)" if external_data else "")
    return path

