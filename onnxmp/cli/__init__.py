"""``onnxmp`` command line.

Conventions follow Polygraphy and onnxconverter-common: subcommands, ``-o``
for the output path, ``-v``/``-q`` to raise or lower log verbosity (stdlib
``logging``).  Each subcommand family lives in its own module with a
``register(subparsers)`` function, so features stay beside their CLI.

One error contract for every command: a failure prints
``onnxmp <cmd>: error: <one line>`` and at most one ``  hint: ...`` line,
never a traceback (``-v`` adds it), and exits with :data:`EXIT_USAGE` for a
wrong command line, :data:`EXIT_ERROR` for anything else, and
:data:`EXIT_TOLERANCE` when calibration missed its tolerance but still wrote
the best model it found.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import re
import sys
import traceback

from onnxmp.errors import OnnxMPError, UsageError

# Modules that contribute subcommands; each has ``register(subparsers)``.
_COMMAND_MODULES = ("onnxmp.cli.convert", "onnxmp.cli.parity", "onnxmp.cli.train")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_TOLERANCE = 3  # calibration ran, missed the tolerance, and wrote the best model it found

log = logging.getLogger("onnxmp")

_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<value>[^']*)' \(choose from (?P<choices>.*)\)$")


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` instead of printing its usage block and exiting.

    Used for the subcommand parsers too, so ``main`` reports every usage
    error in the one format.
    """

    def error(self, message: str):
        hint = f"see `{self.prog} --help`"
        choice = _INVALID_CHOICE.search(message)
        if choice:
            # Python < 3.12.8 quotes the choices, newer ones do not.
            choices = [c.strip().strip("'") for c in choice["choices"].split(",")]
            close = difflib.get_close_matches(choice["value"], choices, n=1, cutoff=0.5)
            hint = (f"did you mean {close[0]}? " if close else "") + f"choose from: {', '.join(choices)}"
            if message.startswith("argument COMMAND:"):
                message = f"unknown command {choice['value']!r}"
                hint = f"did you mean {close[0]}?" if close else f"commands: {', '.join(choices)}"
            else:
                message = message[:choice.start()] + f"invalid choice {choice['value']!r}"
        raise UsageError(message, hint=hint, prog=self.prog)


def at_least(minimum: int):
    """argparse ``type=`` for an integer flag with a lower bound: a bad value is a usage error (exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def positive_float(text: str) -> float:
    """argparse ``type=`` for a flag that must be a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_verbosity_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output (repeatable); shows the traceback of an error")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="less log output (repeatable)")


def add_trust_flag(parser: argparse.ArgumentParser) -> None:
    """``--trust-external-data``, on every command that reads a model (docs/cli.md, "Untrusted models")."""
    parser.add_argument("--trust-external-data", action="store_true",
                        help="for a model you trust: let its external data files lie outside its folder or at "
                             "absolute paths (sizes and file types are still checked)")


def _configure_logging(verbose: int, quiet: int) -> None:
    level = logging.INFO - 10 * verbose + 10 * quiet
    root = logging.getLogger()
    ours = not root.handlers  # basicConfig adds a handler only to an unconfigured process
    logging.basicConfig(level=max(logging.DEBUG, min(logging.CRITICAL, level)),
                        format="[%(levelname)s] %(name)s: %(message)s", stream=sys.stderr)
    if ours:
        # -v is about onnxmp: other libraries (matplotlib's font manager: 2,000 lines) keep to warnings.
        root.handlers[0].addFilter(_onnxmp_or_warning)


def _onnxmp_or_warning(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or record.name == "onnxmp" or record.name.startswith("onnxmp.")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="onnxmp", description="Automatic mixed precision for ONNX models.")
    from onnxmp import __version__

    parser.add_argument("--version", action="version", version=f"onnxmp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    sub.required = True
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a feature module not installed / not built yet
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def report_error(prog: str, message: str, hint: str | None = None) -> None:
    """The contract's format: ``<prog>: error: <first line>`` and at most one ``  hint:`` line.

    For a command that prints its result and still fails (parity failed,
    tolerance missed); everything else raises and ``main`` calls this.
    """
    lines = str(message).strip().splitlines() or ["error"]
    sys.stderr.write(f"{prog}: error: {lines[0]}\n")
    if hint:
        sys.stderr.write(f"  hint: {hint.splitlines()[0]}\n")


def _os_error_line(exc: OSError) -> str:
    text = exc.strerror or str(exc) or type(exc).__name__
    return f"{text}: {exc.filename}" if exc.filename else text


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # reported by the top-level parser otherwise, away from the command they were given to
            raise UsageError(f"unrecognized arguments: {' '.join(unknown)}",
                             hint=f"see `onnxmp {args.command} --help`", prog=f"onnxmp {args.command}")
    except UsageError as exc:
        report_error(exc.prog, exc.message, exc.hint)
        return EXIT_USAGE
    _configure_logging(getattr(args, "verbose", 0), getattr(args, "quiet", 0))
    prog = f"onnxmp {args.command}"
    verbose = getattr(args, "verbose", 0) > 0
    try:
        from onnxmp.tensordata import trust_external_data

        with trust_external_data(getattr(args, "trust_external_data", False)):
            return int(args.func(args) or 0)
    except BrokenPipeError:  # `onnxmp lists | head` is normal use, not an error
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    except Exception as exc:  # the boundary: a user sees one line, -v the traceback
        return report_exception(prog, exc, verbose)


# Top-level module -> the onnxmp extra that installs it.
_EXTRAS = {
    "onnxruntime": 'install a runtime: pip install "onnxmp[cpu]" (or "onnxmp[gpu]" for CUDA; "onnxmp[train-cpu]" '
                   'also brings one, with the training build on Python <= 3.11)',
    "matplotlib": 'pip install "onnxmp[dev]" (or matplotlib)',
    "mpi4py": 'pip install "onnxmp[distributed]"',
    "onnxconverter_common": 'pip install "onnxmp[dev]" (or onnxconverter-common)',
    "sklearn": 'pip install "onnxmp[dev]" (or scikit-learn)',
}


def missing_module_hint(name: str) -> str:
    top = name.split(".")[0]
    return _EXTRAS.get(top, f"pip install {top}")


def report_exception(prog: str, exc: BaseException, verbose: bool) -> int:
    """Report ``exc`` in the contract's format; returns the exit status it calls for.

    ``main`` calls it at the boundary; a data-parallel rank calls it before it
    aborts the job (the other ranks would wait for it forever otherwise).
    """
    if isinstance(exc, KeyboardInterrupt):
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    if verbose:
        traceback.print_exception(exc)
    if isinstance(exc, OnnxMPError):
        report_error(prog, exc.message, exc.hint)
        return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_ERROR
    if isinstance(exc, OSError):
        report_error(prog, _os_error_line(exc), "check the path and its permissions")
    elif isinstance(exc, ModuleNotFoundError) and exc.name:
        # A missing dependency is the environment's, not a bug: name what to install.
        report_error(prog, f"{exc.name.split('.')[0]} is not installed", missing_module_hint(exc.name))
    else:
        report_error(prog, f"{type(exc).__name__}: {exc}",
                     None if verbose else "run again with -v for the traceback, and please report it")
    return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
