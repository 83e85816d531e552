"""Whether the graphs of a training build are valid and would load where they are meant to run.

A build for ``target="cuda"`` holds the real float16/bfloat16 training graph, which a machine
without a GPU cannot run; these are the checks that machine can still make, one graph at a time
(:func:`check_graph`):

1. **valid**: ``onnx.checker`` with strict type inference (:func:`onnxmp.verify.full_check`); the
   default-domain ops onnx has no schema for (onnxruntime-training's ``MaxPoolGrad``) are left to
   onnxruntime's resolution and listed;
2. **resolved**: onnxruntime loads the graph and resolves it (:func:`onnxmp.runtime.resolve`), as a session does
   before it chooses kernels: every node against its schema (training and contrib ops included,
   on a training build), each type parameter bound to one type.  A gradient of mixed types fails
   here ("Type parameter (T) of Optype (Sub) bound to different types").  Kernels are not chosen:
   the CPU EP has none for many bfloat16 ops, which says nothing about the GPU;
3. **kernels**: every node has a kernel of the provider (the CUDA EP by default) in plain
   onnxruntime's registry (:mod:`onnxmp.kernels`) that takes its float types.  The nodes that have
   none are counted by op type: onnxruntime-training's own ops until the training graph is lowered,
   and any standard op whose low-precision form the provider does not register.  Types onnx's
   inference cannot see (the outputs of com.microsoft ops) are checked by op alone.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto

from onnxmp import runtime
from onnxmp.domains import is_onnx_domain
from onnxmp.errors import first_line
from onnxmp.kernels import KernelTable
from onnxmp.normalize import infer_tensor_types
from onnxmp.precision import BY_ONNX_TYPE
from onnxmp.verify import full_check

# The kernel table's float types by ONNX type (it reads "float32" as its "float").
FLOAT_NAMES = {**{t: p.name for t, p in BY_ONNX_TYPE.items()}, TensorProto.DOUBLE: "double"}


@dataclass
class GraphCheck:
    """What :func:`check_graph` found for one graph."""

    name: str
    nodes: int
    op_types: Counter
    invalid: str | None                  # the checker's first line, None when valid
    unresolved: str | None               # onnxruntime's first line, None when it resolves the graph
    missing: Counter = field(default_factory=Counter)   # (domain, op type) -> nodes with no provider kernel
    not_onnx: Counter = field(default_factory=Counter)  # default-domain op types onnx has no schema for

    @property
    def without_kernel(self) -> Counter:
        """Op type -> nodes with no kernel of the provider, whatever their domain."""
        result: Counter = Counter()
        for (_, op), n in self.missing.items():
            result[op] += n
        return result

    @property
    def standard_without_kernel(self) -> Counter:
        """The ONNX ops (onnx has their schema) among :attr:`without_kernel`."""
        return Counter({op: n for (domain, op), n in self.missing.items()
                        if domain == "ai.onnx" and op not in self.not_onnx})

    @property
    def ok(self) -> bool:
        """Valid and resolved by onnxruntime (kernels are reported, not judged: see the module)."""
        return self.invalid is None and self.unresolved is None


def check_graph(model: onnx.ModelProto | str | os.PathLike, provider: str = "cuda",
                name: str | None = None) -> GraphCheck:
    """Check one graph (a model or its file) for ``provider``'s plain onnxruntime build."""
    if not isinstance(model, onnx.ModelProto):
        name = name or Path(model).name
        model = onnx.load(str(model))
    checked, not_onnx = _without_onnx_schemas(model)
    try:
        full_check(checked)
        invalid = None
    except Exception as exc:  # noqa: BLE001 (the checker's exception types vary)
        invalid = first_line(exc, 300)
    return GraphCheck(name or model.graph.name, len(model.graph.node), Counter(n.op_type for n in model.graph.node),
                      invalid, runtime.resolve(model), without_kernel(model, provider), not_onnx)


UNCHECKED_DOMAIN = "onnxmp.unchecked"


def _without_onnx_schemas(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Counter]:
    """``model`` with its default-domain nodes that onnx has no schema for moved to a domain the
    checker skips, and their op types.

    onnxruntime-training registers some gradient ops in the default domain (``MaxPoolGrad``), which
    onnx's checker refuses at the first such node, checking nothing after it.  onnxruntime's
    resolution checks those nodes; the checker checks the rest.
    """
    opset = next((o.version for o in model.opset_import if is_onnx_domain(o.domain)), None)
    unknown = Counter()
    for node in model.graph.node:
        if is_onnx_domain(node.domain) and opset is not None and not onnx.defs.has(node.op_type, opset, ""):
            unknown[node.op_type] += 1
    if not unknown:
        return model, unknown
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        if is_onnx_domain(node.domain) and node.op_type in unknown:
            node.domain = UNCHECKED_DOMAIN
    copy.opset_import.append(onnx.helper.make_opsetid(UNCHECKED_DOMAIN, 1))
    return copy, unknown


def without_kernel(model: onnx.ModelProto, provider: str = "cuda") -> Counter:
    """(domain, op type) -> number of nodes for which ``provider`` registers no kernel taking their
    float types ("ai.onnx" for the default domain)."""
    table = KernelTable.default()
    opsets = {("ai.onnx" if is_onnx_domain(o.domain) else o.domain): o.version for o in model.opset_import}
    types = {name: FLOAT_NAMES.get(tp.tensor_type.elem_type) for name, tp in infer_tensor_types(model).items()
             if tp.HasField("tensor_type")}
    missing: Counter = Counter()
    for node in model.graph.node:
        if node.op_type == "Constant" and is_onnx_domain(node.domain):
            continue  # onnxruntime makes Constant nodes initializers when it loads a graph: no kernel runs
        domain = "ai.onnx" if is_onnx_domain(node.domain) else node.domain
        opset = opsets.get(domain, 1)
        dtypes = float_params(node, domain, opset, types)
        if not table.accepts(provider, domain, node.op_type, opset, dtypes):  # None: no kernel at all
            missing[domain, node.op_type] += 1
    return missing


def float_params(node: onnx.NodeProto, domain: str, opset: int, types: dict[str, str | None]) -> dict[str, str]:
    """Type parameter -> float type of the node's tensors whose types are known.  Without an onnx
    schema (contrib ops) each tensor is its own pseudo-parameter, which any of the kernel's takes."""
    schema = None
    if domain == "ai.onnx":
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            schema = None
    params: dict[str, str] = {}
    for formals, actuals, side in ((schema.inputs if schema else None, node.input, "in"),
                                   (schema.outputs if schema else None, node.output, "out")):
        for i, tensor in enumerate(actuals):
            dtype = types.get(tensor) if tensor else None
            if dtype is None:
                continue
            if formals:
                formal = formals[min(i, len(formals) - 1)]  # a variadic last parameter repeats
                params.setdefault(formal.type_str, dtype)
            else:
                params[f"{side}{i}"] = dtype
    return params
