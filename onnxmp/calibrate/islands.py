"""Shaping the float32 set the bisection found into cheap islands (``docs/calibration.md``).

The bisection returns a small set of nodes whose return to float32 makes the
candidate pass.  Two refinements, each checked on the switchboard:

* :func:`spare_heavy`: a Conv/MatMul/Gemm in the set is given back to float16
  wherever the cheap ops around it (every other candidate that is not
  Conv/MatMul/Gemm, in float32) suffice.  The Conv/MatMul/Gemm members are tried
  exhaustively (every subset, fewest kept in float32 first, up to
  ``EXHAUSTIVE_HEAVY`` of them), so when the share cannot rise, the one found is
  the best achievable over the ranked candidates; more of them (a spread
  error's passing prefix, a large island) are left to the release step
  (:mod:`onnxmp.calibrate.release`).  The cheap part is then shrunk again by
  the bisection.
* :func:`fewer_casts`: a cheap node whose every low-precision neighbour is in
  float32 (an activation or a Reshape between two float32 nodes) costs a Cast
  on each side; it joins the float32 island when the candidate still passes.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx

from onnxmp.calibrate.search import Oracle, find_fp32_set
from onnxmp.calibrate.switchboard import LowNode

EXHAUSTIVE_HEAVY = 5  # 2 ** 5 - 1 candidates at most; more Conv/MatMul/Gemm members go to the release step


@dataclass
class HeavyCheck:
    """What the exhaustive pass over the set's Conv/MatMul/Gemm members found."""

    members: int  # Conv/MatMul/Gemm in the bisection's set
    kept_fp32: int  # the fewest of them a passing candidate needs (the best achievable over the ranking)
    candidates_run: int
    exhaustive: bool  # False when the set held more than EXHAUSTIVE_HEAVY of them


def spare_heavy(found: Sequence[str], order: Sequence[str], heavy: frozenset[str],
                oracle: Oracle) -> tuple[list[str] | None, HeavyCheck]:
    """A passing set with fewer Conv/MatMul/Gemm than ``found``, or None; and what was tried."""
    members = [m for m in order if m in heavy and m in set(found)]
    before = oracle.runs
    if not members:
        return None, HeavyCheck(0, 0, 0, True)
    cheap = frozenset(m for m in order if m not in heavy)
    best: tuple[str, ...] | None = None
    exhaustive = len(members) <= EXHAUSTIVE_HEAVY
    if exhaustive:
        for size in range(len(members)):
            for kept in itertools.combinations(members, size):
                if oracle(cheap | frozenset(kept)).passed:
                    best = kept
                    break
            if best is not None:
                break
    # More than EXHAUSTIVE_HEAVY (a spread error's passing prefix, a large island): not forced to fp32
    # whole here, but handed to the release step (onnxmp.calibrate.release), which frees them one at a
    # time on the set as it is and proves each one it keeps.
    check = HeavyCheck(len(members), len(members) if best is None else len(best), oracle.runs - before, exhaustive)
    if best is None:
        return None, check
    # The cheap ops needed around the Conv/MatMul/Gemm kept: bisect them down, those kept fixed.
    culprits = find_fp32_set([m for m in order if m not in heavy], oracle, fixed=best, gallop=True)
    check.candidates_run = oracle.runs - before
    return [*best, *(c.node for c in culprits)], check


def fewer_casts(found: Sequence[str], low: Mapping[str, LowNode], graph: onnx.GraphProto,
                heavy: frozenset[str], oracle: Oracle) -> list[str]:
    """``found`` plus the cheap low nodes whose every low-precision neighbour is in it, when that passes."""
    fp32 = set(found)
    producer = {t: n.name for n in graph.node for t in n.output}
    consumers: dict[str, list[str]] = {}
    for n in graph.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n.name)

    def neighbours(name: str) -> set[str]:
        spec = low[name]
        near = {producer[t] for t in spec.inputs if t in producer}
        near |= {c for t in spec.outputs for c in consumers.get(t, ())}
        return {m for m in near if m in low}

    # Constant nodes are left out: the conversion writes a Constant in the type its reader needs,
    # with no Cast either way.
    extra = [name for name in low if name not in fp32 and name not in heavy and low[name].op != "Constant"
             and (near := neighbours(name)) and near <= fp32]
    if not extra:
        return list(found)
    grown = [*found, *extra]
    return grown if oracle(grown).passed else list(found)


__all__: list[str] = ["EXHAUSTIVE_HEAVY", "HeavyCheck", "fewer_casts", "spare_heavy"]
