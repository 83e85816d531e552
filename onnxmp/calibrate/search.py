"""The search behind calibration: which low-precision nodes must go back to float32.

Two parts:

* :class:`Switchboard` builds ONE emulated float32 model in which every
  low-precision node's rounding can be switched on or off at run time.  For
  each node ``n`` that runs in low precision after plain conversion, each of its
  low-precision inputs and outputs ``t`` becomes ``Where(low[n], round(t), t)``
  where ``round`` is a ``Cast(to=FLOAT16) -> Cast(to=FLOAT)`` pair (as in
  :mod:`onnxmp.parity.emulate`) and ``low`` is a bool vector fed with the sample.  A
  candidate ("these nodes back to float32") is then one ``session.run`` per
  sample, with no convert, verify or session build in between.  With every
  switch on it reproduces the emulated real conversion (bit for bit on the
  bundled models; kernels fed through ``Where`` may sum in another order, so a
  value can round one ulp apart), and with every switch off it is the float32 model.

* :func:`find_fp32_set` finds a small set of nodes to keep in float32 so that
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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxmp.color.masks import replace_fills
from onnxmp.targets import CPU
from onnxmp.errors import OnnxMPError, first_line
from onnxmp.external import is_large, session_source
from onnxmp.subgraphs import bodies
from onnxmp.runtime import as_output_array
from onnxmp.naming import FreshNames, proto_names
from onnxmp.precision import low_precision

log = logging.getLogger("onnxmp.search")

RUNS_C = 5
SWITCH_INPUT = "onnxmp_low_switches"


def run_bound(candidates: int, culprits: int) -> float:
    """The documented worst case ``RUNS_C * k * log2(N)`` (see the module docstring)."""
    return RUNS_C * max(culprits, 1) * math.log2(max(candidates, 4))


@dataclass(frozen=True)
class LowNode:
    """A node running in low precision: which of its inputs and outputs are low-precision tensors."""

    name: str
    op: str
    inputs: frozenset[str]
    outputs: frozenset[str]


class Switchboard:
    """One ORT session over the model with every low node's rounding switchable per run."""

    def __init__(self, model: onnx.ModelProto, low: Mapping[str, LowNode], precision: str = "float16",
                 fills: Mapping[str, float] | None = None, low_io: Iterable[str] = ()):
        """``fills``: the attention mask fills the conversion replaced (``{constant: value}``, from
        ``Report.mask_fills``), replaced here whatever the switches say, as in the real model.
        ``low_io``: main-graph inputs and outputs the conversion gives a low-precision type
        (``keep_io_types=False``); they are rounded whatever the switches say, as the real model's
        interface rounds them, so that a candidate's float32 node at the edge is not credited with
        float32 accuracy the converted model cannot deliver.

        Every low node's low-precision outputs (main graph) are outputs of the session too
        (``self.probed``), for :func:`local_attribution`; :meth:`run` fetches only the model's."""
        import onnxruntime as ort

        self.low_type = low_precision(precision).onnx_type
        self.nodes: list[str] = []  # switch index -> node name, topological (bodies at their parent)
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        if fills:
            replace_fills(proto.graph, fills, low_precision(precision))
        self._names = FreshNames(proto_names(proto.graph))
        self._switch: dict[str, str] = {}
        self.follows = _single_reader_constants(proto.graph, low)
        self.followers: dict[str, list[str]] = {}
        for constant, reader in self.follows.items():
            self.followers.setdefault(reader, []).append(constant)
        self._order_nodes(proto.graph, low)
        head = self._switch_nodes(proto.graph)
        for constant, reader in self.follows.items():
            self._switch[constant] = self._switch[reader]
        self._rewrite(proto.graph, low)
        head += self._round_io(proto.graph, frozenset(low_io))
        nodes = [*head, *proto.graph.node, *self._tail]
        proto.graph.ClearField("node")
        proto.graph.node.extend(nodes)
        proto.graph.input.append(helper.make_tensor_value_info(SWITCH_INPUT, TensorProto.BOOL, [len(self.nodes)]))
        self.outputs = [o.name for o in model.graph.output]
        present = set(self.outputs)
        main = {n.name for n in proto.graph.node}
        self.probed = [t for name in self.nodes if name in main for t in sorted(low[name].outputs) if t not in present]
        for t in self.probed:
            proto.graph.output.append(helper.make_tensor_value_info(t, TensorProto.FLOAT, None))
        self.low = dict(low)
        options = ort.SessionOptions()
        # ORT's memory-reuse planner is superlinear in the number of values: it took 5 s of a
        # 4,500-node switchboard's 5.5 s start-up.  Runs are short; allocation is cheap by comparison.
        options.enable_mem_reuse = False
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if is_large(proto):
            # Each switched weight's rounded copies come from Casts that read only initializers,
            # which ORT's default order runs first, all at once.  Priority order keeps fewer alive:
            # 8 x 64 MiB weights peaked at 1.00 GB instead of 1.40 GB, runs 1.1 -> 1.5 s.  (Without
            # the CPU arena too: 0.88 GB, but 2.5 s a run.)
            options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        self.session = cpu_session(proto, "switchboard model", options)
        self._index = {name: i for i, name in enumerate(self.nodes)}

    # -- building ---------------------------------------------------------------------
    def _order_nodes(self, graph: onnx.GraphProto, low: Mapping[str, LowNode]) -> None:
        for node in graph.node:
            if node.name in low and node.name not in self.follows:
                self.nodes.append(node.name)
            for sub in bodies(node):
                self._order_nodes(sub, low)

    def _switch_nodes(self, graph: onnx.GraphProto) -> list[onnx.NodeProto]:
        """A scalar bool per low node, gathered from the switch vector (bodies read it from outer scope)."""
        made = []
        for i, name in enumerate(self.nodes):
            index = self._names(f"{name}__onnxmp_switch_index")
            graph.initializer.append(helper.make_tensor(index, TensorProto.INT64, [], [i]))
            switch = self._names(f"{name}__onnxmp_switch")
            made.append(helper.make_node("Gather", [SWITCH_INPUT, index], [switch], name=switch))
            self._switch[name] = switch
        return made

    def _round_io(self, graph: onnx.GraphProto, low_io: frozenset[str]) -> list[onnx.NodeProto]:
        """Rounding of the low-precision interface: a rounded input keeps its name inside the graph
        and is fed under a fresh one (``self._feed``); a rounded output is fetched under a fresh one
        (``self._fetch``), so nodes reading either, in bodies too, need no rewriting."""
        self._feed: dict[str, str] = {}
        self._fetch: dict[str, str] = {}
        self._tail: list[onnx.NodeProto] = []
        head = []
        for value in graph.input:
            if value.name in low_io and value.type.tensor_type.elem_type == TensorProto.FLOAT:
                fed = self._names(f"{value.name}__onnxmp_io")
                head += self._round(fed, value.name)
                self._feed[value.name] = fed
                value.name = fed
        for value in graph.output:
            if value.name in low_io and value.type.tensor_type.elem_type == TensorProto.FLOAT:
                fetched = self._names(f"{value.name}__onnxmp_io")
                self._tail += self._round(value.name, fetched)
                self._fetch[value.name] = fetched
                value.name = fetched
        return head

    def _round(self, src: str, dst: str) -> list[onnx.NodeProto]:
        low = self._names(f"{dst}__low")
        return [helper.make_node("Cast", [src], [low], name=low, to=self.low_type),
                helper.make_node("Cast", [low], [dst], name=dst, to=TensorProto.FLOAT)]

    def _rewrite(self, graph: onnx.GraphProto, low: Mapping[str, LowNode]) -> None:
        rounded: dict[str, str] = {}  # tensor -> its rounded copy in this graph
        out: list[onnx.NodeProto] = []
        for node in graph.node:
            for sub in bodies(node):
                self._rewrite(sub, low)
            spec = low.get(node.name)
            if spec is None:
                out.append(node)
                continue
            switch = self._switch[node.name]
            gated: dict[str, str] = {}
            for k, tensor in enumerate(node.input):
                if not tensor or tensor not in spec.inputs:
                    continue
                if tensor not in gated:
                    if tensor not in rounded:
                        rounded[tensor] = self._names(f"{tensor}__rounded")
                        out.extend(self._round(tensor, rounded[tensor]))
                    gated[tensor] = self._names(f"{tensor}__{node.name}__in")
                    out.append(helper.make_node("Where", [switch, rounded[tensor], tensor], [gated[tensor]],
                                                name=gated[tensor]))
                node.input[k] = gated[tensor]
            tail: list[onnx.NodeProto] = []
            for k, tensor in enumerate(node.output):
                if not tensor or tensor not in spec.outputs:
                    continue
                raw = self._names(f"{tensor}__raw")
                node.output[k] = raw
                tail.extend(self._round(raw, self._names(f"{tensor}__raw_rounded")))
                tail.append(helper.make_node("Where", [switch, tail[-1].output[0], raw], [tensor],
                                             name=self._names(f"{tensor}__gate")))
            out.append(node)
            out.extend(tail)
        graph.ClearField("node")
        graph.node.extend(out)

    # -- running ----------------------------------------------------------------------
    def mask(self, fp32: Iterable[str]) -> np.ndarray:
        """The switch vector with every node low except ``fp32``."""
        switches = np.ones(len(self.nodes), dtype=bool)
        for name in fp32:
            i = self._index.get(name)
            if i is not None:
                switches[i] = False
        return switches

    def run(self, fp32: Iterable[str], samples: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        return list(self.iter_run(fp32, samples))

    def iter_run(self, fp32: Iterable[str], samples: Sequence[Mapping[str, np.ndarray]],
                 outputs: Sequence[str] | None = None) -> Iterator[dict[str, np.ndarray]]:
        """One sample at a time, so a caller can stop at the first sample that already fails."""
        names = list(self.outputs if outputs is None else outputs)
        if self._feed:
            samples = ({self._feed.get(k, k): v for k, v in s.items()} for s in samples)
        runs = run_samples(self.session, samples, [self._fetch.get(n, n) for n in names],
                           {SWITCH_INPUT: self.mask(fp32)})
        if not self._fetch:
            return runs
        return ({n: out[self._fetch.get(n, n)] for n in names} for out in runs)


def _single_reader_constants(graph: onnx.GraphProto, low: Mapping[str, LowNode]) -> dict[str, str]:
    """Low Constant nodes of the main graph read by exactly one low node and nothing else: constant ->
    reader.  Exporters such as Paddle2ONNX write every weight, bias and norm statistic as a Constant node;
    each would be a candidate of its own, doubling the search for nothing, since its rounding only
    matters to its one reader.  It shares its reader's switch instead."""
    uses: dict[str, list[str]] = {}
    for node in graph.node:
        for t in node.input:
            uses.setdefault(t, []).append(node.name)
    captured: set[str] = set()

    def scan(g: onnx.GraphProto) -> None:
        for n in g.node:
            captured.update(n.input)
            for sub in bodies(n):
                scan(sub)

    for node in graph.node:
        for sub in bodies(node):
            scan(sub)
    outputs = {o.name for o in graph.output}
    follows = {}
    for node in graph.node:
        if node.op_type != "Constant" or node.name not in low or len(node.output) != 1:
            continue
        t = node.output[0]
        readers = uses.get(t, [])
        if len(readers) == 1 and readers[0] in low and readers[0] != node.name and t not in captured \
                and t not in outputs and t in low[readers[0]].inputs | low[node.name].outputs:
            follows[node.name] = readers[0]
    return follows


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


def cpu_session(model: onnx.ModelProto, what: str, options=None):
    """A quiet onnxruntime CPU session over ``model`` (``options``: a SessionOptions to start from);
    a model it cannot load is an OnnxMPError naming ``what``."""
    import onnxruntime as ort

    options = options or ort.SessionOptions()
    options.log_severity_level = 3
    try:
        with session_source(model, "calibration") as source:
            return ort.InferenceSession(source, options, providers=[CPU.provider])
    except OnnxMPError:
        raise
    except Exception as exc:  # onnxruntime's exceptions share no public base class
        raise OnnxMPError(f"onnxruntime cannot load the {what} for calibration: {first_line(exc)}",
                          hint="check that the float32 model runs on onnxruntime CPU") from exc


def run_samples(session, samples: Iterable[Mapping[str, np.ndarray]], outputs: Sequence[str] | None = None,
                extra: Mapping[str, np.ndarray] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """``outputs`` (default: all) of ``session`` per sample; arrays that feed no input are left out
    (a training file's labels), ``extra`` feeds are added to each sample."""
    allowed = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()] if outputs is None else list(outputs)
    for sample in samples:
        feeds = {k: v for k, v in sample.items() if k in allowed}
        feeds.update(extra or {})
        try:
            values = session.run(names, feeds)
        except Exception as exc:  # onnxruntime's exceptions share no public base class
            raise OnnxMPError(f"calibration run failed: {first_line(exc)}",
                              hint="check the calibration inputs' shapes and dtypes") from exc
        yield {name: as_output_array(value) for name, value in zip(names, values)}


# --- the search ------------------------------------------------------------------------


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


class RunBar:
    """tqdm over search runs, on a terminal only."""

    def __init__(self, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(desc=desc, unit="run", disable=None, leave=False)
        self.start = time.perf_counter()
        self.heavy: frozenset[str] = frozenset()  # the search's Conv/MatMul/Gemm candidates
        self.tolerance = 1.0

    def __call__(self, probe: Probe) -> None:
        share = (f", fp16 Conv/MatMul/Gemm {1 - len(probe.fp32 & self.heavy) / len(self.heavy):.0%}"
                 if self.heavy else "")
        error = "" if probe.passed else ">="  # a failing candidate stops at its first failing sample
        self.bar.set_postfix_str(f"fp32 {len(probe.fp32)}, error {error}{probe.score * self.tolerance:.3g}{share}")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
