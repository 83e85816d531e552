#!/usr/bin/env python
"""Generate ``onnxmp/data/ort_cuda_placement.json``: where onnxruntime's CUDA EP puts a node and its tensors.

:mod:`onnxmp.training.build.placement` simulates the CUDA EP's placement of a training graph from
these facts and from ``onnxmp/data/ort_kernels.json`` (which CUDA kernels exist and which float
types they take: :class:`onnxmp.kernels.KernelTable`, the one table of kernel facts).  This file
adds what that table leaves out:

- ``int_types``: the non-float tensor types each CUDA kernel's type parameters take (int64 Add,
  bool Where ...), parsed from the same ``scripts/sources/onnxruntime-OperatorKernels.md.gz``
  (``gen_kernel_table.py`` keeps only float types there).  A node whose types no CUDA kernel
  takes runs on the CPU EP;
- ``memory``: the CUDA kernels' ``.InputMemoryType(OrtMemTypeCPUInput, i)`` and
  ``.OutputMemoryType(OrtMemTypeCPUOutput, i)`` registrations, read from the kernel sources under
  ``onnxruntime/core/providers/cuda`` and ``onnxruntime/contrib_ops/cuda`` at ``MEMORY_COMMIT`` (each
  entry names its file).  They are curated below, not parsed: the sources are not vendored (the CUDA
  EP cannot be loaded without a GPU to ask it);
- ``cpu_preferred``: the constants of ``GetCpuPreferredNodes``
  (``onnxruntime/core/framework/fallback_cpu_capability.cc``), which the CUDA EP's
  ``GetCapability`` (``onnxruntime/core/providers/cuda/cuda_execution_provider.cc``) calls to leave
  shape-computing subgraphs to the CPU.

Usage::

    python scripts/gen_cuda_placement.py [-o onnxmp/data/ort_cuda_placement.json]
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_kernel_table as kernels  # noqa: E402  (the OperatorKernels.md parser)

OUTPUT = kernels.REPO_ROOT / "onnxmp" / "data" / "ort_cuda_placement.json"
PROVIDER = "CUDAExecutionProvider"

# The onnxruntime sources read (main branch, the commits the stored files were read at).
SOURCES = {
    "fallback_cpu_capability": ("onnxruntime/core/framework/fallback_cpu_capability.cc",
                                "039e489f3ff5cc427030dc58e43af78696cf74e7"),
    "get_capability": ("onnxruntime/core/providers/cuda/cuda_execution_provider.cc",
                       "0018ddb68e9b056d3f66ff51b084cf9ca7b6e948"),
}
_CUDA = "onnxruntime/core/providers/cuda/"

# The kernel registrations below were read at one commit of the main branch (Feb 2026, "Doc fixes (#27228)"),
# from the fork tianleiwu/onnxruntime whose main mirrors microsoft/onnxruntime's (microsoft's own
# snapshot is too large to fetch here), with
#   git grep -nE 'OrtMemTypeCPU(Input|Output)' -- onnxruntime/core/providers/cuda onnxruntime/contrib_ops/cuda
MEMORY_COMMIT = "735e69a396afe7e1bdfbc6b38c1d43eeb68b8484"
_MS = "onnxruntime/contrib_ops/cuda/"

# (domain, op, since, until, CPU-memory inputs, CPU-memory outputs, file read): every CUDA registration
# carrying ``.InputMemoryType(OrtMemTypeCPUInput, i)`` or ``.OutputMemoryType(..., i)`` (Shape, Size and
# SequenceLength register their output as ``OrtMemTypeCPUInput``: any CPU type puts it on the host), with
# the registration's opset range.  Versions without the memory type are left out (Squeeze-1..12 takes
# axes as an attribute, Clip-11+ reads min/max on the device).  Not listed: the kernels of
# orttraining/training_ops/cuda (no CUDA kernel of the inference build onnxmp targets) and the
# Distributed* ops of contrib_ops/cuda/collective (built with MPI/NCCL only, absent from OperatorKernels.md).
MEMORY = [
    ("ai.onnx", "Shape", 1, None, [], [0], "tensor/shape_op.cc"),
    ("ai.onnx", "Size", 1, None, [], [0], "tensor/size.cc"),
    ("ai.onnx", "Reshape", 5, None, [1], [], "tensor/reshape.cc"),
    ("ai.onnx", "Expand", 8, None, [1], [], "tensor/expand.cc"),
    ("ai.onnx", "Tile", 6, None, [1], [], "tensor/tile.cc"),
    ("ai.onnx", "Slice", 10, None, [1, 2, 3, 4], [], "tensor/slice.cc"),
    ("ai.onnx", "Squeeze", 13, None, [1], [], "tensor/squeeze.cc"),
    ("ai.onnx", "Unsqueeze", 13, None, [1], [], "tensor/unsqueeze.cc"),
    ("ai.onnx", "Split", 13, None, [1], [], "tensor/split.cc"),
    ("ai.onnx", "Pad", 11, 17, [1, 2], [], "tensor/pad.cc"),
    ("ai.onnx", "Pad", 18, None, [1, 2, 3], [], "tensor/pad.cc"),
    ("ai.onnx", "Resize", 10, 10, [1], [], "tensor/resize.cc"),
    ("ai.onnx", "Resize", 11, None, [1, 2, 3], [], "tensor/resize.cc"),
    ("ai.onnx", "Upsample", 7, 9, [1], [], "tensor/upsample.cc"),
    ("ai.onnx", "OneHot", 11, None, [1, 2], [], "tensor/onehot.cc"),
    ("ai.onnx", "Trilu", 14, None, [1], [], "tensor/trilu.cc"),
    ("ai.onnx", "SequenceAt", 11, None, [1], [], "tensor/sequence_op.cc"),
    ("ai.onnx", "SequenceErase", 11, None, [1], [], "tensor/sequence_op.cc"),
    ("ai.onnx", "SequenceInsert", 11, None, [2], [], "tensor/sequence_op.cc"),
    ("ai.onnx", "SequenceLength", 11, None, [], [0], "tensor/sequence_op.cc"),
    ("ai.onnx", "ConstantOfShape", 9, None, [0], [], "generator/constant_of_shape.cc"),
    ("ai.onnx", "Range", 11, None, [0, 1, 2], [], "generator/range.cc"),
    ("ai.onnx", "CumSum", 11, None, [1], [], "math/cumsum.cc"),
    ("ai.onnx", "TopK", 10, None, [1], [], "math/topk.cc"),
    ("ai.onnx", "MatMulInteger", 10, None, [2, 3], [], "math/matmul_integer.cc"),
    ("ai.onnx", "Dropout", 12, None, [1, 2], [], "nn/dropout.cc"),
    ("ai.onnx", "NonMaxSuppression", 10, None, [2, 3, 4], [], "object_detection/non_max_suppression.cc"),
    *[("ai.onnx", op, 7, None, [4], [], f"rnn/{op.lower()}.cc") for op in ("GRU", "LSTM", "RNN")],
    ("ai.onnx", "If", 1, None, [0], [], "controlflow/if.cc"),
    ("ai.onnx", "Loop", 1, None, [0, 1], [], "controlflow/loop.cc"),
    ("ai.onnx", "Scan", 8, 8, [0], [], "controlflow/scan.cc"),
    ("ai.onnx", "ReduceSum", 13, None, [1], [], "reduction/reduction_ops.cc"),
    *[("ai.onnx", op, 18, None, [1], [], "reduction/reduction_ops.cc")
      for op in ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
                 "ReduceLogSumExp", "ReduceSumSquare")],
    ("ai.onnx", "MemcpyFromHost", 1, None, [0], [], "cuda_execution_provider.cc"),
    ("ai.onnx", "MemcpyToHost", 1, None, [], [0], "cuda_execution_provider.cc"),
    ("ai.onnx", "DynamicSlice", 1, None, [1, 2, 3], [], _MS + "tensor/dynamicslice.cc"),
    ("com.microsoft", "BitmaskDropout", 1, None, [1, 2], [], _MS + "math/bitmask_dropout.cc"),
    ("com.microsoft", "BiasDropout", 1, None, [3, 4], [], _MS + "math/bias_dropout.cc"),
    ("com.microsoft", "BitmaskBiasDropout", 1, None, [3, 4], [], _MS + "math/bias_dropout.cc"),
    ("com.microsoft", "Trilu", 1, None, [1], [], _MS + "tensor/trilu.cc"),
    ("com.microsoft", "ConvTransposeWithDynamicPads", 1, None, [2], [], _MS + "conv_transpose_with_dynamic_pads.cc"),
    ("com.microsoft", "Attention", 1, None, [6], [], _MS + "bert/attention.cc"),
    ("com.microsoft", "MultiHeadAttention", 1, None, [8], [], _MS + "bert/multihead_attention.cc"),
    ("com.microsoft", "GroupQueryAttention", 1, None, [6], [], _MS + "bert/group_query_attention.cc"),
    ("com.microsoft", "SparseAttention", 1, None, [7], [], _MS + "sparse/sparse_attention.cc"),
    ("com.microsoft", "DecoderMaskedMultiHeadAttention", 1, None, [7, 8], [],
     _MS + "bert/decoder_masked_multihead_attention.cc"),
    ("com.microsoft", "DecoderMaskedSelfAttention", 1, None, [6, 7], [], _MS + "bert/decoder_masked_self_attention.cc"),
    ("com.microsoft", "RelativePositionBias", 1, None, [1, 2], [], _MS + "bert/relative_attn_bias.cc"),
    ("com.microsoft", "RemovePadding", 1, None, [], [3], _MS + "bert/remove_padding.cc"),
    ("com.microsoft", "QAttention", 1, None, [3, 4, 6, 7], [], _MS + "quantization/attention_quantization.cc"),
    ("com.microsoft", "QOrderedAttention", 1, None, [1, 2, 3, 4, 14, 15, 16], [],
     _MS + "quantization/qordered_ops/qordered_attention.cc"),
    ("com.microsoft", "QOrderedLayerNormalization", 1, None, [1, 4], [],
     _MS + "quantization/qordered_ops/qordered_layer_norm.cc"),
    ("com.microsoft", "QOrderedLongformerAttention", 1, None, [1, 3, 5, 6, 9, 11, 13], [],
     _MS + "quantization/qordered_ops/qordered_longformer_attention.cc"),
    ("com.microsoft", "QOrderedMatMul", 1, None, [1, 4, 7], [], _MS + "quantization/qordered_ops/qordered_matmul.cc"),
    ("com.microsoft", "QuantizeWithOrder", 1, None, [1], [], _MS + "quantization/qordered_ops/qordered_qdq.cc"),
    ("com.microsoft", "DequantizeWithOrder", 1, None, [1], [], _MS + "quantization/qordered_ops/qordered_qdq.cc"),
    ("com.microsoft", "QOrderedGelu", 1, None, [1, 2], [], _MS + "quantization/qordered_ops/qordered_unary_ops.cc"),
    ("com.microsoft", "BeamSearch", 1, None, [0, 1, 2, 3, 4, 5, 6, 9, 10, 11], [0, 1], _MS + "transformers/beam_search.cc"),
    ("com.microsoft", "WhisperBeamSearch", 1, None, [0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 14], [0, 1],
     _MS + "transformers/beam_search.cc"),
    ("com.microsoft", "GreedySearch", 1, None, [0, 1, 2, 3, 6], [0], _MS + "transformers/greedy_search.cc"),
    ("com.microsoft", "Sampling", 1, None, [0, 1, 2, 3, 6], [0, 1], _MS + "transformers/sampling.cc"),
]


def non_float_types(text: str) -> dict:
    """``{domain: {op: [[since, until, {param: [non-float types]}], ...]}}`` of the CUDA EP's kernels."""
    out: dict = {}
    provider = domain = op = None
    for line in text.splitlines():
        heading = kernels._PROVIDER_HEADING.match(line)
        if heading:
            provider, domain, op = heading.group(1), None, None
            continue
        if provider != PROVIDER or not line.startswith("|"):
            continue
        found = kernels._DOMAIN_ROW.match(line)
        if found:
            domain, op = found.group(1), None
            continue
        cells = line.split("|")[1:-1]
        if len(cells) != 4 or not cells[2].strip() or cells[2].strip() == "OpSet Version" or set(cells[2]) <= {"-"}:
            continue
        op = cells[0].strip() or op
        since, until = kernels.parse_opset(cells[2])
        params = {}
        for part in cells[3].split("<br/>"):
            m = kernels._PARAM.match(part.strip())
            items = kernels._top_level_items(m.group(2))
            params[m.group(1)] = sorted(item[len("tensor("):-1] for item in items if item.startswith("tensor(")
                                        and item[len("tensor("):-1] not in kernels.FLOAT_TYPES)
        out.setdefault(domain, {}).setdefault(op, []).append([since, until, params])
    for ops in out.values():
        for ranges in ops.values():
            ranges.sort(key=lambda r: r[0])
    return out


