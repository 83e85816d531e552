"""Stage 5: verify.  Nothing half-converted leaves onnxmp.

Checks the rewritten model with the full checker and strict type inference; the checker also
enforces topological order in every graph (a body may read only outer names defined before
its node).  Any failure is an :class:`OnnxMPError`.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Callable

import onnx

from onnxmp import runtime
from onnxmp.contrib_types import binding_errors, has_foreign_ops
from onnxmp.domains import is_onnx_domain, onnx_opset
from onnxmp.errors import OnnxMPError, first_line
from onnxmp.external import check_skeleton, has_external_data, skeleton
from onnxmp.subgraphs import iter_proto_graphs
from onnxmp.normalize import make_node_names_unique, toposort_all

SKELETON_ABOVE = 1 << 30  # bytes; well under protobuf's 2 GB serialization limit
CHECK_FILE_BELOW = 64 << 20  # bytes; see full_check

log = logging.getLogger("onnxmp.verify")

# No route is suggested here: blocking the named node alone led to another unloadable model
# (issue 30: --block-node on a Gemm whose weight a fused op shares).
_HINT = ("onnxmp produced an invalid model; please report it with the model. onnxmp does not write it; "
         "`onnxmp explain` shows the coloring that led to it")


def verify(model: onnx.ModelProto | bytes, *, keep_io_types: bool = True,
           original_io: tuple[list, list] | None = None,
           reload_original: Callable[[], onnx.ModelProto] | None = None,
           ort_version: str | None = None, foreign_ops: bool | None = None) -> onnx.ModelProto:
    """Check the converted model and return it.

    ``original_io`` (``io_signature`` of the model converted) and ``reload_original`` (which makes
    that model again, for the rare failure) stand in for the original model itself: callers pass them
    to let it go before the checker makes its own copies of the converted one.  ``model`` may be
    its bytes (:func:`compact_bytes`): they are checked first and parsed after, so the checker's
    copy never sits beside a parsed one.

    The judgment is "no new errors": a model whose input already failed the checker in the same
    words passes (onnxruntime and onnxconverter-common run such models; onnx's checker wants a
    rank on every output, they do not).  Nodes of onnxruntime's domains are checked against its
    schemas for ``ort_version`` (:func:`~onnxmp.contrib_types.binding_errors`), as its graph
    resolution does at session creation; ``foreign_ops`` (normalize's finding) spares plain models the
    search for such nodes.
    """
    try:
        try:
            full_check(model)
        except Exception:
            explicit = with_function_defaults(_parsed(model))
            if explicit is None:
                raise
            full_check(explicit)
            log.debug("the model passes the checker once function ops' attribute defaults are written out")
    except Exception as exc:  # ValidationError, or InferenceError from full_check
        # full_check runs type inference with check_type and strict mode: a type error lands here too.
        error = first_line(exc)
        before = input_error(reload_original() if reload_original is not None else None)
        if before is None or before != error:
            reject_invalid_input(reload_original() if before is not None and reload_original is not None else None)
            raise OnnxMPError(f"converted model fails onnx.checker / strict type inference: {error}",
                              hint=_HINT) from None
        # The same complaint as the input's: the judge is whether onnxruntime takes the written model
        # (it does not ask for a rank on every output, as the checker does; a dangling input it refuses).
        refused = runtime_load_error(_parsed(model))
        if refused is not None:
            reject_invalid_input(reload_original() if reload_original is not None else None)
            raise OnnxMPError(f"converted model fails onnx.checker ({error}) and onnxruntime refuses it: {refused}",
                              hint=_HINT)
        log.warning("the input model already fails onnx.checker in the same way (%s); onnxruntime loads the "
                    "converted model, which adds no new error", error)
    model = _parsed(model)
    if foreign_ops or (foreign_ops is None and has_foreign_ops(model)):
        errors = binding_errors(model, ort_version)
        if errors:
            raise OnnxMPError(f"converted model would not load in onnxruntime {ort_version or ''}: {errors[0]}".replace(
                "onnxruntime :", "onnxruntime:"), hint=_HINT)
    if original_io is not None and keep_io_types:
        _check_io_signatures(original_io, io_signature(model))
    return model


def runtime_load_error(model: onnx.ModelProto) -> str | None:
    """What the installed onnxruntime says when it refuses ``model`` at session creation (graph
    resolution: types, structure); None when it resolves.  A missing CPU kernel
    (:data:`onnxmp.runtime.NO_KERNEL`) is no fault of the model and counts as resolved; without
    onnxruntime, nothing can be proved."""
    try:
        return runtime.resolve(model, initialize=True)
    except OnnxMPError as exc:  # no onnxruntime, or no room for a large model's runtime file
        return exc.message


def input_error(original: onnx.ModelProto | None) -> str | None:
    """The first line of what the full checker says of ``original``; None when it passes (or when
    there is no original at hand)."""
    if original is None:
        return None
    try:
        full_check(original)
    except Exception as exc:  # noqa: BLE001 (the checker's exception types vary)
        return first_line(exc)
    return None


def _parsed(model: onnx.ModelProto | bytes) -> onnx.ModelProto:
    return onnx.ModelProto.FromString(model) if isinstance(model, bytes) else model


def compact_bytes(model: onnx.ModelProto) -> bytes | None:
    """The bytes of a model whose structure, not its weights, fills its memory; None otherwise.

    The written model still holds, in its protobuf arena, everything normalize's shape inference
    and the rewrite allocated in it and then dropped.  Handed these bytes instead, and with the
    model let go, :func:`verify` checks them while no parsed model is alive and parses them
    afresh after, into a fresh arena (bench_convert's peak RSS at 80k nodes: 483 -> 400 MB).  A model of mostly weights, or with external data, gains nothing and is left
    as it is.
    """
    data = _serialized(model)
    if data is None or len(data) > CHECK_FILE_BELOW or has_external_data(model, data):
        return None
    return data


def check_input_model(model: onnx.ModelProto) -> None:
    """Raise :class:`OnnxMPError` when ``model`` is not one convert would accept as input.

    Coloring does not need a valid model, so explain would otherwise print colors for a
    model convert refuses (a tensor nothing produces, an Add of float and int).  ``model``
    is not changed: the check runs on a weightless copy, named and sorted the way convert
    prepares its input first (an unsorted export is valid input).
    """
    copy = skeleton(model)  # the checker needs types only
    make_node_names_unique(copy.graph)
    toposort_all(copy)
    copy = with_function_defaults(copy) or copy
    error = input_error(copy)
    if error is None:
        return
    # convert judges by "no new errors" where onnxruntime loads the model (verify): so does explain.
    if runtime_load_error(model) is None:
        log.warning("the input model fails onnx.checker (%s), but onnxruntime loads it; convert judges its "
                    "output by adding no new error", error)
        return
    reject_invalid_input(copy)


def reject_invalid_input(original: onnx.ModelProto | None) -> None:
    """Raise :class:`OnnxMPError` blaming the input when ``original`` fails the full checker.

    A model that was invalid before conversion is the export's problem, not a converter bug
    to report; verify calls this before blaming itself.  ``None`` (no original at hand) passes.
    """
    if original is None:
        return
    try:
        full_check(original)
    except Exception as exc:  # noqa: BLE001 (the checker's exception types vary)
        raise OnnxMPError(f"the input model is invalid (onnx.checker, strict type inference): {first_line(exc)}",
                          hint="fix or re-export the model; onnx.checker.check_model(model, full_check=True) "
                               "shows the problem") from None


def full_check(model: onnx.ModelProto | bytes) -> None:
    """onnx.checker with strict type inference; raises what the checker raises.  ``model`` may
    be :func:`compact_bytes`.

    A model under ``CHECK_FILE_BELOW`` bytes is checked from a temporary file: handed bytes,
    onnx copies its parsed model once more for type inference, and for a graph of many nodes
    that copy is several times the serialized size.  Bigger models are mostly weights, which
    the file would only write out and read back.
    """
    if isinstance(model, bytes):  # compact_bytes: under CHECK_FILE_BELOW, no external data
        data = model
    elif (data := _serialized(model)) is None or len(data) > SKELETON_ABOVE or has_external_data(model, data):
        del data
        # The weights are in other files, or the proto does not fit protobuf's 2 GB: check a
        # weightless skeleton.
        with tempfile.TemporaryDirectory(prefix="onnxmp-verify-") as folder:
            onnx.checker.check_model(str(check_skeleton(model, folder)), full_check=True)
        return
    if len(data) > CHECK_FILE_BELOW:
        onnx.checker.check_model(data, full_check=True)
        return
    fd, path = tempfile.mkstemp(prefix="onnxmp-verify-", suffix=".onnx")  # a file only: cheaper than a folder
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        del data
        onnx.checker.check_model(path, full_check=True)
    finally:
        os.unlink(path)


def _serialized(model: onnx.ModelProto) -> bytes | None:
    try:
        return model.SerializeToString()
    except Exception:  # noqa: BLE001 (over 2 GB; the error type depends on the protobuf build)
        return None


def with_function_defaults(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A weightless copy whose function-op nodes spell out their schema's attribute defaults;
    None when no node relies on one.

    onnx (1.23) expands a schema function body for type inference without applying the
    attribute defaults, so a body reading ``@axes`` (MeanVarianceNormalization) fails strict
    inference on a node that leaves ``axes`` at its default, although the model is valid and
    ORT runs it.  Writing the default out means the same thing and lets the check see through.
    """
    opset = onnx_opset(model)
    if opset is None:
        return None
    copy = skeleton(model)
    changed = False
    for graph in iter_proto_graphs(copy.graph):
        for node in graph.node:
            if not is_onnx_domain(node.domain):
                continue
            try:
                schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
            except onnx.defs.SchemaError:
                continue
            if not (schema.has_function or schema.has_context_dependent_function):
                continue
            present = {a.name for a in node.attribute}
            for name, attr in schema.attributes.items():
                if name not in present and attr.default_value.type != onnx.AttributeProto.UNDEFINED:
                    default = onnx.AttributeProto()
                    default.CopyFrom(attr.default_value)
                    default.name = name
                    node.attribute.append(default)
                    changed = True
    return copy if changed else None


def type_signature(tp: onnx.TypeProto) -> tuple:
    """What a caller relies on in a value's type: its kind, element types and shape, nested
    through sequences, optionals and maps."""
    which = tp.WhichOneof("value")
    if which in ("tensor_type", "sparse_tensor_type"):
        t = getattr(tp, which)
        shape = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in t.shape.dim) \
            if t.HasField("shape") else None
        return which, t.elem_type, shape
    if which in ("sequence_type", "optional_type"):
        return which, type_signature(getattr(tp, which).elem_type)
    if which == "map_type":
        return which, tp.map_type.key_type, type_signature(tp.map_type.value_type)
    return (which,)


def io_signature(model: onnx.ModelProto) -> tuple[list, list]:
    return ([(v.name, type_signature(v.type)) for v in model.graph.input],
            [(v.name, type_signature(v.type)) for v in model.graph.output])


def _kept(original: tuple, converted: tuple) -> bool:
    """``converted`` is the type ``original`` declared; a tensor declared without a shape may
    come back with the shape inference found (normalize fills it in for the checker)."""
    if original == converted:
        return True
    return (original[0] == converted[0] == "tensor_type" and original[2] is None
            and original[1] == converted[1])


def check_io_unchanged(original: onnx.ModelProto, converted: onnx.ModelProto) -> None:
    _check_io_signatures(io_signature(original), io_signature(converted))


def _check_io_signatures(original: tuple[list, list], converted: tuple[list, list]) -> None:
    for what, a, b in zip(("inputs", "outputs"), original, converted):
        if len(a) != len(b) or not all(x[0] == y[0] and _kept(x[1], y[1]) for x, y in zip(a, b)):
            changed = [f"{x[0]}: {x[1]} -> {y[1]}" for x, y in zip(a, b) if x != y] or [f"{a} -> {b}"]
            raise OnnxMPError(f"graph {what} changed name or type during conversion: {'; '.join(changed)[:400]}",
                              hint=_HINT)
