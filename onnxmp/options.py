"""The one options object: every choice a conversion takes, checked once.

:class:`Options` is what callers fill in: the Python API (``onnxmp.convert(model,
precision="bfloat16")`` or ``onnxmp.convert(model, Options(...))``), the CLI (``options_from``
in ``onnxmp.cli.convert``), calibration, the compat functions and training all build one.
:meth:`Options.resolve` checks it against one model and gives the :class:`Resolved` form the
stages read: the target's and precision's descriptors, the final op lists, compiled node
patterns and the input/output names kept.  A bad value is one :class:`OnnxMPError` with a hint,
before any work.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
import onnx

from onnxmp.domains import onnx_opset
from onnxmp.errors import OnnxMPError
from onnxmp.lists import ListOverrides, resolve_lists
from onnxmp.precision import Precision, low_precision
from onnxmp.targets import Target, target

DEFAULT_UNDERFLOW_SHARE = 0.5     # share of an initializer's values that may flush or turn subnormal
DEFAULT_THRESHOLD = 65504.0 / 4   # calibration: |x| above which an intermediate's node is denied
DEFAULT_TOLERANCE = 1e-2          # calibration: per output, in the metric's units
MAX_RUNS = 2000                   # calibration: emulated runs before the search returns the best model found

_CALIBRATION_ONLY = ("tolerance", "metric", "holdout", "max_runs", "time_budget")


@dataclass(frozen=True)
class Options:
    """How to convert.

    ``target``: the execution provider converted for (``cuda``, ``cpu``).  ``precision``:
    ``float16`` or ``bfloat16``.  ``keep_io_types``: True keeps every graph input and output as
    declared; False turns every float32 one low precision; a list of names or regular expressions
    (whole names) keeps those and lowers the other float32 ones.  ``level``: TF's AMP levels
    (``default``, ``tensor_cores_only``, ``treat_infer_as_deny``, ``unsafe_force_all``).
    ``lists``: list overrides, ``{"deny_add": ["Pow"], ...}``.  ``block_nodes``: regular
    expressions of node names kept in float32.  ``master_weights``: initializers that stay
    float32 and are Cast at each low-precision use (training).  ``underflow_share``: the share
    of an initializer's non-zero values that may flush or turn subnormal before its node stays
    float32.  ``forced_deny``: node name -> cause, nodes kept in float32 (the compat functions'
    range limits; calibration's culprits).  ``ort_version``: the onnxruntime the model will run on
    (``"1.19.2"``; ``"1.19.2,1.32.0"`` or ``"all"`` for a model that must load in each); it decides
    the schemas and kernels of onnxruntime's own ops (1.19.2 has no bfloat16 Attention).  Default:
    ``"all"``, every onnxruntime the tables know (1.19.2 to the newest): a converted model travels
    from the machine that converts it to the one that runs it, and must load in whichever supported
    onnxruntime that is; name one version to use what only it offers.

    Calibration (``calibration``: sample inputs, a dict of arrays, a list of them or .npz paths)
    adds the magnitude seed (``calibration_threshold``) and the accuracy-guided search to
    ``tolerance`` under ``metric``, tuning on all but the last ``holdout`` samples and stopping
    after ``max_runs`` emulated runs or ``time_budget`` seconds, keeping the best model found
    (``docs/calibration.md``).
    """

    target: str = "cuda"
    precision: str = "float16"
    keep_io_types: bool | Iterable[str] = True
    level: str = "default"
    lists: Mapping[str, Iterable[str]] | ListOverrides | None = None
    block_nodes: Iterable[str] = ()
    master_weights: Iterable[str] = ()
    underflow_share: float = DEFAULT_UNDERFLOW_SHARE
    forced_deny: Mapping[str, str] | None = None
    ort_version: str | None = None
    calibration: Any = None
    calibration_threshold: float = DEFAULT_THRESHOLD
    tolerance: float | None = None
    metric: Any = None
    holdout: int | None = None
    max_runs: int | None = None
    time_budget: float | None = None

    @classmethod
    def of(cls, options: Options | None = None, **changes) -> Options:
        """``options`` (or the defaults) with ``changes``; an unknown name is a clear error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(changes) - known)
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            raise OnnxMPError(f"unknown option {unknown[0]!r}",
                              hint=(f"did you mean {close[0]!r}? " if close else "")
                              + f"options: {', '.join(sorted(known))}")
        return dataclasses.replace(options or cls(), **changes)

    def check_calibration(self) -> None:
        """The calibration settings need samples, and take only sensible values."""
        if self.calibration is None:
            for name in _CALIBRATION_ONLY:
                if getattr(self, name) is not None:
                    raise OnnxMPError(f"{name} needs calibration samples",
                                      hint="pass calibration=inputs (or --calibrate a.npz)")
            return
        if self.tolerance is not None and not self.tolerance > 0:
            raise OnnxMPError(f"tolerance must be positive, got {self.tolerance}", hint="e.g. --tolerance 0.01")
        if self.max_runs is not None and self.max_runs < 1:
            raise OnnxMPError(f"max_runs must be at least 1, got {self.max_runs}")
        if self.time_budget is not None and not self.time_budget > 0:
            raise OnnxMPError(f"time_budget must be positive seconds, got {self.time_budget}",
                              hint="e.g. --time-budget 60")
        if self.holdout is not None and self.holdout < 0:
            raise OnnxMPError(f"holdout must be at least 0, got {self.holdout}")

    def resolve(self, model: onnx.ModelProto) -> Resolved:
        """The options as the stages read them for ``model``, every value checked (the calibration
        settings by :meth:`check_calibration`, which :func:`onnxmp.convert` runs first)."""
        chosen = target(self.target)
        low = low_precision(self.precision)
        opset = onnx_opset(model)
        newest = onnx.defs.onnx_opset_version()
        if opset is not None and opset > newest:
            # Schemas decide which tensors change type together; guessing them for an unknown opset
            # could silently produce an invalid model.
            raise OnnxMPError(f"the model uses ai.onnx opset {opset}, newer than this onnx {onnx.__version__} knows "
                              f"(up to {newest})",
                              hint=f"upgrade onnx, or convert the model down with "
                                   f"onnx.version_converter.convert_version(model, {newest})")
        if low.name == "bfloat16" and opset is not None and opset < 13:
            raise OnnxMPError(f"bfloat16 needs opset >= 13 (Cast to bfloat16); the model has opset {opset}",
                              hint="upgrade it with onnx.version_converter.convert_version(model, 13)")
        if not 0 <= self.underflow_share <= 1:
            raise OnnxMPError(f"underflow_share must lie in [0, 1], got {self.underflow_share}")
        block = [self.block_nodes] if isinstance(self.block_nodes, str) else list(self.block_nodes or ())
        for pattern in block:
            try:
                re.compile(pattern)
            except Exception as exc:
                raise OnnxMPError(f"bad --block-node pattern {pattern!r}: {exc}",
                                  hint="use a Python regular expression") from None
        master = [self.master_weights] if isinstance(self.master_weights, str) else self.master_weights
        return Resolved(target=chosen, precision=low, level=self.level,
                        lists=resolve_lists(chosen.name, low.name, self.level, self.lists),
                        block_nodes=tuple(block), keep_io_types=kept_io(model, self.keep_io_types),
                        master_weights=tuple(master or ()), underflow_share=self.underflow_share,
                        forced_deny=dict(self.forced_deny or {}), calibration_threshold=self.calibration_threshold,
                        ort_version=_ort_version(self.ort_version))


