"""The optimizer update both engines run: the artifacts' portable optimizer graph (torch's
AdamW / SGD in standard ops, :func:`onnxmp.training.update_graph.build_portable_optimizer`) on a
plain ``InferenceSession``.

One home for the update, so the native and the portable engine step with the same algorithm
and differ only in the training graph's kernels (onnxruntime-training's gradient ops against
their lowered form).  The update's state (the slots, the step count) lives here as OrtValues
on the device; the engine lends the parameters and the accumulated gradients, and the buffers
the new parameters are written into (an output may not alias an input of the same run).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from onnxmp import runtime
from onnxmp.errors import OnnxMPError
from onnxmp.training.artifacts import Artifacts, read_parameters, write_parameters
from onnxmp.training.contract import LEARNING_RATE, STEP, grad_input, optimizer_slots, slot_input, updated
from onnxmp.training.update_graph import build_portable_optimizer

OPTIMIZER_STATE = "optimizer_state.npz"
_STEP = "onnxmp.optimizer.step"  # the update count, beside the slots in OPTIMIZER_STATE
_REBUILD = "rebuild the artifacts with this onnxmp version"


def default_learning_rate(artifacts: Artifacts) -> float:
    """The lr the artifacts' optimizer was given (torch's default, 1e-3, where none is recorded)."""
    hyper = artifacts.manifest.get("optimizer", {}).get("hyperparameters", {})
    return float(np.float32(hyper.get("lr", 1e-3)))


def optimizer_model(artifacts: Artifacts, requires_grad: Sequence[str], shapes: Mapping[str, Sequence[int]],
                    clip_global_norm: float | None):
    """The optimizer graph: the artifacts' file, or one rebuilt from the manifest's entry when a
    clip is asked for (a constant in the graph) or the folder has no portable graphs."""
    if clip_global_norm is None and artifacts.has_portable:
        return str(artifacts.portable_path("optimizer_model"))
    entry = artifacts.manifest.get("optimizer")
    if not isinstance(entry, dict):
        raise OnnxMPError(f"the manifest in {artifacts.directory} records no optimizer entry", _REBUILD)
    kwargs = {} if clip_global_norm is None else {"clip_global_norm": float(clip_global_norm)}
    model = build_portable_optimizer(entry, [(p, list(shapes[p])) for p in requires_grad],
                                     artifacts.manifest["opset"], **kwargs)
    return model.SerializeToString()


class Update:
    """torch's optimizer over ``requires_grad``, with its slots and step count on ``where``."""

    def __init__(self, artifacts: Artifacts, requires_grad: Sequence[str],
                 shapes: Mapping[str, Sequence[int]], where: tuple[str, int], options, providers,
                 clip_global_norm: float | None = None):
        self._where = where
        self.requires_grad = list(requires_grad)
        self._session = runtime.session(optimizer_model(artifacts, requires_grad, shapes, clip_global_norm),
                                        what=f"optimizer graph of {artifacts.directory}", options=options,
                                        provider_list=providers, hint=_REBUILD)
        self._inputs = [i.name for i in self._session.get_inputs()]
        self._outputs = [o.name for o in self._session.get_outputs()]
        self.slots = optimizer_slots(self._inputs, self.requires_grad)
        zeros = {p: np.zeros(shapes[p], dtype=np.float32) for p in self.requires_grad}
        self._state = {slot_input(p, slot): runtime.to_ortvalue(zeros[p], where)
                       for p in self.requires_grad for slot in self.slots}
        self._spare: dict | None = None
        # io bindings by the identities of the state they bind, for callers whose OrtValues are
        # only ever swapped or written in place (run's ``stable``)
        self._bindings: dict[tuple, tuple] = {}
        self.step = 0  # applied updates
        self.lr = default_learning_rate(artifacts)

    def empty_like(self, ortvalue):
        return runtime.empty_like(ortvalue, self._where)

    def run(self, params: Mapping[str, object], grads: Mapping[str, object], into: Mapping[str, object],
            *, stable: bool = False) -> None:
        """One update: reads ``params`` and ``grads`` (OrtValues by parameter name), writes the new
        parameters into ``into`` and advances the slots and the step count.  ``stable``: the caller
        passes the same few OrtValues every step (swapped, or written in place), so the binding of
        each pairing is kept (:meth:`_bound`); otherwise it is made anew."""
        if self._spare is None:
            self._spare = {k: self.empty_like(v) for k, v in self._state.items()}
        binding = self._bound(params, grads, into, keep=stable)
        # the two scalars change every step; rebinding a name replaces its value
        if LEARNING_RATE in self._inputs:
            binding.bind_cpu_input(LEARNING_RATE, np.array(self.lr, dtype=np.float32))
        if STEP in self._inputs:
            binding.bind_cpu_input(STEP, np.array(self.step + 1, dtype=np.int64))
        self._session.run_with_iobinding(binding)
        self._state, self._spare = self._spare, self._state
        self.step += 1

    def _bound(self, params: Mapping[str, object], grads: Mapping[str, object], into: Mapping[str, object],
               keep: bool):
        """The binding of the state OrtValues for this pairing of the parameter, gradient and slot
        sets.  Each set swaps with its spare every step, so a run sees at most a few pairings;
        binding every input and output anew (several per parameter) cost about as much Python time
        as the optimizer graph's run on a small model.  The learning rate and step are bound per run."""
        first = self.requires_grad[0]
        slot = next(iter(self._state), None)
        which = (params[first], grads[first], into[first], *((self._state[slot], self._spare[slot]) if slot else ()))
        key = tuple(map(id, which))
        if key in self._bindings:
            return self._bindings[key][0]
        binding = self._session.io_binding()
        grad_of = {grad_input(p): p for p in grads}
        for name in self._inputs:
            if name in (LEARNING_RATE, STEP):
                continue  # bound by run()
            elif name in params:
                binding.bind_ortvalue_input(name, params[name])
            elif name in grad_of:
                binding.bind_ortvalue_input(name, grads[grad_of[name]])
            elif name in self._state:
                binding.bind_ortvalue_input(name, self._state[name])
            else:
                raise OnnxMPError(f"the optimizer graph has an unknown input {name!r}", _REBUILD)
        for name in self._outputs:
            source = updated(name)
            if source in into:
                binding.bind_ortvalue_output(name, into[source])
            elif source in self._spare:
                binding.bind_ortvalue_output(name, self._spare[source])
            else:
                raise OnnxMPError(f"the optimizer graph has an unknown output {name!r}", _REBUILD)
        if keep:
            self._bindings[key] = (binding, which)  # holding ``which`` keeps its ids from being reused
        return binding

    def state_dict(self) -> dict[str, np.ndarray]:
        """The slots (``P.<slot>``) and the update count, as arrays."""
        state = {name: value.numpy().copy() for name, value in self._state.items()}
        state[_STEP] = np.array(self.step, dtype=np.int64)
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray], where: str = "the state") -> None:
        missing = sorted(set(self._state) - set(state))
        if missing or _STEP not in state:
            raise OnnxMPError(f"{where} lacks the optimizer state {', '.join(missing[:5]) or _STEP}",
                              "resume from a folder onnxmp saved with these artifacts")
        for name, value in self._state.items():
            value.update_inplace(np.asarray(state[name], dtype=np.float32, order="C"))
        self.step = int(state[_STEP])

    def save(self, folder: Path) -> dict:
        write_parameters(folder / OPTIMIZER_STATE, self.state_dict())
        return {"optimizer_state": OPTIMIZER_STATE}

    def restore(self, artifacts: Artifacts) -> None:
        """Continue from the optimizer state a saved folder holds (nothing to do in a fresh one)."""
        saved_name = artifacts.manifest.get("state", {}).get("optimizer_state")
        if saved_name:
            path = artifacts.directory / saved_name
            self.load_state_dict(read_parameters(path), str(path))
