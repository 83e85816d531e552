"""Small graphs the placement simulation and the device_values stage are both tested on."""
from __future__ import annotations

import onnx
import onnx.parser

from onnxmp.normalize import toposort_all

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def parsed(text: str) -> onnx.ModelProto:
    """A graph written in onnx's text form, opset 17, nodes in topological order."""
    model = onnx.parser.parse_model(HEAD + text)
    toposort_all(model)
    return model


def divide_by_first_dim(dims: str = "N, 4", divided: str = "r") -> str:
    """``y = divided / float(dim 0 of divided)``: the count a mean divides by, taken from a shape.

    ``divided`` is ``r`` (a Relu's output, device data) or ``x`` (the graph input, which
    GetCpuPreferredNodes skips); ``dims`` static makes the shape foldable."""
    return f"""
    g (float[{dims}] x) => (float[{dims}] y) {{
        r = Relu(x)
        s = Shape({divided})
        zero = Constant<value = int64 {{0}}>()
        n = Gather<axis = 0>(s, zero)
        f = Cast<to = 1>(n)
        y = Div({divided}, f)
    }}"""
