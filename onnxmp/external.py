"""Models whose initializers live in external files (and models over 2 GB).

Such models are converted, emulated, validated and calibrated without ever holding all their
weights, or the serialized proto, in memory at once (see docs/large-models.md):

* ``load`` leaves external tensors where they are and records absolute
  locations, so the source folder no longer matters;
* each external initializer is read only when a seed checks it or the rewrite
  converts it, one at a time (:func:`tensor_array`, :func:`converted_external`);
  converted values wait in a spill folder (:func:`spilled`), deleted by
  :func:`discard_spilled` once no model needs them;
* ``verify`` checks a weightless skeleton of the model from a temporary folder;
* onnxruntime loads a small model file whose tensors point at the weight files
  (:func:`session_source`, :func:`runtime_file`);
* ``save`` streams tensor data into the output's data file tensor by tensor.

:func:`is_large` is the one test that sends a model down these paths.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import onnx
from onnx.external_data_helper import uses_external_data

from onnxmp.errors import OnnxMPError
from onnxmp.subgraphs import bodies, holders, may_hold_graphs
from onnxmp.tensordata import nbytes, open_checked, read_range, resolve_location

_PACKED = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.FLOAT4E2M1}

CHUNK = 64 << 20  # bytes copied per read when streaming external data
# Protobuf cannot serialize a message over 2 GiB; a model above half of it keeps (or gets) its weights in
# files.  The same test picks every large-model path (save, sessions, emulate), so a model just under
# 2 GB and one just over take the same one.
EXTERNAL_DATA_THRESHOLD = 1 << 30
PROTOBUF_LIMIT = 2**31 - 1
SKELETON_DATA = "onnxmp-skeleton.bin"
SKELETON_TENSOR_BYTES = 1024  # raw data above this is left out of the skeleton
_PLAIN = frozenset({onnx.AttributeProto.INT, onnx.AttributeProto.FLOAT, onnx.AttributeProto.STRING,
                    onnx.AttributeProto.INTS, onnx.AttributeProto.FLOATS, onnx.AttributeProto.STRINGS})


def all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every initializer (all graphs), then every tensor-valued attribute (graphs and functions),
    in the order onnx's external-data helpers visit them."""
    yield from _initializers(model.graph)
    yield from _attribute_tensors(model.graph)
    for function in model.functions:
        yield from _attribute_tensors(function)


