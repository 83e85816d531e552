"""Stage 3: color.  Runs the data seeds and TF's passes in spec order."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Mapping


from onnxmp.color.rules import (
    ALLOW, DENY, FP32, Coloring, Reason,
    add_allow_ops, add_clear_and_infer_to_allow_if_between_allow, add_infer_to_allow_if_follow_allow,
    force_color_match, make_casts_allow_if_all_outputs_allow, propagate_allow_through_clear,
    propagate_deny_forward_through_clear_and_infer, remove_allow_set_with_fp32,
)
from onnxmp.color.seeds import (
    DEFAULT_THRESHOLD, DEFAULT_UNDERFLOW_SHARE, seed_deny_forced, seed_deny_from_calibration, seed_deny_from_initializer_range,
)
from onnxmp.color.vertices import TypeView, Vertex, build_type_view
from onnxmp.index import ModelIndex
from onnxmp.kernels import KernelTable
from onnxmp.passes import PassResult
from onnxmp.precision import BFLOAT16, low_precision

__all__ = ["ALLOW", "DENY", "FP32", "Coloring", "Reason", "TypeView", "Vertex", "ColorOptions", "color",
           ]

log = logging.getLogger("onnxmp.color")

PROVIDERS = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}


@dataclass
class ColorOptions:
    lists: Mapping[str, frozenset[str]]
    target: str = "cuda"
    precision: str = "float16"
    level: str = "default"
    block_nodes: Iterable[str] = ()
    keep_io_types: bool | frozenset[str] = True  # or the main-graph I/O names kept (convert resolves lists)
    underflow_share: float = DEFAULT_UNDERFLOW_SHARE
    calibration_magnitudes: Mapping[str, float] | None = None
    calibration_threshold: float = DEFAULT_THRESHOLD
    forced_deny: Mapping[str, str] | None = None  # node name -> cause (accuracy fallback)
    kernels: KernelTable | None = None
    initializer_inputs: tuple[str, ...] = ()


@dataclass
class ColorResult:
    coloring: Coloring


def color(graph: ModelIndex, options: ColorOptions) -> ColorResult:
    kernels = options.kernels or KernelTable.default()
    view = build_type_view(graph, options.lists, low=low_precision(options.precision),
                           provider=PROVIDERS[options.target], kernels=kernels,
                           block_nodes=options.block_nodes, keep_io_types=options.keep_io_types,
                           initializer_inputs=options.initializer_inputs)
    state = Coloring(view, low_name=options.precision)
    result = ColorResult(state)

    def run(name: str, fn, *args, **kwargs) -> PassResult:
        outcome = fn(state, *args, **kwargs)
        log.debug("%s: %s", name, outcome.details)
        return outcome

    run("seed_deny_from_initializer_range", seed_deny_from_initializer_range, graph,
        underflow_share=options.underflow_share)
    if options.calibration_magnitudes:
        run("seed_deny_from_calibration", seed_deny_from_calibration, options.calibration_magnitudes,
            options.calibration_threshold)
    if options.forced_deny:
        run("seed_deny_forced", seed_deny_forced, options.forced_deny)
    if not run("add_allow_ops", add_allow_ops).modified:
        log.info("no allow-list op can run in %s here; the model is left unchanged", options.precision)
        return result
    run("propagate_deny_forward_through_clear_and_infer", propagate_deny_forward_through_clear_and_infer)
    run("add_clear_and_infer_to_allow_if_between_allow", add_clear_and_infer_to_allow_if_between_allow)
    if options.precision == BFLOAT16.name:
        run("add_infer_to_allow_if_follow_allow", add_infer_to_allow_if_follow_allow)
    run("propagate_allow_through_clear", propagate_allow_through_clear)
    run("remove_allow_set_with_fp32", remove_allow_set_with_fp32)
    run("force_color_match", force_color_match)
    run("make_casts_allow_if_all_outputs_allow", make_casts_allow_if_all_outputs_allow)
    return result
