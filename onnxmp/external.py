"""Models whose initializers live in external files (and models over 2 GB).

Such models are converted without ever holding all their weights, or the
serialized proto, in memory at once:

* ``load`` leaves external tensors where they are and records absolute
  locations, so the source folder no longer matters;
* after GS import, each external initializer is read lazily, one at a time
  (:class:`ExternalValues`), and only when the rewrite converts it;
* ``verify`` checks a weightless skeleton of the model from a temporary folder;
* ``save`` streams tensor data into the output's data file tensor by tensor.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx.external_data_helper import _get_all_tensors, uses_external_data
from onnx_graphsurgeon.ir.tensor import LazyValues

from onnxmp.errors import OnnxMPError
from onnxmp.graphs import iter_graphs

CHUNK = 64 << 20  # bytes copied per read when streaming external data
SKELETON_DATA = "onnxmp-skeleton.bin"


def all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    return _get_all_tensors(model)


def has_external_data(model: onnx.ModelProto) -> bool:
    return any(uses_external_data(t) for t in all_tensors(model))


def read_locations(model: onnx.ModelProto) -> list[Path]:
    """The files the model's external tensors are read from (absolute locations: a model onnxmp
    loaded).  Writing over one of them while the model streams from it destroys the weights."""
    locations = {info(t).get("location", "") for t in all_tensors(model) if uses_external_data(t)}
    return sorted(Path(loc) for loc in locations if loc and os.path.isabs(loc))


def info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _set_info(tensor: onnx.TensorProto, values: dict[str, str]) -> None:
    del tensor.external_data[:]
    for key, value in values.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    tensor.data_location = onnx.TensorProto.EXTERNAL


def make_locations_absolute(model: onnx.ModelProto, base_dir: Path) -> None:
    """Point external tensors at absolute paths, checking that the files exist."""
    for tensor in all_tensors(model):
        if not uses_external_data(tensor):
            continue
        meta = info(tensor)
        location = Path(meta.get("location", ""))
        path = location if location.is_absolute() else (base_dir / location)
        if not path.is_file():
            raise OnnxMPError(f"external data file of tensor `{tensor.name}` not found: {path}",
                              hint="keep the external data files next to the model, with the names it records")
        meta["location"] = str(path.resolve())
        _set_info(tensor, meta)


def read_external(tensor: onnx.TensorProto) -> np.ndarray:
    meta = info(tensor)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    offset = int(meta.get("offset", 0))
    array = np.fromfile(meta["location"], dtype=dtype, count=count, offset=offset)
    if array.size != count:
        raise OnnxMPError(f"external data of tensor `{tensor.name}` is truncated ({array.size} of {count} values)",
                          hint="the data file does not match the model; re-export it")
    return array.reshape(tuple(tensor.dims))


class ExternalValues(LazyValues):
    """GS lazy values that read from an absolute external location (GS reads relative to the cwd)."""

    def load(self) -> np.ndarray:
        return read_external(self.tensor)


def use_external_reader(graph: gs.Graph) -> int:
    """Swap GS's lazy loader for ours on every external initializer."""
    swapped = 0
    for _, g, _ in iter_graphs(graph):
        for tensor in g.tensors().values():
            values = getattr(tensor, "_values", None)
            if isinstance(tensor, gs.Constant) and isinstance(values, LazyValues) \
                    and not isinstance(values, ExternalValues) and uses_external_data(values.tensor):
                tensor._values = ExternalValues(values.tensor)
                swapped += 1
    return swapped


def constant_array(tensor: gs.Constant) -> np.ndarray:
    """Values of a GS constant without caching them on the tensor (big models stay lazy)."""
    values = tensor._values
    return values.load() if isinstance(values, LazyValues) else np.asarray(values)


