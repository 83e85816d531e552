"""Stage 4: rewrite.  Apply a coloring to the model (``docs/design.md``, the rewrite).

* Output tensors of ALLOW vertices are retyped to the low-precision type.
* At each boundary one Cast per (source tensor, target type) is shared by every consumer
  that needs it in any graph, placed right after the producer in the innermost graph holding
  them all, out of loop bodies; Casts that cancel or that fewer Casts can replace are not added
  (:mod:`~onnxmp.rewrite.casts`, :mod:`~onnxmp.rewrite.branches`, :mod:`~onnxmp.rewrite.moves`).
* Initializers read only by ALLOW vertices are stored in low precision; one read by both
  sides keeps its float32 original and gets a low-precision twin.  Master weights
  (training) always stay float32 and are Cast at use.
* Tensors whose name the outside world sees (graph inputs and outputs kept by
  ``keep_io_types``, body formal inputs and outputs) keep their
  name and type: the low-precision producer writes a renamed tensor and a Cast restores it.

:mod:`~onnxmp.rewrite.plan` decides the edits, :mod:`~onnxmp.rewrite.write` applies them.
"""
from __future__ import annotations

from typing import AbstractSet, Iterable

import onnx

from onnxmp.color.rules import Coloring
from onnxmp.index import ModelIndex
from onnxmp.precision import Precision
from onnxmp.rewrite.plan import Edits, RewriteStats, plan
from onnxmp.rewrite.write import write

__all__ = ["Edits", "RewriteStats", "plan", "rewrite", "write"]


def rewrite(index: ModelIndex, coloring: Coloring, *, precision: Precision, master_weights: Iterable[str] = (),
            keep_io_types: bool | AbstractSet[str] = True) -> tuple[onnx.ModelProto, RewriteStats]:
    """The converted model (``index.model``, edited in place) and what the rewrite did; the
    stats list only the inserted Casts the writer kept (a restore Cast nobody reads goes)."""
    edits, stats = plan(index, coloring, precision=precision, master_weights=master_weights,
                        keep_io_types=keep_io_types)
    model, kept = write(index, edits)
    stats.casts = [name for name in stats.casts if name in kept]
    return model, stats
