"""onnxruntime's graph fusions, as onnxmp needs to know them: which subgraphs ORT runs as one kernel.

A decomposed LayerNorm (``ReduceMean -> Sub -> Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul ->
Add``, as torch exports it below opset 17) is, on the CUDA EP, one ``LayerNormalization`` kernel:
its float16 form computes the mean and the variance in float32 and rounds once, at the output.
The coloring colors such a subgraph as the kernel it becomes, the emulation computes it as that
kernel does, and the speed benchmark counts it as one kernel.  So the matchers here follow ORT's
own conditions (``onnxruntime/core/optimizer/layer_norm_fusion.cc`` at the commit right after
1.19 was cut, 88c811b6, and at 727db0d3 of 2026-01; ``docs/coloring.md``, fused kernels):

* :func:`layer_norms`: ``LayerNormFusion``, with the Casts it absorbs (a leading Cast read only by
  the subgraph, ``Sub -> Cast``, a Cast into ``Pow``, ``Div -> Cast -> Mul``) and without those it
  does not (a Cast after the variance, between ``Mul`` and ``Add``...), one reduced axis (the last);
* :func:`simplified_layer_norms`: ``SimplifiedLayerNormFusion`` (RMSNorm, T5), after ORT's
  ``DivMulFusion`` has turned ``Mul(x, Div(1, s))`` into ``Div(x, s)``.

Where ORT's conditions depend on the execution provider, these are the CUDA EP's.  ORT also fuses
``Add -> LayerNormalization`` into ``SkipLayerNormalization`` (:func:`skip_layer_norm_adds`), an
``Erf`` GELU into ``Gelu`` (:func:`gelus`; with a 1-D bias ``Add`` before it, ``BiasGelu``:
:func:`bias_gelu_add`) and a tanh GELU into ``FastGelu`` (:func:`fast_gelus`).
"""
from __future__ import annotations

from collections import defaultdict
from functools import cached_property
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Mapping

import numpy as np
import onnx

from onnxmp.domains import is_onnx_domain

FLOAT = onnx.TensorProto.FLOAT
_SUPPORTED = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                        onnx.TensorProto.BFLOAT16})


@dataclass(frozen=True)
class FusedNorm:
    """One subgraph ORT fuses into ``LayerNormalization`` or ``SimplifiedLayerNormalization``.

    ``input`` is what the fused kernel reads (the leading Cast's input when ORT absorbs it) and
    ``output`` what it writes.  ``statistics`` are the nodes whose arithmetic the kernel does in
    float32 (the mean, the variance, the normalization), ``affine`` the scale ``Mul`` and the bias
    ``Add`` (the bias only for a LayerNorm), ``casts`` the Casts ORT absorbs."""

    kind: str                   # "LayerNormalization" or "SimplifiedLayerNormalization"
    input: str
    output: str
    statistics: tuple[str, ...]
    affine: tuple[str, ...]
    casts: tuple[str, ...]
    scale: str
    bias: str | None
    epsilon: float | None       # None: ORT uses 1e-5 (the Add's second input is no float32 constant)

    @property
    def nodes(self) -> tuple[str, ...]:
        return (*self.casts, *self.statistics, *self.affine)


class Lookup:
    """A ``name -> value or None`` function as a mapping's ``get``, for GraphFacts' types and shapes."""

    def __init__(self, read: Callable[[str], object]):
        self._read = read

    def get(self, name: str, default=None):
        value = self._read(name)
        return default if value is None else value


