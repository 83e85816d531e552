"""What one node's vertices are: its op's schema read as type-parameter groups (one vertex per
parameter; the target kernel's tied parameters merged), and the facts a vertex's dtypes, list and
kernel give (:class:`Kind`).  The schema is onnx's, or onnxruntime's own for its domains
(``onnxmp.contrib_types.runtime_schema``, per onnxruntime version).  ``vertices.py`` builds the
type view from these.
"""
from __future__ import annotations

import functools
from operator import itemgetter
from typing import Mapping, Sequence

import onnx

from onnxmp.contrib_types import runtime_schema
from onnxmp.domains import op_key
from onnxmp.kernels import ContribSchemas
from onnxmp.lists import list_of

# Ops that define their float output from an attribute; make_casts_allow_if_all_outputs_allow may retarget them.
RETARGETABLE = ("Cast", "Constant", "ConstantOfShape")
CONTROL_FLOW = ("If", "Loop", "Scan")
WHOLE_NODE = "*"  # param of the single vertex of an op with no known schema
NOT_A_TENSOR = -1  # dtype marker for sequence/optional/map values
FLOAT = onnx.TensorProto.FLOAT


class OpInfo:
    """What every node of one (op type, domain) shares: schema and list."""

    __slots__ = ("op_type", "domain", "opset", "key", "schema", "list", "special", "ort_version")

    def __init__(self, op_type: str, domain: str, opset: int, lists: Mapping[str, frozenset[str]],
                 ort_version: str | None = None):
        self.op_type, self.domain, self.opset = op_type, domain, opset
        self.key = op_key(op_type, domain)
        self.schema = op_schema(op_type, domain, opset, ort_version)
        self.ort_version = ort_version
        self.list = list_of(self.key, lists)
        self.special = op_type in RETARGETABLE or op_type in CONTROL_FLOW  # the view records these nodes


class Group:
    """One type parameter of one (op, arity): the input and output positions that share it."""

    __slots__ = ("op", "param", "in_idx", "out_idx", "pick_in", "pick_out", "in_mask")

    def __init__(self, op: OpInfo, param: str, in_idx: tuple[int, ...], out_idx: tuple[int, ...]):
        self.op, self.param, self.in_idx, self.out_idx = op, param, in_idx, out_idx
        self.pick_in, self.pick_out = _picker(in_idx), _picker(out_idx)
        self.in_mask = sum(1 << i for i in in_idx)  # bit i for input i (the rewrite's low inputs)


def _picker(positions: tuple[int, ...]):
    """A C-level function that takes these positions of a tuple, as a tuple."""
    if not positions:
        return itemgetter(slice(0, 0))
    if positions == tuple(range(positions[0], positions[-1] + 1)):
        return itemgetter(slice(positions[0], positions[-1] + 1))
    return itemgetter(*positions)  # two or more positions here: itemgetter gives a tuple


def op_schema(op_type: str, domain: str, opset: int, ort_version: str | None = None):
    """onnx's schema, or onnxruntime's (``ort_version``'s) for the domains it registers; None for
    an op no schema knows."""
    return runtime_schema(op_type, domain, opset, ort_version)


def _params(schema: onnx.defs.OpSchema | None, formals: Sequence, count: int) -> list[str | None]:
    """Type parameter of each actual input/output; None for fixed types like tensor(int64)."""
    if schema is None:
        return [WHOLE_NODE] * count
    type_params = {tc.type_param_str for tc in schema.type_constraints}
    out: list[str | None] = []
    for i in range(count):
        if not formals:
            out.append(None)
            continue
        formal = formals[min(i, len(formals) - 1)]
        if i >= len(formals) and formal.option != onnx.defs.OpSchema.FormalParameterOption.Variadic:
            out.append(None)
            continue
        param = formal.type_str if formal.type_str in type_params else None
        # Heterogeneous variadics (Loop/If/Scan "V") give each position its own type.
        if param and formal.option == onnx.defs.OpSchema.FormalParameterOption.Variadic \
                and not formal.is_homogeneous:
            param = f"{param}#{i}"
        out.append(param)
    return out


