"""Sample inputs for running a model: loaded from ``.npz`` files or generated.

Shared by parity validation and calibration.  A sample is a ``dict`` from
graph-input name to array; each ``.npz`` file holds one sample (so several
files are several samples).  :func:`check_inputs` checks a sample against the
model's declared inputs and casts floats to the declared width, so every
consumer gets the same clear errors.
"""
from __future__ import annotations

import logging
import os
import re
import zipfile
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxmp.load import as_model
from onnxmp.errors import OnnxMPError

log = logging.getLogger("onnxmp.inputs")

Sample = dict[str, np.ndarray]

_INPUTS_HINT = "pass real inputs with {flag} sample.npz (one array per graph input name)"
# Symbolic dims that are (almost always) the batch axis: the default batch size
# is right for them, so they are filled without a warning.
_BATCH_DIM = re.compile(r"^(n|b|bs)$|batch", re.IGNORECASE)


def model_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a caller must feed (IR < 4 lists initializers as inputs too)."""
    initializers = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in initializers]


def read_npz(path: str | os.PathLike, hint: str = "save with np.savez(path, input_name=array, ...)") -> Sample:
    """Every array of one ``.npz`` file, by name, with one clear error for any file that is not one."""
    try:
        if not zipfile.is_zipfile(path):  # numpy would try it as a pickle and talk about allow_pickle
            with open(path, "rb") as head:
                single = head.read(6) == b"\x93NUMPY"
            raise OnnxMPError(f"{path} holds a single array, not an .npz of named arrays" if single
                              else f"{path} is not an .npz file (a zip of named .npy arrays)", hint)
        _check_npz_members(path, hint)
        with np.load(os.fspath(path), allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise OnnxMPError(f"cannot read {path}: file not found", "check the path") from None
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise OnnxMPError(f"cannot read {path}: {exc}", hint) from None


# An .npz expanding past this, at more than _BOMB_RATIO times its compressed size, is a zip bomb: real
# arrays compress far less (deflate tops out near 1030:1 on zeros).  np.savez (stored) never trips it.
_BOMB_BYTES = 256 << 20
_BOMB_RATIO = 200


def _check_npz_members(path, hint: str) -> None:
    """Each member's .npy header against the member's size, before numpy allocates an array for it:
    a header may declare terabytes over a few bytes, and an object (pickled) array is refused unread."""
    from numpy.lib import format as npy

    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
        expanded = sum(m.file_size for m in members)
        packed = sum(m.compress_size for m in members)
        if expanded > _BOMB_BYTES and expanded > _BOMB_RATIO * max(packed, 1):
            raise OnnxMPError(f"{path} expands to {expanded} bytes from {packed}: refused as a zip bomb",
                              "save the arrays uncompressed, with numpy.savez")
        for member in members:
            if not member.filename.endswith(".npy"):
                continue
            with archive.open(member) as stream:
                version = npy.read_magic(stream)
                reader = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
                shape, _, dtype = reader(stream)
                header = stream.tell()
            if dtype.hasobject:
                raise OnnxMPError(f"{path}: array {member.filename[:-4]!r} holds Python objects (a pickle); "
                                  "refused unread", hint)
            count = 1
            for dim in shape:
                count *= dim
            if count * dtype.itemsize != member.file_size - header:
                raise OnnxMPError(f"{path}: array {member.filename[:-4]!r} declares shape {shape} "
                                  f"({count * dtype.itemsize} bytes) but holds {member.file_size - header}", hint)


def load_npz(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Sample]:
    """Load one sample per ``.npz`` file, in the order given."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    samples = [read_npz(path) for path in paths]
    if not samples:
        raise OnnxMPError("no input files given")
    return samples


def as_samples(inputs, what: str = "inputs") -> list[Sample]:
    """Samples from what a caller passes: a dict of arrays, an ``.npz`` path, or a list of either
    (each dict or file is one sample)."""
    if isinstance(inputs, Mapping):
        return [dict(inputs)]
    if isinstance(inputs, (str, os.PathLike)):
        return [read_npz(inputs)]
    items = list(inputs) if isinstance(inputs, Iterable) else []
    if not items or not all(isinstance(i, (Mapping, str, os.PathLike)) for i in items):
        raise OnnxMPError(f"{what} must be a dict of input arrays, an .npz path, or a list of them",
                          hint="e.g. [{'x': array}, 'sample2.npz']")
    return [dict(i) if isinstance(i, Mapping) else read_npz(i) for i in items]


def drop_extra_inputs(model: onnx.ModelProto | str | os.PathLike, samples: list[Sample]) -> list[Sample]:
    """``samples`` without the arrays that are no graph input (the labels ``y`` of a training file, say).

    One info line names what is dropped; a missing input stays an error for
    :func:`check_inputs`.
    """
    wanted = {v.name for v in model_inputs(as_model(model))}
    extra = sorted({name for sample in samples for name in sample} - wanted)
    if not extra:
        return samples
    log.info("ignoring input array(s) that are not model inputs: %s", ", ".join(extra))
    return [{name: array for name, array in sample.items() if name in wanted} for sample in samples]


