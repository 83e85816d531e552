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

The package: :mod:`~onnxmp.fusions.graph_facts` (what the matchers read), :mod:`~onnxmp.fusions.norms`,
:mod:`~onnxmp.fusions.gelus`; :func:`inside_fused_kernels` joins them for the emulation.
"""
from __future__ import annotations

import onnx

from onnxmp.fusions.gelus import bias_gelu_add, fast_gelus, gelus
from onnxmp.fusions.graph_facts import GraphFacts, Lookup
from onnxmp.fusions.norms import FusedNorm, fused_norms, layer_norms, simplified_layer_norms, skip_layer_norm_adds


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


__all__ = ["FusedNorm", "GraphFacts", "Lookup", "bias_gelu_add", "fast_gelus", "fused_norms", "gelus",
           "inside_fused_kernels", "layer_norms", "simplified_layer_norms", "skip_layer_norm_adds"]
