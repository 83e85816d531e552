"""Types of the tensors onnx's shape inference leaves unknown: outputs of the ops onnxruntime
registers in its own domains (com.microsoft's Attention, SkipLayerNormalization, ...) and of the
standard ops that read them.

onnx's inference knows no com.microsoft schema, so it stops at the first fused op and every
tensor after it stays untyped; the coloring would then change the weights of a fused op without
its activations, and onnxruntime refuses the result ("Type parameter (T) of Optype (Attention)
bound to different types").  An output's type follows from its schema's type constraints: a
parameter bound at the inputs binds the outputs of that parameter, and a constraint allowing one
type fixes it.  One pass over the nodes in order (repeated only for a graph out of order) types
every output that binding decides; this runs only for models holding ops of those domains.

The schemas are onnx's own for its domains and ``kernels.ContribSchemas`` (onnxruntime's, per
version) for the others.  A node of an onnxruntime domain no schema knows, whose outputs stay
untyped, is refused by name: converting around it would be guessing.
"""
from __future__ import annotations

import functools
import logging

import onnx

from onnxmp.domains import is_onnx_domain
from onnxmp.errors import OnnxMPError
from onnxmp.kernels import ContribSchemas
from onnxmp.subgraphs import iter_proto_graphs

log = logging.getLogger("onnxmp.normalize")

_ONNX_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training"})


def _type_strs() -> tuple[dict[int, str], dict[str, int]]:
    names = {onnx.TensorProto.FLOAT: "float", onnx.TensorProto.DOUBLE: "double"}
    for name, value in onnx.TensorProto.DataType.items():
        if value and value not in names:
            names[value] = name.lower()
    to_str = {v: f"tensor({n})" for v, n in names.items()}
    return to_str, {s: v for v, s in to_str.items()}


TYPE_STR, TYPE_CODE = _type_strs()


def has_foreign_ops(model: onnx.ModelProto) -> bool:
    """Whether a node of ``model`` (bodies included) is in a domain onnx does not define."""
    return any(node.domain not in _ONNX_DOMAINS for g in iter_proto_graphs(model.graph) for node in g.node)


def runtime_schema(op_type: str, domain: str, opset: int, ort_version: str | None = None):
    """The schema a node resolves to: onnx's for onnx's domains, onnxruntime's (per version) for
    the domains onnxruntime registers; None when neither knows it."""
    if domain in _ONNX_DOMAINS:
        domain = "" if is_onnx_domain(domain) else domain
        found = _onnx_schema(op_type, domain, opset)
        if found is not None or domain != "":
            return found
        # onnxruntime registers a few ops of its own in the default domain (SimplifiedLayerNormalization)
    return ContribSchemas.default().schema(op_type, domain, opset, ort_version)


@functools.lru_cache(maxsize=None)
def _onnx_schema(op_type: str, domain: str, opset: int):
    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None


def formal_params(formals, count: int) -> list[str | None]:
    """The type string (a parameter or a literal type) of each of ``count`` actual positions."""
    out: list[str | None] = []
    for i in range(count):
        if not formals:
            out.append(None)
        elif i < len(formals):
            out.append(formals[i].type_str)
        else:
            last = formals[-1]
            variadic = last.option == onnx.defs.OpSchema.FormalParameterOption.Variadic
            out.append(last.type_str if variadic and last.is_homogeneous else None)
    return out


def type_foreign_outputs(model: onnx.ModelProto, opsets: dict[str, int],
                         holding: list[onnx.NodeProto] | None = None) -> int:
    """Declare (element type only) the outputs the schemas' type bindings decide and inference left
    unknown, in every graph of ``model``; returns how many.  Raises for a node of an onnxruntime
    domain no schema knows when its outputs stay untyped.  ``holding``: ``holders(model.graph)``
    when the caller has it."""
    known: dict[str, int] = {}
    graphs = list(iter_proto_graphs(model.graph, holding))
    for g in graphs:
        for t in g.initializer:
            known[t.name] = t.data_type
        for vi in (*g.input, *g.value_info, *g.output):
            kind = vi.type.WhichOneof("value")
            if kind == "tensor_type" and vi.type.tensor_type.elem_type:
                known.setdefault(vi.name, vi.type.tensor_type.elem_type)
            elif kind and kind != "tensor_type":
                known.setdefault(vi.name, 0)  # a sequence, map or optional: not a tensor to type
    runtime_domains = ContribSchemas.default().domains - _ONNX_DOMAINS
    added = 0
    for g in graphs:
        declared = {vi.name for vi in (*g.value_info, *g.output)}
        rows = [(node, tuple(node.input), tuple(node.output)) for node in g.node]
        for _ in range(len(rows)):  # a sorted graph settles in one pass
            progress = pending = False
            for node, ins, outs in rows:
                if all(o in known or not o for o in outs):
                    continue
                layout = _binding_layout(node.op_type, node.domain, opsets, len(ins), len(outs))
                if layout is None:
                    if node.domain in runtime_domains:
                        raise OnnxMPError(
                            f"no schema types the outputs of {node.domain}:{node.op_type} (node {node.name!r}) "
                            f"for the onnxruntime versions onnxmp knows",
                            hint="onnxmp cannot convert around an op whose output types it cannot tell; "
                                 "convert the model before onnxruntime's fusions, or keep it in float32")
                    continue
                for name, code in zip(outs, _apply(layout, node, ins, known)):
                    if not name or name in known:
                        continue
                    if not code:
                        pending = True
                        continue
                    known[name] = code
                    progress = True
                    if name not in declared:
                        vi = g.value_info.add()
                        vi.name = name
                        vi.type.tensor_type.elem_type = code
                        declared.add(name)
                        added += 1
            if not (progress and pending):
                break
    if added:
        log.info("typed %d outputs of ops onnx's inference does not know", added)
    return added


