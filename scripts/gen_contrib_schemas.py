#!/usr/bin/env python
"""Generate ``onnxmp/data/ort_contrib_schemas.json``: the schemas of the ops onnxruntime registers
outside onnx's own domains (com.microsoft, com.microsoft.nchwc, ...), per onnxruntime version.

onnx's shape inference knows none of these ops, so it leaves their outputs untyped, and onnx's
checker cannot say whether a node binds a type parameter to two types (onnxruntime refuses
such a model at session creation: "Type parameter (T) of Optype (Attention) bound to different
types").  Plain onnxruntime builds expose every registered schema through
``onnxruntime.capi._pybind_state.get_all_operator_schema()``; the training build onnxmp runs on
(1.19.2) does not, so the facts are committed.

Run it once per onnxruntime (each run merges its version into the table)::

    /work/scratch/ort119/bin/python scripts/gen_contrib_schemas.py   # plain 1.19.2
    /work/scratch/py312/bin/python scripts/gen_contrib_schemas.py    # the current release

It needs nothing of onnxmp (it runs in a foreign venv), and writes atomically by replacing the file.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent.parent / "onnxmp" / "data" / "ort_contrib_schemas.json"
# onnx's own domains: onnx's schemas type their ops (not the few onnxruntime adds there).
ONNX_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training")
_OPTION = {0: "single", 1: "optional", 2: "variadic"}
FLOAT_TYPES = ("tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)")


def _formal(p) -> list:
    return [p.name, p.typeStr, _OPTION[int(p.option.value)], bool(p.isHomogeneous)]


def _entry(schema) -> dict:
    return {
        "domain": schema.domain,
        "op": schema.name,
        "since": int(schema.since_version),
        "inputs": [_formal(p) for p in schema.inputs],
        "outputs": [_formal(p) for p in schema.outputs],
        "constraints": {tc.type_param_str: sorted(tc.allowed_type_strs) for tc in schema.type_constraints},
    }


def _key(entry: dict) -> str:
    return json.dumps(entry, sort_keys=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    import onnx
    import onnxruntime
    from onnxruntime.capi import _pybind_state as C

    version = onnxruntime.__version__
    table = json.loads(args.output.read_text()) if args.output.exists() else {
        "source": "onnxruntime.capi._pybind_state.get_all_operator_schema(), scripts/gen_contrib_schemas.py",
        "versions": [], "schemas": []}
    merged: dict[str, dict] = {}
    for entry in table["schemas"]:
        versions = [v for v in entry.pop("ort") if v != version]
        if versions:
            merged[_key(entry)] = {**entry, "ort": versions}
    for schema in C.get_all_operator_schema():
        if schema.deprecated or (schema.domain in ONNX_DOMAINS and onnx.defs.has(schema.name, schema.domain)):
            continue  # onnx's own schema types it (onnxruntime adds a few ops to the default domain)
        entry = _entry(schema)
        merged.setdefault(_key(entry), {**entry, "ort": []})["ort"].append(version)
    # The kernels this (CPU) build registers in those domains, with each type parameter's float types:
    # which fused ops have a float16 CPU kernel changes between versions (SkipLayerNormalization: 1.19.2
    # float only, 1.32 float16 and bfloat16 too).  CUDA's come from OperatorKernels.md (ort_kernels.json).
    kernels: dict[str, dict] = {}
    for entry in table.get("kernels", []):
        versions = [v for v in entry.pop("ort") if v != version]
        if versions:
            kernels[_key(entry)] = {**entry, "ort": versions}
    registered: dict[tuple, dict[str, set[str]]] = {}
    for kdef in C.get_all_opkernel_def():
        if kdef.domain in ONNX_DOMAINS:
            continue
        since, until = kdef.version_range
        key = (kdef.provider, kdef.domain, kdef.op_name, int(since), None if until >= 2**31 - 1 else int(until))
        params = registered.setdefault(key, {})
        for param, types in kdef.type_constraints.items():
            params.setdefault(param, set()).update(t[len("tensor("):-1] for t in types if t in FLOAT_TYPES)
    for (provider, domain, op, since, until), params in registered.items():
        entry = {"provider": provider, "domain": domain, "op": op, "since": since, "until": until,
                 "params": {p: sorted(ts) for p, ts in sorted(params.items())}}
        kernels.setdefault(_key(entry), {**entry, "ort": []})["ort"].append(version)
    krows = sorted(kernels.values(), key=lambda e: (e["provider"], e["domain"], e["op"], e["since"], e["ort"]))
    for row in krows:
        row["ort"].sort(key=lambda v: tuple(map(int, v.split("."))))
    table["versions"] = sorted(set(table["versions"]) | {version}, key=lambda v: tuple(map(int, v.split("."))))
    rows = sorted(merged.values(), key=lambda e: (e["domain"], e["op"], e["since"], e["ort"]))
    for row in rows:
        row["ort"].sort(key=lambda v: tuple(map(int, v.split("."))))
    table["schemas"] = rows
    text = "{\n" + f' "source": {json.dumps(table["source"])},\n "versions": {json.dumps(table["versions"])},\n' \
        + ' "schemas": [\n' + ",\n".join("  " + json.dumps(r, sort_keys=True) for r in rows) + "\n ],\n" \
        + ' "kernels": [\n' + ",\n".join("  " + json.dumps(r, sort_keys=True) for r in krows) + "\n ]\n}\n"
    fd, tmp = tempfile.mkstemp(dir=args.output.parent, prefix=".schemas-")
    os.chmod(tmp, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, args.output)
    print(f"onnxruntime {version}: {sum(version in r['ort'] for r in rows)} schemas -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
