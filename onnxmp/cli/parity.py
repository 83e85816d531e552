"""``onnxmp emulate`` and ``onnxmp validate``: run low precision on the CPU and check parity."""
from __future__ import annotations

import argparse
import logging
import sys

from onnxmp.cli import EXIT_ERROR, add_trust_flag, add_verbosity_flags, at_least, report_error
from onnxmp.precision import PRECISIONS
from onnxmp.targets import NAMES as TARGETS

log = logging.getLogger("onnxmp.cli.parity")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "emulate", help="rewrite a float16/bfloat16 model to run on the ORT CPU EP with low-precision numerics",
        description="Every low-precision tensor becomes float32 holding rounded values "
                    "(Cast to the low type and back after each producer).")
    p.add_argument("model", metavar="IN", help="input .onnx model")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="emulated .onnx model to write")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="low-precision type to emulate (default: the one the model holds)")
    p.add_argument("--float-io", action="store_true",
                   help="make low-precision graph inputs/outputs float32 (default: keep their dtypes)")
    add_trust_flag(p)
    add_verbosity_flags(p)
    p.set_defaults(func=run_emulate)

    p = subparsers.add_parser(
        "validate", help="compare a candidate model's outputs with its float32 reference",
        description="Runs both models on the same inputs with onnxruntime and compares every output "
                    "(max abs/rel error, cosine similarity, top-1 agreement). Exit status 1 when "
                    "parity fails.")
    p.add_argument("reference", metavar="REF", help="float32 reference .onnx model")
    p.add_argument("candidate", metavar="CAND", help="converted .onnx model")
    p.add_argument("--inputs", nargs="+", metavar="NPZ",
                   help=".npz files, one sample each (default: one random sample)")
    p.add_argument("--dims", nargs="+", default=[], metavar="NAME=SIZE", type=_dim,
                   help="sizes of symbolic input dims for generated inputs, e.g. N=2")
    p.add_argument("--seed", type=at_least(0), default=0, help="seed for generated inputs (default: 0)")
    p.add_argument("--provider", choices=TARGETS, default="cpu",
                   help="cpu emulates low precision; cuda runs it for real (default: cpu)")
    p.add_argument("--report", metavar="JSON", help="write the full report as JSON")
    p.add_argument("--plot", metavar="PNG", help="write error histograms as a PNG")
    p.add_argument("--cosine-min", type=float, metavar="X", help="minimum cosine similarity")
    p.add_argument("--rel-err-max", type=float, metavar="X", help="maximum error relative to max |ref|")
    p.add_argument("--abs-err-max", type=float, metavar="X", help="maximum absolute error")
    p.add_argument("--top1-min", type=float, metavar="X", help="minimum top-1 agreement (0..1)")
    add_trust_flag(p)
    add_verbosity_flags(p)
    p.set_defaults(func=run_validate)


def _dim(text: str) -> tuple[str, int]:
    name, sep, size = text.partition("=")
    if not sep or not name or not size.isdigit() or int(size) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME=SIZE with SIZE >= 1, got {text!r}")
    return name, int(size)


def run_emulate(args: argparse.Namespace) -> int:
    from onnxmp.load import as_model
    from onnxmp.parity.emulate import emulate, emulated_precisions
    from onnxmp.files import guard_outputs
    from onnxmp.save import save

    guard_outputs({"-o": args.output}, {"input model": args.model})
    model = as_model(args.model)
    for precision in emulated_precisions(model, args.precision, str(args.model)):
        model = emulate(model, precision, keep_io_types=not args.float_io)
    save(model, args.output, source=args.model)
    return 0


def run_validate(args: argparse.Namespace) -> int:
    from onnxmp.files import all_or_nothing, guard_outputs, write_text_atomic
    from onnxmp.plots import plot_errors, require_matplotlib
    from onnxmp.report import head
    from onnxmp.parity.validate import validate

    guard_outputs({"--report": args.report, "--plot": args.plot},
                  {"reference model": args.reference, "candidate model": args.candidate, "--inputs": args.inputs})
    if args.plot:
        require_matplotlib()  # before the comparison, not after it
    overrides = {key: getattr(args, key) for key in ("cosine_min", "rel_err_max", "abs_err_max", "top1_min")
                 if getattr(args, key) is not None}
    report = validate(args.reference, args.candidate, args.inputs, provider=args.provider,
                      thresholds=overrides, dims=dict(args.dims), seed=args.seed)
    sys.stdout.write(report.summary() + "\n")
    with all_or_nothing():
        if args.report:
            write_text_atomic(args.report, report.to_json() + "\n")
        if args.plot:
            plot_errors(report, args.plot)
    if not report.passed:
        (first,), rest = head(report.failures(), 1)
        report_error("onnxmp validate", f"parity failed: {first}" + (f" ({rest})" if rest else ""))
        return EXIT_ERROR
    return 0
