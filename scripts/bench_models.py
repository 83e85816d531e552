"""onnxmp vs onnxconverter-common (occ) float16 conversion, model by model.

    python scripts/bench_models.py [MODEL.onnx ...] [--only mlp,cnn_bn] [--json FILE]

Every ``models/*.onnx`` (``--only`` narrows them by name) and every path given
is converted by both tools with keep_io_types=True, then compared on:

* casts:  Cast nodes added (all graphs, bodies included) vs the original;
* fp16:   share of Conv/MatMul/Gemm nodes whose output is float16;
* size:   converted model bytes / fp32 file bytes;
* parity: worst max |err| and lowest cosine over the outputs vs the fp32 model,
  fp16 emulated on the ONNX Runtime CPU EP (onnxmp.validate), on the model's
  ``<name>.inputs.npz`` when there is one, else on generated inputs.

Target: at equal or better parity, onnxmp inserts no more Casts than occ.
Models that break it are listed at the end (and in the JSON).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402

from onnxmp.naming import json_safe
import onnxmp  # noqa: E402
from onnxmp.errors import first_line  # noqa: E402
from onnxmp.files import guard_arguments, write_text_atomic  # noqa: E402
# Imported by module path: onnxmp.validate may resolve to the submodule once imported.
from onnxmp.parity.validate import validate  # noqa: E402

HEAVY_OPS = ("Conv", "MatMul", "Gemm")
# Relative slack on max |err| within which two conversions count as equally accurate.
PARITY_SLACK = 0.05


def subgraphs(node: onnx.NodeProto):
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from all_nodes(sub)


def all_graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from all_graphs(sub)


def cast_count(model: onnx.ModelProto) -> int:
    return sum(node.op_type == "Cast" for node in all_nodes(model.graph))


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor name we can learn, in every graph."""
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # an invalid model still has declared types to read
        pass
    types: dict[str, int] = {}
    for g in all_graphs(model.graph):
        for info in (*g.input, *g.output, *g.value_info):
            if info.type.HasField("tensor_type"):
                types[info.name] = info.type.tensor_type.elem_type
        for init in g.initializer:
            types[init.name] = init.data_type
        for node in g.node:
            if node.op_type == "Cast":
                to = next((a.i for a in node.attribute if a.name == "to"), None)
                if to is not None:
                    types.setdefault(node.output[0], to)
    return types


def heavy_fp16_share(model: onnx.ModelProto) -> tuple[float | None, int]:
    types = elem_types(model)
    heavy = [n for n in all_nodes(model.graph) if n.op_type in HEAVY_OPS]
    if not heavy:
        return None, 0
    low = sum(types.get(n.output[0], types.get(n.input[0])) == onnx.TensorProto.FLOAT16 for n in heavy)
    return low / len(heavy), len(heavy)


def convert_ours(path: Path) -> onnx.ModelProto:
    return onnxmp.convert(str(path), keep_io_types=True).model


def convert_occ(path: Path) -> onnx.ModelProto:
    from onnxconverter_common import float16

    with warnings.catch_warnings():
        # It warns once per constant it clamps to the fp16 range.
        warnings.simplefilter("ignore")
        return float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)


def parity(path: Path, converted: onnx.ModelProto, inputs: Path | None) -> dict:
    report = validate(str(path), converted, inputs=str(inputs) if inputs else None, provider="cpu")
    floats = [o for o in report.outputs if not o.exact]
    errs = [o.max_abs_err for o in floats if o.max_abs_err is not None]
    cosines = [o.cosine for o in floats if o.cosine is not None]
    nonfinite = sum(o.nonfinite_mismatches for o in floats)
    return {"max_abs_err": max(errs) if errs else None,
            "cosine": min(cosines) if cosines else None,
            "nonfinite_mismatches": nonfinite,
            "passed": report.passed,
            "failures": report.failures()}


def measure(tool: str, path: Path, inputs: Path | None, original_casts: int, fp32_bytes: int) -> dict:
    convert = convert_ours if tool == "ours" else convert_occ
    start = time.perf_counter()
    try:
        model = convert(path)
    except Exception as exc:  # a failing converter is a result, not a crash of the benchmark
        return {"error": f"conversion failed: {type(exc).__name__}: {first_line(exc, 200)}"}
    seconds = time.perf_counter() - start
    share, heavy = heavy_fp16_share(model)
    entry = {"convert_s": seconds, "casts": cast_count(model) - original_casts, "heavy_fp16_share": share,
             "heavy_nodes": heavy, "size_ratio": model.ByteSize() / fp32_bytes, "error": None}
    try:
        entry["parity"] = parity(path, model, inputs)
    except Exception as exc:
        entry["parity"] = None
        entry["error"] = f"parity run failed: {type(exc).__name__}: {first_line(exc, 200)}"
    return entry


