"""The conversion report: every vertex's color with the rule and cause that set it, a summary,
and Tensor Core advice from TF's mixed-precision guide (``docs/coloring.md``, explain)."""
from __future__ import annotations

import itertools
import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import numpy as np
import onnx

from onnxmp.color.rules import ALLOW, Coloring
from onnxmp.index import ModelIndex, TensorInfo
from onnxmp.naming import json_safe

if TYPE_CHECKING:
    from onnxmp.calibrate.records import CalibrationReport

TENSOR_CORE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")

T = TypeVar("T")


def head(items: Sequence[T], limit: int) -> tuple[Sequence[T], str]:
    """The first ``limit`` items, and the note a summary ends the list with ("… N more"; "" if none is cut)."""
    hidden = len(items) - limit
    return items[:limit], (f"… {hidden} more" if hidden > 0 else "")


@dataclass
class VertexRow:
    vertex: str
    node: str
    op: str
    param: str
    graph: str
    color: str
    rule: str
    cause: str
    tensors: list[str]


@dataclass
class GroupRow:
    """A control-flow color group (TF's force_color_match) and whether it went low precision."""

    name: str
    low: bool
    why: str
    members: list[str]

    def __getitem__(self, key: str):  # older callers read these rows as dicts
        return getattr(self, key)


@dataclass
class MaskFillRow:
    """An attention mask fill whose out-of-range values were replaced (``onnxmp.color.masks``)."""

    constant: str
    original: float
    value: float
    softmaxes: list[str]


@dataclass
class Advice:
    node: str
    op: str
    dimension: str
    value: int
    message: str


