"""The native engine: onnxruntime-training 1.19.2's Module API (Python <= 3.11).

It runs the artifacts' training and eval graphs as built (InPlaceAccumulatorV2, the gradient
ops...), with ORT's CheckpointState holding parameters and gradients.  Its update is the
portable engine's (:mod:`onnxmp.training.run.engines.update`: torch's AdamW / SGD in standard ops,
on an ``InferenceSession`` over the Module's own gradient and parameter buffers), not
onnxruntime's AdamWOptimizer, whose formula is Hugging Face's: the two engines then differ
only in the training graph's kernels, and the native one is the lowering's oracle.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import numpy as np

from onnxmp import runtime
from onnxmp.training import _ort
from onnxmp.training.artifacts import Artifacts, write_parameters
from onnxmp.training.run.engines.base import Engine, check_device, placement, session_options
from onnxmp.training.run.engines.update import Update
from onnxmp.training.contract import ALL_FINITE, LOSS

log = logging.getLogger("onnxmp.training")


class NativeEngine(Engine):
    name = "native"

    def __init__(self, artifacts: Artifacts, device: str, *, threads: int = 0,
                 clip_global_norm: float | None = None):
        super().__init__(artifacts, device, threads=threads, clip_global_norm=clip_global_norm)
        api = _ort.api()
        check_device(device, artifacts, "install onnxruntime-training==1.19.2 (CUDA 11.8), train on the cpu, "
                                        "or use engine='portable' with onnxruntime-gpu")
        self._ort = runtime.ort()
        where, providers = placement(device)
        options = session_options(artifacts, threads)
        try:
            self._state = api.CheckpointState.load_checkpoint(str(artifacts.checkpoint))
            self._module = api.Module(str(artifacts.training_model), self._state, str(artifacts.eval_model),
                                      device=device, session_options=options)
        except Exception as exc:  # noqa: BLE001 (onnxruntime's exceptions share no public base class)
            raise runtime.translate(exc, f"artifacts in {artifacts.directory}",
                                    hint="rebuild them with this onnxmp version") from None
        shapes = {p: tuple(self._state.parameters[p]._parameter.data.shape()) for p in self.requires_grad}
        self._update = Update(artifacts, self.requires_grad, shapes, where, options, providers, clip_global_norm)
        self._update.restore(artifacts)
        self._new: dict | None = None  # the buffers each update writes the parameters into
        self._train_inputs = self._module.train().input_names()
        self._train_outputs = self._module.output_names()
        self._eval_inputs = self._module.eval().input_names()
        self._eval_outputs = self._module.output_names()
        self._module.train()

    # --- graphs ---------------------------------------------------------------------------

    def train(self, feeds: Mapping[str, np.ndarray]) -> tuple[float, bool]:
        outputs = self._module(*[feeds[name] for name in self._train_inputs])
        named = dict(zip(self._train_outputs, outputs if isinstance(outputs, tuple) else (outputs,)))
        return float(named[LOSS]), bool(named[ALL_FINITE])

    def evaluate(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._module.eval()
        try:
            outputs = self._module(*[feeds[name] for name in self._eval_inputs])
        finally:
            self._module.train()
        return dict(zip(self._eval_outputs, outputs if isinstance(outputs, tuple) else (outputs,)))

    def step(self) -> None:
        wrap = self._ort.OrtValue
        params = {p: self._state.parameters[p]._parameter for p in self.requires_grad}
        if self._new is None:
            self._new = {p: self._update.empty_like(wrap(param.data)) for p, param in params.items()}
        # The Module's own buffers, bound without a copy; ORT keeps a parameter's memory where it
        # is, so the new values are copied into it (the training graph reads it there).
        self._update.run({p: wrap(param.data) for p, param in params.items()},
                         {p: wrap(param.grad) for p, param in params.items()}, self._new)
        for p, param in params.items():
            param.copy_from(self._state._state, self._new[p]._ortvalue)

    def reset_grad(self) -> None:
        self._module.lazy_reset_grad()

    # --- state ----------------------------------------------------------------------------

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: np.array(param.data, copy=True) for name, param in self._state.parameters}

    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        for name, value in values.items():
            self._state.parameters[name].data = np.asarray(value)

    def gradients(self) -> dict[str, np.ndarray]:
        return {name: np.array(param.grad, copy=True) for name, param in self._state.parameters
                if param.requires_grad and param.grad is not None}

    def _grads(self):
        return [self._state.parameters[name]._parameter.grad for name in self.requires_grad]

    def gradients_ready(self) -> bool:
        return all(g.has_value() for g in self._grads())

    def read_gradients(self) -> list[np.ndarray]:
        return [g.numpy() for g in self._grads()]

    def write_gradients(self, values: list[np.ndarray]) -> None:
        for g, value in zip(self._grads(), values):
            g.update_inplace(np.asarray(value.reshape(g.shape()), order="C"))

    def save(self, folder: Path) -> dict:
        files = self.artifacts.manifest["files"]
        _ort.api().CheckpointState.save_checkpoint(self._state, str(folder / files["checkpoint"]))
        # The trained weights in the portable format too: exportable and readable anywhere.
        write_parameters(folder / files["parameters"], self.parameters())
        return self._update.save(folder)
