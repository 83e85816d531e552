"""The engine interface: what a :class:`~onnxmp.training.run.trainer.Trainer` asks of a runtime.

An engine holds the runtime state (parameters, accumulated gradients, optimizer state and
its step count) and runs the three graphs; the Trainer holds the loop (loss scaling decisions,
accumulation counts, data-parallel collectives, counters, saving).  Both engines give the
same step for step:

* :meth:`Engine.train` runs one micro-batch through the training graph, which scales the
  loss, unscales the gradients, checks them (``all_finite``) and adds them, weighted by
  ``grad_weight``, to the accumulation buffers (overwriting them on the first micro-batch
  after :meth:`Engine.reset_grad`, which is lazy as onnxruntime's);
* :meth:`Engine.step` applies one optimizer update from the accumulated gradients; a
  skipped update is simply not asked for, so weights, moments and the step count stay
  bit-identical;
* :meth:`Engine.save` writes the engine's state into a state folder being built, and an
  engine made on a saved folder continues from it.
"""
from __future__ import annotations

import abc
from pathlib import Path
from typing import Mapping

import numpy as np

from onnxmp import runtime
from onnxmp.errors import OnnxMPError
from onnxmp.targets import CPU, TARGETS
from onnxmp.training.artifacts import Artifacts


class Engine(abc.ABC):
    """One runtime for the training, eval and optimizer graphs of an :class:`Artifacts` folder."""

    name: str = ""

    def __init__(self, artifacts: Artifacts, device: str, *, threads: int = 0,
                 clip_global_norm: float | None = None):
        self.artifacts = artifacts
        self.device = device
        self.requires_grad: list[str] = list(artifacts.manifest["requires_grad"])

    # --- graphs ---------------------------------------------------------------------------

    @abc.abstractmethod
    def train(self, feeds: Mapping[str, np.ndarray]) -> tuple[float, bool]:
        """One micro-batch; ``feeds`` hold the batch, ``loss_scale`` and ``grad_weight``.
        Returns the unscaled loss and ``all_finite``; gradients accumulate on the device."""

    @abc.abstractmethod
    def evaluate(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The eval graph's outputs, by name."""

    @abc.abstractmethod
    def step(self) -> None:
        """One optimizer update from the accumulated gradients."""

    @abc.abstractmethod
    def reset_grad(self) -> None:
        """The next :meth:`train` overwrites the accumulation buffers instead of adding to them."""

    # --- state ----------------------------------------------------------------------------

    # Both engines step with one Update (update.py), which holds the learning rate.
    @property
    def learning_rate(self) -> float:
        return self._update.lr

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        # The optimizer graph reads it as float32.
        self._update.lr = float(np.float32(value))

    @abc.abstractmethod
    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the float32 parameters (trainable and frozen), by name."""

    @abc.abstractmethod
    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters (rank 0's, broadcast to a data-parallel rank)."""

    @abc.abstractmethod
    def gradients(self) -> dict[str, np.ndarray]:
        """Copies of the accumulation buffers of the trainable parameters that have one."""

    @abc.abstractmethod
    def gradients_ready(self) -> bool:
        """Whether every trainable parameter has an accumulation buffer yet."""

    @abc.abstractmethod
    def read_gradients(self) -> list[np.ndarray]:
        """The accumulation buffers in ``requires_grad`` order (for an all-reduce)."""

    @abc.abstractmethod
    def write_gradients(self, values: list[np.ndarray]) -> None:
        """Overwrite the accumulation buffers (``requires_grad`` order), before :meth:`step`."""

    def state_dict(self) -> dict[str, dict[str, np.ndarray]]:
        """The engine's state as arrays: the parameters and the optimizer's slots and step count."""
        return {"parameters": self.parameters(), "optimizer": self._update.state_dict()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        self.set_parameters(state["parameters"])
        self._update.load_state_dict(state["optimizer"])

    @abc.abstractmethod
    def save(self, folder: Path) -> dict:
        """Write the engine's state into ``folder`` (a state folder being built, the artifacts'
        files already there); returns the manifest's ``state`` entries it adds."""


def check_device(device: str, artifacts: Artifacts, provider_hint: str) -> str:
    chosen, built_for = runtime.check_device(device, provider_hint), TARGETS.get(artifacts.target, CPU)
    if chosen.emulated and not built_for.emulated and artifacts.precision != "float32":
        raise OnnxMPError(f"these {artifacts.precision} artifacts hold real low-precision ops, "
                          "which the ORT CPU EP cannot run",
                          "build the artifacts with target='cpu' (emulated) to train on the CPU")
    return device


def placement(device: str) -> tuple[tuple[str, int], list]:
    """Where OrtValues of ``device`` live (``OrtValue``'s device type and id) and the providers
    of a session on it."""
    return runtime.placement(device), runtime.providers(device)


def session_options(artifacts: Artifacts, threads: int = 0):
    # Deterministic kernels where ORT has a choice (CUDA); on the CPU the nondeterministic
    # gradient kernels (GatherGrad, InplaceClipGradNorm) are kept out of the graphs instead.
    emulated = TARGETS.get(artifacts.target, CPU).emulated and artifacts.precision != "float32"
    return runtime.session_options(threads=threads, quiet=False, emulated=emulated, deterministic=True)