def _subgraphs(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    if attr.type == onnx.AttributeProto.GRAPH:
        return [attr.g]
    return list(attr.graphs) if attr.type == onnx.AttributeProto.GRAPHS else []


def _initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for node in holders(graph):
        for sub in bodies(node):
            yield from _initializers(sub)


def _attribute_tensors(graph, with_initializers: bool = False) -> Iterator[onnx.TensorProto]:
    """Tensor-valued attributes of ``graph``'s nodes and of their bodies (with the bodies'
    initializers too, when asked)."""
    # One comprehension finds the few attributes that can hold a tensor or a graph.
    for attr in [a for node in graph.node for a in node.attribute[:] if a.type not in _PLAIN]:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        for sub in _subgraphs(attr):
            if with_initializers:
                yield from sub.initializer
            yield from _attribute_tensors(sub, with_initializers)


# How every TensorProto with data_location = EXTERNAL serializes that field (field 14, varint 1).
_EXTERNAL_FIELD = bytes([14 << 3, onnx.TensorProto.EXTERNAL])
_SEARCH_WINDOW = 16 << 20  # bytes searched per numpy call: bounds the temporary arrays


def _holds(data: bytes, pair: bytes) -> bool:
    """``pair in data``, for two bytes: numpy finds the first byte's places, then checks the next.
    (A two-byte ``in`` crawls when the first byte is common, as field tags are.)"""
    first, second = pair
    array = np.frombuffer(data, np.uint8)
    for start in range(0, len(array) - 1, _SEARCH_WINDOW):
        window = array[start:start + _SEARCH_WINDOW + 1]
        places = np.flatnonzero(window[:-1] == first)
        if places.size and (window[places + 1] == second).any():
            return True
    return False


def has_external_data(model: onnx.ModelProto, serialized: bytes | None = None) -> bool:
    """Whether any tensor's data is external: ``all_tensors`` in one walk over the nodes
    (the order does not matter here).

    ``serialized`` (the model's bytes, when the caller has them) can spare the walk: bytes
    without the field's encoding hold no external tensor, nested ones included.  Weights
    usually contain those two bytes by chance, and then the walk decides.
    """
    if serialized is not None and not _holds(serialized, _EXTERNAL_FIELD):
        return False
    external = onnx.TensorProto.EXTERNAL
    if any(t.data_location == external for t in model.graph.initializer):
        return True
    if any(t.data_location == external for t in _attribute_tensors(model.graph, with_initializers=True)):
        return True
    return any(t.data_location == external for f in model.functions for t in _attribute_tensors(f))


def is_large(model: onnx.ModelProto) -> bool:
    """Whether ``model`` must be handled through files: its data is external, or it is too big to
    serialize in one piece comfortably."""
    return has_external_data(model) or model.ByteSize() > EXTERNAL_DATA_THRESHOLD


def data_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the model with its external data: the proto plus every external tensor's length
    (read from the records, not the files)."""
    total = model.ByteSize()
    for tensor in all_tensors(model):
        if uses_external_data(tensor):
            meta = info(tensor)
            total += int(meta["length"]) if "length" in meta else _expected_bytes(tensor)
    return total


def _expected_bytes(tensor: onnx.TensorProto) -> int:
    return nbytes(tensor)


def locations(model: onnx.ModelProto) -> set[str]:
    """The ``location`` of every external tensor, as recorded: relative to the model's folder in a
    file, absolute in a model onnxmp loaded."""
    return {info(t).get("location", "") for t in all_tensors(model) if uses_external_data(t)} - {""}


def read_locations(model: onnx.ModelProto) -> list[Path]:
    """The files the model's external tensors are read from (absolute locations: a model onnxmp
    loaded).  Writing over one of them while the model streams from it destroys the weights."""
    return sorted(Path(loc) for loc in locations(model) if os.path.isabs(loc))


def info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _set_info(tensor: onnx.TensorProto, values: dict[str, str]) -> None:
    del tensor.external_data[:]
    for key, value in values.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    tensor.data_location = onnx.TensorProto.EXTERNAL


def make_locations_absolute(model: onnx.ModelProto, base_dir: Path) -> None:
    """Point external tensors at absolute paths, checking every rule of :mod:`onnxmp.tensordata`
    (location inside ``base_dir`` unless trusted, regular file, offset and length within it) before
    any byte is read."""
    for tensor in all_tensors(model):
        if not uses_external_data(tensor):
            continue
        meta = info(tensor)
        meta["location"] = resolve_location(tensor, meta, base_dir)
        _set_info(tensor, meta)


def read_external(tensor: onnx.TensorProto) -> np.ndarray:
    """An external tensor's values, from its absolute location, every rule checked before the read."""
    raw = read_range(tensor, info(tensor))
    if tensor.data_type in _PACKED:  # sub-byte types: numpy_helper unpacks them
        loaded = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims, raw_data=bytes(raw))
        return onnx.numpy_helper.to_array(loaded)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype, copy=False).reshape(
        tuple(tensor.dims))


def load_external(model: onnx.ModelProto, base_dir: Path) -> None:
    """Read every external tensor of a file-loaded ``model`` into ``raw_data`` (what
    ``onnx.load_external_data_for_model`` does), through the same checks as the lazy path."""
    make_locations_absolute(model, base_dir)
    for tensor in all_tensors(model):
        if uses_external_data(tensor):
            raw = read_range(tensor, info(tensor))
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
            tensor.raw_data = bytes(raw)
            del raw


