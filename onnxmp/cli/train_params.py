"""``onnxmp train``'s parameter selection: ``--train`` / ``--freeze`` patterns and ``--list-params``.

Exporters fold the names of weights they cannot name after a module into ``onnx::MatMul_356``;
``--list-params`` shows, for those, the nodes that read them, so that a user can find the
weights of a layer and write the patterns.
"""
from __future__ import annotations

import re
from typing import Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxmp.errors import OnnxMPError, UsageError

# Names an exporter made up rather than took from the module: "onnx::MatMul_356", "/layer/Constant_output_0".
_FOLDED = re.compile(r"^onnx::|^_?val_\d+$|_output_\d+$|^\d+$")


def _compile(patterns: Sequence[str], flag: str) -> list[re.Pattern]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise UsageError(f"{flag} {pattern!r} is not a regular expression: {exc}", prog="onnxmp train") from None
    return compiled


def select(names: Sequence[str], train: Sequence[str] = (), freeze: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """Split the float initializers ``names`` into (trained, frozen) by the patterns (``re.search``).

    With ``train`` patterns only the names one of them matches are trained; ``freeze`` patterns
    then freeze what they match.  A pattern that matches no name is an error: a typo would
    otherwise train (or freeze) something else than meant, silently.
    """
    trained = list(names)
    for flag, patterns in (("--train", train), ("--freeze", freeze)):
        for pattern, compiled in zip(patterns, _compile(patterns, flag)):
            if not any(compiled.search(name) for name in names):
                raise OnnxMPError(f"{flag} {pattern!r} matches no parameter of the model",
                                  "see the names with `onnxmp train MODEL --list-params`")
    if train:
        wanted = _compile(train, "--train")
        trained = [n for n in trained if any(p.search(n) for p in wanted)]
    if freeze:
        unwanted = _compile(freeze, "--freeze")
        trained = [n for n in trained if not any(p.search(n) for p in unwanted)]
    if not trained:
        raise OnnxMPError("the --train/--freeze patterns leave no parameter to train",
                          "see the names with `onnxmp train MODEL --list-params`")
    chosen = set(trained)
    return trained, [n for n in names if n not in chosen]


def readers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    """The nodes of the main graph that read each value."""
    found: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            found.setdefault(name, []).append(node)
    return found


def list_params(model: onnx.ModelProto) -> Iterable[str]:
    """Lines of a table: each float initializer's name, shape, dtype and element count, and for
    names an exporter folded, the node(s) that read it (op and node name)."""
    read_by = readers(model)
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
    rows = []
    for init in model.graph.initializer:
        if init.data_type not in floats:
            continue
        shape = list(init.dims)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)).name if init.data_type != \
            TensorProto.BFLOAT16 else "bfloat16"
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        where = ""
        if _FOLDED.search(init.name):
            nodes = read_by.get(init.name, [])
            where = ", ".join(f"{n.op_type} {n.name!r}" if n.name else n.op_type for n in nodes) or "(not read)"
        rows.append((init.name, str(shape), dtype, count, where))
    if not rows:
        yield "the model has no float initializers: nothing to train"
        return
    width = max(len(r[0]) for r in rows)
    shape_width = max(len(r[1]) for r in rows)
    yield f"{'name':<{width}}  {'shape':<{shape_width}}  {'dtype':<8}  {'elements':>10}  read by"
    for name, shape, dtype, count, where in rows:
        yield f"{name:<{width}}  {shape:<{shape_width}}  {dtype:<8}  {count:>10}  {where}".rstrip()
    total = sum(r[3] for r in rows)
    yield f"{len(rows)} float initializers, {total} elements"
