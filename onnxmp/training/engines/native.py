"""The native engine: onnxruntime-training 1.19.2's Module/Optimizer API (Python <= 3.11).

It runs the artifacts' training graphs as built (InPlaceAccumulatorV2, AdamWOptimizer...),
with ORT's CheckpointState holding parameters, gradients and optimizer state.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx

from onnxmp.errors import OnnxMPError, first_line
from onnxmp.training import _ort
from onnxmp.training.artifacts import Artifacts, write_parameters
from onnxmp.training.engines.base import Engine, check_device, session_options
from onnxmp.training.loss_scale import ALL_FINITE, LOSS
from onnxmp.training.optimizer import build_optimizer_model

log = logging.getLogger("onnxmp.training")


class NativeEngine(Engine):
    name = "native"

    def __init__(self, artifacts: Artifacts, device: str, *, threads: int = 0,
                 clip_global_norm: float | None = None):
        super().__init__(artifacts, device, threads=threads, clip_global_norm=clip_global_norm)
        api = _ort.api()
        check_device(device, artifacts, "install onnxruntime-training==1.19.2 (CUDA 11.8), train on the cpu, "
                                        "or use engine='portable' with onnxruntime-gpu")
        try:
            self._state = api.CheckpointState.load_checkpoint(str(artifacts.checkpoint))
            self._module = api.Module(str(artifacts.training_model), self._state, str(artifacts.eval_model),
                                      device=device, session_options=session_options(artifacts, threads))
            self._optimizer = self._make_optimizer(api, clip_global_norm)
        except OnnxMPError:
            raise
        except Exception as exc:
            raise OnnxMPError(f"onnxruntime cannot load the artifacts in {artifacts.directory}: "
                              f"{first_line(exc)}", "rebuild them with this onnxmp version") from None
        self._train_inputs = self._module.train().input_names()
        self._train_outputs = self._module.output_names()
        self._eval_inputs = self._module.eval().input_names()
        self._eval_outputs = self._module.output_names()
        self._module.train()

    def _make_optimizer(self, api, clip_global_norm):
        # SGDOptimizerV2's schema infers a scalar flag where onnxblock declares [1]; ORT
        # warns about that harmless mismatch on every load, so its log goes to debug.
        if clip_global_norm is None:
            with _ort.native_stderr_to_log(log):
                return api.Optimizer(str(self.artifacts.optimizer_model), self._module)
        model = build_optimizer_model(self.artifacts.optimizer_name, opset=self.artifacts.manifest["opset"],
                                      clip_global_norm=clip_global_norm, parameters=len(self.requires_grad))
        # ORT reads the optimizer model once, at construction.
        with tempfile.TemporaryDirectory(prefix="onnxmp-optimizer-") as folder:
            path = Path(folder) / "optimizer_model.onnx"
            onnx.save(model, path)
            with _ort.native_stderr_to_log(log):
                return api.Optimizer(str(path), self._module)

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
        self._optimizer.step()

    def reset_grad(self) -> None:
        self._module.lazy_reset_grad()

    # --- state ----------------------------------------------------------------------------

    @property
    def learning_rate(self) -> float:
        return self._optimizer.get_learning_rate()

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self._optimizer.set_learning_rate(float(value))

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
            g.update_inplace(np.ascontiguousarray(value.reshape(g.shape())))

    def save(self, folder: Path) -> dict:
        files = self.artifacts.manifest["files"]
        _ort.api().CheckpointState.save_checkpoint(self._state, str(folder / files["checkpoint"]),
                                                   include_optimizer_state=True)
        # The trained weights in the portable format too: exportable and readable anywhere
        # (the optimizer moments stay in ORT's checkpoint only).
        write_parameters(folder / files["parameters"], self.parameters())
        return {}
