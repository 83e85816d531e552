"""Stage 1: load.  Accepts a path or a ModelProto; never modifies the input."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Union

import onnx

from onnxmp.errors import OnnxMPError, first_line

log = logging.getLogger("onnxmp.load")

ModelLike = Union[str, os.PathLike, onnx.ModelProto, bytes]


def load(model: ModelLike, *, lazy_external: bool = False) -> onnx.ModelProto:
    """Return a ModelProto the caller may mutate freely.

    A path is read with its external data (relative to the file's folder); with
    ``lazy_external`` the data stays in its files and tensors point at them by
    absolute path (see :mod:`onnxmp.external`), so models over 2 GB never sit in
    memory whole.  A ModelProto is deep-copied so the caller's object is never touched.
    """
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        _check_not_empty(copy, "the given ModelProto")
        check_model(copy)
        return copy
    if isinstance(model, (bytes, bytearray)):
        return _parse_bytes(bytes(model), "the given bytes")
    if not isinstance(model, (str, os.PathLike)):
        raise OnnxMPError(
            f"cannot load a model from {type(model).__name__}",
            hint="pass a path to an .onnx file or an onnx.ModelProto",
        )
    path = Path(model)
    if not path.is_file():
        raise OnnxMPError(f"no such model file: {path}", hint="check the path")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError or RuntimeError depending on the build
        raise OnnxMPError(
            f"{path} is not a readable ONNX model ({type(exc).__name__}: {first_line(exc, 200)})",
            hint="the file may be truncated or not an ONNX protobuf; re-export it",
        ) from None
    _check_not_empty(proto, str(path))
    external = _uses_external_data(proto)
    if external:
        from onnxmp.external import load_external, make_locations_absolute

        # onnxmp's one reader, not onnx.load_external_data_for_model: the same rules on every path,
        # checked before a byte is read (onnxmp.tensordata).
        (make_locations_absolute if lazy_external else load_external)(proto, path.parent)
    check_model(proto)
    log.debug("loaded %s: %d nodes", path, len(proto.graph.node))
    return proto


def _parse_bytes(data: bytes, what: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as exc:
        raise OnnxMPError(f"{what} are not an ONNX model ({exc})", hint="re-export the model") from None
    _check_not_empty(proto, what)
    check_model(proto)
    return proto


def _check_not_empty(proto: onnx.ModelProto, what: str) -> None:
    # A truncated file often still parses into an empty or partial proto.
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise OnnxMPError(f"{what} holds no graph", hint="the file may be truncated or not an ONNX model")
    if not proto.opset_import:
        raise OnnxMPError(f"{what} declares no opset_import", hint="re-export the model with an opset")


def _uses_external_data(proto: onnx.ModelProto) -> bool:
    from onnxmp.external import has_external_data

    return has_external_data(proto)


def as_model(model: onnx.ModelProto | str | os.PathLike) -> onnx.ModelProto:
    """Return ``model`` itself, or the model loaded from a path, its external data left in its files
    (tensors point at them by absolute path; :mod:`onnxmp.external` reads them one at a time).

    Unlike :func:`onnxmp.load.load` a ModelProto is not copied: every caller
    here only reads it or copies it before changing anything.
    """
    if isinstance(model, onnx.ModelProto):
        check_model(model)  # load's checks, without its copy
        return model
    if isinstance(model, (str, os.PathLike)) and not os.path.exists(model):
        # The CLI and its users key on "not found" for a missing file.
        raise OnnxMPError(f"model file not found: {os.fspath(model)}", "check the path")
    return load(model, lazy_external=True)


def check_model(proto: onnx.ModelProto) -> None:
    """Every embedded tensor holds what its dims declare, before anything reshapes or allocates it;
    and the graphs are ones a walk can finish (:func:`_check_structure`)."""
    from onnxmp.external import all_tensors
    from onnxmp.tensordata import check_model_tensors

    check_model_tensors(all_tensors(proto))
    _check_structure(proto.graph, frozenset(), 0)


# Real models nest a few Loops and Ifs; a model nested to protobuf's limit (about 32 Ifs) makes walks
# that visit each body per level (validation, shape inference) take exponential time.
MAX_NESTING = 16


def _check_structure(graph: onnx.GraphProto, outer: frozenset[str], depth: int) -> None:
    """Refuse what onnx's checker refuses and a walk over the graphs would trip on: subgraphs nested
    past :data:`MAX_NESTING`, a value defined twice (in one graph, or again in a body: onnx's SSA rule
    across scopes), and a cycle among a graph's nodes (out-of-order nodes are fine: normalize sorts)."""
    from onnxmp.subgraphs import bodies, holders

    if depth > MAX_NESTING:
        raise OnnxMPError(f"graph {graph.name!r} is nested {depth} subgraphs deep (onnxmp reads at most "
                          f"{MAX_NESTING})", hint="the model is not one an exporter writes; re-export it")
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    # Each node's fields read once: protobuf field access dominates on graphs of 10^4 nodes.
    ports = [(node.input[:], node.output[:]) for node in graph.node]
    producer: dict[str, int] = {}
    for index, (_, outputs) in enumerate(ports):
        for name in outputs:
            if name in producer or name in outer:
                if not name:
                    continue
                node = graph.node[index]
                where = "an enclosing graph" if name in outer else f"graph {graph.name!r}"
                raise OnnxMPError(f"value {name!r} is defined twice (node {node.name!r} redefines it from {where})",
                                  hint="onnx requires every value name to be defined once across all scopes; "
                                       "re-export the model")
            producer[name] = index
    producer.pop("", None)
    get = producer.get
    if any(get(name, -1) >= index for index, (inputs, _) in enumerate(ports) for name in inputs):
        _check_acyclic(graph, ports, producer)  # out of order: sorted, unless there is a cycle
    inner = outer | defined | producer.keys()
    for node in holders(graph):
        for body in bodies(node):
            _check_structure(body, inner, depth + 1)


def _check_acyclic(graph: onnx.GraphProto, ports, producer: dict[str, int]) -> None:
    waiting = [0] * len(ports)
    readers: dict[int, list[int]] = {}
    for index, (inputs, _) in enumerate(ports):
        for source in {producer[name] for name in inputs if name in producer}:
            waiting[index] += 1
            readers.setdefault(source, []).append(index)
    ready = [i for i, count in enumerate(waiting) if not count]
    done = 0
    while ready:
        index = ready.pop()
        done += 1
        for reader in readers.get(index, ()):
            waiting[reader] -= 1
            if not waiting[reader]:
                ready.append(reader)
    if done != len(graph.node):
        stuck = next(graph.node[i] for i, count in enumerate(waiting) if count)
        raise OnnxMPError(f"graph {graph.name!r} has a cycle (node {stuck.name or stuck.op_type!r} depends on "
                          "its own output)", hint="re-export the model")
