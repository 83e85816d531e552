"""Training engines: one interface (:class:`~onnxmp.training.run.engines.base.Engine`), two runtimes.

* ``native``: onnxruntime-training 1.19.2's Module/Optimizer API (Python <= 3.11);
* ``portable``: plain ``onnxruntime.InferenceSession`` on the artifacts' lowered graphs, CPU
  or CUDA EP, Python 3.10-3.13.

``auto`` picks native where ``onnxruntime.training`` imports and the folder has the native files
(ORT's builder made it), portable elsewhere.
"""
from __future__ import annotations

from onnxmp.errors import OnnxMPError
from onnxmp.training import _ort
from onnxmp.training.artifacts import Artifacts
from onnxmp.training.run.engines.base import Engine

ENGINES = ("auto", "native", "portable")


# A name of its own, for the tests to pretend the training build is (or is not) installed.
native_available = _ort.available


def resolve(engine: str, artifacts: Artifacts) -> str:
    """The engine ``engine`` names for ``artifacts``; ``auto``: native where it imports."""
    if engine not in ENGINES:
        raise OnnxMPError(f"unknown engine {engine!r}", f"use one of: {', '.join(ENGINES)}")
    saved = artifacts.manifest.get("state", {}).get("engine")
    if engine == "auto":
        if saved is not None:  # a saved state continues on the engine that wrote it
            engine = saved
        else:  # onnxmp's builder writes no native files: its folders train on the portable engine
            engine = "native" if artifacts.has_native and native_available() else "portable"
    if engine == "native" and not artifacts.has_native:
        raise OnnxMPError(f"the artifacts in {artifacts.directory} were built by onnxmp's gradient builder and have "
                          "no native-engine files (onnxruntime-training's checkpoint and optimizer model)",
                          "train them with engine='portable' (or 'auto'), or rebuild them with builder='ort' on "
                          "Python 3.11 with the training build")
    if saved is not None and engine != saved:
        raise OnnxMPError(f"{artifacts.directory} holds a state the {saved} engine saved (its optimizer state is "
                          f"in the {saved} engine's format); the {engine} engine cannot continue it",
                          f"resume with engine={saved!r}")
    return engine


def make_engine(engine: str, artifacts: Artifacts, device: str, **kwargs) -> Engine:
    """An engine on ``artifacts``: ``engine`` is ``auto``, ``native`` or ``portable``."""
    name = resolve(engine, artifacts)
    if name == "native":
        from onnxmp.training.run.engines.native import NativeEngine

        return NativeEngine(artifacts, device, **kwargs)
    from onnxmp.training.run.engines.portable import PortableEngine

    if not artifacts.has_portable:
        raise OnnxMPError(f"the artifacts in {artifacts.directory} have no portable graphs, which the portable "
                          "engine runs", "rebuild them with this onnxmp version (Python 3.11 with the training "
                          "build), or train them with engine='native'")
    return PortableEngine(artifacts, device, **kwargs)


__all__ = ["ENGINES", "Engine", "make_engine", "native_available", "resolve"]
