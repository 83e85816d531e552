"""``onnxmp train``: mixed-precision training of an ONNX model on data from .npz files.

Layout of ``--out DIR``:

* ``artifacts/``: what :func:`onnxmp.training.build_artifacts` wrote;
* ``state/``: the trainer saved after every epoch (``--resume DIR/state``);
* ``history.json``: per-epoch summaries of this run;
* ``model.onnx`` (float32) and, for mixed precision, ``model.<precision>.onnx``
  (converted for CUDA): the trained model for inference.
"""
from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import numpy as np

from onnxmp.errors import OnnxMPError

log = logging.getLogger("onnxmp.cli.train")

_METRICS = {"cross_entropy": ["accuracy"], "bce_with_logits": ["binary_accuracy"]}


def register(sub) -> None:
    from onnxmp.cli import add_verbosity_flags
    from onnxmp.training.artifacts import LOSSES, OPTIMIZERS, PRECISIONS

    p = sub.add_parser("train", help="train an ONNX model with mixed precision and dynamic loss scaling",
                       description="Build training artifacts (loss scaling, unscale, inf/NaN check), train on "
                                   "arrays from .npz files, save a resumable state each epoch and export the "
                                   "trained model. On --device cpu mixed precision is emulated in float32.")
    p.add_argument("model", help="float32 .onnx model to train (ignored with --resume)")
    p.add_argument("--data", required=True, help=".npz file with the training arrays")
    p.add_argument("--eval", dest="eval_data", help=".npz file with evaluation arrays (same keys)")
    p.add_argument("--inputs", nargs="+", required=True, metavar="KEY",
                   help="npz keys fed to the model inputs, in the model's input order")
    p.add_argument("--labels", required=True, metavar="KEY", help="npz key holding the labels/targets")
    p.add_argument("--loss", choices=list(LOSSES), default="cross_entropy")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--epochs", type=int, required=True, help="total epochs (a resumed run continues up to it)")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-3,
                   help="learning rate (default 1e-3; a resumed run keeps its saved rate)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--precision", choices=PRECISIONS, default="float16")
    p.add_argument("--resume", metavar="DIR", help="continue from a saved state folder (DIR or DIR/state)")
    p.add_argument("--frozen", nargs="+", default=[], metavar="NAME", help="initializers not to train")
    p.add_argument("--grad-accum-steps", type=int, default=1, metavar="K")
    p.add_argument("--clip-global-norm", type=float, default=None, metavar="C")
    p.add_argument("--seed", type=int, default=0, help="shuffling seed (default 0)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    add_verbosity_flags(p)
    p.set_defaults(func=_train)


def _train(args) -> int:
    from onnxmp.training import Trainer, build_artifacts

    if args.epochs < 1 or args.batch_size < 1:
        raise OnnxMPError("--epochs and --batch-size must be positive")
    out = Path(args.out)
    if args.resume:
        trainer = Trainer.resume(_state_folder(Path(args.resume)), device=args.device)
        log.info("resumed at epoch %d (%d updates); the model file argument is not used", trainer.epoch,
                 trainer.optimizer_steps)
    else:
        from onnxmp.load import load
        from onnxmp.training.models import trainable

        model = load(args.model)
        artifacts = build_artifacts(model, requires_grad=[n for n in trainable(model) if n not in set(args.frozen)],
                                    frozen=args.frozen, loss=args.loss, optimizer=args.optimizer,
                                    precision=args.precision, target=args.device, out_dir=out / "artifacts")
        trainer = Trainer(artifacts, device=args.device, lr=args.lr, grad_accum_steps=args.grad_accum_steps,
                          clip_global_norm=args.clip_global_norm)

    manifest = trainer.artifacts.manifest
    train = _read_arrays(args.data, args.inputs, args.labels, manifest)
    evaluation = _read_arrays(args.eval_data, args.inputs, args.labels, manifest) if args.eval_data else None
    metrics = _METRICS.get(manifest["loss"], [])
    rows = len(train[0])

    def epoch_batches(epoch: int):
        # Seeded by the epoch, so a resumed run sees the same order.
        order = np.random.default_rng([args.seed, epoch]).permutation(rows)
        return [tuple(a[order[i:i + args.batch_size]] for a in train) for i in range(0, rows, args.batch_size)]

    eval_batches = None
    if evaluation is not None:
        n = len(evaluation[0])
        eval_batches = [tuple(a[i:i + args.batch_size] for a in evaluation) for i in range(0, n, args.batch_size)]

    history = trainer.fit(epoch_batches, args.epochs, eval_batches, metrics, progress=args.progress,
                          on_epoch_end=lambda t, _: t.save(out / "state"))
    summaries = history.epochs

    from onnxmp.training.artifacts import write_json

    write_json(out / "history.json", {"epochs": summaries, "skipped_steps": trainer.skipped_steps,
                                      "optimizer_steps": trainer.optimizer_steps,
                                      "loss_scale": trainer.scaler.scale})
    exported = [trainer.export_inference(out / "model.onnx", precision="float32")]
    if manifest["precision"] != "float32":
        exported.append(trainer.export_inference(out / f"model.{manifest['precision']}.onnx",
                                                 precision=manifest["precision"], target="cuda"))
    _print_table(summaries)
    sys.stdout.write(f"skipped steps: {trainer.skipped_steps}, updates: {trainer.optimizer_steps}, "
                     f"final loss scale: {trainer.scaler.scale:g}\n")
    for path in exported:
        sys.stdout.write(f"wrote {path}\n")
    sys.stdout.write(f"state (for --resume): {out / 'state'}\n")
    return 0


def _state_folder(path: Path) -> Path:
    if (path / "state" / "manifest.json").is_file():
        return path / "state"
    return path


def _read_arrays(path: str, inputs: list[str], labels: str, manifest: dict) -> list[np.ndarray]:
    """The arrays of one .npz file in the order a batch needs: model inputs, then labels."""
    if len(inputs) != len(manifest["model_inputs"]):
        raise OnnxMPError(f"--inputs names {len(inputs)} arrays but the model has "
                          f"{len(manifest['model_inputs'])} inputs ({', '.join(manifest['model_inputs'])})")
    try:
        with np.load(path) as data:
            missing = [key for key in [*inputs, labels] if key not in data]
            if missing:
                raise OnnxMPError(f"{path} has no array {', '.join(missing)}",
                                  f"it holds: {', '.join(data.files)}")
            arrays = [data[key] for key in [*inputs, labels]]
    except (OSError, ValueError) as exc:
        raise OnnxMPError(f"cannot read {path}: {exc}", "pass an .npz file written by numpy.savez") from None
    if len({len(a) for a in arrays}) != 1:
        raise OnnxMPError(f"the arrays in {path} have different numbers of rows: "
                          + ", ".join(f"{k}={len(a)}" for k, a in zip([*inputs, labels], arrays)))
    dtypes = manifest["input_dtypes"]
    return [a.astype(dtypes[name], copy=False) for name, a in zip(manifest["inputs"], arrays)]


def _print_table(summaries: list[dict]) -> None:
    if not summaries:
        sys.stdout.write("nothing to train: the state already has all epochs\n")
        return
    columns = [c for c in ("epoch", "loss", "eval_loss", "eval_accuracy", "eval_binary_accuracy", "loss_scale",
                           "skipped_steps") if c in summaries[0]]
    sys.stdout.write("  ".join(f"{c:>14}" for c in columns) + "\n")
    for row in summaries:
        cells = []
        for c in columns:
            value = row[c]
            cells.append(f"{value:>14.6g}" if isinstance(value, float) and not math.isnan(value) else f"{value!s:>14}")
        sys.stdout.write("  ".join(cells) + "\n")
