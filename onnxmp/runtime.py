"""The one layer between onnxmp and onnxruntime: sessions, devices, options, OrtValues, errors.

Every ``InferenceSession`` of onnxmp is made here (:func:`session`), so one place decides how a
model reaches onnxruntime (the serialized model, or a runtime file for a large one), which
providers a device means, how quiet onnxruntime is, and how its errors read.  onnxruntime raises
its own exception types per status and shares no public base class; :func:`translate` turns any
of them into one :class:`~onnxmp.errors.OnnxMPError`: one line that names the onnxruntime version,
what was loaded or run and onnxruntime's reason without its C++ location, and a hint.

onnxruntime is imported lazily: ``import onnxmp`` works without it (convert needs none).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import onnx

from onnxmp.errors import OnnxMPError, first_line
from onnxmp.targets import CPU, TARGETS

log = logging.getLogger("onnxmp.runtime")

# What onnxruntime says when this build has no kernel for a node's types (a float16 model made for
# the CUDA EP, on a CPU-only build): the graph resolved, its types are sound.  The last: the CPU EP's
# own fallback (InsertCastTransformer) ran float16 nodes in float32 with Casts it inserted, after the
# model resolved, and tripped over its own Casts (GPT-2, T5, DeBERTa exports in float16, 1.19.2).
NO_KERNEL = ("Could not find an implementation for", "Kernel not found", "NOT_IMPLEMENTED",
             "InsertedPrecisionFreeCast_")

_OPTIMIZATION = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
                 "all": "ORT_ENABLE_ALL"}
_GPU_HINT = "install onnxruntime-gpu (pip install onnxmp[gpu]), or run on the cpu (low precision is emulated there)"
_LOAD_HINT = ("check the model with onnx.checker.check_model; a model converted for another onnxruntime "
              "(convert's --ort-version) may not load in this one")
_RUN_HINT = "check the inputs' names, shapes and dtypes against the model's inputs"

# Reasons with a better hint than the default; (words in onnxruntime's reason, hint).
_HINTS = (
    (("Invalid Feed Input Name", "Missing Input", "Got invalid dimensions", "Unexpected input data type",
      "input with name", "Invalid rank for input"), _RUN_HINT),
    (NO_KERNEL, "this onnxruntime build has no kernel for some node's types: run the model where it was made "
                "for (a float16 model converted for cuda needs the CUDA EP), or convert with target='cpu'"),
    (("bound to different types",), "the model's types are inconsistent; report it with the model if onnxmp "
                                    "wrote it"),
)


def ort():
    """The onnxruntime module; a clear error where it is not installed."""
    try:
        import onnxruntime
    except ImportError:
        raise OnnxMPError("onnxruntime is not installed",
                          "pip install onnxruntime (or onnxruntime-gpu for CUDA)") from None
    return onnxruntime


def version() -> str:
    return ort().__version__


# --- errors -------------------------------------------------------------------------------------


def reason(exc: BaseException | str, *, node: bool = True) -> str:
    """onnxruntime's reason on one line: the node that failed, if one did (unless ``node`` is False:
    a caller that names it itself), and the words that matter, without the
    ``[ONNXRuntimeError] : 2 : INVALID_ARGUMENT :`` status prefix, the C++ source location and
    signature, or an ``ORT_ENFORCE``'s condition (which can run to hundreds of characters)."""
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : [A-Z_]+ : ", "", str(exc).strip())
    failed = re.search(r"while running (\S+) node\. Name:'([^']*)' Status Message: ", text)
    where = ""
    if failed is not None:
        op_type, name = failed.groups()
        if node:
            where = f"{op_type} node {name!r}: " if name else f"a {op_type} node: "
        text = text[failed.end():]
    if " was false. " in text:
        text = text.split(" was false. ", 1)[1]
    if not text:
        return type(exc).__name__ if isinstance(exc, BaseException) else ""
    return where + first_line(text, 800)


def hint_for(text: str, action: str = "load") -> str:
    """The hint for onnxruntime's ``text`` when loading or running (``action``) failed."""
    for words, hint in _HINTS:
        if any(w in text for w in words):
            return hint
    return _RUN_HINT if action == "run" else _LOAD_HINT


def translate(exc: BaseException, what: str, *, action: str = "load", hint: str | None = None) -> OnnxMPError:
    """onnxruntime's ``exc`` as the :class:`OnnxMPError` users see: ``onnxruntime V cannot ACTION the
    WHAT: REASON``, one line, and ``hint`` (by default one chosen from the reason).  An OnnxMPError
    (onnxmp's own, raised on the way) comes back as it is."""
    if isinstance(exc, OnnxMPError):
        return exc
    why = reason(exc)
    try:
        where = f"onnxruntime {version()}"
    except OnnxMPError:
        where = "onnxruntime"
    return OnnxMPError(f"{where} cannot {action} the {what}: {why}", hint or hint_for(str(exc), action))


