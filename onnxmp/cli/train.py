"""``onnxmp train``: mixed-precision training of an ONNX model on data from .npz files.

Layout of ``--out DIR``:

* ``artifacts/``: what :func:`onnxmp.training.build_artifacts` wrote (a fresh run only: a resumed
  run replaces the folder without it, and its ``state/`` holds the same graphs);
* ``state/``: the trainer saved after every epoch (``--resume DIR/state``), written to this
  final path as each epoch completes (not only when the run ends);
* ``history.json``: per-epoch summaries of this run;
* ``model.onnx`` (float32) and, for mixed precision, ``model.<precision>.onnx``
  (converted for CUDA): the trained model for inference.

The data is checked (keys, rows, dtypes, labels against the loss) before
anything is written; ``DIR`` is built as a temporary folder beside it and
renamed into place when the run succeeds.  Only ``DIR/state`` is written
before: each completed epoch replaces it (atomically), so a run that fails, is
interrupted (SIGINT/SIGTERM: it stops at the current step and exits 130/143
naming the state) or is killed leaves the last completed epoch's state there,
resumable, and nothing else of the run.

Under ``mpiexec -n W`` the run is data-parallel (docs/distributed.md):
``--batch-size`` and ``--grad-accum-steps`` are per rank, every rank reads the
data (and ``--resume``), rank 0 alone writes ``DIR`` and prints, and an error
on any rank ends the job.
"""
from __future__ import annotations

import json
import logging
import contextlib
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnxmp.errors import OnnxMPError, UsageError

log = logging.getLogger("onnxmp.cli.train")



