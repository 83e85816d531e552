"""The normalizations onnxruntime fuses on the CUDA EP: ``LayerNormFusion``,
``SimplifiedLayerNormFusion`` and ``SkipLayerNormFusion``'s Add, by ORT's own conditions
(see :mod:`onnxmp.fusions`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping

from onnxmp.fusions.graph_facts import FLOAT, GraphFacts


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
