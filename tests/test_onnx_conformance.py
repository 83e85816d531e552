"""ONNX's own operator conformance cases through convert, at the default level and at
unsafe_force_all (selection, requirements and the parity bound: tests/onnx_corpus.py)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from tests import onnx_corpus
from tests.graphs import header, parse

CASES = sorted(onnx_corpus.selected_cases())


def test_the_corpus_is_there():
    # ~640 with onnx 1.23 and onnxruntime 1.19; a collapse means the filter broke, not a pass.
    assert len(CASES) > 500


@pytest.mark.parametrize("level", onnx_corpus.LEVELS)
@pytest.mark.parametrize("name", CASES)
def test_onnx_node_case(name, level):
    outcome = onnx_corpus.check_case(onnx_corpus.selected_cases()[name], level)
    assert outcome.kind == "ok", f"{outcome.kind}: {outcome.detail}"


def _matmul_case(scale: float) -> onnx_corpus.Case:
    model = parse(header(13) + """
    g (float[4,4] a, float[4,4] b) => (float[4,4] y) {
        y = MatMul(a, b)
    }""")
    rng = np.random.default_rng(0)
    inputs = [(rng.standard_normal((4, 4)) * scale).astype(np.float32) for _ in range(2)]
    return onnx_corpus.Case("matmul", model, inputs, onnx_corpus.run_ort(model, inputs))


def test_parity_bound_holds_for_a_well_scaled_matmul():
    assert onnx_corpus.check_case(_matmul_case(1.0), "default").kind == "ok"


def test_parity_check_catches_float16_overflow():
    # Products of ~300 overflow float16 after conversion: the check must notice, not pass.
    outcome = onnx_corpus.check_case(_matmul_case(300.0), "default")
    assert outcome.kind == "parity", outcome


def test_parity_check_catches_an_error_beyond_the_bound():
    case = _matmul_case(1.0)
    case.fp32_outputs = [case.fp32_outputs[0] * (1 + 64 * onnx_corpus.U)]
    assert onnx_corpus.check_case(case, "default").kind == "parity"


def test_rounding_depth_counts_the_longest_path_and_loop_iterations():
    model = parse(header(13) + """
    g (float[4] x, int64 n) => (float[4] y) {
        a = Cast<to=10>(x)
        b = Cast<to=1>(a)
        c = Cast<to=10>(b)
        d = Cast<to=1>(c)
        t = Constant<value=bool {1}>()
        y = Loop(n, t, d) <body = body_g (int64 i, bool c_in, float[4] v) => (bool c_out, float[4] w) {
            c_out = Identity(c_in)
            h = Cast<to=10>(v)
            w = Cast<to=1>(h)
        }>
    }""")
    assert onnx_corpus.rounding_depth(model.graph, iterations=3) == 2 + 3
