"""A trainer's state folder: the artifacts, the engine's state and the loop's, written whole; and
the trained model exported for inference.

A state folder is an artifacts folder whose manifest has a ``state`` entry: the engine that
saved it, ``trainer_state.json`` (loss scaler, counters, settings: JSON keeps every float
exact) and the engine's own files.  Both engines write the trained parameters into
``parameters.npz``; the optimizer state is the engine's: onnxruntime's checkpoint for the
native engine, ``optimizer_state.npz`` for the portable one, so a state continues on the
engine that saved it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from onnxmp.errors import OnnxMPError
from onnxmp.training.artifacts import Artifacts, check_replaceable
from onnxmp.training.contract import MANIFEST
from onnxmp.training.run.engines.base import Engine
from onnxmp.training.run.loss_scaler import DynamicLossScaler
from onnxmp.training.run.schedules import Schedule

log = logging.getLogger("onnxmp.training")

TRAINER_STATE = "trainer_state.json"


def save(path: str | os.PathLike, artifacts: Artifacts, engine: Engine, trainer_state: Mapping[str, Any]) -> Path:
    """A state folder at ``path``: ``artifacts``' files, ``engine``'s state (:meth:`Engine.save`) and
    ``trainer_state`` (:meth:`Trainer.state_dict`) in ``trainer_state.json``, written whole."""
    from onnxmp.files import atomic_directory, atomic_write, destination, guard_outputs, write_text_atomic

    path = Path(path)
    check_replaceable(path)
    guard_outputs({"state folder": path}, folders=["state folder"])
    manifest = {k: v for k, v in artifacts.manifest.items() if k != "state"}
    sources = [artifacts.path(kind) for kind in manifest["files"]]
    if artifacts.has_portable:
        sources += [artifacts.portable_path(kind) for kind in manifest["portable"]["files"]]
    # Built beside ``path`` and renamed into place whole; resuming and saving into the same
    # folder works, as its files are copied before it is replaced.
    with atomic_directory(path) as folder:
        for source in sources:
            atomic_write(folder / source.name, lambda tmp, source=source: shutil.copyfile(source, tmp))
        entries = engine.save(folder)
        write_text_atomic(folder / TRAINER_STATE, json.dumps(dict(trainer_state), indent=2) + "\n")
        manifest["state"] = {"engine": engine.name, "trainer": TRAINER_STATE, **entries}
        write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    log.info("saved trainer state (%d updates, epoch %d) to %s", trainer_state["optimizer_steps"],
             trainer_state["epoch"], destination(path))
    return path


def resume_settings(path: str | os.PathLike, lr_schedule: Callable[[int], float] | None, communicator,
                    overrides: Mapping[str, Any]) -> tuple[Artifacts, dict, dict]:
    """The artifacts of a saved state, its saved loop state and the Trainer's settings."""
    artifacts = Artifacts.load(path)
    entry = artifacts.manifest.get("state")
    if not entry:
        raise OnnxMPError(f"{path} holds artifacts but no saved training state",
                          "resume from a folder written by Trainer.save (or `onnxmp train --out`)")
    try:
        saved = json.loads((artifacts.directory / entry["trainer"]).read_text())
    except (OSError, ValueError) as exc:
        raise OnnxMPError(f"cannot read the training state in {path}: {exc}", "resume from another saved state") \
            from None
    if saved.get("lr_schedule") and lr_schedule is None:
        raise OnnxMPError(f"{path} was trained with an lr_schedule, which a saved state cannot hold",
                          "pass the same lr_schedule to Trainer.resume (it is called with the update count, "
                          "so the schedule continues where it stopped)")
    scaler = DynamicLossScaler.from_state_dict(saved["scaler"])
    world = 1 if communicator is None else communicator.size
    saved_world = saved.get("world_size", 1)
    per_rank = saved["grad_accum_steps"]
    if world != saved_world and "grad_accum_steps" not in overrides:
        effective = per_rank * saved_world
        if effective % world:
            raise OnnxMPError(f"{path} was trained on {saved_world} rank(s) with {per_rank} micro-batch(es) "
                              f"each, an effective batch of {effective} micro-batches, which {world} ranks "
                              "cannot split evenly",
                              f"resume on a number of ranks dividing {effective}, or pass grad_accum_steps "
                              "to change the effective batch")
        per_rank = effective // world
        log.info("resuming a %d-rank run on %d rank(s): %d micro-batch(es) per rank keep the effective "
                 "batch of %d", saved_world, world, per_rank, effective)
    settings = {"scaler": scaler, "grad_accum_steps": per_rank,
                "clip_global_norm": saved["clip_global_norm"], "lr": saved["learning_rate"]}
    if saved.get("schedule") and lr_schedule is None:
        settings["schedule"] = Schedule.from_dict(saved["schedule"])
        settings["base_lr"] = float(saved["base_learning_rate"])
    settings.update(overrides)
    return artifacts, saved, settings


def export_inference(artifacts: Artifacts, trained: Mapping[str, np.ndarray], path: str | os.PathLike,
                     precision: str = "float16", *, target: str = "cuda") -> Path:
    """The original forward model with the trained weights, converted by ``onnxmp.convert``
    unless ``precision="float32"``."""
    from onnxmp.load import load
    from onnxmp.save import save as save_model

    model = load(artifacts.path("forward_model"))

    def refill(tensor: onnx.TensorProto, values: np.ndarray) -> None:  # keeps its name and dtype
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
        tensor.CopyFrom(numpy_helper.from_array(values.astype(dtype), tensor.name))

    for init in model.graph.initializer:
        if init.name in trained:
            refill(init, trained[init.name])
    for node in model.graph.node:  # weights the exporter wrote as Constant nodes
        if node.op_type == "Constant" and node.output[0] in trained:
            for attr in node.attribute:
                if attr.name == "value":
                    refill(attr.t, trained[node.output[0]])
    if precision != "float32":
        import onnxmp

        convert = getattr(onnxmp, "convert", None)
        if convert is None:
            raise OnnxMPError(f"exporting {precision} needs onnxmp.convert, which this onnxmp build lacks",
                              "export precision='float32'")
        model = convert(model, target=target, precision=precision, keep_io_types=True).model
    return save_model(model, path)
