"""The kernel table per onnxruntime version (onnxmp/kernels.py, scripts/gen_kernel_table.py).

Each version's CPU facts come from that release's kernel registry, dumped in scripts/sources;
these tests hold the table to the dumps, and to the onnxruntime installed here: its registry
where the build lists it (plain onnxruntime), else (onnxruntime-training, which does not) what
its sessions load.
"""
from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
from pathlib import Path

import onnx
import onnx.helper as oh
import pytest

from onnxmp.kernels import KernelTable

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "gen_kernel_table.py"
PACKAGED = REPO_ROOT / "onnxmp" / "data" / "ort_kernels.json"
TIES = REPO_ROOT / "onnxmp" / "data" / "ort_kernel_ties.json"
REGENERATE = ("python scripts/gen_kernel_table.py --dump (under that plain onnxruntime), then "
              "python scripts/gen_kernel_table.py")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_kernel_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _generator()


@pytest.fixture(scope="module")
def table() -> KernelTable:
    return KernelTable.default()


def _dump_rows(version: str) -> list[list]:
    return gen.read_dump(gen.dumps()[version])["rows"]


def _table_cpu(version: str) -> dict:
    """The packaged table's CPU kernels of ``version``, shaped as ``kernels_of`` gives them."""
    out: dict = {}
    for domain, ops in json.loads(PACKAGED.read_text())["providers"]["CPUExecutionProvider"].items():
        for op, rows in ops.items():
            ranges = [[since, until, params] for since, until, params, versions in rows if version in versions]
            if ranges:
                out.setdefault(domain, {})[op] = ranges
    return out


def _registry_ties(rows: list[list]) -> dict[tuple, set[frozenset[str]]]:
    """(domain, op, since) -> tie groups of a CPU registry: parameters that take the same single
    float type in every typed kernel of a registration."""
    floats = {f"tensor({t})" for t in gen.FLOAT_TYPES}
    registrations: dict[tuple, list[dict[str, set[str]]]] = {}
    for domain, op, since, _until, params in rows:
        if domain in ("ai.onnx", "com.microsoft"):
            registrations.setdefault((domain, op, since), []).append(
                {p: floats & set(ts) for p, ts in params.items()})
    found: dict[tuple, set[frozenset[str]]] = {}
    for key, defs in registrations.items():
        params = sorted({p for d in defs for p, ts in d.items() if ts})
        groups: list[set[str]] = []
        for a, b in itertools.combinations(params, 2):
            pairs = {(x, y) for d in defs for x in d.get(a, ()) for y in d.get(b, ())}
            seen_a = {x for d in defs for x in d.get(a, ())}
            seen_b = {y for d in defs for y in d.get(b, ())}
            if pairs == {(x, y) for x in seen_a for y in seen_b}:
                continue  # every combination has a kernel
            assert all(x == y for x, y in pairs), f"{key}: {a}/{b} is a combination list, not a tie: {pairs}"
            joined = [g for g in groups if a in g or b in g]
            merged = {a, b}.union(*joined)
            groups = [g for g in groups if g not in joined] + [merged]
        if groups:
            found[key] = {frozenset(g) for g in groups}
    return found


def _check_ties(table: KernelTable, version: str, rows: list[list]) -> None:
    found = _registry_ties(rows)
    assert found, "the registry shows no tie at all: the detection is broken"
    view = table.for_version(version)
    for (domain, op, since), groups in found.items():
        assert set(view.tied_params("cpu", domain, op, since)) == groups, (version, domain, op, since)
    for entry in json.loads(TIES.read_text())["ties"]:
        if entry["provider"] == "CPUExecutionProvider" and version in entry["ort"]:
            assert (entry["domain"], entry["op"], entry["since"]) in found, (version, entry)


# --- the versions the table knows --------------------------------------------------------------


def test_versions_and_their_sources(table):
    assert {"1.19.2", "1.31.1", "1.32.0"} <= set(table.versions)
    assert tuple(gen.dumps()) == table.versions
    for version in table.versions:
        sources = table.sources[version]
        assert "get_all_opkernel_def" in sources["CPUExecutionProvider"] and version in sources["CPUExecutionProvider"]
        assert "OperatorKernels.md" in sources["CUDAExecutionProvider"]


