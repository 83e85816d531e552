"""Byte identity of converted models against another git revision.

    python scripts/check_identity.py [--base main] [--with-tests] [--save FILE] [--keep DIR]

Builds one set of input models (every bundled ``models/*.onnx``, zoo and
benchmark transformer stacks, seeded random graphs from ``tests/strategies.py``)
and converts each under several options (float16 and bfloat16, a few levels,
``keep_io_types`` both ways) twice: with this tree's onnxmp and with the
``--base`` revision's, checked out in a temporary ``git worktree``.  Each
conversion runs in a child process whose ``sys.path`` starts with one tree, so
both see the very same input bytes.  The SHA-256 of every serialized output
model is compared (and, separately, of the report without timings).

``--with-tests`` also captures every model the test suite hands to
``onnxmp.convert`` (a pytest plugin records them) and adds those conversions.

Exit status 0 when every model is byte-identical, 1 otherwise.
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


def build_cases(folder: Path, with_tests: bool) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    import onnx

    from models import zoo
    from tests.strategies import random_graph

    models: dict[str, onnx.ModelProto] = {}
    for path in sorted((ROOT / "models").glob("*.onnx")):
        models[path.stem] = onnx.load(path)
    models["transformer_stack_3"] = zoo.transformer_stack(3, hidden=8, seq=4, heads=2)
    models["linear_occ_stack_3"] = zoo.linear_occ_stack(3)
    for seed in range(12):
        graph, _ = random_graph(random.Random(seed))
        models[f"random_{seed}"] = graph.model
    cases = []
    for name, model in models.items():
        file = folder / f"{name}.onnx"
        file.write_bytes(model.SerializeToString())
        for options in OPTIONS:
            label = ",".join(f"{k}={v}" for k, v in options.items()) or "defaults"
            cases.append({"name": f"{name} [{label}]", "file": str(file), "kwargs": options})
    if with_tests:
        cases += capture_test_models(folder)
    return cases


def capture_test_models(folder: Path) -> list[dict]:
    """Run the test suite (not the slow training/benchmark parts) recording convert_once's inputs."""
    capture = folder / "captured"
    capture.mkdir()
    plugin = folder / "identity_capture_plugin.py"
    plugin.write_text(_PLUGIN)
    env = dict(os.environ, PYTHONPATH=f"{folder}{os.pathsep}{ROOT}", ONNXMP_IDENTITY_CAPTURE=str(capture))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "identity_capture_plugin",
                    "--ignore=tests/training", "--ignore=tests/test_benchmarks.py", "-k", "not fuzz_many",
                    "tests"], cwd=ROOT, env=env, capture_output=True, text=True)
    cases = []
    for i, path in enumerate(sorted(capture.glob("*.pkl"))):
        with open(path, "rb") as f:
            record = pickle.load(f)
        model_file = path.with_suffix(".onnx")
        model_file.write_bytes(record["model"])
        kind = "explain" if record.get("explain") else "convert"
        cases.append({"name": f"test:{record['test']}#{i} ({kind})", "file": str(model_file),
                      "kwargs": record["kwargs"], "explain": record.get("explain", False)})
    return cases


_PLUGIN = '''
import itertools, os, pickle, sys
import onnx
import onnxmp.convert  # noqa: F401  (the package re-exports `convert`, shadowing the module attribute)

convert_module = sys.modules["onnxmp.convert"]

_counter = itertools.count()
_current = {"test": "?"}
_original = convert_module.convert_once


def pytest_runtest_setup(item):
    _current["test"] = item.nodeid


def _record(model, kwargs, explain=False):
    try:
        proto = convert_module.load(model, lazy_external=True)
        if proto.ByteSize() < (64 << 20) and not any(
                t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
            path = os.path.join(os.environ["ONNXMP_IDENTITY_CAPTURE"], f"{next(_counter):06d}.pkl")
            with open(path, "wb") as f:
                pickle.dump({"test": _current["test"], "model": proto.SerializeToString(), "explain": explain,
                             "kwargs": {k: (list(v) if isinstance(v, (tuple, set, frozenset)) else v)
                                        for k, v in kwargs.items()}}, f)
    except Exception:
        pass


def _recording(model, **kwargs):
    _record(model, kwargs)
    return _original(model, **kwargs)


_original_explain = convert_module.explain


def _recording_explain(model, **kwargs):
    if not isinstance(kwargs.get("calibration"), (str, bytes)):
        _record(model, kwargs, explain=True)
    return _original_explain(model, **kwargs)


import onnxmp

convert_module.convert_once = _recording
convert_module.explain = onnxmp.explain = _recording_explain
'''