class GraphFacts:
    """What the matchers read of one graph: producers, consumer edges, constants, ranks and types.

    ``types`` and ``shapes`` may be given, anything with a mapping's ``get`` (the coloring passes
    the index's, as :class:`Lookup`; ``scripts/bench_speed.py`` the fp32 run's); otherwise they are
    read from the graph's declarations and initializers.  Everything but the op types is
    built on first use: most graphs hold none of the ops a matcher starts from, and those pay one
    pass over their node list (the matchers ask :meth:`has` first)."""

    def __init__(self, graph: onnx.GraphProto, types: Mapping[str, int] | None = None,
                 shapes: Mapping[str, tuple] | None = None, outer_constants: Mapping[str, onnx.TensorProto] = {}):
        self.graph = graph
        self.nodes = list(graph.node)
        self.op_types = {node.op_type for node in self.nodes if is_onnx_domain(node.domain)}
        self._given_types, self._given_shapes, self._outer = types, shapes, outer_constants

    def has(self, *op_types: str) -> bool:
        """Whether the graph holds a node of every one of ``op_types`` (ai.onnx domain)."""
        return self.op_types.issuperset(op_types)

    @cached_property
    def producer(self) -> dict[str, int]:
        return {name: k for k, node in enumerate(self.nodes) for name in node.output if name}

    @cached_property
    def edges(self) -> dict[str, list[int]]:
        """Tensor -> the reading nodes, one per input slot."""
        edges: dict[str, list[int]] = defaultdict(list)
        for k, node in enumerate(self.nodes):
            for name in node.input:
                if name:
                    edges[name].append(k)
        return edges

    @cached_property
    def position(self) -> dict[str, int]:
        """Node name -> its place in ``nodes`` (what the matchers return are names)."""
        return {node.name: k for k, node in enumerate(self.nodes)}

    @cached_property
    def graph_outputs(self) -> set[str]:
        return {v.name for v in self.graph.output}

    @cached_property
    def constants(self) -> dict[str, onnx.TensorProto]:
        constants: dict[str, onnx.TensorProto] = dict(self._outer)
        constants.update((t.name, t) for t in self.graph.initializer)
        for node in self.nodes:
            if node.op_type == "Constant" and is_onnx_domain(node.domain):
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    constants[node.output[0]] = value
        return constants

    @cached_property
    def _declared(self) -> tuple[dict[str, int], dict[str, tuple]]:
        types, shapes = {}, {}
        for v in (*self.graph.input, *self.graph.value_info, *self.graph.output):
            t = v.type.tensor_type
            if v.type.WhichOneof("value") == "tensor_type":
                types.setdefault(v.name, t.elem_type)
                if t.HasField("shape"):
                    shapes.setdefault(v.name, tuple(
                        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim))
        for name, tensor in self.constants.items():
            types.setdefault(name, tensor.data_type)
            shapes.setdefault(name, tuple(tensor.dims))
        return types, shapes

    @cached_property
    def types(self) -> Mapping[str, int]:
        return self._declared[0] if self._given_types is None else self._given_types

    @cached_property
    def shapes(self) -> Mapping[str, tuple]:
        """Dims: ints, dim_param strings, None where unknown."""
        return self._declared[1] if self._given_shapes is None else self._given_shapes

    def rank(self, name: str) -> int | None:
        shape = self.shapes.get(name)
        if shape is None and name in self.constants:  # a constant no declaration describes
            shape = self.constants[name].dims
        return None if shape is None else len(shape)

    # -- what ORT's graph_utils and optimizer_utils ask -------------------------------------------
    def op(self, k: int, op_type: str) -> bool:
        if k < 0:
            return False
        node = self.nodes[k]
        return node.op_type == op_type and is_onnx_domain(node.domain)

    def out_edges(self, k: int) -> int:
        """Node.GetOutputEdgesCount: one edge per reading input slot."""
        return sum(len(self.edges.get(name, ())) for name in self.nodes[k].output if name)

    def check_out_edges(self, k: int, count: int) -> bool:
        """optimizer_utils::CheckOutputEdges: exactly ``count`` edges and no graph output."""
        return self.out_edges(k) == count and not self.writes_graph_output(k)

    def shapes_equal(self, a: str, b: str) -> bool:
        """Both shapes known and the same, dim by dim: the same value or the same dim_param."""
        sa, sb = self.shapes.get(a), self.shapes.get(b)
        return sa is not None and sa == sb and None not in sa

    def writes_graph_output(self, k: int) -> bool:
        return any(name in self.graph_outputs for name in self.nodes[k].output)

    def children(self, k: int) -> list[int]:
        """Consumers of node ``k``, one per edge, in node order."""
        return sorted(c for name in self.nodes[k].output if name for c in self.edges.get(name, ()))

    def first_child(self, k: int, op_type: str) -> int | None:
        return next((c for c in self.children(k) if self.op(c, op_type)), None)

    def parent(self, k: int, index: int) -> int | None:
        inputs = self.nodes[k].input
        return self.producer.get(inputs[index]) if index < len(inputs) else None

    def parents(self, k: int) -> list[int]:
        return [p for name in self.nodes[k].input if name and (p := self.producer.get(name)) is not None]

    def first_parent(self, k: int, op_type: str) -> int | None:
        return next((p for p in self.parents(k) if self.op(p, op_type)), None)

    def supported(self, k: int, inputs: int | None = None) -> bool:
        """IsSupportedDataType: every (or the first ``inputs``) input is float16/32/64 or bfloat16;
        an input of unknown type passes (ORT knows it; the caller's types may not)."""
        names = self.nodes[k].input[:inputs] if inputs is not None else self.nodes[k].input
        return all(self.types.get(name, FLOAT) in _SUPPORTED for name in names if name)

    def scalar(self, name: str) -> float | None:
        tensor = self.constants.get(name)
        if tensor is None:
            return None
        values = onnx.numpy_helper.to_array(tensor)
        return float(values.reshape(-1)[0]) if values.size == 1 else None

    def axes(self, k: int) -> list[int] | None:
        """The ``axes`` of a ReduceMean: the attribute, or (opset 18) a constant second input."""
        node = self.nodes[k]
        for attr in node.attribute:
            if attr.name == "axes":
                return list(attr.ints)
        if len(node.input) > 1 and node.input[1] in self.constants:
            return [int(a) for a in onnx.numpy_helper.to_array(self.constants[node.input[1]]).reshape(-1)]
        return None