# --- devices and options ------------------------------------------------------------------------


def device_index(device: str) -> int:
    """N of ``cuda:N`` (0 for ``cuda`` and ``cpu``)."""
    _, _, index = device.partition(":")
    try:
        return int(index) if index else 0
    except ValueError:
        raise OnnxMPError(f"bad device {device!r}", "use cpu, cuda or cuda:N") from None


def check_device(device: str, hint: str = _GPU_HINT):
    """The :class:`~onnxmp.targets.Target` of ``device`` (``cpu``, ``cuda`` or ``cuda:N``), once this
    onnxruntime build has its provider."""
    chosen = TARGETS.get(device.split(":")[0])
    if chosen is None:
        raise OnnxMPError(f"unknown device {device!r}", "use cpu or cuda (cuda:N for another GPU)")
    device_index(device)
    if chosen.provider not in ort().get_available_providers():
        raise OnnxMPError(f"this onnxruntime build has no {chosen.provider}", hint)
    return chosen


def providers(device: str) -> list:
    """The providers of a session on ``device``, its own first, the CPU EP as the fallback onnxruntime
    adds anyway."""
    if device.split(":")[0] == "cuda":
        return [("CUDAExecutionProvider", {"device_id": device_index(device)}), CPU.provider]
    return [CPU.provider]


def placement(device: str) -> tuple[str, int]:
    """Where OrtValues of ``device`` live: ``OrtValue``'s device type and id."""
    if device.split(":")[0] == "cuda":
        return "cuda", device_index(device)
    return "cpu", 0


def session_options(*, threads: int | None = None, quiet: bool = True, optimization: str | None = None,
                    emulated: bool = False, deterministic: bool = False):
    """onnxruntime SessionOptions.

    ``quiet``: only onnxruntime's errors reach the log (its warnings about unused initializers and
    CPU fallbacks say nothing a user can act on).  ``optimization``: ``disable``, ``basic``,
    ``extended`` or ``all`` (onnxruntime's default).  ``emulated``: for a model of
    :func:`onnxmp.parity.emulate.emulate` on the CPU EP: ORT's extended fusions (level 2) take a
    ``Cast`` from a low-precision type in front of a decomposed LayerNorm into the fused
    ``LayerNormalization``, as they would on a GPU; the CPU EP has no bfloat16 kernel for it and
    refuses the model, and elsewhere such a fusion would compute past the rounding the emulation
    exists for.  The basic level keeps constant folding and the eliminations of redundant nodes,
    and leaves the emulated graph's arithmetic as written.  ``deterministic``: deterministic
    kernels where onnxruntime has a choice (CUDA).  ``threads``: intra-op threads (0 or None:
    onnxruntime's default).
    """
    rt = ort()
    options = rt.SessionOptions()
    if optimization is None and emulated:
        optimization = "basic"
    if optimization is not None:
        if optimization not in _OPTIMIZATION:
            raise ValueError(f"unknown optimization level {optimization!r}")
        options.graph_optimization_level = getattr(rt.GraphOptimizationLevel, _OPTIMIZATION[optimization])
    if quiet:
        options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    if deterministic:
        options.use_deterministic_compute = True
    return options


# --- sessions -----------------------------------------------------------------------------------


def session(model: onnx.ModelProto | bytes | str | os.PathLike, *, what: str, device: str = "cpu",
            options=None, provider_list: Sequence | None = None, hint: str | None = None):
    """An ``InferenceSession`` over ``model`` on ``device``; any failure is an :class:`OnnxMPError`
    naming ``what`` (translated by :func:`translate`, ``hint`` replacing the one it would choose).

    A ModelProto reaches onnxruntime as :func:`onnxmp.external.session_source` gives it (a large
    one as a runtime file, never serialized whole).  ``options``: a SessionOptions (default: a
    quiet :func:`session_options`).  ``provider_list``: the providers as a caller names them
    (onnxconverter-common's ``providers=``) instead of ``device``'s.
    """
    from onnxmp.external import session_source

    rt = ort()
    if provider_list is None:
        check_device(device)
        chosen = providers(device)
    else:
        chosen = list(provider_list)
    options = options if options is not None else session_options()
    try:
        if isinstance(model, onnx.ModelProto):
            # ``what`` names the runtime file a large model is written to: a file name, not a path.
            with session_source(model, re.sub(r"[^\w.-]+", "_", what)[:64]) as source:
                sess = rt.InferenceSession(source, options, providers=chosen)
        else:
            sess = rt.InferenceSession(model if isinstance(model, bytes) else os.fspath(model), options,
                                       providers=chosen)
    except Exception as exc:  # noqa: BLE001 (onnxruntime's exceptions share no public base class)
        raise translate(exc, what, hint=hint) from None
    # A provider list as the caller named it falls back to the CPU EP as onnxruntime lets it (and
    # onnxconverter-common with it); a device asked for must be the one that runs.
    wanted = chosen[0] if isinstance(chosen[0], str) else chosen[0][0]
    if provider_list is None and wanted not in sess.get_providers():
        raise OnnxMPError(f"{wanted} failed to initialize for the {what}",
                          "check the CUDA and cuDNN libraries onnxruntime needs")
    return sess