def register(sub) -> None:
    from onnxmp.cli import add_trust_flag, add_verbosity_flags, at_least, positive_float
    from onnxmp.training.build import BUILDERS, PRECISIONS
    from onnxmp.training.losses import LOSSES
    from onnxmp.targets import NAMES as TARGETS
    from onnxmp.training.run.engines import ENGINES
    from onnxmp.training.optimizer_settings import OPTIMIZERS
    from onnxmp.training.run.schedules import SCHEDULES

    p = sub.add_parser("train", help="train an ONNX model with mixed precision and dynamic loss scaling",
                       description="Build training artifacts (loss scaling, unscale, inf/NaN check), train on "
                                   "arrays from .npz files, save a resumable state each epoch and export the "
                                   "trained model. On --device cpu mixed precision is emulated in float32.")
    p.add_argument("model", nargs="?", help="float32 .onnx model to train (not with --artifacts or --resume)")
    p.add_argument("--artifacts", metavar="DIR",
                   help="train artifacts built before instead of a model (with --engine portable they train on "
                        "any Python and onnxruntime)")
    p.add_argument("--data", help=".npz file with the training arrays")
    p.add_argument("--eval", dest="eval_data", help=".npz file with evaluation arrays (same keys)")
    p.add_argument("--inputs", nargs="+", metavar="KEY",
                   help="npz keys fed to the model inputs, in the model's input order")
    p.add_argument("--labels", metavar="KEY", help="npz key holding the labels/targets")
    p.add_argument("--loss", default="cross_entropy", metavar="LOSS",
                   help=f"a built-in loss ({', '.join(LOSSES)}; default cross_entropy) or a custom one: "
                        "module:function or path/to/file.py:function: a function (builder, output, label) -> "
                        "loss name, an ONNX graph or function, or an onnxblock Block (docs/training.md)")
    p.add_argument("--ignore-index", type=int, default=None, metavar="I",
                   help="cross_entropy / causal_lm: the label of positions without one (default -100)")
    p.add_argument("--pos-weight", type=float, nargs="+", default=None, metavar="W",
                   help="bce_with_logits: weight of the positive targets (one number, or one per class)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--epochs", type=at_least(1), help="total epochs (a resumed run continues up to it)")
    p.add_argument("--batch-size", type=at_least(1))
    p.add_argument("--lr", type=positive_float, default=1e-3,
                   help="learning rate (default 1e-3; a resumed run keeps its saved rate)")
    p.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="learning-rate schedule, per update, as Hugging Face's get_*_schedule_with_warmup "
                        "(default constant); a resumed run keeps its saved one")
    p.add_argument("--warmup-steps", type=at_least(0), default=0, metavar="N",
                   help="updates of linear warmup from 0 to --lr (default 0)")
    p.add_argument("--init-scale", type=positive_float, default=None, metavar="S",
                   help="initial loss scale (torch's GradScaler default 65536; float16 scales dynamically)")
    p.add_argument("--growth-interval", type=at_least(1), default=None, metavar="N",
                   help="finite updates in a row before the loss scale grows (default 2000)")
    p.add_argument("--growth-factor", type=positive_float, default=None, metavar="F",
                   help="the loss scale's growth factor (default 2)")
    p.add_argument("--backoff-factor", type=positive_float, default=None, metavar="F",
                   help="the loss scale's back-off factor on non-finite gradients (default 0.5)")
    p.add_argument("--no-loss-scaling", dest="loss_scaling", action="store_false",
                   help="a static loss scale of 1 (torch's GradScaler(enabled=False)); non-finite updates are "
                        "still skipped")
    p.add_argument("--threads", type=at_least(0), default=None, metavar="N",
                   help="intra-op threads of the onnxruntime sessions (default: all cores; 0: onnxruntime's default)")
    p.add_argument("--out", metavar="DIR", help="output folder")
    p.add_argument("--device", choices=TARGETS, default="cpu")
    p.add_argument("--precision", choices=PRECISIONS, default="float16")
    p.add_argument("--resume", metavar="DIR", help="continue from a saved state folder (DIR or DIR/state)")
    p.add_argument("--frozen", nargs="+", default=[], metavar="NAME", help="initializers not to train")
    p.add_argument("--train", dest="train_patterns", action="append", default=[], metavar="REGEX",
                   help="train only the parameters whose name a pattern matches (re.search; repeatable)")
    p.add_argument("--freeze", dest="freeze_patterns", action="append", default=[], metavar="REGEX",
                   help="do not train the parameters whose name a pattern matches (re.search; repeatable)")
    p.add_argument("--list-params", action="store_true",
                   help="list the model's float initializers (shape, dtype, size, and the nodes reading "
                        "exporter-made names) and exit without training")
    p.add_argument("--grad-accum-steps", type=at_least(1), default=1, metavar="K")
    p.add_argument("--clip-global-norm", type=positive_float, default=None, metavar="C")
    p.add_argument("--seed", type=at_least(0), default=0, help="shuffling seed (default 0)")
    p.add_argument("--builder", choices=list(BUILDERS), default="auto",
                   help="who builds the gradient graph: onnxmp (any Python, plain onnxruntime), ort "
                        "(onnxruntime-training 1.19.2, Python <= 3.11; adds the native engine's files) or auto "
                        "(ort where the training build imports, else onnxmp)")
    p.add_argument("--engine", choices=list(ENGINES), default="auto",
                   help="what runs the steps: native (onnxruntime-training, Python <= 3.11), portable (plain "
                        "onnxruntime, CPU or CUDA) or auto (native where the training build imports, else portable)")
    p.add_argument("--distributed", choices=["auto", "mpi", "none"], default="auto",
                   help="data-parallel backend: auto (MPI when launched by mpiexec with more than one rank), "
                        "mpi, or none (train alone)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (there is none when stderr is not a terminal either)")
    add_trust_flag(p)
    add_verbosity_flags(p)
    p.set_defaults(func=_train)


def _train(args) -> int:
    from onnxmp.training.run.distributed import abort_on_error, from_environment

    if args.list_params:
        return _list_params(args)
    missing = [flag for flag, value in (("--data", args.data), ("--inputs", args.inputs), ("--labels", args.labels),
                                        ("--epochs", args.epochs), ("--batch-size", args.batch_size),
                                        ("--out", args.out)) if value is None]
    if missing:
        raise UsageError(f"the following arguments are required: {', '.join(missing)}",
                         "see `onnxmp train --help`", prog="onnxmp train")
    comm = from_environment(args.distributed)
    if comm is None or comm.size == 1:
        return _train_on(args, None)
    from onnxmp.cli import report_exception

    if comm.rank:  # rank 0 speaks for the job; the others only report their warnings and errors
        logging.getLogger("onnxmp").setLevel(max(logging.WARNING, logging.getLogger().level))
    prog = f"onnxmp train (rank {comm.rank} of {comm.size})"
    with abort_on_error(comm, lambda exc: report_exception(prog, exc, args.verbose > 0)):
        code = _train_on(args, comm)
        comm.barrier()  # the job ends when rank 0 has written DIR
    return code


