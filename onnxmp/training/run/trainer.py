"""The mixed-precision training loop; an engine (:mod:`onnxmp.training.run.engines`) runs the graphs.

One :meth:`Trainer.train_step` runs one micro-batch through the training graph, which accumulates
its unscaled gradients and reports ``all_finite``.  After ``grad_accum_steps`` micro-batches the
trainer decides once for the effective batch (the AND of the ``all_finite``): finite, the engine's
optimizer step (clipping inside the optimizer graph); not finite, no step (weights, moments and the
step count stay exactly as they were) and the loss scale backs off.  Either way the accumulation
buffers are reset (lazily).  Data-parallel, the trainer's gradient sync
(:mod:`onnxmp.training.run.distributed.sync`) makes the decision the same on every rank.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from onnxmp.errors import OnnxMPError
from onnxmp.training.artifacts import Artifacts
from onnxmp.training.contract import GRAD_WEIGHT, IGNORE_INDEX, LOSS, LOSS_SCALE
from onnxmp.training.run import saving
from onnxmp.training.run.distributed import Communicator
from onnxmp.training.run.distributed.sync import Pending, gradient_sync
from onnxmp.training.run.engines import make_engine
from onnxmp.training.run.feeds import Feeds
from onnxmp.training.run.loss_scaler import DynamicLossScaler
from onnxmp.training.run.metrics import (METRICS, History, Metric, RunningMean, StepResult, metric_functions,
                                         weighted_means)
from onnxmp.training.run.schedules import Schedule

log = logging.getLogger("onnxmp.training")

__all__ = ["METRICS", "History", "StepResult", "Trainer"]


class Trainer:
    """Train from an :class:`Artifacts` folder (or its path); docs/training.md describes each setting.

    ``scaler``: :meth:`DynamicLossScaler.of`.  ``lr``: the base learning rate (``None``: the
    artifacts' optimizer's).  ``schedule`` (a :class:`~onnxmp.training.run.schedules.Schedule` or one
    of its names, with ``warmup_steps`` and ``total_steps``) sets the lr before each applied update,
    as Hugging Face's ``get_*_schedule_with_warmup``; ``lr_schedule(step)``, a function, does the
    same but cannot be saved.  ``clip_global_norm`` clips each effective batch's unscaled gradients
    by their global L2 norm.  ``threads``: the sessions' intra-op threads (0: onnxruntime's default).
    ``communicator`` (a :class:`~onnxmp.training.run.distributed.Communicator` of ``W`` ranks) trains
    data-parallel, equal to one process with ``grad_accum_steps * W``: every rank makes the same
    calls with the same number of micro-batches (``None`` pads a shard), inside
    :func:`~onnxmp.training.run.distributed.abort_on_error`.  ``engine``: ``native``
    (onnxruntime-training 1.19.2), ``portable`` (plain onnxruntime) or ``auto`` (native where it
    imports; a saved state continues on the engine that saved it).
    """

    def __init__(self, artifacts: Artifacts | str | os.PathLike, *, device: str = "cpu",
                 scaler: DynamicLossScaler | None = None, grad_accum_steps: int = 1, lr: float | None = None,
                 lr_schedule: Callable[[int], float] | None = None, clip_global_norm: float | None = None,
                 communicator: Communicator | None = None, engine: str = "auto",
                 schedule: Schedule | str | None = None, warmup_steps: int = 0, total_steps: int | None = None,
                 threads: int | None = None):
        self.sync = gradient_sync(communicator)
        # The communicator of a multi-rank run (None alone): what callers shard their data by.
        self.comm = communicator if self.sync.world_size > 1 else None
        self.artifacts = artifacts if isinstance(artifacts, Artifacts) else Artifacts.load(artifacts)
        if int(grad_accum_steps) != grad_accum_steps or grad_accum_steps < 1:
            raise OnnxMPError(f"grad_accum_steps must be a positive integer, got {grad_accum_steps}")
        if threads is not None and (isinstance(threads, bool) or int(threads) != threads or threads < 0):
            raise OnnxMPError(f"threads must be a non-negative integer (0: onnxruntime's default), got {threads!r}")
        self.device, self.grad_accum_steps = device, int(grad_accum_steps)
        self.clip_global_norm = None if clip_global_norm is None else float(clip_global_norm)
        self.lr_schedule = lr_schedule
        self.schedule = Schedule.of(schedule, warmup_steps, total_steps, lr_schedule)
        self.scaler = DynamicLossScaler.of(scaler, self.artifacts.precision)
        self.engine = make_engine(engine, self.artifacts, device,
                                  threads=self.sync.threads() if threads is None else int(threads),
                                  clip_global_norm=self.clip_global_norm)
        if lr is not None:
            self.engine.learning_rate = float(lr)
        self.base_lr = float(lr) if lr is not None else self.engine.learning_rate  # what a schedule multiplies
        self.feeds = Feeds(self.artifacts)
        # Counters; all of them are saved with the state.
        self.optimizer_steps = 0  # applied updates (the engine's own step count moves with it)
        self.skipped_steps = 0  # effective batches whose update was skipped
        self.micro_steps = 0  # micro-batches run, every rank's
        self.epoch = 0  # completed fit() epochs
        self._pending = Pending()  # this rank's micro-batches of the current effective batch
        self.last_batch_losses: list[float] = []  # the last effective batch's losses, every rank's
        self.sync.broadcast_parameters(self.engine)

    # --- stepping ---------------------------------------------------------------------

    def train_step(self, *arrays: np.ndarray) -> StepResult:
        """Run one micro-batch: ``arrays`` in :attr:`Artifacts.inputs` order (model inputs, then labels)."""
        scale = self.scaler.scale
        feeds = self.feeds(arrays)
        feeds[LOSS_SCALE] = np.array(scale, dtype=np.float32)
        # Each micro-batch of the effective batch (all ranks') weighs the same, as in one process.
        feeds[GRAD_WEIGHT] = np.array(1.0 / (self.grad_accum_steps * self.sync.world_size), dtype=np.float32)
        loss, finite = self.feeds.run("training", self.engine.train, feeds)
        self.micro_steps += 1
        return self._count_micro_step(loss, finite, scale)

    def pad_step(self) -> StepResult:
        """A micro-step with no batch: it counts towards the effective batch and adds no gradient
        (data-parallel ranks pad a short last group with it; :func:`shard` marks them ``None``)."""
        return self._count_micro_step(None, True, self.scaler.scale)

    def _count_micro_step(self, loss: float | None, finite: bool, scale: float) -> StepResult:
        self._pending.add(loss, finite)
        stepped = skipped = False
        if self._pending.count == self.grad_accum_steps:
            stepped = bool(self._finish_effective_batch())
            skipped = not stepped
        return StepResult(loss=math.nan if loss is None else loss, all_finite=finite, stepped=stepped,
                          loss_scale=scale, skipped=skipped)

    def _finish_effective_batch(self) -> bool | None:
        """Decide on the effective batch; ``None`` when no rank has anything pending."""
        decision = self.sync.reduce(self.engine, self._pending, self.grad_accum_steps)
        if decision is None:
            return None
        self.micro_steps += decision.others
        self.last_batch_losses = decision.losses
        apply = self.scaler.update(decision.finite)
        if apply:
            if self.lr_schedule is not None:
                self.engine.learning_rate = float(self.lr_schedule(self.optimizer_steps))
            elif self.schedule is not None:
                self.engine.learning_rate = self.schedule.lr_at(self.optimizer_steps, self.base_lr)
            self.engine.step()
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
            log.debug("non-finite gradients: update skipped, loss scale now %g", self.scaler.scale)
        self.engine.reset_grad()
        self._pending = Pending()
        self.scaler.check_progress(decision.losses, precision=self.artifacts.precision)
        return apply

    def flush(self) -> StepResult | None:
        """Decide on a partly accumulated effective batch now (its gradients weigh ``m/k``).
        Data-parallel, every rank must call it, pending or not."""
        stepped = self._finish_effective_batch()
        if stepped is None:
            return None
        return StepResult(loss=math.nan, all_finite=stepped, stepped=stepped, loss_scale=self.scaler.scale,
                          skipped=not stepped)

    # --- loops ------------------------------------------------------------------------

    def fit(self, train_batches: Iterable[Sequence[np.ndarray]] | Callable[[int], Iterable[Sequence[np.ndarray]]],
            epochs: int, eval_batches: Iterable[Sequence[np.ndarray]] | None = None,
            metrics: Sequence[str | tuple[str, Metric]] = (), *, progress: bool = True,
            on_epoch_end: Callable[["Trainer", dict[str, Any]], None] | None = None) -> History:
        """Train until ``epochs`` epochs are complete in total (a resumed trainer continues).

        ``train_batches``: re-iterable batches, or a function of the epoch returning them (shuffle
        there, seeded by the epoch).  A partial effective batch left at an epoch's end is applied
        then; ``on_epoch_end(trainer, summary)`` runs after each epoch.  Data-parallel, each rank
        passes its own shards; the history holds every rank's losses in the global order.
        """
        from tqdm.auto import tqdm

        history = History()
        metric_fns = self._metric_functions(metrics)
        full = self.grad_accum_steps * self.sync.world_size
        for epoch in range(self.epoch, epochs):
            batches = train_batches(epoch) if callable(train_batches) else train_batches
            total = len(batches) if hasattr(batches, "__len__") else None
            bar = tqdm(batches, total=total, desc=f"epoch {epoch + 1}/{epochs}",
                       disable=not progress or self.sync.rank != 0, dynamic_ncols=True)
            mean, skipped_before = RunningMean(), self.skipped_steps  # the epoch's finite losses
            for batch in bar:
                result = self.train_step(*batch) if batch is not None else self.pad_step()
                if result.stepped or result.skipped:
                    decided = self.last_batch_losses
                    history.record_batch(decided, result.loss_scale, result.skipped, len(decided) == full)
                    mean.add(decided)
                    bar.set_postfix(loss=f"{mean.value:.4f}", scale=f"{self.scaler.scale:g}",
                                    skipped=self.skipped_steps, refresh=False)
            bar.close()
            scale = self.scaler.scale
            if self.flush() is not None:
                history.record_batch(self.last_batch_losses, scale, False, False)
                mean.add(self.last_batch_losses)
            self.epoch = epoch + 1
            summary = {"epoch": self.epoch, "loss": mean.value,
                       "loss_scale": self.scaler.scale, "skipped_steps": self.skipped_steps - skipped_before,
                       "optimizer_steps": self.optimizer_steps}
            if eval_batches is not None:
                summary.update({f"eval_{k}": v for k, v in self.evaluate(eval_batches, metric_fns).items()})
            history.epochs.append(summary)
            (log.info if self.sync.rank == 0 else log.debug)("epoch %d: %s", self.epoch, ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items() if k != "epoch"))
            if on_epoch_end is not None:
                on_epoch_end(self, summary)
        return history

    def evaluate(self, batches: Iterable[Sequence[np.ndarray]],
                 metrics: Sequence[str | tuple[str, Metric]] = ()) -> dict[str, float]:
        """Mean loss and metrics over ``batches``, weighted by batch size.  A metric is a name from
        :data:`METRICS` or ``(name, fn(labels, predictions))`` (predictions: the first output).
        Data-parallel, each rank passes its block (:func:`~onnxmp.training.run.distributed.contiguous_shard`)
        and the sums are added in the global order, so the result equals one process's."""
        metric_fns = self._metric_functions(metrics)
        prediction = self.artifacts.manifest["forward_outputs"][0]
        label = self.artifacts.manifest["label_input"]
        rows = []  # per batch: each total times the batch's rows, then the rows
        for batch in batches:
            feeds = self.feeds(batch)
            named = self.feeds.run("eval", self.engine.evaluate, feeds)
            n = len(feeds[label])
            rows.append([float(named[LOSS]) * n, *(fn(feeds[label], named[prediction]) * n
                                                   for _, fn in metric_fns), n])
        names = [LOSS, *(name for name, _ in metric_fns)]
        return weighted_means(self.sync.gather_rows(rows, len(names) + 1), names)

    def _metric_functions(self, metrics):
        options = self.artifacts.manifest.get("loss_options") or {}
        return metric_functions(metrics, ignore_index=options.get("ignore_index", IGNORE_INDEX))

    # --- state ------------------------------------------------------------------------

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the current float32 parameters (trainable and frozen), by name."""
        return self.engine.parameters()

    def gradients(self) -> dict[str, np.ndarray]:
        """Copies of the trainable parameters' accumulated gradients, by name: after :meth:`train_step`,
        the unscaled gradient of the micro-batches accumulated so far, weighted ``1/grad_accum_steps``
        each (reset lazily, at the next :meth:`train_step` after an effective batch)."""
        return self.engine.gradients()

    @property
    def learning_rate(self) -> float:
        return self.engine.learning_rate

    def state_dict(self) -> dict[str, Any]:
        """The loop's counters and settings, with the scaler's and the schedule's state; the engine's
        (parameters, optimizer state) is :meth:`Engine.state_dict`."""
        return {
            "scaler": self.scaler.state_dict(), "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps, "micro_steps": self.micro_steps, "epoch": self.epoch,
            "grad_accum_steps": self.grad_accum_steps, "clip_global_norm": self.clip_global_norm,
            "learning_rate": self.learning_rate, "base_learning_rate": self.base_lr,
            "schedule": None if self.schedule is None else self.schedule.state_dict(),
            # A function cannot be saved: record that there was one, so that resume() refuses to go on without it.
            "lr_schedule": self.lr_schedule is not None,
            # grad_accum_steps is per rank: the effective batch is grad_accum_steps * world_size micro-batches.
            "world_size": self.sync.world_size,
            "sharding": "groups of grad_accum_steps * world_size micro-batches; rank r runs the r-th "
                        "grad_accum_steps of each; the last group padded",
        }

    def load_state_dict(self, state: Mapping[str, Any], *, settings: bool = True) -> None:
        """The counters of :meth:`state_dict`, and (``settings``) its scaler's and schedule's state."""
        try:
            self.optimizer_steps, self.skipped_steps = int(state["optimizer_steps"]), int(state["skipped_steps"])
            self.micro_steps, self.epoch = int(state["micro_steps"]), int(state["epoch"])
        except (KeyError, TypeError, ValueError) as exc:
            raise OnnxMPError(f"not a trainer state: {exc}", "was it saved by onnxmp?") from None
        if settings:
            self.scaler.load_state_dict(state["scaler"])
            if self.schedule is not None and state.get("schedule"):
                self.schedule.load_state_dict(state["schedule"])

    def save(self, path: str | os.PathLike) -> Path:
        """Write a resumable folder (:func:`saving.save`).  Data-parallel, every rank calls it: rank 0
        writes while the others wait, as their state is the same."""
        if self._pending.count:
            raise OnnxMPError("cannot save in the middle of an accumulated batch",
                              f"save after a multiple of grad_accum_steps={self.grad_accum_steps} steps, "
                              "or call flush() first")
        self.sync.on_root(lambda: saving.save(path, self.artifacts, self.engine, self.state_dict()))
        return Path(path)

    @classmethod
    def resume(cls, path: str | os.PathLike, *, device: str = "cpu",
               lr_schedule: Callable[[int], float] | None = None, communicator: Communicator | None = None,
               **overrides: Any) -> "Trainer":
        """Continue from a folder written by :meth:`save`, bit for bit.  Saved settings apply unless
        given in ``overrides`` (``engine`` too: the one that saved it); an ``lr_schedule`` must be
        given again.  Data-parallel, every rank reads ``path``; another world size keeps the
        effective batch where it divides it (:func:`saving.resume_settings`)."""
        artifacts, saved, settings = saving.resume_settings(path, lr_schedule, communicator, overrides)
        base_lr = settings.pop("base_lr", None)
        trainer = cls(artifacts, device=device, lr_schedule=lr_schedule, communicator=communicator, **settings)
        trainer.load_state_dict(saved, settings=False)  # the scaler and schedule: settings' (overridable)
        if base_lr is not None and "lr" not in overrides:
            trainer.base_lr = base_lr
        trainer.sync.check_same_state(  # the parameters come from rank 0, each rank's moments from its own file
            [trainer.optimizer_steps, trainer.skipped_steps, trainer.micro_steps,
             trainer.epoch, trainer.scaler.scale, trainer.scaler.good_steps, trainer.learning_rate], str(path))
        return trainer

    def export_inference(self, path: str | os.PathLike, precision: str = "float16", *,
                         target: str = "cuda") -> Path:
        """The trained model for deployment (:func:`saving.export_inference`)."""
        return saving.export_inference(self.artifacts, self.parameters(), path, precision, target=target)
