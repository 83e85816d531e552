"""Attribution: which low-precision nodes ADD the error, from two switchboard passes (all float32,
all low), and the ranking the search bisects."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from onnxmp.calibrate.switchboard import Switchboard


def local_attribution(board: Switchboard, samples: Sequence[Mapping[str, np.ndarray]],
                      on_sample: Callable[[int, dict], None] | None = None) -> dict[str, float]:
    """The relative error each low node ADDS, from two passes: all in float32 and all low.

    For a node, the relative error (max|low - fp32| / max|fp32|, worst sample) of its
    output minus the worst of its low-precision inputs' is its local contribution:
    a node whose inputs arrive nearly exact but whose output is far off (a rounded
    bias of ~1000 taken back off by a norm, magnitudes flushed to zero) ranks
    first, while a node that only carries error it was handed ranks low.  Nodes
    whose outputs are not probed (inside bodies) get the error of nothing: 0.
    ``on_sample(index, outputs)`` sees each sample's all-low model outputs.  When one
    sample's intermediates exceed ``ATTRIBUTION_BYTES``, they are fetched in groups
    (two more runs per group) rather than holding two full copies at once.
    """
    from onnxmp.parity.metrics import relative_error

    names = list(dict.fromkeys([*board.outputs, *board.probed]))
    err: dict[str, float] = {}

    def fold(exact: Mapping[str, np.ndarray], rounded: Mapping[str, np.ndarray]) -> None:
        for t in exact:
            ref, low = exact[t], rounded[t]
            if ref.dtype.kind != "f" or ref.shape != low.shape:
                continue
            e = relative_error(ref, low)
            err[t] = max(err.get(t, 0.0), e if math.isfinite(e) else 1e30)

    groups: list[list[str]] | None = None
    for index, sample in enumerate(samples):
        exact = next(board.iter_run(board.nodes, [sample], names))
        if groups is None:
            groups = _groups(names, exact, ATTRIBUTION_BYTES, lead=len(board.outputs))
        if len(groups) > 1:
            del exact
        for k, group in enumerate(groups):
            part = exact if len(groups) == 1 else next(board.iter_run(board.nodes, [sample], group))
            rounded = next(board.iter_run((), [sample], group))
            fold(part, rounded)
            if k == 0 and on_sample is not None:  # the model's outputs lead the first group
                on_sample(index, {o: rounded[o] for o in board.outputs})
            del part, rounded
    added: dict[str, float] = {}
    producer = {t: name for name in board.nodes for t in board.low[name].outputs}
    amplifiers = []
    for name in board.nodes:
        spec = board.low[name]
        out = max((err.get(t, 0.0) for t in spec.outputs), default=0.0)
        into = max((err.get(t, 0.0) for t in spec.inputs), default=0.0)
        added[name] = max(out - into, 0.0)
        if 0.0 < into and out > AMPLIFICATION * into:
            amplifiers.append(name)
    # A node that turns a small input error into a large one (a norm centring values rounded at
    # |x| ~ 1000) is not where the error is made: its producers' rounding is.  They share its blame,
    # halved per hop, for HOPS hops upstream.
    for name in amplifiers:
        frontier, score = [name], added[name]
        for _ in range(HOPS):
            score /= 2
            frontier = [producer[t] for n in frontier for t in board.low[n].inputs if t in producer]
            for n in frontier:
                added[n] = max(added[n], score)
    return added


def _groups(names: Sequence[str], values: Mapping[str, np.ndarray], limit: int, lead: int = 0) -> list[list[str]]:
    """``names`` in order, cut into groups of at most ``limit`` bytes (at least one name each); the
    first ``lead`` names stay together in the first group."""
    groups: list[list[str]] = [[]]
    size = 0
    for i, name in enumerate(names):
        nbytes = int(getattr(values.get(name), "nbytes", 0))
        if i >= lead and groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


ATTRIBUTION_BYTES = 1 << 30  # one sample's intermediates above this are fetched group by group
AMPLIFICATION = 10.0  # output error over input error above which a node counts as amplifying
HOPS = 2


HEAVY_DISCOUNT = 0.25  # a Conv/MatMul/Gemm must add 4x the error of a cheap op to be given up before it


def attribution_ranking(nodes: Sequence[str], added: Mapping[str, float], heavy: Callable[[str], bool]) -> list[str]:
    """``nodes`` by the error each adds (most first); Conv/MatMul/Gemm discounted so cheap ops around
    them (the bias, norm or activation reading their output) are tried first; ties keep topological
    order."""
    position = {name: i for i, name in enumerate(nodes)}
    return sorted(nodes, key=lambda m: (-added.get(m, 0.0) * (HEAVY_DISCOUNT if heavy(m) else 1.0), position[m]))