def _train_on(args, comm) -> int:
    from onnxmp.cli import interrupts
    from onnxmp.files import atomic_directory, guard_outputs, recover_folder
    from onnxmp.training import Trainer, build_artifacts
    from onnxmp.training.artifacts import Artifacts, check_replaceable

    root = comm is None or comm.is_root
    world = 1 if comm is None else comm.size
    out = Path(args.out)
    resume = _state_folder(Path(args.resume)) if args.resume else None
    prebuilt = Path(args.artifacts) if args.artifacts and resume is None else None
    if resume is None and prebuilt is None and not args.model:
        raise OnnxMPError("onnxmp train needs a model, --artifacts DIR or --resume DIR",
                          "pass the float32 .onnx model to build and train, or a folder built before")
    if args.model and (prebuilt or resume):
        log.info("the model file argument is not used with %s", "--resume" if resume else "--artifacts")
    if args.builder != "auto" and (prebuilt or resume):
        log.warning("--builder %s is not used with %s: the folder's graphs are built already (its manifest "
                    "names the builder)", args.builder, "--resume" if resume else "--artifacts")
    inputs = {"model": None if resume or prebuilt else args.model, "--data": args.data, "--eval": args.eval_data,
              "--artifacts": prebuilt}
    # Resuming in place (--resume OUT/state --out OUT) is fine: OUT is replaced only once the new
    # one is complete, and the state is read before that.
    if resume is not None and not resume.resolve().is_relative_to(out.resolve()):
        inputs["--resume"] = resume
    if root:  # only rank 0 writes; on another host --out's folder need not exist
        guard_outputs({"--out": out}, inputs, folders=["--out"])
        recover_folder(out / "state")  # a killed run's DIR/state, before the check reads DIR
        if not (out / "state" / "manifest.json").is_file():  # an interrupted run leaves only DIR/state
            check_replaceable(out, marker="history.json", what="train output folder")

    if resume is not None:
        trainer = Trainer.resume(resume, device=args.device, communicator=comm, engine=args.engine,
                                 **({"threads": args.threads} if args.threads is not None else {}))
        log.info("resumed at epoch %d (%d updates)", trainer.epoch, trainer.optimizer_steps)
        spec = _DataSpec.of_manifest(trainer.artifacts.manifest)
    elif prebuilt is not None:
        artifacts = Artifacts.load(prebuilt)
        spec = _DataSpec.of_manifest(artifacts.manifest)
    else:
        from onnxmp.load import load
        from onnxmp.training.build import check_trainable_size, resolve_builder

        builder = resolve_builder(args.builder)  # the builder asked for is there: say so before any work
        if builder == "onnxmp" and args.engine == "native":
            raise OnnxMPError("--engine native runs the files ORT's gradient builder writes, and onnxmp's builder "
                              "builds this run", "use --engine portable (or auto), or --builder ort on Python 3.11 "
                              "with the training build")
        check_trainable_size(args.model)  # before the weights are read into memory
        model = load(args.model)
        loss, loss_options = _loss(args)
        spec = _DataSpec.of_model(model, args.loss, loss_options)
    # Every check on the data happens before anything is built or written.
    train = _read_arrays(args.data, args.inputs, args.labels, spec)
    evaluation = _read_arrays(args.eval_data, args.inputs, args.labels, spec) if args.eval_data else None
    settings = _trainer_settings(args, len(train[0]), world)
    if resume is None:
        scaler = _scaler(args, args.precision if prebuilt is None else artifacts.precision)
        if scaler is not None:
            settings["scaler"] = scaler
    else:
        ignored = [flag for flag, given in (("--schedule", args.schedule is not None),
                                            ("--warmup-steps", args.warmup_steps), ("--init-scale", args.init_scale),
                                            ("--growth-interval", args.growth_interval),
                                            ("--growth-factor", args.growth_factor),
                                            ("--backoff-factor", args.backoff_factor),
                                            ("--no-loss-scaling", not args.loss_scaling)) if given]
        if ignored:
            log.warning("%s not used with --resume: the run keeps its saved schedule and loss scaler",
                        ", ".join(ignored))

    # The other ranks build their own artifacts (the same graphs; rank 0's weights are broadcast)
    # in a private folder, which goes when they are done.
    saved = _Saved(out / "state", resume)
    try:
        with interrupts.stop_on_signals(), interrupts.Deferral() as finishing:
            workspace = atomic_directory(out) if root else _private_folder(f"onnxmp-rank{comm.rank}-")
            with workspace as folder:
                if resume is None and prebuilt is None:
                    trained, frozen = _parameters(args, model)
                    artifacts = build_artifacts(model, requires_grad=trained, frozen=frozen, loss=loss,
                                                optimizer=args.optimizer, precision=args.precision,
                                                target=args.device, out_dir=folder / "artifacts",
                                                builder=builder)
                if resume is None:
                    trainer = Trainer(artifacts, device=args.device, communicator=comm, **settings)
                summaries, exported = _fit_and_export(trainer, train, evaluation, args, folder, saved)
                finishing.start()  # DIR is complete: a signal now waits until it is renamed into place
    except interrupts.Interrupted as stop:
        if root:
            sys.stderr.write(f"onnxmp train: interrupted by {stop.name}; {saved.describe(args)}\n")
        return stop.exit_code
    if not root:
        return 0
    if comm is not None:
        sys.stdout.write(f"data-parallel on {comm.size} ranks: {trainer.grad_accum_steps} micro-batch(es) of "
                         f"{args.batch_size} rows per rank per update\n")
    _print_table(summaries)
    sys.stdout.write(f"skipped steps: {trainer.skipped_steps}, updates: {trainer.optimizer_steps}, "
                     f"final loss scale: {trainer.scaler.scale:g}\n")
    for name in exported:
        sys.stdout.write(f"wrote {out / name}\n")
    sys.stdout.write(f"state (for --resume): {out / 'state'}\n")
    return 0