def _np_dtype(value: onnx.ValueInfoProto) -> np.dtype:
    if value.type.WhichOneof("value") != "tensor_type":
        raise OnnxMPError(f"graph input {value.name!r} is not a tensor ({value.type.WhichOneof('value')})",
                          "only tensor inputs are supported")
    elem = value.type.tensor_type.elem_type
    if elem == TensorProto.UNDEFINED:
        raise OnnxMPError(f"graph input {value.name!r} declares no element type")
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem))


def _is_float(dtype: np.dtype) -> bool:
    # ml_dtypes' bfloat16 is not a numpy "floating" subtype, hence the name test.
    return np.issubdtype(dtype, np.floating) or "float" in dtype.name


def symbolic_dims(model: onnx.ModelProto) -> list[str]:
    names: list[str] = []
    for value in model_inputs(model):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param not in names:
                names.append(dim.dim_param)
    return names


def generate_inputs(model: onnx.ModelProto | str | os.PathLike, dims: Mapping[str, int] | None = None,
                    seed: int = 0, batch_default: int = 1) -> Sample:
    """One random sample from the model's input metadata.

    Floats are standard normal, bools fair coin flips.  Integer inputs are
    refused: their valid range (token ids, indices) is unknown.  Symbolic
    dims come from ``dims``; batch-like ones (``N``, ``batch``...) default to
    ``batch_default``, any other to 1 with a warning.
    """
    model = as_model(model)
    dims = dict(dims or {})
    known = symbolic_dims(model)
    unknown = sorted(set(dims) - set(known))
    if unknown:
        raise OnnxMPError(f"--dims names {', '.join(unknown)}, which no model input uses",
                          f"symbolic dims of this model: {', '.join(known) or 'none'}")
    rng = np.random.default_rng(seed)
    sample: Sample = {}
    for value in model_inputs(model):
        dtype = _np_dtype(value)
        shape = []
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_value"):
                shape.append(dim.dim_value)
            elif dim.HasField("dim_param") and dim.dim_param in dims:
                shape.append(int(dims[dim.dim_param]))
            elif dim.HasField("dim_param") and _BATCH_DIM.search(dim.dim_param):
                shape.append(batch_default)
            else:
                label = dim.dim_param or f"axis {axis}"
                log.warning("input %r: dim %s has no size; using 1 (set it with --dims NAME=SIZE)",
                            value.name, label)
                shape.append(1)
        if _is_float(dtype):
            sample[value.name] = rng.standard_normal(shape).astype(np.float32).astype(dtype)
        elif dtype == np.bool_:
            sample[value.name] = rng.random(shape) < 0.5
        else:
            raise OnnxMPError(f"cannot generate values for {dtype.name} input {value.name!r}: "
                              "its valid range is unknown", _INPUTS_HINT.format(flag="--inputs"))
    return sample


def check_inputs(model: onnx.ModelProto | str | os.PathLike, sample: Mapping[str, np.ndarray],
                 flag: str = "--inputs") -> Sample:
    """Check ``sample`` against the model's inputs; return it with floats cast to the declared dtype.

    Float arrays of another width are cast (an .npz saved in float64 is
    fine); a float/int/bool kind mismatch, a wrong rank, a fixed dim that
    differs, or one symbolic dim bound to two sizes is an error.  ``flag``
    is the option a hint tells the user to pass inputs with.
    """
    model = as_model(model)
    declared = {v.name: v for v in model_inputs(model)}
    extra = sorted(set(sample) - set(declared))
    if extra:
        raise OnnxMPError(f"inputs {', '.join(map(repr, extra))} are not inputs of the model",
                          f"model inputs: {', '.join(declared)}")
    missing = [name for name in declared if name not in sample]
    if missing:
        raise OnnxMPError(f"no value for model input(s) {', '.join(map(repr, missing))}",
                          _INPUTS_HINT.format(flag=flag))

    bound: dict[str, tuple[int, str]] = {}
    checked: Sample = {}
    for name, value in declared.items():
        array = np.asarray(sample[name])
        want = _np_dtype(value)
        if _is_float(want) and _is_float(array.dtype):
            array = array.astype(want, copy=False)
        elif array.dtype != want:
            raise OnnxMPError(f"input {name!r} is {array.dtype.name} but the model expects {want.name}")
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and array.ndim != len(dims):
            raise OnnxMPError(f"input {name!r} has shape {list(array.shape)} (rank {array.ndim}) "
                              f"but the model expects rank {len(dims)}")
        for axis, dim in enumerate(dims):
            size = array.shape[axis]
            # Paddle2ONNX writes a dynamic axis as dim_value -1 (PP-OCR's classifier); onnxruntime
            # takes any size there, and so do we.
            if dim.HasField("dim_value") and dim.dim_value >= 0 and dim.dim_value != size:
                raise OnnxMPError(f"input {name!r} has size {size} on axis {axis}; the model expects "
                                  f"{dim.dim_value}", f"shape given: {list(array.shape)}")
            if dim.HasField("dim_param") and dim.dim_param != "?":  # Paddle's "?" names no shared size
                first = bound.setdefault(dim.dim_param, (size, name))
                if first[0] != size:
                    raise OnnxMPError(f"dim {dim.dim_param!r} is {first[0]} in input {first[1]!r} "
                                      f"but {size} in input {name!r}")
        checked[name] = array
    return checked
