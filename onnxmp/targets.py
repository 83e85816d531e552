"""The targets onnxmp converts, validates and trains for: one table.

A target names an onnxruntime execution provider.  Adding one is one entry here (plus its
kernels in ``onnxmp/data/ort_kernels.json``): the CLI choices, the kernel lookups, the
validation sessions and training all read this table.
"""
from __future__ import annotations

from dataclasses import dataclass

from onnxmp.errors import OnnxMPError


@dataclass(frozen=True)
class Target:
    name: str          # the API and CLI spelling: target="cuda", --target cuda
    provider: str      # the onnxruntime execution provider
    emulated: bool     # low-precision compute is emulated on it (no float16 compute kernels to speak of)


CUDA = Target("cuda", "CUDAExecutionProvider", emulated=False)
CPU = Target("cpu", "CPUExecutionProvider", emulated=True)

TARGETS: dict[str, Target] = {t.name: t for t in (CUDA, CPU)}
NAMES = tuple(TARGETS)  # the choices of --target / target= and --provider / provider=


def target(name: str, what: str = "target") -> Target:
    """The target called ``name``; a clear error for anything else."""
    try:
        return TARGETS[name]
    except KeyError:
        raise OnnxMPError(f"unknown {what} {name!r}", hint=f"choose one of: {', '.join(NAMES)}") from None


def provider(name: str) -> str:
    """The onnxruntime execution provider of target ``name``, or ``name`` itself when it already
    names a provider of the table (``CUDAExecutionProvider``)."""
    for t in TARGETS.values():
        if name in (t.name, t.provider) or name.lower() == t.name:
            return t.provider
    raise OnnxMPError(f"unknown execution provider {name!r}",
                      hint=f"use one of: {', '.join(sorted([*NAMES, *(t.provider for t in TARGETS.values())]))}")
