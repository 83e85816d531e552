"""Inference speed of fp32, onnxmp and onnxconverter-common (occ) models, estimated without a GPU.

    python scripts/bench_speed.py [--models PATH ...] [--gpu h200|h100|a100] [--precision float16|bfloat16]
                                  [--batch N] [--seq N] [--shape NAME=32x128 ...] [--shape-batch N]
                                  [--launch-us US] [--no-tf32] [--gpu-check-models] [--speed-models]
                                  [--verbose [--top N]]
                                  [--json FILE]

THIS IS A PROXY, NOT A MEASUREMENT.  Nothing is timed: every number is a deterministic count
over the graph, turned into a roofline time for a named GPU.  Of ONNX Runtime's fusions on the
CUDA EP, those that decide what a converter's Casts cost are modelled, the same way for every
converter (``onnxmp.fusions``, which follows ORT's own matching conditions): a decomposed
LayerNorm or RMSNorm is one kernel (the Casts ORT absorbs included), an ``Add`` feeding one is
folded into it (SkipLayerNormalization), and an Erf GELU chain is one kernel; ``--no-fusions``
counts every node.  The others (attention, MatMul+bias, Conv+activation...) are not modelled,
nor are kernel efficiency, memory reuse or overlap.  The real measure is ``bash scripts/gpu_check.sh``
on a GPU.  The milliseconds are not a prediction (no fusion lowers them, no kernel below its
peak raises them); the ratios between converters are the signal: what each converted graph
costs in Casts, kernel launches and bytes.  The committed exports are tiny (hidden 32): their
times are nearly all launch overhead, so there the ms mostly count kernels; on base-size
models (``--speed-models``: real torch exports at BERT-base size, their weights drawn again from
skeletons; ``--gpu-check-models``; or ``--models`` on your own exports) bytes and FLOPs dominate.

Method, per model:

1. Concrete input shapes at throughput sizes (text: batch 32 x seq 128; images: batch 64 at
   the model's own H x W where fixed, else 224; audio: batch 8 x 16000 samples; other: batch
   32), from the declared dims (named batch/N, sequence/S, samples, past/P...) and, for the
   exports, models/exports/matrix.json and tasks.py.  ``--batch``, ``--seq`` and ``--shape``
   override them.  A text model whose position table is shorter than the sequence (the
   committed exports have 64 positions; roberta-style ones start at 2) runs at the longest
   sequence it takes, and its row says so.
2. Real input data: token ids within the rows of the embedding table they index, attention
   masks of ones with padding zeros at the end of most rows, normal noise for floats.
3. The shape of every tensor: the fp32 model runs once on onnxruntime CPU with every
   main-graph tensor added as a graph output.  A converted model's tensors have the fp32
   shapes by name; a Cast's output has its input's shape (and back); initializers and
   Constants their own.  ``--shape-batch B`` runs at batches B and 2B instead and
   extrapolates every dim linearly in the batch (exact for dims of the form a*batch + c,
   flattened batch x seq dims included) when the full run does not fit in memory.
4. Element types from each converted model (onnx shape inference, declared types, Cast
   ``to``), so each tensor's bytes are counted in its own precision.
5. Per node: bytes moved = the sizes of its distinct inputs (initializers included) plus its
   outputs; FLOPs = 2*M*N*K for MatMul/Gemm (batch dims included), 2*out*K for
   Conv/ConvTranspose/Einsum, the gate matmuls for GRU/LSTM/RNN, and a rough per-element
   count for everything else (memory-bound anyway).  Time = max(bytes / bandwidth,
   FLOPs / peak) + a launch overhead (``--launch-us``, default 4 us: CUDA launch plus ORT's
   dispatch).  Peak: Tensor Cores for fp16/bf16 MatMul/Gemm/Conv/Einsum/RNN, TF32 Tensor
   Cores for fp32 ones (ORT's CUDA EP has use_tf32 on by default; ``--no-tf32`` uses the
   fp32 vector rate), the vector rate of the output's type for the rest.

Nodes that cost nothing: Constant, Shape and Size; any node whose inputs are all
initializers/Constants (ORT constant-folds it at load); any node whose inputs are all
constants or shape values (descended from Shape/Size) and whose outputs are not floating
point (ORT runs such shape arithmetic on the CPU); and the views Reshape, Squeeze, Unsqueeze, Flatten,
Identity and Dropout (aliases of their input on the CUDA EP, or removed at load).  Control
flow (If/Loop/Scan) counts as one node with its own inputs and outputs; what runs in its
bodies is not modelled.  Inputs and outputs stay on the GPU (no PCIe copies), as in
gpu_check.py's I/O binding.

Table columns: ``kernels`` nodes that launch a GPU kernel (fp32/mp/occ); ``casts`` Cast
kernels; ``cast>cast`` Casts whose input is another Cast's output (pure waste);
``GB`` bytes moved per run by float32 / float16 (or bfloat16) tensors (integer and bool
tensors count in the times, not these columns); ``ms`` estimated time per run; ``mp/occ``
onnxmp time over occ time (> 1: onnxmp slower); ``fp32/mp`` and ``fp32/occ`` the
estimated speed-ups.  The last row holds geometric means.  mp = onnxmp, occ =
onnxconverter-common's ``float16.convert_float_to_float16(keep_io_types=True)`` (float16
only: with ``--precision bfloat16`` its columns are left out).

``--gpu-check-models`` adds the BERT-base (b32 s128) and ResNet-50 (b64 224px) models that
scripts/gpu_check.py measures on a GPU (README, "On a GPU"), so the proxy can be set beside
real numbers; their shapes come from a --shape-batch 2 run (a full one would hold every
intermediate tensor of a batch-32 BERT-base in memory at once).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import onnxmp  # noqa: E402
from onnxmp.domains import is_onnx_domain  # noqa: E402
from onnxmp.errors import first_line  # noqa: E402
from onnxmp.files import guard_arguments, write_text_atomic  # noqa: E402
from onnxmp.naming import json_safe  # noqa: E402

EXPORTS = ROOT / "models" / "exports"
SPEED_MODELS = EXPORTS / "speed"  # base-size exports as skeletons (models/exports/skeleton.py)
BUNDLED = ("mlp", "cnn_bn", "cnn_bn_bigvar", "transformer_block", "transformer_classifier", "kv_decoder",
           "gru", "lstm")  # loop_if left out: its work is in If/Loop bodies, which are not modelled

PROXY_NOTE = ("PROXY, not a measurement: roofline estimate from counted bytes and FLOPs; of ORT's fusions only "
              "LayerNorm/RMSNorm (with the Casts they absorb), SkipLayerNorm and Erf GELU are modelled (all "
              "converters alike), not attention, MatMul+bias or kernel efficiency. "
              "The real measure is `bash scripts/gpu_check.sh` on a GPU.")

TERA = 1e12


@dataclass(frozen=True)
class Gpu:
    """Peak rates of one GPU, dense (no 2:4 sparsity), in bytes/s and FLOP/s."""
    name: str
    bandwidth: float
    tensor_fp16: float   # fp16 and bf16 Tensor Core
    tensor_tf32: float   # TF32 Tensor Core: fp32 MatMul/Conv with use_tf32
    vector_fp32: float
    vector_fp16: float
    vector_bf16: float
    source: str


GPUS = {
    "h200": Gpu("NVIDIA H200 SXM", 4.8 * TERA, 989 * TERA, 494 * TERA, 67 * TERA, 134 * TERA, 134 * TERA,
                "NVIDIA H200 Tensor Core GPU datasheet: HBM3e 4.8 TB/s, FP16/BF16 Tensor Core 1,979 TFLOPS and "
                "TF32 989 TFLOPS with sparsity (halved here: dense), FP32 67 TFLOPS; same GH100 chip as H100 "
                "SXM, whose non-Tensor FP16/BF16 rate (133.8 TFLOPS) is in NVIDIA's H100 architecture whitepaper"),
    "h100": Gpu("NVIDIA H100 SXM5", 3.35 * TERA, 989 * TERA, 494 * TERA, 67 * TERA, 134 * TERA, 134 * TERA,
                "NVIDIA H100 Tensor Core GPU datasheet (SXM): HBM3 3.35 TB/s, FP16/BF16 Tensor Core 1,979 and "
                "TF32 989 TFLOPS with sparsity (dense: half), FP32 67 TFLOPS; non-Tensor FP16/BF16 133.8 "
                "TFLOPS from the NVIDIA H100 Tensor Core GPU Architecture whitepaper"),
    "a100": Gpu("NVIDIA A100 SXM4 80GB", 2.039 * TERA, 312 * TERA, 156 * TERA, 19.5 * TERA, 78 * TERA, 39 * TERA,
                "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): HBM2e 2,039 GB/s, FP16/BF16 Tensor Core 312 "
                "TFLOPS, TF32 156 TFLOPS (dense), FP32 19.5 TFLOPS; non-Tensor FP16 78 and BF16 39 TFLOPS from "
                "the NVIDIA A100 Tensor Core GPU Architecture whitepaper"),
}

# Nodes that launch nothing on the CUDA EP (see the module docstring).
HOST_OPS = {"Constant", "Shape", "Size"}
VIEW_OPS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Dropout"}
MATMUL_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "GRU", "LSTM", "RNN"}
# FLOPs per element (of the larger of the biggest input and the output) of the other ops.
ELEMENT_FLOPS = {"Softmax": 5, "LogSoftmax": 5, "LayerNormalization": 8, "SimplifiedLayerNormalization": 6,
                 "InstanceNormalization": 8, "GroupNormalization": 8, "BatchNormalization": 2, "Erf": 8,
                 "Tanh": 8, "Sigmoid": 4, "Exp": 4, "Log": 4, "Pow": 4, "Sqrt": 2, "Gelu": 8, "HardSwish": 3,
                 "HardSigmoid": 3}
FLOAT_TYPES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
               TensorProto.DOUBLE: "float64"}
LOW = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}

# Default sizes per kind of model.
BATCH = {"text": 32, "image": 64, "audio": 8, "other": 32}
SEQ, IMAGE, SAMPLES = 128, 224, 16000
BATCH_DIMS = {"batch", "batch_size", "n", "b", "bs"}
SEQ_DIMS = {"sequence", "seq", "s", "seq_len", "sequence_length", "past", "p", "past_sequence_length", "t"}


# --- models, shapes and inputs --------------------------------------------------------------


@dataclass
class Case:
    """One model to bench: where it comes from, its kind and its concrete input shapes."""
    name: str
    path: Path | None
    kind: str
    shapes: dict[str, list[int]] = field(default_factory=dict)
    batch_axes: dict[str, int | None] = field(default_factory=dict)
    seq_axes: dict[str, list[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    shape_batch: int | None = None


def matrix_kinds() -> dict[str, str]:
    """File name -> task kind (text/image/audio) of the committed exports."""
    from models.exports import tasks

    matrix = json.loads((EXPORTS / "matrix.json").read_text())
    return {entry["file"]: tasks.SPECS[entry["arch"]]["kind"] for entry in matrix.values() if "file" in entry}


def default_paths() -> list[Path]:
    exports = [EXPORTS / f for f in sorted(matrix_kinds()) if (EXPORTS / f).is_file()]
    return exports + [ROOT / "models" / f"{name}.onnx" for name in BUNDLED]


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def guess_kind(model: onnx.ModelProto) -> str:
    inputs = graph_inputs(model)
    types = [i.type.tensor_type.elem_type for i in inputs]
    ranks = [len(i.type.tensor_type.shape.dim) for i in inputs]
    if any(t in (TensorProto.INT64, TensorProto.INT32) and "ids" in i.name for i, t in zip(inputs, types)):
        return "text"
    if len(inputs) == 1 and ranks[0] == 4 and types[0] == TensorProto.FLOAT:
        return "image"
    if len(inputs) == 1 and ranks[0] == 2 and any("sample" in (d.dim_param or "").lower() or "values" in i.name
                                                  for i in inputs for d in i.type.tensor_type.shape.dim):
        return "audio"
    return "other"


def derive_shapes(case: Case, model: onnx.ModelProto, batch: int | None, seq: int | None,
                  overrides: dict[str, list[int]]) -> None:
    """Fill case.shapes (and which axes are batch / sequence) from the declared dims."""
    batch = batch or BATCH[case.kind]
    for info in graph_inputs(model):
        dims = list(info.type.tensor_type.shape.dim)
        shape: list[int] = []
        batch_axis, seq_axes = None, []
        for axis, dim in enumerate(dims):
            if dim.HasField("dim_value"):
                shape.append(dim.dim_value)
                continue
            label = (dim.dim_param or "").lower()
            if label in BATCH_DIMS or "batch" in label:
                shape.append(batch)
                batch_axis = axis
            elif label in SEQ_DIMS or "seq" in label or "past" in label:
                shape.append(seq or SEQ)
                seq_axes.append(axis)
            elif "sample" in label or label in {"time", "length"}:
                shape.append(SAMPLES)
            elif case.kind == "image" and axis >= 2:
                shape.append(IMAGE)
            elif axis == 0 and batch_axis is None:
                shape.append(batch)
                batch_axis = axis
            else:
                raise ValueError(f"input {info.name!r}: no default for dim {axis} ({dim.dim_param or '?'}); "
                                 f"give --shape {info.name}=...")
        if info.name in overrides:
            shape, seq_axes = list(overrides[info.name]), []
            if len(shape) != len(dims):
                raise ValueError(f"--shape {info.name}: rank {len(shape)}, the model declares {len(dims)}")
        case.shapes[info.name] = shape
        case.batch_axes[info.name] = batch_axis
        case.seq_axes[info.name] = seq_axes


def table_rows(model: onnx.ModelProto, name: str, depth: int = 4) -> int | None:
    """Rows of the embedding tables that the integer input ``name`` indexes (through casts and reshapes)."""
    tables = {i.name: list(i.dims) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].type == onnx.AttributeProto.TENSOR:
            tables[node.output[0]] = list(node.attribute[0].t.dims)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for tensor in node.input:
            readers.setdefault(tensor, []).append(node)
    found, frontier = [], [name]
    for _ in range(depth):
        nxt = []
        for tensor in frontier:
            for node in readers.get(tensor, []):
                if node.op_type == "Gather" and node.input[1] == tensor and tables.get(node.input[0]):
                    found.append(tables[node.input[0]][0])
                elif node.op_type in ("Cast", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze") \
                        and node.input[0] == tensor:
                    nxt.append(node.output[0])
        frontier = nxt
    return min(found) if found else None


def make_inputs(model: onnx.ModelProto, case: Case, batch_scale: int | None = None,
                seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds at case.shapes, or with every batch axis set to ``batch_scale``."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in graph_inputs(model):
        shape = list(case.shapes[info.name])
        axis = case.batch_axes.get(info.name)
        if batch_scale is not None and axis is not None:
            shape[axis] = batch_scale
        dtype = helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type)
        feeds[info.name] = make_array(model, info.name, shape, dtype, rng)
    return feeds


def make_array(model: onnx.ModelProto, name: str, shape: list[int], dtype, rng) -> np.ndarray:
    lower = name.lower()
    if "mask" in lower and len(shape) >= 1:
        seq = shape[-1]
        lengths = rng.integers(max(1, seq // 2), seq + 1, size=shape[:-1])
        lengths.flat[0] = seq  # one row unpadded
        return (np.arange(seq) < lengths[..., None]).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        if "position" in lower and len(shape) >= 1:
            return np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
        rows = table_rows(model, name)
        return rng.integers(0, rows or 1, size=shape).astype(dtype)
    if dtype == np.bool_:
        return np.ones(shape, dtype=bool)
    return rng.standard_normal(shape).astype(dtype)


def probe_session(model: onnx.ModelProto):
    """An onnxruntime CPU session of ``model`` with every main-graph tensor as an output."""
    import onnxruntime as ort
    from onnxmp.external import session_source

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output}
    for node in probe.graph.node:
        for name in node.output:
            if name and name not in present:
                probe.graph.output.append(onnx.ValueInfoProto(name=name))  # untyped: ORT infers it
                present.add(name)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with session_source(probe, "probe") as source:
        return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def run_shapes(session, feeds: dict[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    import onnxruntime as ort

    run_options = ort.RunOptions()
    run_options.log_severity_level = 4
    names = [o.name for o in session.get_outputs()]
    values = session.run(names, feeds, run_options)
    out = {name: (tuple(v.shape), v.dtype) for name, v in zip(names, values)}
    out.update({name: (tuple(v.shape), v.dtype) for name, v in feeds.items()})
    return out


def fp32_shapes(model: onnx.ModelProto, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of every tensor of the fp32 model at case.shapes (fitting the sequence if needed)."""
    session = probe_session(model)
    try:
        return _shapes_at(session, model, case)
    except Exception as exc:
        if not any(case.seq_axes.values()):
            raise
        seq = _longest_seq(session, model, case)
        if seq is None:
            raise
        requested = next(case.shapes[n][a[0]] for n, a in case.seq_axes.items() if a)
        for name, axes in case.seq_axes.items():
            for axis in axes:
                case.shapes[name][axis] = seq
        where = re.search(r"running (\w+ node)\. Name:'([^']*)'", str(exc))
        why = f"{where[1]} {where[2]}" if where else first_line(exc, 100)
        case.notes.append(f"seq {seq}, not {requested}: longer sequences fail ({why})")
        return _shapes_at(session, model, case)


