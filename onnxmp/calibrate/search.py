"""The search behind calibration: which low-precision nodes must go back to float32.

The algorithm only; candidates are scored by an :class:`Oracle` over any ``evaluate``
(calibration's runs the :mod:`~onnxmp.calibrate.switchboard`).

:func:`find_fp32_set` finds a small set of nodes to keep in float32 so that
the candidate passes, by bisection over a ranking (Zeller's delta debugging,
specialised to prefixes).  Invariant: ``D ∪ order[:hi]`` passes (all of
``order`` denied is float32, which passes).  While ``D`` alone fails, binary
search the smallest ``hi`` with ``D ∪ order[:hi]`` passing; ``order[hi - 1]``
is then necessary given the rest, so it joins ``D`` and ``hi`` shrinks by one.
A last pass drops members that later finds made redundant.

**Bound.**  Let ``N`` be the number of candidate nodes and suppose the
candidate passes exactly when a set ``K`` of ``k`` culprits is denied (more
float32 never hurts).  Each bisection returns a member of ``K``, so ``k``
rounds run; each costs one check of ``D`` plus at most ``ceil(log2 N)``
bisection runs; then one check that ``D`` passes and one pruning run per
member.  With the ``ceil(log2 N)`` segment runs of the ranking and two
measurements of real models (plain conversion, and the confirmation)::

    runs <= 3 + ceil(log2 N) + k * (ceil(log2 N) + 2)
         <= RUNS_C * k * log2(N)   with RUNS_C = 5, for N >= 4, k >= 1.

When the error is spread over many nodes (more than ``ceil(log2 N) + 1`` rounds),
the search returns the culprits found plus the smallest passing prefix of the
ranking rather than bisecting node by node, so a cycle costs at most about
``(ceil(log2 N) + 2) ** 2`` runs whatever k is.  ``max_runs`` caps the total.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("onnxmp.search")

RUNS_C = 5


def run_bound(candidates: int, culprits: int) -> float:
    """The documented worst case ``RUNS_C * k * log2(N)`` (see the module docstring)."""
    return RUNS_C * max(culprits, 1) * math.log2(max(candidates, 4))


class BudgetExhausted(Exception):
    """Raised by :class:`Oracle` when ``max_runs`` candidates have been run."""


@dataclass
class Probe:
    fp32: frozenset[str]
    score: float  # worst error / tolerance; <= 1 passes

    @property
    def passed(self) -> bool:
        return self.score <= 1.0


@dataclass
class Oracle:
    """Scores candidates (sets of nodes back in fp32), caching repeats and counting runs."""

    evaluate: Callable[[frozenset[str]], float]
    max_runs: int
    runs: int = 0
    on_run: Callable[[Probe], None] | None = None
    cache: dict[frozenset[str], Probe] = field(default_factory=dict)
    # ``evaluate`` may stop at the first failing sample (its score of a failing candidate is then a
    # lower bound); ``full`` scores every sample, for the figures the report prints.
    full: Callable[[frozenset[str]], float] | None = None
    deadline: float | None = None  # time.perf_counter() after which no new candidate runs (--time-budget)
    exact: dict[frozenset[str], float] = field(default_factory=dict)

    def _spend(self) -> None:
        if self.runs >= self.max_runs or (self.deadline is not None and time.perf_counter() > self.deadline):
            raise BudgetExhausted
        self.runs += 1

    def __call__(self, fp32: Iterable[str]) -> Probe:
        key = frozenset(fp32)
        if key not in self.cache:
            self._spend()
            self.cache[key] = Probe(key, self.evaluate(key))
            if self.on_run is not None:
                self.on_run(self.cache[key])
        return self.cache[key]

    def score(self, fp32: Iterable[str]) -> float:
        """The candidate's score over every sample (one more run when the cached one stopped early)."""
        probe = self(fp32)
        if self.full is None or probe.passed:  # a passing candidate ran every sample
            return probe.score
        if probe.fp32 not in self.exact:
            self._spend()
            self.exact[probe.fp32] = self.full(probe.fp32)
        return self.exact[probe.fp32]

    def best_passing(self, weight: Callable[[frozenset[str]], Any]) -> Probe | None:
        """The passing candidate that gives up the least (by ``weight``), then the lowest score."""
        passing = [p for p in self.cache.values() if p.passed]
        return min(passing, key=lambda p: (weight(p.fp32), p.score), default=None)


