"""Mixed-precision training loop; an engine (:mod:`onnxmp.training.run.engines`) runs the graphs.

One :meth:`Trainer.train_step` runs one micro-batch through the training
graph, which accumulates its unscaled gradients and reports ``all_finite``.
After ``grad_accum_steps`` micro-batches the trainer decides once for the
effective batch (the AND of the micro-steps' ``all_finite``):

* finite: the engine's optimizer step (global-norm clipping happens inside the
  optimizer graph, on the unscaled accumulated gradients);
* not finite: no optimizer step, so weights, moments and the optimizer's step
  count stay exactly as they were; the loss scale backs off.

Either way the accumulation buffers are reset (lazily, at the next micro-batch).

With a ``communicator`` (data-parallel, :mod:`onnxmp.training.run.distributed`)
the decision is the same on every rank: the finite flag is all-reduced with
MIN, and a finite effective batch's gradients are all-reduced (summed) and
written back into the engine's buffers before the optimizer step, so the clipping
in the optimizer graph sees the reduced gradients.
"""
from __future__ import annotations

import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from onnxmp.errors import OnnxMPError
from onnxmp.training import _ort
from onnxmp.training.run import saving
from onnxmp.training.artifacts import Artifacts
from onnxmp.training.run.distributed import Communicator
from onnxmp.training.run.engines import make_engine
from onnxmp.training.labels import check_labels, label_run_error
from onnxmp.training.build.unscale import GRAD_SHAPE, GRAD_WEIGHT, LOSS, LOSS_SCALE
from onnxmp.training.losses import IGNORE_INDEX, LOSSES
from onnxmp.training.run.metrics import METRICS, History, Metric, StepResult, metric_functions
from onnxmp.training.run.loss_scaler import DynamicLossScaler
from onnxmp.training.run.schedules import Schedule

log = logging.getLogger("onnxmp.training")

__all__ = ["METRICS", "History", "StepResult", "Trainer"]


