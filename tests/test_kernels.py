"""Tests for the ORT kernel coverage table (onnxmp/kernels.py, scripts/gen_kernel_table.py).

Expected values are what ORT's OperatorKernels.md (the commit recorded in the
JSON header; CUDA) and each onnxruntime's kernel registry (CPU) actually list, not what one
might guess.  The table answers for every version it knows unless told one
(tests/test_kernel_versions.py checks the versions against each other and the installed runtime).
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
REFERENCE = REPO_ROOT / "scripts" / "sources" / "onnxruntime-OperatorKernels.md.gz"
PACKAGED = REPO_ROOT / "onnxmp" / "data" / "ort_kernels.json"
TIES = REPO_ROOT / "onnxmp" / "data" / "ort_kernel_ties.json"


@pytest.fixture(scope="module")
def table() -> KernelTable:
    return KernelTable.default()


def test_default_is_cached_and_records_source(table):
    assert KernelTable.default() is table
    assert KernelTable.default("all") is table and table.ort_versions == table.versions
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
    # onnxruntime 1.19.2's CPU LayerNormalization is float and double only: not every version has float16.
    assert "LayerNormalization" not in cpu
    assert table.for_version("1.32.0").ops_with_dtype("cpu", "float16")["LayerNormalization"] == [(1, 16), (17, None)]
    assert "Gelu" in table.ops_with_dtype("cuda", "float16", domain="com.microsoft")
    bf16 = table.ops_with_dtype("cuda", "bfloat16")
    assert bf16["Add"] == [(13, 13), (14, None)]


def test_packaged_json_is_up_to_date(tmp_path):
    out = tmp_path / "ort_kernels.json"
    subprocess.run([sys.executable, str(SCRIPT), str(REFERENCE), "-o", str(out)], check=True, capture_output=True)
    assert out.read_bytes() == PACKAGED.read_bytes(), "run scripts/gen_kernel_table.py and commit the result"


def test_packaged_json_is_small():
    assert PACKAGED.stat().st_size < 200_000


# --- tied type parameters and registered combinations (onnxmp/data/ort_kernel_ties.json) ---


def test_cuda_batchnorm_ties(table):
    # batch_norm.cc binds T1/T2 (15+) and U (14) to GetTensorType<T>(): a float16 X with
    # float32 scale/mean has no CUDA kernel (ResNet-50 ran every BN on the CPU EP).
    assert table.tied_params("cuda", "", "BatchNormalization", 15) == (frozenset({"T", "T1", "T2"}),)
    assert table.tied_params("CUDAExecutionProvider", "ai.onnx", "BatchNormalization", 1000) == (
        frozenset({"T", "T1", "T2"}),)
    assert table.tied_params("cuda", "", "BatchNormalization", 14) == (frozenset({"T", "U"}),)
    # Opsets 7-13 have one type parameter: nothing to tie.
    assert table.tied_params("cuda", "", "BatchNormalization", 13) == ()
    assert table.tied_params("cuda", "com.ms.internal.nhwc", "BatchNormalization", 15) == (
        frozenset({"T", "T1", "T2"}),)


def test_ops_without_ties(table):
    assert table.tied_params("cuda", "", "Conv", 17) == ()
    assert table.tied_params("cpu", "", "MatMul", 17) == ()
    # Parameters registered as independent lists are not tied (CUDA Pow base/exponent, Cast in/out).
    assert table.tied_params("cuda", "", "Pow", 15) == ()
    assert table.tied_params("cuda", "", "Cast", 19) == ()
    assert table.tied_params("cuda", "", "NoSuchOp", 17) == ()


def test_tie_opset_boundaries(table):
    # RMSNormalization and the ONNX Attention exist from 23; CUDA ties T/V and T1/T2/U.
    assert table.tied_params("cuda", "", "RMSNormalization", 22) == ()
    assert table.tied_params("cuda", "", "RMSNormalization", 23) == (frozenset({"T", "V"}),)
    assert table.tied_params("cuda", "", "Attention", 22) == ()
    assert table.tied_params("cuda", "", "Attention", 23) == (frozenset({"T1", "T2", "U"}),)
    assert table.tied_params("cuda", "", "Attention", 24) == (frozenset({"T1", "T2", "U"}),)
    # CPU's former contrib LayerNormalization (1-16) ties T/V (1.19.2: T/U/V, U as well); the
    # opset-17 kernel has one input type parameter.
    new = table.for_version("1.32.0")
    assert new.tied_params("cpu", "", "LayerNormalization", 16) == (frozenset({"T", "V"}),)
    assert table.for_version("1.19.2").tied_params("cpu", "", "LayerNormalization", 16) == (
        frozenset({"T", "U", "V"}),)
    assert set(table.tied_params("cpu", "", "LayerNormalization", 16)) == {
        frozenset({"T", "V"}), frozenset({"T", "U", "V"})}
    assert table.tied_params("cpu", "", "LayerNormalization", 17) == ()
    # CPU GridSample 16-19 registers float only; 20+ float and double, tied.
    assert table.tied_params("cpu", "", "GridSample", 19) == ()
    assert table.tied_params("cpu", "", "GridSample", 20) == (frozenset({"T1", "T2"}),)


def test_contrib_ties(table):
    assert table.tied_params("cuda", "com.microsoft", "MatMulNBits", 1) == (frozenset({"T1", "T3"}),)
    assert table.tied_params("cpu", "com.microsoft", "MatMulNBits", 1) == (frozenset({"T1", "T3"}),)
    # The CPU tie is 1.31.1's and 1.32.0's registry's; 1.19.2 registers MatMulNBits for float alone.
    assert table.for_version("1.19.2").tied_params("cpu", "com.microsoft", "MatMulNBits", 1) == ()
    assert table.tied_params("cuda", "com.microsoft", "GroupQueryAttention", 1) == (frozenset({"T", "T_CACHE"}),)
    # MultiHeadAttention registers every float/low mix of T and QK: combinations, no tie.
    assert table.tied_params("cuda", "com.microsoft", "MultiHeadAttention", 1) == ()


def test_ties_unknown_provider_raises(table):
    for call in (table.tied_params, table.float_combos):
        with pytest.raises(OnnxMPError) as info:
            call("DmlExecutionProvider", "", "BatchNormalization", 15)
        assert info.value.hint and "cuda" in info.value.hint
    with pytest.raises(OnnxMPError):
        table.accepts("rocm", "", "BatchNormalization", 15, {"T": "float16"})


def test_float_combos(table):
    assert table.float_combos("cuda", "", "BatchNormalization", 15) is None
    combos = table.float_combos("cuda", "", "LayerNormalization", 16)
    assert {"T": "float16", "U": "float", "V": "float"} in combos
    assert {"T": "bfloat16", "U": "float", "V": "bfloat16"} in combos
    assert not any(c["T"] == "bfloat16" and c["V"] == "float" for c in combos)
    assert table.float_combos("cuda", "", "LayerNormalization", 17) == (
        {"T": "float", "U": "float"}, {"T": "double", "U": "float"},
        {"T": "float16", "U": "float"}, {"T": "bfloat16", "U": "float"})
    assert table.float_combos("cuda", "", "SimplifiedLayerNormalization", 1) == combos


def test_accepts_batchnorm(table):
    mixed = {"T": "float16", "T1": "float", "T2": "float"}
    assert table.accepts("cuda", "", "BatchNormalization", 15, mixed) is False
    assert table.accepts("cuda", "", "BatchNormalization", 15, dict.fromkeys(mixed, "float16")) is True
    assert table.accepts("cuda", "", "BatchNormalization", 15, dict.fromkeys(mixed, "float32")) is True
    assert table.accepts("cuda", "", "BatchNormalization", 14, {"T": "fp16", "U": "fp32"}) is False
    # Without ties a per-parameter answer: CPU has no float16 BatchNormalization at all.
    assert table.accepts("cpu", "", "BatchNormalization", 15, dict.fromkeys(mixed, "float16")) is False
    assert table.accepts("cuda", "", "BatchNormalization", 6, {"T": "float16"}) is None


def test_accepts_ignores_non_float_members(table):
    # A bool attn_mask leaves U out of the node's float types; a float one must match Q/K/V.
    assert table.accepts("cuda", "", "Attention", 23, {"T1": "float16", "T2": "float16"}) is True
    assert table.accepts("cuda", "", "Attention", 23, {"T1": "float16", "T2": "float16", "U": "float"}) is False
    # uint8 zero points leave T3 out; float16 A with float16 zero points is fine.
    assert table.accepts("cuda", "com.microsoft", "MatMulNBits", 1, {"T1": "float16"}) is True
    assert table.accepts("cuda", "com.microsoft", "MatMulNBits", 1, {"T1": "float16", "T3": "float"}) is False


def test_accepts_combos(table):
    # CUDA LayerNormalization 1-16: float16 X with float32 scale exists, bfloat16 with float32 does not.
    assert table.accepts("cuda", "", "LayerNormalization", 16, {"T": "float16", "V": "float"}) is True
    assert table.accepts("cuda", "", "LayerNormalization", 16, {"T": "bfloat16", "V": "float"}) is False
    assert table.accepts("cuda", "", "LayerNormalization", 16, {"T": "bfloat16", "V": "bfloat16"}) is True
    # Mean/InvStdDev (U) are float for every low-precision X.
    assert table.accepts("cuda", "", "LayerNormalization", 16, {"T": "float16", "U": "float16"}) is False
    assert table.accepts("cuda", "com.microsoft", "MultiHeadAttention", 1, {"T": "float16", "QK": "float"}) is True
    assert table.accepts("cuda", "com.microsoft", "MultiHeadAttention", 1, {"T": "float16", "QK": "bfloat16"}) is False


def test_table_without_ties_file():
    table = KernelTable.from_file(PACKAGED)
    assert table.tied_params("cuda", "", "BatchNormalization", 15) == ()
    assert table.float_combos("cuda", "", "LayerNormalization", 16) is None
    assert table.accepts("cuda", "", "BatchNormalization", 15, {"T": "float16", "T1": "float"}) is True
    with_ties = KernelTable.from_file(PACKAGED, TIES)
    assert with_ties.tied_params("cuda", "", "BatchNormalization", 15) == (frozenset({"T", "T1", "T2"}),)


def test_ties_file_is_consistent_with_kernel_table(table):
    data = json.loads(TIES.read_text())
    providers = json.loads(PACKAGED.read_text())["providers"]
    assert data["ties"] and data["combos"]
    for entry in data["ties"] + data["combos"]:
        where = (entry["provider"], entry["domain"], entry["op"], entry["since"])
        assert entry["provider"] in providers, where
        assert entry["file"].startswith("onnxruntime/") and entry["file"].endswith(".cc"), where
        assert entry["commit"] is None or len(entry["commit"]) == 40, where
        assert entry["until"] is None or entry["until"] >= entry["since"], where
        assert set(entry.get("ort", table.versions)) <= set(table.versions), where
        for version in entry.get("ort", table.versions):
            params = table.for_version(version).kernel_params(entry["provider"], entry["domain"], entry["op"],
                                                              entry["since"])
            assert params is not None, f"no kernel at {where} in {version}"
            for group in entry.get("groups", ()):
                # Parameters bound to one template type take the same float types (those the table lists);
                # a tie read from a registry (with "ort"; tests/test_kernel_versions.py checks it there) may
                # also be typed registrations that pair each float type with itself only (CPU OneHot-28:
                # bfloat16 values only with integer indices), so they share one at least.
                assert len(group) >= 2, where
                types = [set(params[p]) for p in group if p in params]
                if "ort" in entry:
                    assert set.intersection(*types), (where, version, group, params)
                else:
                    assert len({frozenset(t) for t in types}) <= 1, (where, version, group, params)
            for row in entry.get("types", ()):
                assert len(row) == len(entry["params"]), where
                for param, dtype in zip(entry["params"], row):
                    assert dtype in params[param], (where, version, param, dtype)


def test_ties_file_is_package_data():
    tomllib = pytest.importorskip("tomllib")
    import fnmatch

    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["onnxmp"]
    for path in (TIES, PACKAGED):
        assert any(fnmatch.fnmatch(path.relative_to(REPO_ROOT / "onnxmp").as_posix(), p) for p in patterns)
