"""Control-flow color groups: tensors bound across an If/Loop/Scan boundary that must share one
type (TF's force_color_match).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import onnx

from onnxmp.subgraphs import GRAPH


@dataclass
class ColorGroup:
    """Tensors bound across a control-flow boundary that must share one type (TF's force_color_match).

    ``members`` are (graph id, tensor name); ``must_allow`` are the tensors whose
    producer vertex must be ALLOW (values computed in a body), ``must_not_deny``
    those whose producer may be anything but DENY (an outer initial value: one
    Cast outside the loop is cheap).  ``low_inputs`` are (node, input index)
    positions of the control-flow node that then read the low-precision value.
    """

    kind: str
    node: str
    index: int
    output: str              # the control-flow node's output bound to the group
    members: list[tuple[str, str]]
    must_allow: list[str]
    must_not_deny: list[str] = field(default_factory=list)
    low_inputs: list[tuple[str, int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.kind} `{self.node}` #{self.index}"


def control_flow_groups(nodes: Iterable[tuple[str, onnx.NodeProto]]) -> list[ColorGroup]:
    """Loop carried values and scan outputs, If outputs, Scan state and scan outputs of the
    If/Loop/Scan ``nodes`` (graph id, node)."""
    groups: list[ColorGroup] = []
    for graph_id, node in nodes:
        bodies = {a.name: a.g for a in node.attribute if a.type == GRAPH}
        if node.op_type == "If" and "then_branch" in bodies and "else_branch" in bodies:
            then_g, else_g = bodies["then_branch"], bodies["else_branch"]
            for i, out in enumerate(node.output):
                if i >= len(then_g.output) or i >= len(else_g.output):
                    continue
                t, e = then_g.output[i].name, else_g.output[i].name
                groups.append(ColorGroup("If output", node.name, i, out,
                                         [(graph_id, out), (f"{node.name}/then_branch", t),
                                          (f"{node.name}/else_branch", e)], must_allow=[t, e]))
        elif node.op_type in ("Loop", "Scan") and "body" in bodies:
            groups += _loop_or_scan_groups(graph_id, node, bodies["body"])
    return groups


def _loop_or_scan_groups(graph_id: str, node: onnx.NodeProto, body: onnx.GraphProto) -> list[ColorGroup]:
    body_id = f"{node.name}/body"
    inputs, outputs = list(node.input), list(node.output)
    inits = {t.name for t in body.initializer}
    body_inputs = [t.name for t in body.input if t.name not in inits]  # GS's graph inputs
    if node.op_type == "Loop":
        n_state = len(inputs) - 2
        first_in, first_body_in, first_body_out = 2, 2, 1
    else:
        # Scan-8 reads a leading sequence_lens (possibly "") that its body does not see; Scan-9+ has none.
        scan_inputs = next((a.i for a in node.attribute if a.name == "num_scan_inputs"), 0)
        first_in = max(0, len(inputs) - len(body_inputs))
        n_state = len(inputs) - first_in - int(scan_inputs)
        first_body_in, first_body_out = 0, 0
    groups = []
    for i in range(n_state):
        outer_in = inputs[first_in + i]
        body_in = body_inputs[first_body_in + i]
        body_out = body.output[first_body_out + i].name
        if not outer_in or i >= len(outputs):
            continue
        groups.append(ColorGroup(f"{node.op_type} carried value", node.name, i, outputs[i],
                                 [(graph_id, outer_in), (body_id, body_in), (body_id, body_out),
                                  (graph_id, outputs[i])],
                                 must_allow=[body_out], must_not_deny=[outer_in],
                                 low_inputs=[(node.name, first_in + i)]))
    for k, body_out in enumerate(body.output[first_body_out + n_state:]):
        out_index = n_state + k
        if out_index >= len(outputs):
            break
        groups.append(ColorGroup(f"{node.op_type} scan output", node.name, out_index, outputs[out_index],
                                 [(body_id, body_out.name), (graph_id, outputs[out_index])],
                                 must_allow=[body_out.name]))
    return groups
