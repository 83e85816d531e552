"""Fresh tensor and node names, and JSON that survives inf/NaN: small helpers every stage needs."""
from __future__ import annotations

import math
from typing import Any, Container, Iterable

import onnx


class FreshNames:
    """Deterministic names that collide with nothing already used, nor with each other.
    ``taken`` are more containers of used names, looked up without being copied."""

    def __init__(self, used: Iterable[str], *taken: Container[str]):
        self.used = set(used)
        self.taken = taken

    def __call__(self, base: str) -> str:
        name, k = base, 0
        while name in self.used or any(name in names for names in self.taken):
            k += 1
            name = f"{base}_{k}"
        self.used.add(name)
        return name


def proto_names(graph: onnx.GraphProto) -> set[str]:
    """Every value and node name in ``graph`` and its subgraphs."""
    names = {v.name for v in [*graph.input, *graph.output, *graph.value_info]}
    names.update(t.name for t in graph.initializer)
    for node in graph.node:
        names.add(node.name)
        names.update(node.input)
        names.update(node.output)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
                names |= proto_names(sub)
    return names


def json_safe(value: Any) -> Any:
    """JSON has no inf/NaN: write them as strings ("inf", "-inf", "nan")."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