def _last_axis_only(axes: list[int] | None, rank: int | None) -> bool:
    """CheckAxesOnReduceMean with one axis (ORT's inference builds): the last dim."""
    if not axes or len(axes) != 1:
        return False
    axis = axes[0]
    if axis >= 0:
        if rank is None:
            return False
        axis -= rank
    return axis == -1


def _transposed(facts: GraphFacts, x: str) -> bool:
    """The normalized tensor comes straight from a Transpose: ORT's level-1 transpose optimizer
    pushes it into the reductions first, and the fusion no longer matches (measured on the
    swin and wav2vec2 exports, tests/test_fusions.py)."""
    k = facts.producer.get(x)
    return k is not None and facts.op(k, "Transpose")


def _epsilon(facts: GraphFacts, add: int) -> float | None:
    """The epsilon ORT reads: the Add's second input, only as a float32 constant."""
    name = facts.nodes[add].input[1] if len(facts.nodes[add].input) > 1 else ""
    tensor = facts.constants.get(name)
    if tensor is None or tensor.data_type != FLOAT:
        return None
    return facts.scalar(name)


def _rank_one_input(facts: GraphFacts, k: int) -> str | None:
    """ORT's scale/bias pick: the last input of rank 1 (``== number of axes``)."""
    found = None
    for name in facts.nodes[k].input:
        if name and facts.rank(name) == 1:
            found = name
    return found


def layer_norms(facts: GraphFacts, strict: bool = True) -> list[FusedNorm]:
    """The subgraphs ``LayerNormFusion`` turns into ``LayerNormalization`` on the CUDA EP.  With
    ``strict=False`` also those whose input comes straight from a Transpose, which ORT's transpose
    optimizer may rearrange before the fusion looks (the coloring's units, whose float32
    statistics are explicit whether ORT fuses them or not)."""
    if not facts.has("ReduceMean", "Sub", "Pow", "Sqrt", "Div"):
        return []
    found, used = [], set()
    for r1 in range(len(facts.nodes)):
        match = _layer_norm_at(facts, r1, strict)
        if match is not None and used.isdisjoint(match.nodes):
            found.append(match)
            used.update(match.nodes)
    return found