@functools.lru_cache(maxsize=None)
def schema_layout(op_type: str, domain: str, opset: int, n_in: int, n_out: int, ort_version: str | None = None
            ) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]:
    """The vertices of one (op, arity) in the order their first position appears (inputs, then
    outputs): (param, input positions, output positions)."""
    schema = op_schema(op_type, domain, opset, ort_version)
    positions: dict[str, tuple[list[int], list[int]]] = {}
    for side, formals, count in ((0, schema.inputs if schema else (), n_in),
                                 (1, schema.outputs if schema else (), n_out)):
        for i, param in enumerate(_params(schema, formals, count)):
            if param is not None:
                positions.setdefault(param, ([], []))[side].append(i)
    return tuple((param, tuple(ins), tuple(outs)) for param, (ins, outs) in positions.items())


class Tied:
    """An op's vertices with the kernel's tied type parameters merged (see merge_tied_params)."""

    __slots__ = ("plain", "ties", "groups")

    def __init__(self, plain: list[Group], ties: tuple[frozenset[str], ...], groups: list[Group]):
        self.plain, self.ties, self.groups = plain, ties, groups

    def for_node(self, ins: Sequence[str], outs: Sequence[str], code_of) -> list[Group]:
        """The node's vertices: the cached merge when every tied tensor is float32 (or of unknown
        type), else a merge of only the parameters whose tensors are."""
        def floats(g: Group) -> bool:
            return all(code_of(ins[i]) in _FLOAT_OR_UNKNOWN for i in g.in_idx if ins[i]) and \
                all(code_of(outs[i]) in _FLOAT_OR_UNKNOWN for i in g.out_idx if outs[i])

        if all(map(floats, self.plain)):
            return self.groups
        merged = merge_tied_params(self.plain, self.ties, floats)
        return merged.groups if merged is not None else self.plain


_FLOAT_OR_UNKNOWN = (onnx.TensorProto.FLOAT, None)


def merge_tied_params(groups: list[Group], ties: tuple[frozenset[str], ...], floats=None) -> Tied | None:
    """One vertex for the type parameters the target's kernel binds to one type.

    ONNX lets BatchNormalization-15 type X (T) apart from scale/B (T1) and mean/var (T2), but
    ORT's CUDA kernel is registered for T1 = T2 = T: a node with float16 X and float32 scale
    has no CUDA kernel, and ORT runs it on the CPU with copies around it (ResNet-50 on an
    H200: 801 ms a batch instead of 7.3 ms).  Merged, the tied parameters are painted as one
    vertex and keep one type.  The merged vertex is named after the tied parameter that comes
    first.  ``floats(group)`` says whether a group may join: a parameter holding a bool mask
    is no float tensor, and the kernel does not bind it to one.  None when nothing merges.
    """
    merged, changed = list(groups), False
    for tie in ties:
        members = [g for g in merged if g.param.split("#")[0] in tie and (floats is None or floats(g))]
        if len(members) < 2:
            continue
        head = members[0]
        in_idx = tuple(sorted(i for g in members for i in g.in_idx))
        out_idx = tuple(sorted(i for g in members for i in g.out_idx))
        merged = [Group(head.op, head.param, in_idx, out_idx) if g is head else g
                  for g in merged if g is head or g not in members]
        changed = True
    return Tied(list(groups), tuple(ties), merged) if changed else None


def present_groups(groups: list[Group], ins: Sequence[str], outs: Sequence[str]) -> list[Group]:
    """A node with empty (omitted) optional names: its vertices cover named positions only, in the
    order their first named position appears."""
    found = []
    for g in groups:
        in_idx = tuple(i for i in g.in_idx if ins[i])
        out_idx = tuple(i for i in g.out_idx if outs[i])
        if in_idx or out_idx:
            first = in_idx[0] if in_idx else len(ins) + out_idx[0]
            found.append((first, Group(g.op, g.param, in_idx, out_idx)))
    found.sort(key=lambda item: item[0])
    return [g for _, g in found]


def allows_type(schema: onnx.defs.OpSchema | None, param: str, type_str: str) -> bool | None:
    if schema is None:
        return None
    base = param.split("#")[0]
    for tc in schema.type_constraints:
        if tc.type_param_str == base:
            return type_str in tc.allowed_type_strs
    return None


def identity_group(op: OpInfo, lists: Mapping[str, frozenset[str]]) -> Group:
    """An identity Cast as one clear vertex over its input and output (as Identity), so colors
    pass through it; a low-precision one is retargeted to a low-to-low Cast, which ORT drops."""
    identity = OpInfo(op.op_type, op.domain, op.opset, lists, op.ort_version)
    identity.list = "clear"
    return Group(identity, "T1", (0,), (0,))


