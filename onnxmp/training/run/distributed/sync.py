"""The Trainer's collectives: one :class:`GradientSync` per trainer, itself (no-ops) for a single
process, :class:`DataParallelSync` on a :class:`~onnxmp.training.run.distributed.Communicator`.

The Trainer calls the same methods either way: it never asks how many ranks there are.  A run on
``W`` ranks with ``k`` micro-batches each equals one process accumulating ``k * W``
(docs/distributed.md): each micro-batch's gradient weighs ``1 / (k * W)`` (:attr:`world_size`), and
per effective batch :meth:`GradientSync.reduce` all-reduces the finite flag (MIN), then the
gradients as one flat buffer (SUM), which it writes back into the engine's buffers before the
optimizer step, so the clipping in the optimizer graph sees the reduced gradients.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import numpy as np

from onnxmp.errors import OnnxMPError
from onnxmp.training.run.distributed.communicator import Communicator
from onnxmp.training.run.engines.base import Engine

T = TypeVar("T")


@dataclass
class Pending:
    """The micro-batches accumulated towards the current effective batch on this rank."""

    count: int = 0
    finite: bool = True
    losses: list[float | None] = field(default_factory=list)  # None: a padding micro-step
    ran: bool = False  # whether a micro-batch ran since the last reset (padding does not)

    def add(self, loss: float | None, finite: bool) -> None:
        self.count += 1
        self.finite &= finite
        self.losses.append(loss)
        self.ran |= loss is not None


@dataclass
class Decision:
    """An effective batch as every rank sees it: the all-reduced finite flag and every rank's
    losses in the global order (``others``: how many of them other ranks ran)."""

    finite: bool
    losses: list[float]
    others: int = 0


class GradientSync:
    """What a trainer asks of the other ranks; alone, nothing (this class)."""

    rank, world_size, is_root, local_size = 0, 1, True, 1

    def __init__(self):
        self.communication_seconds = 0.0  # time spent in collectives (the benchmark's share)

    def threads(self) -> int:
        """Default intra-op threads of a rank: ranks on one host share its cores; ORT's default (all
        cores per process) oversubscribes them.  0: onnxruntime's default."""
        return 0

    def broadcast_parameters(self, engine: Engine) -> None:
        """Rank 0's parameters to every rank."""

    def reduce(self, engine: Engine, pending: Pending, grad_accum_steps: int) -> Decision | None:
        """The effective batch's decision; ``None`` when no rank has anything pending."""
        if not pending.count:
            return None
        return Decision(pending.finite, [loss for loss in pending.losses if loss is not None])

    def gather_rows(self, rows: list[list[float]], width: int) -> list[list[float]]:
        """Every rank's rows (eval sums), rank 0's first."""
        return rows

    def check_same_state(self, state: Sequence[float], where: str) -> None:
        """Refuse (on every rank alike) to go on when the ranks hold different ``state``."""

    def on_root(self, call: Callable[[], T]) -> T | None:
        """``call()`` on rank 0 while the others wait for it (a write all ranks would make alike)."""
        return call()


class DataParallelSync(GradientSync):
    def __init__(self, comm: Communicator):
        super().__init__()
        self.comm = comm
        self.rank, self.world_size, self.is_root = comm.rank, comm.size, comm.is_root
        self.local_size = comm.local_size

    def _collective(self, call, *args):
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.communication_seconds += time.perf_counter() - start

    def threads(self) -> int:
        return max(1, (os.cpu_count() or 1) // max(1, self.local_size))

    def broadcast_parameters(self, engine: Engine) -> None:
        """One flat buffer per dtype."""
        params = sorted(engine.parameters().items())
        by_dtype: dict[np.dtype, list] = {}
        for name, data in params:
            by_dtype.setdefault(data.dtype, []).append((name, data))
        received = {}
        for dtype, group in sorted(by_dtype.items(), key=lambda item: str(item[0])):
            flat = np.concatenate([data.ravel() for _, data in group]) if group else np.zeros(0, dtype)
            self._collective(self.comm.broadcast, np.ascontiguousarray(flat))
            if not self.is_root:
                offset = 0
                for name, data in group:
                    received[name] = flat[offset:offset + data.size].reshape(data.shape)
                    offset += data.size
        if received:
            engine.set_parameters(received)

    def reduce(self, engine: Engine, pending: Pending, grad_accum_steps: int) -> Decision | None:
        """First a MIN over ``[finite, buffers exist, pending, -pending]``: every rank learns the same
        decision and that all ran as many micro-steps (a mismatch is reported on every rank alike
        rather than hanging in the next collective).  Then one SUM over this rank's gradients (if
        finite) followed by each micro-batch's loss and presence in its rank's slots, zeros
        elsewhere (so the sum is exact)."""
        ready = engine.gradients_ready()
        meta = np.array([pending.finite, ready, pending.count, -pending.count], dtype=np.float64)
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
        slots = grad_accum_steps * self.world_size
        grads = engine.read_gradients() if finite else []
        sizes = [g.size for g in grads]
        total = sum(sizes)
        buffer = np.zeros(total + 2 * slots, dtype=np.float32)
        if finite and pending.ran:  # a rank that only padded adds zeros, not stale buffers
            offset = 0
            for g, size in zip(grads, sizes):
                buffer[offset:offset + size] = g.ravel()
                offset += size
        first = total + self.rank * grad_accum_steps
        for i, loss in enumerate(pending.losses):
            if loss is not None:
                buffer[first + i] = loss
                buffer[first + slots + i] = 1.0
        self._collective(self.comm.allreduce_sum, buffer)
        if finite:
            offset, reduced = 0, []
            for g, size in zip(grads, sizes):
                reduced.append(buffer[offset:offset + size].reshape(g.shape))
                offset += size
            engine.write_gradients(reduced)
        losses, present = buffer[total:total + slots], buffer[total + slots:]
        everyone = [float(x) for x, p in zip(losses, present) if p]
        mine = sum(loss is not None for loss in pending.losses)
        return Decision(finite, everyone, len(everyone) - mine)

    def gather_rows(self, rows: list[list[float]], width: int) -> list[list[float]]:
        """Sums with zeros elsewhere, so exact."""
        most = self._collective(self.comm.allreduce_max, np.array([len(rows)], dtype=np.int64))[0]
        table = np.zeros((self.world_size, int(most), width), dtype=np.float64)
        if rows:
            table[self.rank, :len(rows)] = rows
        self._collective(self.comm.allreduce_sum, table)
        return [list(row) for block in table for row in block if row[-1] > 0]

    def check_same_state(self, state: Sequence[float], where: str) -> None:
        state = np.array(state, dtype=np.float64)
        low = self._collective(self.comm.allreduce_min, state.copy())
        high = self._collective(self.comm.allreduce_max, state.copy())
        if not np.array_equal(low, high):
            raise OnnxMPError(f"the ranks resumed from different training states ({where} differs between them)",
                              "give every rank the same saved state (a shared folder, or the same copy on each host)")

    def on_root(self, call: Callable[[], T]) -> T | None:
        result = call() if self.is_root else None
        self._collective(self.comm.barrier)
        return result


def gradient_sync(communicator: Communicator | None) -> GradientSync:
    """The sync of ``communicator``'s ranks; alone (None, or a world of one) the no-op one."""
    if communicator is None or communicator.size <= 1:
        return GradientSync()
    return DataParallelSync(communicator)
