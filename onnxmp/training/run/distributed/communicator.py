"""Data-parallel training: the communicator interface, its MPI backend, and the data sharding.

A run on ``W`` ranks with ``k`` micro-batches per rank equals one process
accumulating ``k * W`` micro-batches (see docs/distributed.md):

* every rank builds the same global list of micro-batches (same seed) and
  takes its shard with :func:`shard`: in each group of ``k * W`` consecutive
  micro-batches, rank ``r`` runs the ``k`` at positions ``r*k .. r*k+k-1``;
  a last, short group is padded with ``None`` (a micro-batch that contributes
  no gradient), so every rank runs the same number of micro-steps and the
  collectives line up, and nothing is dropped;
* each micro-batch's gradient weighs ``1 / (k * W)``, as in the one process;
* per effective batch, the trainer all-reduces the finite flag (MIN), then
  the gradients as one flat buffer (SUM), which it writes back into ORT's
  buffers before ``optimizer.step()``.

The MPI backend uses mpi4py (``pip install onnxmp[distributed]`` brings it
with the ``mpich`` wheel), imported only when a world of more than one rank
is detected or asked for.  Another backend (``torch.distributed``) only has
to implement :class:`Communicator`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from abc import ABC, abstractmethod
from typing import Iterator, Sequence, TypeVar

import numpy as np

from onnxmp.errors import OnnxMPError

log = logging.getLogger("onnxmp.training.run.distributed")

ABORT_DRAIN_S = 0.5  # how long a failing rank waits for its last stderr line to reach mpiexec

T = TypeVar("T")

# Set by launchers: MPICH/Hydra and Intel MPI (PMI_*), Open MPI (OMPI_*), Slurm's srun with PMI (PMI_*).
_WORLD_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")

_INSTALL_HINT = 'install the MPI backend: pip install "onnxmp[distributed]" (mpi4py with the mpich wheel)'


class Communicator(ABC):
    """The collectives data-parallel training needs, on numpy arrays.

    Every call is collective: all ranks make the same calls in the same order,
    with arrays of the same shape and dtype.  The reductions work in place on
    ``array`` (a contiguous numpy array) and return it.
    """

    rank: int
    size: int
    #: ranks on this host (to share its cores between them)
    local_size: int = 1

    @abstractmethod
    def allreduce_sum(self, array: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def allreduce_min(self, array: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def allreduce_max(self, array: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray: ...

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (after this rank's error has been reported)."""

    @property
    def is_root(self) -> bool:
        return self.rank == 0


class MPICommunicator(Communicator):
    """MPI through mpi4py (``COMM_WORLD`` unless another communicator is given)."""

    def __init__(self, comm=None):
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise OnnxMPError(f"data-parallel training needs mpi4py, which cannot be imported: {exc}",
                              _INSTALL_HINT) from None
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_size = local.Get_size()
        local.Free()

    def _reduce(self, array: np.ndarray, op) -> np.ndarray:
        _check_contiguous(array)
        self.comm.Allreduce(self._MPI.IN_PLACE, array, op=op)
        return array

    def allreduce_sum(self, array: np.ndarray) -> np.ndarray:
        return self._reduce(array, self._MPI.SUM)

    def allreduce_min(self, array: np.ndarray) -> np.ndarray:
        return self._reduce(array, self._MPI.MIN)

    def allreduce_max(self, array: np.ndarray) -> np.ndarray:
        return self._reduce(array, self._MPI.MAX)

    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        _check_contiguous(array)
        self.comm.Bcast(array, root=root)
        return array

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, code: int = 1) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)

    def __repr__(self) -> str:
        return f"MPICommunicator(rank={self.rank}, size={self.size})"


def _check_contiguous(array: np.ndarray) -> None:
    if not (isinstance(array, np.ndarray) and array.flags.c_contiguous and array.flags.writeable):
        raise OnnxMPError("a collective needs a writable, C-contiguous numpy array")


def launched_world_size(environ=os.environ) -> int:
    """The world size a launcher (mpiexec, srun) announced in the environment; 1 when none did."""
    for name in _WORLD_SIZE_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def from_environment(backend: str = "auto") -> Communicator | None:
    """The communicator of the job this process was launched in, or ``None`` when it runs alone.

    ``auto`` uses MPI when a launcher announced more than one rank, and imports
    nothing otherwise; ``mpi`` asks for MPI (a world of one included); ``none``
    runs alone whatever the environment says.
    """
    if backend not in ("auto", "mpi", "none"):
        raise OnnxMPError(f"unknown communication backend {backend!r}", "use auto, mpi or none")
    if backend == "none" or (backend == "auto" and launched_world_size() <= 1):
        return None
    comm = MPICommunicator()
    if comm.size <= 1 and backend == "auto":
        return None
    return comm


def shard(batches: Sequence[T], rank: int, size: int, per_rank: int) -> list[T | None]:
    """Rank ``rank``'s micro-batches out of the global list, ``per_rank`` per effective batch.

    Group ``g`` of the global list (``per_rank * size`` micro-batches) gives rank
    ``r`` its micro-batches ``r*per_rank .. (r+1)*per_rank - 1``; a short last
    group is padded with ``None``, so every rank gets the same count.
    """
    if not 0 <= rank < size or per_rank < 1:
        raise OnnxMPError(f"no shard {rank} of {size} with {per_rank} micro-batches per rank")
    group = per_rank * size
    result: list[T | None] = []
    for start in range(0, len(batches), group):
        for i in range(per_rank):
            j = start + rank * per_rank + i
            result.append(batches[j] if j < len(batches) else None)
    return result


def contiguous_shard(items: Sequence[T], rank: int, size: int) -> list[T]:
    """Rank ``rank``'s block of ``items`` (blocks in rank order, sizes differing by at most one)."""
    n = len(items)
    start, stop = rank * n // size, (rank + 1) * n // size
    return list(items[start:stop])


@contextlib.contextmanager
def abort_on_error(comm: Communicator | None, report=None) -> Iterator[None]:
    """Inside the block, an exception on one rank ends the whole job.

    The others may be waiting in a collective that will never complete, so
    raising alone would hang them: the error is reported here (``report(exc)``,
    or logged), then :meth:`Communicator.abort` ends every rank with a
    non-zero status.  Alone (``comm`` is None or of one rank) it changes nothing.
    """
    if comm is None or comm.size <= 1:
        yield
        return
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 (SystemExit and ^C too: the others would wait forever)
        code = 1
        try:
            if report is not None:
                code = report(exc)
            else:
                log.error("rank %d of %d failed: %s", comm.rank, comm.size, exc)
        finally:
            code = int(code) if isinstance(code, int) and code else 1
            # mpiexec forwards each rank's stderr asynchronously, and MPI_Abort kills the forwarder
            # too: without a moment to drain, the one line saying why was lost under load.
            sys.stderr.flush()
            time.sleep(ABORT_DRAIN_S)
            comm.abort(code)
            # MPICH's MPI_Abort can return to a caller that is handling an exception (seen with
            # mpi4py 4.1 and MPICH 5.0); the job is ending, so leave without Python's traceback.
            os._exit(code)
