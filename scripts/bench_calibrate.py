"""Accuracy-guided calibration over the bundled models and the hard cases, before and after.

    python scripts/bench_calibrate.py [--models a,b,...] [--tolerance 0.01] [--samples 4] [--json FILE]
                                      [--before DIR]

For each model: plain fp16 conversion's error and the calibrated model's error
(relative, max|out - ref| / max|ref|, worst output; on the held-out sample, the
last of ``--samples``; the others tune), the fp16 share of every non-Constant
node and of Conv/MatMul/Gemm, the Casts the conversion added, the nodes the
search moved, its emulated runs, and wall seconds of the whole
``onnxmp.convert(..., calibration=...)`` call.

``--before DIR``: DIR holds another onnxmp checkout (main's, e.g. from
``git archive main | tar -x -C DIR``); every model is also calibrated with that
onnxmp (in a subprocess, on the same models and samples from this checkout) and
the table shows both side by side, ``before -> after``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _import_paths(onnxmp_dir: str | None) -> None:
    if onnxmp_dir:  # that checkout's onnxmp, this checkout's models
        sys.path.insert(0, os.path.abspath(onnxmp_dir))
        import onnxmp  # noqa: F401
        sys.path.remove(os.path.abspath(onnxmp_dir))
        sys.modules.pop("models", None)
    sys.path.insert(0 if not onnxmp_dir else 1, ROOT)


TRANSFORMER = "transformer_cancellation"


def _error(model, converted, sample) -> float:
    from onnxmp.calibrate import run_with_intermediates
    from onnxmp.parity.emulate import emulate
    from onnxmp.parity.metrics import relative_error

    ref = run_with_intermediates(model, [sample])[0]
    out = run_with_intermediates(emulate(converted, keep_io_types=False), [sample])[0]
    return max(relative_error(ref[o.name], out[o.name]) for o in model.graph.output)


def _low_share(report) -> float | None:
    ops = {v.node: v.op for v in report.vertices if v.op != "Constant"}
    colors = report.node_colors()
    return sum(colors.get(n) == "allow" for n in ops) / len(ops) if ops else None


def _casts(original, converted) -> int:
    def casts(model):
        return sum(n.op_type == "Cast" for n in model.graph.node)
    return casts(converted) - casts(original)


def bench(name: str, tolerance: float, count: int) -> dict:
    import onnxmp
    from models import hard_cases
    from models.zoo import build

    model = hard_cases.BUILDERS[name]() if name in hard_cases.BUILDERS else build(name)
    samples = hard_cases.samples(name, count)
    plain = onnxmp.convert(model)
    start = time.perf_counter()
    result = onnxmp.convert(model, calibration=samples, tolerance=tolerance)
    seconds = time.perf_counter() - start
    cal = result.report.calibration
    return {
        "model": name, "nodes": len(model.graph.node),
        "plain_error": _error(model, plain.model, samples[-1]),
        "calibrated_error": _error(model, result.model, samples[-1]),
        "tune_error": cal.final.tune_error if cal.final else 0.0,
        "met": cal.met, "share_plain": plain.report.tensor_core_share(),
        "share": result.report.tensor_core_share(), "share_all": _low_share(result.report),
        "casts": _casts(model, result.model), "moved": len(cal.moved), "candidates": cal.candidates,
        "runs": cal.runs, "cycles": len(cal.cycles), "seconds": seconds,
    }


def _before(directory: str, names: list[str], tolerance: float, count: int) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "before.json")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--onnxmp", directory, "--models",
                               ",".join(names), "--tolerance", str(tolerance), "--samples", str(count), "--json", out,
                               "--quiet"], cwd=ROOT, capture_output=True, text=True)
        if not os.path.exists(out):
            raise SystemExit(f"the --before run failed:\n{proc.stdout}{proc.stderr}")
        with open(out) as f:
            return {r["model"]: r for r in json.load(f)["rows"]}


def _share(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def _pair(before: dict | None, after: dict, key: str, fmt) -> str:
    return fmt(after[key]) if before is None else f"{fmt(before[key])} -> {fmt(after[key])}"


COLUMNS = [("calib err", "calibrated_error", lambda v: f"{v:.2g}"), ("met", "met", lambda v: "yes" if v else "NO"),
           ("fp16 all", "share_all", _share), ("fp16 C/M/G", "share", _share), ("Casts", "casts", str),
           ("moved", "moved", str), ("runs", "runs", str), ("s", "seconds", lambda v: f"{v:.1f}")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None)
    parser.add_argument("--tolerance", type=float, default=1e-2)
    parser.add_argument("--samples", type=int, default=4, help="samples per model; the last one is held out")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--before", metavar="DIR", help="another onnxmp checkout to compare with (main's)")
    parser.add_argument("--onnxmp", metavar="DIR", help=argparse.SUPPRESS)  # the --before subprocess
    parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _import_paths(args.onnxmp)
    from models import hard_cases
    from models.zoo import COMMITTED
    from onnxmp.files import guard_arguments, write_text_atomic
    from onnxmp.naming import json_safe

    guard_arguments(parser, {"--json": args.json})
    names = (args.models or ",".join([*COMMITTED, *hard_cases.BUILDERS])).split(",")
    before = _before(args.before, names, args.tolerance, args.samples) if args.before else {}
    say = (lambda *a, **k: None) if args.quiet else print
    say(f"tolerance {args.tolerance:g} (rel, held-out sample), {args.samples} samples, "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs" + (" ; before -> after" if before else ""))
    width = 21 if before else 11
    header = f"{'model':<26}{'nodes':>6}{'plain err':>11}" + "".join(f"{c:>{width}}" for c, _, _ in COLUMNS)
    say(header)
    say("-" * len(header))
    rows = []
    for name in names:
        row = bench(name, args.tolerance, args.samples)
        rows.append(row)
        old = before.get(name)
        cells = "".join(f"{_pair(old, row, k, f):>{width}}" for _, k, f in COLUMNS)
        say(f"{name:<26}{row['nodes']:>6}{row['plain_error']:>11.2g}{cells}", flush=True)
    if args.json:
        write_text_atomic(args.json, json.dumps(json_safe({"tolerance": args.tolerance, "rows": rows,
                                                           "before": list(before.values())}), indent=2))
    failed = [r["model"] for r in rows if not r["met"] or (r["share"] is not None and r["share"] < 0.8)]
    if failed:
        say(f"missed (tolerance or 80% fp16 Conv/MatMul/Gemm share): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
