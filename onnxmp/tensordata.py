"""What a model may say about its tensors' data, checked before a byte is read or an array allocated.

Models come from anywhere (a hub, an upload to a conversion service), so a tensor's declarations
are the user's input, never facts:

* an external ``location`` is relative and, once normalized and its symlinks resolved, stays inside
  the model's folder (onnx's rule since 1.16, the fix for CVE-2024-27318/27319); it names a regular
  file (no device, FIFO or folder);
* ``offset`` and ``length`` are non-negative integers, ``length`` is what the dims need, and the
  range lies inside the file;
* dims are non-negative and their product fits; a string tensor keeps no external data;
* embedded data (``raw_data`` or a typed field) holds exactly what the dims declare.

Every refusal is a one-line :class:`~onnxmp.errors.OnnxMPError` naming the tensor and the rule.
:func:`trust_external_data` (the CLI's ``--trust-external-data``) lets a trusted model keep its data
at an absolute location or outside its folder (a Hugging Face cache links its files to a shared
blob folder); the other rules hold even then.  See docs/cli.md, "Untrusted models".
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import stat
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx

from onnxmp.errors import OnnxMPError

_TRUSTED = contextvars.ContextVar("onnxmp_trust_external_data", default=False)
_TRUST_HINT = "keep the data files inside the model's folder; for a model you trust, pass --trust-external-data"
_REEXPORT = "the model and its data do not match; re-export it"
# No tensor is anywhere near this: a product above it is a lie (and would overflow int64 arithmetic).
MAX_TENSOR_BYTES = 1 << 48

_T = onnx.TensorProto
# Elements per byte of the packed sub-byte types (raw_data and int32_data alike).
_PER_BYTE = {_T.INT4: 2, _T.UINT4: 2, _T.FLOAT4E2M1: 2}
for _name, _per in (("UINT2", 4), ("INT2", 4)):
    if hasattr(_T, _name):
        _PER_BYTE[getattr(_T, _name)] = _per
# Values per element in the typed field that holds them.
_PER_ELEMENT = {_T.COMPLEX64: 2, _T.COMPLEX128: 2}


@contextlib.contextmanager
def trust_external_data(trusted: bool = True) -> Iterator[None]:
    """Within the block, models may keep external data at absolute locations or outside their folder.

    For models you trust only: the size and file-type checks still apply.  ``onnxmp convert
    --trust-external-data`` (and every other command's flag of that name) runs in this block.
    """
    token = _TRUSTED.set(bool(trusted))
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def external_data_trusted() -> bool:
    return _TRUSTED.get()


def refuse(tensor: onnx.TensorProto, rule: str, hint: str = _REEXPORT) -> OnnxMPError:
    return OnnxMPError(f"tensor `{tensor.name}`: {rule}", hint=hint)


def element_count(tensor: onnx.TensorProto) -> int:
    """prod(dims), refused when a dim is negative or the product is beyond any real tensor."""
    count = 1
    for dim in tensor.dims:
        if dim < 0:
            raise refuse(tensor, f"negative dimension {dim} in dims {list(tensor.dims)}")
        count *= dim
        if count > MAX_TENSOR_BYTES:
            raise refuse(tensor, f"dims {list(tensor.dims)} declare more elements than any tensor holds")
    return count


def nbytes(tensor: onnx.TensorProto) -> int:
    """The bytes the dims need in ``raw_data`` or an external file (packed types included)."""
    if tensor.data_type == _T.STRING:
        raise refuse(tensor, "a string tensor cannot keep its data as raw bytes or in an external file")
    try:
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    except Exception:  # noqa: BLE001 (KeyError or ValueError by onnx version)
        raise refuse(tensor, f"unknown data type {tensor.data_type}") from None
    count = element_count(tensor)
    per = _PER_BYTE.get(tensor.data_type)
    size = -(-count // per) if per else count * itemsize
    if size > MAX_TENSOR_BYTES:
        raise refuse(tensor, f"dims {list(tensor.dims)} declare {size} bytes, more than any tensor holds")
    return size


def check_embedded(tensor: onnx.TensorProto) -> None:
    """An in-file tensor holds exactly what its dims declare (before numpy reshapes or allocates)."""
    if tensor.data_location == _T.EXTERNAL:
        return
    if tensor.HasField("raw_data"):
        have, need = len(tensor.raw_data), nbytes(tensor)
        if have != need:
            raise refuse(tensor, f"raw_data holds {have} bytes but dims {list(tensor.dims)} need {need}")
        return
    count = element_count(tensor)
    if tensor.data_type == _T.UNDEFINED:
        if count and len(tensor.dims):
            raise refuse(tensor, "data type UNDEFINED")
        return
    try:
        field = onnx.helper.tensor_dtype_to_field(tensor.data_type)
    except Exception:  # noqa: BLE001
        raise refuse(tensor, f"unknown data type {tensor.data_type}") from None
    have = len(getattr(tensor, field))
    per = _PER_BYTE.get(tensor.data_type)
    need = -(-count // per) if per else count * _PER_ELEMENT.get(tensor.data_type, 1)
    if have != need and not (have == 0 and count == 0):
        raise refuse(tensor, f"holds {have} values in {field} but dims {list(tensor.dims)} need {need}")


def _int(tensor: onnx.TensorProto, meta: dict[str, str], key: str, default: int | None) -> int | None:
    if key not in meta:
        return default
    try:
        value = int(meta[key])
    except ValueError:
        raise refuse(tensor, f"external data {key} {meta[key]!r} is not an integer") from None
    if value < 0:
        raise refuse(tensor, f"external data {key} {value} is negative")
    return value


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def resolve_location(tensor: onnx.TensorProto, meta: dict[str, str], base_dir: Path) -> str:
    """The absolute, symlink-free path of a file-loaded tensor's data file, checked (no byte read):
    onnx's location rules unless trusted, then :func:`checked_range`'s."""
    location = meta.get("location", "")
    if not location:
        raise refuse(tensor, "external data without a location")
    if "\0" in location:
        raise refuse(tensor, "external data location holds a NUL character")
    folder = os.path.realpath(base_dir)
    joined = os.path.join(folder, location)
    real = os.path.realpath(joined)
    if not external_data_trusted():
        if os.path.isabs(location) or location.startswith(("\\", "~")) or (len(location) > 1 and location[1] == ":"):
            raise refuse(tensor, f"external data location {location!r} is absolute; it must be relative "
                                 "to the model's folder", _TRUST_HINT)
        if not _inside(os.path.normpath(joined), folder):
            raise refuse(tensor, f"external data location {location!r} points outside the model's folder",
                         _TRUST_HINT)
        if not _inside(real, folder):
            raise refuse(tensor, f"external data location {location!r} is a symlink leading outside the "
                                 "model's folder", _TRUST_HINT)
    try:
        info = os.stat(real)
    except FileNotFoundError:
        raise OnnxMPError(f"external data file of tensor `{tensor.name}` not found: {joined}",
                          hint="keep the external data files next to the model, with the names it records") from None
    except OSError as exc:
        raise refuse(tensor, f"cannot stat external data file {location!r}: {exc.strerror}",
                     "check the file's permissions") from None
    checked_range(tensor, meta, info, location)
    return real


def checked_range(tensor: onnx.TensorProto, meta: dict[str, str], info: os.stat_result,
                  shown: str | None = None) -> tuple[int, int]:
    """(offset, bytes) of an external tensor in a file whose ``stat`` is ``info``, every rule checked."""
    shown = shown or meta.get("location", "")
    if not stat.S_ISREG(info.st_mode):
        raise refuse(tensor, f"external data location {shown!r} is not a regular file (a device, FIFO or folder)")
    need = nbytes(tensor)
    offset = _int(tensor, meta, "offset", 0)
    length = _int(tensor, meta, "length", None)
    if length is not None and length != need:
        raise refuse(tensor, f"external data length {length} does not match dims {list(tensor.dims)} "
                             f"({need} bytes)")
    if offset + need > info.st_size:
        raise refuse(tensor, f"external data runs past the end of {shown!r} (bytes {offset}..{offset + need} "
                             f"of a {info.st_size}-byte file)")
    return offset, need


def read_range(tensor: onnx.TensorProto, meta: dict[str, str]) -> bytearray:
    """The bytes of an external tensor whose location is absolute (a model onnxmp loaded), checked on
    the open file itself: a file swapped since loading is checked again, and a FIFO never blocks."""
    with open_checked(tensor, meta) as (fd, offset, need):
        buffer = bytearray(need)
        view, done = memoryview(buffer), 0
        while done < need:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise refuse(tensor, f"external data ends early in {meta.get('location')!r}")
            done += got
    return buffer


@contextlib.contextmanager
def open_checked(tensor: onnx.TensorProto, meta: dict[str, str]) -> Iterator[tuple[int, int, int]]:
    """(fd, offset, bytes) of an external tensor's data, every rule checked before a byte is read."""
    location = meta.get("location", "")
    if not os.path.isabs(location):
        raise refuse(tensor, f"records its external data file relative to an unknown folder: {location!r}",
                     "pass the model's path, or load it with onnxmp.load(path)")
    try:
        fd = os.open(location, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise OnnxMPError(f"external data file of tensor `{tensor.name}` not found: {location}",
                          hint="keep the external data files next to the model, with the names it records") from None
    except OSError as exc:
        raise refuse(tensor, f"cannot open external data file {location!r}: {exc.strerror}",
                     "check the file's permissions") from None
    try:
        offset, need = checked_range(tensor, meta, os.fstat(fd))
        yield fd, offset, need
    finally:
        os.close(fd)


def check_model_tensors(tensors) -> None:
    """:func:`check_embedded` on every tensor of a model (``external.all_tensors``)."""
    for tensor in tensors:
        check_embedded(tensor)