def tensor_array(tensor: onnx.TensorProto) -> np.ndarray:
    """Values of a tensor (read-only), read from its (absolute) external location when it has one."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return read_external(tensor)
    if tensor.data_type == onnx.TensorProto.FLOAT and tensor.raw_data:
        # numpy_helper.to_array's generality costs ~25 us a tensor; models hold thousands of small ones.
        return np.frombuffer(tensor.raw_data, dtype="<f4").reshape(tuple(tensor.dims))
    return onnx.numpy_helper.to_array(tensor)


def constant_node_values(node: onnx.NodeProto) -> np.ndarray | None:
    """A Constant node's values, whichever attribute holds them (``value``, ``value_float(s)``,
    ``value_int(s)``), in the type that attribute makes; None for the sparse and string forms.

    The one reader of a Constant's values: the range seed, the idle-Cast fold, the writer and the
    training build all read Constants through it, so each sees every attribute form alike."""
    for attr in node.attribute:
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
            return tensor_array(attr.t)
        if attr.name == "value_float":
            return np.asarray(attr.f, dtype=np.float32)
        if attr.name == "value_floats":
            return np.asarray(list(attr.floats), dtype=np.float32)
        if attr.name == "value_int":
            return np.asarray(attr.i, dtype=np.int64)
        if attr.name == "value_ints":
            return np.asarray(list(attr.ints), dtype=np.int64)
    return None


def converted_external(source: onnx.TensorProto, low_dtype: np.dtype, low_enum: int) -> onnx.TensorProto:
    """An external fp32 initializer converted to low precision, spilled to disk.

    The converted bytes go, one tensor at a time, into a temporary folder that lives
    as long as the process (or until ``save`` copies them), so the converted model
    never holds its weights in memory.
    """
    return spilled(source.name, read_external(source).astype(low_dtype), low_enum)


def spilled(name: str, values: np.ndarray, data_type: int) -> onnx.TensorProto:
    """A tensor named ``name`` whose ``values`` are written to a file of the spill folder."""
    path = spill_folder() / f"{next(_SPILLED)}.bin"
    np.ascontiguousarray(values).tofile(path)
    proto = onnx.TensorProto(name=name, data_type=data_type, dims=values.shape)
    _set_info(proto, {"location": str(path), "offset": 0, "length": values.nbytes})
    return proto


def discard_spilled(model: onnx.ModelProto, keep: Iterable[onnx.ModelProto] = ()) -> None:
    """Delete the spill files ``model`` reads that no model in ``keep`` reads: a converted or
    emulated copy of a large model is as big as its weights, and a search makes many."""
    if not _SPILL:
        return
    folder = str(_SPILL[0])
    kept = set().union(*(locations(m) for m in keep))
    for location in locations(model) - kept:
        if os.path.dirname(location) == folder:
            Path(location).unlink(missing_ok=True)


_SPILL: list[Path] = []
_SPILLED = itertools.count()  # listing the folder for a fresh name made spilling quadratic


def spill_folder() -> Path:
    if not _SPILL:
        folder = Path(tempfile.mkdtemp(prefix="onnxmp-spill-"))
        atexit.register(shutil.rmtree, folder, True)
        _SPILL.append(folder)
    return _SPILL[0]


def skeleton(model: onnx.ModelProto, holding: list[onnx.NodeProto] | None = None) -> onnx.ModelProto:
    """A copy with every large tensor's data replaced by a reference to an empty stand-in file.

    Built field by field so the weights are never copied: protobuf cannot
    serialize more than 2 GB, and checker and type inference need only types.
    ``holding`` is ``holders(model.graph)`` when the caller has it already.
    """
    return _shell(model, _skeleton_tensor, holding)


def _shell(model: onnx.ModelProto, tensor: Callable[[onnx.TensorProto], onnx.TensorProto],
           holding: list[onnx.NodeProto] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` with every initializer (all graphs) passed through ``tensor``, built field
    by field so the weights are never copied."""
    out = onnx.ModelProto()
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(out, field, getattr(model, field))
    out.opset_import.extend(model.opset_import)
    out.metadata_props.extend(model.metadata_props)
    out.functions.extend(model.functions)
    _skeleton_graph(model.graph, out.graph, holding, tensor)
    return out