@dataclass
class Culprit:
    node: str
    score_with: float | None  # score with this node low, the rest of the set in fp32 (None: not measured alone)
    score_without: float  # score with the whole set in fp32


def segment_ranking(nodes: Sequence[str], oracle: Oracle, heavy: Callable[[str], bool]) -> tuple[list[str],
                                                                                                 list[float]]:
    """Rank nodes by the OUTPUT error of their topological segment run alone in low precision.

    ``ceil(log2 N)`` segments, each measured with every other node in float32, so
    error created in one place and amplified downstream (or underflow ahead of a
    float32 Log) is charged to the segment that creates it, whatever its local
    error looks like.  Within a segment, nodes that are not Conv/MatMul/Gemm come
    first so the search prefers giving up cheap ops.
    """
    n = len(nodes)
    count = min(n, max(1, math.ceil(math.log2(n)))) if n > 1 else 1
    bounds = [round(i * n / count) for i in range(count + 1)]
    segments = [list(nodes[bounds[i]:bounds[i + 1]]) for i in range(count)]
    everything = frozenset(nodes)
    scores = []
    for seg in segments:
        if count == 1:
            scores.append(math.inf)
            break
        scores.append(oracle(everything - frozenset(seg)).score)
    position = {name: i for i, name in enumerate(nodes)}
    ranked = sorted(range(count), key=lambda i: (-scores[i], i))
    order = [name for i in ranked for name in sorted(segments[i], key=lambda m: (heavy(m), position[m]))]
    return order, scores


def find_fp32_set(order: Sequence[str], oracle: Oracle, fixed: Iterable[str] = (),
                  max_rounds: int | None = None, gallop: bool = False) -> list[Culprit]:
    """A small set of ``order``'s nodes whose return to float32 makes the candidate pass.

    ``fixed`` nodes are in float32 throughout.  After ``max_rounds`` rounds
    (default ``ceil(log2 N) + 1``) without passing, the error is spread over many
    nodes rather than held by a few culprits; bisecting node by node would cost
    ``log2 N`` runs per node, so the search returns the culprits found plus the
    smallest passing prefix of the ranking (the bisection invariant) instead,
    keeping the runs at ``O(log2(N) ** 2)``.  Raises :class:`BudgetExhausted`
    from the oracle; callers then fall back on ``oracle.best_passing``.
    """
    base = frozenset(fixed)
    if max_rounds is None:
        max_rounds = math.ceil(math.log2(max(len(order), 2))) + 1
    chosen: list[str] = []
    prefix: list[str] = []
    hi = len(order)
    while not oracle(base | frozenset(chosen)).passed:
        if hi == 0:
            break  # nothing left to give (only when more float32 can hurt: not monotone)
        if len(chosen) >= max_rounds:
            prefix = list(order[:hi])  # with ``chosen`` it passes: the bisection's invariant
            break
        lo = 0
        denied = base | frozenset(chosen)
        # Galloping from the top of the ranking first: a culprit the attribution ranked at position p
        # costs about 2 log2(p) runs instead of log2(N).
        step = 1
        while gallop and step < hi - 1:
            if oracle(denied | frozenset(order[:step])).passed:
                hi = step
                break
            lo, step = step, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if oracle(denied | frozenset(order[:mid])).passed:
                hi = mid
            else:
                lo = mid
        chosen.append(order[hi - 1])
        hi -= 1
    # One-minimal: later finds (ranked higher) may make earlier ones redundant.
    result: list[Culprit] = []
    keep = list(chosen)
    base |= frozenset(prefix)
    for name in list(chosen):
        rest = base | frozenset(m for m in keep if m != name)
        trial = oracle(rest)
        if trial.passed:
            keep.remove(name)
        else:
            result.append(Culprit(name, oracle.score(rest), oracle.score(rest | {name})))
    if prefix:
        passing = oracle.score(base | frozenset(keep))
        result += [Culprit(name, None, passing) for name in prefix]
    return result