def _layer_norm_at(f: GraphFacts, r1: int, strict: bool = True) -> FusedNorm | None:  # noqa: C901 (one check per ORT condition)
    n = f.nodes
    if not f.op(r1, "ReduceMean") or f.out_edges(r1) not in (1, 2) or f.writes_graph_output(r1) \
            or not f.supported(r1, 1):
        return None
    subs = f.children(r1)
    if not subs or not all(f.op(s, "Sub") for s in subs) or len(subs) > 2:
        return None
    sub, dup = subs[0], (subs[1] if len(subs) == 2 else None)
    if not f.supported(sub):
        return None
    x = n[r1].input[0]
    for s in subs:
        others = [name for name in n[s].input if name != n[r1].output[0]]
        if not others or others[0] != x:
            return None
    casts = []
    leading = f.producer.get(x)
    x_in = x
    if leading is not None and f.op(leading, "Cast") and f.check_out_edges(leading, len(subs) + 1):
        casts.append(leading)
        x_in = n[leading].input[0]
    if strict and _transposed(f, x_in):
        return None
    cast1 = None
    if dup is None and f.out_edges(sub) == 1:
        child = f.children(sub)[0]
        if f.op(child, "Cast") and f.check_out_edges(child, 2) and f.supported(child):
            cast1 = child
            casts.append(child)
    if not f.check_out_edges(sub, 2 if dup is None and cast1 is None else 1):
        return None
    div = f.first_child(cast1 if cast1 is not None else sub, "Div")
    if dup is not None:
        if not f.check_out_edges(sub, 1) or not f.supported(dup):
            return None
        if div is None:
            div = f.first_child(dup, "Div")
    if div is None or not f.check_out_edges(div, 1) or not f.supported(div):
        return None
    sqrt = f.first_parent(div, "Sqrt")
    if sqrt is None or not f.check_out_edges(sqrt, 1) or not f.supported(sqrt) or not f.parents(sqrt):
        return None
    add2 = f.parent(sqrt, 0)
    if add2 is None or not f.op(add2, "Add") or not f.check_out_edges(add2, 1) or not f.supported(add2):
        return None
    r2 = f.first_parent(add2, "ReduceMean")
    if r2 is None or not f.check_out_edges(r2, 1) or not f.supported(r2, 1) or not f.parents(r2):
        return None
    pow_ = f.parent(r2, 0)
    if pow_ is None or not f.op(pow_, "Pow") or not f.check_out_edges(pow_, 1) or not f.supported(pow_):
        return None
    cast2 = f.first_parent(pow_, "Cast")
    if cast2 is not None and cast2 != cast1:
        if not f.check_out_edges(cast2, 1):
            return None
        casts.append(cast2)
    elif cast2 is None:
        sub2 = f.first_parent(pow_, "Sub")
        if sub2 is None or sub2 not in (sub, dup):
            return None
    after_div = f.children(div)[0]
    if f.op(after_div, "Cast") and f.check_out_edges(after_div, 1):
        casts.append(after_div)
        after_div = f.children(after_div)[0]
    mul = after_div
    if not f.op(mul, "Mul") or not f.check_out_edges(mul, 1) or not f.supported(mul):
        return None
    add = f.children(mul)[0]
    if not f.op(add, "Add") or not f.supported(add):
        return None
    rank = f.rank(n[r1].input[0])
    if not (_last_axis_only(f.axes(r1), rank) and _last_axis_only(f.axes(r2), rank)):
        return None
    scale, bias = _rank_one_input(f, mul), _rank_one_input(f, add)
    if scale is None or bias is None:
        return None
    statistics = [r1, sub, *([dup] if dup is not None else []), pow_, r2, add2, sqrt, div]
    return FusedNorm("LayerNormalization", x_in, n[add].output[0], tuple(n[k].name for k in sorted(statistics)),
                     (n[mul].name, n[add].name), tuple(n[k].name for k in sorted(casts)), scale, bias,
                     _epsilon(f, add2))


def simplified_layer_norms(facts: GraphFacts, taken: Iterable[str] = ()) -> list[FusedNorm]:
    """The subgraphs ``SimplifiedLayerNormFusion`` turns into ``SimplifiedLayerNormalization`` on the
    CUDA EP (RMSNorm), leaving out nodes of ``taken`` (the LayerNorms, which ORT fuses first)."""
    if not facts.has("Pow", "ReduceMean", "Sqrt", "Div"):
        return []
    found, used = [], set(taken)
    for pow_ in range(len(facts.nodes)):
        match = _simplified_at(facts, pow_)
        if match is not None and used.isdisjoint(match.nodes):
            found.append(match)
            used.update(match.nodes)
    return found


