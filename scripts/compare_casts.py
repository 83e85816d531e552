"""Casts per model: onnxmp (this checkout, and a reference checkout for "before") against
onnxconverter-common, onnxruntime's converter and modelopt AutoCast, all float16 with the graph
inputs and outputs kept float32.

    python scripts/compare_casts.py [MODEL.onnx ...] [--bundled] [--fused] [--corpus DIR]
        [--before CHECKOUT] [--modelopt-python PYTHON] [--parity all|onnxmp|none] [--reuse JSON] [--json FILE]

Per model and converter:

* casts:  every Cast node of the written model (the model's own included), counted statically
          in every graph; ``sub`` of them inside If/Loop/Scan bodies; ``path`` on the costliest
          path one run executes (an If counts its costlier branch, a Loop/Scan body once, i.e. per
          iteration); ``run`` of them left after onnxruntime's optimizations (constant folding
          takes a Cast of a constant, identity Casts go), which is what a run executes;
* fp16:   the share of Conv/MatMul/Gemm nodes with a float16 output, and of all nodes computing a
          float tensor (Casts aside), from the types the model declares or onnx infers (a
          contrib op's output in a model declaring no types, as onnxruntime's converter writes
          them, counts as not float16: its shares are then lower bounds);
* valid:  ``ok`` when onnxruntime builds a CPU session (a missing float16 CPU kernel is no fault:
          the model runs on the CUDA EP); else why not.  What onnx's full checker says besides is
          printed (onnxruntime's converter writes its input Casts after their readers);
* err:    the worst max |err| of the emulated float16 model against float32 (onnxmp.validate on
          the CPU) on the model's committed inputs (``<name>.inputs.npz``, the corpus's first
          sample) or generated ones; ``-`` for models with integer inputs and no samples, and where
          ``--parity`` skips it.  Before and after agree exactly: every rule is exact.

The goal (issue 39): onnxmp's Casts <= the fewest any *valid* anchor writes, at the same or higher
Conv/MatMul/Gemm fp16 share.  The last column names the anchor that has fewer, if any.  "before"
converts with the onnxmp found in ``--before`` (e.g. a worktree of main) in a subprocess;
modelopt runs in ``--modelopt-python``'s interpreter (it is no dependency of onnxmp).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from onnxmp.files import guard_arguments, write_text_atomic  # noqa: E402
from onnxmp.naming import json_safe  # noqa: E402
from onnxmp.subgraphs import bodies, iter_proto_graphs  # noqa: E402
from scripts.bench_models import all_nodes, elem_types, heavy_fp16_share  # noqa: E402

LOW = (onnx.TensorProto.FLOAT16,)
FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
ANCHORS = ("occ", "ort", "modelopt")
CPU_FALLBACK_CAST = "InsertedPrecisionFreeCast_"  # onnxruntime's name for the CPU EP's own Casts

_CONVERT_WITH_ONNXMP = """
import sys, onnx, onnxmp
onnx.save(onnxmp.convert(sys.argv[1], keep_io_types=True).model, sys.argv[2])
"""
_CONVERT_WITH_MODELOPT = """
import sys, onnx
from modelopt.onnx.autocast import convert_to_mixed_precision
onnx.save(convert_to_mixed_precision(sys.argv[1], low_precision_type="fp16", keep_io_types=True), sys.argv[2])
"""


# -- counting ------------------------------------------------------------------------------------
def _casts_here(graph: onnx.GraphProto) -> int:
    return sum(n.op_type == "Cast" for n in graph.node)


def static_casts(graph: onnx.GraphProto) -> int:
    return _casts_here(graph) + sum(static_casts(b) for n in graph.node for b in bodies(n))


def path_casts(graph: onnx.GraphProto) -> int:
    """Casts on the costliest path one run takes: an If runs one branch, other bodies count once."""
    total = _casts_here(graph)
    for node in graph.node:
        counts = [path_casts(b) for b in bodies(node)]
        if counts:
            total += max(counts) if node.op_type == "If" else sum(counts)
    return total


def run_casts(model: onnx.ModelProto) -> int | None:
    """The model's Casts, in every graph, left after onnxruntime's optimizations (ORT_ENABLE_EXTENDED
    on the CPU EP: constant folding takes the Casts of constants, identity Casts go, fusions absorb
    some); None when onnxruntime builds no CPU session.  A Cast counts when its node survives by
    name, or when the CPU EP merged it into one of the Casts it puts around float16 nodes it has
    no kernel for (named after the tensor: a GPU would have run the model's Cast), as
    tests/test_fused_matrix.py counts them."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        opts.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        try:
            ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            optimized = onnx.load(opts.optimized_model_filepath)
        except Exception:  # no CPU session (a missing kernel): the static counts stand
            return None
    after = {n.name for g in iter_proto_graphs(optimized.graph) for n in g.node}
    return sum(n.op_type == "Cast" and (n.name in after or CPU_FALLBACK_CAST + n.output[0] in after)
               for g in iter_proto_graphs(model.graph) for n in g.node)


def all_fp16_share(model: onnx.ModelProto) -> float | None:
    types = elem_types(model)
    computing = [n for n in all_nodes(model.graph) if n.op_type != "Cast"
                 and any(types.get(t) in FLOATS for t in n.output if t)]
    if not computing:
        return None
    return sum(any(types.get(t) in LOW for t in n.output if t) for n in computing) / len(computing)


def counts(model: onnx.ModelProto) -> dict:
    total = static_casts(model.graph)
    return {"casts": total, "sub": total - _casts_here(model.graph), "path": path_casts(model.graph),
            "heavy_fp16": heavy_fp16_share(model)[0], "all_fp16": all_fp16_share(model)}


# -- validity and parity -------------------------------------------------------------------------
def validity(model: onnx.ModelProto) -> tuple[str, str | None]:
    """(``ok`` or why onnxruntime refuses the model, onnx's full checker's complaint or None).
    The runtime is the judge: onnxruntime sorts a graph the checker finds out of order."""
    import onnxruntime as ort

    note = None
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:  # the anchor's defect is a result, not a crash of the comparison
        note = str(exc).splitlines()[0][:120]
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:
        text = str(exc)
        if "NOT_IMPLEMENTED" in text or "Could not find an implementation" in text:
            return "ok", note  # valid; the CPU EP lacks a float16 kernel
        return "onnxruntime: " + text.splitlines()[0][:160], note
    return "ok", note


def sample_for(path: Path) -> dict | None:
    """The model's committed inputs: ``<stem>.inputs.npz``, or the corpus's ``<stem>.<n>.npz`` first sample."""
    stem = path.name[: -len(".onnx")]
    beside = path.with_name(stem + ".inputs.npz")
    if beside.is_file():
        with np.load(beside) as z:
            return {k: z[k] for k in z.files}
    for npz in sorted(path.parent.glob(stem + ".*.npz")):
        with np.load(npz) as z:
            return {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("0/")}
    return None


def parity(path: Path, model: onnx.ModelProto, sample: dict | None) -> float | None:
    from onnxmp.parity.validate import validate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = validate(str(path), model, inputs=sample, provider="cpu")
    errs = [o.max_abs_err for o in report.outputs if not o.exact and o.max_abs_err is not None]
    return max(errs) if errs else 0.0


# -- converters ----------------------------------------------------------------------------------
def convert(tool: str, path: Path, args) -> onnx.ModelProto:
    if tool == "after":
        import onnxmp

        return onnxmp.convert(str(path), keep_io_types=True).model
    if tool == "occ":
        from onnxconverter_common import float16

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # it warns once per constant it clamps
            return float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)
    if tool == "ort":
        from onnxruntime.transformers import float16

        return float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)
    python, code, env = {
        "before": (sys.executable, _CONVERT_WITH_ONNXMP, {"PYTHONPATH": str(args.before)}),
        "modelopt": (args.modelopt_python, _CONVERT_WITH_MODELOPT, {}),
    }[tool]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "converted.onnx"
        done = subprocess.run([python, "-c", code, str(path), str(out)], capture_output=True, text=True,
                              env={**os.environ, **env}, cwd=tmp, timeout=args.timeout)
        if done.returncode != 0:
            raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1][:200])
        return onnx.load(str(out))


