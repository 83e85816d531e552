#!/usr/bin/env python
"""Validate mixed-precision training against float32 on real data (scikit-learn's digits).

Data: ``sklearn.datasets.load_digits`` (1797 8x8 images, shipped with
scikit-learn, nothing is downloaded), pixels scaled to [0, 1], a stratified
80/20 split.  Model: an MLP 64-128-10 built with onnx.helper (opset 17, IR 8).

Three runs with the same seed, weights and batch order:

* ``fp32``: the float32 baseline;
* ``amp_dynamic``: float16 mixed precision with dynamic loss scaling;
* ``amp_scale1``: float16 mixed precision with the loss scale fixed at 1.

On ``--device cpu`` the mixed runs are emulated (float32 tensors holding
fp16-rounded values: the ORT CPU EP has no fp16 kernels); ``--device cuda``
runs real float16.

Underflow case: the same three runs, with the loss multiplied by 2**-20 inside
the graph (a custom loss block: cross entropy times a constant).  The true
gradients shrink by 2**-20 too, down to ~1e-9..1e-8, below float16's smallest
subnormal (6e-8): with a loss scale of 1 the fp16 backward pass flushes them to
zero; dynamic scaling (starting at 2**16) lifts them back into range.  The
optimizer there is plain SGD with the learning rate multiplied by 2**20, which
makes the float32 run exactly equivalent to training on the unscaled loss
(AdamW's epsilon would otherwise swamp such tiny gradients in every run).

Transformer case: the bundled BERT-style classifier (``models/zoo.py``
``transformer_classifier``: single-output LayerNormalization, Erf GELU, a
float32-min attention-mask fill, Gather embeddings), fine-tuned with every
weight trainable on its token task (``classifier_task``), in the same three
runs.  Its masked attention is where a careless float16 graph turns the fill
into -inf and the loss into NaN.

Prints the final test accuracies and skipped steps, writes a PNG with the loss
curves and the loss-scale curve, and with ``--json FILE`` the figures.
``--quick`` is a smoke test (two epochs) for CI.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Run as a script, sys.path[0] is scripts/: the bundled models live one level up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import zoo  # noqa: E402
from onnxmp.files import atomic_write, guard_arguments, write_text_atomic  # noqa: E402
from onnxmp.training import DynamicLossScaler, Trainer, build_artifacts  # noqa: E402
from onnxmp.training.models import mlp, scaled_cross_entropy, trainable  # noqa: E402

UNDERFLOW_MULTIPLIER = 2.0**-20
TRANSFORMER_ROWS = (1024, 256)  # train, test


def load_data(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def run(name, model, data, *, precision, scaler, optimizer, lr, loss, args, workdir, epochs=None):
    """``data`` is ``(train_columns, test_columns)``: tuples of arrays, labels last."""
    train, test = data
    artifacts = build_artifacts(model, requires_grad=trainable(model), loss=loss, optimizer=optimizer,
                                precision=precision, target=args.device, out_dir=workdir / name)
    trainer = Trainer(artifacts, device=args.device, scaler=scaler, lr=lr)
    rows = len(train[0])

    def epoch_batches(epoch):
        order = np.random.default_rng([args.seed, epoch]).permutation(rows)
        return [tuple(a[order[i:i + args.batch_size]] for a in train) for i in range(0, rows, args.batch_size)]

    start = time.perf_counter()
    history = trainer.fit(epoch_batches, epochs or args.epochs, progress=not args.no_progress)
    seconds = time.perf_counter() - start
    result = trainer.evaluate([test], ["accuracy"])
    return {"accuracy": result["accuracy"], "test_loss": result["loss"], "skipped_steps": trainer.skipped_steps,
            "final_loss_scale": trainer.scaler.scale, "seconds": seconds,
            "step_loss": history.step_loss, "step_loss_scale": history.step_loss_scale}


def three_runs(model, data, args, workdir, *, optimizer, lr, loss, tag, epochs=None):
    dynamic = DynamicLossScaler(growth_steps=args.growth_steps)
    common = dict(optimizer=optimizer, lr=lr, loss=loss, args=args, workdir=workdir, epochs=epochs)
    return {
        "fp32": run(f"{tag}fp32", model, data, precision="float32", scaler=DynamicLossScaler.static(1.0), **common),
        "amp_dynamic": run(f"{tag}amp_dynamic", model, data, precision="float16", scaler=dynamic, **common),
        "amp_scale1": run(f"{tag}amp_scale1", model, data, precision="float16",
                          scaler=DynamicLossScaler.static(1.0), **common),
    }


def smooth(values, window):
    values = np.asarray(values, dtype=np.float64)
    values = np.where(np.isfinite(values), values, np.nan)
    if len(values) < window:
        return values
    kernel = np.ones(window) / window
    filled = np.where(np.isnan(values), np.nanmean(values), values)
    return np.convolve(filled, kernel, mode="valid")


def plot(path, main, underflow, transformer, steps_per_epoch, transformer_steps_per_epoch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 14.5))
    window = max(1, steps_per_epoch // 2)
    for name, r in main.items():
        axes[0].plot(smooth(r["step_loss"], window), label=f"{name} (test acc {r['accuracy']:.3f})")
    axes[0].set(title="digits MLP: training loss (moving average; curves that match overlap)", xlabel="step", ylabel="loss", yscale="log")
    axes[0].legend()
    axes[1].plot(main["amp_dynamic"]["step_loss_scale"], color="tab:orange")
    axes[1].set(title=f"amp_dynamic loss scale ({main['amp_dynamic']['skipped_steps']} skipped steps)",
                xlabel="step", ylabel="loss scale", yscale="log", ylim=(0.5, None))
    for name, r in underflow.items():
        axes[2].plot(smooth(np.asarray(r["step_loss"]) / UNDERFLOW_MULTIPLIER, window),
                     label=f"{name} (test acc {r['accuracy']:.3f})")
    axes[2].set(title="underflow case: loss x 2^-20 (plotted unscaled), SGD", xlabel="step", ylabel="loss",
                yscale="log")
    axes[2].legend()
    window = max(1, transformer_steps_per_epoch // 2)
    for name, r in transformer.items():
        axes[3].plot(smooth(r["step_loss"], window), label=f"{name} (test acc {r['accuracy']:.3f}, "
                                                           f"{r['skipped_steps']} skipped)")
    axes[3].set(title="transformer classifier (float32-min attention mask): training loss, moving average",
                xlabel="step", ylabel="loss", yscale="log")
    axes[3].legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--epochs", type=int, default=None, help="default 30 (2 with --quick)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the main runs")
    parser.add_argument("--sgd-lr", type=float, default=0.2, help="SGD learning rate of the underflow case "
                                                                  "(before the 2**20 compensation)")
    parser.add_argument("--growth-steps", type=int, default=200,
                        help="loss-scale growth interval (Keras uses 2000 for long runs; shorter here so the "
                             "scale's dynamics show within a few minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transformer-epochs", type=int, default=None, help="default 4 (1 with --quick)")
    parser.add_argument("--transformer-lr", type=float, default=1e-3)
    parser.add_argument("--quick", action="store_true", help="two epochs: a smoke test")
    parser.add_argument("--plot", type=Path, default=Path("reports/validate_training.png"),
                        help="PNG of the loss and loss-scale curves (default: reports/validate_training.png)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = 2 if args.quick else 30
    if args.transformer_epochs is None:
        args.transformer_epochs = 1 if args.quick else 4
    if args.plot.parent == Path("reports"):
        args.plot.parent.mkdir(exist_ok=True)  # the default location
    guard_arguments(parser, {"--plot": args.plot, "--json": args.json})

    x_train, x_test, y_train, y_test = load_data(args.seed)
    data = ((x_train, y_train), (x_test, y_test))
    model = mlp((64, 128, 10), seed=args.seed, opset=17, ir_version=8)
    mode = "emulated float16 (CPU)" if args.device == "cpu" else "real float16 (CUDA)"
    print(f"digits: {len(x_train)} train / {len(x_test)} test rows; MLP 64-128-10; {args.epochs} epochs, "
          f"batch {args.batch_size}; mixed runs: {mode}")
    with tempfile.TemporaryDirectory(prefix="onnxmp-validate-") as folder:
        workdir = Path(folder)
        main_runs = three_runs(model, data, args, workdir, optimizer="adamw", lr=args.lr, loss="cross_entropy",
                               tag="")
        underflow = three_runs(model, data, args, workdir, optimizer="sgd",
                               lr=args.sgd_lr / UNDERFLOW_MULTIPLIER,
                               loss=scaled_cross_entropy(UNDERFLOW_MULTIPLIER), tag="underflow_")
        task_train = zoo.classifier_task(TRANSFORMER_ROWS[0], seed=args.seed)
        task_test = zoo.classifier_task(TRANSFORMER_ROWS[1], seed=args.seed + 1)
        columns = ("input_ids", "attention_mask", "labels")
        transformer = three_runs(zoo.transformer_classifier(),
                                 (tuple(task_train[k] for k in columns), tuple(task_test[k] for k in columns)),
                                 args, workdir, optimizer="adamw", lr=args.transformer_lr, loss="cross_entropy",
                                 tag="transformer_", epochs=args.transformer_epochs)

    print(f"\n{'run':<14}{'test acc':>10}{'skipped':>9}{'final scale':>13}{'seconds':>9}")
    for title, runs in (("main (AdamW)", main_runs), ("underflow (loss x 2^-20, SGD)", underflow),
                        (f"transformer classifier ({args.transformer_epochs} epochs, AdamW)", transformer)):
        print(title)
        for name, r in runs.items():
            print(f"  {name:<12}{r['accuracy']:>10.4f}{r['skipped_steps']:>9}{r['final_loss_scale']:>13g}"
                  f"{r['seconds']:>9.1f}")
    gap = 100 * (main_runs["amp_dynamic"]["accuracy"] - main_runs["fp32"]["accuracy"])
    print(f"\namp_dynamic - fp32: {gap:+.2f} accuracy points")
    print("underflow case: the loss is multiplied by 2**-20 in the graph, so fp16 gradients fall below the "
          "smallest subnormal; scale 1 flushes them, dynamic scaling recovers them")

    steps_per_epoch = -(-len(x_train) // args.batch_size)
    plot(args.plot, main_runs, underflow, transformer, steps_per_epoch, -(-TRANSFORMER_ROWS[0] // args.batch_size))
    print(f"plot: {args.plot}")
    if args.json:
        figures = {
            "fp32": main_runs["fp32"]["accuracy"],
            "amp_dynamic": main_runs["amp_dynamic"]["accuracy"],
            "amp_scale1": main_runs["amp_scale1"]["accuracy"],
            "skipped_steps": main_runs["amp_dynamic"]["skipped_steps"],
            "underflow_case": {
                "loss_multiplier": UNDERFLOW_MULTIPLIER,
                "fp32": underflow["fp32"]["accuracy"],
                "amp_dynamic": underflow["amp_dynamic"]["accuracy"],
                "amp_scale1": underflow["amp_scale1"]["accuracy"],
                "skipped_steps": underflow["amp_dynamic"]["skipped_steps"],
            },
            "transformer": {
                name: {"accuracy": r["accuracy"], "test_loss": r["test_loss"], "skipped_steps": r["skipped_steps"],
                       "final_loss_scale": r["final_loss_scale"], "first_loss": r["step_loss"][0],
                       "final_loss": r["step_loss"][-1]}
                for name, r in transformer.items()},
            "transformer_epochs": args.transformer_epochs,
            "device": args.device,
            "epochs": args.epochs,
            "plot": str(args.plot),
        }
        write_text_atomic(args.json, json.dumps(figures, indent=2) + "\n")
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