def _simplified_at(f: GraphFacts, pow_: int) -> FusedNorm | None:
    n = f.nodes
    if not f.op(pow_, "Pow") or not f.check_out_edges(pow_, 1) or not f.supported(pow_):
        return None
    rm = f.first_child(pow_, "ReduceMean")
    if rm is None or not f.check_out_edges(rm, 1) or not f.supported(rm, 1):
        return None
    add = f.first_child(rm, "Add")
    if add is None or not f.check_out_edges(add, 1) or not f.supported(add):
        return None
    sqrt = f.first_child(add, "Sqrt")
    if sqrt is None or not f.check_out_edges(sqrt, 1) or not f.supported(sqrt):
        return None
    div = f.first_child(sqrt, "Div")
    if div is None or not f.check_out_edges(div, 1) or not f.supported(div):
        return None
    x = n[pow_].input[0]
    statistics = [pow_, rm, add, sqrt, div]
    if n[div].input[0] != x:
        # ORT's DivMulFusion first turns Mul(x, Div(1, s)) into Div(x, s).
        if f.scalar(n[div].input[0]) != 1.0:
            return None
        times = f.children(div)[0]
        if not f.op(times, "Mul") or x not in n[times].input or not f.check_out_edges(times, 1):
            return None
        statistics.append(times)
        div = times
    casts = []
    leading = f.producer.get(x)
    x_in = x
    if leading is not None and f.op(leading, "Cast") and f.check_out_edges(leading, 2):
        casts.append(leading)
        x_in = n[leading].input[0]
    if _transposed(f, x_in) or f.op(f.producer.get(x_in, -1), "Sub"):
        # ORT may also fuse the tail of a LayerNorm it could not fuse (x - mean, normalized), or
        # not, as its transpose optimizer left the graph: such a tail is not counted on.
        return None
    mul = f.children(div)[0]
    if f.op(mul, "Cast") and f.check_out_edges(mul, 1):
        casts.append(mul)
        mul = f.children(mul)[0]
    if not f.op(mul, "Mul") or not f.supported(mul):
        return None
    if not _last_axis_only(f.axes(rm), f.rank(n[rm].input[0])):
        return None
    scale = _rank_one_input(f, mul)
    if scale is None:
        return None
    return FusedNorm("SimplifiedLayerNormalization", x_in, n[mul].output[0],
                     tuple(n[k].name for k in sorted(statistics)), (n[mul].name,),
                     tuple(n[k].name for k in sorted(casts)), scale, None, _epsilon(f, add))


def fused_norms(facts: GraphFacts, strict: bool = True) -> list[FusedNorm]:
    """Every LayerNorm and RMSNorm subgraph ORT fuses on the CUDA EP, LayerNorms first (ORT's order);
    ``strict`` as in :func:`layer_norms`."""
    norms = layer_norms(facts, strict)
    return norms + simplified_layer_norms(facts, (name for norm in norms for name in norm.nodes))


def inside_fused_kernels(graph: onnx.GraphProto) -> set[str]:
    """The tensors of ``graph`` and its bodies that ORT computes inside a fused kernel that works in
    float32 (never rounded): every output of a fused normalization's nodes but its final one, and
    likewise of an Erf GELU that ORT makes a ``Gelu`` (not one it makes a ``BiasGelu``, which
    computes in the low type; docs/coloring.md, kernel facts)."""
    from onnxmp.subgraphs import iter_proto_graphs

    inside = set()
    for g in iter_proto_graphs(graph):
        facts = GraphFacts(g)
        groups = [(set(norm.nodes), norm.output) for norm in fused_norms(facts)]
        for match in gelus(facts):
            if bias_gelu_add(facts, match) is None:
                groups.append((set(match), facts.nodes[facts.position[match[-1]]].output[0]))
        for names, output in groups:
            inside.update(out for name in names for out in facts.nodes[facts.position[name]].output if out != output)
    return inside


def skip_layer_norm_adds(facts: GraphFacts, norms: Mapping[str, tuple[str, Collection[str]]]) -> dict[str, str]:
    """``SkipLayerNormFusion``'s first Add (Format 3; skip_layer_norm_fusion.cc r19:28-62, 238-251).
    ``norms``: ``{input: (norm id, its node names)}`` for real ``LayerNormalization`` nodes and fused
    ones alike (not RMSNorms: ORT 1.19 folds no Add into a SimplifiedLayerNormalization, T5's test).  ORT runs it after ``LayerNormFusion``, so an Add that a decomposed norm's nodes alone
    read has one output edge by then.  An ``Add`` of two 3-D inputs of one shape, written to no
    graph output and read by the norm only: ``{add node: norm id}``."""
    found = {}
    for x, (norm, members) in norms.items():
        k = facts.producer.get(x)
        if k is None or not facts.op(k, "Add") or facts.writes_graph_output(k):
            continue
        if any(facts.nodes[c].name not in members for c in facts.edges.get(x, ())):
            continue  # a pre-LN residual stream reads the sum again: not fused
        a, b = facts.nodes[k].input[:2]
        if facts.rank(a) == facts.rank(b) == 3 and facts.shapes_equal(a, b):
            found[facts.nodes[k].name] = norm
    return found


