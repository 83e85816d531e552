"""``onnxmp convert``, ``onnxmp explain`` and ``onnxmp lists``."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from onnxmp.cli import EXIT_TOLERANCE, at_least, positive_float, report_error
from onnxmp.errors import UsageError
from onnxmp.files import all_or_nothing, guard_outputs, write_text_atomic
from onnxmp.lists import LEVELS, LIST_NAMES
from onnxmp.options import Options
from onnxmp.precision import PRECISIONS
from onnxmp.targets import NAMES as TARGETS
from onnxmp.targets import target

log = logging.getLogger("onnxmp.cli")


def register(sub) -> None:
    from onnxmp.cli import add_trust_flag, add_verbosity_flags

    p = sub.add_parser("convert", help="convert a float32 ONNX model to mixed precision",
                       description="Color the model with TensorFlow's AMP algorithm and rewrite it to mixed "
                                   "float16/bfloat16. Prints a summary; --report writes the full explanation.")
    p.add_argument("model", help="input .onnx file")
    p.add_argument("-o", "--output", required=True, help="output .onnx file (written atomically)")
    _add_common(p)
    p.add_argument("--calibrate", nargs="+", metavar="NPZ", default=None,
                   help="sample inputs (.npz): deny nodes whose intermediates overflow and fall back to fp32 "
                        "where the converted model misses --tolerance")
    p.add_argument("--tolerance", type=positive_float, default=None,
                   help="with --calibrate: the largest error allowed per output, in the metric's units "
                        "(default 0.01)")
    p.add_argument("--metric", action="append", default=None, metavar="[OUTPUT=]METRIC",
                   help="with --calibrate: rel (default, max|err|/max|ref|), max_abs, cosine (1 - cosine), "
                        "argmax (share of rows whose last-axis argmax differs) or binary:T (share of elements "
                        "where x > T differs); OUTPUT=METRIC for one output (repeatable)")
    p.add_argument("--holdout", type=at_least(0), default=None, metavar="K",
                   help="with --calibrate: tune on all but the last K samples and report on those "
                        "(default: a quarter of them once there are two or more)")
    p.add_argument("--max-runs", type=at_least(1), default=None, metavar="N",
                   help="with --calibrate: emulated runs before the search stops with the best model found "
                        "(default 2000)")
    p.add_argument("--time-budget", type=positive_float, default=None, metavar="SECONDS",
                   help="with --calibrate: stop searching after about SECONDS and write the best model found "
                        "so far (default: no limit)")
    p.add_argument("--report", metavar="FILE.json", help="write the full per-vertex explanation as JSON")
    add_trust_flag(p)
    add_verbosity_flags(p)
    p.set_defaults(func=_convert)

    p = sub.add_parser("explain", help="show how a model would be colored, without converting it")
    p.add_argument("model", help="input .onnx file")
    _add_common(p)
    p.add_argument("--json", action="store_true", help="print the full explanation as JSON")
    add_trust_flag(p)
    add_verbosity_flags(p)
    p.set_defaults(func=_explain)

    p = sub.add_parser("lists", help="print the op lists and the kernel coverage of a target")
    p.add_argument("--target", choices=TARGETS, default="cuda")
    p.add_argument("--precision", choices=PRECISIONS, default="float16")
    p.add_argument("--level", choices=LEVELS, default="default")
    p.add_argument("--opset", type=at_least(1), default=17, help="opset at which kernel coverage is shown (default 17)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_verbosity_flags(p)
    p.set_defaults(func=_lists)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=TARGETS, default="cuda", help="execution provider to convert for")
    p.add_argument("--precision", choices=PRECISIONS, default="float16")
    io = p.add_mutually_exclusive_group()
    io.add_argument("--keep-io-types", dest="keep_io_types", nargs="*", metavar="NAME", default=True,
                    help="keep graph inputs/outputs as declared (the default); with names (or regular "
                         "expressions matching whole names), keep only those and turn every other float32 "
                         "input/output low precision, e.g. --keep-io-types logits")
    io.add_argument("--no-keep-io-types", dest="keep_io_types", action="store_false",
                    help="turn every float32 graph input/output low precision (Cast inside where needed)")
    p.add_argument("--level", choices=LEVELS, default="default")
    for name in LIST_NAMES:
        p.add_argument(f"--{name}-add", action="append", default=[], metavar="OP", help=f"add OP to the {name} list")
        p.add_argument(f"--{name}-remove", action="append", default=[], metavar="OP",
                       help=f"remove OP from the {name} list")
    p.add_argument("--block-node", action="append", default=[], metavar="REGEX",
                   help="keep nodes whose name matches REGEX in float32 (repeatable)")
    p.add_argument("--ort-version", default=None, metavar="X.Y.Z",
                   help="the onnxruntime the model will run on: its schemas and kernels decide onnxruntime's own "
                        "ops (com.microsoft). Default: all, every onnxruntime onnxmp knows (1.19.2 to the newest), so the "
                        "model loads in each")


def _overrides(args) -> dict[str, list[str]]:
    out = {}
    for name in LIST_NAMES:
        for action in ("add", "remove"):
            ops = [op for chunk in getattr(args, f"{name}_{action}") for op in chunk.split(",") if op]
            if ops:
                out[f"{name}_{action}"] = ops
    return out


def options_from(args) -> Options:
    """The :class:`~onnxmp.options.Options` the command line asks for."""
    keep = args.keep_io_types
    if isinstance(keep, list):  # --keep-io-types NAME...; without names, the default
        keep = keep or True
    calibration = {name: getattr(args, name, None) for name in ("tolerance", "metric", "holdout", "max_runs",
                                                                      "time_budget")}
    if not getattr(args, "calibrate", None):
        given = [f"--{k.replace('_', '-')}" for k, v in calibration.items() if v is not None]
        if given:
            raise UsageError(f"{given[0]} needs --calibrate", hint="pass sample inputs: --calibrate inputs.npz")
    return Options(target=args.target, precision=args.precision, keep_io_types=keep, level=args.level,
                   lists=_overrides(args), block_nodes=args.block_node, ort_version=getattr(args, "ort_version", None),
                   calibration=getattr(args, "calibrate", None) or None, **calibration)


def _convert(args) -> int:
    import onnxmp
    from onnxmp.save import external_data_path

    options = options_from(args)
    # -o's external data (`OUT.data`, written for large models) is checked now too, not after the work.
    guard_outputs({"-o": args.output, "--report": args.report,
                   "external data of -o": external_data_path(args.output)},
                  {"input model": args.model, "--calibrate": args.calibrate})
    result = onnxmp.convert(args.model, options)
    calibration = result.report.calibration
    with all_or_nothing():  # a failed report takes the model with it, not the user's old files
        onnxmp.save(result.model, args.output, source=args.model)
        if args.report:
            write_text_atomic(args.report, result.report.to_json())
    sys.stdout.write(result.report.summary() + "\n")
    sys.stdout.write(f"wrote {args.output}\n")
    if calibration is not None and not calibration.met:
        # The best model found is written: minutes of search are never thrown away.
        report_error("onnxmp convert", f"calibration missed the tolerance: best error {calibration.error:.3g} > "
                     f"{calibration.tolerance:g} ({calibration.error - calibration.tolerance:.3g} above); the best "
                     "model found was written",
                     "raise --tolerance or --max-runs, or --block-node the parts named above")
        return EXIT_TOLERANCE
    return 0


def _explain(args) -> int:
    import onnxmp

    report = onnxmp.explain(args.model, options_from(args))
    if args.json:
        sys.stdout.write(report.to_json() + "\n")
        return 0
    sys.stdout.write(report.summary(full="every vertex is listed below") + "\n\n")
    sys.stdout.write(f"{'vertex':<48}{'color':<7}{'rule':<48}cause\n")
    for v in report.vertices:
        sys.stdout.write(f"{v.vertex:<48}{v.color:<7}{v.rule:<48}{v.cause}\n")
    return 0


def _lists(args) -> int:
    from onnxmp.kernels import KernelTable
    from onnxmp.lists import resolve_lists

    lists = resolve_lists(args.target, args.precision, args.level)
    table = KernelTable.default()
    provider = target(args.target).provider
    coverage = {}
    for name in LIST_NAMES:
        for op in sorted(lists[name]):
            domain, _, op_type = op.rpartition(":")
            coverage[op] = {"list": name, "kernel": table.supports(provider, domain, op_type, args.opset, None,
                                                                   args.precision)}
    if args.json:
        sys.stdout.write(json.dumps({"target": args.target, "precision": args.precision, "level": args.level,
                                     "opset": args.opset, "kernel_table": table.source, "ops": coverage},
                                    indent=2) + "\n")
        return 0
    sys.stdout.write(f"target={args.target} precision={args.precision} level={args.level} opset={args.opset}\n")
    sys.stdout.write(f"kernel facts: {table.source}\n")
    mark = {True: "yes", False: "no", None: "no kernel"}
    for name in LIST_NAMES:
        ops = sorted(op for op, c in coverage.items() if c["list"] == name)
        sys.stdout.write(f"\n{name} ({len(ops)} ops)   {args.precision} kernel on {provider} at opset {args.opset}\n")
        for op in ops:
            sys.stdout.write(f"  {op:<40}{mark[coverage[op]['kernel']]}\n")
    return 0
