"""Fuzz the conversion on many random graphs and summarize.

    python scripts/fuzz_convert.py [--examples 1000] [--seed S] [--json FILE]

Runs the properties of ``tests/test_fuzz.py`` (valid output with I/O kept,
emulated error within bound, idempotence) on independent graphs from
``tests/strategies.py``, in float16 for every graph and in bfloat16 for every
fourth.  Unlike the hypothesis tests it does not stop at the first failure: it
counts failures per property and keeps the first few failing graphs (as
ONNX text) in the JSON report.  Exit status 1 when any property failed.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import onnxmp  # noqa: E402
from onnxmp.files import guard_arguments, write_text_atomic  # noqa: E402
from tests.strategies import random_graph  # noqa: E402
from tests.test_fuzz import check_idempotent, check_valid, error_ratios  # noqa: E402

PROPERTIES = ("crash", "valid", "error_bound", "idempotent")
KEPT_FAILURES = 20


def run_one(graph, precision: str, keep_io_types: bool, stats: dict) -> None:
    run = stats[precision]
    run["conversions"] += 1
    try:
        result = onnxmp.convert(graph.model, precision=precision, keep_io_types=keep_io_types)
    except Exception as exc:  # the property: nothing at all may be raised
        fail(stats, precision, "crash", graph, exc)
        return
    run["changed"] += bool(result.report.changed)
    for prop, check in (("valid", lambda: check_valid(graph, result, precision, keep_io_types)),
                        ("idempotent", lambda: check_idempotent(result, precision, keep_io_types))):
        try:
            check()
        except Exception as exc:
            fail(stats, precision, prop, graph, exc)
    try:
        ratios = error_ratios(graph, result, precision)
    except Exception as exc:
        fail(stats, precision, "error_bound", graph, exc)
        return
    worst = max(ratios.values())
    run["max_ratio"] = max(run["max_ratio"], worst)
    if not worst <= 1.0:
        fail(stats, precision, "error_bound", graph, AssertionError(f"error / bound = {ratios}"))


def fail(stats: dict, precision: str, prop: str, graph, exc: Exception) -> None:
    stats[precision]["failures"][prop] += 1
    if len(stats["examples"]) < KEPT_FAILURES:
        stats["examples"].append({
            "precision": precision, "property": prop,
            "error": "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000],
            "graph": graph.describe()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the summary and failing graphs here")
    args = parser.parse_args(argv)
    guard_arguments(parser, {"--json": args.json})

    rng = random.Random(args.seed)
    stats: dict = {"examples": []}
    for precision in ("float16", "bfloat16"):
        stats[precision] = {"conversions": 0, "changed": 0, "max_ratio": 0.0,
                            "failures": Counter({p: 0 for p in PROPERTIES})}
    skipped = 0
    start = time.perf_counter()
    for i in range(args.examples):
        graph, rejected = random_graph(rng)
        skipped += rejected
        keep_io_types = rng.random() < 0.5
        run_one(graph, "float16", keep_io_types, stats)
        if i % 4 == 0:
            run_one(graph, "bfloat16", keep_io_types, stats)
    elapsed = time.perf_counter() - start

    summary = {"examples": args.examples, "seed": args.seed, "rejected_graphs": skipped,
               "seconds": round(elapsed, 1)}
    for precision in ("float16", "bfloat16"):
        run = stats[precision]
        summary[precision] = {"conversions": run["conversions"], "changed": run["changed"],
                              "failures": dict(run["failures"]),
                              "max_error_over_bound": round(run["max_ratio"], 4)}
    print(f"examples: {args.examples} (seed {args.seed}; {skipped} ill-conditioned graphs redrawn), "
          f"{elapsed:.1f} s")
    for precision in ("float16", "bfloat16"):
        s = summary[precision]
        failures = ", ".join(f"{p} {n}" for p, n in s["failures"].items())
        print(f"{precision}: {s['conversions']} conversions ({s['changed']} changed the model); "
              f"failures: {failures}; max error / bound: {s['max_error_over_bound']}")
    if args.json:
        write_text_atomic(args.json, json.dumps({"summary": summary, "failing_graphs": stats["examples"]}, indent=2))
    failed = sum(sum(summary[p]["failures"].values()) for p in ("float16", "bfloat16"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
