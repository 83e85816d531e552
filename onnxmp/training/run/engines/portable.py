"""The portable engine: plain ``onnxruntime.InferenceSession`` (CPU or CUDA EP, any onnxruntime
>= 1.19, Python 3.10-3.13), on the artifacts' portable graphs (:mod:`onnxmp.training.contract`).

Parameters, accumulation buffers and optimizer state live on the device as OrtValues for the
whole run.  Each graph run binds them as inputs through I/O binding and writes their next values
into a second set of OrtValues on the same device (an output may not alias an input of the same
run), and the two sets swap afterwards: no state crosses to the host.  Only ``loss`` and
``all_finite`` are bound to the CPU.  The state's bindings are made once per pairing of the two
sets (at most four) and kept: a step rebinds only the batch and the reset flag.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import numpy as np

from onnxmp import runtime
from onnxmp.training.artifacts import Artifacts, write_parameters
from onnxmp.training.run.engines.base import Engine, check_device, placement, session_options
from onnxmp.training.run.engines.update import Update
from onnxmp.training.contract import ALL_FINITE, LAZY_RESET_GRAD, LOSS, accumulation_buffer

log = logging.getLogger("onnxmp.training")

_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(bool)": np.bool_}


class PortableEngine(Engine):
    name = "portable"

    def __init__(self, artifacts: Artifacts, device: str, *, threads: int = 0,
                 clip_global_norm: float | None = None):
        super().__init__(artifacts, device, threads=threads, clip_global_norm=clip_global_norm)
        check_device(device, artifacts, "install onnxruntime-gpu (pip install onnxmp[gpu]) or train on the cpu")
        self._where, providers = placement(device)
        manifest = artifacts.manifest
        pairs = manifest["portable"]["state_pairs"] if artifacts.has_portable else {}
        self._grad_pairs: dict[str, str] = pairs.get("training_model", {})
        options = session_options(artifacts, threads)
        self._train_session, self._eval_session = (
            runtime.session(artifacts.portable_path(graph), what=f"portable graphs in {artifacts.directory}",
                            device=device, options=options, hint="rebuild the artifacts with this onnxmp version")
            for graph in ("training_model", "eval_model"))
        self._train_inputs = [i.name for i in self._train_session.get_inputs()]
        self._train_outputs = [o.name for o in self._train_session.get_outputs()]
        # loss and all_finite land in host buffers made once where their shapes are static (the
        # contract's scalars), read without fetching every bound output each step
        self._host_outputs = {o.name: runtime.ort().OrtValue.ortvalue_from_shape_and_type(o.shape, _NUMPY[o.type], "cpu", 0)
                              for o in self._train_session.get_outputs()
                              if o.name in (LOSS, ALL_FINITE) and o.type in _NUMPY
                              and all(isinstance(d, int) for d in o.shape)}
        self._eval_inputs = [i.name for i in self._eval_session.get_inputs()]
        self._eval_outputs = [o.name for o in self._eval_session.get_outputs()]

        initial = artifacts.parameters()
        self._update = Update(artifacts, self.requires_grad,
                              {p: initial[p].shape for p in self.requires_grad}, self._where, options, providers,
                              clip_global_norm)
        self._update.restore(artifacts)
        self._params = {name: runtime.to_ortvalue(value, self._where) for name, value in initial.items()}
        self._grads = {p: runtime.to_ortvalue(np.zeros(initial[p].shape, dtype=np.float32), self._where)
                       for p in self.requires_grad}
        self._reset = True
        # The second set of state buffers, each run's outputs; made at first use.
        self._spare_grads: dict | None = None
        self._spare_params: dict | None = None
        # training bindings with the state bound, by which of the two sets is current (_bound_state)
        self._bindings: dict[tuple[int, int], object] = {}
        self._batch_inputs: list[str] | None = None  # the training inputs bound per step, in order

    # --- graphs ---------------------------------------------------------------------------

    def _bound_state(self):
        """The training binding with the current parameters, buffers and next buffers bound (the
        batch and the flag are bound per step): the two sets swap, so one binding per pairing."""
        if self._spare_grads is None:
            self._spare_grads = {p: runtime.empty_like(v, self._where) for p, v in self._grads.items()}
        first = self.requires_grad[0]
        key = (id(self._params[first]), id(self._grads[first]))
        if key in self._bindings:
            return self._bindings[key]
        binding = self._train_session.io_binding()
        buffers = {accumulation_buffer(p): p for p in self.requires_grad}
        for name in self._train_inputs:
            if name in self._params:
                binding.bind_ortvalue_input(name, self._params[name])
            elif name in buffers:
                binding.bind_ortvalue_input(name, self._grads[buffers[name]])
        outputs = {out: buffers[into] for into, out in self._grad_pairs.items()}
        for name in self._train_outputs:
            if name in outputs:
                binding.bind_ortvalue_output(name, self._spare_grads[outputs[name]])
            elif name in self._host_outputs:
                binding.bind_ortvalue_output(name, self._host_outputs[name])
            elif name in (LOSS, ALL_FINITE):
                binding.bind_output(name, "cpu")
            else:  # loss_scaled: nobody reads it, it stays where it was computed
                binding.bind_output(name, *self._where)
        self._bindings[key] = binding
        return binding

    def train(self, feeds: Mapping[str, np.ndarray]) -> tuple[float, bool]:
        binding = self._bound_state()
        if self._batch_inputs is None:
            state = set(self._params) | {accumulation_buffer(p) for p in self.requires_grad}
            self._batch_inputs = [name for name in self._train_inputs if name not in state]
        for name in self._batch_inputs:
            if name == LAZY_RESET_GRAD:
                binding.bind_cpu_input(name, np.array([self._reset]))
            else:
                binding.bind_cpu_input(name, feeds[name])
        self._train_session.run_with_iobinding(binding)
        if len(self._host_outputs) == 2:
            values = {name: value.numpy() for name, value in self._host_outputs.items()}
        else:
            produced = binding.get_outputs()  # in binding order: self._train_outputs'
            values = {name: produced[i].numpy() for i, name in enumerate(self._train_outputs)
                      if name in (LOSS, ALL_FINITE)}
        self._grads, self._spare_grads = self._spare_grads, self._grads
        self._reset = False
        return float(values[LOSS]), bool(values[ALL_FINITE])

    def evaluate(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        binding = self._eval_session.io_binding()
        for name in self._eval_inputs:
            if name in self._params:
                binding.bind_ortvalue_input(name, self._params[name])
            else:
                binding.bind_cpu_input(name, feeds[name])
        for name in self._eval_outputs:
            binding.bind_output(name, "cpu")
        self._eval_session.run_with_iobinding(binding)
        return dict(zip(self._eval_outputs, binding.copy_outputs_to_cpu()))

    def step(self) -> None:
        if self._spare_params is None:
            self._spare_params = {p: runtime.empty_like(self._params[p], self._where) for p in self.requires_grad}
        self._update.run(self._params, self._grads, self._spare_params, stable=True)
        for p in self.requires_grad:
            self._params[p], self._spare_params[p] = self._spare_params[p], self._params[p]

    def reset_grad(self) -> None:
        self._reset = True

    # --- state ----------------------------------------------------------------------------

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: value.numpy().copy() for name, value in self._params.items()}

    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        for name, value in values.items():
            self._params[name].update_inplace(np.asarray(value, dtype=np.float32, order="C"))

    def gradients(self) -> dict[str, np.ndarray]:
        return {p: self._grads[p].numpy().copy() for p in self.requires_grad}

    def gradients_ready(self) -> bool:
        return True  # the buffers exist from the start, zeros

    def read_gradients(self) -> list[np.ndarray]:
        return [self._grads[p].numpy() for p in self.requires_grad]

    def write_gradients(self, values: list[np.ndarray]) -> None:
        for p, value in zip(self.requires_grad, values):
            value = np.asarray(value, dtype=np.float32, order="C")
            self._grads[p].update_inplace(value.reshape(self._grads[p].shape()))

    def save(self, folder: Path) -> dict:
        write_parameters(folder / self.artifacts.manifest["files"]["parameters"], self.parameters())
        return self._update.save(folder)
