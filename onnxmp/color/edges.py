"""The type view's edges: producer vertex -> consumer vertex over float32 tensors, as flat arrays
(:class:`Adjacency`); ``vertices.py`` builds them once with :func:`link`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import itertools
from array import array
from typing import Iterator, Mapping

import numpy as np

from onnxmp.color.layouts import CONTROL_FLOW

if TYPE_CHECKING:
    from onnxmp.color.vertices import TypeView


class Adjacency:
    """Fan-in or fan-out of every vertex as one flat int array (CSR): ``adj[v]`` is v's list."""

    __slots__ = ("start", "flat")

    def __init__(self, start: array, flat: array):
        self.start, self.flat = start, flat

    def __getitem__(self, vid: int) -> array:
        return self.flat[self.start[vid]:self.start[vid + 1]]

    def __len__(self) -> int:
        return len(self.start) - 1


def link(view: TypeView, read: list[str], n_read: array, written: list[str], n_written: array) -> None:
    """Edges producer -> consumer over float32 tensors, in first-link order: tensors in the order
    they are first read, each tensor's readers in id order.  A body's read of an outer tensor is an edge
    like any other (names are unique across graphs, so a reader in another graph than the
    producer's reads it from an enclosing one): the value crosses into the body in the type its
    producer writes, and the rules see through the boundary; the control-flow groups add ephemeral
    edges for the values bound at it.

    ``read``/``written`` are the tensors each float32 vertex reads/writes, in id order, and
    ``n_read``/``n_written`` how many per vertex.  Also records ``producer_of`` and the readers
    of the tensors the passes ask about (retargetable outputs, group members)."""
    n = len(view.v_kind)
    floats = np.flatnonzero(np.frombuffer(view.f32, dtype=np.uint8))
    # A produced tensor is known by its (last) position in ``written``: no second name map.
    position = dict(zip(written, itertools.count()))
    writer = np.repeat(floats, n_written).astype(np.intc)
    view.producer_of = _Producers(position, array("i", writer.tobytes()))
    source = np.fromiter(map(position.get, read, itertools.repeat(-1)), dtype=np.int64, count=len(read))
    reader = np.repeat(floats, n_read).astype(np.intc)
    linked = np.flatnonzero(source >= 0)
    # Edges grouped by tensor in the order tensors are first read, then in read (= id) order.
    tensor = source[linked]
    first_read = np.zeros(len(written), dtype=np.int64)
    unique, first = np.unique(tensor, return_index=True)
    first_read[unique] = linked[first]
    order = np.argsort(first_read[tensor], kind="stable")
    src_np, dst_np = writer[tensor[order]], reader[linked[order]]
    view.consumers_of = _readers_of(view, read, source, reader, position)

    extra_src, extra_dst = [], []
    for group in view.groups:
        # TF colors one flat graph where NextIteration/Merge edges close the loop; here the
        # group's producers are linked to the group's consumers (ephemeral edges) so the passes
        # see through the boundary (a body Add between this iteration's MatMul and the next
        # one's is "between allow ops").  force_color_match settles the group afterwards.
        producers = [view.producer_of[t] for t in group.must_allow + group.must_not_deny if t in view.producer_of]
        consumers = [c for _, t in group.members for c in view.consumers_of[t]
                     if view.v_kind[c].group.op.op_type not in CONTROL_FLOW]
        for p in producers:
            extra_src.extend([p] * len(consumers))
            extra_dst.extend(consumers)
    for unit in view.fused:
        # The kernel reads the input and writes the affine output: the passes see it as one op
        # between the input's producer and the readers of its output.
        producer = view.producer_of.get(unit.norm.input)
        if producer is not None and unit.affine:
            extra_src.append(producer)
            extra_dst.append(unit.affine[0])
    if extra_src:
        src_np = np.concatenate([src_np, np.asarray(extra_src, dtype=np.intc)])
        dst_np = np.concatenate([dst_np, np.asarray(extra_dst, dtype=np.intc)])
    # One edge per (producer, consumer): a consumer may read several outputs of one vertex, or
    # one tensor twice.
    pair = src_np.astype(np.int64) * n + dst_np
    _, first = np.unique(pair, return_index=True)
    if len(first) < len(pair):
        first.sort()
        src_np, dst_np = src_np[first], dst_np[first]
    view.fanout = _adjacency(src_np, dst_np, n)
    view.fanin = _adjacency(dst_np, src_np, n)


def _readers_of(view: TypeView, read: list[str], source: np.ndarray, reader: np.ndarray,
                position: dict[str, int]) -> dict[str, list[int]]:
    """The float32 vertices reading each tensor the passes ask about (outputs of capable
    retargetable vertices, control-flow group members), in id order, across graphs."""
    ok = view.ok
    asked = [t for vid in view.retargetable if ok[vid] for t in view.output_names(vid)]
    asked += [t for group in view.groups for _, t in group.members]
    if not asked:
        return {}
    by_source = np.argsort(source, kind="stable")
    sorted_source, sorted_reader = source[by_source], reader[by_source]
    found: dict[str, list[int]] = {}
    unproduced = set()
    produced = []
    for t in asked:
        if t in position:
            produced.append(t)
        else:
            unproduced.add(t)
    # Each produced tensor's readers are one run of the readers sorted by what they read.
    written_at = np.fromiter(map(position.__getitem__, produced), dtype=np.int64, count=len(produced))
    low = np.searchsorted(sorted_source, written_at).tolist()
    high = np.searchsorted(sorted_source, written_at + 1).tolist()
    for t, lo, hi in zip(produced, low, high):
        found[t] = list(dict.fromkeys(sorted_reader[lo:hi].tolist()))  # read order; one may read t twice
    if unproduced:  # graph and body inputs in groups: found by name
        for t in unproduced:
            found[t] = []
        for i, t in enumerate(read):
            if t in unproduced:
                found[t].append(int(reader[i]))
        for t in unproduced:
            found[t] = list(dict.fromkeys(found[t]))
    return found


class _Producers(Mapping):
    """Tensor name -> the float32 vertex id writing it (the last one, as a dict would keep)."""

    def __init__(self, position: dict[str, int], writer: array):
        self._position, self._writer = position, writer

    def __getitem__(self, name: str) -> int:
        return self._writer[self._position[name]]

    def __contains__(self, name) -> bool:
        return name in self._position

    def __iter__(self) -> Iterator[str]:
        return iter(self._position)

    def __len__(self) -> int:
        return len(self._position)


def _adjacency(keys: np.ndarray, values: np.ndarray, n: int) -> Adjacency:
    order = np.argsort(keys, kind="stable")  # stable: each list keeps first-link order
    start = np.zeros(n + 1, dtype=np.intc)
    np.cumsum(np.bincount(keys, minlength=n), out=start[1:])
    return Adjacency(array("i", start.tobytes()), array("i", values[order].astype(np.intc).tobytes()))
