"""Conversion speed on synthetic transformer graphs of about 1k to 80k nodes.

    python scripts/bench_convert.py [--shape both|quadratic-occ|linear-occ] [--sizes 1k,5k,20k,80k]
                                    [--repeat 3] [--json FILE] [--timeout SECONDS] [--profile N]
                                    [--rss SIZE]

Two graph shapes, both transformer stacks with hidden=8 so even 80k nodes have tiny weights:

* ``quadratic-occ``: ``models.zoo.transformer_stack`` (decomposed LayerNorm, Q/K/V MatMul+Add,
  Softmax with an additive mask, Erf GELU, residual adds; 67 nodes per layer, value_info for
  every tensor).  onnxconverter-common goes quadratic on it.
* ``linear-occ``: ``models.zoo.linear_occ_stack``, built with onnx.helper the way exporters
  with fused ops emit it: the LayerNormalization op, MatMul+Add projections, attention with an
  additive mask graph input (unsqueezed once), Erf GELU, no value_info (34 nodes per layer).  onnxconverter-common
  is linear on it.

Three things are timed per repetition, in one process, interleaved (the order rotates each
repetition so none always runs on a warm or a cold heap):

* ours:  ``onnxmp.convert`` (total wall, plus its per-stage report.timings);
* occ:   ``onnxconverter_common.float16.convert_float_to_float16(keep_io_types=True)``;
* floor: ``onnx.load`` + ``onnx.save`` of the same model through a temp file.

The table shows medians, ours/occ, and the growth per 4x nodes,
``(t(n) / t(m)) ** (ln 4 / ln(n / m))`` between consecutive sizes m < n
(exactly t(n)/t(n/4) when the sizes are 4x apart; linear scaling is 4.0).

``--timeout`` caps one call: a call that runs past it is stopped and counted as
"> timeout"; that measurement is then skipped at the larger sizes.

``--rss SIZE`` (default: the largest size) also measures peak resident memory of each
converter at that size: each converter runs alone in a fresh child process that loads the
saved model and converts it; the child's ``VmHWM`` (peak RSS, the model's load included)
is reported, with ``load-only`` (the same child doing nothing but load) as the floor.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import os
import platform
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402

import onnxmp  # noqa: E402
from peak_rss import peak_rss_mib  # noqa: E402
from onnxmp.files import guard_arguments, write_text_atomic  # noqa: E402
from models import zoo  # noqa: E402

STAGES = ("load", "normalize", "color", "rewrite", "verify")
THINGS = ("ours", "occ", "floor")
SHAPES = ("quadratic-occ", "linear-occ")
HIDDEN, SEQ, HEADS = 8, 4, 2
LINEAR_NODES_PER_LAYER, LINEAR_SHARED_NODES = 34, 2
TARGET_RSS = 1.5     # ours/occ peak RSS at the RSS size
TARGET_RATIO = 1.0   # ours/occ at the largest size
TARGET_GROWTH = 4.4  # per 4x nodes


class CallTimeout(Exception):
    pass


def _raise_timeout(signum, frame):
    raise CallTimeout()


@contextmanager
def deadline(seconds: float | None):
    # SIGALRM interrupts the pure-Python loops that dominate both converters.
    if not seconds:
        yield
        return
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def parse_size(text: str) -> int:
    text = text.strip().lower()
    scale = 1000 if text.endswith("k") else 1
    return int(float(text.rstrip("k")) * scale)


def layers_for(nodes: int, shape: str = "quadratic-occ") -> int:
    if shape == "linear-occ":
        return max(1, round((nodes - LINEAR_SHARED_NODES) / LINEAR_NODES_PER_LAYER))
    # transformer_stack has 67 nodes per layer plus 7 shared ones.
    return max(1, round((nodes - 7) / 67))


def build(shape: str, n_layers: int) -> onnx.ModelProto:
    if shape == "linear-occ":
        return zoo.linear_occ_stack(n_layers, hidden=HIDDEN, seq=SEQ, heads=HEADS)
    return zoo.transformer_stack(n_layers, hidden=HIDDEN, seq=SEQ, heads=HEADS)


def run_ours(model: onnx.ModelProto) -> dict:
    start = time.perf_counter()
    result = onnxmp.convert(model)
    total = time.perf_counter() - start
    return {"total": total, "stages": {s: result.report.timings.get(s, 0.0) for s in STAGES},
            "casts": result.report.casts_inserted}


def run_occ(model: onnx.ModelProto) -> dict:
    from onnxconverter_common import float16

    start = time.perf_counter()
    with warnings.catch_warnings():
        # It warns once per clamped constant (the -1e9 mask fill, eps 1e-12).
        warnings.simplefilter("ignore")
        float16.convert_float_to_float16(model, keep_io_types=True)
    return {"total": time.perf_counter() - start}


def run_floor(path: str, out_path: str) -> dict:
    start = time.perf_counter()
    onnx.save(onnx.load(path), out_path)
    return {"total": time.perf_counter() - start}


def growth_per_4x(t_small: float | None, t_big: float | None, n_small: int, n_big: int) -> float | None:
    if not t_small or not t_big or n_big <= n_small:
        return None
    return (t_big / t_small) ** (math.log(4) / math.log(n_big / n_small))


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def profile_ours(model: onnx.ModelProto, top: int) -> dict:
    profiler = cProfile.Profile()
    profiler.enable()
    onnxmp.convert(model)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    total = max(stats.total_tt, 1e-9)
    rows = []
    for (filename, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        where = filename.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
        rows.append({"function": f"{where}:{line}({func})", "calls": ncalls, "tottime_s": tottime,
                     "cumtime_s": cumtime, "cum_share": cumtime / total})
    by_cumulative = sorted(rows, key=lambda r: r["cumtime_s"], reverse=True)[:top]
    by_own = sorted(rows, key=lambda r: r["tottime_s"], reverse=True)[:top]
    return {"total_s": total, "top_cumulative": by_cumulative, "top_own": by_own}


def fmt_s(value: float | None, timed_out: bool = False, limit: float | None = None) -> str:
    if timed_out:
        return f">{limit:.0f}s"
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def fmt_x(value: float | None, prefix: str = "") -> str:
    return "-" if value is None else f"{prefix}{value:.2f}x"


def bench(shapes: list[str], sizes: list[str], repeat: int, timeout: float | None, profile_top: int,
          rss_size: str | None) -> dict:
    result = {"config": {"shapes": shapes, "sizes": sizes, "repeat": repeat, "timeout_s": timeout,
                         "hidden": HIDDEN, "seq": SEQ, "heads": HEADS, "rss_size": rss_size,
                         "python": platform.python_version(), "onnx": onnx.__version__, "cpus": os.cpu_count()},
              "shapes": {}}
    for shape in shapes:
        rows = bench_shape(shape, sizes, repeat, timeout, profile_top, rss_size)
        result["shapes"][shape] = {"rows": rows, "targets": _targets(rows)}
    return result


def bench_shape(shape: str, sizes: list[str], repeat: int, timeout: float | None, profile_top: int,
                rss_size: str | None) -> list[dict]:
    rows = []
    dead: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
        for label in sizes:
            n_layers = layers_for(parse_size(label), shape)
            model = build(shape, n_layers)
            path = os.path.join(tmp, "model.onnx")
            onnx.save(model, path)
            samples: dict[str, list[dict]] = {t: [] for t in THINGS}
            timed_out = {t: t in dead for t in THINGS}
            calls = {"ours": lambda: run_ours(model), "occ": lambda: run_occ(model),
                     "floor": lambda: run_floor(path, os.path.join(tmp, "copy.onnx"))}
            for rep in range(repeat):
                order = THINGS[rep % 3:] + THINGS[:rep % 3]
                for thing in order:
                    if timed_out[thing]:
                        continue
                    gc.collect()  # don't charge the previous call's garbage to this one
                    try:
                        with deadline(timeout):
                            samples[thing].append(calls[thing]())
                    except CallTimeout:
                        timed_out[thing] = True
                        dead.add(thing)
                print(f"  {shape} {label}: repetition {rep + 1}/{repeat} done", file=sys.stderr, flush=True)
            row = {"shape": shape, "size": label, "layers": n_layers, "nodes": len(model.graph.node),
                   "model_bytes": os.path.getsize(path)}
            for thing in THINGS:
                entry = {"total": median_or_none([s["total"] for s in samples[thing]]),
                         "samples": [s["total"] for s in samples[thing]], "timed_out": timed_out[thing]}
                if thing == "ours":
                    entry["stages"] = {st: median_or_none([s["stages"][st] for s in samples[thing]])
                                       for st in STAGES}
                    entry["casts"] = samples[thing][0]["casts"] if samples[thing] else None
                row[thing] = entry
            row["ours_over_occ"] = _ratio(row["ours"], row["occ"], timeout)
            row["ours_over_floor"] = _ratio(row["ours"], row["floor"], timeout)
            del model
            if label == rss_size:
                row["peak_rss_mb"] = {thing: peak_rss_mb(thing, path, timeout) for thing in ("ours", "occ", "load")}
                ours, occ = row["peak_rss_mb"]["ours"], row["peak_rss_mb"]["occ"]
                row["rss_ours_over_occ"] = ours / occ if ours and occ else None
            if profile_top and not timed_out["ours"]:
                row["profile"] = profile_ours(onnx.load(path), profile_top)
            rows.append(row)
    for prev, row in zip([None] + rows[:-1], rows):
        row["growth_per_4x"] = {t: (growth_per_4x(prev[t]["total"], row[t]["total"], prev["nodes"], row["nodes"])
                                    if prev else None) for t in THINGS}
    return rows


def peak_rss_mb(thing: str, path: str, timeout: float | None) -> float | None:
    """Peak RSS (VmHWM) of a fresh child that loads ``path`` and runs ``thing`` on it alone."""
    try:
        proc = subprocess.run([sys.executable, __file__, "--rss-child", thing, path], capture_output=True,
                              text=True, timeout=timeout * 2 if timeout else None, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        print(f"  peak RSS of {thing} failed: {proc.stderr[-500:]}", file=sys.stderr)
        return None
    return float(proc.stdout.strip().splitlines()[-1])


def rss_child(thing: str, path: str) -> None:
    model = onnx.load(path)
    if thing == "ours":
        run_ours(model)
    elif thing == "occ":
        run_occ(model)
    print(peak_rss_mib())


def _ratio(a: dict, b: dict, timeout: float | None) -> dict:
    """a/b, with which side is only a lower bound when a call timed out."""
    if a["timed_out"] and b["timed_out"]:
        return {"value": None, "bound": None}
    if a["timed_out"]:
        return {"value": timeout / b["total"], "bound": "lower"}
    if b["timed_out"]:
        return {"value": a["total"] / timeout, "bound": "upper"}
    return {"value": a["total"] / b["total"], "bound": None}


def _targets(rows: list[dict]) -> dict:
    last = rows[-1]
    ratio = last["ours_over_occ"]
    if ratio["value"] is None:
        ratio_met = None
    elif ratio["bound"] == "lower":
        ratio_met = False if ratio["value"] > TARGET_RATIO else None
    else:
        ratio_met = ratio["value"] <= TARGET_RATIO
    growths = [r["growth_per_4x"]["ours"] for r in rows if r["growth_per_4x"]["ours"] is not None]
    worst = max(growths) if growths else None
    ratios = [r["ours_over_occ"]["value"] for r in rows if r["ours_over_occ"]["value"] is not None]
    rss = next((r for r in rows if r.get("rss_ours_over_occ") is not None), None)
    return {"ours_over_occ_at_largest": {"size": last["size"], "value": ratio["value"], "bound": ratio["bound"],
                                         "limit": TARGET_RATIO, "met": ratio_met},
            "ours_over_occ_worst": {"value": max(ratios) if ratios else None, "limit": TARGET_RATIO,
                                    "met": max(ratios) <= TARGET_RATIO if ratios else None},
            "ours_growth_per_4x": {"worst": worst, "limit": TARGET_GROWTH,
                                   "met": None if worst is None else worst <= TARGET_GROWTH},
            "peak_rss_ours_over_occ": {"size": rss["size"] if rss else None,
                                       "value": rss["rss_ours_over_occ"] if rss else None, "limit": TARGET_RSS,
                                       "met": rss["rss_ours_over_occ"] <= TARGET_RSS if rss else None}}


def print_table(result: dict) -> None:
    timeout = result["config"]["timeout_s"]
    header = ("shape", "size", "nodes", "ours", *STAGES, "occ", "floor", "ours/occ", "ours/floor",
              "grow ours", "grow occ", "grow floor")
    lines = [header]
    for shape, data in result["shapes"].items():
        for r in data["rows"]:
            ours, occ, floor = r["ours"], r["occ"], r["floor"]
            stages = [fmt_s(ours["stages"][s]) for s in STAGES]
            lines.append((shape, r["size"], str(r["nodes"]), fmt_s(ours["total"], ours["timed_out"], timeout),
                          *stages, fmt_s(occ["total"], occ["timed_out"], timeout),
                          fmt_s(floor["total"], floor["timed_out"], timeout),
                          _fmt_ratio(r["ours_over_occ"]), _fmt_ratio(r["ours_over_floor"]),
                          *(fmt_x(r["growth_per_4x"][t]) for t in THINGS)))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    print(f"median seconds over {result['config']['repeat']} repetition(s); "
          f"hidden={HIDDEN} seq={SEQ} heads={HEADS}")
    for row in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    for shape, data in result["shapes"].items():
        for r in data["rows"]:
            if "peak_rss_mb" in r:
                mb = r["peak_rss_mb"]
                print(f"{shape} {r['size']} peak RSS (MB, fresh child each, load included): "
                      + "  ".join(f"{k} {fmt_s(v)}" for k, v in mb.items())
                      + f"  ours/occ {fmt_x(r['rss_ours_over_occ'])}")
    for shape, data in result["shapes"].items():
        t = data["targets"]
        worst = t["ours_over_occ_worst"]
        print(f"{shape}: target ours/occ <= {worst['limit']} at every size: worst {fmt_x(worst['value'])} "
              f"-> {_verdict(worst['met'])}")
        growth = t["ours_growth_per_4x"]
        print(f"{shape}: target ours growth <= {growth['limit']}x per 4x nodes: worst {fmt_x(growth['worst'])} "
              f"-> {_verdict(growth['met'])}")
        rss = t["peak_rss_ours_over_occ"]
        if rss["value"] is not None:
            print(f"{shape}: target peak RSS ours/occ <= {rss['limit']} at {rss['size']}: {fmt_x(rss['value'])} "
                  f"-> {_verdict(rss['met'])}")


def _fmt_ratio(ratio: dict) -> str:
    return fmt_x(ratio["value"], {"lower": ">", "upper": "<"}.get(ratio["bound"], ""))


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "NOT met", None: "unknown"}[met]


def print_profiles(result: dict) -> None:
    for r in (r for data in result["shapes"].values() for r in data["rows"]):
        if "profile" not in r:
            continue
        total = r["profile"]["total_s"]
        print(f"\ncProfile of onnxmp.convert on {r['shape']} at {r['size']} ({r['nodes']} nodes), "
              f"{total:.1f} s under the profiler")
        print("  by cumulative time:  share  cumtime     calls  function")
        for p in r["profile"]["top_cumulative"]:
            print(f"{100 * p['cum_share']:26.1f}%  {p['cumtime_s']:6.2f}s  {p['calls']:>8}  {p['function']}")
        print("  by own time:         share  tottime     calls  function")
        for p in r["profile"]["top_own"]:
            print(f"{100 * p['tottime_s'] / total:26.1f}%  {p['tottime_s']:6.2f}s  {p['calls']:>8}  {p['function']}")


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--rss-child"]:  # internal: one measured child process
        rss_child(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="both", choices=("both", *SHAPES),
                    help="graph shape (default: %(default)s)")
    ap.add_argument("--sizes", default="1k,5k,20k,80k", help="node counts, e.g. 1k,5k (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions per size (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=None, help="stop any single call after this many seconds")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also cProfile one onnxmp.convert per size and print the top N functions")
    ap.add_argument("--rss", metavar="SIZE", default=None,
                    help="measure peak RSS at this size (default: the largest; 'none' to skip)")
    ap.add_argument("--json", type=Path, help="write the table as JSON here")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes or args.repeat < 1:
        ap.error("need at least one size and --repeat >= 1")
    rss_size = None if args.rss == "none" else (args.rss or sizes[-1])
    if rss_size is not None and rss_size not in sizes:
        ap.error(f"--rss {rss_size} is not one of --sizes")
    guard_arguments(ap, {"--json": args.json})
    shapes = list(SHAPES) if args.shape == "both" else [args.shape]
    result = bench(shapes, sizes, args.repeat, args.timeout, args.profile, rss_size)
    print_table(result)
    print_profiles(result)
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
