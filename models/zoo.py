"""Small, deterministic float32 ONNX models used by tests, examples and benchmarks.

Every builder returns a fresh ``onnx.ModelProto`` (opset 17, IR 8) whose weights
come from a fixed numpy seed, so two calls serialize to identical bytes. That is
what lets ``tests/test_models.py`` check the committed ``*.onnx`` files against
this module instead of trusting them.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
# onnxruntime 1.19 refuses IR > 10 and onnx 1.23 would stamp a newer one.
IR_VERSION = 8
PRODUCER = "onnxmp.models.zoo"
BATCH = "N"

# Models written to disk by models/generate.py. transformer_stack is left out on
# purpose: the 1000-node variant is several MB and is always built in memory.
COMMITTED = (
    "mlp",
    "cnn_bn",
    "cnn_bn_bigvar",
    "transformer_block",
    "gru",
    "lstm",
    "loop_if",
    "transformer_classifier",
    "kv_decoder",
)

FP16_MAX = 65504.0


class _Graph:
    """Accumulates nodes/initializers with readable, collision-free names."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._counts: Counter[str] = Counter()

    def _unique(self, base: str) -> str:
        k = self._counts[base]
        self._counts[base] += 1
        return base if k == 0 else f"{base}_{k}"

    def init(self, name: str, array: np.ndarray) -> str:
        name = self._unique(name)
        self.inits.append(numpy_helper.from_array(np.asarray(array, order="C"), name))
        return name

    def op(self, op_type: str, inputs: list[str], scope: str = "", n_out: int = 1, **attrs):
        name = self._unique(f"{scope}/{op_type}" if scope else op_type)
        outs = [f"{name}_output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype, scope: str = "") -> str:
        """Constant node, the way exporters emit scalars and shape vectors."""
        arr = np.asarray(value, dtype=dtype)
        name = self._unique(f"{scope}/Constant" if scope else "Constant")
        out = f"{name}_output_0"
        self.nodes.append(
            helper.make_node(
                "Constant", [], [out], name=name, value=numpy_helper.from_array(arr, out)
            )
        )
        return out

    # Weight initializers ------------------------------------------------------

    def xavier(self, name: str, shape: tuple[int, ...], fan_in: int, fan_out: int, gain=1.0) -> str:
        std = gain * math.sqrt(2.0 / (fan_in + fan_out))
        return self.init(name, (self.rng.standard_normal(shape) * std).astype(np.float32))

    def he(self, name: str, shape: tuple[int, ...], fan_in: int) -> str:
        std = math.sqrt(2.0 / fan_in)
        return self.init(name, (self.rng.standard_normal(shape) * std).astype(np.float32))

    def bias(self, name: str, n: int, std: float = 0.02) -> str:
        return self.init(name, (self.rng.standard_normal(n) * std).astype(np.float32))


def _vi(name: str, elem_type: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def _finish(g: _Graph, name: str, inputs, outputs, doc: str) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, name, inputs, outputs, initializer=g.inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name=PRODUCER,
        producer_version="1",
        doc_string=doc,
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


# ---------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------


def mlp() -> onnx.ModelProto:
    """x[N,64] -> Gemm -> Relu -> MatMul+Add -> Relu -> Gemm -> logits[N,10].

    Mixes Gemm (transB=1, as torch.nn.Linear exports) and MatMul+Add so both
    spellings of a dense layer get exercised.
    """
    g = _Graph(np.random.default_rng(1001))
    w1 = g.he("fc1.weight", (128, 64), 64)
    b1 = g.bias("fc1.bias", 128)
    w2 = g.he("fc2.weight", (128, 64), 128)
    b2 = g.bias("fc2.bias", 64)
    w3 = g.xavier("fc3.weight", (10, 64), 64, 10)
    b3 = g.bias("fc3.bias", 10)

    h = g.op("Gemm", ["x", w1, b1], "fc1", transB=1)
    h = g.op("Relu", [h], "fc1")
    h = g.op("MatMul", [h, w2], "fc2")
    h = g.op("Add", [h, b2], "fc2")
    h = g.op("Relu", [h], "fc2")
    g.nodes.append(helper.make_node("Gemm", [h, w3, b3], ["logits"], name="fc3/Gemm", transB=1))
    return _finish(
        g,
        "mlp",
        [_vi("x", TensorProto.FLOAT, [BATCH, 64])],
        [_vi("logits", TensorProto.FLOAT, [BATCH, 10])],
        "3-layer MLP",
    )


# ---------------------------------------------------------------------------
# CNN with BatchNormalization
# ---------------------------------------------------------------------------

BIGVAR_LAYER = "bn1"
BIGVAR_CHANNEL = 5
BIGVAR_VALUE = 9.8e7
BN_EPS = 1e-5


def _cnn(name: str, big_var: bool) -> onnx.ModelProto:
    # Same seed for both variants: cnn_bn_bigvar differs only in one BN channel,
    # and is rescaled to compute the same function, so its fp32 outputs match
    # cnn_bn and any fp16 error is attributable to the huge var alone.
    g = _Graph(np.random.default_rng(2002))
    c1, c2 = 16, 32

    def bn_params(prefix: str, c: int):
        scale = (1.0 + 0.1 * g.rng.standard_normal(c)).astype(np.float32)
        bias = (0.1 * g.rng.standard_normal(c)).astype(np.float32)
        mean = (0.2 * g.rng.standard_normal(c)).astype(np.float32)
        var = g.rng.uniform(0.5, 3.0, c).astype(np.float32)
        if big_var and prefix == BIGVAR_LAYER:
            # Mirrors a real OCR detector export: one near-dead channel with an
            # enormous running var. Scale grows by the same sqrt so the channel's
            # output (scale / sqrt(var)) is unchanged; 9.8e7 -> scale ~1e4 still
            # fits fp16, the var does not.
            k = BIGVAR_CHANNEL
            ratio = math.sqrt((BIGVAR_VALUE + BN_EPS) / (float(var[k]) + BN_EPS))
            scale[k] = np.float32(float(scale[k]) * ratio)
            var[k] = np.float32(BIGVAR_VALUE)
        return [
            g.init(f"{prefix}.weight", scale),
            g.init(f"{prefix}.bias", bias),
            g.init(f"{prefix}.running_mean", mean),
            g.init(f"{prefix}.running_var", var),
        ]

    w1 = g.he("conv1.weight", (c1, 3, 3, 3), 3 * 9)
    b1 = g.bias("conv1.bias", c1)
    bn1 = bn_params("bn1", c1)
    w2 = g.he("conv2.weight", (c2, c1, 3, 3), c1 * 9)
    b2 = g.bias("conv2.bias", c2)
    bn2 = bn_params("bn2", c2)
    wf = g.xavier("fc.weight", (10, c2), c2, 10)
    bf = g.bias("fc.bias", 10)

    conv = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    h = g.op("Conv", ["x", w1, b1], "conv1", **conv)
    h = g.op("BatchNormalization", [h, *bn1], "bn1", epsilon=BN_EPS)
    h = g.op("Relu", [h], "relu1")
    h = g.op("MaxPool", [h], "pool1", kernel_shape=[2, 2], strides=[2, 2])
    h = g.op("Conv", [h, w2, b2], "conv2", **conv)
    h = g.op("BatchNormalization", [h, *bn2], "bn2", epsilon=BN_EPS)
    h = g.op("Relu", [h], "relu2")
    h = g.op("GlobalAveragePool", [h], "gap")
    h = g.op("Flatten", [h], "flatten", axis=1)
    g.nodes.append(helper.make_node("Gemm", [h, wf, bf], ["logits"], name="fc/Gemm", transB=1))
    return _finish(
        g,
        name,
        [_vi("x", TensorProto.FLOAT, [BATCH, 3, 32, 32])],
        [_vi("logits", TensorProto.FLOAT, [BATCH, 10])],
        "Conv-BN-Relu CNN" + (f" with {BIGVAR_LAYER} var[{BIGVAR_CHANNEL}]={BIGVAR_VALUE:g}" if big_var else ""),
    )


def cnn_bn() -> onnx.ModelProto:
    """x[N,3,32,32] -> (Conv,BN,Relu,MaxPool) -> (Conv,BN,Relu) -> GAP -> Flatten -> Gemm."""
    return _cnn("cnn_bn", big_var=False)


def cnn_bn_bigvar() -> onnx.ModelProto:
    """cnn_bn with bn1.running_var[5] = 9.8e7 (> fp16 max); same fp32 function."""
    return _cnn("cnn_bn_bigvar", big_var=True)


# ---------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------

LN_EPS = 1e-12  # BERT's value; it underflows to 0 in fp16.
MASK_FILL = -1e9  # overflows to -inf in fp16; 0 * -inf is NaN.


def _layer_norm(g: _Graph, x: str, hidden: int, scope: str) -> str:
    # Decomposed the way torch.onnx exports LayerNorm below opset 17's fused op.
    gamma = g.init(f"{scope}.weight", (1.0 + 0.05 * g.rng.standard_normal(hidden)).astype(np.float32))
    beta = g.init(f"{scope}.bias", (0.02 * g.rng.standard_normal(hidden)).astype(np.float32))
    mean = g.op("ReduceMean", [x], scope, axes=[-1], keepdims=1)
    d = g.op("Sub", [x, mean], scope)
    p = g.op("Pow", [d, g.const(2.0, np.float32, scope)], scope)
    var = g.op("ReduceMean", [p], scope, axes=[-1], keepdims=1)
    ve = g.op("Add", [var, g.const(LN_EPS, np.float32, scope)], scope)
    s = g.op("Sqrt", [ve], scope)
    n = g.op("Div", [d, s], scope)
    n = g.op("Mul", [n, gamma], scope)
    return g.op("Add", [n, beta], scope)


def _linear(g: _Graph, x: str, fan_in: int, fan_out: int, scope: str, gain: float = 1.0) -> str:
    w = g.xavier(f"{scope}.weight", (fan_in, fan_out), fan_in, fan_out, gain)
    b = g.bias(f"{scope}.bias", fan_out)
    return g.op("Add", [g.op("MatMul", [x, w], scope), b], scope)


def _additive_mask(g: _Graph, mask: str) -> str:
    """mask[N,S] of 1/0 -> (1 - mask) * -1e9 shaped [N,1,1,S]; built once per model."""
    scope = "mask"
    m = g.op("Unsqueeze", [mask, g.const([1, 2], np.int64, scope)], scope)
    inv = g.op("Sub", [g.const(1.0, np.float32, scope), m], scope)
    return g.op("Mul", [inv, g.const(MASK_FILL, np.float32, scope)], scope)


def _split_heads(g: _Graph, x: str, q: str, k: str, v: str, a: str, seq: int, heads: int, dh: int):
    """[N,S,H] -> per-head q [N,h,S,d], k^T [N,h,d,S], v [N,h,S,d]; also returns [N] for merging back.

    Dynamic batch via Shape/Gather/Unsqueeze/Concat, as exporters trace it; the
    int64 side-graph is something a precision pass must leave alone.
    """
    shp = g.op("Shape", [x], a)
    n = g.op("Gather", [shp, g.const(0, np.int64, a)], a, axis=0)
    n1 = g.op("Unsqueeze", [n, g.const([0], np.int64, a)], a)
    split_shape = g.op("Concat", [n1, g.const([seq, heads, dh], np.int64, a)], a, axis=0)
    q = g.op("Transpose", [g.op("Reshape", [q, split_shape], a)], a, perm=[0, 2, 1, 3])
    k = g.op("Transpose", [g.op("Reshape", [k, split_shape], a)], a, perm=[0, 2, 3, 1])
    v = g.op("Transpose", [g.op("Reshape", [v, split_shape], a)], a, perm=[0, 2, 1, 3])
    return q, k, v, n1


def _transformer_layer(
    g: _Graph, x: str, mask_add: str, scope: str, hidden: int, seq: int, heads: int, out_gain: float
) -> str:
    dh = hidden // heads
    ffn = 4 * hidden

    # ---- attention (pre-LN) ----
    a = f"{scope}/attn"
    h = _layer_norm(g, x, hidden, f"{scope}/ln1")
    q = _linear(g, h, hidden, hidden, f"{a}/q")
    k = _linear(g, h, hidden, hidden, f"{a}/k")
    v = _linear(g, h, hidden, hidden, f"{a}/v")

    q, k, v, n1 = _split_heads(g, h, q, k, v, a, seq, heads, dh)

    scores = g.op("MatMul", [q, k], a)
    scores = g.op("Div", [scores, g.const(math.sqrt(dh), np.float32, a)], a)
    scores = g.op("Add", [scores, mask_add], a)
    probs = g.op("Softmax", [scores], a, axis=-1)
    ctx = g.op("MatMul", [probs, v], a)
    ctx = g.op("Transpose", [ctx], a, perm=[0, 2, 1, 3])
    merge_shape = g.op("Concat", [n1, g.const([seq, hidden], np.int64, a)], a, axis=0)
    ctx = g.op("Reshape", [ctx, merge_shape], a)
    attn = _linear(g, ctx, hidden, hidden, f"{a}/out", gain=out_gain)
    x = g.op("Add", [x, attn], f"{scope}/residual1")

    # ---- feed-forward ----
    f = f"{scope}/ffn"
    h = _layer_norm(g, x, hidden, f"{scope}/ln2")
    h = _linear(g, h, hidden, ffn, f"{f}/fc1")
    # GELU through Erf, exactly as torch exports nn.GELU() at opset < 20.
    e = g.op("Erf", [g.op("Div", [h, g.const(math.sqrt(2.0), np.float32, f)], f)], f)
    e = g.op("Add", [e, g.const(1.0, np.float32, f)], f)
    h = g.op("Mul", [g.op("Mul", [h, e], f), g.const(0.5, np.float32, f)], f)
    h = _linear(g, h, ffn, hidden, f"{f}/fc2", gain=out_gain)
    return g.op("Add", [x, h], f"{scope}/residual2")


def transformer_stack(n_layers: int, hidden: int = 64, seq: int = 16, heads: int = 4) -> onnx.ModelProto:
    """n_layers pre-LN encoder layers over x[N,seq,hidden] with mask[N,seq]; 67 nodes/layer.

    transformer_stack(17) has > 1000 nodes. Nothing is written to disk.
    """
    return _transformer("transformer_stack", n_layers, hidden, seq, heads)


def transformer_block() -> onnx.ModelProto:
    """One layer of transformer_stack with x[N,16,64], mask[N,16] -> y[N,16,64]."""
    return _transformer("transformer_block", 1, 64, 16, 4)


def _transformer(name: str, n_layers: int, hidden: int, seq: int, heads: int) -> onnx.ModelProto:
    if n_layers < 1:
        raise ValueError("n_layers must be >= 1")
    if hidden % heads:
        raise ValueError("hidden must be divisible by heads")
    g = _Graph(np.random.default_rng(3003))
    # GPT-2 style damping of the residual branches keeps the pre-LN residual
    # stream O(1) at any depth, so deep stacks stay well inside fp16 range.
    out_gain = 1.0 / math.sqrt(2.0 * n_layers)
    mask_add = _additive_mask(g, "mask")
    x = "x"
    for i in range(n_layers):
        x = _transformer_layer(g, x, mask_add, f"layer{i}", hidden, seq, heads, out_gain)
    g.nodes.append(helper.make_node("Identity", [x], ["y"], name="output/Identity"))
    return _finish(
        g,
        name if name == "transformer_block" else f"{name}_{n_layers}",
        [
            _vi("x", TensorProto.FLOAT, [BATCH, seq, hidden]),
            _vi("mask", TensorProto.FLOAT, [BATCH, seq]),
        ],
        [_vi("y", TensorProto.FLOAT, [BATCH, seq, hidden])],
        f"{n_layers}-layer pre-LN transformer encoder, hidden={hidden}, heads={heads}",
    )


def linear_occ_stack(n_layers: int, hidden: int = 8, seq: int = 4, heads: int = 2) -> onnx.ModelProto:
    """Pre-LN encoder layers over x[N,seq,hidden] with an additive mask[N,seq] input.

    One LayerNormalization node per norm, Q/K/V/out/FFN as MatMul+Add, scaled dot-product
    attention with Reshape/Transpose heads, GELU as x * 0.5 * (1 + Erf(x / sqrt 2)).  Weights
    are initializers; no value_info, so every type comes from shape inference.
    """
    rng = np.random.default_rng(12)
    dh, ffn = hidden // heads, 4 * hidden
    nodes, inits = [], []

    def init(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(name, shape):
        return init(name, (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32))

    def op(op_type, inputs, name, **attrs):
        nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    heads_shape = init("shape_heads", np.array([0, seq, heads, dh], np.int64))
    merge_shape = init("shape_merge", np.array([0, seq, hidden], np.int64))
    scale = init("attn_scale", np.array(math.sqrt(dh), np.float32))
    sqrt2 = init("gelu_sqrt2", np.array(math.sqrt(2.0), np.float32))
    one = init("gelu_one", np.array(1.0, np.float32))
    half = init("gelu_half", np.array(0.5, np.float32))
    # Read once from the graph input: occ Casts a float input once per reader and appends the Casts
    # after every node, so a mask input read by every layer makes its topological sort quadratic.
    x = op("Identity", ["x"], "input/Identity")
    mask = op("Unsqueeze", ["mask", init("mask_axes", np.array([1, 2], np.int64))], "mask/Unsqueeze")
    for i in range(n_layers):
        p = f"layer{i}"

        def linear(src, name, n_in, n_out):
            w = weight(f"{p}/{name}.weight", (n_in, n_out))
            b = init(f"{p}/{name}.bias", np.zeros(n_out, np.float32))
            return op("Add", [op("MatMul", [src, w], f"{p}/{name}/MatMul"), b], f"{p}/{name}/Add")

        def norm(src, name):
            g = init(f"{p}/{name}.weight", np.ones(hidden, np.float32))
            b = init(f"{p}/{name}.bias", np.zeros(hidden, np.float32))
            return op("LayerNormalization", [src, g, b], f"{p}/{name}", axis=-1, epsilon=1e-5)

        h = norm(x, "ln1")
        q, k, v = (op("Transpose", [op("Reshape", [linear(h, n, hidden, hidden), heads_shape], f"{p}/{n}/Reshape")],
                      f"{p}/{n}/Transpose", perm=perm)
                   for n, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])))
        scores = op("Div", [op("MatMul", [q, k], f"{p}/scores/MatMul"), scale], f"{p}/scores/Div")
        probs = op("Softmax", [op("Add", [scores, mask], f"{p}/mask/Add")], f"{p}/Softmax", axis=-1)
        ctx = op("MatMul", [probs, v], f"{p}/ctx/MatMul")
        ctx = op("Reshape", [op("Transpose", [ctx], f"{p}/ctx/Transpose", perm=[0, 2, 1, 3]), merge_shape],
                 f"{p}/ctx/Reshape")
        x = op("Add", [x, linear(ctx, "out", hidden, hidden)], f"{p}/residual1")
        h = linear(norm(x, "ln2"), "fc1", hidden, ffn)
        erf = op("Erf", [op("Div", [h, sqrt2], f"{p}/gelu/Div")], f"{p}/gelu/Erf")
        gelu = op("Mul", [op("Mul", [h, op("Add", [erf, one], f"{p}/gelu/Add")], f"{p}/gelu/Mul"), half],
                  f"{p}/gelu/Mul2")
        x = op("Add", [x, linear(gelu, "fc2", ffn, hidden)], f"{p}/residual2")
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(
        nodes, f"linear_occ_stack_{n_layers}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", seq, hidden]),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["N", seq])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", seq, hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
                             producer_name="bench_convert")


