"""onnxruntime's own ops (com.microsoft): typed from onnxruntime's schemas, colored as one type
binding, checked as onnxruntime's graph resolution checks them (issue 30)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP, helper, numpy_helper

import onnxmp
from onnxmp import verify
from onnxmp.contrib_types import binding_errors, type_foreign_outputs
from onnxmp.errors import OnnxMPError
from onnxmp.kernels import ContribSchemas
from onnxmp.normalize import normalize

ort = pytest.importorskip("onnxruntime")
H, S = 8, 4  # hidden size, sequence length
MS = "com.microsoft"


def _w(name, shape, seed=0):
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)


def fused_bert(skip_ln=True) -> onnx.ModelProto:
    """x -> Attention (int32 mask) -> SkipLayerNormalization -> MatMul -> BiasGelu -> MatMul -> y,
    as onnxruntime's transformer optimizer writes a BERT layer."""
    nodes = [helper.make_node("Attention", ["x", "qkv_w", "qkv_b", "mask"], ["att"], name="Attention_0",
                              domain=MS, num_heads=2)]
    if skip_ln:
        nodes.append(helper.make_node("SkipLayerNormalization", ["att", "x", "gamma", "beta"], ["ln"],
                                      name="SkipLayerNorm_0", domain=MS, epsilon=1e-5))
    else:
        nodes.append(helper.make_node("Add", ["att", "x"], ["ln"], name="add"))
    nodes += [helper.make_node("MatMul", ["ln", "w1"], ["h"], name="mm1"),
              helper.make_node("BiasGelu", ["h", "b1"], ["g"], name="Gelu_0", domain=MS),
              helper.make_node("MatMul", ["g", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(
        nodes, "fused",
        [helper.make_tensor_value_info("x", TP.FLOAT, [1, S, H]), helper.make_tensor_value_info("mask", TP.INT32, [1, S])],
        [helper.make_tensor_value_info("y", TP.FLOAT, [1, S, H])],
        [_w("qkv_w", (H, 3 * H)), _w("qkv_b", (3 * H,), 1), _w("gamma", (H,), 2), _w("beta", (H,), 3),
         _w("w1", (H, 2 * H), 4), _w("b1", (2 * H,), 5), _w("w2", (2 * H, H), 6)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                             ir_version=8)


def _types(model):
    out = {t.name: t.data_type for t in model.graph.initializer}
    for vi in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        out[vi.name] = vi.type.tensor_type.elem_type
    return out


def _loads(model) -> str:
    """'' when onnxruntime resolves the model (a missing CPU kernel for a GPU model counts as
    resolved), else what it says."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001
        return "" if "NOT_IMPLEMENTED" in str(exc) else str(exc)
    return ""


def test_the_schema_table_knows_each_version_and_the_fused_ops():
    table = ContribSchemas.default()
    assert {"1.19.2", "1.32.0"} <= set(table.versions)
    for op in ("Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention", "SkipLayerNormalization",
               "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization", "BiasGelu", "FastGelu",
               "BiasSplitGelu", "BiasAdd", "RotaryEmbedding", "GroupNorm", "QuickGelu", "FusedMatMul", "MatMulNBits"):
        assert table.schema(op, MS, 1) is not None, op
    # 1.19.2's Attention takes no bfloat16; the newest does.
    assert "tensor(bfloat16)" not in table.schema("Attention", MS, 1, "1.19.2").allowed["T"]
    assert "tensor(bfloat16)" in table.schema("Attention", MS, 1).allowed["T"]
    assert table.known_version("1.20.1") == "1.19.2" and table.known_version("9.0") == table.versions[-1]
    assert table.schema("NoSuchOp", MS, 1) is None


def test_normalize_types_contrib_outputs_and_what_reads_them():
    index = normalize(fused_bert()).index
    for name in ("att", "ln", "h", "g", "y"):
        assert index.dtype(name) == TP.FLOAT, name


def test_a_model_of_onnx_ops_only_gets_no_extra_declarations():
    model = fused_bert(skip_ln=False)
    model.graph.node.remove(model.graph.node[0])
    model.graph.node.remove(model.graph.node[2])  # BiasGelu: mm2 now reads h
    model.graph.node[0].input[0] = "x"
    model.graph.node[2].input[0] = "h"
    before = len(normalize(model).index.model.graph.value_info)
    assert type_foreign_outputs(model, {"": 17}) == 0 and len(model.graph.value_info) == before


def test_an_onnxruntime_op_no_schema_knows_is_refused_by_name():
    model = fused_bert()
    model.graph.node[3].op_type = "BiasGeluFromTheFuture"
    with pytest.raises(OnnxMPError, match="com.microsoft:BiasGeluFromTheFuture.*Gelu_0"):
        onnxmp.convert(model)


@pytest.mark.parametrize("skip_ln", [True, False])
def test_float16_fused_model_binds_every_type_parameter_once_and_loads(skip_ln):
    model = onnxmp.convert(fused_bert(skip_ln)).model
    types = _types(model)
    assert types["qkv_w"] == types["qkv_b"] == TP.FLOAT16  # weights and activation change together
    assert types["mask"] == TP.INT32
    assert binding_errors(model) == []
    assert _loads(model) == ""


def test_binding_errors_name_the_node_as_onnxruntime_does():
    model = fused_bert()
    w = model.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w).astype(np.float16), "qkv_w"))
    errors = binding_errors(model)
    assert errors and "Type parameter (T) of Optype (Attention) bound to different types" in errors[0]
    assert "Attention_0" in errors[0]
    assert "bound to different types" in _loads(model)  # what onnxruntime itself says


def test_verify_refuses_a_model_onnxruntime_would_refuse():
    model = fused_bert()
    normalize(model)
    w = model.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w).astype(np.float16), "qkv_w"))
    with pytest.raises(OnnxMPError, match="would not load.*Attention"):
        verify.verify(model)
    assert verify.verify(fused_bert()) is not None  # the float32 model passes


@pytest.mark.parametrize("version, low", [("1.19.2", False), ("1.32.0", True)])
def test_bfloat16_attention_goes_low_only_where_the_target_onnxruntime_has_it(version, low):
    result = onnxmp.convert(fused_bert(), precision="bfloat16", ort_version=version)
    types = _types(result.model)
    assert (types["qkv_w"] == TP.BFLOAT16) is low
    assert binding_errors(result.model, version) == []


def test_ort_version_is_checked():
    with pytest.raises(OnnxMPError, match="ort_version"):
        onnxmp.convert(fused_bert(), ort_version="latest")


def test_validate_loads_the_candidate_itself(tmp_path):
    from onnxmp.parity.validate import check_loads

    good = onnxmp.convert(fused_bert()).model
    check_loads(good, "candidate")  # resolves (CPU kernels missing for float16 is not its fault)
    bad = fused_bert()
    w = bad.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w).astype(np.float16), "qkv_w"))
    with pytest.raises(OnnxMPError, match="cannot load the candidate model itself.*bound to different types"):
        check_loads(bad, "candidate")


def _group_norm() -> onnx.ModelProto:
    """Conv -> GroupNorm (com.microsoft, NHWC) -> Conv, as in a diffusers UNet through onnxruntime's
    optimizer."""
    c = 4
    nodes = [helper.make_node("Conv", ["x", "k"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
             helper.make_node("Transpose", ["c0"], ["nhwc"], name="to_nhwc", perm=[0, 2, 3, 1]),
             helper.make_node("GroupNorm", ["nhwc", "gamma", "beta"], ["gn"], name="GroupNorm_0", domain=MS,
                              activation=1, epsilon=1e-5, groups=2),
             helper.make_node("Transpose", ["gn"], ["nchw"], name="to_nchw", perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["nchw", "k"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "gn", [helper.make_tensor_value_info("x", TP.FLOAT, [1, c, 4, 4])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [1, c, 4, 4])],
                              [_w("gamma", (c,), 1), _w("beta", (c,), 2), _w("k", (c, c, 3, 3), 3)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                             ir_version=8)


def test_group_norm_computes_low_but_keeps_gamma_and_beta_float32_on_cuda():
    result = onnxmp.convert(_group_norm())
    types = _types(result.model)
    assert types["gamma"] == types["beta"] == TP.FLOAT       # the CUDA kernel reads them as float
    node = next(n for n in result.model.graph.node if n.op_type == "GroupNorm")
    assert types.get(node.input[0]) == TP.FLOAT16              # X goes low with the Conv around it
    assert binding_errors(result.model) == []
    assert _loads(result.model) == ""


def _nhwc_unet_block() -> onnx.ModelProto:
    """NhwcConv -> SkipGroupNorm -> Cast(to=float) -> NhwcConv, as onnxruntime's optimizer writes a
    UNet resnet block (enable_nhwc_conv, enable_skip_group_norm; the Cast of a float32 tensor is its)."""
    c = 4
    nodes = [helper.make_node("NhwcConv", ["x", "k", "kb"], ["c0"], name="NhwcConv_0", domain=MS,
                              kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("SkipGroupNorm", ["c0", "gamma", "beta", "x"], ["gn"], name="SkipGroupNorm_0",
                              domain=MS, activation=1, channels_last=1, epsilon=1e-5, groups=2),
             helper.make_node("Cast", ["gn"], ["gn32"], name="gn_cast_to_1", to=TP.FLOAT),
             helper.make_node("NhwcConv", ["gn32", "k", "kb"], ["y"], name="NhwcConv_1", domain=MS,
                              kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "unet", [helper.make_tensor_value_info("x", TP.FLOAT, [1, 4, 4, c])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [1, 4, 4, c])],
                              [_w("gamma", (c,), 1), _w("beta", (c,), 2), _w("k", (c, c, 3, 3), 3),
                               _w("kb", (c,), 4)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                             ir_version=8)


def test_nhwc_conv_and_skip_group_norm_go_low_with_gamma_and_beta_float32():
    # Before NhwcConv and SkipGroupNorm were on a list, a UNet through the optimizer kept every
    # conv and norm in float32 (71 Casts where onnxruntime's converter writes 44).
    result = onnxmp.convert(_nhwc_unet_block())
    types = _types(result.model)
    convs = [n for n in result.model.graph.node if n.op_type == "NhwcConv"]
    assert all(types[n.input[1]] == TP.FLOAT16 for n in convs)
    norm = next(n for n in result.model.graph.node if n.op_type == "SkipGroupNorm")
    assert types[norm.input[1]] == types[norm.input[2]] == TP.FLOAT   # read with Data<float>()
    assert types.get(norm.output[0]) == TP.FLOAT16
    # in and out: the model's own Cast of gn and the Cast back to float16 the low NhwcConv_1 needs
    # cancel (rewrite/idle.py), so NhwcConv_1 reads the norm's float16 output as it is
    assert sum(n.op_type == "Cast" for n in result.model.graph.node) == 2
    assert next(n for n in result.model.graph.node if n.name == "NhwcConv_1").input[0] == norm.output[0]
    assert binding_errors(result.model) == []
    # (1.19.2's CPU EP trips over its own fallback Casts here: no fault of the model, see below)
    assert verify.runtime_load_error(result.model) is None


def test_nhwc_conv_stays_float32_where_its_kernel_has_no_low_type():
    # The CUDA NhwcConv is registered for float and float16 only.
    result = onnxmp.convert(_nhwc_unet_block(), precision="bfloat16")
    types = _types(result.model)
    assert all(types[n.input[1]] == TP.FLOAT for n in result.model.graph.node if n.op_type == "NhwcConv")
    assert binding_errors(result.model) == []


def test_group_norm_gamma_follows_the_schema_where_no_kernel_fact_pins_it():
    from onnxmp.kernels import KernelTable

    table = KernelTable.default()
    assert table.float32_params("cuda", MS, "GroupNorm", 1) == {"M"}
    assert table.float32_params("cuda", MS, "BiasSplitGelu", 1) == frozenset()
    assert table.float32_params("cuda", "", "LayerNormalization", 17) == frozenset()


@pytest.mark.parametrize("op, inputs, extra", [
    ("FastGelu", ["h", "b1"], {}),
    ("BiasAdd", None, {}),
    ("QuickGelu", ["h"], {"alpha": 1.702}),
    ("FusedMatMul", ["h", "w3"], {"alpha": 1.0}),
])
def test_fused_activations_and_matmuls_convert_into_models_onnxruntime_resolves(op, inputs, extra):
    model = fused_bert()
    node = model.graph.node[3]
    del node.attribute[:]
    node.op_type = op
    if op == "BiasAdd":  # BiasAdd(X, bias, skip) on [N, S, C]
        model.graph.initializer.append(_w("skip", (1, S, 2 * H), 9))
        inputs = ["h", "b1", "skip"]
    if op == "FusedMatMul":
        model.graph.initializer.append(_w("w3", (2 * H, 2 * H), 9))
    del node.input[:]
    node.input.extend(inputs)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in extra.items())
    result = onnxmp.convert(model)
    types = _types(result.model)
    assert types["g"] == TP.FLOAT16, op
    assert binding_errors(result.model) == []
    assert _loads(result.model) == ""


def _clips(opset: int, dropout: bool = False) -> onnx.ModelProto:
    """Conv -> Clip (Relu6, as PP-LCNet exports it at opset 11) -> Conv."""
    c = 4
    nodes = [helper.make_node("Conv", ["x", "k"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c0", "lo", "hi"], ["r"], name="clip"),
             helper.make_node("Conv", ["r", "k"], ["y"], name="conv1", pads=[1, 1, 1, 1])]
    if dropout:  # Dropout-10's ratio attribute is an input from opset 12: the meaning changes
        nodes.append(helper.make_node("Dropout", ["y"], ["z"], name="drop", ratio=0.0))
    graph = helper.make_graph(nodes, "clips", [helper.make_tensor_value_info("x", TP.FLOAT, [1, c, 4, 4])],
                              [helper.make_tensor_value_info("z" if dropout else "y", TP.FLOAT, [1, c, 4, 4])],
                              [_w("k", (c, c, 3, 3), 3), numpy_helper.from_array(np.array(0, np.float32), "lo"),
                               numpy_helper.from_array(np.array(6, np.float32), "hi")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)


def test_clip_at_opset_11_is_retargeted_to_12_and_goes_low():
    result = onnxmp.convert(_clips(11))
    assert [o.version for o in result.model.opset_import if o.domain in ("", "ai.onnx")] == [12]
    assert "opset 11 -> 12: Clip" in (result.report.opset_retarget or "")
    assert "retargeted" in result.report.summary()
    assert _types(result.model).get("r") in (None, TP.FLOAT16)
    assert not any(n.op_type == "Cast" for n in result.model.graph.node if n.name.startswith("clip"))
    assert sum(n.op_type == "Cast" for n in result.model.graph.node) == 2  # graph input and output only


@pytest.mark.parametrize("model", [_clips(12), _clips(11, dropout=True)], ids=["opset12", "dropout-changes"])
def test_no_retarget_where_no_gap_or_the_meaning_changes(model):
    result = onnxmp.convert(model)
    assert result.report.opset_retarget is None
    assert [o.version for o in result.model.opset_import] == [o.version for o in model.opset_import]


def _gemm_into_skip_ln() -> onnx.ModelProto:
    """GPT-2's projection through onnxruntime's optimizer: Gemm -> Reshape -> SkipLayerNormalization
    -> MatMul.  Once, the Gemm's weight went float16 with its activation left float32 ("Gemm ... B
    has inconsistent type"), and blocking the Gemm left SkipLayerNormalization bound to two types."""
    nodes = [helper.make_node("Gemm", ["x2", "wg", "bg"], ["p"], name="c_proj/Gemm"),
             helper.make_node("Reshape", ["p", "shape"], ["p3"], name="reshape"),
             helper.make_node("SkipLayerNormalization", ["p3", "x3", "gamma", "beta"], ["ln"], name="SkipLayerNorm_0",
                              domain=MS, epsilon=1e-5),
             helper.make_node("MatMul", ["ln", "w1"], ["y"], name="mm")]
    graph = helper.make_graph(
        nodes, "gemm_skip",
        [helper.make_tensor_value_info("x2", TP.FLOAT, [S, H]), helper.make_tensor_value_info("x3", TP.FLOAT, [1, S, H])],
        [helper.make_tensor_value_info("y", TP.FLOAT, [1, S, 2 * H])],
        [_w("wg", (H, H), 1), _w("bg", (H,), 2), numpy_helper.from_array(np.array([1, S, H], np.int64), "shape"),
         _w("gamma", (H,), 3), _w("beta", (H,), 4), _w("w1", (H, 2 * H), 5)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                             ir_version=8)


@pytest.mark.parametrize("block", [(), ("c_proj/Gemm",), ("SkipLayerNorm",)])
def test_a_gemm_feeding_a_fused_op_converts_into_a_loadable_model_however_blocked(block):
    result = onnxmp.convert(_gemm_into_skip_ln(), block_nodes=block)
    types = _types(result.model)
    assert (types["wg"] == TP.FLOAT) is ("c_proj/Gemm" in block)
    assert binding_errors(result.model) == []
    assert _loads(result.model) == ""


def _between_matmuls(op: str) -> onnx.ModelProto:
    """x -> MatMul -> OP (com.microsoft) -> MatMul -> y, OP's other inputs initializers."""
    inits = [_w("w0", (H, H), 1), _w("w9", (H, H), 9)]
    extra_inputs = []
    if op == "MultiHeadAttention":
        node = helper.make_node(op, ["a", "a", "a"], ["b"], name="op", domain=MS, num_heads=2)
    elif op == "SkipSimplifiedLayerNormalization":
        node = helper.make_node(op, ["a", "x", "gamma"], ["b"], name="op", domain=MS, epsilon=1e-5)
        inits.append(_w("gamma", (H,), 2))
    elif op == "RotaryEmbedding":
        node = helper.make_node(op, ["a", "pos", "cos", "sin"], ["b"], name="op", domain=MS, num_heads=2)
        inits += [_w("cos", (S, 2), 3), _w("sin", (S, 2), 4)]
        extra_inputs.append(helper.make_tensor_value_info("pos", TP.INT64, [1, S]))
    elif op == "MatMulNBits":  # 4-bit weights in blocks of 16 along K = H
        node = helper.make_node(op, ["a", "qw", "scales"], ["b"], name="op", domain=MS, K=H, N=H, bits=4, block_size=16)
        inits += [numpy_helper.from_array(np.full((H, 1, 8), 0x88, np.uint8), "qw"), _w("scales", (H,), 5)]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w0"], ["a"], name="mm0"), node,
         helper.make_node("MatMul", ["b", "w9"], ["y"], name="mm9")], "between",
        [helper.make_tensor_value_info("x", TP.FLOAT, [1, S, H]), *extra_inputs],
        [helper.make_tensor_value_info("y", TP.FLOAT, [1, S, H])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                             ir_version=8)


@pytest.mark.parametrize("op", ["MultiHeadAttention", "SkipSimplifiedLayerNormalization", "RotaryEmbedding",
                                "MatMulNBits"])
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_the_optimizers_other_fused_ops_are_typed_and_bound_once(op, precision):
    model = _between_matmuls(op)
    assert normalize(_between_matmuls(op)).index.dtype("b") == TP.FLOAT
    result = onnxmp.convert(model, precision=precision, ort_version="1.19.2")
    assert binding_errors(result.model, "1.19.2") == []
    assert _loads(result.model) == ""
    if op == "MatMulNBits":
        types = _types(result.model)
        node = next(n for n in result.model.graph.node if n.op_type == op)
        assert types["qw"] == TP.UINT8 and types["scales"] == types[node.input[0]]  # T1: scales follow A
        # 1.19.2's MatMulNBits takes no bfloat16: it stays float32 there
        assert types["scales"] == (TP.FLOAT16 if precision == "float16" else TP.FLOAT)


def test_binding_errors_see_through_undeclared_cast_outputs():
    model = fused_bert()
    # x reaches Attention through a Cast to float16 whose output nothing declares; the weights stay float32
    model.graph.node.insert(0, helper.make_node("Cast", ["x"], ["x16"], name="cast", to=TP.FLOAT16))
    model.graph.node[1].input[0] = "x16"
    errors = binding_errors(model)
    assert errors and "(tensor(float16) and tensor(float))" in errors[0]


def test_validate_fails_a_candidate_onnxruntime_refuses_though_its_emulated_copy_runs():
    bad = fused_bert()
    w = bad.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w).astype(np.float16), "qkv_w"))
    feeds = {"x": np.random.default_rng(0).standard_normal((1, S, H)).astype(np.float32),
             "mask": np.ones((1, S), np.int32)}
    with pytest.raises(OnnxMPError, match="cannot load the candidate model itself"):
        onnxmp.validate(fused_bert(), bad, feeds)
    good = onnxmp.convert(fused_bert()).model
    assert onnxmp.validate(fused_bert(), good, feeds).passed


@pytest.mark.parametrize("version, low", [("1.19.2", False), ("1.32.0", True)])
def test_cpu_target_reads_the_cpu_kernels_of_the_target_onnxruntime(version, low):
    # onnxruntime 1.19.2's CPU EP registers SkipLayerNormalization for float only; 1.32's for float16 too.
    table = ContribSchemas.default()
    assert table.kernel_supports("CPUExecutionProvider", MS, "SkipLayerNormalization", 1, "T", "float16", version) is low
    assert table.kernel_supports("CUDAExecutionProvider", MS, "SkipLayerNormalization", 1, "T", "float16") is None
    result = onnxmp.explain(_between_matmuls("SkipSimplifiedLayerNormalization"), target="cpu", ort_version=version)
    vertex = next(v for v in result.vertices if v.node == "op")
    assert (f"in onnxruntime {version}" in vertex.cause) is not low, vertex.cause


def test_schema_table_matches_the_installed_plain_onnxruntime():
    pybind = pytest.importorskip("onnxruntime.capi._pybind_state")
    if not hasattr(pybind, "get_all_operator_schema"):
        pytest.skip("this onnxruntime build does not expose get_all_operator_schema (onnxruntime-training 1.19.2)")
    table = ContribSchemas.default()
    if ort.__version__ not in table.versions:
        pytest.skip(f"the table does not record onnxruntime {ort.__version__}: run scripts/gen_contrib_schemas.py")
    for schema in pybind.get_all_operator_schema():
        if schema.domain != MS or schema.deprecated:
            continue
        ours = table.schema(schema.name, MS, schema.since_version, ort.__version__)
        assert ours is not None and ours.since_version == schema.since_version, schema.name
        assert ours.allowed == {tc.type_param_str: frozenset(tc.allowed_type_strs) for tc in schema.type_constraints}


@pytest.mark.parametrize("spec", ["1.19.2,1.32.0", "all"])
def test_several_target_versions_keep_low_only_what_each_takes(spec):
    table = ContribSchemas.default()
    assert table.versions_of(spec)[0] == "1.19.2"
    result = onnxmp.convert(fused_bert(), precision="bfloat16", ort_version=spec)
    assert _types(result.model)["qkv_w"] == TP.FLOAT  # 1.19.2 has no bfloat16 Attention
    assert binding_errors(result.model, "1.19.2") == binding_errors(result.model, "1.32.0") == []
    bad = onnxmp.convert(fused_bert(), precision="bfloat16", ort_version="1.32.0").model
    assert binding_errors(bad, spec) and not binding_errors(bad, "1.32.0")


def test_the_cpu_eps_own_cast_fallback_is_no_fault_of_the_model():
    # A float16 GPT-2 on a CPU-only build: onnxruntime runs its float16 nodes in float32 through
    # Casts it inserts ("InsertedPrecisionFreeCast_...") and, in 1.19.2, trips over them after the
    # model resolved.  validate's load check must not blame the model for that.
    from pathlib import Path

    from onnxmp.parity.validate import check_loads

    path = Path(__file__).resolve().parent.parent / "models" / "exports" / "gpt2.torchscript17.onnx"
    check_loads(onnxmp.convert(str(path)).model, "candidate")


def _rms_between_matmuls(first_matmul=True) -> onnx.ModelProto:
    """[MatMul ->] SimplifiedLayerNormalization (onnxruntime's RMSNorm, X of type T, Y of type V) -> MatMul."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1")] if first_matmul else []
    nodes += [helper.make_node("SimplifiedLayerNormalization", ["h" if first_matmul else "x", "scale"], ["n"],
                               name="rms", axis=-1, epsilon=1e-6),
              helper.make_node("MatMul", ["n", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("x", TP.FLOAT, [2, H])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [2, H])],
                              [_w("w1", (H, H), 1), _w("scale", (H,), 2), _w("w2", (H, H), 3)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                             ir_version=8)


def test_a_float32_kernel_reads_an_input_already_low_without_a_cast():
    # X binds no output: no "between allow ops" reaches it.  Kept float32 it cost a Cast up of a
    # float16 tensor (Llama's embedding into its first RMSNorm), with the same numerics: the CUDA
    # kernel widens X to float either way.
    result = onnxmp.convert(_rms_between_matmuls())
    types = _types(result.model)
    rms = next(n for n in result.model.graph.node if n.op_type == "SimplifiedLayerNormalization")
    assert types[rms.input[0]] == types[rms.output[0]] == TP.FLOAT16
    assert sum(n.op_type == "Cast" for n in result.model.graph.node) == 2  # the model's input and output
    assert result.coloring.final("rms:T")[1].rule == "take_low_inputs_of_float32_kernels"
    assert binding_errors(result.model) == []


def test_an_input_read_in_float32_stays_float32():
    # X is the model's float32 input: going low would be a Cast, not save one.
    result = onnxmp.convert(_rms_between_matmuls(first_matmul=False))
    types = _types(result.model)
    rms = next(n for n in result.model.graph.node if n.op_type == "SimplifiedLayerNormalization")
    assert types[rms.input[0]] == TP.FLOAT and types[rms.output[0]] == TP.FLOAT16
    assert binding_errors(result.model) == []