def test_version_specs(table):
    assert table.versions_of(None) == table.versions_of("all") == table.versions
    assert table.versions_of("1.32.0") == ("1.32.0",)
    assert table.versions_of("1.25.0") == ("1.19.2",)  # the newest known at or below it
    assert table.versions_of("9.0") == (table.versions[-1],)
    assert table.versions_of("1.32.0, 1.19.2") == ("1.19.2", "1.32.0")
    assert table.for_version("1.32.0") is table.for_version("1.32") is KernelTable.default("1.32.0")
    assert table.for_version("1.32.0").for_version("all") is table


def test_a_fact_holds_for_several_versions_only_where_it_holds_in_each(table):
    # CPU SkipLayerNormalization: float only in 1.19.2, float16 too in 1.32.0.
    old, new = table.for_version("1.19.2"), table.for_version("1.32.0")
    args = ("cpu", "com.microsoft", "SkipLayerNormalization", 1, None, "float16")
    assert old.supports(*args) is False and new.supports(*args) is True
    assert table.supports(*args) is False and table.for_version("1.19.2,1.32.0").supports(*args) is False
    # CPU Acos: 1.19.2 registers 7+, 1.32.0 [7, 21] and 22+; opset 22 has a kernel in each.
    assert old.kernel_params("cpu", "", "Acos", 22) == new.kernel_params("cpu", "", "Acos", 22) == {"T": ("float",)}
    assert table.has_kernel("cpu", "", "Acos", 22)
    # An op only the newer releases register has no kernel for every version.
    assert new.has_kernel("cpu", "", "RMSNormalization", 23) and not old.has_kernel("cpu", "", "RMSNormalization", 23)
    assert table.has_kernel("cpu", "", "RMSNormalization", 23) is False
    assert table.supports("cpu", "", "RMSNormalization", 23, "T", "float") is None
    # CUDA's facts are one document's for every version.
    assert old.kernel_params("cuda", "", "Conv", 22) == new.kernel_params("cuda", "", "Conv", 22)


def test_ties_of_several_versions_add_up(table):
    # Any version's tie constrains a model that must load in each.
    assert table.for_version("1.19.2").accepts("cpu", "", "LayerNormalization", 16,
                                               {"T": "float", "U": "double", "V": "float"}) is False
    assert table.for_version("1.32.0").accepts("cpu", "", "LayerNormalization", 16,
                                               {"T": "double", "U": "float", "V": "double"}) is True
    assert table.accepts("cpu", "", "LayerNormalization", 16, {"T": "double", "U": "float", "V": "double"}) is False
    # OneHot-28 exists in 1.32.0 alone; its tie is that version's.
    assert table.for_version("1.32.0").tied_params("cpu", "", "OneHot", 28) == (frozenset({"T1", "T2", "T3"}),)
    assert table.for_version("1.31.1").tied_params("cpu", "", "OneHot", 28) == ()


# --- the dumps ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", list(gen.dumps()))
def test_table_holds_each_dump(version):
    assert _table_cpu(version) == gen.kernels_of(_dump_rows(version))


@pytest.mark.parametrize("version", list(gen.dumps()))
def test_cpu_ties_match_each_dump(table, version):
    _check_ties(table, version, _dump_rows(version))


def test_dump_is_refused_on_a_build_without_a_registry(monkeypatch):
    # onnxruntime-training lists no kernels: --dump must say so rather than write an empty release.
    import types

    fake = types.ModuleType("onnxruntime")
    fake.__version__ = "0.0.0"
    capi = types.ModuleType("onnxruntime.capi")
    capi._pybind_state = types.ModuleType("onnxruntime.capi._pybind_state")
    for name, module in (("onnxruntime", fake), ("onnxruntime.capi", capi),
                         ("onnxruntime.capi._pybind_state", capi._pybind_state)):
        monkeypatch.setitem(__import__("sys").modules, name, module)
    with pytest.raises(SystemExit, match="does not expose get_all_opkernel_def"):
        gen.dump_installed()
    assert "0.0.0" not in gen.dumps()


# --- the installed onnxruntime -----------------------------------------------------------------


def _installed(table):
    onnxruntime = pytest.importorskip("onnxruntime")
    if onnxruntime.__version__ not in table.versions:
        pytest.skip(f"the kernel table knows onnxruntime {', '.join(table.versions)}, not the installed "
                    f"{onnxruntime.__version__}: add it with {REGENERATE}")
    return onnxruntime


