"""Converted models against another git revision's, compared by meaning, not by bytes.

    python scripts/check_equivalence.py [--base main] [--with-tests] [--onnx-cases] [--save FILE] [--keep DIR]

Builds one set of input models (every bundled ``models/*.onnx``, the real exports in
``models/exports``, the hard calibration cases, zoo and benchmark transformer stacks,
seeded random graphs from ``tests/strategies.py``; ``--onnx-cases`` adds onnx's own
operator test models) and converts each under several options (float16 and bfloat16, a
few levels, ``keep_io_types`` both ways) twice: with this tree's onnxmp and with the
``--base`` revision's, checked out in a temporary ``git worktree``.  Each conversion runs
in a child process whose ``sys.path`` starts with one tree, so both see the same input
bytes.  ``--with-tests`` also captures every model the test suite hands to the converter.

Two converted models are *equivalent* when they hold the same nodes (op, domain, name,
inputs, outputs, attributes; order aside), the same initializer values and types (in
whichever graph they sit), the same graph inputs and outputs, and the same type for every
tensor both declare.  Node doc strings, attribute order, the order of initializers and
declarations, and which graph lists an outer initializer are not compared: they carry no
meaning.  Each difference is printed with its kind; the exit status is 0 when every pair
is equivalent.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

OPTIONS = [
    {},
    {"precision": "bfloat16"},
    {"keep_io_types": False},
    {"precision": "bfloat16", "keep_io_types": False},
    {"level": "unsafe_force_all"},
    {"level": "tensor_cores_only"},
    {"level": "treat_infer_as_deny", "precision": "bfloat16"},
]
ONNX_CASE_OPTIONS = [{}, {"level": "unsafe_force_all"}]


def build_cases(folder: Path, with_tests: bool, onnx_cases: bool) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    import onnx

    from models import hard_cases, zoo
    from tests.strategies import random_graph

    models: dict[str, onnx.ModelProto] = {}
    for path in sorted((ROOT / "models").glob("*.onnx")):
        models[path.stem] = onnx.load(path)
    for path in sorted((ROOT / "models" / "exports").glob("*.onnx")):
        models[f"exports/{path.stem}"] = onnx.load(path)
    for name in ("amplified_cancellation", "underflow_log", "correlated_rounding", "transformer_cancellation",
                 "db_head"):
        models[f"hard/{name}"] = getattr(hard_cases, name)()
    models["transformer_stack_3"] = zoo.transformer_stack(3, hidden=8, seq=4, heads=2)
    models["linear_occ_stack_3"] = zoo.linear_occ_stack(3)
    for seed in range(12):
        graph, _ = random_graph(random.Random(seed))
        models[f"random_{seed}"] = graph.model
    cases = []

    def add(name: str, model: onnx.ModelProto, options_list) -> None:
        file = folder / f"{name.replace('/', '__')}.onnx"
        file.write_bytes(model.SerializeToString())
        for options in options_list:
            label = ",".join(f"{k}={v}" for k, v in options.items()) or "defaults"
            cases.append({"name": f"{name} [{label}]", "file": str(file), "kwargs": options})

    for name, model in models.items():
        add(name, model, OPTIONS)
    if onnx_cases:
        from tests.onnx_corpus import selected_cases

        for name, case in selected_cases().items():
            add(f"onnx/{name}", case.model, ONNX_CASE_OPTIONS)
    if with_tests:
        cases += capture_test_models(folder)
    return cases


def capture_test_models(folder: Path) -> list[dict]:
    """Run the test suite (not the slow training/benchmark parts) recording the converter's inputs."""
    capture = folder / "captured"
    capture.mkdir()
    plugin = folder / "equivalence_capture_plugin.py"
    plugin.write_text(_PLUGIN)
    env = dict(os.environ, PYTHONPATH=f"{folder}{os.pathsep}{ROOT}", ONNXMP_CAPTURE=str(capture))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "equivalence_capture_plugin",
                    "--ignore=tests/training", "--ignore=tests/test_benchmarks.py", "-k", "not fuzz_many",
                    "tests"], cwd=ROOT, env=env, capture_output=True, text=True)
    cases = []
    for i, path in enumerate(sorted(capture.glob("*.pkl"))):
        with open(path, "rb") as f:
            record = pickle.load(f)
        model_file = path.with_suffix(".onnx")
        model_file.write_bytes(record["model"])
        cases.append({"name": f"test:{record['test']}#{i}", "file": str(model_file), "kwargs": record["kwargs"]})
    return cases