def tools(args) -> list[str]:
    earlier = {t for row in args.earlier.values() for t in row} if args.earlier else set()
    chosen = (["before"] if args.before or "before" in earlier else []) + ["after", "occ", "ort"]
    return chosen + (["modelopt"] if args.modelopt_python or "modelopt" in earlier else [])


def measure(path: Path, args, earlier: dict) -> dict:
    original = onnx.load(str(path))
    row = {"model": path.name[: -len(".onnx")], "original": {**counts(original), "run": run_casts(original)}}
    sample = None if args.parity == "none" else sample_for(path)
    for tool in tools(args):
        if tool != "after" and tool in earlier.get(row["model"], {}):
            row[tool] = earlier[row["model"]][tool]  # --reuse: only this checkout's column is measured again
            continue
        try:
            model = convert(tool, path, args)
        except Exception as exc:  # a failing converter is a result
            row[tool] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}
            continue
        entry = counts(model)
        entry["valid"], entry["checker"] = validity(model)
        entry["run"] = run_casts(model) if entry["valid"] == "ok" else None
        entry["err"] = None
        if entry["valid"] == "ok" and (args.parity == "all" or (args.parity == "onnxmp" and tool in ("before", "after"))):
            try:
                entry["err"] = parity(path, model, sample)
            except Exception as exc:
                entry["err_note"] = str(exc).splitlines()[0][:120]
        row[tool] = entry
    row["fewer"] = fewer(row, "casts")
    row["fewer_run"] = fewer(row, "run")
    return row


def fewer(row: dict, key: str) -> list[str]:
    """The valid anchors with fewer Casts (``key``: static, or ``run`` after onnxruntime's
    optimizations) than onnxmp's, each with the share that differs."""
    ours = row.get("after", {})
    if "casts" not in ours:
        return ["onnxmp failed"]
    found = []
    for tool in ANCHORS:
        other = row.get(tool, {})
        if other.get("valid") == "ok" and None not in (ours.get(key), other.get(key)) and other[key] < ours[key]:
            found.append(tool + _why(ours, other))
    return found


