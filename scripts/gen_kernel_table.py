#!/usr/bin/env python
"""Generate ``onnxmp/data/ort_kernels.json`` from ONNX Runtime's OperatorKernels.md.

ORT's ``docs/OperatorKernels.md`` is generated from the kernels registered in
each execution provider.  We keep only what mixed precision needs: the CPU and
CUDA providers, and for every kernel (op, opset range) the float types each
type parameter accepts.  Parameters with no float type are kept with an empty
list, so that a question about e.g. an int64-only ``T2`` answers "no" instead
of falling back to "does any parameter take float16".

Usage::

    python scripts/gen_kernel_table.py [OperatorKernels.md[.gz]] [-o out.json]

The default source is the copy in ``scripts/sources/`` (its README names the ORT commit).
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from onnxmp.files import guard_arguments, write_text_atomic  # noqa: E402

DEFAULT_SOURCE = REPO_ROOT / "scripts" / "sources" / "onnxruntime-OperatorKernels.md.gz"
DEFAULT_OUTPUT = REPO_ROOT / "onnxmp" / "data" / "ort_kernels.json"

PROVIDERS = ("CPUExecutionProvider", "CUDAExecutionProvider")
FLOAT_TYPES = ("float", "double", "float16", "bfloat16")

_PROVIDER_HEADING = re.compile(r"^## Operators implemented by (\w+)")
_DOMAIN_ROW = re.compile(r"^\|\*\*Operator Domain:\*\* \*([^*]+)\*")
_PARAM = re.compile(r"^\*\*(\w+)\*\* = (.*)$")
_COMMIT = re.compile(r"\b[0-9a-f]{40}\b")


def parse_opset(cell: str) -> tuple[int, int | None]:
    """``14+`` -> (14, None), ``13`` -> (13, 13), ``[7, 12]`` -> (7, 12)."""
    cell = cell.strip()
    if cell.endswith("+"):
        return int(cell[:-1]), None
    m = re.fullmatch(r"\[(\d+),\s*(\d+)\]", cell)
    if m:
        return int(m.group(1)), int(m.group(2))
    return int(cell), int(cell)


def _top_level_items(text: str) -> list[str]:
    """Split on commas outside parentheses: ``map(int64,tensor(float))`` is one item."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    items.append(text[start:].strip())
    return [item for item in items if item]


def parse_types(cell: str) -> dict[str, list[str]]:
    """Float tensor types per type parameter.

    Only plain ``tensor(x)`` counts: ``seq(tensor(float16))`` and the like are
    containers an AMP rewrite never retypes.
    """
    params: dict[str, list[str]] = {}
    for part in cell.split("<br/>"):
        m = _PARAM.match(part.strip())
        if not m:
            raise ValueError(f"unrecognised type constraint {part!r}")
        kinds = {item[len("tensor("):-1] for item in _top_level_items(m.group(2)) if item.startswith("tensor(")}
        params[m.group(1)] = [t for t in FLOAT_TYPES if t in kinds]
    return params


def parse_kernels(text: str) -> dict:
    """``{provider: {domain: {op: [[since, until|None, {param: [types]}], ...]}}}``."""
    providers: dict = {}
    provider = domain = op = None
    for lineno, line in enumerate(text.splitlines(), 1):
        heading = _PROVIDER_HEADING.match(line)
        if heading:
            provider, domain, op = heading.group(1), None, None
            continue
        if provider not in PROVIDERS or not line.startswith("|"):
            continue
        dom = _DOMAIN_ROW.match(line)
        if dom:
            domain, op = dom.group(1), None
            continue
        cells = line.split("|")[1:-1]
        # Header, separator and the blank "| |" spacer rows between domains.
        if len(cells) != 4 or not cells[2].strip() or cells[2].strip() == "OpSet Version" or set(cells[2]) <= {"-"}:
            continue
        if domain is None:
            raise ValueError(f"line {lineno}: kernel row before any domain row")
        name = cells[0].strip() or op
        if name is None:
            raise ValueError(f"line {lineno}: continuation row without an operator")
        op = name
        since, until = parse_opset(cells[2])
        ranges = providers.setdefault(provider, {}).setdefault(domain, {}).setdefault(op, [])
        ranges.append([since, until, parse_types(cells[3])])
    for domains in providers.values():
        for ops in domains.values():
            for ranges in ops.values():
                ranges.sort(key=lambda r: r[0])
    missing = [p for p in PROVIDERS if p not in providers]
    if missing:
        raise ValueError(f"no kernel table for {', '.join(missing)}")
    return providers


def read_commit(source: Path) -> str | None:
    """The ORT commit the README next to ``source`` records for it, if any."""
    readme = source.parent / "README.md"
    if not readme.is_file():
        return None
    text = readme.read_text(encoding="utf-8")
    position = text.find(source.name)
    m = _COMMIT.search(text, position) if position >= 0 else None
    return m.group(0) if m else None


def _markdown_name(source: Path) -> str:
    return source.name[:-3] if source.name.endswith(".gz") else source.name


def build_table(source: Path) -> dict:
    raw = source.read_bytes()
    text = (gzip.decompress(raw) if source.name.endswith(".gz") else raw).decode("utf-8")
    return {
        "source": {"file": _markdown_name(source), "onnxruntime_commit": read_commit(source)},
        "float_types": list(FLOAT_TYPES),
        "providers": parse_kernels(text),
    }


def dump_table(table: dict) -> str:
    return json.dumps(table, sort_keys=True, separators=(",", ":")) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", type=Path, default=DEFAULT_SOURCE, help="ORT OperatorKernels.md")
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT, help="JSON file to write")
    args = parser.parse_args(argv)
    if not args.source.is_file():
        parser.error(f"{args.source} not found")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    guard_arguments(parser, {"-o": args.output}, {"source": args.source})
    write_text_atomic(args.output, dump_table(build_table(args.source)))
    sys.stderr.write(f"wrote {args.output} ({args.output.stat().st_size} bytes)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