def build(source: Path = kernels.DEFAULT_SOURCE) -> dict:
    text = gzip.decompress(source.read_bytes()).decode("utf-8")
    memory: dict = {}
    for domain, op, since, until, inputs, outputs, file in MEMORY:
        memory.setdefault(domain, {}).setdefault(op, []).append(
            {"since": since, "until": until, "cpu_inputs": inputs, "cpu_outputs": outputs,
             "file": file if file.startswith("onnxruntime/") else _CUDA + file})
    return {
        "source": {
            "int_types": f"{kernels._markdown_name(source)} at onnxruntime@{kernels.read_commit(source)}",
            "memory": {"file": "the KernelDefBuilder registrations of the files below",
                       "onnxruntime_commit": MEMORY_COMMIT},
            **{name: {"file": file, "onnxruntime_commit": commit} for name, (file, commit) in SOURCES.items()},
        },
        "cpu_preferred": {
            # IsSmallInitializer: an initializer of at most this many elements may feed a CPU node
            "small_initializer_elements": 100,
            # an input of these types keeps a node on the device
            "device_types": ["float16", "bfloat16", "float8e4m3fn", "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz"],
        },
        "int_types": non_float_types(text),
        "memory": memory,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    from onnxmp.files import write_text_atomic

    write_text_atomic(args.output, json.dumps(build(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