def _is_value(facts: GraphFacts, name: str, expected: float) -> bool:
    """optimizer_utils::IsInitializerWithExpectedValue: a float32 or float64 scalar within 1e-5
    (relative) of ``expected``, or a float16 one within that of ``expected`` rounded to float16
    (optimizer/utils.cc r19:41-97); any other type, bfloat16 included, never matches."""
    tensor = facts.constants.get(name)
    if tensor is None or int(np.prod(tensor.dims)) != 1:
        return False
    value = float(onnx.numpy_helper.to_array(tensor).reshape(-1)[0])
    if tensor.data_type == onnx.TensorProto.FLOAT16:
        target = float(np.float16(expected))
    elif tensor.data_type in (FLOAT, onnx.TensorProto.DOUBLE):
        target = expected
    else:
        return False
    return np.isfinite(value) and abs(value - target) <= 1e-8 + 1e-5 * abs(expected)


def gelus(facts: GraphFacts) -> list[tuple[str, ...]]:
    """``GeluFusion``: ``Div(x, sqrt(2)) -> Erf -> Add(1) -> Mul(x) -> Mul(0.5)`` (either order of the
    two Muls), each node read only by the next; the node names of each match."""
    if not facts.has("Div", "Erf", "Add", "Mul"):
        return []
    found = []
    for div in range(len(facts.nodes)):
        f, n = facts, facts.nodes
        if not f.op(div, "Div") or not f.check_out_edges(div, 1):
            continue
        root = n[div].input[1] if len(n[div].input) > 1 else ""
        if not (_is_value(f, root, 1.4142099618911743) or _is_value(f, root, float(np.sqrt(2.0)))):
            continue
        erf = f.children(div)[0]
        if not f.op(erf, "Erf") or not f.check_out_edges(erf, 1):
            continue
        add = f.children(erf)[0]
        if not f.op(add, "Add") or not f.check_out_edges(add, 1) or \
                not any(_is_value(f, name, 1.0) for name in n[add].input):
            continue
        mul = f.children(add)[0]
        if not f.op(mul, "Mul"):
            continue
        x = n[div].input[0]
        half = None
        if x in n[mul].input and f.check_out_edges(mul, 1):
            half = f.children(mul)[0]
            if not (f.op(half, "Mul") and any(_is_value(f, name, 0.5) for name in n[half].input)):
                continue
            found.append(tuple(n[k].name for k in (div, erf, add, mul, half)))
            continue
        other = next((f.producer.get(name) for name in n[mul].input if name != n[add].output[0]), None)
        if other is not None and f.op(other, "Mul") and x in n[other].input \
                and any(_is_value(f, name, 0.5) for name in n[other].input):
            found.append(tuple(n[k].name for k in (div, erf, add, other, mul)))
    return found


def bias_gelu_add(facts: GraphFacts, gelu: tuple[str, ...]) -> str | None:
    """``BiasGeluFusion``: the ``Add`` of a 1-D bias feeding a fused GELU (``gelu``: its node names,
    the ``Div`` first), read by nothing else; its name, or None."""
    x = facts.nodes[facts.position[gelu[0]]].input[0]
    k = facts.producer.get(x)
    if k is None or not facts.op(k, "Add") or facts.writes_graph_output(k):
        return None
    # The Gelu reads x twice (Div and Mul): after the fusion one edge is left, the Add's only one.
    if facts.out_edges(k) != 2:
        return None
    inputs = facts.nodes[k].input
    if not any(facts.rank(name) == 1 for name in inputs):
        return None
    return facts.nodes[k].name


_FAST_GELU = {"cube": 0.044715, "cube2": 0.044714998453855515, "root": 0.7978845834732056}