# ---------------------------------------------------------------------------
# Transformer classifier (BERT-style, as torch.onnx.export writes one)
# ---------------------------------------------------------------------------

TC_VOCAB, TC_SEQ, TC_HIDDEN, TC_HEADS, TC_LAYERS, TC_FFN, TC_CLASSES = 16, 12, 32, 4, 2, 64, 2
TC_PAD, TC_CLS, TC_KEY = 0, 1, 2  # token ids of the classifier's little task
FLOAT32_MIN = float(np.finfo(np.float32).min)  # torch.finfo(float32).min: -inf in fp16


def _torch_layer_norm(g: _Graph, x: str, hidden: int, scope: str) -> str:
    # torch.onnx (opset >= 17) writes nn.LayerNorm as one single-output LayerNormalization.
    gamma = g.init(f"{scope}.weight", np.ones(hidden, np.float32))
    beta = g.init(f"{scope}.bias", np.zeros(hidden, np.float32))
    return g.op("LayerNormalization", [x, gamma, beta], scope, axis=-1, epsilon=LN_EPS)


def _torch_linear(g: _Graph, x: str, fan_in: int, fan_out: int, scope: str) -> str:
    # TorchScript export: MatMul with the transposed weight as an anonymous initializer, then Add.
    w = g.init(f"onnx::MatMul_{scope}", (g.rng.standard_normal((fan_in, fan_out)) * 0.02 * 4).astype(np.float32))
    b = g.init(f"{scope}.bias", np.zeros(fan_out, np.float32))
    return g.op("Add", [b, g.op("MatMul", [x, w], scope)], scope)


