"""Stage 3: color.  The data seeds, then TF's AMP rules in TF's order (``docs/coloring.md``).

The vertices and edges are built once (:func:`~onnxmp.color.vertices.build_type_view`); every
seed and rule is one function over the :class:`~onnxmp.color.rules.Coloring` state, run by one
:class:`~onnxmp.passes.PassManager`.  The result is an analysis, ``{vertex: (color, rule, cause)}``;
nothing is written into the graph.
"""
from __future__ import annotations

import logging

from onnxmp.color.rules import (
    ALLOW, DENY, FP32, Coloring, Reason,
    add_allow_ops, add_clear_and_infer_to_allow_if_between_allow, add_constant_fed_to_allow_if_before_allow,
    add_infer_to_allow_if_follow_allow,
    allow_only_where_ok, follow_input_in_fused_normalizations, force_color_match,
    make_casts_allow_if_all_outputs_allow, propagate_allow_through_clear, take_low_inputs_of_float32_kernels,
    propagate_deny_forward_through_clear_and_infer, remove_allow_set_with_fp32,
)
from onnxmp.color.masks import mask_fills
from onnxmp.color.seeds import seed_deny_forced, seed_deny_from_calibration, seed_deny_from_initializer_range
from onnxmp.color.vertices import TypeView, Vertex, build_type_view
from onnxmp.index import ModelIndex
from onnxmp.kernels import KernelTable
from onnxmp.options import Resolved
from onnxmp.passes import FunctionPass, PassBase, PassManager
from onnxmp.precision import BFLOAT16

__all__ = ["ALLOW", "DENY", "FP32", "Coloring", "Reason", "TypeView", "Vertex", "color", "color_passes", "uncolored"]

log = logging.getLogger("onnxmp.color")

_ALLOW_OK = (allow_only_where_ok, "every ALLOW vertex is processed, float32 and low-precision capable")


def _for(kernels: KernelTable | None, options: Resolved) -> KernelTable:
    """The kernel facts of the onnxruntime versions converted for (a model must load in each)."""
    return (kernels or KernelTable.default()).for_version(options.ort_version)


def _float32_compute(index: ModelIndex, options: Resolved, kernels: KernelTable):
    """op key (``Op`` or ``domain:Op``) -> whether its low kernel on the target computes in float32."""
    def computes_in_float32(key: str) -> bool:
        domain, _, op_type = key.rpartition(":")
        return kernels.computes_in_float32(options.target.provider, domain, op_type, index.opset_of(domain),
                                           options.precision.name)
    return computes_in_float32


def color_passes(index: ModelIndex, options: Resolved, kernels: KernelTable | None = None) -> list[PassBase[Coloring]]:
    """The seeds that apply to ``options``, then TF's rules in TF's order (with onnxmp's rule for
    the normalizations ORT fuses after TF's removal of incapable vertices)."""
    passes = [FunctionPass(seed_deny_from_initializer_range, index, underflow_share=options.underflow_share)]
    if options.magnitudes:
        passes.append(FunctionPass(seed_deny_from_calibration, options.magnitudes, options.calibration_threshold))
    if options.forced_deny:
        passes.append(FunctionPass(seed_deny_forced, options.forced_deny))
    passes += [
        FunctionPass(add_allow_ops, ensures=_ALLOW_OK),
        FunctionPass(propagate_deny_forward_through_clear_and_infer),
        FunctionPass(add_clear_and_infer_to_allow_if_between_allow),
        FunctionPass(add_constant_fed_to_allow_if_before_allow),
    ]
    if options.precision is BFLOAT16:
        passes.append(FunctionPass(add_infer_to_allow_if_follow_allow))
    passes += [
        FunctionPass(propagate_allow_through_clear),
        FunctionPass(remove_allow_set_with_fp32, ensures=_ALLOW_OK),
        FunctionPass(take_low_inputs_of_float32_kernels,
                     _float32_compute(index, options, _for(kernels, options)), ensures=_ALLOW_OK),
        FunctionPass(follow_input_in_fused_normalizations, ensures=_ALLOW_OK),
        FunctionPass(force_color_match),
        FunctionPass(make_casts_allow_if_all_outputs_allow),
    ]
    return passes


def uncolored(index: ModelIndex, options: Resolved, *, kernels: KernelTable | None = None) -> Coloring:
    """The state before any pass: the vertices and edges of ``index`` for ``options``, nothing painted
    (calibration starts many colorings from one, :mod:`onnxmp.calibrate.colorings`)."""
    view = build_type_view(index, options.lists, low=options.precision, provider=options.target.provider,
                           kernels=_for(kernels, options), block_nodes=options.block_nodes,
                           keep_io_types=options.keep_io_types, initializer_inputs=index.initializer_inputs,
                           ort_version=options.ort_version)
    return Coloring(view, low_name=options.precision.name, mask_fills=mask_fills(index, options.precision))


def color(index: ModelIndex, options: Resolved, *, kernels: KernelTable | None = None,
          timings: dict[str, float] | None = None) -> Coloring:
    """Color every (node, type parameter) vertex of ``index``'s graphs for ``options``."""
    state = uncolored(index, options, kernels=kernels)
    result = PassManager(color_passes(index, options, kernels), log=log, timings=timings)(state)
    if result.details.get("add_allow_ops") and result.details["add_allow_ops"].stop:
        log.info("no allow-list op can run in %s here; the model is left unchanged", options.precision.name)
    return state
