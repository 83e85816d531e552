"""The whole pipeline on the bundled models: verify, I/O kept, idempotence, parity, save/load."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxmp
from onnxmp.cli import main as cli
from onnxmp.verify import io_signature
from tests.graphs import FLOAT, FLOAT16, header, named, parse

MODELS = Path(__file__).resolve().parent.parent / "models"
ZOO = ["mlp", "cnn_bn", "cnn_bn_bigvar", "transformer_block", "gru", "lstm", "loop_if"]


@pytest.mark.parametrize("name", ZOO)
def test_bundled_model_converts_verifies_and_keeps_io(name):
    path = MODELS / f"{name}.onnx"
    original = onnx.load(str(path))
    result = onnxmp.convert(path)
    assert result.report.changed
    onnx.checker.check_model(result.model, full_check=True)
    onnx.shape_inference.infer_shapes(result.model, check_type=True, strict_mode=True)
    assert io_signature(result.model) == io_signature(original)
    assert result.model.ir_version == original.ir_version


@pytest.mark.parametrize("name", ZOO)
def test_converting_a_converted_model_changes_nothing(name):
    first = onnxmp.convert(MODELS / f"{name}.onnx")
    second = onnxmp.convert(first.model)
    assert second.report.casts_inserted == 0 and not second.report.changed
    assert second.model.SerializeToString() == first.model.SerializeToString()


@pytest.mark.parametrize("name", ZOO)
def test_emulated_parity_of_bundled_models(name):
    ort = pytest.importorskip("onnxruntime")
    from onnxmp.parity.emulate import emulate

    inputs = dict(np.load(MODELS / f"{name}.inputs.npz"))
    ref = ort.InferenceSession(str(MODELS / f"{name}.onnx")).run(None, inputs)
    converted = onnxmp.convert(MODELS / f"{name}.onnx").model
    out = ort.InferenceSession(emulate(converted).SerializeToString()).run(None, inputs)
    for r, o in zip(ref, out):
        assert np.isfinite(o).all()
        assert np.abs(r - o).max() <= 1e-2 * max(1.0, np.abs(r).max())


def test_bigvar_batchnorm_stays_fp32_with_reason_and_neighbour_convs_go_fp16():
    report = onnxmp.convert(MODELS / "cnn_bn_bigvar.onnx").report
    colors = report.node_colors()
    bn = [n for n in colors if "bn1" in n]
    assert bn and all(colors[n] == "deny" for n in bn)
    cause = next(v.cause for v in report.vertices if v.node == bn[0])
    assert "running_var" in cause and "> 65504" in cause
    convs = [n for n in colors if "Conv" in n or "conv" in n]
    assert convs and all(colors[n] == "allow" for n in convs)


def test_loop_whose_carried_value_passes_a_deny_op_keeps_its_io_fp32_with_casts_inside_the_body():
    body = onnx.parser.parse_graph("""
    body (int64 i, bool cond, float[4,4] v) => (bool cond_out, float[4,4] v_out) {
        m = MatMul(v, w)
        cond_out = Identity(cond)
        v_out = Exp(m)
    }""")
    loop = onnx.helper.make_node("Loop", ["trip", "", "x"], ["y"], name="loop", body=body)
    graph = onnx.helper.make_graph(
        [loop], "g", [onnx.helper.make_tensor_value_info("x", FLOAT, [4, 4])],
        [onnx.helper.make_tensor_value_info("y", FLOAT, [4, 4])],
        [onnx.numpy_helper.from_array(np.array(2, np.int64), "trip"),
         onnx.numpy_helper.from_array(np.eye(4, dtype=np.float32) * 0.5, "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    result = onnxmp.convert(model)
    colors = result.report.node_colors()
    assert colors["loop"] != "allow"
    body_out = next(n for n in result.model.graph.node if n.op_type == "Loop").attribute[0].g
    body_types = {v.name: v.type.tensor_type.elem_type for v in list(body_out.input) + list(body_out.output)}
    assert body_types["v"] == FLOAT and body_types["v_out"] == FLOAT  # formal I/O fixed
    casts_in_body = [n for n in body_out.node if n.op_type == "Cast"]
    assert len(casts_in_body) == 2  # v to fp16 before MatMul, m back to fp32 for Exp
    # The outer initializer w is read only by the low-precision MatMul: stored in fp16, no Cast.
    inits = {t.name: t.data_type for g in (result.model.graph, body_out) for t in g.initializer}
    assert inits["w"] == FLOAT16
    assert not any(n.op_type == "Cast" for n in result.model.graph.node)
    ort = pytest.importorskip("onnxruntime")
    from onnxmp.parity.emulate import emulate

    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    out = ort.InferenceSession(emulate(result.model).SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-2)


def test_conversion_leaves_no_reference_cycles_behind():
    # The pipeline runs with the cycle collector off; a cycle there (a recursive closure in the Cast
    # placement held the rewrite state and, through it, the analysed model) keeps everything it
    # reaches alive until the next collection, raising peak memory while the checker runs.
    import gc

    model = onnx.load(str(MODELS / "loop_if.onnx"))
    onnxmp.convert(model)  # warm caches, so that only the conversion's own objects are counted
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        result = onnxmp.convert(model)
        assert result.report.casts_inserted > 0
        del result
        assert gc.collect() == 0
    finally:
        if was_enabled:
            gc.enable()


def test_tensor_core_advice_names_unfriendly_dims_only():
    model = named(header() + """
    g (float[8,30] x, float[30,24] w, float[24,4] u, float[4,48] v) => (float[8,48] y) {
        a = MatMul(x, w)
        b = MatMul(a, u)
        y = MatMul(b, v)
    }""")
    advice = onnxmp.explain(model).advice
    flagged = {(a.node, a.dimension, a.value) for a in advice}
    assert ("a", "K", 30) in flagged
    assert not any(a.node == "b" for a in advice)  # K=24 (multiple of 8), N=4 (power of two < 256)
    assert not any(a.node == "y" and a.dimension == "N" for a in advice)  # 48 = 6 * 8


def test_tensor_core_advice_reads_gemm_transposes_and_conv_groups():
    model = named(header() + """
    g (float[30,8] x, float[24,30] w, float[2,12,5,5] img, float[12,6,3,3] k) => (float[8,24] y, float[2,12,3,3] c) {
        y = Gemm <transA = 1, transB = 1> (x, w)
        c = Conv <group = 2> (img, k)
    }""")
    flagged = [(a.node, a.op, a.dimension, a.value) for a in onnxmp.explain(model).advice]
    # Gemm: K is x's first dim (transA), N is w's first (transB): 30 and 24, only 30 unfriendly.
    # Conv: input channels = 6 * group = 12, output channels = 12: both unfriendly.
    assert flagged == [("y", "Gemm", "K", 30), ("c", "Conv", "input channels", 12),
                       ("c", "Conv", "output channels", 12)]


def test_tensor_core_advice_reads_declared_activation_dims():
    # K comes from an activation's declaration: a symbolic, an unknown and a last dim are read;
    # a 1-D weight has no N.
    model = named(header() + """
    g (float[B,S] x, float[S,12] w, float[12] v, float[4,30] u) => (float[B,12] y, float[B] z, float[4,12] t) {
        y = MatMul(x, w)
        z = MatMul(y, v)
        t = MatMul(u, w)
    }""")
    flagged = [(a.node, a.dimension, a.value) for a in onnxmp.explain(model).advice]
    assert flagged == [("y", "N", 12), ("z", "K", 12), ("t", "K", 30), ("t", "N", 12)]


def test_unnamed_and_duplicate_nodes_get_unique_names():
    model = parse(header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        a = MatMul(x, w)
        b = Relu(a)
        y = MatMul(b, w)
    }""")
    model.graph.node[0].name = "dup"
    model.graph.node[1].name = "dup"
    model.graph.node[2].name = ""
    report = onnxmp.convert(model).report
    nodes = {v.node for v in report.vertices}
    assert len(nodes) == 3 and "dup" in nodes


