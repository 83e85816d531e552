"""Accuracy-guided calibration side by side: this checkout, the previous release, onnxconverter-common.

    python scripts/bench_calibrate.py [--corpus] [--models a,b,...] [--tolerance 0.01] [--samples N]
                                      [--before DIR] [--occ] [--limit S] [--json FILE]

Models: ``--corpus`` takes the real models of ``models/corpus.py`` (fetched into ``$ONNXMP_CORPUS`` on
first use; 6 samples each, the last 2 held out); otherwise the bundled models and the hard cases
(``--samples``, the last held out).  Each method runs in a subprocess of its own (``--limit``
seconds at most), writes its model, and this process measures every written model the same way:

* ``err`` / ``held``: relative error (max|out - ref| / max|ref|, worst output and sample) of the
  written model, emulated by :func:`onnxmp.parity.emulate.emulate`, on the tuning / held-out samples;
* ``fp16 all`` / ``fp16 C/M/G``: share of the non-Cast, non-Constant nodes (all graphs), and of
  Conv/MatMul/Gemm, that read or write a float16 tensor in the written model;
* ``Casts``: Cast nodes added (all graphs); ``runs``: candidates the method ran; ``s``: its wall
  seconds (the conversion call alone); ``cpu s``: CPU seconds of its whole subprocess (all threads).

Methods: ``after`` (this checkout's ``onnxmp.convert(..., calibration=...)``), ``before`` with
``--before DIR`` (the same call with the onnxmp of another checkout, e.g.
``git worktree add DIR main``), and ``occ`` with ``--occ`` (onnxconverter-common's
``auto_convert_mixed_precision`` on the first tuning sample, keep_io_types=True, validated at the
same relative tolerance on every output; it runs real float16 on onnxruntime's CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
HEAVY = ("Conv", "MatMul", "Gemm")


def _case(name: str, count: int):
    """(model, samples, held-out count) for a corpus model, a bundled model or a hard case."""
    import onnx
    from models import corpus, hard_cases
    from models.zoo import build

    if name in corpus.CORPUS:
        return onnx.load(corpus.model_path(name)), corpus.samples(name), corpus.HOLDOUT
    model = hard_cases.BUILDERS[name]() if name in hard_cases.BUILDERS else build(name)
    return model, hard_cases.samples(name, count), 1


# --- one method on one model (in a subprocess) -------------------------------------------------


def _run_onnxmp(model, samples, holdout: int, tolerance: float):
    import onnxmp

    start = time.perf_counter()
    result = onnxmp.convert(model, calibration=samples, tolerance=tolerance, holdout=holdout)
    seconds = time.perf_counter() - start
    cal = result.report.calibration
    release = cal.release  # the release step's proof: Conv/MatMul/Gemm kept, each measured failing back in fp16
    return result.model, {"runs": cal.runs, "seconds": seconds, "claimed_met": cal.met, "moved": len(cal.moved),
                          "fallback": any(m.reason == "all-float32 fallback" for m in cal.moved),
                          "released": None if release is None else len(release.released),
                          "kept_proven": None if release is None or not release.proven
                          else {k.node: k.error_released for k in release.kept},
                          # getattr: a --before checkout may predate the landed-model release
                          "ruled": None if release is None
                          else {r.node: r.reason for r in getattr(release, "ruled", [])},
                          "release_landed": None if release is None else getattr(release, "landed", None)}


def _run_occ(model, samples, holdout: int, tolerance: float):
    import numpy as np
    from onnxconverter_common.auto_mixed_precision import auto_convert_mixed_precision

    runs = 0

    def validate(ref, out) -> bool:
        nonlocal runs
        runs += 1
        for a, b in zip(ref, out):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            if a.shape != b.shape or not np.isfinite(b).all():
                return False
            if np.abs(a - b).max() > tolerance * max(np.abs(a).max(), 1e-30):
                return False
        return True

    tune = samples[:len(samples) - holdout]
    start = time.perf_counter()
    converted = auto_convert_mixed_precision(model, dict(tune[0]), validate_fn=validate, keep_io_types=True)
    return converted, {"runs": runs, "seconds": time.perf_counter() - start, "moved": None, "fallback": False}


def _one(method: str, name: str, tolerance: float, count: int, out_dir: str) -> None:
    import onnx
    import onnxmp

    model, samples, holdout = _case(name, count)
    runner = _run_occ if method == "occ" else _run_onnxmp
    converted, row = runner(model, samples, holdout, tolerance)
    onnx.save(converted, os.path.join(out_dir, f"{name}.onnx"))
    row["onnxmp"] = os.path.dirname(os.path.dirname(os.path.abspath(onnxmp.__file__)))
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(row, f)


def _spawn(method: str, name: str, args, out_dir: str) -> dict:
    """Run one method on one model in a subprocess; its row, or why it has none."""
    env = dict(os.environ)
    path = [ROOT] if method != "before" else [os.path.abspath(args.before), ROOT]  # that onnxmp, these models
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, os.path.abspath(__file__), "--one", method, "--models", name, "--tolerance",
           str(args.tolerance), "--samples", str(args.samples), "--save", out_dir]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.limit)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer in {args.limit:g} s"}
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = os.path.join(out_dir, f"{name}.json")
    if proc.returncode or not os.path.exists(result):
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if "W:onnxruntime" not in ln]
        return {"error": (lines[-1] if lines else f"exit {proc.returncode}")[:160]}
    with open(result) as f:
        row = json.load(f)
    # CPU seconds of the whole subprocess (loading and writing included): on a loaded machine the
    # wall seconds say more about the neighbours than about the method.
    row["cpu_seconds"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return row


# --- measuring a written model ----------------------------------------------------------------


def _graphs(graph):
    from onnxmp.subgraphs import bodies

    yield graph
    for node in graph.node:
        for body in bodies(node):
            yield from _graphs(body)


def _types(model) -> dict[str, int]:
    from onnxmp.parity.emulate import infer_tensor_types

    types = {name: t.tensor_type.elem_type for name, t in infer_tensor_types(model).items()}
    for g in _graphs(model.graph):
        for v in [*g.input, *g.output, *g.value_info]:
            types.setdefault(v.name, v.type.tensor_type.elem_type)
        for init in g.initializer:
            types.setdefault(init.name, init.data_type)
        for node in g.node:
            if node.op_type == "Constant":
                for a in node.attribute:
                    if a.name == "value":
                        types.setdefault(node.output[0], a.t.data_type)
            elif node.op_type == "Cast":
                types.setdefault(node.output[0], next(a.i for a in node.attribute if a.name == "to"))
    return types


def structure(original, converted) -> dict:
    """fp16 shares (all nodes, Conv/MatMul/Gemm) and Casts added, read from the written model."""
    from onnx import TensorProto

    types = _types(converted)
    low = TensorProto.FLOAT16, TensorProto.BFLOAT16
    nodes = [n for g in _graphs(converted.graph) for n in g.node if n.op_type not in ("Cast", "Constant")]
    is_low = [any(types.get(t) in low for t in [*n.input, *n.output] if t) for n in nodes]
    heavy = [lo for n, lo in zip(nodes, is_low) if n.op_type in HEAVY]

    def casts(model):
        return sum(n.op_type == "Cast" for g in _graphs(model.graph) for n in g.node)

    return {"share_all": sum(is_low) / len(nodes) if nodes else None,
            "share": sum(heavy) / len(heavy) if heavy else None, "casts": casts(converted) - casts(original)}


def errors(original, converted, samples, holdout: int) -> tuple[float, float | None]:
    """Relative error of the emulated written model on the tuning and the held-out samples."""
    from onnxmp.calibrate.session import cpu_session, run_samples
    from onnxmp.parity.emulate import emulate
    from onnxmp.parity.metrics import relative_error

    outputs = [o.name for o in original.graph.output]
    ref = list(run_samples(cpu_session(original, "model"), samples, outputs))
    low = converted
    for precision in ("float16", "bfloat16"):
        low = emulate(low, precision, keep_io_types=False)
    out = list(run_samples(cpu_session(low, "converted model"), samples, outputs))
    per = [max((relative_error(r[o], x[o]) for o in outputs if r[o].dtype.kind == "f"), default=0.0)
           for r, x in zip(ref, out)]
    cut = len(samples) - holdout
    return max(per[:cut]), (max(per[cut:]) if holdout else None)


# --- the table --------------------------------------------------------------------------------


def _f(v, fmt) -> str:
    return "-" if v is None else fmt(v)


COLUMNS = [("err", "error", lambda v: f"{v:.2g}"), ("held", "holdout_error", lambda v: f"{v:.2g}"),
           ("fp16 all", "share_all", lambda v: f"{v:.0%}"), ("fp16 C/M/G", "share", lambda v: f"{v:.0%}"),
           ("Casts", "casts", str), ("runs", "runs", str), ("s", "seconds", lambda v: f"{v:.1f}"),
           ("cpu s", "cpu_seconds", lambda v: f"{v:.0f}")]


def bench(name: str, args, methods: list[str], tmp: str) -> dict:
    import onnx

    model, samples, holdout = _case(name, args.samples)
    plain_model = __import__("onnxmp").convert(model).model
    plain_err, plain_held = errors(model, plain_model, samples, holdout)
    row = {"model": name, "nodes": len(model.graph.node), "plain_error": max(plain_err, plain_held or 0.0)}
    for method in methods:
        out_dir = os.path.join(tmp, method)
        os.makedirs(out_dir, exist_ok=True)
        got = _spawn(method, name, args, out_dir)
        if "error" not in got:
            converted = onnx.load(os.path.join(out_dir, f"{name}.onnx"))
            got["error"], got["holdout_error"] = errors(model, converted, samples, holdout)
            got.update(structure(model, converted))
            got["met"] = max(got["error"], got["holdout_error"] or 0.0) <= args.tolerance
        else:
            got = {"failed": got["error"], "met": False}
        row[method] = got
    return row


def _line(row: dict, method: str) -> str:
    got = row[method]
    if "failed" in got:
        return f"  {method:<7}failed: {got['failed']}"
    cells = "".join(f"{_f(got.get(k), fmt):>11}" for _, k, fmt in COLUMNS)
    flag = "" if got["met"] else "  MISSED"
    if got.get("claimed_met") and not got["met"]:
        flag += " (claimed met)"
    if got.get("fallback"):
        flag += " (all-fp32 fallback)"
    return f"  {method:<7}{cells}{flag}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", action="store_true", help="the real models of models/corpus.py")
    parser.add_argument("--models", default=None)
    parser.add_argument("--tolerance", type=float, default=1e-2)
    parser.add_argument("--samples", type=int, default=4, help="samples per bundled model; the last is held out")
    parser.add_argument("--before", metavar="DIR", help="another onnxmp checkout to compare with (main's)")
    parser.add_argument("--occ", action="store_true", help="also onnxconverter-common's auto_convert_mixed_precision")
    parser.add_argument("--limit", type=float, default=600.0, help="seconds per method and model")
    parser.add_argument("--methods", help="comma-separated subset of before,after,occ (default: all asked for)")
    parser.add_argument("--table", metavar="JSON,...", help="print the table of earlier --json files (rows merged)")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--one", choices=["after", "before", "occ"], help=argparse.SUPPRESS)  # the subprocess
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # PYTHONPATH says whose onnxmp; this checkout's models whatever that checkout holds
        import onnxmp  # noqa: F401
        sys.path.insert(0, ROOT)
        sys.modules.pop("models", None)
        _one(args.one, args.models, args.tolerance, args.samples, args.save)
        return 0
    sys.path.insert(0, ROOT)
    from models import corpus, hard_cases
    from models.zoo import COMMITTED
    from onnxmp.files import guard_arguments, write_text_atomic
    from onnxmp.naming import json_safe

    guard_arguments(parser, {"--json": args.json})
    default = list(corpus.CORPUS) if args.corpus else [*COMMITTED, *hard_cases.BUILDERS]
    names = args.models.split(",") if args.models else default
    methods = [*(["before"] if args.before else []), "after", *(["occ"] if args.occ else [])]
    if args.methods:
        methods = [m for m in ("before", "after", "occ") if m in args.methods.split(",")]
    print(f"tolerance {args.tolerance:g} (relative, worst output and sample), python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'model':<24}{'nodes':>6}{'plain':>8}  {'':<7}" + "".join(f"{c:>11}" for c, _, _ in COLUMNS))
    rows = []
    if args.table:
        merged: dict[str, dict] = {}
        for path in args.table.split(","):
            with open(path) as f:
                for row in json.load(f)["rows"]:
                    merged.setdefault(row["model"], {}).update(row)
        rows = [merged[n] for n in names if n in merged]
        methods = [m for m in ("before", "after", "occ") if any(m in r for r in rows)]
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = next((r for r in rows if r["model"] == name), None) if args.table else bench(name, args, methods, tmp)
            if row is None:
                continue
            if not args.table:
                rows.append(row)
                if args.json:  # after each model: a long run stopped half-way keeps what it measured
                    write_text_atomic(args.json, json.dumps(json_safe({"tolerance": args.tolerance,
                                                                       "methods": methods, "rows": rows}), indent=2))
            print(f"{name:<24}{row['nodes']:>6}{row['plain_error']:>8.2g}", flush=True)
            for method in methods:
                if method in row:
                    print(f"{'':<36}{_line(row, method)}", flush=True)
    if args.json:
        write_text_atomic(args.json, json.dumps(json_safe({"tolerance": args.tolerance, "methods": methods,
                                                           "rows": rows}), indent=2))
    failed = [r["model"] for r in rows if "after" in r
              if not r["after"]["met"] or (r["after"].get("share") is not None and r["after"]["share"] < 0.8)]
    if failed:
        print(f"missed (tolerance or 80% fp16 Conv/MatMul/Gemm share): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
