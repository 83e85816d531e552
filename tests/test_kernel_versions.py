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


def _loads(ort, schema, opset: int, types: dict[str, str], saved: Path) -> bool | None:
    """Whether onnxruntime's CPU EP runs a one-node model of ``schema`` whose tensors of each type
    parameter hold ``types[param]`` with a kernel of those types: False when no kernel takes them
    (refused, or float16 run through inserted Casts); None when the session fails for another reason."""
    Option = onnx.defs.OpSchema.FormalParameterOption
    inputs = [(f"x{i}", f.type_str) for i, f in enumerate(schema.inputs) if f.option != Option.Optional]
    outputs = [(f"y{i}", f.type_str) for i, f in enumerate(schema.outputs) if f.option != Option.Optional]
    graph = oh.make_graph([oh.make_node(schema.name, [n for n, _ in inputs], [n for n, _ in outputs])], "probe",
                          [oh.make_tensor_value_info(n, _ELEM[types[t]], None) for n, t in inputs],
                          [oh.make_tensor_value_info(n, _ELEM[types[t]], None) for n, t in outputs])
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


def _probe_kernels(ort, view: KernelTable, saved: Path) -> tuple[int, list]:
    """(answers, mismatches): every one-type op of the installed version's CPU table, loaded in
    each float type its schema allows, against whether the table says its kernel takes it."""
    newest = max(s.since_version for s in onnx.defs.get_all_schemas_with_history() if s.domain == "")
    answers, mismatches = 0, []
    for op, ranges in sorted(_table_cpu(ort.__version__)["ai.onnx"].items()):
        for since, _until, _params in ranges:
            if not 7 <= since <= newest or (found := _one_type_schema(op, since)) is None:
                continue
            schema, allowed = found
            param = schema.inputs[0].type_str if schema.inputs else schema.outputs[0].type_str
            for dtype in view.float_types:
                if f"tensor({dtype})" not in allowed:
                    continue
                loaded = _loads(ort, schema, since, {param: dtype}, saved)
                if loaded is None:
                    continue  # refused for another reason (an opset newer than this onnxruntime's)
                answers += 1
                if loaded != bool(view.supports("cpu", "", op, since, None, dtype)):
                    mismatches.append((op, since, dtype, loaded))
    return answers, mismatches


def _probe_ties(ort, view: KernelTable, saved: Path) -> int:
    """Load each CPU tie of the installed version that onnx's schema can state (ai.onnx ops):
    float on every member loads, another float type on one member with float on the others does not."""
    probed = 0
    for entry in json.loads(TIES.read_text())["ties"]:
        if entry["provider"] != "CPUExecutionProvider" or ort.__version__ not in entry["ort"] or (
                entry["domain"] != "ai.onnx"):
            continue
        try:
            schema = onnx.defs.get_schema(entry["op"], entry["since"], "")
        except onnx.defs.SchemaError:
            continue  # onnxruntime's own op in the ONNX domain (LayerNormalization-1): no onnx schema
        if schema.since_version != entry["since"] or any(a.required for a in schema.attributes.values()):
            continue
        params = view.kernel_params("cpu", "", entry["op"], entry["since"])
        for group in entry["groups"]:
            other = [t for t in params[group[0]] if t != "float"]
            if not other:
                continue  # one float type: nothing to mix
            types = dict.fromkeys({f.type_str for f in [*schema.inputs, *schema.outputs]}, "float")
            assert _loads(ort, schema, entry["since"], types, saved) is True, entry
            assert view.accepts("cpu", "", entry["op"], entry["since"], {p: "float" for p in group})
            mixed = {**types, group[0]: other[0]}
            # Refused either way: no kernel, or (RMSNormalization, a function op) its expansion fails.
            assert _loads(ort, schema, entry["since"], mixed, saved) is not True, (entry, mixed)
            assert not view.accepts("cpu", "", entry["op"], entry["since"], {p: mixed[p] for p in group})
            probed += 1
    return probed


