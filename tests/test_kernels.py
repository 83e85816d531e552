"""Tests for the ORT kernel coverage table (onnxmp/kernels.py, scripts/gen_kernel_table.py).

Expected values are what ORT's OperatorKernels.md (the commit recorded in the
JSON header) actually lists, not what one might guess.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from onnxmp.errors import OnnxMPError
from onnxmp.kernels import KernelTable

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "gen_kernel_table.py"
REFERENCE = REPO_ROOT.parent / "shared" / "reference" / "onnxruntime-OperatorKernels.md"
PACKAGED = REPO_ROOT / "onnxmp" / "data" / "ort_kernels.json"


@pytest.fixture(scope="module")
def table() -> KernelTable:
    return KernelTable.default()


def test_default_is_cached_and_records_source(table):
    assert KernelTable.default() is table
    assert "OperatorKernels.md" in table.source
    assert table.providers == ("CPUExecutionProvider", "CUDAExecutionProvider")


@pytest.mark.parametrize("op", ["Conv", "MatMul", "Gemm"])
def test_cuda_compute_ops_have_float16_at_opset_17(table, op):
    assert table.supports("CUDAExecutionProvider", "ai.onnx", op, 17, "T", "float16") is True
    assert table.supports("CUDAExecutionProvider", "ai.onnx", op, 17, "T", "float") is True


def test_cpu_matmul_is_float_and_double_only(table):
    assert table.kernel_params("cpu", "", "MatMul", 17) == {"T": ("float", "double")}
    assert table.supports("cpu", "", "MatMul", 17, "T", "float16") is False
    assert table.supports("cpu", "", "MatMul", 17, "T", "bfloat16") is False


def test_empty_domain_means_ai_onnx(table):
    assert table.supports("cuda", "", "Conv", 17, "T", "float16") is True
    assert table.kernel_params("cuda", "", "Conv", 17) == table.kernel_params("cuda", "ai.onnx", "Conv", 17)


def test_opset_outside_every_range(table):
    # CUDA Add starts at [7, 12]; CPU Clip's newest range is 13+, its oldest [6, 10].
    assert table.supports("cuda", "", "Add", 6, "T", "float16") is None
    assert table.has_kernel("cuda", "", "Add", 6) is False
    assert table.has_kernel("cpu", "", "Clip", 5) is False
    assert table.has_kernel("cuda", "", "Add", 7) is True


def test_range_boundaries(table):
    # CUDA Add: [7, 12] no bfloat16, 13 exact and 14+ with bfloat16.
    assert table.supports("cuda", "", "Add", 7, "T", "bfloat16") is False
    assert table.supports("cuda", "", "Add", 12, "T", "bfloat16") is False
    assert table.supports("cuda", "", "Add", 13, "T", "bfloat16") is True
    assert table.supports("cuda", "", "Add", 14, "T", "bfloat16") is True
    assert table.supports("cuda", "", "Add", 1000, "T", "bfloat16") is True  # 14+ is open-ended
    # CPU Clip: [6, 10] and 11 (exact) float only, 12 (exact) and 13+ add float16.
    assert table.supports("cpu", "", "Clip", 10, "T", "float16") is False
    assert table.supports("cpu", "", "Clip", 11, "T", "float16") is False
    assert table.supports("cpu", "", "Clip", 12, "T", "float16") is True
    assert table.supports("cpu", "", "Clip", 13, "T", "float16") is True
    # CUDA Conv: [11, 21] lacks bfloat16, 22+ has it.
    assert table.supports("cuda", "", "Conv", 21, "T", "bfloat16") is False
    assert table.supports("cuda", "", "Conv", 22, "T", "bfloat16") is True


def test_ended_range_without_successor(table):
    # Upsample was deprecated at opset 10: kernels end with the exact range 9.
    assert table.has_kernel("cuda", "", "Upsample", 9) is True
    assert table.has_kernel("cuda", "", "Upsample", 10) is False
    assert table.supports("cuda", "", "Upsample", 10, None, "float") is None


def test_param_specific_answers(table):
    # CUDA Pow [13, 14]: base T takes bfloat16, exponent T1 does not (15+ both do).
    assert table.supports("cuda", "", "Pow", 14, "T", "bfloat16") is True
    assert table.supports("cuda", "", "Pow", 14, "T1", "bfloat16") is False
    assert table.supports("cuda", "", "Pow", 15, "T1", "bfloat16") is True
    # CUDA LayerNormalization 17+: T any float, the Mean/InvStdDev outputs (U) float only.
    assert table.kernel_params("cuda", "", "LayerNormalization", 17) == {
        "T": ("float", "double", "float16", "bfloat16"),
        "U": ("float",),
    }
    assert table.supports("cuda", "", "LayerNormalization", 17, "U", "float16") is False
    # An int-only parameter is kept (with no float type), so it answers False
    # rather than falling back to "any parameter".
    assert table.kernel_params("cuda", "", "LSTM", 17)["T1"] == ()
    assert table.supports("cuda", "", "LSTM", 17, "T1", "float16") is False
    assert table.supports("cuda", "", "LSTM", 17, "T", "float16") is True


def test_resize_params(table):
    # The kernel only constrains X/Y (T1); `scales` is literally tensor(float)
    # in the schema and roi (T2) is left unconstrained, so neither appears.
    assert table.kernel_params("cuda", "", "Resize", 19) == {"T1": ("float", "double", "float16")}
    assert table.supports("cuda", "", "Resize", 19, "T1", "float16") is True
    assert table.supports("cuda", "", "Resize", 19, "T1", "bfloat16") is False
    # Opset 10 Resize names its parameter T.
    assert table.kernel_params("cuda", "", "Resize", 10) == {"T": ("float", "double", "float16")}
    assert table.supports("cpu", "", "Resize", 19, "T1", "float16") is False


def test_unknown_param_falls_back_to_any_param(table):
    assert table.supports("cuda", "", "Resize", 19, "T2", "float16") is True
    assert table.supports("cuda", "", "Resize", 19, None, "float16") is True
    assert table.supports("cpu", "", "Resize", 19, "T2", "float16") is False
    assert table.supports("cuda", "", "LayerNormalization", 17, None, "float16") is True


def test_batchnorm_opset_15_on_cuda(table):
    params = table.kernel_params("cuda", "", "BatchNormalization", 15)
    assert params == {
        "T": ("float", "double", "float16"),
        "T1": ("float", "double", "float16"),
        "T2": ("float", "double", "float16"),
    }
    assert table.supports("cuda", "", "BatchNormalization", 15, "T2", "float16") is True
    assert table.supports("cuda", "", "BatchNormalization", 15, "T", "bfloat16") is False
    # Opset 14 is its own registration with T/U names.
    assert set(table.kernel_params("cuda", "", "BatchNormalization", 14)) == {"T", "U"}
    assert table.supports("cpu", "", "BatchNormalization", 15, "T", "float16") is False


@pytest.mark.parametrize("op", ["ReduceMean", "Softmax", "Erf", "LSTM", "GRU"])
def test_cuda_float16_at_opset_17(table, op):
    assert table.supports("cuda", "", op, 17, None, "float16") is True


def test_gelu_domains_on_cuda(table):
    # ai.onnx Gelu only exists from opset 20; the contrib op covers older models.
    assert table.supports("cuda", "", "Gelu", 17, None, "float16") is None
    assert table.supports("cuda", "", "Gelu", 20, None, "float16") is True
    assert table.supports("cuda", "com.microsoft", "Gelu", 1, None, "float16") is True


def test_unknown_op_returns_none(table):
    assert table.supports("cuda", "", "NoSuchOp", 17, None, "float16") is None
    assert table.supports("cuda", "no.such.domain", "Conv", 17, None, "float16") is None
    assert table.has_kernel("cpu", "", "NoSuchOp", 17) is False
    assert table.kernel_params("cpu", "", "NoSuchOp", 17) is None


def test_provider_aliases(table):
    for alias in ("cuda", "CUDA", "CUDAExecutionProvider"):
        assert table.supports(alias, "", "MatMul", 17, "T", "float16") is True
    for alias in ("cpu", "Cpu", "CPUExecutionProvider"):
        assert table.supports(alias, "", "MatMul", 17, "T", "float16") is False


def test_unknown_provider_raises(table):
    with pytest.raises(OnnxMPError) as info:
        table.supports("DmlExecutionProvider", "", "MatMul", 17, "T", "float16")
    assert info.value.hint and "cuda" in info.value.hint
    with pytest.raises(OnnxMPError):
        table.has_kernel("tensorrt", "", "MatMul", 17)
    with pytest.raises(OnnxMPError):
        table.ops_with_dtype("rocm", "float16")


def test_non_float_dtype_raises(table):
    with pytest.raises(OnnxMPError):
        table.supports("cuda", "", "MatMul", 17, "T", "int64")
    assert table.supports("cuda", "", "MatMul", 17, "T", "fp16") is True
    assert table.supports("cuda", "", "MatMul", 17, "T", "float32") is True


def test_ops_with_dtype(table):
    cuda = table.ops_with_dtype("cuda", "float16")
    assert (13, None) in cuda["MatMul"]
    assert (11, 21) in cuda["Conv"] and (22, None) in cuda["Conv"]
    cpu = table.ops_with_dtype("cpu", "float16")
    assert "MatMul" not in cpu
    assert cpu["LayerNormalization"] == [(1, 16), (17, None)]
    assert "Gelu" in table.ops_with_dtype("cuda", "float16", domain="com.microsoft")
    bf16 = table.ops_with_dtype("cuda", "bfloat16")
    assert bf16["Add"] == [(13, 13), (14, None)]


@pytest.mark.skipif(not REFERENCE.is_file(), reason=f"reference table {REFERENCE} not available")
def test_packaged_json_is_up_to_date(tmp_path):
    out = tmp_path / "ort_kernels.json"
    subprocess.run([sys.executable, str(SCRIPT), str(REFERENCE), "-o", str(out)], check=True, capture_output=True)
    assert out.read_bytes() == PACKAGED.read_bytes(), "run scripts/gen_kernel_table.py and commit the result"


def test_packaged_json_is_small():
    assert PACKAGED.stat().st_size < 200_000


def test_cpu_table_matches_installed_onnxruntime():
    pybind = pytest.importorskip("onnxruntime.capi._pybind_state")
    if not hasattr(pybind, "get_all_opkernel_def"):
        pytest.skip("this onnxruntime build does not expose get_all_opkernel_def (e.g. onnxruntime-training-cpu 1.19.2)")
    float_types = KernelTable.default().float_types
    documented = {
        (domain, op, since, until): {p: list(ts) for p, ts in params.items()}
        for domain, ops in json.loads(PACKAGED.read_text())["providers"]["CPUExecutionProvider"].items()
        for op, ranges in ops.items()
        for since, until, params in ranges
    }
    # ORT registers a typed kernel once per type (Abs<float>, Abs<double>, ...): one key, several defs.
    registered: dict[tuple, dict[str, set[str]]] = {}
    for kdef in pybind.get_all_opkernel_def():
        if kdef.provider != "CPUExecutionProvider":
            continue
        since, until = kdef.version_range
        key = (kdef.domain or "ai.onnx", kdef.op_name, since, None if until >= 2**31 - 1 else until)
        params = registered.setdefault(key, {})
        for p, types in kdef.type_constraints.items():
            params.setdefault(p, set()).update(types)
    # Kernel types change between releases within one opset range (Pad-21 gained bfloat16), so
    # types are only comparable against the build the table documents: the same registrations.
    differ = set(documented) ^ set(registered)
    if differ:
        import onnxruntime

        pytest.skip(f"onnxruntime {onnxruntime.__version__} is another build than the table's "
                    f"({len(differ)} CPU kernel registrations differ, e.g. {sorted(differ, key=str)[0]})")
    compared, mismatches = 0, []
    for key, params in registered.items():
        if key not in documented:
            continue
        installed = {p: [t for t in float_types if f"tensor({t})" in types] for p, types in params.items()}
        compared += 1
        if installed != documented[key]:
            mismatches.append((key, documented[key], installed))
    assert compared > 100
    assert not mismatches, mismatches[:10]