@dataclass
class Report:
    """What a conversion did.  ``vertices`` (one :class:`VertexRow` per vertex) and ``advice`` are
    built from the coloring the first time they are read (:meth:`defer`): one record per vertex is
    most of a report's cost, and most conversions never read them."""

    target: str
    precision: str
    level: str
    casts_inserted: int = 0
    cast_nodes: list[str] = field(default_factory=list)
    changed: bool = False
    unchanged_reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    node_count: int = 0
    converted_initializers: list[str] = field(default_factory=list)
    twin_initializers: list[str] = field(default_factory=list)
    calibration: CalibrationReport | None = None  # set by convert(..., calibration=...)
    shape_inference_error: str | None = None
    opset_retarget: str | None = None  # the model's opset raised to reach a low-precision kernel (opset_gaps.py)
    groups: list[GroupRow] = field(default_factory=list)  # control-flow color groups
    mask_fills: list[MaskFillRow] = field(default_factory=list)  # attention mask fills replaced
    _rows: dict[str, list | Callable[[], list]] = field(default_factory=dict, repr=False, compare=False)

    def defer(self, name: str, build: Callable[[], list]) -> None:
        """Let ``vertices`` or ``advice`` be built by ``build()`` when first read; ``build`` must
        read only what no later stage changes."""
        assert name in ("vertices", "advice")
        self._rows[name] = build

    def _built(self, name: str) -> list:
        rows = self._rows.get(name, [])
        if callable(rows):
            rows = self._rows[name] = rows()
        return rows

    @property
    def vertices(self) -> list[VertexRow]:
        return self._built("vertices")

    @vertices.setter
    def vertices(self, rows: list[VertexRow]) -> None:
        self._rows["vertices"] = rows

    @property
    def advice(self) -> list[Advice]:
        return self._built("advice")

    @advice.setter
    def advice(self, rows: list[Advice]) -> None:
        self._rows["advice"] = rows

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_rows"] = {"vertices": self.vertices, "advice": self.advice}  # built now: a builder may not pickle
        return state

    # -- aggregates ---------------------------------------------------------------
    def color_counts(self) -> dict[str, int]:
        return dict(Counter(v.color for v in self.vertices))

    def node_colors(self) -> dict[str, str]:
        """A node is low precision when any vertex is ALLOW, else deny when any is DENY."""
        rank = {ALLOW: 2, "deny": 1}
        out: dict[str, str] = {}
        for v in self.vertices:
            current = out.get(v.node)
            if current is None or rank.get(v.color, 0) > rank.get(current, 0):
                out[v.node] = v.color
        return out

    def per_op(self) -> dict[str, dict[str, int]]:
        ops = {v.node: v.op for v in self.vertices}
        table: dict[str, Counter] = defaultdict(Counter)
        for node, color in self.node_colors().items():
            table[ops[node]][color] += 1
        return {op: dict(c) for op, c in sorted(table.items())}

    def tensor_core_share(self) -> float | None:
        colors = self.node_colors()
        ops = {v.node: v.op for v in self.vertices}
        heavy = [n for n, op in ops.items() if op in TENSOR_CORE_OPS]
        if not heavy:
            return None
        return sum(colors[n] == ALLOW for n in heavy) / len(heavy)

    def denied(self) -> list[VertexRow]:
        return [v for v in self.vertices if v.color == "deny"]

    # -- output ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        data["vertices"], data["advice"] = self.vertices, self.advice
        data = asdict(_Plain(data))["data"]
        data["summary"] = {"colors": self.color_counts(), "per_op": self.per_op(),
                           "tensor_core_fp16_share": self.tensor_core_share()}
        return data

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(json_safe(self.to_dict()), indent=indent, default=_json_default)

    def summary(self, full: str = "see --report JSON") -> str:
        """The human summary; ``full`` says where a cut list is whole (explain prints it below)."""
        lines = [f"onnxmp: target={self.target} precision={self.precision} level={self.level} "
                 f"nodes={self.node_count}"]
        if not self.changed:
            lines.append(f"model unchanged: {self.unchanged_reason or 'nothing to convert'}")
        counts = self.color_counts()
        lines.append("vertices: " + ", ".join(f"{c}={counts.get(c, 0)}" for c in ("allow", "deny", "fp32")))
        share = self.tensor_core_share()
        if share is not None:
            lines.append(f"{self.precision} share of Conv/MatMul/Gemm nodes: {share:.0%}")
        lines.append(f"Casts inserted: {self.casts_inserted}")
        if self.converted_initializers or self.twin_initializers:
            lines.append(f"initializers: {len(self.converted_initializers)} converted, "
                         f"{len(self.twin_initializers)} with a low-precision twin")
        if self.opset_retarget:
            lines.append(f"retargeted {self.opset_retarget}")
        for fill in self.mask_fills:
            lines.append(f"attention mask fill `{fill.constant}`: {fill.original:.3g} -> {fill.value:g} "
                         f"(out of {self.precision}'s range; masks {len(fill.softmaxes)} Softmax)")
        lines.append("")
        lines.append(f"{'op':<28}{'allow':>7}{'deny':>7}{'fp32':>7}")
        for op, c in self.per_op().items():
            lines.append(f"{op:<28}{c.get('allow', 0):>7}{c.get('deny', 0):>7}{c.get('fp32', 0):>7}")
        denied = self.denied()
        if denied:
            lines.append("")
            lines.append("kept in fp32 (deny):")
            first = {}  # one line per node, the first reason it was denied
            for v in denied:
                first.setdefault(v.node, v)
            shown, rest = head(list(first.values()), 20)
            lines.extend(f"  {v.node} ({v.op}): {v.cause}" for v in shown)
            if rest:
                lines.append(f"  {rest} ({full})")
        if self.groups:
            lines.append("")
            lines.append("control-flow groups:")
            for g in self.groups:
                verdict = self.precision if g.low else "keeps its type"
                lines.append(f"  {g.name}: {verdict}" + (f" ({g.why})" if g.why else ""))
        if self.advice:
            lines.append("")
            lines.append("Tensor Core advice (dimensions should be multiples of 8, or powers of two below 256):")
            shown, rest = head(self.advice, 20)
            lines.extend(f"  {a.message}" for a in shown)
            if rest:
                lines.append(f"  {rest}")
        if self.calibration is not None:
            lines.append("")
            lines.extend(self.calibration.summary_lines(self.precision))
        if self.timings:
            lines.append("")
            lines.append("time: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in self.timings.items()))
        return "\n".join(lines)


@dataclass
class _Plain:
    """A wrapper that lets :func:`dataclasses.asdict` turn nested records into dicts."""

    data: dict


def _json_default(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    return str(obj)


def vertex_rows(state: Coloring) -> list[VertexRow]:
    rows = []
    for v in state.view.by_id:
        if not v.float32 and v.type_known:
            continue  # int/bool parameters are never candidates; listing them is noise
        color, reason = state.final(v.id)
        rows.append(VertexRow(v.key, v.node, v.op, v.param, v.graph or "main", color, reason.rule, reason.cause,
                              v.tensors))
    return rows


def group_rows(state: Coloring) -> list[GroupRow]:
    low = {g.name for g in state.low_groups}
    return [GroupRow(g.name, g.name in low, state.group_notes.get(g.name, ""), [t for _, t in g.members])
            for g in state.view.groups]


def tensor_core_friendly(dim: int) -> bool:
    """Seed documents: multiples of 8, or powers of two below 256."""
    return dim % 8 == 0 or (dim < 256 and dim > 0 and dim & (dim - 1) == 0)


_INTS = (int, np.integer)


def tensor_core_findings(graph: ModelIndex, state: Coloring) -> list[tuple[str, str, str, int]]:
    """For each low-precision MatMul/Gemm/Conv, the static K/N or channel dims that are not friendly,
    as (node, op, dimension, value): what the advice needs from the model (``advice_records``
    makes the report's records)."""
    view = state.view
    found: list[tuple[str, str, str, int]] = []
    nodes = _low_tensor_core_nodes(state)
    if not nodes:
        return found
    tensors = graph.tensors
    names, node_ins, node_scope, v_kind, node_first = (view.node_names, view.node_ins, view.node_scope,
                                                       view.v_kind, view.node_first)
    scope_first = list(itertools.accumulate((len(scope.names) for scope in graph.scopes), initial=0))
    for k in nodes:
        ins = node_ins[k]
        if len(ins) < 2:
            continue
        op_type = v_kind[node_first[k]].group.op.op_type
        if op_type == "MatMul":  # most of them: read here, one dim of each input
            a, b = ins[0], ins[1]
            info = tensors.get(a) if a else None
            if info is not None:
                rank, dim = info.rank_and_dim(-1)
                if rank >= 1 and isinstance(dim, _INTS) and dim > 0 and dim % 8 \
                        and not tensor_core_friendly(int(dim)):
                    found.append((names[k], op_type, "K", dim))
            info = tensors.get(b) if b else None
            if info is not None:
                rank, dim = info.rank_and_dim(-1)
                if rank >= 2 and isinstance(dim, _INTS) and dim > 0 and dim % 8 \
                        and not tensor_core_friendly(int(dim)):
                    found.append((names[k], op_type, "N", dim))
            continue
        scope = node_scope[k]
        node = graph.scopes[scope].graph.node[k - scope_first[scope]]
        for label, dim in _dims(tensors, node, ins):
            # Most dims are multiples of 8: `dim % 8` settles them before the call.
            if isinstance(dim, _INTS) and dim > 0 and dim % 8 and not tensor_core_friendly(int(dim)):
                found.append((names[k], op_type, label, dim))
    return found


class _TensorCoreKinds(dict):
    """_Kind -> 1 when its op (of any domain) is a Tensor Core op, filled as kinds are met."""

    def __missing__(self, kind) -> int:
        flag = self[kind] = int(kind.group.op.op_type in TENSOR_CORE_OPS)
        return flag


def _low_tensor_core_nodes(state: Coloring) -> list[int]:
    """Indices (view order: scopes in order, nodes in graph order) of the nodes with an ALLOW vertex
    of a Tensor Core op, found with array operations so that only their protos are read."""
    view = state.view
    flags = _TensorCoreKinds()
    heavy = bytes(map(flags.__getitem__, view.v_kind))
    if not any(flags.values()):
        return []
    low = np.frombuffer(heavy, dtype=np.uint8) & np.frombuffer(state.marks(ALLOW), dtype=np.uint8)
    vids = np.flatnonzero(low)
    return np.unique(np.frombuffer(view.v_node, dtype=np.intc)[vids]).tolist()


def advice_records(findings: list[tuple[str, str, str, int]]) -> list[Advice]:
    return [Advice(node, op, label, int(dim),
                   f"{op} `{node}`: {label} = {dim} is not a multiple of 8 "
                   "(nor a power of two below 256); pad it for Tensor Cores")
            for node, op, label, dim in findings]


def _shape(tensors: dict[str, TensorInfo], name: str):
    info = tensors.get(name) if name else None
    return None if info is None else info.shape  # read only


def _rank_and_dim(tensors: dict[str, TensorInfo], name: str, axis: int) -> tuple[int, Any]:
    info = tensors.get(name) if name else None
    return (0, None) if info is None else info.rank_and_dim(axis)


def _dims(tensors: dict[str, TensorInfo], node: onnx.NodeProto, inputs: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The K/N or channel dims of a Gemm, Conv or ConvTranspose (tensor_core_findings reads a
    MatMul's itself); ``inputs``: the node's input names (the index has them).  Of a Gemm's
    inputs only the dim used is read; the caller checks there are two."""
    op_type = node.op_type
    if op_type == "Gemm":
        ta, tb = _attr(node, "transA", 0), _attr(node, "transB", 0)
        (rank_a, k), (rank_b, n) = (_rank_and_dim(tensors, inputs[0], 0 if ta else 1),
                                    _rank_and_dim(tensors, inputs[1], 0 if tb else 1))
        out = []
        if rank_a == 2:
            out.append(("K", k))
        if rank_b == 2:
            out.append(("N", n))
        return out
    if op_type in ("Conv", "ConvTranspose"):
        w = _shape(tensors, inputs[1])
        if not w or len(w) < 2:
            return []
        group = int(_attr(node, "group", 1))
        if op_type == "Conv":
            return [("input channels", w[1] * group), ("output channels", w[0])]
        return [("input channels", w[0]), ("output channels", w[1] * group)]
    return []


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)