def test_cpu_kernels_of_installed_onnxruntime(table, tmp_path):
    """The installed version's CPU facts equal what it registers: its registry where the build
    lists it (plain onnxruntime), else (onnxruntime-training) what its sessions load, the runtime
    being the judge: every one-type op in each float type loads with a kernel of that type exactly
    when the table says it has one."""
    ort = _installed(table)
    from onnxruntime.capi import _pybind_state

    if hasattr(_pybind_state, "get_all_opkernel_def"):
        rows = gen.registry_rows(_pybind_state)
        assert rows == _dump_rows(ort.__version__)
        assert _table_cpu(ort.__version__) == gen.kernels_of(rows)
        return
    answers, mismatches = _probe_kernels(ort, table.for_version(ort.__version__), tmp_path / "probe.onnx")
    assert answers > 300, answers
    assert not mismatches, mismatches[:10]


def test_cpu_ties_of_installed_onnxruntime(table, tmp_path):
    """The installed version's CPU ties: those its registry shows, else (onnxruntime-training)
    those onnx's schemas can state, through sessions."""
    ort = _installed(table)
    from onnxruntime.capi import _pybind_state

    if hasattr(_pybind_state, "get_all_opkernel_def"):
        _check_ties(table, ort.__version__, gen.registry_rows(_pybind_state))
        return
    assert _probe_ties(ort, table.for_version(ort.__version__), tmp_path / "probe.onnx") >= 3


def test_session_probe_agrees_with_a_registry(table, tmp_path):
    """The probes the training build is checked by give the registry's answers where a build
    lists it (a probe that could not fail would check nothing)."""
    ort = _installed(table)
    from onnxruntime.capi import _pybind_state

    if not hasattr(_pybind_state, "get_all_opkernel_def"):
        pytest.skip("this build lists no registry to hold the probes to: test_cpu_kernels_of_installed_onnxruntime "
                    "probes it")
    view = table.for_version(ort.__version__)
    answers, mismatches = _probe_kernels(ort, view, tmp_path / "probe.onnx")
    assert answers > 300 and not mismatches, (answers, mismatches[:10])
    assert _probe_ties(ort, view, tmp_path / "probe.onnx") >= 3
    other = table.for_version(table.versions[0] if ort.__version__ != table.versions[0] else table.versions[-1])
    assert _probe_kernels(ort, other, tmp_path / "probe.onnx")[1], "another version's facts pass the probe"


def test_an_unknown_installed_version_skips_naming_the_commands(table, monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    monkeypatch.setattr(ort, "__version__", "1.25.0")
    with pytest.raises(pytest.skip.Exception, match="not the installed 1.25.0: add it with python scripts/gen_kernel"):
        _installed(table)


def test_numerics_and_combos_per_version():
    """Entries with "ort" hold for those versions only; a fact for several holds where it holds in each."""
    row = [1, None, {"T": ["float", "float16"], "U": ["float", "float16"]}, ["1.0.0", "2.0.0"]]
    data = {"versions": {"1.0.0": {}, "2.0.0": {}}, "float_types": ["float", "double", "float16", "bfloat16"],
            "providers": {"CUDAExecutionProvider": {"ai.onnx": {"Op": [row]}}}}
    where = {"provider": "CUDAExecutionProvider", "domain": "ai.onnx", "op": "Op", "since": 1, "until": None}
    ties = {"combos": [{**where, "params": ["T", "U"], "types": [["float", "float"], ["float16", "float"]],
                        "ort": ["1.0.0"]},
                       {**where, "params": ["T", "U"], "types": [["float", "float"], ["float16", "float16"]],
                        "ort": ["2.0.0"]}]}
    numerics = {"kernels": [{**where, "types": ["float16"], "compute": "float32", "ort": ["2.0.0"]}]}
    table = KernelTable(data, ties, numerics)
    mixed = {"T": "float16", "U": "float"}
    assert table.for_version("1.0.0").accepts("cuda", "", "Op", 1, mixed) is True
    assert table.for_version("2.0.0").accepts("cuda", "", "Op", 1, mixed) is False
    assert table.float_combos("cuda", "", "Op", 1) == ({"T": "float", "U": "float"},)
    assert table.for_version("2.0.0").computes_in_float32("cuda", "", "Op", 1, "float16") is True
    assert table.for_version("1.0.0").numerics("cuda", "", "Op", 1, "float16") is None
    assert table.computes_in_float32("cuda", "", "Op", 1, "float16") is False
