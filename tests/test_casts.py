"""The fewest Casts (``onnxmp/rewrite/casts.py``): one Cast per value shared across graphs, hoisted
out of loop bodies; pairs that cancel exactly; Constants retargeted instead of Cast.  Each rule
with a case where it fires and one where it does not, checked on the written model (onnxruntime
runs it; emulated fp16 matches float32)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxmp
from models import zoo
from onnxmp.parity.emulate import emulate
from tests.graphs import header

FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
ort = pytest.importorskip("onnxruntime")

W = "float[8,8] w = {" + ",".join(str(round(0.1 * ((i * 7) % 11 - 5), 2)) for i in range(64)) + "}"
X = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32) * 0.3


def _parse(text: str) -> onnx.ModelProto:
    model = onnx.parser.parse_model(header() + text)
    onnx.checker.check_model(model, full_check=True)
    return model


def _casts(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    return [n for n in graph.node if n.op_type == "Cast"]


def _body(graph: onnx.GraphProto, op: str, attr: str) -> onnx.GraphProto:
    node = next(n for n in graph.node if n.op_type == op)
    return next(a.g for a in node.attribute if a.name == attr)


def _cast_sources(graph: onnx.GraphProto) -> list[tuple[str, int]]:
    """(input, type) of every Cast of ``graph`` and its bodies."""
    found = [(c.input[0], c.attribute[0].i) for c in _casts(graph)]
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                found += _cast_sources(a.g)
    return found


def _converted(model: onnx.ModelProto, feeds_list, options: onnxmp.Options | None = None) -> onnx.ModelProto:
    """The converted model, after checking that onnxruntime runs it and that its emulation
    matches float32 on every feed."""
    converted = onnxmp.convert(model, options).model
    ref = ort.InferenceSession(model.SerializeToString())
    ort.InferenceSession(converted.SerializeToString())  # loads as written
    emulated = ort.InferenceSession(emulate(converted).SerializeToString())
    for feeds in feeds_list:
        for r, o in zip(ref.run(None, feeds), emulated.run(None, feeds)):
            np.testing.assert_allclose(o, r, rtol=2e-2, atol=2e-2)
    return converted


IF_BOTH = """
g (float[4,8] x, bool c) => (float[4,8] y) {
    e = Exp(x)
    y = If(c) <then_branch = t () => (float[4,8] yt) { yt = MatMul(e, w) },
               else_branch = f () => (float[4,8] yf) { m = MatMul(e, w)  yf = Relu(m) }>
}""" + "\n"
FEEDS_IF = [{"x": X, "c": np.array(True)}, {"x": X, "c": np.array(False)}]


def _with_w(text: str) -> str:
    return text.replace("=> (float[4,8] y) {", "=> (float[4,8] y) <" + W + "> {", 1)


def test_both_branches_of_an_if_read_one_cast_of_the_outer_value():
    out = _converted(_parse(_with_w(IF_BOTH)), FEEDS_IF)
    g = out.graph
    assert not _casts(_body(g, "If", "then_branch")) and not _casts(_body(g, "If", "else_branch"))
    to_low = [c for c in _casts(g) if c.attribute[0].i == FLOAT16]
    assert [c.input[0] for c in to_low] == ["e"]  # one Cast of `e`, beside the If


def test_a_value_only_one_branch_reads_is_cast_in_that_branch():
    text = _with_w(IF_BOTH).replace("m = MatMul(e, w)  yf = Relu(m)", "yf = Sigmoid(e)")
    out = _converted(_parse(text), FEEDS_IF)
    g = out.graph
    # Sigmoid reads `e` in float32; only the then-branch reads it low: the Cast runs only when taken.
    assert [c.input[0] for c in _casts(_body(g, "If", "then_branch")) if c.attribute[0].i == FLOAT16] == ["e"]
    assert not any(c.input[0] == "e" for c in _casts(g))


NESTED = """
g (float[4,8] x, bool c, bool d) => (float[4,8] y) {
    e = Exp(x)
    y = If(c) <
        then_branch = t () => (float[4,8] yt) {
            yt = If(d) <then_branch = tt () => (float[4,8] ytt) { ytt = MatMul(e, w) },
                        else_branch = tf () => (float[4,8] ytf) { ytf = MatMul(e, w) }>
        },
        else_branch = f () => (float[4,8] yf) { yf = Sigmoid(e) }>
}"""


def test_nested_ifs_share_one_cast_in_the_innermost_graph_holding_every_reader():
    out = _converted(_parse(_with_w(NESTED)), [{"x": X, "c": np.array(c), "d": np.array(d)}
                                                for c in (True, False) for d in (True, False)])
    outer_then = _body(out.graph, "If", "then_branch")
    assert [c.input[0] for c in _casts(outer_then) if c.attribute[0].i == FLOAT16] == ["e"]
    assert not _casts(_body(outer_then, "If", "then_branch")) and not _casts(_body(outer_then, "If", "else_branch"))
    assert not any(c.input[0] == "e" for c in _casts(out.graph))


def test_nested_ifs_reading_in_both_outer_branches_cast_beside_the_outer_if():
    text = _with_w(NESTED).replace("yf = Sigmoid(e)", "yf = MatMul(e, w)")
    out = _converted(_parse(text), [{"x": X, "c": np.array(c), "d": np.array(True)} for c in (True, False)])
    assert [c.input[0] for c in _casts(out.graph) if c.attribute[0].i == FLOAT16] == ["e"]
    assert [src for src, to in _cast_sources(out.graph) if src == "e"] == ["e"]  # in no body


LOOP = """
g (float[4,8] x) => (float[4,8] y) <""" + W + """, int64 trip = {3}> {
    e = Exp(x)
    y = Loop(trip, "", x) <body = b (int64 i, bool cond, float[4,8] v) => (bool co, float[4,8] vo) {
        co = Identity(cond)
        m = MatMul(e, w)
        vo = Add(v, m)
    }>
}"""


def test_a_loop_body_reads_the_cast_of_an_outer_value_made_once_outside_it():
    out = _converted(_parse(LOOP), [{"x": X}])
    body = _body(out.graph, "Loop", "body")
    assert not any(c.input[0] == "e" for c in _casts(body))
    assert [c.input[0] for c in _casts(out.graph) if c.input[0] == "e"] == ["e"]


def test_a_loop_body_casts_its_own_values_inside():
    text = LOOP.replace("m = MatMul(e, w)", "s = Exp(v)  m = MatMul(s, w)")
    out = _converted(_parse(text), [{"x": X}])
    body = _body(out.graph, "Loop", "body")
    assert [c.input[0] for c in _casts(body) if c.attribute[0].i == FLOAT16] == ["s"]


WIDEN = """
g (float16[4,8] x) => (float[4,8] y, float[4,8] z) <""" + W + """> {
    c = Cast <to = 1> (x)
    y = MatMul(c, w)
    z = Exp(c)
}"""


def test_a_low_reader_of_the_models_cast_to_float32_of_a_low_value_reads_the_value():
    out = _converted(_parse(WIDEN), [{"x": X.astype(np.float16)}])
    # Cast(Cast(x, float32), float16) is x, bit for bit: the MatMul reads the float16 input.
    matmul = next(n for n in out.graph.node if n.op_type == "MatMul")
    assert matmul.input[0] == "x"
    assert [(c.input[0], c.attribute[0].i) for c in _casts(out.graph)] == [("x", FLOAT), ("y_onnxmp_fp16", FLOAT)]


def test_a_cast_to_float32_of_a_wider_value_is_not_cancelled():
    # Cast(Cast(x, float32), float16) of a double x rounds twice: the Cast of c stays.
    out = _converted(_parse(WIDEN.replace("float16[4,8] x", "double[4,8] x")), [{"x": X.astype(np.float64)}])
    matmul = next(n for n in out.graph.node if n.op_type == "MatMul")
    assert matmul.input[0] != "x"
    assert ("c", FLOAT16) in [(c.input[0], c.attribute[0].i) for c in _casts(out.graph)]


CONST = """
g (float[4,8] x, bool c) => (float[4,8] y) {
    k = Constant <value = """ + W.replace("float[8,8] w = ", "float[8,8] ") + """> ()
    y = If(c) <then_branch = t () => (float[4,8] yt) { yt = MatMul(x, k) },
               else_branch = f () => (float[4,8] yf) { m = MatMul(x, k)  yf = Relu(m) }>
}"""


def test_a_constant_read_only_in_low_precision_makes_the_low_type_itself():
    out = _converted(_parse(CONST), FEEDS_IF)
    const = next(n for n in out.graph.node if n.op_type == "Constant")
    assert const.attribute[0].t.data_type == FLOAT16
    assert not any(c.input[0] == "k" for c in _casts(out.graph))


def test_a_constant_also_read_in_float32_stays_float32_and_is_cast_once():
    text = CONST.replace("m = MatMul(x, k)  yf = Relu(m)", "m = MatMul(x, k)  s = Exp(k)  r = ReduceMean <axes = [0]> (s)  yf = Add(m, r)")
    out = _converted(_parse(text), FEEDS_IF)
    const = next(n for n in out.graph.node if n.op_type == "Constant")
    assert const.attribute[0].t.data_type == FLOAT
    assert [c.input[0] for c in _casts(out.graph) if c.input[0] == "k"] == ["k"]


def test_the_bundled_loop_if_model_casts_each_value_once():
    # x into the MatMul branch, the softmax branch's output into the fp16 Loop, logits out: 3 Casts
    # (4 before the If output took the low type: a restore in the MatMul branch and a Cast after
    # the If), 2 on either path.  onnxconverter-common writes 2, with the softmax in float16.
    converted = onnxmp.convert(zoo.loop_if()).model
    ort.InferenceSession(converted.SerializeToString())
    sources = _cast_sources(converted.graph)
    assert len(sources) == len(set(sources)) == 3  # no value cast twice to one type, in any graph
    if_node = next(n for n in converted.graph.node if n.op_type == "If")
    per_branch = [len(_casts(a.g)) for a in if_node.attribute]
    assert per_branch == [1, 1] and len(_casts(converted.graph)) == 1


GATHERS = """
g (float[4,8] x, float[2,4,8] state, bool c) => (float[4,8] y) <""" + W + """, int64 zero = {0}, int64 one = {1}> {
    a = Gather <axis = 0> (state, zero)
    b = Gather <axis = 0> (state, one)
    y = If(c) <then_branch = t () => (float[4,8] yt) { yt = MatMul(a, w) },
               else_branch = f () => (float[4,8] yf) { yf = MatMul(b, w) }>
}"""
FEEDS_GATHERS = [{"x": X, "state": np.stack([X, -X]) * 0.5, "c": np.array(c)} for c in (True, False)]


def test_gathers_of_one_float32_input_read_low_in_branches_take_one_cast_of_the_input():
    # A body's read of an outer tensor is an edge of the coloring: the Gathers feed low MatMuls
    # and run low themselves, and one Cast of `state` serves both (none in the branches).
    out = _converted(_parse(GATHERS), FEEDS_GATHERS)
    assert [(src, to) for src, to in _cast_sources(out.graph) if to == FLOAT16] == [("state", FLOAT16)]
    assert {v.name: v.type.tensor_type.elem_type for v in out.graph.value_info}["a"] == FLOAT16


OUTER_LOW = """
g (float[4,8] x, bool c, bool d) => (float[4,8] y) <""" + W + """> {
    e = MatMul(x, w)
    y = If(c) <
        then_branch = t () => (float[4,8] yt) {
            yt = If(d) <then_branch = tt () => (float[4,8] ytt) { ytt = MatMul(e, w) },
                        else_branch = tf () => (float[4,8] ytf) { ytf = MatMul(e, w) }>
        },
        else_branch = f () => (float[4,8] yf) { yf = MatMul(e, w) }>
}"""
FEEDS_NESTED = [{"x": X, "c": np.array(c), "d": np.array(d)} for c in (True, False) for d in (True, False)]


def test_nested_ifs_read_an_outer_low_value_as_it_is():
    # Outer reads are edges: `e` is written low in place and every branch, however deep, reads it
    # without a Cast (pinned, it was renamed, restored to float32 and Cast again in each branch).
    out = _converted(_parse(OUTER_LOW), FEEDS_NESTED)
    assert [src for src, to in _cast_sources(out.graph) if to == FLOAT16] == ["x"]
    assert not any(src.startswith("e") for src, _ in _cast_sources(out.graph))


def test_nested_ifs_reading_an_outer_low_value_in_float32_cast_it_once_beside_the_producer():
    text = OUTER_LOW.replace("ytf = MatMul(e, w)", "ytf = Exp(e)").replace("yf = MatMul(e, w)", "yf = Sigmoid(e)")
    out = _converted(_parse(text), FEEDS_NESTED)
    # Both outer branches read `e` in float32: one Cast in the main graph, none in any body.
    assert [src for src, _ in _cast_sources(out.graph) if src == "e"] == ["e"]  # one, in any graph
    assert [c.input[0] for c in _casts(out.graph) if c.input[0] == "e"] == ["e"]  # and it is the main graph's



SPLIT = """
g (float[4,8] x) => (float[4,4] y) <""" + W + """> {
    h = MatMul(x, w)
    a, b = Split <axis = 1, num_outputs = 2> (h)
    ea = Exp(a)
    eb = Exp(b)
    y = Add(ea, eb)
}"""


def test_a_low_split_whose_outputs_are_all_read_in_float32_splits_one_float32_copy():
    out = _converted(onnx.parser.parse_model(header(18) + SPLIT), [{"x": X}])
    assert [src for src, to in _cast_sources(out.graph) if to == FLOAT] == ["h"]


def test_a_split_with_an_output_read_in_low_precision_keeps_its_casts():
    text = SPLIT.replace("eb = Exp(b)", "eb = MatMul(b, v)").replace("float[4,4] y) <" + W,
                                                                         "float[4,4] y) <" + W + ", float[4,4] v = {" + ",".join(["0.1"] * 16) + "}")
    out = _converted(onnx.parser.parse_model(header(18) + text), [{"x": X}])
    assert ("a", FLOAT) in _cast_sources(out.graph) and ("h", FLOAT) not in _cast_sources(out.graph)


IDLE = """
g (float[4,8] x) => (float[4,8] y) <""" + W + """> {
    h = MatMul(x, w)
    c = Cast <to = 1> (h)
    y = MatMul(c, w)
}"""


def test_the_models_cast_of_a_value_made_low_is_idle_and_bypassed():
    # The Cast's reader is low, so the coloring retargets it to float16; its input is float16
    # already: the second MatMul reads `h` and the Cast goes.
    out = _converted(_parse(IDLE), [{"x": X}])
    matmuls = [n for n in out.graph.node if n.op_type == "MatMul"]
    assert matmuls[1].input[0] == "h"
    assert sorted(src for src, _ in _cast_sources(out.graph)) == ["x", "y_onnxmp_fp16"]


PAIR = """
g (float16[4,8] x, float[4,8] v) => (float16[4,8] z, float[4,8] y, float[4,8] e) <""" + W + """> {
    c = Cast <to = 1> (x)
    d = Cast <to = 10> (c)
    z = Add(d, d)
    y = MatMul(v, w)
    e = Exp(c)
}"""
FEEDS_PAIR = [{"x": X.astype(np.float16), "v": X}]


def test_a_cast_pair_that_cancels_is_bypassed_and_the_intermediate_kept_for_its_other_reader():
    out = _converted(_parse(PAIR), FEEDS_PAIR)
    add = next(n for n in out.graph.node if n.op_type == "Add")
    assert list(add.input) == ["x", "x"]  # Cast(Cast(x, float32), float16) of a float16 x is x
    assert ("c", FLOAT16) not in _cast_sources(out.graph)
    assert ("x", FLOAT) in _cast_sources(out.graph)  # Exp still reads the float32 copy


def test_a_lossy_cast_pair_is_kept():
    # Cast(Cast(v, float16), float32) of a float32 v rounds: both Casts stay.
    text = PAIR.replace("c = Cast <to = 1> (x)\n    d = Cast <to = 10> (c)",
                        "c0 = Cast <to = 10> (v)\n    c = Cast <to = 1> (c0)\n    d = Cast <to = 10> (x)")
    out = _converted(_parse(text), FEEDS_PAIR)
    assert ("v", FLOAT16) in _cast_sources(out.graph) and ("c0", FLOAT) in _cast_sources(out.graph)
    exp = next(n for n in out.graph.node if n.op_type == "Exp")
    assert exp.input[0] == "c"


RESTORED = """
g (float[4,8] x, bool c, bool d) => (float[4,8] y) <""" + W + """> {
    h = MatMul(x, w)
    y = If(c) <
        then_branch = t () => (float[4,8] o) {
            o = If(d) <then_branch = tt () => (float[4,8] ot) {
                           ot = If(d) <then_branch = ttt () => (float[4,8] ott) { ott = MatMul(x, w) },
                                       else_branch = ttf () => (float[4,8] otf) { otf = MatMul(h, w) }>
                       },
                       else_branch = tf () => (float[4,8] of) { of = Identity(h) }>
        },
        else_branch = f () => (float[4,8] yf) { yf = Sigmoid(x) }>
}"""


def test_an_if_output_both_branches_compute_low_is_restored_once_after_the_if():
    # `o` is an outer branch output, float32 for the coloring (the group's producers are an If and
    # an Identity, not ALLOW vertices).  Both its branches compute it low: restored in each it costs
    # two Casts; written low by the If and restored after it, one.
    out = _converted(_parse(RESTORED), FEEDS_NESTED)
    assert [(src, to) for src, to in _cast_sources(out.graph) if to == FLOAT] == [("o_onnxmp_fp16", FLOAT)]
    assert [c.input[0] for c in _casts(_body(out.graph, "If", "then_branch"))] == ["o_onnxmp_fp16"]


def test_an_if_output_one_branch_computes_in_float32_keeps_its_restore():
    # One restore in the low branch against a narrowing in the float32 branch plus one after the If:
    # nothing saved, the restore stays in its branch.
    out = _converted(_parse(RESTORED.replace("of = Identity(h)", "of = Exp(x)")), FEEDS_NESTED)
    assert [src for src, to in _cast_sources(out.graph) if to == FLOAT] == ["ot_onnxmp_fp16"]


SHAPE_CAST = """
g (float[4,8] x) => (float[8,4] y) <""" + W + """> {
    s = Constant <value = int32[2] {8, 4}> ()
    s64 = Cast <to = 7> (s)
    h = MatMul(x, w)
    y = Reshape(h, s64)
}"""


def test_the_models_cast_of_a_constant_is_folded_into_the_constant():
    out = _converted(_parse(SHAPE_CAST), [{"x": X}])
    assert not any(src == "s" for src, _ in _cast_sources(out.graph))
    const = next(n for n in out.graph.node if n.op_type == "Constant")
    assert const.attribute[0].t.data_type == onnx.TensorProto.INT64
    assert next(n for n in out.graph.node if n.op_type == "Reshape").input[1] == "s"


@pytest.mark.parametrize("form", ["value_floats = [8.0, 4.0]", "value = float[2] {8.0, 4.0}"])
def test_a_constant_cast_folds_whichever_attribute_holds_the_values(form):
    # One reader of a Constant's values serves every attribute form: value_floats folds as value does.
    out = _converted(_parse(SHAPE_CAST.replace("value = int32[2] {8, 4}", form)), [{"x": X}])
    assert not any(src == "s" for src, _ in _cast_sources(out.graph))
    const = next(n for n in out.graph.node if n.op_type == "Constant")
    assert [a.name for a in const.attribute] == ["value"]
    assert onnx.numpy_helper.to_array(const.attribute[0].t).tolist() == [8, 4]


@pytest.mark.parametrize("change", ["lossy", "read twice"])
def test_a_cast_of_a_constant_that_is_lossy_or_read_elsewhere_stays(change):
    if change == "lossy":  # 2.5 -> int64 truncates: the Cast computes something, it stays
        text = SHAPE_CAST.replace("int32[2] {8, 4}", "float[2] {8.0, 4.5}")
        feeds_ok = False
    else:  # the Constant is read in its own type too
        text = SHAPE_CAST.replace("y = Reshape(h, s64)", "y = Reshape(h, s64)\n    z = Identity(s)").replace(
            "(float[8,4] y)", "(float[8,4] y, int32[2] z)")
        feeds_ok = True
    model = _parse(text)
    out = onnxmp.convert(model).model
    assert ("s", onnx.TensorProto.INT64) in _cast_sources(out.graph)
    if feeds_ok:
        ort.InferenceSession(out.SerializeToString())


SLICES = """
g (float[4,8] x) => (float[4,2] y) <""" + W + """, int64[1] z = {0}, int64[1] two = {2}, int64[1] four = {4},
                                     int64[1] eight = {8}, int64[1] ax = {1}> {
    h = MatMul(x, w)
    r = Slice(h, z, four, ax)
    i = Slice(h, four, eight, ax)
    ra = Slice(r, z, two, ax)
    ia = Slice(i, z, two, ax)
    p = Exp(ra)
    q = Exp(ia)
    y = Add(p, q)
}"""
V = "float[4,4] v = {" + ",".join(["0.1"] * 16) + "}"


def test_slice_chains_of_a_low_value_read_in_float32_slice_one_float32_copy():
    # Two chains of Slices end in float32 Exps: one float32 copy of `h`, sliced in float32,
    # instead of a Cast at the end of each chain.
    out = _converted(onnx.parser.parse_model(header(13) + SLICES), [{"x": X}])
    assert [src for src, to in _cast_sources(out.graph) if to == FLOAT] == ["h"]


def test_a_slice_chain_with_a_low_reader_on_the_way_keeps_its_casts():
    # `r` is also read by a low MatMul: its chain stays low and is Cast at its end; the other
    # chain alone would save nothing.
    text = SLICES.replace("y = Add(p, q)", "m = MatMul(r, v)  ms = Slice(m, z, two, ax)  pq = Add(p, q)  y = Add(pq, ms)")
    out = _converted(onnx.parser.parse_model(header(13) + text.replace("int64[1] z", V + ", int64[1] z")), [{"x": X}])
    assert ("h", FLOAT) not in _cast_sources(out.graph)
    assert {"ra", "ia"} <= {src for src, to in _cast_sources(out.graph) if to == FLOAT}



STATES = """
g (float[4,8] x) => (float[2,4,8] y) <""" + W + """, int64[1] ax = {0}> {
    h1 = MatMul(x, w)
    h2 = MatMul(h1, w)
    u1 = Unsqueeze(h1, ax)
    u2 = Unsqueeze(h2, ax)
    k = Concat <axis = 0> (u1, u2)
    y = Exp(k)
}"""


def _named(text: str) -> onnx.ModelProto:
    model = _parse(text)
    for node in model.graph.node:
        node.name = node.output[0]
    return model


@pytest.mark.parametrize("kept", [("k",), ("u1", "k")])
def test_a_float32_concat_of_restored_values_runs_low_and_one_cast_restores_its_output(kept):
    # The Concat (and with it the Unsqueeze `u1`) is kept float32 by the coloring (forced_deny, as
    # calibration's fallback writes it), so it reads the restores of two low values: 2 Casts.
    # Concat and Unsqueeze only copy elements, Cast(Concat(a, b)) == Concat(Cast(a), Cast(b)) bit
    # for bit: they read the low values and one Cast restores the Concat's output.
    options = onnxmp.Options(forced_deny={name: "test" for name in kept})
    out = _converted(_named(STATES), [{"x": X}], options)
    assert [(src, to) for src, to in _cast_sources(out.graph) if to == FLOAT] == [("k_onnxmp_fp16", FLOAT)]
    concat = next(n for n in out.graph.node if n.op_type == "Concat")
    assert list(concat.input) == ["u1", "u2"] and list(concat.output) == ["k_onnxmp_fp16"]
    exp = next(n for n in out.graph.node if n.op_type == "Exp")
    assert list(exp.input) == ["k"]  # the restore keeps the name the float32 readers read


def test_a_restore_also_read_elsewhere_in_float32_is_not_moved_below_the_concat():
    # `u1`'s restore stays for the second Exp: moving the Casts below the Concat would free only
    # `u2`'s and add one after the Concat, nothing saved.
    text = STATES.replace("y = Exp(k)", "y = Exp(k)  z = Exp(u1)").replace(
        "(float[2,4,8] y)", "(float[2,4,8] y, float[1,4,8] z)")
    out = _converted(_named(text), [{"x": X}], onnxmp.Options(forced_deny={"k": "test"}))
    assert sorted(src for src, to in _cast_sources(out.graph) if to == FLOAT) == ["u1", "u2"]
    concat = next(n for n in out.graph.node if n.op_type == "Concat")
    assert list(concat.output) == ["k"] and all(i.endswith("_onnxmp_fp32") for i in concat.input)


def test_a_low_reader_of_the_concat_reads_its_low_output_once_the_restores_move_below():
    # Before the move: the two restores, and a Cast of the float32 Concat back to float16 for the
    # MatMul (3).  After: the MatMul reads the low Concat itself, one Cast feeds the Exp.
    text = STATES.replace("y = Exp(k)", "e = Exp(k)  m = MatMul(k, w)  y = Add(e, m)")
    out = _converted(_named(text), [{"x": X}], onnxmp.Options(forced_deny={"k": "test"}))
    concat = next(n for n in out.graph.node if n.op_type == "Concat")
    matmul = next(n for n in out.graph.node if n.op_type == "MatMul" and n.name == "m")
    assert matmul.input[0] == concat.output[0] != "k"
    assert sorted(src for src, _ in _cast_sources(out.graph)) == sorted(["x", concat.output[0], "m"])


BRANCH_CONCAT = """
g (float[4,8] x, bool c) => (float[2,4,8] y) <""" + W + """, int64[1] ax = {0}> {
    r = If(c) <then_branch = t () => (float[2,4,8] k) { h = MatMul(x, w)  u = Unsqueeze(h, ax)  k = Concat <axis = 0> (u, u) },
               else_branch = f () => (float[2,4,8] kf) { g = MatMul(x, w)  v = Unsqueeze(g, ax)  kf = Concat <axis = 0> (v, v) }>
    y = Exp(r)
}"""


def _name_all(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        node.name = node.output[0]
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _name_all(a.g)


def test_a_float32_concat_writing_a_branch_output_moves_its_restore_below_it_and_out_of_the_if():
    # The then-branch's Concat is kept float32: it reads one restore of `u` twice (one Cast either
    # way), but as its output is the branch output, the restore moves below it at no gain; both
    # branches then end in a restore, which raise_if_outputs makes one Cast after the If.
    model = _parse(BRANCH_CONCAT)
    _name_all(model.graph)
    feeds = [{"x": X, "c": np.array(c)} for c in (True, False)]
    out = _converted(model, feeds, onnxmp.Options(forced_deny={"k": "test"}))
    assert not _casts(_body(out.graph, "If", "then_branch")) and not _casts(_body(out.graph, "If", "else_branch"))
    if_node = next(n for n in out.graph.node if n.op_type == "If")
    assert [(c.input[0], c.attribute[0].i) for c in _casts(out.graph)] == [("x", FLOAT16), (if_node.output[0], FLOAT)]
    then = _body(out.graph, "If", "then_branch")
    assert next(n for n in then.node if n.op_type == "Concat").input[:] == ["u", "u"]


def _corpus_model(name: str) -> str:
    import os
    path = os.path.join(os.environ.get("ONNXMP_CORPUS", ""), f"{name}.onnx")
    if not os.environ.get("ONNXMP_CORPUS") or not os.path.exists(path):
        pytest.skip("set ONNXMP_CORPUS to a folder `python models/corpus.py --cache DIR` filled")
    return path


def test_silero_vads_lstm_states_are_restored_once_after_the_outer_if():
    # silero-vad's LSTM states come out of three levels of Ifs, are Unsqueezed and concatenated in
    # each branch of the outer If, and leave as a kept float32 output.  The inner Ifs write them low
    # and restore them after (raise_if_outputs); the restores then move below the Unsqueezes and
    # the Concat (move_restores_down), so each branch output is a restore, which the outer If makes
    # one Cast in the main graph: 26 Casts become 23 (onnxruntime's converter writes 24).
    from scripts.compare_casts import static_casts

    out = onnxmp.convert(_corpus_model("silero_vad")).model
    ort.InferenceSession(out.SerializeToString())
    assert static_casts(out.graph) <= 23
    for attr in ("then_branch", "else_branch"):
        branch = _body(out.graph, "If", attr)
        assert any(n.op_type == "Concat" and n.output[0].endswith("_onnxmp_fp16") for n in branch.node)
