"""TensorFlow's AMP coloring passes over (node, type-parameter) vertices (spec §5).

Each rule is one function named after TF's pass.  Colors are an analysis
result, ``{vertex key: (color, Reason)}`` held by :class:`Coloring`; nothing is
written into the graph here.  Every rule returns a :class:`PassResult` saying
whether it painted anything, and checks its postcondition.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple

from onnxmp.color.vertices import TypeView, Vertex
from onnxmp.passes import PassResult, require

ALLOW = "allow"
DENY = "deny"
FP32 = "fp32"  # never painted: stays in its original precision


class Reason(NamedTuple):
    rule: str
    cause: str


@dataclass
class Coloring:
    """Colors by vertex id (insertion-ordered: passes walk ALLOW vertices in the order they were
    painted).  The ``*_key`` free methods take the readable "node:param" keys for callers."""

    view: TypeView
    colors: dict[int, tuple[str, Reason]] = field(default_factory=dict)
    low_name: str = "float16"
    low_groups: list = field(default_factory=list)          # ColorGroups that go low precision
    group_notes: dict[str, str] = field(default_factory=dict)  # group name -> why it stays as it is
    # Constant nodes whose `value` the range seed read.  onnxmp's GS-based rewrite wrote such a
    # tensor back as raw data once its values were loaded; the emitter keeps those bytes.
    read_constants: set[str] = field(default_factory=set)

    def _id(self, key: str | int) -> int:
        return key if isinstance(key, int) else self.view.vertices[key].id

    def is_allow(self, key: str | int) -> bool:
        entry = self.colors.get(self._id(key))
        return entry is not None and entry[0] == ALLOW

    def is_deny(self, key: str | int) -> bool:
        entry = self.colors.get(self._id(key))
        return entry is not None and entry[0] == DENY

    def paint(self, key: str | int, color: str, rule: str, cause: str) -> bool:
        """Paint unless already that color; True when something changed."""
        vid = self._id(key)
        entry = self.colors.get(vid)
        if entry is not None and entry[0] == color:
            return False
        self.colors[vid] = (color, Reason(rule, cause))
        return True

    def unpaint(self, key: str | int) -> None:
        self.colors.pop(self._id(key), None)

    def allow_ids(self) -> list[int]:
        return [i for i, (c, _) in self.colors.items() if c == ALLOW]

    def allow_keys(self) -> list[str]:
        by_id = self.view.by_id
        return [by_id[i].key for i in self.allow_ids()]

    def final(self, key: str | int) -> tuple[str, Reason]:
        vid = self._id(key)
        if vid in self.colors:
            return self.colors[vid]
        v = self.view.by_id[vid]
        if v.why_not:
            return FP32, Reason("not_processed", v.why_not)
        return FP32, Reason("not_promoted", _why_fp32(v))


def _why_fp32(v: Vertex) -> str:
    if v.list == "infer":
        return f"infer op {v.op} is not between allow ops"
    if v.list == "clear":
        return f"clear op {v.op} has no allow neighbour"
    if v.list == "allow":
        return f"allow op {v.op} was not painted"
    return f"op {v.op} keeps its type"


def _dfs(view: TypeView, roots: Iterable[int], direction: str,
         enter: Callable[[int], bool], visit: Callable[[int, int | None], None]) -> None:
    """Depth-first traversal over float32 edges; ``enter`` guards every non-root vertex."""
    seen: set[int] = set()
    fanin = view.fanin if direction in ("in", "both") else None
    fanout = view.fanout if direction in ("out", "both") else None
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        visit(root, None)
        stack = [root]
        while stack:
            current = stack.pop()
            if fanin is not None and fanout is not None:
                nexts = fanin[current] + fanout[current]
            else:
                nexts = (fanin or fanout)[current]
            for nxt in nexts:
                if nxt in seen or not enter(nxt):
                    continue
                seen.add(nxt)
                visit(nxt, current)
                stack.append(nxt)


def _ok_for_low(v: Vertex) -> bool:
    return v.processed and v.float32 and v.capable


def add_allow_ops(state: Coloring) -> PassResult:
    """Every vertex of a processed allow-list node joins ALLOW (unless a data seed denied it)."""
    painted = 0
    for v in state.view.by_id:
        if v.list == "allow" and _ok_for_low(v) and not state.is_deny(v.id):
            painted += state.paint(v.id, ALLOW, "add_allow_ops", f"allow-list op {v.op}")
    require(all(_ok_for_low(state.view.by_id[i]) for i in state.allow_ids()),
            "add_allow_ops", "every ALLOW vertex is processed, float32 and low-precision capable")
    return PassResult(painted > 0, {"painted": painted})


def propagate_deny_forward_through_clear_and_infer(state: Coloring) -> PassResult:
    """Deny spreads forward through clear and infer vertices that lie upstream of a deny or infer op.

    (a) Walk backward from every vertex of every deny and infer node (and every
    data-seeded deny vertex), entering only clear-list nodes: everything reached
    is "upstream of deny-or-infer".  (b) Walk forward from every deny vertex,
    entering only that set, and paint it DENY.  So deny->infer->clear->infer->
    clear->allow->infer ends deny, deny, deny, deny, -, allow, -: the last clear
    feeds only the allow op and is left for the allow passes.
    """
    view = state.view
    by_id = view.by_id
    roots = [v.id for v in by_id if v.float32 and (v.list in ("deny", "infer") or state.is_deny(v.id))]
    upstream: set[int] = set()
    root_set = set(roots)
    _dfs(view, roots, "in",
         enter=lambda k: k in root_set or (k not in upstream and by_id[k].list == "clear"),
         visit=lambda k, _p: upstream.add(k))

    painted = 0
    for v in by_id:
        if v.float32 and v.list == "deny" and not state.is_deny(v.id):
            painted += state.paint(v.id, DENY, "propagate_deny_forward_through_clear_and_infer",
                                   f"deny-list op {v.op}")
    deny_roots = [v.id for v in by_id if v.float32 and state.is_deny(v.id)]
    origin: dict[int, int] = {k: k for k in deny_roots}

    def visit(k: int, parent: int | None) -> None:
        nonlocal painted
        if parent is None:
            return
        origin[k] = origin.get(parent, parent)
        if state.is_deny(k):
            return
        src = by_id[origin[k]]
        via = by_id[parent] if parent != origin[k] else None
        cause = f"downstream of deny {src.op} `{src.node}`"
        if via is not None:
            cause += f" through {via.list or 'op'} {via.op} `{via.node}`"
        painted += state.paint(k, DENY, "propagate_deny_forward_through_clear_and_infer", cause)

    _dfs(view, deny_roots, "out",
         enter=lambda k: k in upstream and not state.is_allow(k), visit=visit)
    require(not any(state.is_deny(i) for i in state.allow_ids()),
            "propagate_deny_forward_through_clear_and_infer", "no vertex is both ALLOW and DENY")
    return PassResult(painted > 0, {"painted": painted})


def add_clear_and_infer_to_allow_if_between_allow(state: Coloring) -> PassResult:
    """Clear and infer vertices on a path from an allow vertex to an allow vertex join ALLOW.

    Walk forward from allow vertices through processed, low-precision-capable,
    float32 clear/infer vertices that are not DENY; then backward from allow
    vertices through that set.  Reached both ways means between allow ops.
    """
    view = state.view
    by_id = view.by_id
    allow_roots = [i for i in state.allow_ids() if by_id[i].list == "allow"]
    root_set = set(allow_roots)
    downstream: set[int] = set()

    def passable(k: int) -> bool:
        v = by_id[k]
        return (v.list in ("clear", "infer") and _ok_for_low(v) and not state.is_deny(k))

    _dfs(view, allow_roots, "out",
         enter=lambda k: k not in root_set and k not in downstream and passable(k),
         visit=lambda k, _p: downstream.add(k))
    between: set[int] = set()

    def visit(k: int, parent: int | None) -> None:
        if parent is not None:  # the allow roots themselves are already ALLOW
            between.add(k)

    _dfs(view, allow_roots, "in", enter=lambda k: k in downstream, visit=visit)
    painted = 0
    for k in sorted(between, key=lambda i: by_id[i].key):  # the readable order reports were painted in
        v = by_id[k]
        painted += state.paint(k, ALLOW, "add_clear_and_infer_to_allow_if_between_allow",
                               f"{v.list} op {v.op} lies between allow ops")
    return PassResult(painted > 0, {"painted": painted})


def add_infer_to_allow_if_follow_allow(state: Coloring) -> PassResult:
    """bfloat16 only (as in TF): in one sweep, an infer vertex with at least one ALLOW
    direct input and no DENY direct input becomes ALLOW."""
    view = state.view
    by_id = view.by_id
    promote = []
    for v in by_id:
        k = v.id
        if v.list != "infer" or not _ok_for_low(v) or state.is_deny(k) or state.is_allow(k):
            continue
        fanin = view.fanin[k]
        if any(state.is_deny(f) for f in fanin):
            continue
        allow_in = [f for f in fanin if state.is_allow(f)]
        if allow_in:
            promote.append((k, allow_in[0]))
    for k, src in promote:  # decided first, painted after: a single sweep, not a propagation
        state.paint(k, ALLOW, "add_infer_to_allow_if_follow_allow",
                    f"infer op follows allow {by_id[src].op} `{by_id[src].node}`")
    return PassResult(bool(promote), {"painted": len(promote)})


def propagate_allow_through_clear(state: Coloring) -> PassResult:
    """Walk both ways from ALLOW vertices through processed, capable, float32 clear
    vertices that are not DENY; they join ALLOW.  Infer vertices are not crossed."""
    view = state.view
    by_id = view.by_id
    roots = state.allow_ids()
    root_set = set(roots)
    origin: dict[int, int] = {}  # reached clear vertex -> the allow vertex its walk started from

    def visit(k: int, parent: int | None) -> None:
        if parent is not None:
            origin[k] = origin.get(parent, parent)

    def enter(k: int) -> bool:
        v = by_id[k]
        return (k not in root_set and v.list == "clear" and _ok_for_low(v) and not state.is_deny(k))

    _dfs(view, roots, "both", enter=enter, visit=visit)
    painted = 0
    for k, root in origin.items():
        src = by_id[root]
        painted += state.paint(k, ALLOW, "propagate_allow_through_clear",
                               f"clear op connected to allow {src.op} `{src.node}`")
    return PassResult(painted > 0, {"painted": painted})


def remove_allow_set_with_fp32(state: Coloring) -> PassResult:
    """Remove from ALLOW any vertex whose schema or kernel cannot take the low-precision type."""
    removed = 0
    by_id = state.view.by_id
    for k in state.allow_ids():
        if not _ok_for_low(by_id[k]):
            state.unpaint(k)
            removed += 1
    require(all(_ok_for_low(by_id[k]) for k in state.allow_ids()),
            "remove_allow_set_with_fp32", "every ALLOW vertex can take the low-precision type")
    return PassResult(removed > 0, {"removed": removed})


def force_color_match(state: Coloring) -> PassResult:
    """Tensors that must share a type end with one color (spec §5.7).

    Loop carried values (outer initial value, body input, body output, Loop
    output), Loop/Scan scan outputs, If branch outputs with the If output, and
    Scan state form groups.  A group goes low precision only if every member
    can: each value computed in a body comes from an ALLOW vertex, and an outer
    initial value is not DENY.  Otherwise the group keeps its original type: the
    control-flow node's own inputs and outputs stay as they are, and Casts at
    the body's formal inputs and outputs go inside the body.  Control-flow
    vertices themselves are never painted ALLOW.
    """
    view = state.view
    by_id = view.by_id
    changed = False
    for k in state.allow_ids():
        v = by_id[k]
        if v.op_type in ("If", "Loop", "Scan"):
            state.paint(k, DENY, "force_color_match", f"{v.op_type} inputs and outputs follow their color groups")
            changed = True
    state.low_groups = []
    for group in view.groups:
        blocker = None
        for tensor in group.must_allow:
            producer = view.producer_of.get(tensor)
            if producer is None or not state.is_allow(producer):
                blocker = f"`{tensor}` is not computed by an allow vertex"
                break
        for tensor in group.must_not_deny:
            producer = view.producer_of.get(tensor)
            if blocker is None and producer is not None and state.is_deny(producer):
                blocker = f"initial value `{tensor}` comes from deny {by_id[producer].op}"
        if blocker is None:
            state.low_groups.append(group)
            changed = True
        else:
            state.group_notes[group.name] = blocker
    return PassResult(changed, {"low_groups": len(state.low_groups)})


def make_casts_allow_if_all_outputs_allow(state: Coloring) -> PassResult:
    """An existing Cast(to=FLOAT), ConstantOfShape or float Constant whose consumers are
    all ALLOW is retargeted to the low-precision type (its output vertex joins ALLOW)."""
    view = state.view
    painted = 0
    for v in view.by_id:
        k = v.id
        if v.op_type not in ("Cast", "Constant", "ConstantOfShape") or not v.outputs or v.inputs:
            continue
        if not _ok_for_low(v) or state.is_deny(k) or state.is_allow(k):
            continue
        (_, tensor), = v.outputs
        if tensor in view.pinned:
            continue
        consumers = view.consumers_of.get(tensor, [])
        if consumers and all(state.is_allow(c) for c in consumers):
            painted += state.paint(k, ALLOW, "make_casts_allow_if_all_outputs_allow",
                                   f"every consumer of `{tensor}` is ALLOW")
    return PassResult(painted > 0, {"painted": painted})