_CHILD = r'''
import hashlib, json, logging, pickle, sys, warnings
sys.path.insert(0, sys.argv[1])
logging.disable(logging.CRITICAL)
warnings.simplefilter("ignore")
import onnx
import onnxmp
from onnxmp.convert import convert_once, explain
assert onnxmp.__file__.startswith(sys.argv[1]), onnxmp.__file__
with open(sys.argv[2], "rb") as f:
    cases = pickle.load(f)
def report_hash(report):
    report = report.to_dict()
    report.pop("timings", None)
    return hashlib.sha256(json.dumps(report, sort_keys=True, default=str).encode()).hexdigest()
out = {}
for case in cases:
    model = onnx.load(case["file"])
    try:
        if case.get("explain"):
            out[case["name"]] = {"report": report_hash(explain(model, **case["kwargs"]))}
            continue
        result = convert_once(model, **case["kwargs"])
    except Exception as exc:
        out[case["name"]] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        continue
    out[case["name"]] = {"model": hashlib.sha256(result.model.SerializeToString()).hexdigest(),
                         "report": report_hash(result.report)}
with open(sys.argv[3], "w") as f:
    json.dump(out, f, indent=1, sort_keys=True)
'''


def convert_all(root: Path, cases: list[dict], folder: Path, tag: str) -> dict:
    case_file = folder / f"cases-{tag}.pkl"
    with open(case_file, "wb") as f:
        pickle.dump(cases, f)
    out = folder / f"hashes-{tag}.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(root), str(case_file), str(out)], cwd=folder,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"conversion with {root} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from onnxmp.files import guard_arguments, write_text_atomic

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main", help="git revision to compare against (default: %(default)s)")
    ap.add_argument("--with-tests", action="store_true", help="also convert every model the test suite converts")
    ap.add_argument("--save", type=Path, help="write both hash tables as JSON here")
    ap.add_argument("--keep", type=Path, help="build the cases in this (new) folder and keep it")
    args = ap.parse_args(argv)
    guard_arguments(ap, {"--save": args.save})
    with tempfile.TemporaryDirectory(prefix="onnxmp-identity-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        cases = build_cases(folder, args.with_tests)
        print(f"{len(cases)} conversions", flush=True)
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(base_tree), args.base], cwd=ROOT,
                       check=True)
        try:
            base = convert_all(base_tree, cases, folder, "base")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
        ours = convert_all(ROOT, cases, folder, "ours")
    if args.save:
        write_text_atomic(args.save, json.dumps({"base": args.base, "base_hashes": base, "ours": ours}, indent=1))
    model_diff = [n for n in base if base[n].get("model") != ours.get(n, {}).get("model")
                  or base[n].get("error") != ours.get(n, {}).get("error")]
    report_diff = [n for n in base if n not in model_diff and base[n].get("report") != ours[n].get("report")]
    errors = sum("error" in v for v in base.values())
    print(f"{len(base) - len(model_diff)}/{len(base)} identical to {args.base} "
          f"({errors} of them are identical errors); reports differ in {len(report_diff)}")
    for name in model_diff:
        print(f"  model differs: {name}: {base[name]} -> {ours.get(name)}")
    for name in report_diff:
        print(f"  report differs: {name}")
    return 1 if model_diff else 0


if __name__ == "__main__":
    sys.exit(main())