class _Saved:
    """Where the per-epoch state goes (its final path, outside the output's temporary folder), and
    what there is to resume from when the run stops."""

    def __init__(self, path: Path, resumed_from: Path | None):
        self.path = path
        self.epoch: int | None = None  # the last epoch saved by this run
        self.resumed_from = resumed_from

    def save(self, trainer) -> None:
        from onnxmp.cli import interrupts

        with interrupts.deferred():  # a signal now waits: the state is never cut in half
            if trainer.comm is None or trainer.comm.is_root:
                self.path.parent.mkdir(exist_ok=True)
            trainer.save(self.path)
        self.epoch = trainer.epoch

    def describe(self, args) -> str:
        out = self.path.parent
        if self.epoch is not None:
            where = self.path
            what = f"the state after epoch {self.epoch} is in {where}"
        elif self.resumed_from is not None:
            where = self.resumed_from
            what = f"no epoch completed since the resume; the state resumed from is still {where}"
        else:
            return "no epoch completed: nothing was saved"
        return f"{what}: continue with `onnxmp train --resume {where} --out {out} ...` (the same data and flags)"


def _parameters(args, model) -> tuple[list[str], list[str]]:
    """(trained, frozen) initializers: --frozen names, then the --train/--freeze patterns, less the
    constants some exporters store as initializers (a clamp minimum...), which have no gradient."""
    from onnxmp.cli.train_params import select
    from onnxmp.training.models import trainable
    from onnxmp.training.build.prepare import without_gradient

    names = trainable(model)
    candidates = [n for n in names if n not in set(args.frozen)]
    trained, by_pattern = select(candidates, args.train_patterns, args.freeze_patterns)
    if by_pattern:
        log.info("not training %d parameter(s) the --train/--freeze patterns leave out", len(by_pattern))
    constant = without_gradient(model, trained)
    for name, reason in constant.items():
        log.info("not training %s: %s", name, reason)
    trained = [n for n in trained if n not in constant]
    return trained, [*args.frozen, *by_pattern, *constant]


def _list_params(args) -> int:
    from onnxmp.cli.train_params import list_params
    from onnxmp.load import load

    if not args.model:
        raise UsageError("--list-params needs the model", "onnxmp train MODEL --list-params", prog="onnxmp train")
    for line in list_params(load(args.model)):
        sys.stdout.write(line + "\n")
    return 0