def compare_parity(ours: dict, occ: dict) -> str:
    """better / equal / worse for ours vs occ, judged by pass/fail, then worst max |err|."""
    a, b = ours.get("parity"), occ.get("parity")
    if a is None:
        return "worse" if b is not None else "n/a"
    if b is None:
        return "better"
    if a["passed"] != b["passed"]:
        return "better" if a["passed"] else "worse"
    ea, eb = a["max_abs_err"], b["max_abs_err"]
    if ea is None or eb is None:
        return "equal"
    if not math.isfinite(ea) or not math.isfinite(eb):
        return "equal" if math.isfinite(ea) == math.isfinite(eb) else ("better" if math.isfinite(ea) else "worse")
    if ea <= eb * (1 - PARITY_SLACK):
        return "better"
    if ea <= eb * (1 + PARITY_SLACK) + 1e-12:
        return "equal"
    return "worse"


def bench_model(path: Path) -> dict:
    original = onnx.load(str(path))
    npz = path.with_name(path.name[: -len(".onnx")] + ".inputs.npz") if path.name.endswith(".onnx") else None
    inputs = npz if npz is not None and npz.is_file() else None
    fp32_bytes = path.stat().st_size
    original_casts = cast_count(original)
    row = {"name": path.stem, "path": str(path), "nodes": sum(1 for _ in all_nodes(original.graph)),
           "fp32_bytes": fp32_bytes, "inputs": str(inputs) if inputs else "generated"}
    for tool in ("ours", "occ"):
        row[tool] = measure(tool, path, inputs, original_casts, fp32_bytes)
    row["parity_vs_occ"] = compare_parity(row["ours"], row["occ"])
    ours_casts, occ_casts = row["ours"].get("casts"), row["occ"].get("casts")
    row["casts_ok"] = None if ours_casts is None or occ_casts is None else ours_casts <= occ_casts
    return row


def _g(value, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def print_table(rows: list[dict]) -> None:
    header = ("model", "nodes", "casts ours", "casts occ", "fp16 ours", "fp16 occ", "size ours", "size occ",
              "max|err| ours", "max|err| occ", "cosine ours", "cosine occ", "pass ours/occ", "parity", "casts<=occ")
    lines = [header]
    for r in rows:
        cells = [r["name"], str(r["nodes"])]
        for key, spec in (("casts", "d"), ("heavy_fp16_share", ".0%"), ("size_ratio", ".2f")):
            cells += [_g(r[t].get(key), spec) for t in ("ours", "occ")]
        pars = [r[t].get("parity") or {} for t in ("ours", "occ")]
        cells += [_g(p.get("max_abs_err"), ".2e") for p in pars]
        cells += [_g(p.get("cosine"), ".7f") for p in pars]
        cells.append("/".join({True: "ok", False: "FAIL", None: "-"}[p.get("passed")] for p in pars))
        cells.append(r["parity_vs_occ"])
        cells.append({True: "yes", False: "NO", None: "-"}[r["casts_ok"]])
        lines.append(tuple(cells))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    for row in lines:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    for r in rows:
        for tool in ("ours", "occ"):
            if r[tool].get("error"):
                print(f"{r['name']} ({tool}): {r[tool]['error']}")
            for failure in (r[tool].get("parity") or {}).get("failures", []):
                print(f"{r['name']} ({tool}) parity: {failure}")


def summarize(rows: list[dict]) -> dict:
    violations = []
    for r in rows:
        if r["casts_ok"] is False:
            occ_parity = r["occ"].get("parity") or {}
            violations.append({"model": r["name"], "casts_ours": r["ours"]["casts"], "casts_occ": r["occ"]["casts"],
                               "parity_vs_occ": r["parity_vs_occ"], "occ_passed": occ_parity.get("passed")})
    return {"cast_violations": violations,
            "parity_worse": [r["name"] for r in rows if r["parity_vs_occ"] in ("worse", "n/a")]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", type=Path, help="more .onnx models to compare")
    ap.add_argument("--only", help="comma-separated names of models/*.onnx to include (default: all)")
    ap.add_argument("--json", type=Path, help="write the table as JSON here")
    args = ap.parse_args(argv)
    zoo = sorted((ROOT / "models").glob("*.onnx"))
    if args.only is not None:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = wanted - {p.stem for p in zoo}
        if unknown:
            ap.error(f"no models/{'|'.join(sorted(unknown))}.onnx")
        zoo = [p for p in zoo if p.stem in wanted]
    paths = zoo + [p.resolve() for p in args.paths]
    if not paths:
        ap.error("no models to compare")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        ap.error(f"no such model file: {', '.join(missing)}")
    guard_arguments(ap, {"--json": args.json}, {"model": paths})
    rows = []
    for path in paths:
        print(f"  {path.name} ...", file=sys.stderr, flush=True)
        rows.append(bench_model(path))
    print_table(rows)
    summary = summarize(rows)
    print("more Casts than occ (target violated): " + (", ".join(
        f"{v['model']} ({v['casts_ours']} vs {v['casts_occ']}, parity {v['parity_vs_occ']}"
        + (", occ fails parity" if v["occ_passed"] is False else "") + ")"
        for v in summary["cast_violations"]) or "none"))
    print(f"worse parity than occ: {', '.join(summary['parity_worse']) or 'none'}")
    if args.json:
        write_text_atomic(args.json, json.dumps(json_safe({"models": rows, **summary}), indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