def fast_gelus(facts: GraphFacts) -> list[tuple[str, ...]]:
    """``FastGeluFusion``: the tanh GELU ``0.5 * x * (1 + tanh(0.79788 * (x + 0.044715 * x**3)))`` as
    exporters write it, with ``Pow(x, 3)`` (GPT-2, ALBERT's gelu_new) or as ``x * (0.79788 * x) *
    (1 + 0.044715 * x * x)``: the node names of each match (fast_gelu_fusion.cc, r19:35-305)."""
    if not facts.has("Tanh", "Mul", "Add"):
        return []
    f, n = facts, facts.nodes
    found = []
    for k in range(len(n)):
        start = _fast_gelu_pow(f, k) or _fast_gelu_muls(f, k)
        if start is None:
            continue
        members, tanh_input, x = start
        tanh = f.children(tanh_input)[0]
        if not f.op(tanh, "Tanh") or not f.check_out_edges(tanh, 1):
            continue
        add2 = f.children(tanh)[0]
        if not f.op(add2, "Add") or not f.check_out_edges(add2, 1) or \
                not any(_is_value(f, name, 1.0) for name in n[add2].input if name != n[tanh].output[0]):
            continue
        mul5 = f.children(add2)[0]
        if not f.op(mul5, "Mul") or f.writes_graph_output(mul5):
            continue
        other = next((f.producer.get(name) for name in n[mul5].input if name != n[add2].output[0]), None)
        if other is None or not f.op(other, "Mul") or f.writes_graph_output(other):
            continue
        half = [name for name in n[other].input if _is_value(f, name, 0.5)]
        if not half or [name for name in n[other].input if name not in half] != [x]:
            continue
        found.append(tuple(n[i].name for i in (*members, tanh, add2, other, mul5)))
    return found


def _fast_gelu_pow(f: GraphFacts, pow_: int):
    """Formula 2: Pow(x, 3) -> Mul(0.044715) -> Add(x) -> Mul(0.79788)."""
    n = f.nodes
    if not f.op(pow_, "Pow") or f.out_edges(pow_) != 1 or len(n[pow_].input) < 2 or \
            not _is_value(f, n[pow_].input[1], 3.0):
        return None
    x = n[pow_].input[0]
    mul1 = f.children(pow_)[0]
    if not f.op(mul1, "Mul") or not f.check_out_edges(mul1, 1) or \
            not any(_is_value(f, t, _FAST_GELU["cube2"]) for t in n[mul1].input if t != n[pow_].output[0]):
        return None
    add1 = f.children(mul1)[0]
    if not f.op(add1, "Add") or not f.check_out_edges(add1, 1) or \
            [t for t in n[add1].input if t != n[mul1].output[0]] != [x]:
        return None
    mul2 = f.children(add1)[0]
    if not f.op(mul2, "Mul") or not f.check_out_edges(mul2, 1) or \
            not any(_is_value(f, t, _FAST_GELU["root"]) for t in n[mul2].input if t != n[add1].output[0]):
        return None
    return [pow_, mul1, add1, mul2], mul2, x


def _fast_gelu_muls(f: GraphFacts, mul1: int):
    """Formula 1: Mul(x, 0.044715) -> Mul(x) -> Add(1) -> Mul(Mul(x, 0.79788))."""
    n = f.nodes
    if not f.op(mul1, "Mul") or f.out_edges(mul1) != 1:
        return None
    constant = [t for t in n[mul1].input if _is_value(f, t, _FAST_GELU["cube"])]
    rest = [t for t in n[mul1].input if t not in constant]
    if not constant or len(rest) != 1:
        return None
    x = rest[0]
    mul2 = f.children(mul1)[0]
    if not f.op(mul2, "Mul") or not f.check_out_edges(mul2, 1) or \
            [t for t in n[mul2].input if t != n[mul1].output[0]] != [x]:
        return None
    add1 = f.children(mul2)[0]
    if not f.op(add1, "Add") or not f.check_out_edges(add1, 1) or \
            not any(_is_value(f, t, 1.0) for t in n[add1].input if t != n[mul2].output[0]):
        return None
    mul3 = f.children(add1)[0]
    if not f.op(mul3, "Mul") or not f.check_out_edges(mul3, 1):
        return None
    mul4 = next((f.producer.get(t) for t in n[mul3].input if t != n[add1].output[0]), None)
    if mul4 is None or not f.op(mul4, "Mul") or not f.check_out_edges(mul4, 1) or \
            not any(_is_value(f, t, _FAST_GELU["root"]) for t in n[mul4].input) or x not in n[mul4].input:
        return None
    return [mul1, mul2, add1, mul4, mul3], mul3, x