def _shapes_at(session, model: onnx.ModelProto, case: Case):
    if not case.shape_batch:
        return run_shapes(session, make_inputs(model, case))
    small = case.shape_batch
    one = run_shapes(session, make_inputs(model, case, small))
    two = run_shapes(session, make_inputs(model, case, 2 * small))
    target = next((case.shapes[n][a] for n, a in case.batch_axes.items() if a is not None), None)
    if target is None:
        raise ValueError("--shape-batch needs an input with a batch dim")
    shapes = {}
    for name, (dims, dtype) in one.items():
        other = two[name][0]
        if len(other) != len(dims):
            raise ValueError(f"--shape-batch: {name} changes rank with the batch")
        scaled = []
        for d1, d2 in zip(dims, other):
            step, rem = divmod((d2 - d1) * (target - small), small)
            if rem:
                raise ValueError(f"--shape-batch: a dim of {name} is not linear in the batch")
            scaled.append(d1 + step)
        shapes[name] = (tuple(scaled), dtype)
    return shapes


def _longest_seq(session, model: onnx.ModelProto, case: Case) -> int | None:
    """Largest sequence length (below the requested one) the model runs at, by bisection at batch 2."""
    probe = Case(case.name, case.path, case.kind, {k: list(v) for k, v in case.shapes.items()},
                 dict(case.batch_axes), case.seq_axes)

    def runs(seq: int) -> bool:
        for name, axes in probe.seq_axes.items():
            for axis in axes:
                probe.shapes[name][axis] = seq
        try:
            run_shapes(session, make_inputs(model, probe, batch_scale=2))
            return True
        except Exception:
            return False

    if not runs(1):
        return None
    lo, hi = 1, next(case.shapes[n][a[0]] for n, a in case.seq_axes.items() if a)  # runs(lo), not runs(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if runs(mid) else (lo, mid)
    return lo