@dataclass(frozen=True)
class Resolved:
    """:class:`Options` checked against one model: what the stages read.  ``magnitudes`` (tensor ->
    max |x| of the float32 model on calibration data) is set by calibration."""

    target: Target
    precision: Precision
    level: str
    lists: Mapping[str, frozenset[str]]
    block_nodes: tuple[str, ...]
    keep_io_types: bool | frozenset[str]
    master_weights: tuple[str, ...]
    underflow_share: float
    forced_deny: Mapping[str, str] = field(default_factory=dict)
    calibration_threshold: float = DEFAULT_THRESHOLD
    magnitudes: Mapping[str, float] | None = None
    ort_version: str | None = None

    def replace(self, **changes) -> Resolved:
        return dataclasses.replace(self, **changes)


def _ort_version(version: str | None) -> str:
    """The onnxruntime versions converted for: ``version``, else every one the schema table knows
    (a written model must load in each onnxruntime onnxmp supports, not only the converting
    machine's)."""
    if version is not None:
        parts = [p.strip() for p in str(version).split(",")]
        if str(version).strip() != "all" and not all(re.fullmatch(r"\d+\.\d+(\.\d+)?", p) for p in parts):
            raise OnnxMPError(f"ort_version takes an onnxruntime version such as '1.19.2', several separated by "
                              f"commas, or 'all'; got {version!r}")
        return ",".join(parts)
    return "all"


def kept_io(model: onnx.ModelProto, keep_io_types) -> bool | frozenset[str]:
    """``keep_io_types`` as the stages take it: True, False, or the set of main-graph input and
    output names that keep their type.  A list (or one string) holds names or Python regular
    expressions matched against whole names; every other float32 input and output takes the
    low-precision type, as a list means in onnxruntime's float16 converter."""
    if isinstance(keep_io_types, (bool, np.bool_)):
        return bool(keep_io_types)
    if isinstance(keep_io_types, frozenset):
        return keep_io_types  # resolved already
    entries = [keep_io_types] if isinstance(keep_io_types, str) else list(keep_io_types)
    names = list(dict.fromkeys([v.name for v in model.graph.input] + [v.name for v in model.graph.output]))
    kept: set[str] = set()
    for entry in entries:
        if not isinstance(entry, str):
            raise OnnxMPError(f"keep_io_types takes True, False or input/output names; got {entry!r} in the list",
                              hint="e.g. keep_io_types=['logits'] or --keep-io-types logits")
        try:
            pattern = re.compile(entry)
        except re.error as exc:
            raise OnnxMPError(f"bad keep_io_types pattern {entry!r}: {exc}",
                              hint="a name, or a Python regular expression matching whole names") from None
        hits = [n for n in names if n == entry or pattern.fullmatch(n)]
        if not hits:
            close = difflib.get_close_matches(entry, names, n=3)
            raise OnnxMPError(f"keep_io_types {entry!r} matches no graph input or output",
                              hint=(f"did you mean {', '.join(map(repr, close))}? " if close else "")
                              + f"inputs and outputs: {', '.join(names[:12])}")
        kept.update(hits)
    return frozenset(kept)
