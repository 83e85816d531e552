"""onnxmp's optimizers against torch.optim on the same BERT, batches and settings: per-step losses.

Two Pythons: this one (onnxmp with onnxruntime-training, Python 3.11) and one with torch and
transformers (not onnxmp dependencies), given by ``--torch-python``:

    python scripts/compare_torch_optimizers.py --torch-python /work/scratch/torchenv/bin/python

The torch side rebuilds the matrix's ``bert2`` exactly as ``models/exports/export.py`` made it (same
seed, same config; the script checks the logits against ``matrix.json``) and trains it in eval mode
(the export has no dropout) with ``torch.optim``.  The onnxmp side trains
``models/exports/bert2.torchscript17.onnx`` (every parameter, float32): onnxruntime-training's
training graph gives the loss and gradients, and :func:`build_portable_optimizer`'s graph, run in a
plain ``InferenceSession``, applies the update.  Both see the same batches (``tasks.batches``) and the
same float32 learning rate.  It prints each step's two losses and their relative difference.

``--trainer ENGINE`` runs the onnxmp side through ``onnxmp.training.Trainer`` on that engine instead
(the loop users run: ``train_step`` per batch, a static loss scale of 1).  The portable engine needs
artifacts with portable graphs (the lowering of issue 28); the native engine steps with its own
optimizer model, which is onnxruntime's AdamW until it runs the portable optimizer graph too.
``--plot PNG`` draws the curves (matplotlib).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EXPORTS = ROOT / "models" / "exports"
sys.path.insert(0, str(EXPORTS))
import tasks  # noqa: E402

ENTRY = "bert2.torchscript17"
NO_DECAY = ["bias", "LayerNorm.weight"]
RUNS = {  # name -> (optimizer, keyword arguments, no_decay)
    "adamw": ("adamw", {"lr": tasks.DEFAULT_LR, "weight_decay": 0.0}, []),
    "adamw_wd": ("adamw", {"lr": tasks.DEFAULT_LR, "weight_decay": 0.1}, NO_DECAY),
    "sgd": ("sgd", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}, []),
}


def _batches(steps: int):
    entry = json.loads((EXPORTS / "matrix.json").read_text())[ENTRY]
    batches = tasks.batches(entry["arch"], entry["inputs"], steps * tasks.BATCH, seed=0)
    return entry, batches


def torch_losses(steps: int) -> dict:
    """Run with torch: the per-step losses of each run."""
    import torch

    import export  # models/exports/export.py: the matrix's builders

    entry, batches = _batches(steps)
    results = {}
    for run, (kind, kwargs, no_decay) in RUNS.items():
        torch.manual_seed(0)
        model = export.builders()[entry["arch"]]()
        model.config._attn_implementation = "eager"
        with torch.no_grad():  # as export.py perturbs the random init
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        model.eval()
        names = entry["inputs"]
        check = model(**{k: torch.from_numpy(v) for k, v in tasks.make(entry["arch"], 2, 0).items()
                         if k in names}).logits.detach().numpy()
        assert np.allclose(check, entry["check_logits"], atol=2e-5), "not the exported model"
        params = dict(model.named_parameters())
        decayed = [p for n, p in params.items() if not any(s in n for s in no_decay)]
        exempt = [p for n, p in params.items() if any(s in n for s in no_decay)]
        groups = [{"params": decayed}] + ([{"params": exempt, "weight_decay": 0.0}] if exempt else [])
        lr = float(np.float32(kwargs["lr"]))
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
        opt = cls(groups, **{**kwargs, "lr": lr}, foreach=False)
        losses = []
        for batch in batches:
            opt.zero_grad()
            logits = model(**{k: torch.from_numpy(v) for k, v in zip(names, batch)}).logits
            loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(batch[-1]))
            loss.backward()
            opt.step()
            losses.append(float(loss))
        results[run] = losses
    return results


def onnxmp_losses(steps: int, folder: Path) -> dict:
    import onnx
    import onnxruntime as ort

    from onnxmp.training import SGD, AdamW, _ort, build_artifacts
    from onnxmp.training.update_graph import build_portable_optimizer

    entry, batches = _batches(steps)
    model = onnx.load(str(EXPORTS / entry["file"]))
    names = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    api = _ort.api()
    results = {}
    for run, (kind, kwargs, no_decay) in RUNS.items():
        optimizer = (AdamW if kind == "adamw" else SGD)(**kwargs, no_decay=no_decay)
        art = build_artifacts(model, requires_grad=names, loss="cross_entropy", optimizer=optimizer,
                              precision="float32", out_dir=folder / run)
        state = api.CheckpointState.load_checkpoint(str(art.checkpoint))
        module = api.Module(str(art.training_model), state, str(art.eval_model), device="cpu")
        module.train()
        inputs = module.input_names()
        outputs = module.output_names()
        shapes = [(n, list(state.parameters[n].data.shape)) for n in names]
        session = ort.InferenceSession(build_portable_optimizer(optimizer, shapes, 17).SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        slots = {f"{n}.{s}": np.zeros(shape, np.float32) for n, shape in shapes for s in optimizer.slots}
        losses = []
        for step, batch in enumerate(batches, start=1):
            feeds = dict(zip([*entry["inputs"], art.manifest["label_input"]], batch))
            feeds.update(loss_scale=np.array(1.0, np.float32), grad_weight=np.array(1.0, np.float32))
            named = dict(zip(outputs, module(*[feeds[n] for n in inputs])))
            losses.append(float(named["loss"]))
            opt_feeds = {"learning_rate": np.array(kwargs["lr"], np.float32), "step": np.array(step, np.int64),
                         **slots}
            for n in names:
                opt_feeds[n] = state.parameters[n].data
                opt_feeds[f"{n}.grad"] = state.parameters[n].grad
            new = dict(zip([o.name for o in session.get_outputs()], session.run(None, opt_feeds)))
            for n in names:
                state.parameters[n].data = new[f"{n}.out"]
            slots = {k: new[f"{k}.out"] for k in slots}
            module.lazy_reset_grad()
        results[run] = losses
    results["adamw_native"] = _native_losses(model, names, batches, entry, folder / "native", api)
    return results


def trainer_losses(steps: int, folder: Path, engine: str) -> dict:
    """The same runs through the Trainer on ``engine``: per-step losses."""
    import onnx

    from onnxmp.errors import OnnxMPError
    from onnxmp.training import SGD, AdamW, DynamicLossScaler, Trainer, build_artifacts

    entry, batches = _batches(steps)
    model = onnx.load(str(EXPORTS / entry["file"]))
    names = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    results = {}
    for run, (kind, kwargs, no_decay) in RUNS.items():
        optimizer = (AdamW if kind == "adamw" else SGD)(**kwargs, no_decay=no_decay)
        art = build_artifacts(model, requires_grad=names, loss="cross_entropy", optimizer=optimizer,
                              precision="float32", out_dir=folder / f"trainer-{run}")
        if engine == "portable" and not art.has_portable:
            raise OnnxMPError("this onnxmp writes no portable graphs yet (the lowering of issue 28 is not merged): "
                              "the portable engine cannot run the comparison",
                              "run without --trainer (ORT's training graph + the portable optimizer graph)")
        trainer = Trainer(art, engine=engine, lr=float(np.float32(kwargs["lr"])), scaler=DynamicLossScaler.static(1.0))
        results[run] = [trainer.train_step(*batch).loss for batch in batches]
    return results


def plot(figures: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in RUNS if r in figures]
    fig, axes = plt.subplots(2, len(runs), figsize=(4.2 * len(runs), 6.4), sharex=True,
                             gridspec_kw={"height_ratios": [2, 1]})
    for col, run in enumerate(runs):
        steps = np.arange(1, len(figures[run]["torch"]) + 1)
        top, bottom = axes[0][col], axes[1][col]
        top.plot(steps, figures[run]["torch"], "o-", label="torch.optim", color="black", lw=1)
        top.plot(steps, figures[run]["onnxmp"], "x--", label="onnxmp", color="tab:blue")
        rel = np.abs(np.subtract(figures[run]["onnxmp"], figures[run]["torch"])) / np.abs(figures[run]["torch"])
        bottom.semilogy(steps, np.maximum(rel, 1e-10), "x--", color="tab:blue", label="onnxmp")
        if run == "adamw" and "adamw_native" in figures:
            top.plot(steps, figures["adamw_native"]["onnxmp"], "s:", color="tab:red", ms=3,
                     label="onnxruntime's AdamW (native engine)")
            native = np.abs(np.subtract(figures["adamw_native"]["onnxmp"], figures[run]["torch"])) \
                / np.abs(figures[run]["torch"])
            bottom.semilogy(steps, np.maximum(native, 1e-10), "s:", color="tab:red", ms=3)
        bottom.axhline(1e-4, color="grey", lw=0.8, ls="--")
        kind, kwargs, _ = RUNS[run]
        top.set_title(f"{kind} lr={kwargs['lr']:g} wd={kwargs['weight_decay']:g}"
                      + (f" mom={kwargs['momentum']:g}" if "momentum" in kwargs else ""), fontsize=9)
        top.legend(fontsize=7)
        bottom.set_xlabel("step")
        if col == 0:
            top.set_ylabel("training loss")
            bottom.set_ylabel("relative difference")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    from onnxmp.files import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


def _native_losses(model, names, batches, entry, folder: Path, api) -> list[float]:
    """For contrast: the native engine's optimizer model (onnxruntime's AdamWOptimizer, Hugging Face's
    formula, eps 1e-6) at run "adamw"'s lr and no weight decay."""
    from onnxmp.training import build_artifacts

    art = build_artifacts(model, requires_grad=names, loss="cross_entropy", optimizer="adamw",
                          precision="float32", out_dir=folder)
    state = api.CheckpointState.load_checkpoint(str(art.checkpoint))
    module = api.Module(str(art.training_model), state, str(art.eval_model), device="cpu")
    optimizer = api.Optimizer(str(art.optimizer_model), module)
    optimizer.set_learning_rate(float(np.float32(RUNS["adamw"][1]["lr"])))
    module.train()
    inputs, outputs, losses = module.input_names(), module.output_names(), []
    for batch in batches:
        feeds = dict(zip([*entry["inputs"], art.manifest["label_input"]], batch))
        feeds.update(loss_scale=np.array(1.0, np.float32), grad_weight=np.array(1.0, np.float32))
        losses.append(float(dict(zip(outputs, module(*[feeds[n] for n in inputs])))["loss"]))
        optimizer.step()
        module.lazy_reset_grad()
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--torch-python", help="a Python with torch and transformers")
    parser.add_argument("--role", choices=["torch"], help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--trainer", choices=["native", "portable"],
                        help="run the onnxmp side through Trainer on this engine")
    parser.add_argument("--plot", type=Path, help="draw the curves into this PNG")
    args = parser.parse_args()
    if args.role == "torch":
        json.dump(torch_losses(args.steps), sys.stdout)
        return 0
    if not args.torch_python:
        parser.error("--torch-python is required")
    done = subprocess.run([args.torch_python, __file__, "--role", "torch", "--steps", str(args.steps)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        sys.stderr.write(done.stderr[-3000:])
        return 1
    theirs = json.loads(done.stdout)
    with tempfile.TemporaryDirectory(prefix="onnxmp-compare-") as folder:
        ours = onnxmp_losses(args.steps, Path(folder))
        if args.trainer:
            ours.update(trainer_losses(args.steps, Path(folder), args.trainer))
    figures = {}
    for run in [*RUNS, "adamw_native"]:
        against = "adamw" if run == "adamw_native" else run
        rel = [abs(a - b) / abs(b) for a, b in zip(ours[run], theirs[against])]
        figures[run] = {"onnxmp": ours[run], "torch": theirs[against], "max_rel": max(rel)}
        if run == "adamw_native":
            print(f"{run}: the native engine's optimizer model (onnxruntime's AdamW) against torch's run adamw")
        else:
            print(f"{run}: {RUNS[run][1]} no_decay={RUNS[run][2]}")
        print(" step   onnxmp        torch         rel.diff")
        for i, (a, b, r) in enumerate(zip(ours[run], theirs[against], rel), start=1):
            print(f" {i:4d}   {a:.8f}    {b:.8f}    {r:.1e}")
        print(f" max relative difference: {max(rel):.2e}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if args.plot:
        how = (f"Trainer, {args.trainer} engine" if args.trainer
               else "ORT's training graph + the portable optimizer graph")
        plot(figures, args.plot, f"bert2 (matrix export), float32, {args.steps} steps: onnxmp ({how}) vs torch.optim")
    return 0


if __name__ == "__main__":
    sys.exit(main())
