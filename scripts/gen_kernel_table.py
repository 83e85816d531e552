#!/usr/bin/env python
"""Generate ``onnxmp/data/ort_kernels.json``: the float types onnxruntime's kernels accept, per version.

Two kinds of source, both kept in ``scripts/sources/`` so the table rebuilds from the repository alone:

- CPU: each onnxruntime release's own kernel registry, as plain onnxruntime builds expose it
  (``onnxruntime.capi._pybind_state.get_all_opkernel_def()``), dumped once per release to
  ``onnxruntime-<version>-cpu-kernels.json.gz`` by ``--dump`` run under that onnxruntime.
- CUDA: ORT's ``docs/OperatorKernels.md`` at one commit (its README names it).  The CUDA EP's
  registry cannot be read without a GPU: onnxruntime-gpu's provider library needs the CUDA
  driver to load, and its ``get_all_opkernel_def`` crashes without it.  Its facts stand for
  every version of the table, which the table's ``versions`` say.

We keep only what mixed precision needs: for every kernel (op, opset range) the float types each
type parameter accepts, and the versions that register it.  Parameters with no float type are
kept with an empty list, so that a question about e.g. an int64-only ``T2`` answers "no" instead
of falling back to "does any parameter take float16".

Usage::

    python scripts/gen_kernel_table.py --dump        # under a plain onnxruntime: add its release
    python scripts/gen_kernel_table.py [OperatorKernels.md[.gz]] [-o out.json]   # rebuild the table

The dump needs nothing but onnxruntime (it runs in a scratch venv of that release).
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCES = REPO_ROOT / "scripts" / "sources"
DEFAULT_SOURCE = SOURCES / "onnxruntime-OperatorKernels.md.gz"
DEFAULT_OUTPUT = REPO_ROOT / "onnxmp" / "data" / "ort_kernels.json"
DUMP_NAME = "onnxruntime-{version}-cpu-kernels.json.gz"
_DUMP = re.compile(r"onnxruntime-(\d+\.\d+\.\d+)-cpu-kernels\.json\.gz")

PROVIDERS = ("CPUExecutionProvider", "CUDAExecutionProvider")
DOC_PROVIDERS = ("CUDAExecutionProvider",)  # the registry dumps give CPU's
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


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


# -- the registry of an installed onnxruntime ------------------------------------------------------

def registry_rows(pybind) -> list[list]:
    """Every CPU kernel definition of the running onnxruntime: ``[domain, op, since, until|None,
    {param: [types]}]``, one per registered (typed) kernel, all types kept (the ties need them)."""
    rows = []
    for kdef in pybind.get_all_opkernel_def():
        if kdef.provider != "CPUExecutionProvider":
            continue
        since, until = kdef.version_range
        rows.append([kdef.domain or "ai.onnx", kdef.op_name, int(since), None if until >= 2**31 - 1 else int(until),
                     {p: sorted(ts) for p, ts in sorted(kdef.type_constraints.items())}])
    return sorted(rows, key=json.dumps)


def kernels_of(rows: list[list]) -> dict:
    """Registry rows -> ``{domain: {op: [[since, until, {param: [float types]}], ...]}}``: a typed
    kernel is registered once per type (Abs<float>, Abs<double>), so one range takes their union."""
    merged: dict[tuple, dict[str, set[str]]] = {}
    for domain, op, since, until, params in rows:
        found = merged.setdefault((domain, op, since, until), {})
        for param, types in params.items():
            found.setdefault(param, set()).update(t[len("tensor("):-1] for t in types if t.startswith("tensor("))
    out: dict = {}
    for (domain, op, since, until), params in merged.items():
        out.setdefault(domain, {}).setdefault(op, []).append(
            [since, until, {p: [t for t in FLOAT_TYPES if t in ts] for p, ts in sorted(params.items())}])
    for ops in out.values():
        for ranges in ops.values():
            ranges.sort(key=lambda r: (r[0], -1 if r[1] is None else r[1]))
    return out


def read_dump(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()).decode("utf-8"))


def dumps() -> dict[str, Path]:
    """onnxruntime version -> its registry dump in ``scripts/sources``."""
    found = {m.group(1): path for path in SOURCES.iterdir() if (m := _DUMP.fullmatch(path.name))}
    return dict(sorted(found.items(), key=lambda item: version_key(item[0])))


def dump_installed() -> Path:
    """Write the running onnxruntime's CPU registry to ``scripts/sources`` (atomically)."""
    import os
    import tempfile

    import onnxruntime
    from onnxruntime.capi import _pybind_state

    if not hasattr(_pybind_state, "get_all_opkernel_def"):
        raise SystemExit(f"onnxruntime {onnxruntime.__version__} does not expose get_all_opkernel_def "
                         "(training builds do not): run --dump under the plain onnxruntime of that release")
    version = onnxruntime.__version__
    text = json.dumps({"onnxruntime": version, "read_with": "onnxruntime.capi._pybind_state.get_all_opkernel_def()",
                       "rows": registry_rows(_pybind_state)}, separators=(",", ":")) + "\n"
    out = SOURCES / DUMP_NAME.format(version=version)
    fd, tmp = tempfile.mkstemp(dir=SOURCES, prefix=".dump-")
    os.chmod(tmp, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(gzip.compress(text.encode("utf-8"), mtime=0))
    os.replace(tmp, out)
    return out


# -- the table --------------------------------------------------------------------------------------

def _add(providers: dict, provider: str, kernels: dict, version: str) -> None:
    for domain, ops in kernels.items():
        for op, ranges in ops.items():
            rows = providers.setdefault(provider, {}).setdefault(domain, {}).setdefault(op, [])
            for since, until, params in ranges:
                same = [r for r in rows if r[:3] == [since, until, params]]
                if same:
                    same[0][3].append(version)
                else:
                    rows.append([since, until, params, [version]])


def build_table(source: Path, versions: dict[str, Path] | None = None) -> dict:
    """The table: CUDA from ``source`` (OperatorKernels.md) for every version, CPU from each
    version's registry dump.  Each kernel row is ``[since, until|None, {param: [float types]},
    [versions]]``."""
    versions = dumps() if versions is None else versions
    if not versions:
        raise SystemExit("no onnxruntime registry dump in scripts/sources: run --dump under a plain onnxruntime")
    raw = source.read_bytes()
    text = (gzip.decompress(raw) if source.name.endswith(".gz") else raw).decode("utf-8")
    documented = parse_kernels(text)
    commit = read_commit(source)
    doc = f"{_markdown_name(source)}" + (f" at onnxruntime@{commit}" if commit else "")
    providers: dict = {}
    sources: dict[str, dict[str, str]] = {}
    for version, path in versions.items():
        dumped = read_dump(path)
        if dumped["onnxruntime"] != version:
            raise SystemExit(f"{path.name} holds onnxruntime {dumped['onnxruntime']}, not {version}")
        _add(providers, "CPUExecutionProvider", kernels_of(dumped["rows"]), version)
        for provider in DOC_PROVIDERS:
            _add(providers, provider, documented[provider], version)
        sources[version] = {"CPUExecutionProvider": f"{dumped['read_with']} of onnxruntime {version} ({path.name})",
                            **{p: f"{doc} (not read from {version}: one document stands for every version)"
                               for p in DOC_PROVIDERS}}
    for domains in providers.values():
        for ops in domains.values():
            for ranges in ops.values():
                ranges.sort(key=lambda r: (r[0], -1 if r[1] is None else r[1], version_key(r[3][0])))
    return {
        "source": {"file": _markdown_name(source), "onnxruntime_commit": commit},
        "versions": sources,
        "float_types": list(FLOAT_TYPES),
        "providers": providers,
    }


def dump_table(table: dict) -> str:
    return json.dumps(table, sort_keys=True, separators=(",", ":")) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", type=Path, default=DEFAULT_SOURCE, help="ORT OperatorKernels.md")
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT, help="JSON file to write")
    parser.add_argument("--dump", action="store_true",
                        help="write the installed (plain) onnxruntime's CPU registry to scripts/sources and stop")
    args = parser.parse_args(argv)
    if args.dump:
        sys.stderr.write(f"wrote {dump_installed()}\n")
        return 0
    if not args.source.is_file():
        parser.error(f"{args.source} not found")
    sys.path.insert(0, str(REPO_ROOT))
    from onnxmp.files import guard_arguments, write_text_atomic

    args.output.parent.mkdir(parents=True, exist_ok=True)
    guard_arguments(parser, {"-o": args.output}, {"source": args.source})
    write_text_atomic(args.output, dump_table(build_table(args.source)))
    sys.stderr.write(f"wrote {args.output} ({args.output.stat().st_size} bytes)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