def _bert_layer(g: _Graph, x: str, mask_add: str, scope: str) -> str:
    hidden, heads, seq = TC_HIDDEN, TC_HEADS, TC_SEQ
    dh = hidden // heads
    a = f"{scope}/attention"
    q = _torch_linear(g, x, hidden, hidden, f"{a}/query")
    k = _torch_linear(g, x, hidden, hidden, f"{a}/key")
    v = _torch_linear(g, x, hidden, hidden, f"{a}/value")
    q, k, v, n1 = _split_heads(g, x, q, k, v, a, seq, heads, dh)
    scores = g.op("Div", [g.op("MatMul", [q, k], a), g.const(math.sqrt(dh), np.float32, a)], a)
    probs = g.op("Softmax", [g.op("Add", [scores, mask_add], a)], a, axis=-1)
    ctx = g.op("Transpose", [g.op("MatMul", [probs, v], a)], a, perm=[0, 2, 1, 3])
    merge_shape = g.op("Concat", [n1, g.const([seq, hidden], np.int64, a)], a, axis=0)
    ctx = g.op("Reshape", [ctx, merge_shape], a)
    attn = _torch_linear(g, ctx, hidden, hidden, f"{a}/output")
    x = _torch_layer_norm(g, g.op("Add", [attn, x], a), hidden, f"{a}/LayerNorm")

    f = f"{scope}/ffn"
    h = _torch_linear(g, x, hidden, TC_FFN, f"{f}/intermediate")
    e = g.op("Erf", [g.op("Div", [h, g.const(math.sqrt(2.0), np.float32, f)], f)], f)
    h = g.op("Mul", [g.op("Mul", [h, g.op("Add", [e, g.const(1.0, np.float32, f)], f)], f),
                     g.const(0.5, np.float32, f)], f)
    h = _torch_linear(g, h, TC_FFN, hidden, f"{f}/output")
    return _torch_layer_norm(g, g.op("Add", [h, x], f), hidden, f"{f}/LayerNorm")