_CAST = "cast"  # layout marker: the output's type is the node's ``to``


@functools.lru_cache(maxsize=None)
def _cached_layout(op_type: str, domain: str, opset: int, n_in: int, n_out: int):
    """((input position, param) pairs, per output a param, a type code or None); None when no
    schema knows the op."""
    if op_type == "Cast" and domain == "":
        return _CAST
    schema = runtime_schema(op_type, domain, opset)
    if schema is None:
        return None
    allowed = {c.type_param_str: tuple(c.allowed_type_strs) for c in schema.type_constraints}
    ins = tuple((i, p) for i, p in enumerate(formal_params(schema.inputs, n_in)) if p in allowed)
    outs = []
    for param in formal_params(schema.outputs, n_out):
        if param in allowed:  # a constraint allowing one type fixes it
            outs.append(TYPE_CODE.get(allowed[param][0]) if len(allowed[param]) == 1 else param)
        else:
            outs.append(TYPE_CODE.get(param) if param else None)  # a literal type, tensor(int32)
    return ins, tuple(outs)


def _binding_layout(op_type: str, domain: str, opsets: dict[str, int], n_in: int, n_out: int):
    domain = "" if is_onnx_domain(domain) else domain
    return _cached_layout(op_type, domain, opsets.get(domain, 1), n_in, n_out)


def _apply(layout, node: onnx.NodeProto, ins: tuple, known: dict[str, int]) -> list:
    """Each output's type code under the binding ``layout`` gives; None where it does not decide."""
    if layout is _CAST:
        return [next((a.i for a in node.attribute if a.name == "to"), None)]
    bound: dict[str, int] = {}
    for i, param in layout[0]:
        code = known.get(ins[i]) if ins[i] else None
        if code:
            bound.setdefault(param, code)
    return [bound.get(out) if isinstance(out, str) else out for out in layout[1]]


def binding_errors(model: onnx.ModelProto, ort_version: str | None = None, limit: int = 5) -> list[str]:
    """The nodes onnxruntime ``ort_version``'s graph resolution refuses for types, in its words:
    a type parameter bound to two types, or bound to a type its constraint does not allow.  For
    several versions (``"1.19.2,1.32.0"``, ``"all"``), what any of them refuses.

    Checks the nodes of onnxruntime's domains (onnx's checker, with strict inference, checks onnx's
    own ops); each tensor's type is its declaration, an initializer's or a graph input's.
    """
    found: list[str] = []
    for version in ContribSchemas.default().versions_of(ort_version):
        found += [e for e in _binding_errors(model, version, limit) if e not in found]
        if len(found) >= limit:
            break
    return found[:limit]


def _binding_errors(model: onnx.ModelProto, ort_version: str, limit: int) -> list[str]:
    found: list[str] = []
    opsets = {("" if is_onnx_domain(o.domain) else o.domain): int(o.version) for o in model.opset_import}
    graphs = list(iter_proto_graphs(model.graph))
    types: dict[str, int] = {}
    for g in graphs:
        for vi in (*g.input, *g.value_info, *g.output):
            if vi.type.WhichOneof("value") == "tensor_type" and vi.type.tensor_type.elem_type:
                types[vi.name] = vi.type.tensor_type.elem_type
        for t in g.initializer:
            types[t.name] = t.data_type
        for node in g.node:  # the rewrite's Casts may leave their outputs undeclared
            if node.op_type == "Cast" and is_onnx_domain(node.domain) and node.output[0] not in types:
                to = next((a.i for a in node.attribute if a.name == "to"), 0)
                if to:
                    types[node.output[0]] = to
    for g in graphs:
        for node in g.node:
            domain = "" if is_onnx_domain(node.domain) else node.domain
            if domain in _ONNX_DOMAINS and _onnx_schema(node.op_type, domain, opsets.get(domain, 1)) is not None:
                continue
            schema = runtime_schema(node.op_type, domain, opsets.get(domain, 1), ort_version)
            if schema is None:
                continue  # a custom op: onnxruntime needs its library, which onnxmp cannot see into
            allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
            bound: dict[str, tuple[str, str]] = {}
            for side, names, formals in (("input", node.input, schema.inputs), ("output", node.output, schema.outputs)):
                for name, param in zip(names, formal_params(formals, len(names))):
                    code = types.get(name) if name else None
                    if param not in allowed or not code:
                        continue
                    type_str = TYPE_STR.get(code, str(code))
                    if type_str not in allowed[param]:
                        found.append(f"Type '{type_str}' of {side} {name!r} of operator ({node.op_type}) in node "
                                     f"({node.name}) is invalid for onnxruntime {ort_version}")
                    elif param in bound and bound[param][0] != type_str:
                        found.append(f"Type parameter ({param}) of Optype ({node.op_type}) bound to different types "
                                     f"({bound[param][0]} and {type_str}) in node ({node.name})")
                    bound.setdefault(param, (type_str, name))
            if len(found) >= limit:
                return found[:limit]
    return found
