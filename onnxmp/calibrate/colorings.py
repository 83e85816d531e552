"""The colorings of the search's candidates, with the work no candidate changes done once.

A candidate ("these nodes back to float32") is scored as the model it writes, so the search needs
the coloring convert would compute with those nodes denied (``driver.written_off``).  Coloring from
scratch costs the type view (vertices, edges) and the seeds that read the weights (initializer
ranges, observed magnitudes) each time: on PP-OCR's classifier 120 colorings took 23 s of a 107 s
calibration.  None of that depends on the forced set: ``color_passes`` runs those seeds first, then
``seed_deny_forced``, then TF's rules.  :class:`Colorings` runs the first part once and starts each
candidate from a copy of that state, so every candidate's coloring is the one :func:`~onnxmp.color.color`
computes (``tests/test_calibrate_release.py`` compares them).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from onnxmp.color import Coloring, color, color_passes, uncolored
from onnxmp.color.seeds import seed_deny_forced
from onnxmp.index import ModelIndex
from onnxmp.options import Resolved
from onnxmp.passes import FunctionPass, PassManager
from onnxmp.pipeline import ACCURACY_FALLBACK

log = logging.getLogger("onnxmp.calibrate")

_FIRST_RULE = "add_allow_ops"  # the first of TF's rules: every pass before it is a seed


def _copy(state: Coloring) -> Coloring:
    """A coloring that the passes can paint without touching ``state`` (the view is read-only to them)."""
    return Coloring(state.view, colors=dict(state.colors), low_name=state.low_name, low_groups=list(state.low_groups),
                    mask_fills=dict(state.mask_fills), group_notes=dict(state.group_notes))


def allow_nodes(state: Coloring) -> frozenset[str]:
    """The nodes with a vertex that ends low precision (what ``vertex_rows`` lists as ``allow``)."""
    view = state.view
    return frozenset(v.node for v in view.by_id if (v.float32 or not v.type_known) and state.is_allow(v.id))


class Colorings:
    """``low(forced)``: the nodes left low when ``forced`` nodes are denied on top of ``options``,
    cached by forced set; ``cached=False`` colors from scratch each time (the reference)."""

    def __init__(self, index: ModelIndex, options: Resolved, cached: bool = True):
        self.index, self.options = index, options
        self.seconds = 0.0
        self._memo: dict[frozenset[str], frozenset[str]] = {}
        self._seeded: Coloring | None = None
        self._rules: list = []
        if cached:
            passes = color_passes(index, options)
            names = [p.name for p in passes]
            first = names.index(_FIRST_RULE) if _FIRST_RULE in names else None
            # The split holds only while the forced seed is the last seed: anything else, color from scratch.
            if first is not None and "seed_deny_forced" not in names[first:]:
                seeds = [p for p in passes[:first] if p.name != "seed_deny_forced"]
                self._seeded = uncolored(index, options)
                PassManager(seeds, log=log)(self._seeded)
                self._rules = passes[first:]

    def __len__(self) -> int:
        return len(self._memo)

    def coloring(self, forced: Iterable[str]) -> Coloring:
        causes = {**self.options.forced_deny, **dict.fromkeys(forced, ACCURACY_FALLBACK)}
        if self._seeded is None:
            return color(self.index, self.options.replace(forced_deny=causes))
        state = _copy(self._seeded)
        passes = [FunctionPass(seed_deny_forced, causes)] if causes else []
        PassManager([*passes, *self._rules], log=log)(state)
        return state

    def low(self, forced: Iterable[str]) -> frozenset[str]:
        key = frozenset(forced)
        if key not in self._memo:
            start = time.perf_counter()
            self._memo[key] = allow_nodes(self.coloring(key))
            self.seconds += time.perf_counter() - start
        return self._memo[key]


__all__ = ["Colorings", "allow_nodes"]
