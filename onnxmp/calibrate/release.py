"""The release step: Conv/MatMul/Gemm the landed set keeps in float32 go back to low precision where
the tolerance allows, and the proof for those that cannot (``docs/calibration.md``).

The bisection finds a set that passes, not the one that keeps the most Conv/MatMul/Gemm in float16:
an error spread over many nodes ends in a passing prefix of the ranking, and an island of more than
``EXHAUSTIVE_HEAVY`` of them is too many for every subset.  :func:`release_heavy` takes the set once
it passes and, on the same oracle (the switchboard scoring each candidate as the model it writes):

1. tries every member back in low precision at once (one run);
2. else tries them one at a time, least blamed first (the attribution ranking read backwards),
   keeping each release that still passes;
3. re-measures every member kept that was tried before a later release, against the final set:
   one that now passes is released too, and the pass repeats.

What is left is the proof the report prints: for each Conv/MatMul/Gemm still in float32, the tuning
error with it alone back in low precision and everything else as written, above the tolerance.
A failing candidate's error may stop at the first failing sample, so the figure is a lower bound
("at least"), which is all a proof of failure needs.  Cost: ``1 + m`` runs for ``m`` members plus
the re-measures.

The driver calls it twice: in each cycle over that cycle's set, and once the search lands over every
Conv/MatMul/Gemm the landed model forces, whichever cycle forced it (``driver.release_landed``); the
second record is the one reported, with the Conv/MatMul/Gemm that the coloring itself keeps in fp32
(:class:`RuledHeavy`), so the proof covers every one the written model computes in fp32.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from onnxmp.calibrate.search import BudgetExhausted, Oracle

log = logging.getLogger("onnxmp.calibrate")


@dataclass
class KeptHeavy:
    """A Conv/MatMul/Gemm the release step kept in float32, and the measurement that says why."""

    node: str
    op: str
    error_released: float  # tuning error (at least) with it back in low precision, the rest as the final set


@dataclass
class RuledHeavy:
    """A Conv/MatMul/Gemm in float32 that no release can try: the coloring keeps it there for a reason
    that is not the search's (a range or calibration seed, a rule such as one type through a fused
    normalization), which the written model must honour."""

    node: str
    op: str
    reason: str  # the coloring's rule and cause


@dataclass
class ReleaseRecord:
    """What the release step tried, freed and kept (``proven``: every kept member was measured failing
    against the final set; False when the run budget stopped it first, or when the release's model
    missed its confirmation and the set before it was kept, ``note`` saying so)."""

    members: int  # Conv/MatMul/Gemm in the landed set
    released: list[str] = field(default_factory=list)
    kept: list[KeptHeavy] = field(default_factory=list)
    runs: int = 0
    error: float | None = None  # tuning error of the final set
    proven: bool = False
    ruled: list[RuledHeavy] = field(default_factory=list)  # fp32 by the coloring, not by the search
    landed: bool = False  # over every Conv/MatMul/Gemm the landed model keeps in fp32, all cycles
    note: str | None = None

    def summary_lines(self, precision: str, tolerance: float, rows: int) -> list[str]:
        lines = []
        if self.members:
            scope = "the calibrated model kept in fp32 (all cycles)" if self.landed else "the search kept in fp32"
            lines.append(f"  release: {len(self.released)} of the {self.members} Conv/MatMul/Gemm {scope} "
                         f"went back to {precision} ({self.runs} run(s))")
        if self.note:
            lines.append(f"  release not kept: {self.note}")
        if self.kept:
            proof = ("each breaks the tolerance back in " + precision if self.proven
                     else "measured against a set that was not kept" if self.note
                     else "not all measured: the run budget ran out")
            lines.append(f"  kept in fp32: {len(self.kept)} ({proof}; tuning error with it alone back, "
                         f"tolerance {tolerance:g}):")
            lines += _first(rows, [f"    {k.node} ({k.op}): >= {k.error_released:.3g}" for k in self.kept])
        if self.ruled:
            lines.append(f"  kept in fp32 by the coloring, not the search: {len(self.ruled)}")
            lines += _first(rows, [f"    {r.node} ({r.op}): {r.reason}" for r in self.ruled])
        return lines


def _first(rows: int, lines: list[str]) -> list[str]:
    """The first ``rows`` lines, and how many more the report JSON holds."""
    more = [f"    ... and {len(lines) - rows} more (see --report JSON)"] if len(lines) > rows else []
    return lines[:rows] + more


def release_heavy(fp32: Sequence[str], heavy: frozenset[str], order: Sequence[str], oracle: Oracle,
                  ops: dict[str, str], tolerance: float) -> tuple[list[str], ReleaseRecord]:
    """``fp32`` (a passing set) less the Conv/MatMul/Gemm that can go back to low precision, and the
    record.  ``order``: the attribution ranking (most blamed first); ``ops``: node -> op type."""
    rank = {name: i for i, name in enumerate(order)}
    members = sorted((m for m in fp32 if m in heavy), key=lambda m: -rank.get(m, -1))
    record = ReleaseRecord(len(members))
    current = set(fp32)
    before = oracle.runs
    failed: dict[str, tuple[float, int]] = {}  # member -> (score, releases made when it was measured)
    try:
        if not members:
            return list(fp32), record
        if oracle(current - set(members)).passed:
            current -= set(members)
            record.released = list(members)
        else:
            pending = list(members)
            while pending:
                for name in pending:
                    probe = oracle(current - {name})
                    if probe.passed:
                        current.discard(name)
                        record.released.append(name)
                        failed.pop(name, None)
                    else:
                        failed[name] = (probe.score, len(record.released))
                # Measured before a later release: the final set has more in low precision, so measure again.
                pending = [n for n, (_, made) in failed.items() if made < len(record.released)]
        record.kept = [KeptHeavy(n, ops.get(n, ""), failed[n][0] * tolerance) for n in members if n in failed]
        record.proven = True
    except BudgetExhausted:
        record.kept = [KeptHeavy(n, ops.get(n, ""), failed[n][0] * tolerance) for n in members
                       if n in current and n in failed]
        log.info("calibration: the run budget ran out during the release step")
    finally:
        record.runs = oracle.runs - before
    landed = oracle.cache.get(frozenset(current))
    record.error = None if landed is None else landed.score * tolerance
    if record.released:
        log.info("calibration: released %d of %d Conv/MatMul/Gemm back to low precision",
                 len(record.released), len(members))
    return [m for m in fp32 if m in current], record


__all__ = ["KeptHeavy", "ReleaseRecord", "RuledHeavy", "release_heavy"]
