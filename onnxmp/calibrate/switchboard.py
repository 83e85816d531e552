"""The switchboard: one emulated float32 session in which every low-precision node's rounding is
switchable per run, so a candidate ("these nodes back to float32") costs one ``session.run`` per
sample, with no convert, verify or session build in between.

For each node ``n`` that runs in low precision after plain conversion, each of its low-precision
inputs and outputs ``t`` becomes ``low[n] ? round(t) : t`` (an If selecting, :meth:`Switchboard._select`)
where ``round`` is a ``Cast(to=FLOAT16) -> Cast(to=FLOAT)`` pair (as in :mod:`onnxmp.parity.emulate`; with
float16 the first Cast is shared by a tensor's selections and the second runs in each one's branch) and
``low`` is a bool vector fed with the sample.  With every switch on it reproduces the emulated real conversion
(bit for bit on the bundled models; kernels fed through the selection may sum in another order, so a
value can round one ulp apart), and with every switch off it is the float32 model.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxmp import runtime
from onnxmp.calibrate.session import cpu_session, run_samples
from onnxmp.color.masks import replace_fills
from onnxmp.external import is_large
from onnxmp.naming import FreshNames, proto_names
from onnxmp.precision import low_precision
from onnxmp.subgraphs import bodies, proto_nodes

SWITCH_INPUT = "onnxmp_low_switches"


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
        # float16: a switched tensor's low copy is one Cast, and each selection's "on" branch casts it
        # back: one full-size float32 pass less per tensor than Cast, Cast, then a copy in the branch
        # (bfloat16 keeps the pair: numpy has no bfloat16 to fetch the low copy as).
        self._split = self.low_type == TensorProto.FLOAT16
        self.nodes: list[str] = []  # switch index -> node name, topological (bodies at their parent)
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        if fills:
            replace_fills(proto.graph, fills, low_precision(precision))
        self._names = FreshNames(proto_names(proto.graph))
        self._switch: dict[str, str] = {}
        self._ungated: dict[str, tuple[str, str, str]] = {}  # low output with no gate -> (its node, raw, rounded)
        self._low_copies: set[str] = set()  # fetched names typed low precision (float16), cast on fetch
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
            # an output with no gate is fetched as its raw or its rounded value, as its switch says
            for fetched in self._ungated[t][1:] if t in self._ungated else (t,):
                kind = self.low_type if fetched in self._low_copies else TensorProto.FLOAT
                proto.graph.output.append(helper.make_tensor_value_info(fetched, kind, None))
        self.low = dict(low)
        options = runtime.session_options(optimization="disable")
        # ORT's memory-reuse planner is superlinear in the number of values: it took 5 s of a
        # 4,500-node switchboard's 5.5 s start-up.  Runs are short; allocation is cheap by comparison.
        options.enable_mem_reuse = False
        # Nor a memory pattern: without reuse the pattern is one block as large as every value of a
        # run together.  With it, layout_cdla's (1 GB of values a sample) first runs after a change of
        # switches took 1.4 to 3.4 s instead of 0.2, and the attribution's eight runs 9.6 s, not 4.5-5.8.
        options.enable_mem_pattern = False
        # No optimization at all, as the measurement of the written model (session.py).
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

    def _rounded(self, src: str, dst: str) -> list[onnx.NodeProto]:
        """``dst``: what a selection's "on" branch reads for ``src`` rounded, shared by every selection
        of ``src`` (split: its low-precision copy, which the branch casts back)."""
        if not self._split:
            return self._round(src, dst)
        self._low_copies.add(dst)
        return [helper.make_node("Cast", [src], [dst], name=dst, to=self.low_type)]

    def _select(self, switch: str, on: str, off: str, out: str) -> onnx.NodeProto:
        """``on`` where the scalar ``switch`` holds, else ``off``: an If whose branches are one node
        each, an Identity (a Cast back to float32 for a float16 low copy, :meth:`_rounded`).  Not
        ``Where``: onnxruntime's CPU Where broadcasting a scalar condition costs 2-2.5x the If's copy
        (250k floats: 99-114 us against 40-66, onnxruntime 1.19 and 1.32), and was 77% of a
        layout_cdla run on 1.32.  The same values, bit for bit: a selection rounds nothing itself."""
        def branch(src: str, tag: str) -> onnx.GraphProto:
            copy = self._names(f"{out}__{tag}")
            node = (helper.make_node("Cast", [src], [copy], name=copy, to=TensorProto.FLOAT) if src in self._low_copies
                    else helper.make_node("Identity", [src], [copy], name=copy))
            return helper.make_graph([node], copy, [], [helper.make_tensor_value_info(copy, TensorProto.FLOAT, None)])

        return helper.make_node("If", [switch], [out], name=self._names(f"{out}__select"),
                                then_branch=branch(on, "on"), else_branch=branch(off, "off"))

    def _rewrite(self, graph: onnx.GraphProto, low: Mapping[str, LowNode]) -> None:
        rounded: dict[str, str] = {}  # tensor -> its rounded copy in this graph
        gated_output: dict[str, tuple[str, str]] = {}  # a low node's output -> (its switch, its raw value)
        gate_read = _read_other_than_low(graph, low)
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
                        out.extend(self._rounded(tensor, rounded[tensor]))
                    gated[tensor] = self._names(f"{tensor}__{node.name}__in")
                    if tensor in gated_output:
                        # Read rounded when either end is low: one selection over the producer's raw value,
                        # so the producer's own gate runs only for readers that are not low nodes.
                        producer_switch, raw = gated_output[tensor]
                        either = switch
                        if producer_switch != switch:
                            either = self._names(f"{tensor}__{node.name}__either")
                            out.append(helper.make_node("Or", [producer_switch, switch], [either], name=either))
                        out.append(self._select(either, rounded[tensor], raw, gated[tensor]))
                    else:
                        out.append(self._select(switch, rounded[tensor], tensor, gated[tensor]))
                node.input[k] = gated[tensor]
            tail: list[onnx.NodeProto] = []
            for k, tensor in enumerate(node.output):
                if not tensor or tensor not in spec.outputs:
                    continue
                raw = self._names(f"{tensor}__raw")
                node.output[k] = raw
                tail.extend(self._rounded(raw, self._names(f"{tensor}__raw_rounded")))
                # Rounding is idempotent, so round(tensor) is round(raw) whatever this node's switch
                # says: a low reader takes that copy instead of two more Casts over the tensor.
                rounded[tensor] = tail[-1].output[0]
                gated_output[tensor] = (switch, raw)
                if tensor in gate_read:
                    tail.append(self._select(switch, rounded[tensor], raw, tensor))
                else:  # onnxruntime runs every node, fetched or not: no gate that only low readers bypass
                    self._ungated[tensor] = (self.follows.get(node.name, node.name), raw, rounded[tensor])
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
        mask = self.mask(fp32)
        fetch = {n: self._fetch.get(n, n) for n in names}
        for n in names:
            if n in self._ungated:
                node, raw, rounded = self._ungated[n]
                fetch[n] = rounded if mask[self._index[node]] else raw
        runs = run_samples(self.session, samples, list(fetch.values()), {SWITCH_INPUT: mask})
        if all(n == f for n, f in fetch.items()):
            return runs
        # float16 -> float32 is exact: the same values a Cast back would have given
        return ({n: out[f].astype(np.float32) if f in self._low_copies else out[f] for n, f in fetch.items()}
                for out in runs)


def _read_other_than_low(graph: onnx.GraphProto, low: Mapping[str, LowNode]) -> set[str]:
    """Tensors of ``graph`` that something reads other than as a low node's low-precision input: a
    float32 reader, a body (outer-scope reads), or the graph's outputs.  Only these need the gated
    value under their own name; a low reader takes the raw or the rounded value directly."""
    read = {o.name for o in graph.output} | _body_reads(graph)
    for node in graph.node:
        spec = low.get(node.name)
        read.update(t for t in node.input if spec is None or t not in spec.inputs)
    return read


def _body_reads(graph: onnx.GraphProto) -> set[str]:
    """Every name a node inside ``graph``'s bodies reads (outer-scope reads among them)."""
    return {t for node in graph.node for body in bodies(node) for n in proto_nodes(body) for t in n.input}


def _single_reader_constants(graph: onnx.GraphProto, low: Mapping[str, LowNode]) -> dict[str, str]:
    """Low Constant nodes of the main graph read by exactly one low node and nothing else: constant ->
    reader.  Exporters such as Paddle2ONNX write every weight, bias and norm statistic as a Constant node;
    each would be a candidate of its own, doubling the search for nothing, since its rounding only
    matters to its one reader.  It shares its reader's switch instead."""
    uses: dict[str, list[str]] = {}
    for node in graph.node:
        for t in node.input:
            uses.setdefault(t, []).append(node.name)
    captured = _body_reads(graph)
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

