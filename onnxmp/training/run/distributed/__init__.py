"""Data-parallel training (docs/distributed.md)."""
from __future__ import annotations

from onnxmp.training.run.distributed.communicator import (ABORT_DRAIN_S, Communicator, MPICommunicator,
                                                          abort_on_error, contiguous_shard, from_environment,
                                                          launched_world_size, shard)

__all__ = ["ABORT_DRAIN_S", "Communicator", "MPICommunicator", "abort_on_error", "contiguous_shard",
           "from_environment", "launched_world_size", "shard"]
