"""Write torch.optim's reference trajectories for tests/training/test_training_optimizers.py.

torch is not an onnxmp dependency: run this with a Python that has torch (CPU), e.g.

    /work/scratch/torchenv/bin/python scripts/make_optimizer_references.py

It writes ``tests/training/data/optimizer_references.npz`` (``CASE/init/PARAM``, the initial
parameter; ``CASE/grad/PARAM``, the gradients fed, one row per step; ``CASE/param/PARAM`` and
``CASE/SLOT/PARAM``, torch's parameter and state after each step) and ``optimizer_references.json`` (each
case's onnxmp optimizer arguments, the learning rate of each step, the clip norm, the torch version).
Gradients are random (seeded): an optimizer is a function of the gradients, whatever made them.
Learning rates are float32 values, the ones onnxmp's graph takes as its float32 ``learning_rate``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

STEPS = 12
SHAPES = {"layer.weight": (4, 3), "layer.bias": (3,), "scale": (), "LayerNorm.weight": (5,)}
NO_DECAY = ["bias", "LayerNorm.weight"]

# name -> (optimizer, onnxmp/torch keyword arguments, onnxmp-only no_decay, clip_global_norm)
CASES = {
    "adamw_defaults": ("adamw", {}, [], None),
    "adamw_no_decay": ("adamw", {"weight_decay": 0.1}, NO_DECAY, None),
    "adamw_wd0": ("adamw", {"weight_decay": 0.0, "eps": 1e-6}, [], None),
    "adamw_amsgrad": ("adamw", {"betas": (0.8, 0.99), "weight_decay": 0.05, "amsgrad": True}, ["bias"], None),
    "adamw_beta1_small": ("adamw", {"betas": (0.3, 0.9), "eps": 1e-3}, [], None),  # lerp's other branch
    "adamw_clip": ("adamw", {}, NO_DECAY, 0.5),
    "adamw_maximize": ("adamw", {"maximize": True}, [], None),
    "sgd_plain": ("sgd", {}, [], None),
    "sgd_momentum": ("sgd", {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}, [], None),
    "sgd_nesterov": ("sgd", {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05}, NO_DECAY, None),
    "sgd_clip": ("sgd", {"momentum": 0.5}, [], 1.0),
}
SLOTS = {"adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), "sgd": ("momentum_buffer",)}


def _groups(params: dict, no_decay: list[str], kwargs: dict) -> list[dict]:
    """torch's recipe for exempting parameters: a second group with weight_decay 0."""
    exempt = [p for n, p in params.items() if any(s in n for s in no_decay)]
    decayed = [p for n, p in params.items() if not any(s in n for s in no_decay)]
    groups = [{"params": decayed}] if decayed else []
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    return groups


def run_case(name: str, kind: str, kwargs: dict, no_decay: list[str], clip, rng) -> tuple[dict, dict]:
    arrays = {}
    params = {}
    for pname, shape in SHAPES.items():
        value = np.asarray(rng.normal(size=shape), np.float32)
        arrays[f"{name}/init/{pname}"] = value
        params[pname] = torch.nn.Parameter(torch.from_numpy(value.copy()))
    lrs = [float(np.float32(v)) for v in rng.uniform(0.005, 0.05, size=STEPS)]
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
    opt = cls(_groups(params, no_decay, kwargs), lr=lrs[0], foreach=False, **kwargs)
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        for pname, p in params.items():
            # a spread of magnitudes, so that clipping bites on some steps and not on others
            grad = np.asarray(rng.normal(size=SHAPES[pname]) * rng.choice([0.01, 0.3, 2.0]), np.float32)
            arrays.setdefault(f"{name}/grad/{pname}", []).append(grad)
            p.grad = torch.from_numpy(grad.copy())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip, foreach=False)
        opt.step()
        for pname, p in params.items():
            arrays.setdefault(f"{name}/param/{pname}", []).append(p.detach().numpy().copy())
            for slot in SLOTS[kind]:
                if slot in opt.state[p]:
                    arrays.setdefault(f"{name}/{slot}/{pname}", []).append(opt.state[p][slot].numpy().copy())
    arrays = {key: np.stack(value) if isinstance(value, list) else value for key, value in arrays.items()}
    config = {"optimizer": kind, "kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()},
              "no_decay": no_decay, "clip_global_norm": clip, "lrs": lrs, "steps": STEPS,
              "parameters": {k: list(v) for k, v in SHAPES.items()}}
    return arrays, config


def main() -> None:
    default = Path(__file__).resolve().parents[1] / "tests" / "training" / "data"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default)
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(20261203)
    arrays, configs = {}, {}
    for name, (kind, kwargs, no_decay, clip) in CASES.items():
        case_arrays, configs[name] = run_case(name, kind, kwargs, no_decay, clip, rng)
        arrays.update(case_arrays)
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "optimizer_references.npz", **arrays)
    meta = {"torch_version": torch.__version__, "cases": configs}
    (args.out / "optimizer_references.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{len(configs)} cases, {len(arrays)} arrays -> {args.out}")


if __name__ == "__main__":
    main()