# --- converters -------------------------------------------------------------------------------


def convert(model: onnx.ModelProto, tool: str, precision: str) -> onnx.ModelProto:
    if tool == "fp32":
        return model
    if tool == "onnxmp":
        return onnxmp.convert(model, target="cuda", precision=precision, keep_io_types=True).model
    from onnxconverter_common import float16

    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # it converts in place
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one warning per clamped constant
        return float16.convert_float_to_float16(copy, keep_io_types=True)


# --- costs --------------------------------------------------------------------------------------


def element_types(model: onnx.ModelProto, fallback: dict) -> dict[str, int]:
    """Element type of every main-graph tensor: declared, inferred, Cast ``to``, else the fp32 run's."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # over 2 GB, or a graph onnx cannot infer: the declared types
        inferred = model
    types: dict[str, int] = {}
    g = inferred.graph
    for info in (*g.input, *g.output, *g.value_info):
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
            types[info.name] = info.type.tensor_type.elem_type
    for init in model.graph.initializer:
        types[init.name] = init.data_type
    for node in model.graph.node:
        if node.op_type == "Cast":
            types[node.output[0]] = next(a.i for a in node.attribute if a.name == "to")
        elif node.op_type == "Constant" and node.attribute[0].type == onnx.AttributeProto.TENSOR:
            types[node.output[0]] = node.attribute[0].t.data_type
    for name, (_, dtype) in fallback.items():
        types.setdefault(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
    return types


def tensor_shapes(model: onnx.ModelProto, fp32: dict) -> dict[str, tuple[int, ...]]:
    """Shape of every main-graph tensor of ``model``: the fp32 run's by name, initializers' and
    Constants' own, and across Casts both ways (a Cast keeps the shape)."""
    shapes = {name: dims for name, (dims, _) in fp32.items()}
    for init in model.graph.initializer:
        shapes[init.name] = tuple(init.dims)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute[0].type == onnx.AttributeProto.TENSOR:
            shapes[node.output[0]] = tuple(node.attribute[0].t.dims)
    casts = [(n.input[0], n.output[0]) for n in model.graph.node if n.op_type == "Cast"]
    changed = True
    while changed:
        changed = False
        for src, dst in casts:
            if src in shapes and dst not in shapes:
                shapes[dst] = shapes[src]
                changed = True
            elif dst in shapes and src not in shapes:
                shapes[src] = shapes[dst]
                changed = True
    return shapes


