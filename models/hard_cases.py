"""Models whose plain fp16 conversion misses 1e-2, each reproducing a failure seen on real models.

Built with onnx.helper the way exporters write them (weights as initializers and
Constant nodes, BatchNormalization and HardSwish kept as ops), deterministic from
fixed seeds.  Used by tests/test_calibrate_hard.py and scripts/bench_calibrate.py.

* ``amplified_cancellation``: two MatMuls computing nearly equal values are
  subtracted (error created early), then a large gain and a MatMul stack carry
  it to the output (amplified late).
* ``underflow_log``: an in-graph spectrogram of quiet audio (basis MatMuls whose
  outputs are ~1e-6, subnormal or flushed in fp16), then Sqrt and Log in fp32
  and a MatMul stack; fp16 turns the small magnitudes into Log(eps).
* ``correlated_rounding``: two identical MatMuls subtracted (zero in fp32 and
  fp16 alike: their rounding cancels), next to a real culprit; returning just
  one of the pair to fp32 makes the output worse, so greedy blame that picks
  nodes one at a time goes the wrong way.
* ``transformer_cancellation``: the 1,014-node 15-layer transformer with a
  hidden ``(h + 2000) - 2000`` in layer 7's feed-forward block.
* ``db_head``: a Conv/BatchNormalization/HardSwish backbone, a ConvTranspose
  neck, and DB's probability, threshold and differentiable-binarization maps
  ``1 / (1 + exp(-50 (P - T)))``: the gain of 50 amplifies fp16 rounding.
* ``picodet_layout``: a PicoDet-shaped layout detector as Paddle2ONNX writes it
  (every weight a Constant node, depthwise/pointwise Conv + BatchNormalization +
  HardSwish, Resize neck, GFL head with Softmax over bins and a distance-to-bbox
  decode, batched-NMS box areas); a pointwise Conv's bias Add of ~1000 that the
  norm takes back off is the damage, and its minimal fp32 island
  (``PICODET_ISLAND``) is known by construction.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models.zoo import inputs_for, padded_mask, transformer_stack

OPSET = 17
IR_VERSION = 8
FLOAT = TensorProto.FLOAT


class _B:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def init(self, name: str, array) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32), name))
        return name

    def const(self, name: str, value) -> str:
        """A Constant node, as torch and Paddle2ONNX export scalars."""
        arr = np.asarray(value, dtype=np.float32)
        self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                           value=numpy_helper.from_array(arr, name)))
        return name

    def op(self, op: str, inputs: list[str], name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def linear(self, x: str, fan_in: int, fan_out: int, name: str, scale: float = 1.0) -> str:
        w = self.init(f"{name}.w", self.rng.standard_normal((fan_in, fan_out)) * scale / np.sqrt(fan_in))
        return self.op("MatMul", [x, w], name)

    def model(self, name: str, inputs, outputs) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="onnxmp.models.hard_cases")
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model, full_check=True)
        return model


def _mlp_stack(b: _B, x: str, width: int, layers: int, prefix: str) -> str:
    for i in range(layers):
        x = b.op("Relu", [b.linear(x, width, width, f"{prefix}{i}/MatMul", scale=1.4)], f"{prefix}{i}/Relu")
    return x


def amplified_cancellation(width: int = 32, layers: int = 10) -> onnx.ModelProto:
    b = _B(10)
    h = b.op("Relu", [b.linear("x", width, width, "embed/MatMul")], "embed/Relu")
    w = b.rng.standard_normal((width, width)) / np.sqrt(width)
    t = b.op("MatMul", [h, b.init("near_a.w", w)], "near_a/MatMul")
    u = b.op("MatMul", [h, b.init("near_b.w", w + 2e-3 * b.rng.standard_normal(w.shape))], "near_b/MatMul")
    d = b.op("Sub", [t, u], "diff/Sub")
    g = b.op("Mul", [d, b.const("gain", 300.0)], "gain/Mul")
    y = _mlp_stack(b, g, width, layers, "head")
    b.op("MatMul", [y, b.init("out.w", b.rng.standard_normal((width, 8)) / np.sqrt(width))], "y")
    return b.model("amplified_cancellation", [helper.make_tensor_value_info("x", FLOAT, ["N", width])],
                   [helper.make_tensor_value_info("y", FLOAT, ["N", 8])])


def underflow_log(frame: int = 64, bins: int = 32, layers: int = 10) -> onnx.ModelProto:
    b = _B(11)
    k = np.arange(frame)[:, None] * np.arange(1, bins + 1)[None, :] * (2 * np.pi / frame)
    window = np.hanning(frame)[:, None]
    re = b.op("MatMul", ["audio", b.init("basis_re", np.cos(k) * window / frame)], "cqt/real/MatMul")
    im = b.op("MatMul", ["audio", b.init("basis_im", np.sin(k) * window / frame)], "cqt/imag/MatMul")
    power = b.op("Add", [b.op("Mul", [re, re], "cqt/re2"), b.op("Mul", [im, im], "cqt/im2")], "cqt/power")
    mag = b.op("Sqrt", [power], "cqt/Sqrt")
    log = b.op("Log", [b.op("Add", [mag, b.const("eps", 1e-12)], "cqt/eps")], "cqt/Log")
    norm = b.op("Div", [b.op("Add", [log, b.const("shift", 20.0)], "norm/shift"), b.const("span", 10.0)],
                "norm/Div")
    h = b.op("Relu", [b.linear(norm, bins, 48, "stack_in/MatMul")], "stack_in/Relu")
    y = _mlp_stack(b, h, 48, layers, "stack")
    b.op("MatMul", [y, b.init("out.w", b.rng.standard_normal((48, 16)) / np.sqrt(48))], "notes")
    return b.model("underflow_log", [helper.make_tensor_value_info("audio", FLOAT, ["N", frame])],
                   [helper.make_tensor_value_info("notes", FLOAT, ["N", 16])])


def correlated_rounding(width: int = 32, layers: int = 10) -> onnx.ModelProto:
    b = _B(12)
    h = b.op("Relu", [b.linear("x", width, width, "embed/MatMul")], "embed/Relu")
    w = b.init("twin.w", b.rng.standard_normal((width, width)) / np.sqrt(width))
    offset = b.const("offset", 1000.0)
    # Twin branches, each MatMul + a large bias; their difference is 0 in fp32 and in fp16 alike
    # (identical rounding), and is multiplied by 1000.
    t = b.op("Add", [b.op("MatMul", [h, w], "twin_a/MatMul"), offset], "twin_a/Add")
    u = b.op("Add", [b.op("MatMul", [h, w], "twin_b/MatMul"), offset], "twin_b/Add")
    twin = b.op("Mul", [b.op("Sub", [t, u], "twin/Sub"), b.const("twin_gain", 1000.0)], "twin/Mul")
    # The real damage: one twin, centred again, loses its fraction to fp16 rounding at |x| ~ 1000.
    # Blame that follows local error returns twin_a alone to fp32 and breaks the twins' cancellation.
    centred = b.op("Sub", [t, b.const("offset2", 1000.0)], "centre/Sub")
    # twin_b also feeds a MatMul, so it stays between allow ops when twin_a's consumers turn fp32.
    side = b.linear(u, width, width, "side/MatMul", scale=1e-3)
    mixed = b.op("Add", [b.op("Add", [b.op("Add", [h, centred], "mix/Add"), twin], "mix/Add2"), side], "mix/Add3")
    y = _mlp_stack(b, mixed, width, layers, "head")
    b.op("MatMul", [y, b.init("out.w", b.rng.standard_normal((width, 8)) / np.sqrt(width))], "y")
    return b.model("correlated_rounding", [helper.make_tensor_value_info("x", FLOAT, ["N", width])],
                   [helper.make_tensor_value_info("y", FLOAT, ["N", 8])])


def transformer_cancellation(layers: int = 15) -> onnx.ModelProto:
    model = transformer_stack(layers)
    g = model.graph
    idx, node = next((i, n) for i, n in enumerate(g.node) if n.name == f"layer{layers // 2}/ffn/fc1/MatMul")
    out = node.output[0]
    node.output[0] = out + "_pre"
    g.initializer.append(numpy_helper.from_array(np.array(2000.0, np.float32), "big_c"))
    g.node.insert(idx + 1, helper.make_node("Add", [out + "_pre", "big_c"], [out + "_up"], name="inj_add"))
    g.node.insert(idx + 2, helper.make_node("Sub", [out + "_up", "big_c"], [out], name="inj_sub"))
    return model


def _conv(b: _B, x: str, cin: int, cout: int, name: str, k: int = 3, stride: int = 1, act: str | None = "HardSwish",
          transpose: bool = False, bn: bool = True, gain: float = 1.0, offset: float = 0.0) -> str:
    shape = (cin, cout, 2, 2) if transpose else (cout, cin, k, k)
    w = b.init(f"{name}.w", gain * b.rng.standard_normal(shape) * np.sqrt(2.0 / (cin * (4 if transpose else k * k))))
    if transpose:
        inputs = [x, w, b.init(f"{name}.b", np.full(cout, offset))] if offset else [x, w]
        y = b.op("ConvTranspose", inputs, f"{name}/ConvTranspose", strides=[2, 2])
    else:
        y = b.op("Conv", [x, w], f"{name}/Conv", pads=[k // 2] * 4, strides=[stride, stride])
    if bn:
        scale = b.init(f"{name}.bn.scale", 1.0 + 0.1 * b.rng.standard_normal(cout))
        bias = b.init(f"{name}.bn.bias", 0.1 * b.rng.standard_normal(cout))
        mean = b.init(f"{name}.bn.mean", offset + 0.1 * b.rng.standard_normal(cout))
        var = b.init(f"{name}.bn.var", 1.0 + 0.2 * b.rng.random(cout))
        y = b.op("BatchNormalization", [y, scale, bias, mean, var], f"{name}/BatchNormalization", epsilon=1e-5)
    return b.op(act, [y], f"{name}/{act}") if act else y


def db_head(k: float = 50.0, logit_gain: float = 1.0) -> onnx.ModelProto:
    b = _B(13)
    x = _conv(b, "image", 3, 16, "stem", stride=2)
    stages = [(16, 16, 1), (16, 32, 2), *[(32, 32, 1)] * 4, (32, 48, 1), *[(48, 48, 1)] * 5]
    for i, (cin, cout, stride) in enumerate(stages):
        x = _conv(b, x, cin, cout, f"backbone{i}", stride=stride)
    neck = _conv(b, x, 48, 32, "neck", k=1)

    def branch(tag: str, seed: int) -> str:
        # DB's threshold head mirrors the probability head and is trained towards similar maps, so
        # P - T subtracts nearly equal values: the same initial weights, perturbed by 5%.
        b.rng, saved = np.random.default_rng(seed), b.rng
        h = _conv(b, neck, 32, 16, f"{tag}/conv", act="Relu")
        # A large bias that BatchNormalization's running mean takes back off: fp16 rounds the
        # ConvTranspose output at |x| ~ 40, so the centred activations keep an absolute error of ~0.02.
        h = _conv(b, h, 16, 16, f"{tag}/up1", transpose=True, act="Relu", offset=40.0)
        h = _conv(b, h, 16, 1, f"{tag}/up2", transpose=True, act=None, bn=False, gain=logit_gain)
        b.rng = saved
        return b.op("Sigmoid", [h], f"{tag}/Sigmoid")

    p, t = branch("prob", 99), branch("thresh", 99)
    for init in b.inits:  # perturb the threshold head
        if init.name.startswith("thresh/"):
            values = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array(
                (values * (1 + 0.05 * b.rng.standard_normal(values.shape))).astype(np.float32), init.name))
    gain = b.op("Mul", [b.op("Sub", [p, t], "db/Sub"), b.const("db/k", -k)], "db/Mul")
    binary = b.op("Reciprocal", [b.op("Add", [b.op("Exp", [gain], "db/Exp"), b.const("db/one", 1.0)], "db/Add")],
                  "db/Reciprocal")
    b.op("Concat", [p, t, binary], "maps", axis=1)
    return b.model("db_head", [helper.make_tensor_value_info("image", FLOAT, ["N", 3, 32, 32])],
                   [helper.make_tensor_value_info("maps", FLOAT, ["N", 3, 32, 32])])


def _const_weight(b: _B, name: str, array) -> str:
    """A weight as a Constant node, as Paddle2ONNX writes PicoDet's."""
    return b.const(name, array)


