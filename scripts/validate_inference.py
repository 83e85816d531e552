"""Convert every test model to mixed precision and check its parity with the float32 original.

    python scripts/validate_inference.py [PATHS ...] [--models-dir models] [--no-default-models]
                                         [--out reports/inference] [--json FILE]
                                         [--provider cpu|cuda] [--precision float16|bfloat16]
                                         [--calibrate]

Models: every ``*.onnx`` in ``--models-dir`` (unless ``--no-default-models``)
plus any path given.  Inputs come from ``<name>.inputs.npz`` beside the
model, else one random sample is generated from its input metadata.

Each model goes through ``onnxmp.convert`` (target cuda, keep_io_types) and
``onnxmp.validate`` against the float32 model.  With ``--provider cpu`` the
low-precision candidate is emulated on the CPU; ``cuda`` runs it for real.
``--calibrate`` passes the same inputs to the conversion as calibration data
(so parity is then measured on the data the conversion was tuned on).

Prints a table (model, nodes, low-precision share of Conv/MatMul/Gemm, Casts
inserted, worst max abs error and cosine over the outputs, pass), writes
``<out>/report.md`` (the table, each model's conversion and parity summaries
and its error plot ``<out>/<model>.errors.png``) and, with ``--json``, the
table as a list of objects.  A model that fails to load, convert or run is a
failed row carrying the error message, not a crash.

Exit status: 0 when every model passes, 1 when any fails, 2 on bad usage.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tqdm import tqdm  # noqa: E402
from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: E402

from onnxmp.naming import json_safe
import onnxmp  # noqa: E402
from onnxmp.errors import first_line  # noqa: E402
from onnxmp.inputs import generate_inputs, load_npz  # noqa: E402
from onnxmp.files import guard_arguments, write_bytes_atomic  # noqa: E402
from onnxmp.plots import plot_errors  # noqa: E402
from onnxmp.report import head  # noqa: E402
from onnxmp.parity.validate import validate  # noqa: E402
from onnxmp.targets import CUDA, NAMES as TARGETS  # noqa: E402

log = logging.getLogger("validate_inference")

SHORT = {"float16": "fp16", "bfloat16": "bf16"}


@dataclass
class Row:
    model: str
    path: str
    inputs: str = "-"  # "npz" or "generated"
    nodes: int | None = None
    share: float | None = None  # low-precision share of Conv/MatMul/Gemm nodes
    casts: int | None = None
    max_abs_err: float | None = None  # worst over the float outputs
    cosine: float | None = None  # worst over the float outputs
    passed: bool = False
    error: str | None = None  # load/convert/run failure; parity failures go to `failures`
    failures: list[str] = field(default_factory=list)
    convert_s: float | None = None
    validate_s: float | None = None
    plot: str | None = None  # file name inside --out
    # For report.md only, not the JSON table.
    conversion_summary: str | None = field(default=None, repr=False)
    parity_summary: str | None = field(default=None, repr=False)

    def note(self) -> str:
        if self.error:
            return self.error
        if self.failures:
            (first,), rest = head(self.failures, 1)
            return first + (f" ({rest})" if rest else "")
        return ""

    def table_dict(self) -> dict:
        data = asdict(self)
        del data["conversion_summary"], data["parity_summary"]
        return data


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", metavar="PATH", help="extra .onnx models to check")
    parser.add_argument("--models-dir", type=Path, default=ROOT / "models",
                        help="folder whose *.onnx are checked (default: the repository's models/)")
    parser.add_argument("--no-default-models", action="store_true",
                        help="check only the PATHs given, not --models-dir")
    parser.add_argument("--out", type=Path, default=Path("reports/inference"),
                        help="folder for report.md and the error plots (default: reports/inference)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the table as JSON")
    parser.add_argument("--provider", choices=TARGETS, default="cpu",
                        help="cpu emulates low precision; cuda runs it for real (default: cpu)")
    parser.add_argument("--precision", choices=tuple(SHORT), default="float16")
    parser.add_argument("--calibrate", action="store_true",
                        help="convert with the model's inputs as calibration data")
    parser.add_argument("-v", "--verbose", action="store_true", help="log onnxmp's INFO messages")
    return parser


def find_models(args: argparse.Namespace) -> list[Path]:
    found: list[Path] = []
    if not args.no_default_models:
        if not args.models_dir.is_dir():
            raise SystemExit(f"error: --models-dir {args.models_dir} is not a folder")
        found.extend(sorted(args.models_dir.glob("*.onnx")))
    found.extend(Path(p) for p in args.paths)
    unique: dict[Path, Path] = {}
    for path in found:
        unique.setdefault(path.resolve(), path)  # a PATH inside --models-dir is checked once
    return list(unique.values())


def model_names(paths: list[Path]) -> list[str]:
    """File stems, with a suffix where two models share one (their plots would collide)."""
    names: list[str] = []
    for path in paths:
        stem = path.name.removesuffix(".onnx")
        name, k = stem, 2
        while name in names:
            name, k = f"{stem}-{k}", k + 1
        names.append(name)
    return names


def samples_for(path: Path, model) -> tuple[list[dict], str]:
    npz = path.with_name(path.name.removesuffix(".onnx") + ".inputs.npz")
    if npz.is_file():
        return load_npz(npz), "npz"
    return [generate_inputs(model)], "generated"


def check_model(path: Path, name: str, args: argparse.Namespace) -> Row:
    row = Row(model=name, path=str(path))
    plot = args.out / f"{name}.errors.png"
    plot.unlink(missing_ok=True)  # a plot left from an earlier run must not pass for this one
    stage = "load"
    try:
        reference = onnxmp.load(path, lazy_external=True)  # weights stay in their files: models over 2 GB
        stage = "inputs"
        samples, row.inputs = samples_for(path, reference)
        stage = "convert"
        start = time.perf_counter()
        result = onnxmp.convert(reference, target="cuda", precision=args.precision, keep_io_types=True,
                                calibration=samples if args.calibrate else None)
        row.convert_s = time.perf_counter() - start
        report = result.report
        row.nodes, row.share, row.casts = report.node_count, report.tensor_core_share(), report.casts_inserted
        row.conversion_summary = report.summary()
        stage = "validate"
        start = time.perf_counter()
        parity = validate(reference, result.model, samples, provider=args.provider)
        row.validate_s = time.perf_counter() - start
        row.parity_summary = parity.summary()
        errors = [o.max_abs_err for o in parity.outputs if o.max_abs_err is not None]
        cosines = [o.cosine for o in parity.outputs if o.cosine is not None]
        row.max_abs_err = max(errors) if errors else None
        row.cosine = min(cosines) if cosines else None
        row.failures = parity.failures()
        stage = "plot"
        plot_errors(parity, plot)
        row.plot = plot.name
        row.passed = parity.passed
    except onnxmp.OnnxMPError as exc:
        row.error = f"{stage}: {exc.one_line()}"
    except Exception as exc:  # a bug on one model should not hide the results of the others
        log.error("%s: unexpected error during %s\n%s", name, stage, traceback.format_exc())
        row.error = f"{stage}: internal error: {type(exc).__name__}: {first_line(exc)}"
    return row


# --- output --------------------------------------------------------------------------


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def table(rows: list[Row], precision: str) -> tuple[list[str], list[list[str]]]:
    header = ["model", "nodes", f"{SHORT[precision]} share", "Casts", "max abs err", "cosine", "pass",
              "convert", "validate", "note"]
    cells = [[r.model, _num(r.nodes, "d"), "-" if r.share is None else f"{r.share:.0%}", _num(r.casts, "d"),
              _num(r.max_abs_err, ".3e"), _num(r.cosine, ".8f"), "yes" if r.passed else "FAIL",
              _duration(r.convert_s), _duration(r.validate_s),
              r.note()] for r in rows]
    return header, cells


def text_table(header: list[str], cells: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *cells]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(header: list[str], cells: list[list[str]]) -> str:
    def line(values):
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, cells)])


def markdown_report(rows: list[Row], args: argparse.Namespace, header, cells, seconds: float) -> str:
    failed = sum(not r.passed for r in rows)
    how = "emulated on the CPU" if args.provider == "cpu" else "run on CUDA"
    parts = [
        "# Mixed-precision inference parity",
        "",
        f"onnxmp {onnxmp.__version__}: target cuda, {args.precision} ({how}), "
        f"calibration {'on' if args.calibrate else 'off'}. "
        f"{len(rows) - failed} of {len(rows)} model(s) passed in {seconds:.1f} s.",
        "",
        markdown_table(header, cells),
    ]
    for row in rows:
        parts += ["", f"## {row.model}", "", f"`{row.path}`, inputs: {row.inputs}"]
        if row.error:
            parts += ["", f"**Error:** {row.error}"]
        for title, text in (("Conversion", row.conversion_summary), ("Parity", row.parity_summary)):
            if text:
                parts += ["", f"### {title}", "", "```", text, "```"]
        if row.plot:
            parts += ["", f"![{row.model} errors]({row.plot})"]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="[%(levelname)s] %(name)s: %(message)s", stream=sys.stderr)
    paths = find_models(args)
    if not paths:
        print("error: no models to check (give PATHs or a --models-dir with *.onnx)", file=sys.stderr)
        return 2
    if args.provider == "cuda":
        import onnxruntime as ort

        if CUDA.provider not in ort.get_available_providers():
            print("error: this onnxruntime build has no CUDAExecutionProvider "
                  "(install onnxruntime-gpu, or use --provider cpu)", file=sys.stderr)
            return 2
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file of that name, a read-only parent
        parser.error(f"cannot create --out {args.out}: {exc.strerror or exc}")
    guard_arguments(parser, {"--json": args.json, "report": args.out / "report.md"}, {"model": paths})

    start = time.perf_counter()
    rows = []
    with logging_redirect_tqdm():
        progress = tqdm(list(zip(paths, model_names(paths))), desc="models", unit="model", file=sys.stderr)
        for path, name in progress:
            progress.set_postfix_str(name)
            rows.append(check_model(path, name, args))
    seconds = time.perf_counter() - start

    header, cells = table(rows, args.precision)
    print(text_table(header, cells))
    failed = [r.model for r in rows if not r.passed]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} passed in {seconds:.1f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    try:
        report = args.out / "report.md"
        write_bytes_atomic(report, markdown_report(rows, args, header, cells, seconds).encode())
        print(f"report: {report}")
        if args.json:
            table_json = json.dumps(json_safe([r.table_dict() for r in rows]), indent=2)
            write_bytes_atomic(args.json, (table_json + "\n").encode())
    except onnxmp.OnnxMPError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