def resolve(model: onnx.ModelProto | bytes, *, initialize: bool = False) -> str | None:
    """None when onnxruntime loads ``model`` and resolves its graph, else its :func:`reason`.

    Resolution only, with ``initialize=False``: the session is made but not initialized, so no
    kernel is chosen or created (what ``InferenceSession`` does before ``initialize_session``).  The
    CPU EP has no kernel for many low-precision nodes, and onnxruntime-training 1.19.2 crashes
    (SIGSEGV) initializing some float16 training graphs on the CPU, neither of which says anything
    about the CUDA EP a graph is built for.  With ``initialize=True`` kernels are chosen on the CPU
    EP, and a missing one (:data:`NO_KERNEL`) still counts as resolved: the graph's types are sound.
    """
    from onnxmp.external import session_source

    rt = ort()
    options = session_options(optimization="disable")
    try:
        if initialize:
            if isinstance(model, bytes):
                rt.InferenceSession(model, options, providers=[CPU.provider])
            else:
                with session_source(model, "resolved") as source:
                    rt.InferenceSession(source, options, providers=[CPU.provider])
        else:
            from onnxruntime.capi import _pybind_state

            data = model if isinstance(model, bytes) else model.SerializeToString()
            _pybind_state.InferenceSession(options, data, False, False)
    except OnnxMPError:
        raise
    except Exception as exc:  # noqa: BLE001 (onnxruntime raises its own types per status)
        if initialize and any(words in str(exc) for words in NO_KERNEL):
            log.debug("onnxruntime resolves the model; this build lacks kernels for some nodes: %s", reason(exc))
            return None
        return reason(exc)
    return None


def run(sess, feeds: Mapping[str, Any], what: str, outputs: Sequence[str] | None = None,
        hint: str | None = None) -> list[np.ndarray]:
    """``sess.run`` with onnxruntime's errors translated (``cannot run the WHAT``); each output as
    :func:`as_output_array` makes it."""
    try:
        values = sess.run(None if outputs is None else list(outputs), dict(feeds))
    except Exception as exc:  # noqa: BLE001
        raise translate(exc, what, action="run", hint=hint) from None
    return [as_output_array(v) for v in values]


def as_output_array(value) -> np.ndarray:
    """One onnxruntime output as an array: a sequence output arrives as a list of arrays, an empty
    optional as None.  Same-shaped elements are stacked; ragged ones are flattened end to end."""
    if isinstance(value, np.ndarray):
        return value
    if value is None:
        return np.zeros(0, np.float32)
    if isinstance(value, (list, tuple)):
        arrays = [np.asarray(v) for v in value]
        if not arrays:
            return np.zeros(0, np.float32)
        if len({a.shape for a in arrays}) == 1:
            return np.stack(arrays)
        return np.concatenate([a.ravel() for a in arrays])
    return np.asarray(value)


# --- OrtValues and I/O binding ------------------------------------------------------------------


def to_ortvalue(array: np.ndarray, where: tuple[str, int]):
    """A copy of ``array`` as an OrtValue on ``where`` (:func:`placement`)."""
    array = np.asarray(array, order="C")
    value = ort().OrtValue.ortvalue_from_shape_and_type(array.shape, array.dtype, *where)
    value.update_inplace(array)
    return value


def empty_like(value, where: tuple[str, int], dtype=np.float32):
    """An uninitialized OrtValue of ``value``'s shape on ``where`` (a run's output buffer)."""
    return ort().OrtValue.ortvalue_from_shape_and_type(value.shape(), dtype, *where)


def bind(sess, inputs: Mapping[str, Any], outputs: Iterable[tuple[str, Any]]):
    """An I/O binding of ``sess``: each input an OrtValue (bound where it lives) or an array (copied
    from the host); each output an OrtValue to write into, or a placement (:func:`placement`, or
    ``"cpu"``) onnxruntime allocates it on."""
    binding = sess.io_binding()
    ortvalue = ort().OrtValue
    for name, value in inputs.items():
        if isinstance(value, ortvalue):
            binding.bind_ortvalue_input(name, value)
        else:
            binding.bind_cpu_input(name, np.asarray(value))
    for name, into in outputs:
        if isinstance(into, ortvalue):
            binding.bind_ortvalue_output(name, into)
        elif isinstance(into, str):
            binding.bind_output(name, into)
        else:
            binding.bind_output(name, *into)
    return binding