class Trainer:
    """Train from an :class:`Artifacts` folder (or its path).

    ``scaler`` defaults to :class:`DynamicLossScaler` for float16 artifacts and
    a static scale of 1 otherwise (bfloat16 and float32 have float32's range); a
    mapping of its settings (``{"init_scale": 2**24, "growth_interval": 100}``,
    GradScaler's names) makes one.  After each effective batch the scaler's
    ``check_progress`` raises where no loss scale can help (a NaN loss in float32 or
    bfloat16, non-finite gradients at the scale's floor), so a run never silently
    stops learning.

    ``lr`` sets the optimizer's (base) learning rate (``None``: the lr the artifacts' optimizer was built with).
    ``schedule`` (a :class:`~onnxmp.training.run.schedules.Schedule`, or one of its names with
    ``warmup_steps`` and ``total_steps``) sets it to ``schedule.lr_at(updates, lr)`` before
    each applied update, as Hugging Face's ``get_*_schedule_with_warmup`` steps (per
    effective batch; a skipped update does not advance it); it is saved with the state.
    ``lr_schedule(step)``, a function, does the same but cannot be saved.
    ``clip_global_norm`` clips the unscaled gradients of each effective batch by their
    global L2 norm.  ``threads`` sets the sessions' intra-op threads (0: onnxruntime's
    default, all cores; data-parallel ranks share a host's cores unless given).

    ``communicator`` (a :class:`~onnxmp.training.run.distributed.Communicator` of
    ``W`` ranks) trains data-parallel: each rank runs ``grad_accum_steps``
    micro-batches of its shard per effective batch, and the run equals one
    process with ``grad_accum_steps * W``.  Parameters are broadcast from rank 0
    here; every rank must then make the same calls (``fit``, ``flush``, ``save``,
    ``evaluate``) with the same number of micro-batches (``None`` pads a shard,
    see :func:`~onnxmp.training.run.distributed.shard`).  Wrap the calls in
    :func:`~onnxmp.training.run.distributed.abort_on_error` so that an error on one
    rank ends the job instead of leaving the others waiting.

    ``engine`` runs the graphs: ``native`` (onnxruntime-training 1.19.2, Python <= 3.11),
    ``portable`` (plain onnxruntime, CPU or CUDA EP, on the artifacts' lowered graphs) or
    ``auto`` (native where ``onnxruntime.training`` imports, portable elsewhere; a saved
    state continues on the engine that saved it).
    """

    def __init__(self, artifacts: Artifacts | str | os.PathLike, *, device: str = "cpu",
                 scaler: DynamicLossScaler | None = None, grad_accum_steps: int = 1, lr: float | None = None,
                 lr_schedule: Callable[[int], float] | None = None, clip_global_norm: float | None = None,
                 communicator: Communicator | None = None, engine: str = "auto",
                 schedule: Schedule | str | None = None, warmup_steps: int = 0, total_steps: int | None = None,
                 threads: int | None = None):
        self.comm = communicator if communicator is not None and communicator.size > 1 else None
        self.world_size = 1 if self.comm is None else self.comm.size
        self.rank = 0 if self.comm is None else self.comm.rank
        self.artifacts = artifacts if isinstance(artifacts, Artifacts) else Artifacts.load(artifacts)
        if int(grad_accum_steps) != grad_accum_steps or grad_accum_steps < 1:
            raise OnnxMPError(f"grad_accum_steps must be a positive integer, got {grad_accum_steps}")
        self.device = device
        self.grad_accum_steps = int(grad_accum_steps)
        self.clip_global_norm = None if clip_global_norm is None else float(clip_global_norm)
        self.lr_schedule = lr_schedule
        if isinstance(schedule, str):
            schedule = Schedule(schedule, warmup_steps, total_steps)
        elif schedule is not None and not isinstance(schedule, Schedule):
            raise OnnxMPError(f"schedule must be a Schedule or one of its names, got {type(schedule).__name__}",
                              "pass schedule='linear' with warmup_steps and total_steps, or a Schedule")
        if schedule is not None and lr_schedule is not None:
            raise OnnxMPError("schedule and lr_schedule both set the learning rate", "pass one of them")
        self.schedule = schedule
        if scaler is None:
            scaler = DynamicLossScaler() if self.artifacts.precision == "float16" else DynamicLossScaler.static(1.0)
        elif isinstance(scaler, Mapping):
            scaler = DynamicLossScaler(**scaler)
        self.scaler = scaler
        if threads is not None and (isinstance(threads, bool) or int(threads) != threads or threads < 0):
            raise OnnxMPError(f"threads must be a non-negative integer (0: onnxruntime's default), got {threads!r}")

        self.engine = make_engine(engine, self.artifacts, device,
                                  threads=self._threads() if threads is None else int(threads),
                                  clip_global_norm=self.clip_global_norm)
        if lr is not None:
            self.engine.learning_rate = float(lr)
        self.base_lr = float(lr) if lr is not None else self.engine.learning_rate  # what a schedule multiplies
        self._dtypes = {name: np.dtype(d) for name, d in self.artifacts.manifest["input_dtypes"].items()}

        # Counters; all of them are saved with the state.
        self.optimizer_steps = 0  # applied updates (the engine's own step count moves with it)
        self.skipped_steps = 0  # effective batches whose update was skipped
        self.micro_steps = 0
        self.epoch = 0  # completed fit() epochs
        self._pending = 0  # micro-batches accumulated towards the current effective batch
        self._pending_finite = True
        # Data-parallel: this rank's losses of the current effective batch (None for padding),
        # whether it ran a micro-batch since the last reset, and the last batch's losses, all ranks'.
        self._pending_losses: list[float | None] = []
        self._ran_since_reset = False
        self.last_batch_losses: list[float] = []
        self.communication_seconds = 0.0  # time spent in collectives (the benchmark's share)
        if self.comm is not None:
            self._broadcast_parameters()

    def _threads(self) -> int:
        # Ranks on one host share its cores; ORT's default (all cores per process) oversubscribes them.
        if self.comm is None:
            return 0
        return max(1, (os.cpu_count() or 1) // max(1, self.comm.local_size))

    def _broadcast_parameters(self) -> None:
        """Rank 0's parameters to every rank, one flat buffer per dtype."""
        params = sorted(self.engine.parameters().items())
        by_dtype: dict[np.dtype, list] = {}
        for name, data in params:
            by_dtype.setdefault(data.dtype, []).append((name, data))
        received = {}
        for dtype, group in sorted(by_dtype.items(), key=lambda item: str(item[0])):
            flat = np.concatenate([data.ravel() for _, data in group]) if group else np.zeros(0, dtype)
            self._collective(self.comm.broadcast, np.ascontiguousarray(flat))
            if not self.comm.is_root:
                offset = 0
                for name, data in group:
                    received[name] = flat[offset:offset + data.size].reshape(data.shape)
                    offset += data.size
        if received:
            self.engine.set_parameters(received)

    def _collective(self, call, *args):
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.communication_seconds += time.perf_counter() - start

    # --- stepping ---------------------------------------------------------------------

    def train_step(self, *arrays: np.ndarray) -> StepResult:
        """Run one micro-batch: ``arrays`` in :attr:`Artifacts.inputs` order (model inputs, then labels)."""
        scale = self.scaler.scale
        feeds = self._feeds(arrays)
        feeds[LOSS_SCALE] = np.array(scale, dtype=np.float32)
        # Each micro-batch of the effective batch (all ranks') weighs the same, as in one process.
        feeds[GRAD_WEIGHT] = np.array(1.0 / (self.grad_accum_steps * self.world_size), dtype=np.float32)
        loss, finite = self._run("training", feeds)
        if self.comm is None:
            self.micro_steps += 1
        self._ran_since_reset = True
        return self._count_micro_step(loss, finite, scale)

    def pad_step(self) -> StepResult:
        """A micro-step with no batch: it counts towards the effective batch and adds no gradient.

        Data-parallel ranks pad a short last group with it, so that all run the same
        number of micro-steps (:func:`~onnxmp.training.run.distributed.shard` marks them ``None``).
        """
        return self._count_micro_step(None, True, self.scaler.scale)

    def _count_micro_step(self, loss: float | None, finite: bool, scale: float) -> StepResult:
        self._pending += 1
        self._pending_finite &= finite
        self._pending_losses.append(loss)
        stepped = skipped = False
        if self._pending == self.grad_accum_steps:
            stepped = bool(self._finish_effective_batch())
            skipped = not stepped
        return StepResult(loss=math.nan if loss is None else loss, all_finite=finite, stepped=stepped,
                          loss_scale=scale, skipped=skipped)

    def _finish_effective_batch(self) -> bool | None:
        """Decide on the effective batch; ``None`` when no rank has anything pending."""
        finite = self._pending_finite
        if self.comm is not None:
            finite = self._reduce_effective_batch()
            if finite is None:
                return None
        apply = self.scaler.update(finite)
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
        # Data-parallel: every rank's losses, so that every rank decides alike.
        losses = self._pending_losses if self.comm is None else self.last_batch_losses
        self._pending = 0
        self._pending_finite = True
        self._pending_losses = []
        self._ran_since_reset = False
        self.scaler.check_progress(losses, precision=self.artifacts.precision)
        return apply

    def _reduce_effective_batch(self) -> bool | None:
        """The collectives of one effective batch; returns the all-reduced finite flag.

        First a MIN over ``[finite, buffers exist, pending, -pending]``: every rank
        learns the same decision and that all ran as many micro-steps (a mismatch is
        reported on every rank alike rather than hanging in the next collective).  Then
        one SUM over this rank's gradients (if finite) followed by each micro-batch's
        loss and presence in its rank's slots, zeros elsewhere (so the sum is exact).
        """
        ready = self.engine.gradients_ready()
        meta = np.array([self._pending_finite, ready, self._pending, -self._pending], dtype=np.float64)
        self._collective(self.comm.allreduce_min, meta)
        low, high = int(meta[2]), int(-meta[3])
        if low != high:
            raise OnnxMPError(f"the ranks ran different numbers of micro-batches in one effective batch "
                              f"({low} to {high})", "give every rank the same number of batches per epoch: "
                              "onnxmp.training.run.distributed.shard pads the last group with None")
        if high == 0:
            return None
        finite = bool(meta[0])
        if finite and not meta[1]:
            raise OnnxMPError("a rank reached its first update without having run a micro-batch",
                              "the data has fewer micro-batches than ranks: use fewer ranks or a smaller batch size")
        slots = self.grad_accum_steps * self.world_size
        grads = self.engine.read_gradients() if finite else []
        sizes = [g.size for g in grads]
        total = sum(sizes)
        buffer = np.zeros(total + 2 * slots, dtype=np.float32)
        if finite and self._ran_since_reset:  # a rank that only padded adds zeros, not stale buffers
            offset = 0
            for g, size in zip(grads, sizes):
                buffer[offset:offset + size] = g.ravel()
                offset += size
        first = total + self.rank * self.grad_accum_steps
        for i, loss in enumerate(self._pending_losses):
            if loss is not None:
                buffer[first + i] = loss
                buffer[first + slots + i] = 1.0
        self._collective(self.comm.allreduce_sum, buffer)
        if finite:
            offset, reduced = 0, []
            for g, size in zip(grads, sizes):
                reduced.append(buffer[offset:offset + size].reshape(g.shape))
                offset += size
            self.engine.write_gradients(reduced)
        losses, present = buffer[total:total + slots], buffer[total + slots:]
        self.last_batch_losses = [float(x) for x, p in zip(losses, present) if p]
        self.micro_steps += len(self.last_batch_losses)
        return finite

    def flush(self) -> StepResult | None:
        """Decide on a partly accumulated effective batch now (its gradients weigh ``m/k``).

        Data-parallel, every rank must call it, pending or not."""
        if not self._pending and self.comm is None:
            return None
        if self.comm is not None:
            stepped = self._finish_effective_batch()
            if stepped is None:
                return None
            return StepResult(loss=math.nan, all_finite=stepped, stepped=stepped, loss_scale=self.scaler.scale,
                              skipped=not stepped)
        finite = self._pending_finite
        stepped = self._finish_effective_batch()
        return StepResult(loss=math.nan, all_finite=finite, stepped=stepped, loss_scale=self.scaler.scale,
                          skipped=not stepped)

    # --- loops ------------------------------------------------------------------------

    def fit(self, train_batches: Iterable[Sequence[np.ndarray]] | Callable[[int], Iterable[Sequence[np.ndarray]]],
            epochs: int, eval_batches: Iterable[Sequence[np.ndarray]] | None = None,
            metrics: Sequence[str | tuple[str, Metric]] = (), *, progress: bool = True,
            on_epoch_end: Callable[["Trainer", dict[str, Any]], None] | None = None) -> History:
        """Train until ``epochs`` epochs are complete in total (a resumed trainer continues).

        ``train_batches`` is a re-iterable collection of batches, or a function
        of the epoch index returning one (shuffle there, seeded by the epoch,
        and a resumed run sees the same data).  A partial effective batch left
        at an epoch's end is applied then.  ``on_epoch_end(trainer, summary)``
        runs after each epoch (to save, for example).

        Data-parallel, each rank passes its own shard (``None`` entries pad it) and
        its own eval shard; the history and summaries hold every rank's losses in the
        global order, as one process would record them, and only rank 0 shows a
        progress bar and logs.
        """
        from tqdm.auto import tqdm

        history = History()
        metric_fns = self._metric_functions(metrics)
        for epoch in range(self.epoch, epochs):
            batches = train_batches(epoch) if callable(train_batches) else train_batches
            total = len(batches) if hasattr(batches, "__len__") else None
            bar = tqdm(batches, total=total, desc=f"epoch {epoch + 1}/{epochs}",
                       disable=not progress or self.rank != 0, dynamic_ncols=True)
            loss_sum, loss_count, skipped_before = 0.0, 0, self.skipped_steps

            def record(loss: float, loss_scale: float, skipped: bool) -> None:
                nonlocal loss_sum, loss_count
                history.step_loss.append(loss)
                history.step_loss_scale.append(loss_scale)
                history.step_skipped.append(skipped)
                if math.isfinite(loss):
                    loss_sum += loss
                    loss_count += 1

            def record_batch(loss_scale: float, skipped: bool) -> None:
                # All ranks' micro-batches of the effective batch just decided, in the global order.
                # One process marks a skip on the micro-step that ends a full effective batch; a
                # short last one is decided by flush(), which it does not record.
                losses = self.last_batch_losses
                full = len(losses) == self.grad_accum_steps * self.world_size
                for i, loss in enumerate(losses):
                    record(loss, loss_scale, skipped and full and i == len(losses) - 1)

            for batch in bar:
                result = self.train_step(*batch) if batch is not None else self.pad_step()
                if self.comm is None:
                    record(result.loss, result.loss_scale, result.skipped)
                elif result.stepped or result.skipped:
                    record_batch(result.loss_scale, result.skipped)
                bar.set_postfix(loss=f"{loss_sum / max(loss_count, 1):.4f}", scale=f"{self.scaler.scale:g}",
                                skipped=self.skipped_steps, refresh=False)
            bar.close()
            scale = self.scaler.scale
            if self.flush() is not None and self.comm is not None:
                record_batch(scale, False)
            self.epoch = epoch + 1
            summary = {"epoch": self.epoch, "loss": loss_sum / loss_count if loss_count else math.nan,
                       "loss_scale": self.scaler.scale, "skipped_steps": self.skipped_steps - skipped_before,
                       "optimizer_steps": self.optimizer_steps}
            if eval_batches is not None:
                summary.update({f"eval_{k}": v for k, v in self.evaluate(eval_batches, metric_fns).items()})
            history.epochs.append(summary)
            (log.info if self.rank == 0 else log.debug)("epoch %d: %s", self.epoch,
                     ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in summary.items() if k != "epoch"))
            if on_epoch_end is not None:
                on_epoch_end(self, summary)
        return history

    def evaluate(self, batches: Iterable[Sequence[np.ndarray]],
                 metrics: Sequence[str | tuple[str, Metric]] = ()) -> dict[str, float]:
        """Mean loss and metrics over ``batches``, weighted by batch size.

        A metric is a name from :data:`METRICS` or ``(name, fn(labels, predictions))``;
        predictions are the model's first output.

        Data-parallel, each rank passes its block of the batches (rank 0's first,
        :func:`~onnxmp.training.run.distributed.contiguous_shard`); the per-batch sums are
        gathered and added in that global order, so the result equals one process's.
        """
        metric_fns = self._metric_functions(metrics)
        prediction = self.artifacts.manifest["forward_outputs"][0]
        label = self.artifacts.manifest["label_input"]
        names = [LOSS, *(name for name, _ in metric_fns)]
        rows = []  # per batch: each total times the batch's rows, then the rows
        for batch in batches:
            feeds = self._feeds(batch)
            named = self._run("eval", feeds)
            n = len(feeds[label])
            rows.append([float(named[LOSS]) * n, *(fn(feeds[label], named[prediction]) * n
                                                   for _, fn in metric_fns), n])
        if self.comm is not None:
            rows = self._gather_rows(rows, len(names) + 1)
        totals = dict.fromkeys(names, 0.0)
        count = 0
        for row in rows:
            for name, value in zip(names, row):
                totals[name] += value
            count += row[-1]
        if not count:
            raise OnnxMPError("evaluate() got no batches")
        return {name: value / count for name, value in totals.items()}

    def _gather_rows(self, rows: list[list[float]], width: int) -> list[list[float]]:
        """Every rank's rows, rank 0's first (sums with zeros elsewhere, so exact)."""
        most = self._collective(self.comm.allreduce_max, np.array([len(rows)], dtype=np.int64))[0]
        table = np.zeros((self.world_size, int(most), width), dtype=np.float64)
        if rows:
            table[self.rank, :len(rows)] = rows
        self._collective(self.comm.allreduce_sum, table)
        return [list(row) for block in table for row in block if row[-1] > 0]

    # --- state ------------------------------------------------------------------------

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the current float32 parameters (trainable and frozen), by name."""
        return self.engine.parameters()

    def gradients(self) -> dict[str, np.ndarray]:
        """Copies of the trainable parameters' accumulated gradients, by name.

        After :meth:`train_step` they hold the unscaled gradient of the micro-batches
        accumulated so far, weighted ``1/grad_accum_steps`` each; the engine resets
        them lazily, at the next :meth:`train_step` after an effective batch.
        """
        return self.engine.gradients()

    @property
    def learning_rate(self) -> float:
        return self.engine.learning_rate

    def save(self, path: str | os.PathLike) -> Path:
        """Write a resumable folder: the artifacts plus the engine's state (parameters,
        optimizer state) and the loss scaler's and the loop's (``trainer_state.json``).

        Data-parallel, every rank calls it: rank 0 writes (atomically, as alone) while
        the others wait for it, as their state is the same."""
        if self._pending:
            raise OnnxMPError("cannot save in the middle of an accumulated batch",
                              f"save after a multiple of grad_accum_steps={self.grad_accum_steps} steps, "
                              "or call flush() first")
        if self.comm is not None:
            if self.comm.is_root:
                saving.save(self, path)
            self._collective(self.comm.barrier)
            return Path(path)
        return saving.save(self, path)

    @classmethod
    def resume(cls, path: str | os.PathLike, *, device: str = "cpu",
               lr_schedule: Callable[[int], float] | None = None, communicator: Communicator | None = None,
               **overrides: Any) -> "Trainer":
        """Continue from a folder written by :meth:`save`, bit for bit.

        Saved settings (``grad_accum_steps``, ``clip_global_norm``, the scaler,
        the learning rate) apply unless given in ``overrides``.  A run saved with
        an ``lr_schedule`` must be given it again: a function cannot be saved.
        ``engine`` (in ``overrides``) defaults to the engine that saved the state.

        Data-parallel (``communicator``), every rank reads ``path``.  Another world
        size than the saved one keeps the effective batch (``grad_accum_steps *
        world_size`` micro-batches) when it divides it, so the run continues as it
        would have; otherwise it is refused unless ``grad_accum_steps`` is given.
        """
        artifacts, saved, settings = saving.resume_settings(path, lr_schedule, communicator, overrides)
        base_lr = settings.pop("base_lr", None)
        trainer = cls(artifacts, device=device, lr_schedule=lr_schedule, communicator=communicator, **settings)
        trainer.optimizer_steps = saved["optimizer_steps"]
        trainer.skipped_steps = saved["skipped_steps"]
        trainer.micro_steps = saved["micro_steps"]
        trainer.epoch = saved["epoch"]
        if base_lr is not None and "lr" not in overrides:
            trainer.base_lr = base_lr
        if trainer.comm is not None:
            trainer._check_same_state(path)
        return trainer

    def _check_same_state(self, path) -> None:
        """Refuse (on every rank alike) to go on when the ranks resumed from different states:
        the parameters come from rank 0, but each rank's optimizer moments from its own file."""
        state = np.array([self.optimizer_steps, self.skipped_steps, self.micro_steps, self.epoch,
                          self.scaler.scale, self.scaler.good_steps, self.learning_rate], dtype=np.float64)
        low = self._collective(self.comm.allreduce_min, state.copy())
        high = self._collective(self.comm.allreduce_max, state.copy())
        if not np.array_equal(low, high):
            raise OnnxMPError(f"the ranks resumed from different training states ({path} differs between them)",
                              "give every rank the same saved state (a shared folder, or the same copy on each host)")

    def export_inference(self, path: str | os.PathLike, precision: str = "float16", *,
                         target: str = "cuda") -> Path:
        """Write the trained model for deployment: the original forward model with the
        trained weights, converted by ``onnxmp.convert`` unless ``precision="float32"``."""
        return saving.export_inference(self.artifacts, self.parameters(), path, precision, target=target)

    # --- plumbing ---------------------------------------------------------------------

    def _feeds(self, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        names = self.artifacts.inputs
        if len(arrays) != len(names):
            raise OnnxMPError(f"a batch needs {len(names)} arrays ({', '.join(names)}), got {len(arrays)}")
        manifest = self.artifacts.manifest
        label = manifest["label_input"]
        checked = {}
        for name, array in zip(names, arrays):
            if name == label and isinstance(manifest.get("loss"), str) and manifest["loss"] in LOSSES:
                rows = len(arrays[0]) if len(arrays) > 1 else len(array)
                array = check_labels(manifest["loss"], array, rows=rows, shape=manifest.get("output_shape", []),
                                     options=manifest.get("loss_options"))
            elif np.asarray(array).dtype.kind not in "biuf":
                raise OnnxMPError(f"input {name} has dtype {np.asarray(array).dtype}; the model wants "
                                  f"{self._dtypes[name]}")
            checked[name] = np.ascontiguousarray(array, dtype=self._dtypes[name])
        return checked

    def _metric_functions(self, metrics):
        options = self.artifacts.manifest.get("loss_options") or {}
        return metric_functions(metrics, ignore_index=options.get("ignore_index", IGNORE_INDEX))

    def _run(self, graph: str, feeds: Mapping[str, np.ndarray]):
        try:
            return self.engine.train(feeds) if graph == "training" else self.engine.evaluate(feeds)
        except OnnxMPError:
            raise
        except Exception as exc:  # ORT's errors (RuntimeError natively, pybind's Fail... otherwise)
            raise self._run_error(str(exc), graph) from None

    def _run_error(self, text: str, graph: str) -> OnnxMPError:
        """ORT's run error as a one-line OnnxMPError.  ORT checks the feeds against the graph's
        inputs before it runs a node: only such an error is the batch's fault for sure.  One
        from a node may still come from the batch (labels the loss rejects), or from the graph."""
        err = label_run_error(text, self.artifacts.inputs)
        if err:
            return err
        inputs = (f"inputs are {', '.join(self.artifacts.inputs)} "
                  f"with dtypes {self.artifacts.manifest['input_dtypes']}")
        node = re.search(r"while running (\S+) node\. Name:'([^']*)'", text)
        if node is None:
            return OnnxMPError(f"onnxruntime rejected the batch: {_ort.error_reason(text)}", inputs)
        op_type, name = node.groups()
        if name.startswith(GRAD_SHAPE):
            param = name[len(GRAD_SHAPE):]
            return OnnxMPError(f"onnxruntime computed a gradient of the wrong shape for parameter {param!r}: "
                               f"{_ort.error_reason(text)}",
                               f"one of its gradient builders did not sum it back over a broadcast; train without "
                               f"it (frozen=[{param!r}]) and report the model")
        where = f"{op_type} node {name!r}" if name else f"a {op_type} node onnxruntime added"
        return OnnxMPError(f"onnxruntime failed in {where} of the {graph} graph: {_ort.error_reason(text)}",
                           f"if the batch is right ({inputs}), the artifacts are at fault: rebuild them "
                           "with this onnxmp version, and report the model if it persists")