def _loss(args):
    """What build_artifacts takes for --loss, --ignore-index and --pos-weight."""
    from onnxmp.training import losses

    options = {}
    if args.ignore_index is not None:
        options["ignore_index"] = args.ignore_index
    if args.pos_weight is not None:
        options["pos_weight"] = args.pos_weight[0] if len(args.pos_weight) == 1 else args.pos_weight
    if options:
        if args.loss not in losses.LOSSES:
            raise UsageError("--ignore-index and --pos-weight are options of the built-in losses, "
                             f"not of {args.loss!r}",
                             prog="onnxmp train")
        return losses.table_loss(args.loss, **options), options
    return losses.resolve_loss(args.loss), {}


def _scaler(args, precision: str):
    """The loss scaler the flags ask for; None for the Trainer's default."""
    from onnxmp.training.run.loss_scaler import DynamicLossScaler

    settings = {k: v for k, v in (("init_scale", args.init_scale), ("growth_interval", args.growth_interval),
                                  ("growth_factor", args.growth_factor), ("backoff_factor", args.backoff_factor))
                if v is not None}
    if not args.loss_scaling:
        return DynamicLossScaler(enabled=False)
    if not settings:
        return None
    # Asked for on float32/bfloat16 too (their default is a static scale of 1): then it is dynamic there.
    return DynamicLossScaler(**settings)


def _trainer_settings(args, rows: int, world: int) -> dict:
    """Trainer keywords from the flags; ``total_steps`` for a schedule counts the run's updates."""
    settings = {"lr": args.lr, "grad_accum_steps": args.grad_accum_steps, "clip_global_norm": args.clip_global_norm,
                "engine": args.engine, "threads": args.threads}
    if args.schedule is not None or args.warmup_steps:
        batches = math.ceil(rows / args.batch_size)
        per_epoch = math.ceil(batches / (args.grad_accum_steps * world))  # a short last group is one update too
        settings.update(schedule=args.schedule or "constant", warmup_steps=args.warmup_steps,
                        total_steps=args.epochs * per_epoch)
    return settings


@contextlib.contextmanager
def _private_folder(prefix: str):
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        yield Path(folder)


def _fit_and_export(trainer, train, evaluation, args, folder: Path, saved: _Saved) -> tuple[list[dict], list[str]]:
    from onnxmp.files import write_text_atomic
    from onnxmp.training.run.distributed import contiguous_shard, shard
    from onnxmp.training.losses import LOSSES

    manifest = trainer.artifacts.manifest
    metrics = list(LOSSES[manifest["loss"]].metrics) if manifest["loss"] in LOSSES else []
    rows = len(train[0])

    comm = trainer.comm
    root = comm is None or comm.is_root

    def epoch_batches(epoch: int):
        # Seeded by the epoch, so a resumed run sees the same order.  Every rank builds the same
        # global list and runs its shard of it.
        order = np.random.default_rng([args.seed, epoch]).permutation(rows)
        batches = [order[i:i + args.batch_size] for i in range(0, rows, args.batch_size)]
        if comm is not None:
            batches = shard(batches, comm.rank, comm.size, trainer.grad_accum_steps)
        return [None if rows_ is None else tuple(a[rows_] for a in train) for rows_ in batches]

    eval_batches = None
    if evaluation is not None:
        n = len(evaluation[0])
        eval_batches = [tuple(a[i:i + args.batch_size] for a in evaluation) for i in range(0, n, args.batch_size)]
        if comm is not None:
            eval_batches = contiguous_shard(eval_batches, comm.rank, comm.size)

    # As convert's bars: none in a log file or a pipe, where it is only noise.
    progress = args.progress and sys.stderr.isatty()
    history = trainer.fit(epoch_batches, args.epochs, eval_batches, metrics, progress=progress,
                          on_epoch_end=lambda t, _: saved.save(t))
    if not history.epochs:  # nothing left to train: keep the state resumable
        saved.save(trainer)
    if not root:
        return history.epochs, []
    # DIR/state is already in place; the new DIR (this temporary folder) replaces the old one whole,
    # so it takes a copy of it.
    shutil.copytree(saved.path, folder / "state")
    summary = {"epochs": history.epochs, "skipped_steps": trainer.skipped_steps,
               "optimizer_steps": trainer.optimizer_steps, "loss_scale": trainer.scaler.scale}
    if comm is not None:
        summary.update(world_size=comm.size, grad_accum_steps_per_rank=trainer.grad_accum_steps)
    write_text_atomic(folder / "history.json", json.dumps(summary, indent=2) + "\n")
    exported = ["model.onnx"]
    trainer.export_inference(folder / "model.onnx", precision="float32")
    if manifest["precision"] != "float32":
        exported.append(f"model.{manifest['precision']}.onnx")
        trainer.export_inference(folder / exported[-1], precision=manifest["precision"], target="cuda")
    return history.epochs, exported