class ConvertedValues(LazyValues):
    """An external fp32 initializer converted to low precision only when exported.

    At export the converted bytes are spilled, one tensor at a time, into a
    temporary folder that lives as long as the process (or until ``save`` copies
    them), so the converted model never holds its weights in memory.
    """

    def __init__(self, source: onnx.TensorProto, low_dtype: np.dtype, low_enum: int):
        self.source = source
        self.low_dtype = np.dtype(low_dtype)
        self.low_enum = low_enum
        self.shape = tuple(source.dims)
        self.dtype = self.low_dtype
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.low_dtype.itemsize
        self._spilled: onnx.TensorProto | None = None

    def load(self) -> np.ndarray:
        return read_external(self.source).astype(self.low_dtype)

    @property
    def tensor(self) -> onnx.TensorProto:  # what the GS exporter writes into the model
        if self._spilled is None:
            path = spill_folder() / f"{len(list(spill_folder().iterdir()))}.bin"
            values = self.load()
            values.tofile(path)
            proto = onnx.TensorProto(name=self.source.name, data_type=self.low_enum, dims=self.shape)
            _set_info(proto, {"location": str(path), "offset": 0, "length": values.nbytes})
            del values
            self._spilled = proto
        copy = onnx.TensorProto()
        copy.CopyFrom(self._spilled)
        return copy


_SPILL: list[Path] = []


def spill_folder() -> Path:
    if not _SPILL:
        folder = Path(tempfile.mkdtemp(prefix="onnxmp-spill-"))
        atexit.register(shutil.rmtree, folder, True)
        _SPILL.append(folder)
    return _SPILL[0]


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every large tensor's data replaced by a reference to an empty stand-in file.

    Built field by field so the weights are never copied: protobuf cannot
    serialize more than 2 GB, and checker and type inference need only types.
    """
    out = onnx.ModelProto()
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(out, field, getattr(model, field))
    out.opset_import.extend(model.opset_import)
    out.metadata_props.extend(model.metadata_props)
    out.functions.extend(model.functions)
    out.graph.CopyFrom(_skeleton_graph(model.graph))
    return out


def _skeleton_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    if not uses_external_data(tensor) and len(tensor.raw_data) <= 1024:
        return tensor
    proto = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
    _set_info(proto, {"location": SKELETON_DATA})
    return proto


def _skeleton_graph(graph: onnx.GraphProto) -> onnx.GraphProto:
    out = onnx.GraphProto(name=graph.name, doc_string=graph.doc_string)
    out.input.extend(graph.input)
    out.output.extend(graph.output)
    out.value_info.extend(graph.value_info)
    out.sparse_initializer.extend(graph.sparse_initializer)
    out.initializer.extend(_skeleton_tensor(t) for t in graph.initializer)
    for node in graph.node:
        copy = out.node.add()
        copy.input.extend(node.input)
        copy.output.extend(node.output)
        copy.name, copy.op_type, copy.domain, copy.doc_string = node.name, node.op_type, node.domain, node.doc_string
        for attr in node.attribute:
            a = copy.attribute.add()
            if attr.type == onnx.AttributeProto.GRAPH:
                a.name, a.type, a.doc_string = attr.name, attr.type, attr.doc_string
                a.g.CopyFrom(_skeleton_graph(attr.g))
            elif attr.type == onnx.AttributeProto.GRAPHS:
                a.name, a.type, a.doc_string = attr.name, attr.type, attr.doc_string
                a.graphs.extend(_skeleton_graph(g) for g in attr.graphs)
            else:
                a.CopyFrom(attr)
    return out


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
                meta = info(tensor)
                length = _copy_range(meta["location"], int(meta.get("offset", 0)), meta.get("length"), out, tensor)
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


def _copy_range(source: str, offset: int, length: str | None, out, tensor: onnx.TensorProto) -> int:
    itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    expected = int(np.prod(tensor.dims, dtype=np.int64)) * itemsize if tensor.dims else itemsize
    remaining = int(length) if length is not None else expected
    total = 0
    with open(source, "rb") as src:
        src.seek(offset)
        while remaining > 0:
            chunk = src.read(min(CHUNK, remaining))
            if not chunk:
                raise OnnxMPError(f"external data of tensor `{tensor.name}` ends early in {source}",
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
