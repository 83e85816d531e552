"""Fused units: the subgraphs ORT runs as one kernel, colored as that kernel (``onnxmp.fusions``
finds them; the kernel facts say what each computes in).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass, field

from onnxmp.fusions import FusedNorm, GraphFacts, fast_gelus, fused_norms
from onnxmp.index import ModelIndex
from onnxmp.precision import Precision

if TYPE_CHECKING:
    from onnxmp.color.vertices import TypeView


@dataclass
class FusedUnit:
    """A subgraph ORT runs as one normalization kernel that computes in float32 (``onnxmp.fusions``).

    Colored as the kernel it becomes: its ``statistics`` nodes are on no list (the kernel computes
    them in float32 whatever precision surrounds them), and its ``affine`` vertices (the scale
    ``Mul`` and bias ``Add``) take the precision of its ``input`` (see
    ``follow_input_in_fused_normalizations``)."""

    norm: FusedNorm
    graph: str
    affine: list[int]                       # vertex ids of the scale Mul and the bias Add
    readers: list[tuple[str, str]] = field(default_factory=list)  # (statistics node, input) reading ``input``


def fuses_norms(graph: ModelIndex, kernels, provider: str, low: Precision) -> bool:
    """The target's fused normalization kernels compute in float32 for ``low`` (CUDA: yes)."""
    opset = graph.opset_of("")
    return all(kernels.computes_in_float32(provider, "", op, opset, low.name)
               for op in ("LayerNormalization", "SimplifiedLayerNormalization"))


def fused_units(view: TypeView, graph: ModelIndex, facts: list[GraphFacts], kernels, provider: str,
                 low: Precision) -> list[FusedUnit]:
    """The normalizations ORT fuses, colored as the kernels they become: statistics on no list."""
    units = []
    for scope, scope_facts in zip(graph.scopes, facts):
        for norm in fused_norms(scope_facts, strict=False):
            numerics = kernels.numerics(provider, "", norm.kind, graph.opset_of(""), low.name)
            why = (f"computed in float32 inside the {norm.kind} kernel ORT fuses this subgraph into "
                   f"({numerics['file'].split(' ')[0]})")
            for name in (*norm.statistics, *norm.casts):
                for vid in view.ids_of_node(name):
                    kind = view.v_kind[vid].copy()
                    kind.list, kind.processed, kind.why_not = None, False, why
                    view.v_kind[vid] = kind.settle()
            affine = [vid for name in norm.affine for vid in view.ids_of_node(name) if view.v_kind[vid].float32]
            readers = [(name, norm.input) for name in norm.statistics
                       if norm.input in view.node_ins[view.node_index[name]]]
            units.append(FusedUnit(norm, scope.gid, affine, readers))
    return units


def tanh_gelu_cubes(view: TypeView, graph: ModelIndex, facts: list[GraphFacts]) -> None:
    """The ``Pow(x, 3)`` of a tanh GELU (``onnxmp.fusions.fast_gelus``) is no deny op: where ``x**3``
    overflows, ``tanh`` has reached +-1 and the GELU its limits (x or 0), fused by ORT or not."""
    for scope_facts in facts:
        for match in fast_gelus(scope_facts):
            for vid in view.ids_of_node(match[0]):
                kind = view.v_kind[vid]
                if kind.list == "deny":
                    kind = kind.copy()
                    kind.list = "infer"
                    view.v_kind[vid] = kind.settle()
                    view.notes[vid] = "the cube of a tanh GELU: overflow gives the GELU's limits"
