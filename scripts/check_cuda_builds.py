#!/usr/bin/env python
"""Build every export of the matrix (models/exports/) for target "cuda" in float16 and bfloat16 and check
each build's graphs, on a machine without a GPU.

    python scripts/check_cuda_builds.py                      # all entries, markdown table
    python scripts/check_cuda_builds.py gpt2 albert --json   # entries whose name contains "gpt2" or "albert"
    python scripts/check_cuda_builds.py --plain /path/to/py312/bin/python   # also load in plain onnxruntime

The target "cuda" build is the real low-precision training graph (not emulated), built as
tests/training/test_training_cuda_builds.py builds it: every float initializer trained except those
onnxruntime cannot differentiate.  Per build and graph (training, eval, optimizer, and the portable
graphs when the build writes them), onnxmp.training.build.graph_check: "valid" (onnx.checker, strict type
inference), "resolved" (onnxruntime loads and resolves the graph, types bound, as a session does before
it chooses kernels), and the ops the CUDA EP of plain onnxruntime registers no kernel for.  ``--plain
PYTHON`` repeats the resolution with another interpreter's onnxruntime (plain onnxruntime, which knows none
of the training build's own ops until the graphs are lowered).
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPORTS = ROOT / "models" / "exports"
sys.path[:0] = [str(ROOT)]

import onnx  # noqa: E402

from onnxmp.errors import OnnxMPError  # noqa: E402

PRECISIONS = ("float16", "bfloat16")
_PLAIN_LOAD = """
import json, sys
import onnx
from onnxmp.training.build.graph_check import resolve
print(json.dumps({path: resolve(onnx.load(path)) for path in sys.argv[1:]}))
"""


def build(entry: dict, precision: str, folder: Path) -> dict:
    from onnxmp.training import build_artifacts
    from onnxmp.training.build.graph_check import check_graph
    from onnxmp.training.build.prepare import without_gradient

    model = onnx.load(str(EXPORTS / entry["file"]))
    names = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    frozen = without_gradient(model, names)
    start = time.perf_counter()
    try:
        build_artifacts(model, requires_grad=[n for n in names if n not in frozen], frozen=list(frozen),
                        precision=precision, target="cuda", out_dir=folder)
    except OnnxMPError as exc:
        return {"error": str(exc).splitlines()[0], "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    graphs = {}
    for path in sorted(folder.glob("*.onnx")):
        if path.name == "forward_model.onnx":  # the user's float32 export, unchanged
            continue
        check = check_graph(path)
        graphs[path.name] = {"nodes": check.nodes, "op_types": len(check.op_types), "invalid": check.invalid,
                             "unresolved": check.unresolved, "ok": check.ok,
                             "without_cuda_kernel": dict(check.without_kernel), "not_onnx": dict(check.not_onnx),
                             "path": str(path)}
    return {"seconds": seconds, "graphs": graphs}


def plain_loads(python: str, results: dict) -> None:
    """Add ``plain_unresolved`` to every graph, from ``python`` (a plain onnxruntime's interpreter)."""
    paths = [g["path"] for r in results.values() for g in r.get("graphs", {}).values()]
    if not paths:
        return
    done = subprocess.run([python, "-c", _PLAIN_LOAD, *paths], capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=3600)
    if done.returncode:
        raise SystemExit(f"{python} could not check the graphs: {done.stderr.strip().splitlines()[-1:]}")
    loads = json.loads(done.stdout)
    for r in results.values():
        for g in r.get("graphs", {}).values():
            g["plain_unresolved"] = loads[g["path"]]


def _failed_row(entry: str, precision: str, result: dict, columns: int) -> str:
    return f"| {entry} | {precision} | FAILED: {result['error']} | {result['seconds']:.1f} |" + " |" * (columns - 4)


def _short(error: str | None) -> str:
    return "ok" if error is None else error.replace("[ONNXRuntimeError] : ", "")[:90]


def table(results: dict, plain: bool) -> str:
    head = ["entry", "precision", "build", "s", "graph", "nodes / op types", "valid", "resolved (this onnxruntime)",
            *(["resolved (plain onnxruntime)"] if plain else []), "ops without a plain CUDA kernel (nodes)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (entry, precision), r in results.items():
        if "error" in r:
            lines.append(_failed_row(entry, precision, r, len(head)))
            continue
        for i, (name, g) in enumerate(r["graphs"].items()):
            lead = [entry, precision, "ok", f"{r['seconds']:.1f}"] if i == 0 else ["", "", "", ""]
            # *: a default-domain op onnx has no schema for (onnxruntime-training's), checked by onnxruntime only
            missing = ", ".join(f"{op}{'*' if op in g['not_onnx'] else ''} {n}"
                                for op, n in sorted(g["without_cuda_kernel"].items())) or "none"
            row = [*lead, name.removesuffix(".onnx"), f"{g['nodes']} / {g['op_types']}",
                   _short(g["invalid"]), _short(g["unresolved"]),
                   *([_short(g["plain_unresolved"])] if plain else []), missing]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def compact_table(results: dict, plain: bool) -> str:
    """One row per build: the training graph's size, how many graphs pass each check, and the op types
    without a plain CUDA kernel over all its graphs."""
    head = ["entry", "precision", "build", "s", "training nodes / op types", "valid", "resolved",
            *(["resolved by plain onnxruntime"] if plain else []), "op types without a plain CUDA kernel"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (entry, precision), r in results.items():
        if "error" in r:
            lines.append(_failed_row(entry, precision, r, len(head)))
            continue
        graphs = r["graphs"]
        # ORT's native graph where its builder made the folder, else onnxmp's (the portable one).
        training = graphs.get("training_model.onnx", graphs.get("training_model.portable.onnx",
                                                                {"nodes": 0, "op_types": 0}))

        def passed(key):
            good = [n.removesuffix("_model.onnx") for n, g in graphs.items() if g[key] is None]
            return f"{len(good)}/{len(graphs)}" + (f" ({', '.join(good)})" if 0 < len(good) < len(graphs) else "")
        missing = sorted({op for g in graphs.values() for op in g["without_cuda_kernel"]})
        lines.append("| " + " | ".join([entry, precision, "ok", f"{r['seconds']:.1f}",
                                         f"{training['nodes']} / {training['op_types']}", passed("invalid"),
                                         passed("unresolved"), *([passed("plain_unresolved")] if plain else []),
                                         f"{len(missing)}: {', '.join(missing)}"]) + " |")
    return "\n".join(lines)


def summary(results: dict) -> str:
    builds = len(results)
    failed = [k for k, r in results.items() if "error" in r]
    bad = [(k, n) for k, r in results.items() for n, g in r.get("graphs", {}).items() if not g["ok"]]
    ops: Counter = Counter()
    for r in results.values():
        for g in r.get("graphs", {}).values():
            ops.update({op: 1 for op in g["without_cuda_kernel"]})
    seconds = sum(r["seconds"] for r in results.values())
    return (f"{builds - len(failed)}/{builds} builds ok; {len(bad)} graph(s) invalid or not resolved; "
            f"build time {seconds:.1f} s in all ({seconds / max(builds, 1):.2f} s each).\n"
            f"Graphs holding ops without a plain CUDA kernel, per op: "
            + ", ".join(f"{op} {n}" for op, n in ops.most_common()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="only entries whose name contains one of these")
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--plain", metavar="PYTHON", help="also load each graph with this interpreter's onnxruntime")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    ap.add_argument("--graphs", action="store_true", help="one row per graph instead of one per build")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    matrix = json.loads((EXPORTS / "matrix.json").read_text())
    entries = sorted(k for k, e in matrix.items()
                     if "file" in e and (not args.names or any(n in k for n in args.names)))
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="onnxmp-cuda-builds-") as tmp:
        for entry in entries:
            for precision in args.precisions:
                results[entry, precision] = build(matrix[entry], precision, Path(tmp) / f"{entry}-{precision}")
        if args.plain:
            plain_loads(args.plain, results)
    if args.json:
        print(json.dumps({f"{e}/{p}": r for (e, p), r in results.items()}, indent=1))
    else:
        print((table if args.graphs else compact_table)(results, bool(args.plain)))
        print()
        print(summary(results))
    return 0 if all("error" not in r and all(g["ok"] for g in r["graphs"].values())
                    for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
