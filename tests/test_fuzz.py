"""Properties of the conversion on random graphs (``tests/strategies.py``).

(a) ``onnxmp.convert`` never raises on these valid models, and its output
    passes the full checker and strict type inference with the graph inputs
    and outputs unchanged (names always; dtypes with ``keep_io_types``).
(b) The converted model, emulated on the CPU, matches the fp32 outputs within

        max|cand - ref| / max|ref|  <=  C_NODE * depth * gain * u

    per output, where ``u`` is the unit roundoff (2**-11 for float16, 2**-8
    for bfloat16), ``depth`` the number of nodes on the longest path from a
    graph input to the output and ``gain`` the output's first-order error
    gain (:func:`tests.strategies.error_gains`, at most ``MAX_GAIN`` = 4, ~1
    for most outputs).  Why: a node computing in low precision adds at most
    one ``u`` (relative to the magnitude its error is measured against) per
    float operand it reads rounded (its input, weight and bias) and one for
    rounding its output; the generator's nodes read at most three float
    operands, so ``C_NODE = 4``.  Along a path these first-order errors add,
    hence ``depth``; where branches join, independent roundings add in
    quadrature, which the slack of nodes reading fewer than three operands
    absorbs.  The ops carry the errors without amplification beyond
    ``gain`` by construction (bounded Exp/Softmax inputs, Log/Sqrt/Div away
    from singularities, products only as gates) and by the generator
    rejecting graphs that cancel.  Over 10,000 graphs
    (``scripts/fuzz_convert.py --examples 10000 --seed 7``) the largest
    observed error was 0.51 of this bound (float16 and bfloat16 alike).
    In the form ``c * depth * u``: ``c = C_NODE * gain <= 16``.
(c) Converting the converted model again adds nothing: same bytes, no Cast.

Each runs ``ONNXMP_FUZZ_EXAMPLES`` examples (default 40);
``scripts/fuzz_convert.py`` runs the same checks on thousands of graphs.
"""
from __future__ import annotations

import os

import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onnxmp
from onnxmp.calibrate import relative_error
from tests.strategies import RandomGraph, random_graphs

ort = pytest.importorskip("onnxruntime")

UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
LOW_TYPE = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}
C_NODE = 4
EXAMPLES = int(os.environ.get("ONNXMP_FUZZ_EXAMPLES", 40))

fuzz_settings = settings(max_examples=EXAMPLES, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def io_signature(model: onnx.ModelProto) -> list[list[tuple[str, int]]]:
    return [[(v.name, v.type.tensor_type.elem_type) for v in values]
            for values in (model.graph.input, model.graph.output)]


def check_valid(graph: RandomGraph, result: onnxmp.ConversionResult, precision: str,
                keep_io_types: bool) -> None:
    """Property (a), on an already converted graph."""
    onnx.checker.check_model(result.model, full_check=True)
    onnx.shape_inference.infer_shapes(result.model, check_type=True, strict_mode=True)
    before, after = io_signature(graph.model), io_signature(result.model)
    if keep_io_types:
        assert after == before
    else:
        # Every float32 input and output takes the low type, as keep_io_types=False means in
        # onnxconverter-common and onnxruntime (a Cast inside bridges to float32 nodes).
        lowered = [[(n, LOW_TYPE[precision] if t == onnx.TensorProto.FLOAT else t) for n, t in side] for side in before]
        assert after == lowered, after


def error_ratios(graph: RandomGraph, result: onnxmp.ConversionResult, precision: str) -> dict[str, float]:
    """Property (b): each output's relative error over its bound (<= 1 passes)."""
    from onnxmp.parity.emulate import emulate

    emulated = emulate(result.model, precision, keep_io_types=False)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(emulated.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, graph.inputs)))
    u = UNIT_ROUNDOFF[precision]
    return {name: relative_error(ref, out[name]) / (C_NODE * graph.depth[name] * graph.gain[name] * u)
            for name, ref in graph.expected.items()}


def check_idempotent(result: onnxmp.ConversionResult, precision: str, keep_io_types: bool) -> None:
    """Property (c)."""
    again = onnxmp.convert(result.model, precision=precision, keep_io_types=keep_io_types)
    assert again.report.casts_inserted == 0 and not again.report.changed
    assert again.model.SerializeToString() == result.model.SerializeToString()


def _explain(graph: RandomGraph, result: onnxmp.ConversionResult) -> str:
    return f"{graph.describe()}\nconverted:\n{onnx.printer.to_text(result.model.graph)}"


@fuzz_settings
@given(graph=random_graphs(), keep_io_types=st.booleans())
def test_conversion_is_valid_and_keeps_io(graph, keep_io_types):
    result = onnxmp.convert(graph.model, keep_io_types=keep_io_types)
    check_valid(graph, result, "float16", keep_io_types)


@fuzz_settings
@given(graph=random_graphs(), keep_io_types=st.booleans())
def test_emulated_float16_error_within_bound(graph, keep_io_types):
    result = onnxmp.convert(graph.model, keep_io_types=keep_io_types)
    ratios = error_ratios(graph, result, "float16")
    assert max(ratios.values()) <= 1.0, f"{ratios}\n{_explain(graph, result)}"


@fuzz_settings
@given(graph=random_graphs(), keep_io_types=st.booleans())
def test_converting_twice_changes_nothing(graph, keep_io_types):
    result = onnxmp.convert(graph.model, keep_io_types=keep_io_types)
    check_idempotent(result, "float16", keep_io_types)


@settings(fuzz_settings, max_examples=max(1, EXAMPLES // 2))
@given(graph=random_graphs(max_blocks=6), keep_io_types=st.booleans())
def test_bfloat16_valid_idempotent_and_within_bound(graph, keep_io_types):
    result = onnxmp.convert(graph.model, precision="bfloat16", keep_io_types=keep_io_types)
    check_valid(graph, result, "bfloat16", keep_io_types)
    check_idempotent(result, "bfloat16", keep_io_types)
    ratios = error_ratios(graph, result, "bfloat16")
    assert max(ratios.values()) <= 1.0, f"{ratios}\n{_explain(graph, result)}"


# Regressions: patterns found while fuzzing.

OVERRIDABLE_INITIALIZER = """<ir_version: 8, opset_import: ["" : 17]>
g (float[2,4] x, float[4,4] w) => (float[2,4] y) <float[4,4] w = {1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1}> {
    y = MatMul(x, w)
}"""


# An initializer that is also a graph input (an overridable default, as keep_initializers_as_inputs
# exports write) must stay an input of its original dtype.
@pytest.mark.parametrize("keep_io_types", [True, False])
def test_initializer_that_is_also_a_graph_input_stays_an_input(keep_io_types):
    model = onnx.parser.parse_model(OVERRIDABLE_INITIALIZER)
    onnx.checker.check_model(model, full_check=True)
    result = onnxmp.convert(model, keep_io_types=keep_io_types)
    assert [i.name for i in result.model.graph.input] == ["x", "w"]
