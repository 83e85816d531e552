"""Pass shape, after onnx-ir: a pass checks its precondition, runs, checks its
postcondition, and returns whether it changed anything."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from onnxmp.errors import OnnxMPError


@dataclass
class PassResult:
    """``modified`` tells the pipeline whether the pass changed the graph/analysis."""

    modified: bool
    details: dict[str, Any] = field(default_factory=dict)


class PassConditionError(OnnxMPError):
    """A pre- or postcondition failed: a bug in onnxmp or an unexpected graph."""


def require(condition: bool, pass_name: str, what: str, hint: str | None = None) -> None:
    if not condition:
        raise PassConditionError(
            f"{pass_name}: condition violated: {what}",
            hint=hint or "this is an onnxmp bug; please report it with the model (or `onnxmp explain --json`)",
        )