def test_unsorted_graph_is_sorted_before_coloring():
    model = parse(header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        a = MatMul(x, w)
        y = MatMul(a, w)
    }""")
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    result = onnxmp.convert(model)
    onnx.checker.check_model(result.model, full_check=True)


def test_input_model_proto_and_file_are_never_modified(tmp_path):
    src = MODELS / "mlp.onnx"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    proto = onnx.load(str(src))
    before = proto.SerializeToString()
    onnxmp.convert(src)
    onnxmp.convert(proto)
    assert proto.SerializeToString() == before
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest


def test_external_data_models_load_and_save(tmp_path):
    src = onnx.load(str(MODELS / "mlp.onnx"))
    path = tmp_path / "ext.onnx"
    onnx.save_model(src, str(path), save_as_external_data=True, location="ext.data", size_threshold=0)
    result = onnxmp.convert(path)
    out = tmp_path / "out" / "conv.onnx"
    out.parent.mkdir()
    onnxmp.save(result.model, out, external_data=True)
    assert (out.parent / "conv.onnx.data").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["conv.onnx", "conv.onnx.data"]
    reloaded = onnx.load(str(out))
    assert {t.name: t.data_type for t in reloaded.graph.initializer} == \
           {t.name: t.data_type for t in result.model.graph.initializer}


def test_save_is_atomic_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    result = onnxmp.convert(MODELS / "mlp.onnx")
    target = tmp_path / "m.onnx"
    target.write_bytes(b"old")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx, "save_model", boom)
    with pytest.raises(onnxmp.OnnxMPError, match="No space left"):
        onnxmp.save(result.model, target)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def test_verify_failure_is_an_onnxmp_error_and_nothing_is_returned(monkeypatch):
    import importlib

    conv = importlib.import_module("onnxmp.pipeline")

    def broken_verify(model, **kw):
        raise onnxmp.OnnxMPError("converted model fails onnx.checker: boom", hint="report it")

    monkeypatch.setattr(conv, "verify", broken_verify)
    with pytest.raises(onnxmp.OnnxMPError, match="boom"):
        onnxmp.convert(MODELS / "mlp.onnx")


def test_verify_catches_type_errors():
    from onnxmp.verify import verify

    model = parse(header() + """
    g (float[4,4] x, float[4,4] w) => (float[4,4] y) {
        y = MatMul(x, w)
    }""")
    model.graph.input[1].type.tensor_type.elem_type = FLOAT16  # MatMul(float, float16) is ill-typed
    with pytest.raises(onnxmp.OnnxMPError, match="hint|type"):
        verify(model)


MVN = header(13) + """
g (float[3,3,3,4] x, float[4,4] w) => (float[3,3,3,4] y) {
    m = MatMul(x, w)
    y = MeanVarianceNormalization%s(m)
}"""


def test_function_op_relying_on_an_attribute_default_does_not_block_conversion():
    # onnx expands MVN-13's function body for inference without the default axes, so strict
    # inference fails on the model as given; verify must not blame the conversion for that.
    model = onnx.parser.parse_model(MVN % "")
    result = onnxmp.convert(model)
    assert result.report.changed
    node = next(n for n in result.model.graph.node if n.op_type == "MeanVarianceNormalization")
    assert not node.attribute  # the model itself keeps relying on the default


def test_function_op_with_explicit_attributes_is_checked_as_is():
    from onnxmp.verify import with_function_defaults

    explicit = parse(MVN % "<axes = [0, 2, 3]>")
    assert with_function_defaults(explicit) is None
    assert with_function_defaults(onnx.parser.parse_model(MVN % "")) is not None
    assert onnxmp.convert(explicit).report.changed


def test_verify_still_rejects_a_type_error_next_to_a_defaulted_function_op():
    from onnxmp.verify import verify

    model = onnx.parser.parse_model(MVN % "")
    model.graph.input[1].type.tensor_type.elem_type = FLOAT16  # MatMul(float, float16)
    with pytest.raises(onnxmp.OnnxMPError, match="type"):
        verify(model)


def test_io_check_compares_shapes_and_nested_types():
    from onnxmp.verify import check_io_unchanged

    model = parse(header(17) + """
    g (seq(float[N]) xs, float[N] t) => (seq(float[N]) ys) {
        ys = SequenceMap(xs, t) <body = body_g (float[N] x, float[N] u) => (float[N] z) {
            z = Add(x, u)
        }>
    }""")
    same = onnx.ModelProto()
    same.CopyFrom(model)
    check_io_unchanged(model, same)
    same.graph.input[0].type.sequence_type.elem_type.tensor_type.ClearField("shape")
    with pytest.raises(onnxmp.OnnxMPError, match="xs"):
        check_io_unchanged(model, same)


def test_bfloat16_conversion_verifies():
    result = onnxmp.convert(MODELS / "mlp.onnx", precision="bfloat16")
    assert result.report.changed
    types = {t.data_type for t in result.model.graph.initializer}
    assert onnx.TensorProto.BFLOAT16 in types


def test_cli_convert_explain_lists(tmp_path, capsys):
    out = tmp_path / "o.onnx"
    report = tmp_path / "r.json"
    assert cli(["convert", str(MODELS / "cnn_bn_bigvar.onnx"), "-o", str(out), "--report", str(report)]) == 0
    text = capsys.readouterr().out
    assert "Casts inserted: 4" in text and "running_var" in text
    import json

    data = json.loads(report.read_text())
    assert data["casts_inserted"] == 4 and data["summary"]["tensor_core_fp16_share"] == 1.0
    assert cli(["explain", str(MODELS / "mlp.onnx"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["changed"]
    assert cli(["lists", "--target", "cuda"]) == 0
    assert "MatMul" in capsys.readouterr().out


def test_cli_bad_inputs_exit_1_with_one_line_and_hint(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes((MODELS / "mlp.onnx").read_bytes()[:200])
    assert cli(["convert", str(bad), "-o", str(tmp_path / "x.onnx")]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "hint:" in err and "Traceback" not in err
    assert not (tmp_path / "x.onnx").exists()
    assert cli(["convert", str(MODELS / "mlp.onnx"), "-o", str(tmp_path / "x.onnx"), "--allow-add", "Exp"]) == 1
    assert "both the allow and the deny list" in capsys.readouterr().err
    for flag, op, hint in (("--allow-add", "Foo", "hint:"), ("--deny-add", "matmul", "'MatMul'")):
        assert cli(["convert", str(MODELS / "mlp.onnx"), "-o", str(tmp_path / "x.onnx"), flag, op]) != 0
        err = capsys.readouterr().err
        assert f"unknown op '{op}'" in err and hint in err and "Traceback" not in err
        assert not (tmp_path / "x.onnx").exists()
    assert cli(["convert", str(MODELS / "mlp.onnx"), "-o", str(tmp_path / "nodir" / "x.onnx")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_outputs_declared_without_a_shape_convert_and_keep_their_element_type():
    # onnx.helper.make_tensor_value_info(name, FLOAT, None) writes no shape; the checker refuses
    # that on graph I/O, so normalize fills in the inferred shape, and the element type stays.
    w = onnx.numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [onnx.helper.make_tensor_value_info("x", FLOAT, ["N", 4])],
        [onnx.helper.make_tensor_value_info("y", FLOAT, None)], [w])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    assert not model.graph.output[0].type.tensor_type.HasField("shape")
    result = onnxmp.convert(model)
    out = result.model.graph.output[0].type.tensor_type
    assert out.elem_type == FLOAT
    assert [d.dim_param or d.dim_value for d in out.shape.dim] == ["N", 4]
    assert any(n.op_type == "MatMul" for n in result.model.graph.node) and result.report.casts_inserted == 2