def _why(ours: dict, other: dict) -> str:
    """The share that differs: an anchor with a lower Conv/MatMul/Gemm share is no counterexample;
    one with more nodes in fp16 made another coloring (which ones: see docs/design.md)."""
    if None not in (ours["heavy_fp16"], other["heavy_fp16"]) and other["heavy_fp16"] < ours["heavy_fp16"]:
        return " (lower Conv/MatMul/Gemm share)"
    if None not in (ours["all_fp16"], other["all_fp16"]) and other["all_fp16"] > ours["all_fp16"]:
        return " (more nodes in fp16)"
    return ""


# -- output --------------------------------------------------------------------------------------
def _pct(v) -> str:
    return "-" if v is None else f"{v:.0%}"


def _cell(entry: dict | None) -> str:
    if not entry:
        return "-"
    if "error" in entry:
        return "fails"
    mark = "" if entry.get("valid", "ok") == "ok" else "!"
    run = "-" if entry.get("run") is None else entry["run"]
    return f"{entry['casts']}/{entry['sub']}/{entry['path']}/{run}{mark} {_pct(entry['heavy_fp16'])} {_pct(entry['all_fp16'])}"


def print_table(rows: list[dict], names: list[str]) -> None:
    header = ["model", "original"] + names + ["onnxmp has more than"]
    lines = [header] + [[r["model"], _cell(r["original"])] + [_cell(r.get(t)) for t in names]
                        + [", ".join(r["fewer"]) or "-"] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print("cells: casts/in bodies/on the costliest path/after onnxruntime's optimizations, fp16 share of Conv/MatMul/Gemm and of all float nodes;"
          " ! = the model is invalid (see below)")
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
    for r in rows:
        for t in names:
            e = r.get(t) or {}
            if "error" in e:
                print(f"{r['model']} ({t}): conversion failed: {e['error']}")
            elif e.get("valid", "ok") != "ok":
                print(f"{r['model']} ({t}): invalid: {e['valid']}")
            elif e.get("checker"):
                print(f"{r['model']} ({t}): onnxruntime runs it; onnx's checker says: {e['checker']}")
    if any((r.get(t) or {}).get("err") is not None for r in rows for t in names):
        print("\nemulated max |err| against float32:")
        for r in rows:
            cells = []
            for t in names:
                e = r.get(t) or {}
                err = e.get("err")
                cells.append(f"{t} {'-' if err is None else format(err, '.3g')}")
            print(f"  {r['model']}: " + ", ".join(cells))


def model_paths(args, ap) -> list[Path]:
    paths = []
    if args.bundled:
        paths += sorted((ROOT / "models").glob("*.onnx"))
    if args.fused:
        paths += sorted((ROOT / "models" / "fused").glob("*.onnx"))
    if args.corpus:
        paths += sorted(Path(args.corpus).glob("*.onnx"))
    paths += [p.resolve() for p in args.paths]
    if args.only:
        wanted = {n.strip() for n in args.only.split(",")}
        paths = [p for p in paths if p.name[: -len(".onnx")] in wanted]
    if not paths:
        ap.error("no models: name some, or --bundled / --fused / --corpus DIR")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        ap.error(f"no such model file: {', '.join(missing)}")
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", type=Path, help="more .onnx models")
    ap.add_argument("--bundled", action="store_true", help="models/*.onnx")
    ap.add_argument("--fused", action="store_true", help="models/fused/*.onnx")
    ap.add_argument("--corpus", type=Path, help="a folder of .onnx models (models/corpus.py's cache)")
    ap.add_argument("--only", help="comma-separated model names to keep")
    ap.add_argument("--before", type=Path, help="a checkout whose onnxmp converts the 'before' column")
    ap.add_argument("--modelopt-python", help="an interpreter with nvidia-modelopt[onnx] installed")
    ap.add_argument("--parity", choices=("all", "onnxmp", "none"), default="all",
                    help="whose emulated error to measure: every converter's, onnxmp's before and after only, none")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per subprocess conversion")
    ap.add_argument("--reuse", type=Path, help="a --json of an earlier run: its columns but 'after' are taken as they are")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    args.earlier = {r["model"]: r for r in json.loads(args.reuse.read_text())["models"]} if args.reuse else {}
    paths = model_paths(args, ap)
    guard_arguments(ap, {"--json": args.json}, {"model": paths})
    names = tools(args)
    rows = []
    for path in paths:
        print(f"  {path.name} ...", file=sys.stderr, flush=True)
        rows.append(measure(path, args, args.earlier))
    print_table(rows, names)
    for key, what in (("fewer", "Casts"), ("fewer_run", "Casts after onnxruntime's optimizations")):
        exceptions = [r for r in rows if r[key]]
        print(f"\nonnxmp has more {what} than a valid anchor on {len(exceptions)} of {len(rows)} models"
              + (": " + ", ".join(f"{r['model']} ({', '.join(r[key])})" for r in exceptions) if exceptions else ""))
    if args.json:
        write_text_atomic(args.json, json.dumps(json_safe({"tools": names, "models": rows}), indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