def node_roles(model: onnx.ModelProto, types: dict[str, int]) -> list[str]:
    """'kernel', 'host' (folded at load or run on the CPU) or 'view' for each main-graph node."""
    const = {i.name for i in model.graph.initializer}   # known at load
    shape_values = set(const)                           # known on the host at run time
    roles = []
    for node in model.graph.node:
        inputs = [t for t in node.input if t]
        outputs = [t for t in node.output if t]
        float_out = any(types.get(t) in FLOAT_TYPES for t in outputs)
        if node.op_type in HOST_OPS:
            role = "host"
        elif inputs and all(t in const for t in inputs):
            role = "host"
        elif inputs and all(t in shape_values for t in inputs) and not float_out:
            role = "host"
        elif node.op_type in VIEW_OPS:
            role = "view"
        else:
            role = "kernel"
        if role == "host":
            shape_values.update(outputs)
            if node.op_type == "Constant" or (inputs and all(t in const for t in inputs)):
                const.update(outputs)
        roles.append(role)
    return roles


def numel(shape) -> int:
    return math.prod(shape) if shape is not None else 0


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def node_flops(node: onnx.NodeProto, shapes: dict) -> int:
    get = shapes.get
    out = get(node.output[0]) if node.output else None
    op = node.op_type
    if op == "MatMul" and get(node.input[0]) and out is not None:
        return 2 * numel(out) * get(node.input[0])[-1]
    if op == "Gemm" and get(node.input[0]) and out is not None:
        a = get(node.input[0])
        k = a[0] if _attr(node, "transA", 0) else a[-1]
        return 2 * numel(out) * k + (numel(out) if len(node.input) > 2 and node.input[2] else 0)
    if op == "Conv" and get(node.input[1]) and out is not None:
        return 2 * numel(out) * numel(get(node.input[1])[1:])
    if op == "ConvTranspose" and get(node.input[1]) and get(node.input[0]):
        return 2 * numel(get(node.input[0])) * numel(get(node.input[1])[1:])
    if op == "Einsum":
        return einsum_flops(_attr(node, "equation").decode(), [get(t) for t in node.input])
    if op in ("GRU", "LSTM", "RNN") and get(node.input[0]) and get(node.input[1]):
        seq, batch, size = get(node.input[0])[:3]
        directions, gates_hidden = get(node.input[1])[:2]  # W: [directions, gates*hidden, input]
        hidden = _attr(node, "hidden_size")
        return 2 * seq * batch * directions * gates_hidden * (size + hidden)
    biggest = max([numel(get(t)) for t in (*node.input, *node.output) if t and get(t) is not None] or [0])
    return ELEMENT_FLOPS.get(op, 1) * biggest