# Records what the suite converts through the public API (keyword arguments the base revision takes too).
_PLUGIN = '''
import itertools, os, pickle
import onnx
import onnxmp

_counter = itertools.count()
_current = {"test": "?"}
_original = onnxmp.convert
_SIMPLE = ("target", "precision", "keep_io_types", "level", "lists", "block_nodes", "master_weights")


def pytest_runtest_setup(item):
    _current["test"] = item.nodeid


def _recording(model, options=None, /, **kwargs):
    if options is not None:  # an Options object (calibration's own conversions): not recorded
        return _original(model, options, **kwargs)
    try:
        if kwargs.get("calibration") is None and set(kwargs) <= set(_SIMPLE):
            proto = onnxmp.load(model, lazy_external=True)
            if proto.ByteSize() < (64 << 20) and not any(
                    t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
                path = os.path.join(os.environ["ONNXMP_CAPTURE"], f"{next(_counter):06d}.pkl")
                with open(path, "wb") as f:
                    pickle.dump({"test": _current["test"], "model": proto.SerializeToString(),
                                 "kwargs": {k: (list(v) if isinstance(v, (tuple, set, frozenset)) else v)
                                            for k, v in kwargs.items()}}, f)
    except Exception:
        pass
    return _original(model, **kwargs)


onnxmp.convert = _recording
'''


# Runs in a child whose sys.path starts with one tree: converts every case and writes, for each,
# the model's meaning as plain JSON (see describe).
_CHILD = r'''
import hashlib, json, logging, pickle, sys, warnings
sys.path.insert(0, sys.argv[1])
logging.disable(logging.CRITICAL)
warnings.simplefilter("ignore")
import numpy as np
import onnx
from onnx import numpy_helper
import onnxmp
assert onnxmp.__file__.startswith(sys.argv[1]), onnxmp.__file__


def digest(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def tensor(t):
    return [int(t.data_type), list(t.dims), digest(numpy_helper.to_array(t))]


def type_of(tp):
    which = tp.WhichOneof("value")
    if which in ("tensor_type", "sparse_tensor_type"):
        t = getattr(tp, which)
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim] \
            if t.HasField("shape") else None
        return [which, int(t.elem_type), shape]
    if which in ("sequence_type", "optional_type"):
        return [which, type_of(getattr(tp, which).elem_type)]
    if which == "map_type":
        return [which, int(tp.map_type.key_type), type_of(tp.map_type.value_type)]
    return [which]


def attribute(a, out):
    A = onnx.AttributeProto
    if a.type == A.GRAPH:
        return ["graph", graph(a.g, out)]
    if a.type == A.GRAPHS:
        return ["graphs", [graph(g, out) for g in a.graphs]]
    if a.type == A.TENSOR:
        return ["tensor", tensor(a.t)]
    if a.type == A.TENSORS:
        return ["tensors", [tensor(t) for t in a.tensors]]
    value = onnx.helper.get_attribute_value(a)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, list):
        value = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value]
    if not isinstance(value, (int, float, str, list)):
        value = str(value)
    return [int(a.type), value]


def graph(g, out):
    """Nodes of g (bodies described where they stand); initializers and declarations go to
    the model-wide tables in `out` (names are unique across graphs)."""
    for t in g.initializer:
        out["initializers"].setdefault(t.name, tensor(t))
    for t in g.sparse_initializer:
        out["initializers"].setdefault(t.values.name, ["sparse"] + tensor(t.values))
    for v in list(g.value_info) + list(g.input) + list(g.output):
        if v.type.WhichOneof("value"):
            out["declared"].setdefault(v.name, type_of(v.type))
    nodes = []
    for n in g.node:
        attrs = {a.name: attribute(a, out) for a in n.attribute}
        nodes.append({"op": n.op_type, "domain": n.domain, "name": n.name, "inputs": list(n.input),
                      "outputs": list(n.output), "attributes": attrs})
    return {"name": g.name, "inputs": [[v.name, type_of(v.type)] for v in g.input],
            "outputs": [[v.name, type_of(v.type)] for v in g.output], "nodes": nodes}


def describe(model):
    out = {"initializers": {}, "declared": {}}
    main = graph(model.graph, out)
    return {"ir_version": model.ir_version, "opsets": sorted([o.domain, o.version] for o in model.opset_import),
            "functions": len(model.functions), "graph": main, **out}


with open(sys.argv[2], "rb") as f:
    cases = pickle.load(f)
results = {}
for case in cases:
    model = onnx.load(case["file"])
    try:
        result = onnxmp.convert(model, **case["kwargs"])
    except Exception as exc:
        results[case["name"]] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        continue
    results[case["name"]] = {"model": describe(result.model), "casts": result.report.casts_inserted}
with open(sys.argv[3], "w") as f:
    json.dump(results, f)
'''