def _skeleton_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    if tensor.data_location != onnx.TensorProto.EXTERNAL and len(tensor.raw_data) <= SKELETON_TENSOR_BYTES:
        return tensor
    proto = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
    _set_info(proto, {"location": SKELETON_DATA})
    return proto


def _skeleton_graph(graph: onnx.GraphProto, out: onnx.GraphProto, holding: list[onnx.NodeProto] | None = None,
                    tensor: Callable[[onnx.TensorProto], onnx.TensorProto] = _skeleton_tensor) -> None:
    """Fill ``out`` (empty) with ``graph``, initializers through ``tensor``, in place: no copy of the copy."""
    out.name, out.doc_string = graph.name, graph.doc_string
    out.input.extend(graph.input)
    out.output.extend(graph.output)
    out.value_info.extend(graph.value_info)
    out.sparse_initializer.extend(graph.sparse_initializer)
    out.initializer.extend([tensor(t) for t in graph.initializer])
    out.node.extend(graph.node)  # one C++ copy; only nodes holding subgraphs are rebuilt below
    if not (holders(graph) if holding is None else holding):
        return
    for index, node in enumerate(graph.node):
        if not may_hold_graphs(node) or not any(
                a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            continue
        copy = out.node[index]
        del copy.attribute[:]
        for attr in node.attribute:
            a = copy.attribute.add()
            if attr.type == onnx.AttributeProto.GRAPH:
                a.name, a.type, a.doc_string = attr.name, attr.type, attr.doc_string
                _skeleton_graph(attr.g, a.g, tensor=tensor)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                a.name, a.type, a.doc_string = attr.name, attr.type, attr.doc_string
                for g in attr.graphs:
                    _skeleton_graph(g, a.graphs.add(), tensor=tensor)
            else:
                a.CopyFrom(attr)


def write_with_external_data(model: onnx.ModelProto, path: Path, data_path: Path, final_data_name: str) -> None:
    """Stream every tensor's bytes into ``data_path`` and write the proto to ``path``.

    The proto records ``final_data_name`` (the name the data file gets once renamed).
    Afterwards the in-memory model points at the written data file, as
    ``onnx.external_data_helper.convert_model_to_external_data`` would leave it.
    """
    final_abs = str(data_path.parent / final_data_name)
    relocated = []
    with open(data_path, "wb") as out:
        for tensor in all_tensors(model):
            if not uses_external_data(tensor) and len(tensor.raw_data) <= 1024:
                continue
            offset = out.tell()
            if uses_external_data(tensor):
                length = _copy_range(tensor, out)
            else:
                raw = tensor.raw_data
                out.write(raw)
                length = len(raw)
                del raw
                tensor.ClearField("raw_data")
            _set_info(tensor, {"location": final_data_name, "offset": offset, "length": length})
            relocated.append(tensor)
            pad = (-out.tell()) % 64  # aligned offsets let runtimes mmap tensors
            out.write(b"\0" * pad)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    for tensor in relocated:
        meta = info(tensor)
        meta["location"] = final_abs
        _set_info(tensor, meta)


def _copy_range(tensor: onnx.TensorProto, out) -> int:
    """Stream an external tensor's bytes into ``out``, every rule checked before the first read."""
    with open_checked(tensor, info(tensor)) as (fd, offset, remaining):
        total = 0
        while remaining > 0:
            chunk = os.pread(fd, min(CHUNK, remaining), offset + total)
            if not chunk:
                raise OnnxMPError(f"external data of tensor `{tensor.name}` ends early in {info(tensor)['location']}",
                                  hint="the data file does not match the model; re-export it")
            out.write(chunk)
            remaining -= len(chunk)
            total += len(chunk)
    return total


def check_skeleton(model: onnx.ModelProto, folder: str | os.PathLike) -> Path:
    """Write a weightless copy and an empty stand-in data file so the checker can run by path."""
    folder = Path(folder)
    (folder / SKELETON_DATA).write_bytes(b"")
    path = folder / "skeleton.onnx"
    path.write_bytes(skeleton(model).SerializeToString())
    return path


def runtime_file(model: onnx.ModelProto, folder: str | os.PathLike, name: str = "model") -> Path:
    """Write ``model`` into ``folder`` for onnxruntime to load by path, without serializing its weights.

    Large in-memory tensors are written out tensor by tensor into ``<name>.onnx.data``; external
    tensors stay in their files, each reached through a link in ``folder`` (:func:`_link`):
    onnxruntime refuses absolute locations (in subgraphs, in 1.19).  The model itself is not changed.
    """
    folder = Path(folder)
    path = folder / f"{name}.onnx"
    data = folder / f"{name}.onnx.data"
    with open(data, "wb") as out:
        def runtime_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
            if (uses_external_data(tensor) or tensor.data_type == onnx.TensorProto.STRING
                    or tensor.ByteSize() <= SKELETON_TENSOR_BYTES):
                return tensor
            proto = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
            offset = out.tell()
            raw = tensor.raw_data or onnx.numpy_helper.to_array(tensor).tobytes()
            out.write(raw)
            _set_info(proto, {"location": data.name, "offset": offset, "length": len(raw)})
            del raw
            out.write(b"\0" * ((-out.tell()) % 64))
            return proto

        shell = _shell(model, runtime_tensor)
    links: dict[str, str] = {}

    def relocate(tensor: onnx.TensorProto, in_body: bool) -> None:
        meta = info(tensor)
        location = meta.get("location", "")
        if location == data.name or location in links.values():
            return
        if not os.path.isabs(location):
            raise OnnxMPError(f"tensor `{tensor.name}` records its external data file relative to "
                              f"an unknown folder: {location}",
                              hint="pass the model's path, or load it with onnxmp.load(path)")
        if in_body:
            # onnx's checker, which onnxruntime runs on subgraphs, refuses symlinks and files with
            # several hard links alike: a body's tensors (small, as a rule) are copied instead.
            raw = read_range(tensor, meta)
            with open(data, "ab") as out:
                offset = out.tell()
                out.write(raw + b"\0" * ((-(offset + len(raw))) % 64))
            _set_info(tensor, {"location": data.name, "offset": offset, "length": len(raw)})
            return
        with open_checked(tensor, meta):  # a caller's ModelProto was never checked by load
            pass
        if location not in links:
            links[location] = f"{name}.{len(links)}.bin"
            _link(location, folder / links[location])
        meta["location"] = links[location]
        _set_info(tensor, meta)

    # The shell's own copies: relocating them leaves ``model`` alone.  Main-graph initializers
    # first; whatever external tensor is left after them lives in a body or an attribute.
    for tensor in shell.graph.initializer:
        if uses_external_data(tensor):
            relocate(tensor, in_body=False)
    for tensor in all_tensors(shell):
        if uses_external_data(tensor):
            relocate(tensor, in_body=True)
    path.write_bytes(shell.SerializeToString())
    return path


def _link(target: str, link: Path) -> None:
    """``link`` names the file ``target``: a hard link where the file system allows one, else a symlink.

    onnxruntime 1.20 and newer resolve symlinks and refuse external data outside the model's
    folder ("External data path escapes model directory"); a hard link is in the folder itself.
    """
    try:
        os.link(target, link)
    except OSError:  # another file system, or one without hard links
        os.symlink(target, link)


@contextlib.contextmanager
def session_source(model: onnx.ModelProto, name: str = "model") -> Iterator[str | bytes]:
    """What onnxruntime should build a session of ``model`` from, for the ``with`` block's duration:
    the serialized model, or for a large one (:func:`is_large`) a :func:`runtime_file` in a temporary
    folder, so that no serialized whole model is ever in memory and the 2 GB limit never applies."""
    if not is_large(model):
        yield model.SerializeToString()
        return
    with tempfile.TemporaryDirectory(prefix="onnxmp-session-") as folder:
        yield str(runtime_file(model, folder, name))