def einsum_flops(equation: str, shapes: list) -> int:
    """2 x the product of every index's size (the loop nest of a naive einsum)."""
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    ellipsis: list[int] = []
    for term, shape in zip(lhs, shapes):
        if shape is None:
            return 0
        explicit = term.replace("...", "")
        if "..." in term:
            n_ell = len(shape) - len(explicit)
            start = term.index("...")
            ell = list(shape[start:start + n_ell])
            ellipsis = [max(a, b) for a, b in zip(ell, ellipsis)] + ell[len(ellipsis):] if ellipsis else ell
            dims = list(shape[:start]) + list(shape[start + n_ell:])
        else:
            dims = list(shape)
        for letter, size in zip(explicit, dims):
            sizes[letter] = max(sizes.get(letter, 1), size)
    return 2 * math.prod(sizes.values()) * math.prod(ellipsis)


def dtype_name(elem_type: int | None) -> str:
    return FLOAT_TYPES.get(elem_type, "other")


def itemsize(elem_type: int | None) -> int:
    if elem_type in (None, TensorProto.UNDEFINED, TensorProto.STRING):
        return 0
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize


def peak_flops(node: onnx.NodeProto, types: dict, gpu: Gpu, tf32: bool) -> float:
    if node.op_type in MATMUL_OPS:
        t = types.get(node.input[0])
        if t in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
            return gpu.tensor_fp16
        return gpu.tensor_tf32 if tf32 else gpu.vector_fp32
    t = next((types.get(o) for o in node.output if types.get(o) in FLOAT_TYPES), None)
    return {TensorProto.FLOAT16: gpu.vector_fp16, TensorProto.BFLOAT16: gpu.vector_bf16}.get(t, gpu.vector_fp32)


def fused_kernels(model: onnx.ModelProto, types: dict[str, int] | None = None,
                  shapes: dict[str, tuple] | None = None) -> dict[str, tuple[str, list[str]]]:
    """Node name -> (the fused kernel it belongs to, that kernel's member nodes), for the fusions
    ORT makes on the CUDA EP that this proxy models (see the module docstring).  ``types`` and
    ``shapes`` are every tensor's (the fp32 run's): ORT matches on inferred ranks, which a model
    without value_info does not declare."""
    from onnxmp.fusions import GraphFacts, fused_norms, gelus, skip_layer_norm_adds

    facts = GraphFacts(model.graph, types, shapes)
    groups: list[tuple[str, list[str]]] = []
    norms: dict[str, tuple[str, list[str]]] = {}  # input -> (the norm's last node, its nodes)
    for norm in fused_norms(facts):
        groups.append((norm.kind, list(norm.nodes)))
        if norm.kind == "LayerNormalization":  # SkipLayerNormFusion folds no Add into an RMSNorm
            norms[norm.input] = (norm.nodes[-1], list(norm.nodes))
    for node in model.graph.node:
        if node.op_type == "LayerNormalization" and is_onnx_domain(node.domain):
            groups.append(("LayerNormalization", [node.name]))
            norms[node.input[0]] = (node.name, [node.name])
    for match in gelus(facts):
        groups.append(("Gelu", list(match)))
    member = {name: i for i, (_, names) in enumerate(groups) for name in names}
    for add, norm_node in skip_layer_norm_adds(facts, norms).items():
        i = member.get(norm_node)
        if i is not None and add not in member:
            kind, names = groups[i]
            groups[i] = ("SkipLayerNormalization", [add, *names])
            member[add] = i
    return {name: groups[i] for name, i in member.items()}


def _fused_node(name: str, kind: str, members: list[onnx.NodeProto]) -> onnx.NodeProto:
    """One node standing for a fused kernel: what its members read from outside, what they write."""
    written = {out for node in members for out in node.output}
    inputs = list(dict.fromkeys(t for node in members for t in node.input if t and t not in written))
    read = {t for node in members for t in node.input}
    outputs = [t for node in members for t in node.output if t and t not in read] or [members[-1].output[0]]
    return helper.make_node(kind, inputs, outputs, name=name)