def convert_all(root: Path, cases: list[dict], folder: Path, tag: str) -> dict:
    case_file = folder / f"cases-{tag}.pkl"
    with open(case_file, "wb") as f:
        pickle.dump(cases, f)
    out = folder / f"described-{tag}.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(root), str(case_file), str(out)], cwd=folder,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"conversion with {root} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _graph_differences(a: dict, b: dict, where: str) -> list[str]:
    found = []
    for side in ("inputs", "outputs"):
        if a[side] != b[side]:
            found.append(f"{where}graph {side} differ: {a[side]} -> {b[side]}")
    nodes_a = {n["name"]: n for n in a["nodes"]}
    nodes_b = {n["name"]: n for n in b["nodes"]}
    for name in sorted(nodes_a.keys() - nodes_b.keys()):
        found.append(f"{where}node only in base: {name} ({nodes_a[name]['op']})")
    for name in sorted(nodes_b.keys() - nodes_a.keys()):
        found.append(f"{where}node only in ours: {name} ({nodes_b[name]['op']})")
    for name in sorted(nodes_a.keys() & nodes_b.keys()):
        x, y = nodes_a[name], nodes_b[name]
        for key in ("op", "domain", "inputs", "outputs"):
            if x[key] != y[key]:
                found.append(f"{where}node {name}: {key} {x[key]} -> {y[key]}")
        if x["attributes"].keys() != y["attributes"].keys():
            found.append(f"{where}node {name}: attributes {sorted(x['attributes'])} -> {sorted(y['attributes'])}")
        for attr in sorted(x["attributes"].keys() & y["attributes"].keys()):
            p, q = x["attributes"][attr], y["attributes"][attr]
            if p[0] == "graph" and q[0] == "graph":
                found += _graph_differences(p[1], q[1], f"{where}{name}/{attr}: ")
            elif p != q:
                found.append(f"{where}node {name}: attribute {attr} {p} -> {q}")
    order_a = [n["name"] for n in a["nodes"] if n["name"] in nodes_b]
    order_b = [n["name"] for n in b["nodes"] if n["name"] in nodes_a]
    if order_a != order_b:
        found.append(f"{where}node order differs (same nodes)")
    return found


def differences(base: dict, ours: dict) -> list[str]:
    """What differs in meaning between two described models (see the module docstring)."""
    if "error" in base or "error" in ours:
        return [] if base.get("error") == ours.get("error") else [f"error: {base.get('error')} -> {ours.get('error')}"]
    a, b = base["model"], ours["model"]
    found = [f"{key} differs: {a[key]} -> {b[key]}" for key in ("ir_version", "opsets", "functions") if a[key] != b[key]]
    found += _graph_differences(a["graph"], b["graph"], "")
    inits_a, inits_b = a["initializers"], b["initializers"]
    for name in sorted(inits_a.keys() ^ inits_b.keys()):
        found.append(f"initializer only in {'base' if name in inits_a else 'ours'}: {name}")
    for name in sorted(inits_a.keys() & inits_b.keys()):
        if inits_a[name] != inits_b[name]:
            found.append(f"initializer {name}: {inits_a[name]} -> {inits_b[name]}")
    declared_a, declared_b = a["declared"], b["declared"]
    for name in sorted(declared_a.keys() & declared_b.keys()):
        if declared_a[name] != declared_b[name]:
            found.append(f"declared type of {name}: {declared_a[name]} -> {declared_b[name]}")
    return found


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from onnxmp.files import guard_arguments, write_text_atomic

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main", help="git revision to compare against (default: %(default)s)")
    ap.add_argument("--with-tests", action="store_true", help="also convert every model the test suite converts")
    ap.add_argument("--onnx-cases", action="store_true", help="also convert onnx's own operator test models")
    ap.add_argument("--save", type=Path, help="write every difference found as JSON here")
    ap.add_argument("--keep", type=Path, help="build the cases in this (new) folder and keep it")
    args = ap.parse_args(argv)
    guard_arguments(ap, {"--save": args.save})
    with tempfile.TemporaryDirectory(prefix="onnxmp-equivalence-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        cases = build_cases(folder, args.with_tests, args.onnx_cases)
        print(f"{len(cases)} conversions", flush=True)
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(base_tree), args.base], cwd=ROOT,
                       check=True)
        try:
            base = convert_all(base_tree, cases, folder, "base")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
        ours = convert_all(ROOT, cases, folder, "ours")
    found = {name: differences(base[name], ours.get(name, {"error": "missing"})) for name in base}
    found = {name: diffs for name, diffs in found.items() if diffs}
    if args.save:
        write_text_atomic(args.save, json.dumps({"base": args.base, "differences": found}, indent=1))
    errors = sum("error" in v for v in base.values())
    print(f"{len(base) - len(found)}/{len(base)} equivalent to {args.base} ({errors} of them identical errors)")
    for name, diffs in found.items():
        print(f"  {name}:")
        for line in diffs[:8]:
            print(f"    {line[:300]}")
        if len(diffs) > 8:
            print(f"    ... {len(diffs) - 8} more")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