def transformer_classifier(mask_fill: str = "mul") -> onnx.ModelProto:
    """BERT-style encoder classifier: input_ids, attention_mask [N,12] int64 -> logits[N,2].

    Built the way ``torch.onnx.export(..., opset_version=17, dynamo=False)``
    writes a Hugging Face BERT in eval mode: Gather embeddings (word and
    position), single-output LayerNormalization, the extended attention mask
    ``(1 - mask) * finfo(float32).min`` added to the scores (-inf in float16),
    Erf GELU, and a tanh pooler over the first token before the classifier.
    Two layers, hidden 32, 4 heads; the task is :func:`classifier_task`.
    ``mask_fill="where"`` builds the mask as transformers 4.4x+ does instead:
    ``Where(bool(1 - mask), finfo.min, 1 - mask)`` (not committed).
    """
    g = _Graph(np.random.default_rng(2024))
    hidden = TC_HIDDEN
    words = g.init("embeddings.word_embeddings.weight",
                   (g.rng.standard_normal((TC_VOCAB, hidden)) * 0.5).astype(np.float32))
    positions = g.init("embeddings.position_embeddings.weight",
                       (g.rng.standard_normal((TC_SEQ, hidden)) * 0.5).astype(np.float32))
    e = "embeddings"
    # position_ids is a registered buffer: torch exports it as a constant.
    position_ids = g.const(np.arange(TC_SEQ, dtype=np.int64)[None, :], np.int64, e)
    x = g.op("Add", [g.op("Gather", [words, "input_ids"], e), g.op("Gather", [positions, position_ids], e)], e)
    x = _torch_layer_norm(g, x, hidden, f"{e}/LayerNorm")

    m = "extended_attention_mask"
    mask = g.op("Unsqueeze", [g.op("Unsqueeze", ["attention_mask", g.const([1], np.int64, m)], m),
                              g.const([2], np.int64, m)], m)
    mask = g.op("Cast", [mask], m, to=TensorProto.FLOAT)
    inverted = g.op("Sub", [g.const(1.0, np.float32, m), mask], m)
    if mask_fill == "where":
        mask_add = g.op("Where", [g.op("Cast", [inverted], m, to=TensorProto.BOOL),
                                  g.const(FLOAT32_MIN, np.float32, m), inverted], m)
    else:
        mask_add = g.op("Mul", [inverted, g.const(FLOAT32_MIN, np.float32, m)], m)

    for i in range(TC_LAYERS):
        x = _bert_layer(g, x, mask_add, f"encoder/layer.{i}")

    p = "pooler"
    first = g.op("Gather", [x, g.const(0, np.int64, p)], p, axis=1)
    pooled = g.op("Tanh", [_torch_linear(g, first, hidden, hidden, f"{p}/dense")], p)
    logits = _torch_linear(g, pooled, hidden, TC_CLASSES, "classifier")
    g.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="output/Identity"))
    return _finish(
        g, "transformer_classifier",
        [_vi("input_ids", TensorProto.INT64, [BATCH, TC_SEQ]),
         _vi("attention_mask", TensorProto.INT64, [BATCH, TC_SEQ])],
        [_vi("logits", TensorProto.FLOAT, [BATCH, TC_CLASSES])],
        f"{TC_LAYERS}-layer BERT-style encoder classifier as torch.onnx.export (opset 17) writes it",
    )