def model_cost(model: onnx.ModelProto, fp32: dict, gpu: Gpu, launch_s: float, tf32: bool,
               fusions: bool = True) -> dict:
    """Counts and the roofline time of one (converted) model; ``nodes`` holds each kernel's cost."""
    types = element_types(model, fp32)
    shapes = tensor_shapes(model, fp32)
    roles = node_roles(model, types)
    producers = {o: n for n in model.graph.node for o in n.output}
    by_dtype = {"float32": 0, "float16": 0, "bfloat16": 0, "float64": 0, "other": 0}
    unknown: set[str] = set()
    nodes = []
    fused = fused_kernels(model, types, shapes) if fusions else {}
    by_name = {node.name: node for node in model.graph.node}
    done: set[str] = set()
    for node, role in zip(model.graph.node, roles):
        if node.name in fused:
            kind, names = fused[node.name]
            if names[0] in done:
                continue
            done.add(names[0])
            node, role = _fused_node(f"{names[-1]} ({kind})", kind, [by_name[n] for n in names]), "kernel"
        if role != "kernel":
            continue
        moved = dict.fromkeys(by_dtype, 0)
        for tensor in dict.fromkeys(t for t in (*node.input, *node.output) if t):
            if tensor not in shapes:
                unknown.add(tensor)
                continue
            moved[dtype_name(types.get(tensor))] += numel(shapes[tensor]) * itemsize(types.get(tensor))
        flops = node_flops(node, shapes)
        total = sum(moved.values())
        memory_s, compute_s = total / gpu.bandwidth, flops / peak_flops(node, types, gpu, tf32)
        for k, v in moved.items():
            by_dtype[k] += v
        src = producers.get(node.input[0]) if node.input else None
        nodes.append({"name": node.name or node.output[0], "op": node.op_type,
                      "dtype": dtype_name(types.get(node.output[0])) if node.output else "other",
                      "bytes": total, "flops": flops, "bound": "compute" if compute_s > memory_s else "memory",
                      "us": 1e6 * (max(memory_s, compute_s) + launch_s),
                      "cast_of_cast": node.op_type == "Cast" and src is not None and src.op_type == "Cast"})
    kernels = len(nodes)
    roofline_ms = sum(n["us"] for n in nodes) / 1e3 - kernels * launch_s * 1e3
    return {"error": None, "nodes": len(model.graph.node), "kernels": kernels,
            "casts": sum(n["op"] == "Cast" for n in nodes),
            "cast_pairs": sum(n["cast_of_cast"] for n in nodes),
            "bytes": {**{k: v for k, v in by_dtype.items() if v}, "total": sum(by_dtype.values())},
            "gflops": sum(n["flops"] for n in nodes) / 1e9,
            "ms": sum(n["us"] for n in nodes) / 1e3, "launch_ms": kernels * launch_s * 1e3,
            "roofline_ms": roofline_ms, "unknown_shapes": sorted(unknown)[:20], "n_unknown_shapes": len(unknown),
            "nodes_cost": nodes}


def summarize_nodes(cost: dict, top: int) -> None:
    """Replace the per-node list by the top nodes and a per-op-type summary."""
    nodes = cost.pop("nodes_cost")
    cost["top_nodes"] = sorted(nodes, key=lambda n: n["us"], reverse=True)[:top]
    ops: dict[str, dict] = {}
    for n in nodes:
        entry = ops.setdefault(n["op"], {"count": 0, "us": 0.0, "bytes": 0})
        entry["count"] += 1
        entry["us"] += n["us"]
        entry["bytes"] += n["bytes"]
    cost["by_op"] = dict(sorted(ops.items(), key=lambda kv: kv[1]["us"], reverse=True))


# --- the benchmark ----------------------------------------------------------------------------


def load_case(path: Path, kinds: dict[str, str], args) -> tuple[Case, onnx.ModelProto]:
    from models.exports import skeleton

    model = skeleton.load(path)  # a skeleton gets its weights drawn again; other models load as they are
    name = path.name.removesuffix(".onnx").removesuffix(".skeleton")
    case = Case(name, path, kinds.get(path.name) if path.parent.resolve() == EXPORTS.resolve() else None)
    case.kind = case.kind or guess_kind(model)
    # Base-size models at throughput shapes: the all-tensors fp32 run would need tens of GB.
    case.shape_batch = args.shape_batch or (2 if path.parent.resolve() == SPEED_MODELS.resolve() else None)
    derive_shapes(case, model, args.batch, args.seq, args.shape)
    return case, model