def _dw_pw(b: _B, x: str, cin: int, cout: int, name: str, stride: int = 1, offset: float = 0.0) -> str:
    """ESNet/ShuffleNet-style depthwise 3x3 + pointwise 1x1, each Conv + BatchNormalization + HardSwish, the
    weights as Constant nodes.  ``offset``: the pointwise Conv's bias, exported as Paddle2ONNX does (a
    separate Add of a [1, C, 1, 1] Constant), is about ``offset`` and the BatchNormalization's running mean
    takes it back off."""
    for part, (ci, co, k, group, s) in (("dw", (cin, cin, 3, cin, stride)), ("pw", (cin, cout, 1, 1, 1))):
        w = _const_weight(b, f"{name}/{part}.w", b.rng.standard_normal((co, ci // group, k, k))
                          * np.sqrt(2.0 / (ci // group * k * k)))
        y = b.op("Conv", [x, w], f"{name}/{part}/Conv", pads=[k // 2] * 4, strides=[s, s], group=group)
        shift = np.zeros(co)
        if part == "pw" and offset:
            shift = offset * (1.0 + 0.1 * b.rng.random(co))
            y = b.op("Add", [y, _const_weight(b, f"{name}/{part}.b", shift.reshape(1, co, 1, 1))],
                     f"{name}/{part}/Add")
        bn = [_const_weight(b, f"{name}/{part}.bn.{key}", v) for key, v in (
            ("scale", 1.0 + 0.1 * b.rng.standard_normal(co)), ("bias", 0.1 * b.rng.standard_normal(co)),
            ("mean", shift + 0.1 * b.rng.standard_normal(co)), ("var", 1.0 + 0.2 * b.rng.random(co)))]
        y = b.op("BatchNormalization", [y, *bn], f"{name}/{part}/BatchNormalization", epsilon=1e-5)
        x = b.op("HardSwish", [y], f"{name}/{part}/HardSwish")
    return x


PICODET_CLASSES = 8
PICODET_BINS = 8
PICODET_SIZE = 64
PICODET_BIAS = 1000.0
PICODET_ORIGINAL = 400.0  # the page the 64 x 64 input was resized from
# The minimal float32 island, by construction: the bias Add whose output sits at |x| ~ 1000 and the
# BatchNormalization that reads it (its input is rounded when it runs in float16), and the two Constant
# nodes holding the bias and the running mean (~1000: rounded by 0.5 in float16); the Conv stays float16.
PICODET_ISLAND = frozenset({"neck/lat3/pw/Add", "neck/lat3/pw/BatchNormalization", "neck/lat3/pw.b",
                            "neck/lat3/pw.bn.mean"})


def picodet_layout(size: int = PICODET_SIZE) -> onnx.ModelProto:
    """A PicoDet-shaped layout detector as Paddle2ONNX exports it.

    Depthwise/pointwise Conv + BatchNormalization + HardSwish backbone with every
    weight a Constant node; an FPN neck whose coarse level is upsampled by Resize
    (scales from a Constant); per level a GFL head: class logits through Sigmoid,
    and 4 x ``PICODET_BINS`` distance logits through Softmax over the bins and a
    MatMul with the bin indices (the expected distance), times the stride, decoded
    distance-to-bbox around the anchor centres and scaled back to the original
    page (400 px); the NMS-ish tail does what batched NMS does: a copy of the
    boxes per class, shifted by ``class * (page + 1)`` so classes never overlap,
    and the box areas IoU needs from those corners (float32 after plain
    conversion: it leads to outputs through no low-precision op).  The damage:
    the fine level's lateral pointwise Conv has its bias as a separate Add of
    ~``PICODET_BIAS`` that the BatchNormalization's running mean takes back off,
    so float16 rounds those activations with a spacing of 0.5 before centring.
    The minimal float32 island is :data:`PICODET_ISLAND`: the Conv stays float16.
    """
    b = _B(14)
    x = _dw_pw(b, "image", 3, 16, "stem", stride=2)             # 32 x 32
    widths = [(16, 24, 2), (24, 24, 1), (24, 32, 2), (32, 32, 1), (32, 48, 2), (48, 48, 1), (48, 48, 1)]
    feats = []
    for i, (cin, cout, stride) in enumerate(widths):
        x = _dw_pw(b, x, cin, cout, f"backbone{i}", stride=stride)
        if i in (3, 6):
            feats.append((x, cout))                                # 8 x 8 (stride 8), 4 x 4 (stride 16)
    (c3, n3), (c4, n4) = feats
    lat4 = _dw_pw(b, c4, n4, 32, "neck/lat4")
    up = b.op("Resize", [lat4, "", b.const("neck/up.scales", [1.0, 1.0, 2.0, 2.0])], "neck/Resize",
              mode="nearest")
    p3 = b.op("Add", [_dw_pw(b, c3, n3, 32, "neck/lat3", offset=PICODET_BIAS), up], "neck/Add")
    levels = [(p3, 8, size // 8), (lat4, 16, size // 16)]
    scale = PICODET_ORIGINAL / size
    project = _const_weight(b, "head/project", np.arange(PICODET_BINS, dtype=np.float32)[:, None])
    boxes, scores = [], []
    for level, (feat, stride, side) in enumerate(levels):
        hw = side * side
        h = _dw_pw(b, feat, 32, 32, f"head{level}/conv")
        cls_w = _const_weight(b, f"head{level}/cls.w", 0.1 * b.rng.standard_normal((PICODET_CLASSES, 32, 1, 1)))
        cls = b.op("Conv", [h, cls_w, _const_weight(b, f"head{level}/cls.b", np.full(PICODET_CLASSES, -2.0))],
                   f"head{level}/cls/Conv")
        shape = helper.make_tensor(f"head{level}/cls.shape", TensorProto.INT64, [3], [0, PICODET_CLASSES, hw])
        b.nodes.append(helper.make_node("Constant", [], [f"head{level}/cls.shape"], name=f"head{level}/cls.shape",
                                        value=shape))
        sig = b.op("Sigmoid", [cls], f"head{level}/Sigmoid")
        flat = b.op("Reshape", [sig, f"head{level}/cls.shape"], f"head{level}/cls/Reshape")
        scores.append(b.op("Transpose", [flat], f"head{level}/cls/Transpose", perm=[0, 2, 1]))
        reg_w = _const_weight(b, f"head{level}/reg.w", 0.3 * b.rng.standard_normal((4 * PICODET_BINS, 32, 1, 1)))
        # Trained GFL heads put most mass on the first bins (boxes a few strides wide).
        reg_b = _const_weight(b, f"head{level}/reg.b", np.tile(-1.0 * np.arange(PICODET_BINS), 4))
        reg = b.op("Conv", [h, reg_w, reg_b], f"head{level}/reg/Conv")
        rshape = helper.make_tensor(f"head{level}/reg.shape", TensorProto.INT64, [4], [0, 4, PICODET_BINS, hw])
        b.nodes.append(helper.make_node("Constant", [], [f"head{level}/reg.shape"], name=f"head{level}/reg.shape",
                                        value=rshape))
        reg = b.op("Reshape", [reg, f"head{level}/reg.shape"], f"head{level}/reg/Reshape")
        reg = b.op("Transpose", [reg], f"head{level}/reg/Transpose", perm=[0, 3, 1, 2])   # N, HW, 4, bins
        prob = b.op("Softmax", [reg], f"head{level}/Softmax", axis=-1)
        dist = b.op("MatMul", [prob, project], f"head{level}/project/MatMul")            # N, HW, 4, 1
        dshape = helper.make_tensor(f"head{level}/dist.shape", TensorProto.INT64, [3], [0, hw, 4])
        b.nodes.append(helper.make_node("Constant", [], [f"head{level}/dist.shape"],
                                        name=f"head{level}/dist.shape", value=dshape))
        dist = b.op("Reshape", [dist, f"head{level}/dist.shape"], f"head{level}/dist/Reshape")
        dist = b.op("Mul", [dist, b.const(f"head{level}/stride", float(stride))], f"head{level}/stride/Mul")
        ys, xs = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
        centres = (np.stack([xs, ys], -1).reshape(hw, 2) + 0.5) * stride
        # distance-to-bbox: (cx - l, cy - t, cx + r, cy + b), one signed Mul-Add as exporters fold it
        signs = b.const(f"head{level}/signs", [-1.0, -1.0, 1.0, 1.0])
        anchor = b.const(f"head{level}/centres", np.concatenate([centres, centres], -1))
        box = b.op("Add", [anchor, b.op("Mul", [dist, signs], f"head{level}/decode/Mul")], f"head{level}/decode/Add")
        boxes.append(box)
    box = b.op("Concat", boxes, "boxes/Concat", axis=1)
    box = b.op("Mul", [box, b.const("scale_factor", scale)], "boxes")
    b.op("Concat", scores, "scores", axis=1)
    # Batched NMS's trick: a copy of the boxes per class, shifted by class * (page + 1).
    offsets = b.const("nms/offsets", (np.arange(PICODET_CLASSES) * (PICODET_ORIGINAL + 1))[None, :, None, None])
    b.inits.append(numpy_helper.from_array(np.array([1], np.int64), "nms/axis"))
    shifted = b.op("Add", [b.op("Unsqueeze", [box, "nms/axis"], "nms/Unsqueeze"), offsets],
                   "nms/Add")
    x1, y1, x2, y2 = (f"nms/{c}" for c in ("x1", "y1", "x2", "y2"))
    b.nodes.append(helper.make_node("Split", [shifted], [x1, y1, x2, y2], name="nms/Split", axis=-1))
    w = b.op("Sub", [x2, x1], "nms/w/Sub")
    h = b.op("Sub", [y2, y1], "nms/h/Sub")
    b.op("Mul", [w, h], "areas")
    total = sum(s * s for _, _, s in levels)
    return b.model("picodet_layout", [helper.make_tensor_value_info("image", FLOAT, ["N", 3, size,
                                                                                     size])],
                   [helper.make_tensor_value_info("boxes", FLOAT, ["N", total, 4]),
                    helper.make_tensor_value_info("scores", FLOAT, ["N", total, PICODET_CLASSES]),
                    helper.make_tensor_value_info("areas", FLOAT, ["N", PICODET_CLASSES, total, 1])])


SPREAD_BLOCKS = 12


def spread_offsets(offset: float = 48.0) -> onnx.ModelProto:
    """A Paddle-exported depthwise/pointwise Conv stack where EVERY pointwise Conv's bias is a separate
    Add of ~``offset`` that the next BatchNormalization's running mean takes back off: each block's
    rounding alone stays under the tolerance, their sum does not.  The error is spread over
    ``SPREAD_BLOCKS`` islands of cheap ops (bias Add + BatchNormalization); no Conv needs fp32, so the
    best achievable Conv share is 100% by construction, and a search that takes a ranking's passing
    prefix gives Convs away for nothing."""
    b = _B(15)
    x = _dw_pw(b, "image", 3, 16, "stem", stride=2)
    for i in range(SPREAD_BLOCKS):
        x = _dw_pw(b, x, 16, 16, f"block{i}", offset=offset)
    pooled = b.op("GlobalAveragePool", [x], "head/GlobalAveragePool")
    w = _const_weight(b, "head.w", b.rng.standard_normal((8, 16, 1, 1)) * 0.5)
    b.op("Flatten", [b.op("Conv", [pooled, w], "head/Conv")], "logits")
    return b.model("spread_offsets", [helper.make_tensor_value_info("image", FLOAT, ["N", 3, 16, 16])],
                   [helper.make_tensor_value_info("logits", FLOAT, ["N", 8])])


BUILDERS = {
    "amplified_cancellation": amplified_cancellation,
    "underflow_log": underflow_log,
    "correlated_rounding": correlated_rounding,
    "transformer_cancellation": transformer_cancellation,
    "db_head": db_head,
    "picodet_layout": picodet_layout,
    "spread_offsets": spread_offsets,
}


def samples(name: str, count: int = 4, batch: int = 2) -> list[dict[str, np.ndarray]]:
    """``count`` deterministic samples (the last ones serve as held-out samples).

    Also for the bundled models of :mod:`models.zoo`: their sample, then copies
    with 10% noise on the float inputs (masks and integer inputs kept).
    """
    rng = np.random.default_rng(sum(map(ord, name)))
    out = []
    for i in range(count):
        if name not in BUILDERS:
            base = inputs_for(name, batch)
            out.append({k: v if i == 0 or v.dtype != np.float32 or k == "mask"
                        else (v + 0.1 * np.abs(v).mean() * rng.standard_normal(v.shape)).astype(np.float32)
                        for k, v in base.items()})
        elif name == "underflow_log":
            # Quiet audio: a few sines at 1e-4 amplitude plus faint noise.
            t = np.arange(64)
            f = rng.uniform(2, 20, size=(batch, 1, 3))
            tone = (np.sin(2 * np.pi * f * t[None, :, None] / 64) * rng.uniform(0.2, 1.0, (batch, 1, 3))).sum(-1)
            out.append({"audio": (1e-4 * tone + 1e-6 * rng.standard_normal((batch, 64))).astype(np.float32)})
        elif name == "transformer_cancellation":
            out.append({"x": rng.standard_normal((batch, 16, 64)).astype(np.float32),
                        "mask": padded_mask(batch, 16)})
        elif name == "db_head":
            out.append({"image": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)})
        elif name == "spread_offsets":
            out.append({"image": rng.standard_normal((batch, 3, 16, 16)).astype(np.float32)})
        elif name == "picodet_layout":
            out.append({"image": rng.standard_normal((batch, 3, PICODET_SIZE, PICODET_SIZE)).astype(np.float32)})
        else:
            out.append({"x": rng.standard_normal((batch, 32)).astype(np.float32)})
    return out

