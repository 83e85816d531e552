"""``onnxmp`` command line.

Conventions follow Polygraphy and onnxconverter-common: subcommands, ``-o``
for the output path, ``-v``/``-q`` to raise or lower log verbosity (stdlib
``logging``), exit status 0 on success and 1 with a one-line error plus a hint
on bad input.  Each subcommand family lives in its own module with a
``register(subparsers)`` function, so features stay beside their CLI.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from onnxmp.errors import OnnxMPError

# Modules that contribute subcommands; each has ``register(subparsers)``.
_COMMAND_MODULES = ("onnxmp.cli.convert", "onnxmp.cli.parity", "onnxmp.cli.train")

log = logging.getLogger("onnxmp")


def add_verbosity_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (repeatable)")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="less log output (repeatable)")


def _configure_logging(verbose: int, quiet: int) -> None:
    level = logging.INFO - 10 * verbose + 10 * quiet
    logging.basicConfig(level=max(logging.DEBUG, min(logging.CRITICAL, level)),
                        format="[%(levelname)s] %(name)s: %(message)s", stream=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnxmp", description="Automatic mixed precision for ONNX models.")
    from onnxmp import __version__

    parser.add_argument("--version", action="version", version=f"onnxmp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(getattr(args, "verbose", 0), getattr(args, "quiet", 0))
    try:
        return int(args.func(args) or 0)
    except OnnxMPError as exc:
        sys.stderr.write(f"onnxmp {args.command}: error: {exc.message.splitlines()[0]}\n")
        if exc.hint:
            sys.stderr.write(f"  hint: {exc.hint}\n")
        return 1
    except BrokenPipeError:  # `onnxmp lists | head` is normal use, not an error
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        sys.stderr.write("onnxmp: interrupted\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