def gpu_check_builders() -> list[tuple[str, object]]:
    """The BERT-base and ResNet-50 builders of scripts/gpu_check.py (the models it measures)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [("bert_base", module.bert_like), ("resnet50", module.resnet_like)]


def gpu_check_case(build, args) -> tuple[Case, onnx.ModelProto]:
    model, feeds, _, label = build(False)
    case = Case(label.split()[0], None, "image" if "resnet" in label else "other",
                shape_batch=args.shape_batch or 2)
    for name, array in feeds.items():
        case.shapes[name] = list(array.shape)
        case.batch_axes[name] = 0
        case.seq_axes[name] = []
    return case, model


def bench_case(case: Case, model: onnx.ModelProto, tools: list[str], args) -> dict:
    gpu = GPUS[args.gpu]
    row = {"name": case.name, "path": str(case.path) if case.path else None, "kind": case.kind,
           "nodes": len(model.graph.node), "error": None}
    try:
        fp32 = fp32_shapes(model, case)
    except Exception as exc:
        row.update(shapes=case.shapes, notes=case.notes,
                   error=f"fp32 shape run failed: {type(exc).__name__}: {first_line(exc, 200)}")
        return row
    row["shapes"] = case.shapes
    bodies = sorted({n.op_type for n in model.graph.node
                     if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)})
    if bodies:
        case.notes.append(f"{'/'.join(bodies)} count as one node each: their bodies are not modelled")
    if case.shape_batch:
        case.notes.append(f"shapes extrapolated from batches {case.shape_batch} and {2 * case.shape_batch}")
    row["notes"] = case.notes
    row["converters"] = {}
    for tool in tools:
        try:
            converted = convert(model, tool, args.precision)
        except Exception as exc:  # a converter that fails is a result, not a crash of the benchmark
            row["converters"][tool] = {"error": f"conversion failed: {type(exc).__name__}: {first_line(exc, 200)}"}
            continue
        cost = model_cost(converted, fp32, gpu, args.launch_us * 1e-6, not args.no_tf32, not args.no_fusions)
        summarize_nodes(cost, args.top)
        row["converters"][tool] = cost
    ms = {t: c.get("ms") for t, c in row["converters"].items()}
    row["onnxmp_over_occ"] = _div(ms.get("onnxmp"), ms.get("occ"))
    row["speedup_onnxmp"] = _div(ms.get("fp32"), ms.get("onnxmp"))
    row["speedup_occ"] = _div(ms.get("fp32"), ms.get("occ"))
    return row


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def geomeans(rows: list[dict], tools: list[str]) -> dict:
    ok = [r for r in rows if not r["error"]]
    out = {f"{t}_ms": geomean(r["converters"].get(t, {}).get("ms") for r in ok) for t in tools}
    for key in ("onnxmp_over_occ", "speedup_onnxmp", "speedup_occ"):
        out[key] = geomean(r.get(key) for r in ok)
    return out


# --- output -------------------------------------------------------------------------------------


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _gb(cost: dict, key: str) -> str:
    return f"{cost['bytes'].get(key, 0) / 1e9:.3f}"


def print_table(result: dict) -> None:
    cfg = result["config"]
    tools, low = cfg["converters"], cfg["precision"]
    short = {"fp32": "fp32", "onnxmp": "mp", "occ": "occ"}
    lowname = "f16" if low == "float16" else "bf16"
    names = "/".join(short[t] for t in tools)
    header = ["model", "input", "nodes", f"kernels {names}", f"casts {names}", f"cast>cast {names}", "GB fp32"]
    header += [f"GB {short[t]} f32/{lowname}" for t in tools[1:]]
    header += [f"ms {short[t]}" for t in tools]
    header += (["mp/occ"] if "occ" in tools else []) + ["fp32/mp"] + (["fp32/occ"] if "occ" in tools else [])
    lines = [header]
    for r in result["models"]:
        shape = "x".join(map(str, next(iter(r["shapes"].values()), []))) if r.get("shapes") else "-"
        cells = [r["name"], shape, str(r["nodes"])]
        if r["error"]:
            lines.append(cells + ["ERROR"] + [""] * (len(header) - 4))
            continue
        convs = [r["converters"][t] for t in tools]
        for key in ("kernels", "casts", "cast_pairs"):
            cells.append("/".join("x" if c["error"] else str(c[key]) for c in convs))
        cells.append(_gb(convs[0], "float32") if not convs[0]["error"] else "x")
        for c in convs[1:]:
            cells.append("x" if c["error"] else f"{_gb(c, 'float32')}/{_gb(c, low)}")
        cells += ["x" if c["error"] else f"{c['ms']:.3f}" for c in convs]
        cells += ([_f(r["onnxmp_over_occ"], ".2f")] if "occ" in tools else []) + [_f(r["speedup_onnxmp"], ".2f")]
        cells += [_f(r["speedup_occ"], ".2f")] if "occ" in tools else []
        lines.append(cells)
    g = result["geomean"]
    cells = ["geomean", "", "", "", "", ""] + [""] * len(tools)
    cells += [_f(g[f"{t}_ms"], ".3f") for t in tools]
    cells += ([_f(g["onnxmp_over_occ"], ".2f")] if "occ" in tools else []) + [_f(g["speedup_onnxmp"], ".2f")]
    cells += [_f(g["speedup_occ"], ".2f")] if "occ" in tools else []
    lines.append(cells)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    gpu = cfg["gpu"]
    print(f"{PROXY_NOTE}\n"
          f"GPU {gpu['name']}: {gpu['bandwidth_tb_s']:.2f} TB/s, {gpu['tensor_fp16_tflops']:.0f} TFLOPS fp16/bf16 "
          f"Tensor Core, {gpu['fp32_matmul_tflops']:.0f} TFLOPS fp32 MatMul/Conv "
          f"({'TF32' if cfg['tf32'] else 'no TF32'}), {gpu['vector_fp32_tflops']:.1f} TFLOPS fp32 vector; "
          f"+{cfg['launch_us']:g} us per kernel; onnxmp precision {low}; mp = onnxmp, occ = onnxconverter-common")
    for row in lines:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    for r in result["models"]:
        if r["error"]:
            print(f"{r['name']}: {r['error']}")
            continue
        for note in r["notes"]:
            print(f"{r['name']}: {note}")
        for tool, c in r["converters"].items():
            if c["error"]:
                print(f"{r['name']} ({tool}): {c['error']}")
            elif c["n_unknown_shapes"]:
                print(f"{r['name']} ({tool}): {c['n_unknown_shapes']} tensors of unknown shape count 0 bytes: "
                      + ", ".join(c["unknown_shapes"][:5]))


def print_details(result: dict, top: int) -> None:
    """--verbose: per model, the costliest op types and nodes of each converter."""
    for r in result["models"]:
        if r["error"]:
            continue
        tools = [t for t, c in r["converters"].items() if not c["error"]]
        print(f"\n{r['name']}: estimated us by op type (count), costliest first for onnxmp")
        ops = list(r["converters"].get("onnxmp", r["converters"][tools[0]]).get("by_op", {}))
        for t in tools:
            ops += [op for op in r["converters"][t]["by_op"] if op not in ops]
        print(f"  {'op':<24}" + "".join(f"{t:>18}" for t in tools))
        for op in ops[:max(top * 2, 10)]:
            cells = []
            for t in tools:
                e = r["converters"][t]["by_op"].get(op)
                cells.append(f"{e['us']:10.1f} ({e['count']:>3})" if e else f"{'-':>16}")
            print(f"  {op:<24}" + "".join(f"{c:>18}" for c in cells))
        for t in tools:
            print(f"  top {top} nodes, {t}:")
            for n in r["converters"][t]["top_nodes"]:
                print(f"    {n['us']:9.1f} us  {n['op']:<20} {n['dtype']:<8} {n['bytes'] / 1e6:9.2f} MB "
                      f"{n['flops'] / 1e9:9.3f} GFLOP  {n['bound']:<7}  {n['name']}")


def parse_shape(text: str) -> tuple[str, list[int]]:
    name, sep, dims = text.rpartition("=")
    if not sep or not name or not re.fullmatch(r"\d+(x\d+)*", dims):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DxDx... (e.g. input_ids=32x128)")
    return name, [int(d) for d in dims.split("x")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", type=Path, metavar="PATH",
                    help="ONNX files to bench (default: models/exports/*.onnx and the bundled models; "
                         "none, with --gpu-check-models: only those)")
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS), help="GPU preset (default: %(default)s)")
    ap.add_argument("--precision", default="float16", choices=("float16", "bfloat16"),
                    help="onnxmp's low precision (default: %(default)s; occ runs for float16 only)")
    ap.add_argument("--batch", type=int, help="batch size of every model (default: 32 text, 64 images, 8 audio)")
    ap.add_argument("--seq", type=int, help=f"sequence length of text models (default: {SEQ})")
    ap.add_argument("--shape", type=parse_shape, action="append", default=[], metavar="NAME=DIMS",
                    help="concrete shape of an input, e.g. input_ids=32x128 (repeatable)")
    ap.add_argument("--shape-batch", type=int, metavar="B",
                    help="run the fp32 shape pass at batches B and 2B and extrapolate (saves memory)")
    ap.add_argument("--launch-us", type=float, default=4.0, help="overhead per kernel, us (default: %(default)s)")
    ap.add_argument("--no-tf32", action="store_true", help="fp32 MatMul/Conv at the fp32 vector rate")
    ap.add_argument("--no-fusions", action="store_true",
                    help="count every node: no LayerNorm, SkipLayerNorm or GELU fusion")
    ap.add_argument("--gpu-check-models", action="store_true",
                    help="also bench gpu_check.py's BERT-base and ResNet-50 (the README's measured table)")
    ap.add_argument("--speed-models", action="store_true",
                    help="also bench the base-size torch exports of models/exports/speed/ (BERT-base, MPNet-base, "
                         "DistilBERT at opsets 14/17, Whisper-tiny encoder, ResNet-50, MobileNetV2)")
    ap.add_argument("--verbose", action="store_true", help="per model, the costliest op types and nodes")
    ap.add_argument("--top", type=int, default=5, help="nodes listed per converter with --verbose and in the JSON")
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    for flag, value in (("--batch", args.batch), ("--seq", args.seq), ("--shape-batch", args.shape_batch),
                        ("--top", args.top)):
        if value is not None and value < 1:
            ap.error(f"{flag} must be >= 1")
    if args.launch_us < 0:
        ap.error("--launch-us must be >= 0")
    args.shape = dict(args.shape)
    paths = [p.resolve() for p in args.models] if args.models is not None else default_paths()
    if args.speed_models:
        from models.exports import skeleton

        paths += [SPEED_MODELS / entry["file"] for entry in skeleton.manifest().values()]
    if not paths and not args.gpu_check_models and not args.speed_models:
        ap.error("no models to bench")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        ap.error(f"no such model file: {', '.join(missing)}")
    guard_arguments(ap, {"--json": args.json}, {"model": paths})

    from tqdm import tqdm

    tools = ["fp32", "onnxmp"] + (["occ"] if args.precision == "float16" else [])
    kinds = matrix_kinds()
    jobs = [(p.name, lambda p=p: load_case(p, kinds, args)) for p in paths]
    if args.gpu_check_models:
        jobs += [(label, lambda build=build: gpu_check_case(build, args)) for label, build in gpu_check_builders()]
    rows = []
    bar = tqdm(jobs, desc="bench_speed", unit="model", file=sys.stderr, disable=None)
    for label, load in bar:
        bar.set_postfix_str(label)
        try:
            case, model = load()
        except Exception as exc:
            rows.append({"name": label, "path": None, "nodes": 0, "shapes": None, "notes": [],
                         "error": f"{type(exc).__name__}: {first_line(exc, 200)}"})
            continue
        rows.append(bench_case(case, model, tools, args))
        del model
    gpu = GPUS[args.gpu]
    result = {"config": {"proxy": PROXY_NOTE, "converters": tools, "precision": args.precision,
                         "fusions": not args.no_fusions,
                         "launch_us": args.launch_us, "tf32": not args.no_tf32, "batch": args.batch, "seq": args.seq,
                         "shape_overrides": args.shape, "shape_batch": args.shape_batch,
                         "gpu": {"preset": args.gpu, "name": gpu.name, "bandwidth_tb_s": gpu.bandwidth / TERA,
                                 "tensor_fp16_tflops": gpu.tensor_fp16 / TERA,
                                 "fp32_matmul_tflops": (gpu.tensor_tf32 if not args.no_tf32 else gpu.vector_fp32)
                                 / TERA,
                                 "vector_fp32_tflops": gpu.vector_fp32 / TERA,
                                 "vector_fp16_tflops": gpu.vector_fp16 / TERA,
                                 "vector_bf16_tflops": gpu.vector_bf16 / TERA, "source": gpu.source},
                         "onnx": onnx.__version__, "onnxmp": getattr(onnxmp, "__version__", None)},
              "models": rows, "geomean": geomeans(rows, tools)}
    print_table(result)
    if args.verbose:
        print_details(result, args.top)
    if args.json:
        write_text_atomic(args.json, json.dumps(json_safe(result), indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