def _state_folder(path: Path) -> Path:
    from onnxmp.files import recover_folder

    for folder in (path, path / "state"):  # what a killed run was replacing is put back first
        recover_folder(folder)
    if (path / "state" / "manifest.json").is_file():
        return path / "state"
    return path


@dataclass(frozen=True)
class _DataSpec:
    """What the arrays of a batch must be: input names and dtypes, the loss and the output shape."""

    model_inputs: list[str]
    dtypes: dict[str, str]
    loss: str
    output_shape: list[int | None]
    loss_options: dict | None = None

    @classmethod
    def of_manifest(cls, manifest: dict) -> "_DataSpec":
        return cls(list(manifest["model_inputs"]), dict(manifest["input_dtypes"]), manifest["loss"],
                   list(manifest.get("output_shape", [])), manifest.get("loss_options"))

    @classmethod
    def of_model(cls, model, loss: str, options: dict | None = None) -> "_DataSpec":
        from onnx import helper

        from onnxmp.inputs import model_inputs
        from onnxmp.training.labels import output_shape

        inputs = model_inputs(model)
        dtypes = {v.name: str(helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)) for v in inputs}
        return cls([v.name for v in inputs], dtypes, loss, output_shape(model), options)


def _read_arrays(path: str, inputs: list[str], labels: str, spec: _DataSpec) -> list[np.ndarray]:
    """The arrays of one .npz file in the order a batch needs (model inputs, then labels), checked."""
    from onnxmp.inputs import read_npz
    from onnxmp.training.labels import check_labels

    if len(inputs) != len(spec.model_inputs):
        raise OnnxMPError(f"--inputs names {len(inputs)} arrays but the model has "
                          f"{len(spec.model_inputs)} inputs ({', '.join(spec.model_inputs)})")
    data = read_npz(path, hint="pass an .npz file written by numpy.savez")
    keys = [*inputs, labels]
    missing = [key for key in keys if key not in data]
    if missing:
        raise OnnxMPError(f"{path} has no array {', '.join(missing)}", f"it holds: {', '.join(data)}")
    arrays = [data[key] for key in keys]
    if any(a.ndim == 0 for a in arrays):
        raise OnnxMPError(f"{path}: {', '.join(k for k, a in zip(keys, arrays) if a.ndim == 0)} "
                          "are scalars, not rows of data")
    if len({len(a) for a in arrays}) != 1:
        raise OnnxMPError(f"the arrays in {path} have different numbers of rows: "
                          + ", ".join(f"{k}={len(a)}" for k, a in zip(keys, arrays)))
    result = []
    for key, name, array in zip(inputs, spec.model_inputs, arrays):
        if array.dtype.kind not in "biuf":
            raise OnnxMPError(f"{path}: array {key} has dtype {array.dtype}; model input {name} wants "
                              f"{spec.dtypes[name]}")
        result.append(array.astype(spec.dtypes[name], copy=False))
    result.append(check_labels(spec.loss, arrays[-1], rows=len(arrays[0]), shape=spec.output_shape,
                               where=f"{path}: labels {labels!r}", options=spec.loss_options))
    return result


def _print_table(summaries: list[dict]) -> None:
    if not summaries:
        sys.stdout.write("nothing to train: the state already has all epochs\n")
        return
    columns = [c for c in ("epoch", "loss", "eval_loss", "eval_accuracy", "eval_token_accuracy",
                           "eval_binary_accuracy", "loss_scale", "skipped_steps") if c in summaries[0]]
    sys.stdout.write("  ".join(f"{c:>14}" for c in columns) + "\n")
    for row in summaries:
        cells = []
        for c in columns:
            value = row[c]
            cells.append(f"{value:>14.6g}" if isinstance(value, float) and not math.isnan(value) else f"{value!s:>14}")
        sys.stdout.write("  ".join(cells) + "\n")