def classifier_task(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Data for :func:`transformer_classifier`: does the unpadded part hold token ``TC_KEY``?

    Each row is ``[CLS] tokens... [PAD]...`` with a random length; half the rows
    hold the key token somewhere in their text.  The padding is filled with the
    key token too, so only a model that honours the attention mask can learn it.
    """
    rng = np.random.default_rng(seed)
    ids = rng.integers(TC_KEY + 1, TC_VOCAB, size=(rows, TC_SEQ), dtype=np.int64)
    mask = np.zeros((rows, TC_SEQ), np.int64)
    labels = rng.integers(0, 2, size=rows, dtype=np.int64)
    lengths = rng.integers(4, TC_SEQ + 1, size=rows)
    for r in range(rows):
        length = int(lengths[r])
        mask[r, :length] = 1
        ids[r, 0] = TC_CLS
        ids[r, length:] = TC_KEY
        if labels[r]:
            ids[r, rng.integers(1, length)] = TC_KEY
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ---------------------------------------------------------------------------
# Recurrent
# ---------------------------------------------------------------------------

RNN_T, RNN_IN, RNN_H = 8, 32, 64


def _rnn(kind: str) -> onnx.ModelProto:
    gates = {"GRU": 3, "LSTM": 4}[kind]
    g = _Graph(np.random.default_rng(4004 if kind == "GRU" else 5005))
    # torch.nn.GRU/LSTM init: U(-1/sqrt(H), 1/sqrt(H)) for every tensor.
    bound = 1.0 / math.sqrt(RNN_H)

    def u(shape):
        return g.rng.uniform(-bound, bound, shape).astype(np.float32)

    w = g.init("rnn.W", u((1, gates * RNN_H, RNN_IN)))
    r = g.init("rnn.R", u((1, gates * RNN_H, RNN_H)))
    b = g.init("rnn.B", u((1, 2 * gates * RNN_H)))
    attrs = dict(hidden_size=RNN_H, direction="forward")
    if kind == "GRU":
        attrs["linear_before_reset"] = 1  # what torch exports
    outs = g.op(kind, ["x", w, r, b], "rnn", n_out=2 if kind == "GRU" else 3, **attrs)
    y_h = outs[1]  # [1, N, H]
    h = g.op("Squeeze", [y_h, g.const([0], np.int64, "head")], "head")
    wh = g.xavier("head.weight", (RNN_H, 10), RNN_H, 10)
    bh = g.bias("head.bias", 10)
    h = g.op("MatMul", [h, wh], "head")
    g.nodes.append(helper.make_node("Add", [h, bh], ["logits"], name="head/Add"))
    return _finish(
        g,
        kind.lower(),
        [_vi("x", TensorProto.FLOAT, [RNN_T, BATCH, RNN_IN])],
        [_vi("logits", TensorProto.FLOAT, [BATCH, 10])],
        f"ONNX {kind} (seq-major, hidden {RNN_H}) + linear head on the last hidden state",
    )


def gru() -> onnx.ModelProto:
    """x[T=8,N,32] -> GRU(hidden 64) -> Y_h -> Squeeze -> MatMul+Add -> logits[N,10]."""
    return _rnn("GRU")


def lstm() -> onnx.ModelProto:
    """x[T=8,N,32] -> LSTM(hidden 64) -> Y_h -> Squeeze -> MatMul+Add -> logits[N,10]."""
    return _rnn("LSTM")


# ---------------------------------------------------------------------------
# Control flow
# ---------------------------------------------------------------------------

LOOP_TRIPS = 3
LOOP_D = 32


def loop_if() -> onnx.ModelProto:
    """If (MatMul+Relu vs. Exp-normalize) on sign of sum(x), then a 3-trip Loop, then Gemm.

    Both subgraphs read outer-scope initializers (then.weight, loop.weight,
    loop.bias) and the else-branch has a branch-local Constant, so a pass has to
    resolve names across scopes.
    """
    g = _Graph(np.random.default_rng(6006))
    d = LOOP_D
    w_then = g.he("then.weight", (d, d), d)
    w_loop = g.xavier("loop.weight", (d, d), d, d)
    b_loop = g.bias("loop.bias", d)
    w_head = g.xavier("head.weight", (10, d), d, 10)
    b_head = g.bias("head.bias", 10)
    trips = g.init("loop.trip_count", np.array(LOOP_TRIPS, dtype=np.int64))
    cond0 = g.init("loop.cond", np.array(True))

    s = g.op("ReduceSum", ["x"], "select", keepdims=0)
    cond = g.op("Greater", [s, g.const(0.0, np.float32, "select")], "select")

    then_g = _Graph(g.rng)
    t = then_g.op("MatMul", ["x", w_then], "then")
    then_g.nodes.append(helper.make_node("Relu", [t], ["then_out"], name="then/Relu"))
    then_body = helper.make_graph(
        then_g.nodes, "then_branch", [], [_vi("then_out", TensorProto.FLOAT, [BATCH, d])]
    )

    # Exp / ReduceSum / Div: a hand-written softmax, the kind of reduction a
    # precision pass should keep in fp32.
    else_g = _Graph(g.rng)
    e = else_g.op("Exp", ["x"], "else")
    z = else_g.op("ReduceSum", [e, else_g.const([1], np.int64, "else")], "else", keepdims=1)
    else_g.nodes.append(helper.make_node("Div", [e, z], ["else_out"], name="else/Div"))
    else_body = helper.make_graph(
        else_g.nodes, "else_branch", [], [_vi("else_out", TensorProto.FLOAT, [BATCH, d])]
    )
    h = g.op("If", [cond], "branch", then_branch=then_body, else_branch=else_body)

    body_g = _Graph(g.rng)
    m = body_g.op("MatMul", ["v_in", w_loop], "body")
    m = body_g.op("Add", [m, b_loop], "body")
    m = body_g.op("Tanh", [m], "body")
    body_g.nodes.append(helper.make_node("Add", ["v_in", m], ["v_out"], name="body/residual"))
    body_g.nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body/cond"))
    body = helper.make_graph(
        body_g.nodes,
        "loop_body",
        [
            _vi("iter", TensorProto.INT64, []),
            _vi("cond_in", TensorProto.BOOL, []),
            _vi("v_in", TensorProto.FLOAT, [BATCH, d]),
        ],
        [
            _vi("cond_out", TensorProto.BOOL, []),
            _vi("v_out", TensorProto.FLOAT, [BATCH, d]),
        ],
    )
    v = g.op("Loop", [trips, cond0, h], "loop", body=body)
    g.nodes.append(helper.make_node("Gemm", [v, w_head, b_head], ["logits"], name="head/Gemm", transB=1))
    return _finish(
        g,
        "loop_if",
        [_vi("x", TensorProto.FLOAT, [BATCH, d])],
        [_vi("logits", TensorProto.FLOAT, [BATCH, 10])],
        "If + Loop control flow with outer-scope weights",
    )


# ---------------------------------------------------------------------------
# Sample inputs
# ---------------------------------------------------------------------------

# ---------------------------------------------------------------------------
# Decoder with a KV cache
# ---------------------------------------------------------------------------

KV_LAYERS, KV_HEADS, KV_DH, KV_VOCAB, KV_PAST, KV_NEW = 2, 2, 8, 32, 3, 1
KV_HIDDEN = KV_HEADS * KV_DH


def kv_decoder() -> onnx.ModelProto:
    """GPT-style decoder step as optimum exports one: input_ids[N,S] int64 and, per layer,
    past_key_values.{i}.key/value[N,h,P,d] -> logits[N,S,V] and present.{i}.key/value[N,h,P+S,d].

    Pre-LN layers (LayerNormalization op, q/k/v/out/FFN as MatMul+Add, Relu FFN); the new keys
    and values are Concat'ed onto the past ones on the sequence axis; tied embeddings (the LM
    head reads the transposed word embedding).  The cache is what a decoder wants in fp16.
    """
    g = _Graph(np.random.default_rng(4004))
    h, heads, dh = KV_HIDDEN, KV_HEADS, KV_DH
    wte = g.init("wte", (g.rng.standard_normal((KV_VOCAB, h)) * 0.5).astype(np.float32))
    split = g.init("shape_heads", np.array([0, 0, heads, dh], np.int64))
    merge = g.init("shape_merge", np.array([0, 0, h], np.int64))
    scale = g.init("attn_scale", np.array(math.sqrt(dh), np.float32))
    x = g.op("Gather", [wte, "input_ids"], "embed")
    inputs = [_vi("input_ids", TensorProto.INT64, [BATCH, "S"])]
    outputs = [_vi("logits", TensorProto.FLOAT, [BATCH, "S", KV_VOCAB])]

    def norm(src: str, scope: str) -> str:
        gamma = g.init(f"{scope}.weight", np.ones(h, np.float32))
        beta = g.init(f"{scope}.bias", np.zeros(h, np.float32))
        return g.op("LayerNormalization", [src, gamma, beta], scope, axis=-1, epsilon=1e-5)

    def linear(src: str, n_in: int, n_out: int, scope: str) -> str:
        w = g.xavier(f"{scope}.weight", (n_in, n_out), n_in, n_out)
        return g.op("Add", [g.op("MatMul", [src, w], scope), g.bias(f"{scope}.bias", n_out)], scope)

    for i in range(KV_LAYERS):
        p = f"layer{i}"
        a = norm(x, f"{p}/ln1")
        q, k, v = (g.op("Transpose", [g.op("Reshape", [linear(a, h, h, f"{p}/{n}"), split], f"{p}/{n}")],
                        f"{p}/{n}", perm=[0, 2, 1, 3]) for n in ("q", "k", "v"))
        cache = [BATCH, heads, "P", dh]
        grown = [BATCH, heads, "T", dh]
        for kind, new in (("key", k), ("value", v)):
            inputs.append(_vi(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, cache))
            outputs.append(_vi(f"present.{i}.{kind}", TensorProto.FLOAT, grown))
            g.nodes.append(helper.make_node("Concat", [f"past_key_values.{i}.{kind}", new], [f"present.{i}.{kind}"],
                                            name=f"{p}/{kind}/Concat", axis=2))
        kt = g.op("Transpose", [f"present.{i}.key"], f"{p}/kT", perm=[0, 1, 3, 2])
        scores = g.op("Div", [g.op("MatMul", [q, kt], f"{p}/scores"), scale], f"{p}/scores")
        ctx = g.op("MatMul", [g.op("Softmax", [scores], f"{p}/attn", axis=-1), f"present.{i}.value"], f"{p}/ctx")
        ctx = g.op("Reshape", [g.op("Transpose", [ctx], f"{p}/ctx", perm=[0, 2, 1, 3]), merge], f"{p}/ctx")
        x = g.op("Add", [x, linear(ctx, h, h, f"{p}/out")], f"{p}/residual1")
        f = linear(g.op("Relu", [linear(norm(x, f"{p}/ln2"), h, 4 * h, f"{p}/fc1")], f"{p}/act"), 4 * h, h,
                   f"{p}/fc2")
        x = g.op("Add", [x, f], f"{p}/residual2")
    head = g.op("Transpose", [wte], "lm_head", perm=[1, 0])
    g.nodes.append(helper.make_node("MatMul", [norm(x, "ln_f"), head], ["logits"], name="lm_head/MatMul"))
    return _finish(g, "kv_decoder", inputs, outputs,
                   f"{KV_LAYERS}-layer decoder step with a KV cache, hidden={h}, heads={heads}, vocab={KV_VOCAB}")


BUILDERS = {
    "mlp": mlp,
    "cnn_bn": cnn_bn,
    "cnn_bn_bigvar": cnn_bn_bigvar,
    "transformer_block": transformer_block,
    "gru": gru,
    "lstm": lstm,
    "loop_if": loop_if,
    "transformer_classifier": transformer_classifier,
    "kv_decoder": kv_decoder,
}


def build(name: str) -> onnx.ModelProto:
    return BUILDERS[name]()


def padded_mask(batch: int, seq: int) -> np.ndarray:
    # Row 0 unpadded, later rows lose a growing tail, like a right-padded batch.
    mask = np.ones((batch, seq), dtype=np.float32)
    for i in range(1, batch):
        keep = max(1, seq - (seq * i) // (batch + 1) - 3)
        mask[i, keep:] = 0.0
    return mask


def inputs_for(name: str, batch: int = 2, *, seq: int = 16, hidden: int = 64) -> dict[str, np.ndarray]:
    """Deterministic sample feeds. ``seq``/``hidden`` only apply to transformer_stack."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    f32 = np.float32
    if name == "mlp":
        return {"x": rng.standard_normal((batch, 64)).astype(f32)}
    if name in ("cnn_bn", "cnn_bn_bigvar"):
        # Same images for both, so their outputs can be compared directly.
        rng = np.random.default_rng(77)
        return {"x": rng.standard_normal((batch, 3, 32, 32)).astype(f32)}
    if name == "transformer_block":
        seq, hidden = 16, 64
    if name in ("transformer_block", "transformer_stack"):
        return {
            "x": rng.standard_normal((batch, seq, hidden)).astype(f32),
            "mask": padded_mask(batch, seq),
        }
    if name == "transformer_classifier":
        task = classifier_task(batch, seed=1)
        return {"input_ids": task["input_ids"], "attention_mask": task["attention_mask"]}
    if name in ("gru", "lstm"):
        return {"x": rng.standard_normal((RNN_T, batch, RNN_IN)).astype(f32)}
    if name == "loop_if":
        x = rng.standard_normal((batch, LOOP_D)).astype(f32)
        # Pin the branch: sum > 0 takes then_branch. Flip the sign for else.
        x += f32(0.5)
        return {"x": x}
    if name == "kv_decoder":
        feeds = {"input_ids": rng.integers(0, KV_VOCAB, (batch, KV_NEW)).astype(np.int64)}
        for i in range(KV_LAYERS):
            for kind in ("key", "value"):
                feeds[f"past_key_values.{i}.{kind}"] = rng.standard_normal((batch, KV_HEADS, KV_PAST, KV_DH)).astype(f32)
        return feeds
    raise KeyError(f"no sample inputs for model {name!r}")