def kernel_capability(op: OpInfo, param: str, provider: str, kernels, low_name: str, low_type_str: str
                ) -> tuple[bool, str]:
    """Whether the schema and the provider's kernel take the low-precision type (same for every
    vertex of one op type and type parameter)."""
    if op.schema is not None and allows_type(op.schema, param, low_type_str) is False:
        return False, (f"the ONNX schema of {op.key} (opset {op.opset}) does not allow {low_name} "
                       f"for {param}")
    if op.op_type == "Constant":
        return True, ""  # folded at session creation; needs no kernel
    base = None if param == WHOLE_NODE else param.split("#")[0]
    if base is not None and base in kernels.float32_params(provider, op.domain, op.op_type, op.opset):
        return False, f"the {provider} kernel of {op.key} reads {base} as float32 (kernel facts)"
    if op.domain not in ("", "ai.onnx") and op.schema is not None:
        # onnxruntime's own ops: which low kernels a provider has changes between versions (CPU
        # SkipLayerNormalization: float only in 1.19.2), where the per-version table records it
        table = ContribSchemas.default()
        if not table.allows(op.op_type, op.domain, op.opset, param, low_type_str, op.ort_version):
            return False, (f"onnxruntime {op.ort_version}'s schema of {op.key} does not allow {low_name} "
                           f"for {param}")
        by_version = table.kernel_supports(provider, op.domain, op.op_type, op.opset, base, low_name, op.ort_version)
        if by_version is False:
            return False, (f"no {provider} {low_name} kernel for {op.key} ({param}) in onnxruntime "
                           f"{op.ort_version or 'newest'}")
    supported = kernels.supports(provider, op.domain, op.op_type, op.opset, base, low_name)
    if supported is None:
        return False, f"no {provider} kernel for {op.key} at opset {op.opset}"
    if not supported:
        return False, f"no {provider} {low_name} kernel for {op.key} ({param}) at opset {op.opset}"
    return True, ""


class Kind:
    """What a vertex is: its op's type-parameter group and the facts its dtypes, list and block
    match give.  Shared by every vertex with the same group, dtypes and block match."""

    __slots__ = ("group", "list", "type_known", "float32", "processed", "capable", "why_not", "float_only",
                 "ok", "special")

    def __init__(self, group: Group):
        self.group, self.list = group, group.op.list
        self.type_known = self.float32 = self.processed = self.capable = False
        self.why_not = ""
        self.float_only = False  # an op without schema: only its float tensors form the vertex
        self.ok = False          # processed, float32 and low-precision capable: may join ALLOW
        self.special = False     # float_only, or an op the passes look up by id (RETARGETABLE)

    def settle(self) -> Kind:
        self.ok = bool(self.processed and self.float32 and self.capable)
        self.special = self.float_only or self.group.op.op_type in RETARGETABLE
        return self

    def copy(self) -> Kind:
        new = Kind(self.group)
        for name in Kind.__slots__:
            setattr(new, name, getattr(self, name))
        return new


def decide(group: Group, dtypes: Sequence, n_in: int, blocked: str | None, capability) -> Kind:
    """The facts of a vertex from its tensors' dtypes (inputs first, ``n_in`` of them), then TF's
    ShouldProcess (node level) and SupportsF16 (vertex level)."""
    op = group.op
    kind = Kind(group)
    known = [d for d in dtypes if d is not None]
    has_in, has_out = n_in > 0, len(dtypes) > n_in
    if known:
        kind.type_known = True
        kind.float32 = known.count(FLOAT) == len(known)
        if NOT_A_TENSOR in known:
            kind.why_not = "a sequence or optional value, not a tensor"
    if op.schema is None and not kind.float32:
        floats = [i for i, d in enumerate(dtypes) if d == FLOAT]
        if floats:
            kind.float_only = kind.float32 = True
            has_in, has_out = floats[0] < n_in, floats[-1] >= n_in
    if not kind.type_known:
        kind.why_not = "type unknown (shape inference could not type its tensors)"
    elif not kind.float32:
        kind.why_not = kind.why_not or "not float32"
    elif blocked is not None:
        kind.why_not = f"node name matches block pattern {blocked!r}"
    elif op.list is None and not (op.op_type in RETARGETABLE and has_out and not has_in):
        kind.why_not = f"op {op.key} is on no list"
    else:
        kind.processed = True
        kind.capable, why_not = capability(op, group.param)
        if why_not:
            kind.why_not = why_not
    return kind.settle()