def test_cpu_registry_of_installed_onnxruntime(table):
    onnxruntime = _installed(table)
    from onnxruntime.capi import _pybind_state

    if not hasattr(_pybind_state, "get_all_opkernel_def"):
        pytest.skip(f"this onnxruntime {onnxruntime.__version__} build (onnxruntime-training) lists no kernels; "
                    "test_cpu_kernels_load_in_installed_onnxruntime checks it through its sessions")
    rows = gen.registry_rows(_pybind_state)
    assert rows == _dump_rows(onnxruntime.__version__)
    assert _table_cpu(onnxruntime.__version__) == gen.kernels_of(rows)
    _check_ties(table, onnxruntime.__version__, rows)


_ELEM = {"float": onnx.TensorProto.FLOAT, "double": onnx.TensorProto.DOUBLE,
         "float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}


def _one_type_schema(op: str, opset: int):
    """onnx's schema of ``op`` at ``opset`` and the types it allows, when every input and output is
    typed by one parameter and no attribute is required (so a one-node model needs nothing but
    that type); else None."""
    try:
        schema = onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return None
    formals = [*schema.inputs, *schema.outputs]
    params = {f.type_str for f in formals}
    if len(params) != 1 or any(a.required for a in schema.attributes.values()):
        return None
    param = params.pop()
    constraint = [c for c in schema.type_constraints if c.type_param_str == param]
    return (schema, set(constraint[0].allowed_type_strs)) if constraint else None


def _loads(ort, schema, opset: int, dtype: str, saved: Path) -> bool | None:
    """Whether onnxruntime's CPU EP runs a one-node ``dtype`` model of ``schema`` with a kernel of
    that type: False when no kernel takes it (refused, or float16 run through inserted Casts);
    None when the session fails for another reason."""
    Option = onnx.defs.OpSchema.FormalParameterOption
    inputs = [f"x{i}" for i, f in enumerate(schema.inputs) if f.option != Option.Optional]
    outputs = [f"y{i}" for i, f in enumerate(schema.outputs) if f.option != Option.Optional]
    elem = _ELEM[dtype]
    graph = oh.make_graph([oh.make_node(schema.name, inputs, outputs)], "probe",
                          [oh.make_tensor_value_info(n, elem, None) for n in inputs],
                          [oh.make_tensor_value_info(n, elem, None) for n in outputs])
    opsets = [oh.make_opsetid("", opset)]
    model = oh.make_model(graph, opset_imports=opsets, ir_version=min(10, oh.find_min_ir_version_for(opsets)))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.optimized_model_filepath = str(saved)  # after onnxruntime's mandatory Cast insertion
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 (onnxruntime raises its own types per status)
        return False if "Could not find an implementation" in str(exc) else None
    # The CPU EP runs a float16 node without a float16 kernel through Casts to its float kernel.
    return [n.op_type for n in onnx.load(str(saved)).graph.node] == [schema.name]


def test_cpu_kernels_load_in_installed_onnxruntime(table, tmp_path):
    """The runtime is the judge: every one-type op of the installed version's CPU table loads in
    each float type exactly when the table says its kernel takes that type (the only check the
    training build allows, which lists no registry)."""
    ort = _installed(table)
    view = table.for_version(ort.__version__)
    newest = max(s.since_version for s in onnx.defs.get_all_schemas_with_history() if s.domain == "")
    answers, mismatches = 0, []
    for op, ranges in sorted(_table_cpu(ort.__version__)["ai.onnx"].items()):
        for since, _until, _params in ranges:
            if not 7 <= since <= newest or (found := _one_type_schema(op, since)) is None:
                continue
            schema, allowed = found
            for dtype in view.float_types:
                if f"tensor({dtype})" not in allowed:
                    continue
                loaded = _loads(ort, schema, since, dtype, tmp_path / "probe.onnx")
                if loaded is None:
                    continue  # refused for another reason (an opset newer than this onnxruntime's)
                answers += 1
                if loaded != bool(view.supports("cpu", "", op, since, None, dtype)):
                    mismatches.append((op, since, dtype, loaded))
    assert answers > 300, answers
    assert not mismatches, mismatches[:10]
