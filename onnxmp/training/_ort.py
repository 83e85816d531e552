"""onnxruntime-training 1.19.2, the last training build: its limits, and its API without importing torch.

The limits (:data:`MAX_OPSET`, :data:`MAX_IR_VERSION`, :func:`cap_ir_version`) are what every
graph the build writes respects, so that the native engine loads them.

``onnxruntime/training/__init__.py`` imports its torch-based optimizers, so a
plain ``import onnxruntime.training`` fails (or costs seconds) without torch.
The pieces onnxmp needs (``artifacts``/``onnxblock`` for building graphs and
``api`` for running them) do not need torch, so when torch is absent we put a
bare package object in ``sys.modules`` and let submodules import from its
folder.  With torch installed the real package is imported, so other code in
the same process still sees the complete ``onnxruntime.training``.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import tempfile
import types

from onnxmp.errors import OnnxMPError

# onnxruntime-training 1.19.2, the last training build, loads nothing newer.
MAX_IR_VERSION = 10
MAX_OPSET = 21


def cap_ir_version(model) -> None:
    """onnx 1.23 stamps new models IR 14 and ORT 1.19 refuses anything over 10; nothing onnxmp or
    onnxblock writes needs a newer IR feature."""
    model.ir_version = min(model.ir_version or MAX_IR_VERSION, MAX_IR_VERSION)

_INSTALL_HINT = ("install the training build: pip install onnxruntime-training-cpu==1.19.2 "
                 "(or onnxruntime-training==1.19.2 for CUDA); it exists for Python <= 3.11 only")


_BUILD_ON_311 = ('build the artifacts once on Python 3.11 (python3.11 -m venv .venv && . .venv/bin/activate && '
                 'pip install -e ".[train-cpu]" && onnxmp train MODEL ... --out RUN), then train them here with '
                 'the portable engine: onnxmp train --artifacts RUN/artifacts ... (or Trainer(RUN/artifacts))')


def _training_package() -> types.ModuleType:
    name = "onnxruntime.training"
    if name in sys.modules:
        return sys.modules[name]
    try:
        import onnxruntime
    except ImportError as exc:
        raise _no_training("onnxruntime is not installed") from exc
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        raise _no_training(f"onnxruntime {onnxruntime.__version__} has no training support")
    if importlib.util.find_spec("torch") is not None:
        return importlib.import_module(name)
    package = types.ModuleType(name)
    package.__path__ = list(spec.submodule_search_locations)
    package.__package__ = name
    package.__spec__ = spec
    sys.modules[name] = package
    onnxruntime.training = package
    return package


def _no_training(reason: str) -> OnnxMPError:
    if sys.version_info >= (3, 12):
        # onnxruntime-training 1.19.2 (the last training build) has wheels up to Python 3.11 only.
        return OnnxMPError(
            f"building training artifacts with ORT's gradient builder (and the native engine) needs "
            f"onnxruntime-training 1.19.2, which has no wheels for Python {sys.version_info[0]}.{sys.version_info[1]}",
            f"onnxmp's own builder needs none: builder='onnxmp' / --builder onnxmp (what auto picks here); "
            f"or {_BUILD_ON_311}")
    return OnnxMPError(reason, f"{_INSTALL_HINT}; or {_BUILD_ON_311}")


def available() -> bool:
    """Whether the training build (onnxruntime-training: onnxblock and its Module API) imports here."""
    try:
        onnxblock()
        api()
    except (OnnxMPError, ImportError):
        return False
    return True


def onnxblock() -> types.ModuleType:
    _training_package()
    return importlib.import_module("onnxruntime.training.onnxblock")


def api() -> types.ModuleType:
    _training_package()
    return importlib.import_module("onnxruntime.training.api")


@contextlib.contextmanager
def native_stderr_to_log(logger: logging.Logger):
    """Send what native code writes to fd 2 during the block to ``logger.debug``.

    ORT's gradient-graph builder logs every graph transformer at INFO through
    its own logger, whatever the default severity says; this keeps that noise
    out of the user's terminal while ``-v -v`` still shows it.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for line in sink.read().decode(errors="replace").splitlines():
                logger.debug("onnxruntime: %s", line)
