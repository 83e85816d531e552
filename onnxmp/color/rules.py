"""TensorFlow's AMP coloring passes over (node, type-parameter) vertices (``docs/coloring.md``).

Each rule is one function named after TF's pass.  Colors are an analysis
result, ``{vertex id: (color, rule, cause)}`` held by :class:`Coloring`; nothing is
written into the graph here.  Every rule returns a :class:`PassResult` saying
whether it painted anything, and checks its postcondition.  The passes run on
vertex ids and the view's flat arrays (see :class:`~onnxmp.color.vertices.TypeView`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple

import numpy as np

from onnxmp.color.vertices import LIST_CODES, Adjacency, TypeView
from onnxmp.passes import PassResult, require

ALLOW = "allow"
DENY = "deny"
FP32 = "fp32"  # never painted: stays in its original precision


class Reason(NamedTuple):
    rule: str
    cause: str


class Cause(NamedTuple):
    """Why a vertex got its color, as ``writer(view, vertex id, *args)``, which makes the words
    when a report asks (:meth:`Coloring.final`).  ``Cause.text("...")`` is a cause in plain words."""

    writer: Callable[..., str]
    args: tuple = ()

    @classmethod
    def text(cls, words: str) -> Cause:
        return cls(_words, (words,))

    def words(self, view: TypeView, vid: int) -> str:
        return self.writer(view, vid, *self.args)


def _words(view: TypeView, vid: int, words: str) -> str:
    return words


@dataclass
class Coloring:
    """Colors by vertex id (insertion-ordered: see :meth:`allow_ids`).  Methods take an id or, for
    callers, the readable "node:param" key."""

    view: TypeView
    # id -> (color, rule, cause).  A cause is a Cause: the words are made from the view only
    # when a report asks (see final), since most conversions never read them.
    colors: dict[int, tuple] = field(default_factory=dict)
    low_name: str = "float16"
    low_groups: list = field(default_factory=list)          # ColorGroups that go low precision
    mask_fills: dict = field(default_factory=dict)          # constant -> MaskFill (onnxmp.color.masks)
    group_notes: dict[str, str] = field(default_factory=dict)  # group name -> why it stays as it is

    def __post_init__(self):
        # The color of every vertex as a byte (see _CODE), kept with ``colors`` by paint/unpaint:
        # the passes test colors by indexing it and take masks of it with bytes.translate.
        self.codes = bytearray(len(self.view))
        for vid, (color, _, _) in self.colors.items():
            self.codes[vid] = _CODE[color]

    def _id(self, key: str | int) -> int:
        return key if isinstance(key, int) else self.view.id_of(key)

    def is_allow(self, key: str | int) -> bool:
        return self.codes[self._id(key)] == _ALLOW

    def is_deny(self, key: str | int) -> bool:
        return self.codes[self._id(key)] == _DENY

    def paint(self, key: str | int, color: str, rule: str, cause: Cause | str) -> bool:
        """Paint unless already that color; True when something changed.  ``cause`` may be plain words."""
        cause = Cause.text(cause) if isinstance(cause, str) else cause
        vid = self._id(key)
        code = _CODE[color]
        if self.codes[vid] == code:
            return False
        self.colors[vid] = (color, rule, cause)
        self.codes[vid] = code
        return True

    def paint_all(self, ids: Iterable[int], color: str, rule: str, cause: Cause) -> int:
        """:meth:`paint` of every id in order with one shared entry; how many changed."""
        code, codes = _CODE[color], self.codes
        changed = [vid for vid in ids if codes[vid] != code]
        if changed:
            self.colors.update(dict.fromkeys(changed, (color, rule, cause)))
            for vid in changed:
                codes[vid] = code
        return len(changed)

    def unpaint(self, key: str | int) -> None:
        vid = self._id(key)
        self.colors.pop(vid, None)
        self.codes[vid] = 0

    def allow_ids(self) -> list[int]:
        """ALLOW vertex ids in the order they were painted (the order the rewrite retypes in and
        propagate_allow_through_clear walks from); :func:`_ids` of :meth:`marks` where order
        does not matter."""
        return [i for i, entry in self.colors.items() if entry[0] == ALLOW]

    def has_allow(self) -> bool:
        return _ALLOW in self.codes

    def final(self, key: str | int) -> tuple[str, Reason]:
        vid = self._id(key)
        entry = self.colors.get(vid)
        if entry is not None:
            return entry[0], Reason(entry[1], entry[2].words(self.view, vid))
        why_not = self.view.v_kind[vid].why_not
        if why_not:
            return FP32, Reason("not_processed", why_not)
        return FP32, Reason("not_promoted", _why_fp32(self.view.lst[vid], self.view.op_of(vid)))

    def marks(self, color: str) -> bytearray:
        """1 for every vertex painted ``color``, 0 for the others."""
        return bytearray(self.codes.translate(_MARKS[color]))


_ALLOW, _DENY = 1, 2
_CODE = {ALLOW: _ALLOW, DENY: _DENY}
_MARKS = {color: bytes(int(i == code) for i in range(256)) for color, code in _CODE.items()}


# Cause writers (see Coloring.colors); each runs only when a report asks.
def _list_op(view: TypeView, k: int) -> str:
    return f"{view.lst[k]}-list op {view.op_of(k)}"


def _downstream_of_deny(view: TypeView, k: int, source: int, via: int) -> str:
    cause = f"downstream of deny {view.op_of(source)} `{view.node_of(source)}`"
    if via >= 0:
        cause += f" through {view.lst[via] or 'op'} {view.op_of(via)} `{view.node_of(via)}`"
    return cause


def _between_allow(view: TypeView, k: int) -> str:
    note = f" ({view.notes[k]})" if k in view.notes else ""
    return f"{view.lst[k]} op {view.op_of(k)} lies between allow ops{note}"


def _follows_allow(view: TypeView, k: int, source: int) -> str:
    return f"infer op follows allow {view.op_of(source)} `{view.node_of(source)}`"


def _connected_to_allow(view: TypeView, k: int, root: int) -> str:
    return f"clear op connected to allow {view.op_of(root)} `{view.node_of(root)}`"


def _why_fp32(list_name: str | None, op: str) -> str:
    if list_name == "infer":
        return f"infer op {op} is not between allow ops"
    if list_name == "clear":
        return f"clear op {op} has no allow neighbour"
    if list_name == "allow":
        return f"allow op {op} was not painted"
    return f"op {op} keeps its type"


def _ids(marks: bytes | bytearray) -> list[int]:
    """The ids whose byte in ``marks`` is non-zero, in id order."""
    return np.flatnonzero(np.frombuffer(marks, dtype=np.uint8)).tolist()


def _dfs(adjacent: tuple[Adjacency, ...], roots: Iterable[int], enter: bytearray
         ) -> tuple[list[int], list[int]]:
    """Depth-first traversal over float32 edges (fan-in, fan-out or both); ``enter`` guards every
    non-root vertex.  Returns the vertices in visit order and the parent of each (-1 for a root)."""
    state = bytearray(enter)  # 1: may be entered, 0: may not, 2: seen
    order: list[int] = []
    parents: list[int] = []
    both = len(adjacent) == 2
    start, flat = adjacent[0].start, adjacent[0].flat
    if both:
        out_start, out_flat = adjacent[1].start, adjacent[1].flat
    for root in roots:
        if state[root] == 2:
            continue
        state[root] = 2
        order.append(root)
        parents.append(-1)
        stack = [root]
        while stack:
            current = stack.pop()
            nexts = flat[start[current]:start[current + 1]]
            if both:
                nexts += out_flat[out_start[current]:out_start[current + 1]]
            for nxt in nexts:
                if state[nxt] == 1:
                    state[nxt] = 2
                    order.append(nxt)
                    parents.append(current)
                    stack.append(nxt)
    return order, parents


def _next_to(adjacent: tuple[Adjacency, ...], targets: np.ndarray) -> np.ndarray:
    """Per vertex: whether one of its neighbours in ``adjacent`` is in ``targets`` (a bool mask)."""
    near = np.zeros(len(targets), dtype=bool)
    for adj in adjacent:
        start = np.frombuffer(adj.start, dtype=np.intc)
        edges = np.flatnonzero(targets[np.frombuffer(adj.flat, dtype=np.intc)])
        near[np.searchsorted(start, edges, side="right") - 1] = True  # the vertex each edge leaves
    return near


_SEEN = bytes(2) + bytes([1]) + bytes(253)  # translate table: state 2 (seen) -> 1, else 0


def _reached(adjacent: Adjacency, roots: Iterable[int], enter: bytearray) -> bytearray:
    """1 for every vertex :func:`_dfs` over ``(adjacent,)`` visits (the same walk, without its
    order and parents)."""
    state = bytearray(enter)  # as in _dfs: 1 may be entered, 0 may not, 2 seen
    stack = []
    for root in roots:
        if state[root] != 2:
            state[root] = 2
            stack.append(root)
    start, flat = adjacent.start, adjacent.flat
    push, pop = stack.append, stack.pop
    while stack:
        current = pop()
        for nxt in flat[start[current]:start[current + 1]]:
            if state[nxt] == 1:
                state[nxt] = 2
                push(nxt)
    return state.translate(_SEEN)


_ALLOW_LIST, _DENY_LIST, _INFER_LIST, _CLEAR_LIST = (LIST_CODES[name] for name in ("allow", "deny", "infer", "clear"))


def _u8(marks: bytes | bytearray) -> np.ndarray:
    """A byte per vertex (marks, view.f32, view.ok, view.list_codes) as a numpy array, not copied."""
    return np.frombuffer(marks, dtype=np.uint8)


def allow_only_where_ok(state: Coloring) -> bool:
    """Every ALLOW vertex is processed, float32 and low-precision capable (the postcondition of
    add_allow_ops and remove_allow_set_with_fp32)."""
    allow = np.frombuffer(state.marks(ALLOW), dtype=np.uint8)
    return not np.any(allow > np.frombuffer(state.view.ok, dtype=np.uint8))


def add_allow_ops(state: Coloring) -> PassResult:
    """Every vertex of a processed allow-list node joins ALLOW (unless a data seed denied it).
    When none does, the model is left unchanged: no later rule runs."""
    view = state.view
    listed = _ids((_u8(view.list_codes) == _ALLOW_LIST) & (_u8(view.ok) != 0) & (_u8(state.codes) != _DENY))
    painted = state.paint_all(listed, ALLOW, "add_allow_ops", Cause(_list_op))
    # TF returns here when no allow op can take the low-precision type: nothing else may change.
    return PassResult(painted > 0, {"painted": painted}, stop=painted == 0)


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
    lists, f32 = _u8(view.list_codes), _u8(view.f32) != 0
    rule = "propagate_deny_forward_through_clear_and_infer"
    seeded = _u8(state.marks(DENY)) != 0
    deny_list = lists == _DENY_LIST
    roots = f32 & (deny_list | (lists == _INFER_LIST) | seeded)
    upstream = _reached(view.fanin, _ids(roots), bytearray(roots | (lists == _CLEAR_LIST)))

    painted = state.paint_all(_ids(f32 & deny_list & ~seeded), DENY, rule, Cause(_list_op))
    deny = state.marks(DENY)
    deny_roots = _ids(f32 & (_u8(deny) != 0))
    allow = state.marks(ALLOW)
    upstream = bytearray(_u8(upstream) > _u8(allow))
    origin: dict[int, int] = {k: k for k in deny_roots}
    for k, parent in zip(*_dfs((view.fanout,), deny_roots, upstream)):
        if parent < 0:
            continue
        source = origin[k] = origin.get(parent, parent)
        if deny[k]:
            continue
        painted += state.paint(k, DENY, rule, Cause(_downstream_of_deny, (source, parent if parent != source else -1)))
    require(state.marks(ALLOW) == allow, rule, "no ALLOW vertex was painted DENY")
    return PassResult(painted > 0, {"painted": painted})


def add_clear_and_infer_to_allow_if_between_allow(state: Coloring) -> PassResult:
    """Clear and infer vertices on a path from an allow vertex to an allow vertex join ALLOW.

    Walk forward from allow vertices through processed, low-precision-capable,
    float32 clear/infer vertices that are not DENY; then backward from allow
    vertices through that set.  Reached both ways means between allow ops.
    """
    view = state.view
    lists = _u8(view.list_codes)
    roots = (_u8(state.marks(ALLOW)) != 0) & (lists == _ALLOW_LIST)
    allow_roots = _ids(roots)  # any order: see ``between``
    passable = ((lists == _CLEAR_LIST) | (lists == _INFER_LIST)) & (_u8(view.ok) != 0) \
        & (_u8(state.marks(DENY)) == 0) & ~roots
    downstream = _reached(view.fanout, allow_roots, bytearray(passable))
    # Which vertices the walks reach does not depend on the roots' order; the roots are ALLOW already.
    between = _ids((_u8(_reached(view.fanin, allow_roots, downstream)) != 0) & ~roots)
    # In the readable order reports were painted in.
    painted = state.paint_all(sorted(between, key=view.key), ALLOW, "add_clear_and_infer_to_allow_if_between_allow",
                              Cause(_between_allow))
    return PassResult(painted > 0, {"painted": painted})


def _fed_by_constants(view: TypeView, k: int) -> str:
    return f"{view.lst[k]} op {view.op_of(k)} reads only constants on its way to allow ops"


def add_constant_fed_to_allow_if_before_allow(state: Coloring) -> PassResult:
    """(onnxmp's, not TF's) Clear and infer vertices on a path from constants to an allow vertex
    join ALLOW: TF's "between allow ops", with an initializer as the other end.  An initializer
    is stored in low precision at no run-time cost, so such a path needs no Cast at either end
    (embeddings: Gather from a table, Add of the position embeddings, LayerNorm, then the first
    MatMuls).

    Walk forward from processed, low-precision-capable, float32 clear and infer vertices that are
    not DENY and read nothing but constants (initializers, Constant nodes), through such
    vertices; then backward from allow vertices through the set just found."""
    view = state.view
    lists = _u8(view.list_codes)
    passable = ((lists == _CLEAR_LIST) | (lists == _INFER_LIST)) & (_u8(view.ok) != 0) & (_u8(state.codes) == 0)
    constants, constant_at = view.constants, view.constant_at
    # Constants, and Casts or ConstantOfShape making float values from non-float ones (retargeted to
    # make the low type directly): both cost no Cast.
    sources = [k for k in _ids(passable) if
               (names := view.input_names(k)) and all(t in constants or t in constant_at for t in names)]
    sources += [k for k in view.retargetable if view.ok[k] and not state.codes[k]]
    if not sources:
        return PassResult(False, {"painted": 0})
    downstream = _reached(view.fanout, sources, bytearray(passable))
    allow_roots = _ids(_u8(state.marks(ALLOW)) != 0)
    reached = _u8(_reached(view.fanin, allow_roots, downstream)) != 0
    between = _ids(reached & passable)
    painted = state.paint_all(sorted(between, key=view.key), ALLOW, "add_constant_fed_to_allow_if_before_allow",
                              Cause(_fed_by_constants))
    return PassResult(painted > 0, {"painted": painted})


def add_infer_to_allow_if_follow_allow(state: Coloring) -> PassResult:
    """bfloat16 only (as in TF): in one sweep, an infer vertex with at least one ALLOW
    direct input and no DENY direct input becomes ALLOW."""
    view = state.view
    deny, allow = state.marks(DENY), state.marks(ALLOW)
    promote = []
    for k in _ids((_u8(view.list_codes) == _INFER_LIST) & (_u8(view.ok) != 0) & (_u8(deny) == 0) & (_u8(allow) == 0)):
        fanin = view.fanin[k]
        if any(deny[f] for f in fanin):
            continue
        allow_in = [f for f in fanin if allow[f]]
        if allow_in:
            promote.append((k, allow_in[0]))
    for k, src in promote:  # decided first, painted after: a single sweep, not a propagation
        state.paint(k, ALLOW, "add_infer_to_allow_if_follow_allow", Cause(_follows_allow, (src,)))
    return PassResult(bool(promote), {"painted": len(promote)})


def propagate_allow_through_clear(state: Coloring) -> PassResult:
    """Walk both ways from ALLOW vertices through processed, capable, float32 clear
    vertices that are not DENY; they join ALLOW.  Infer vertices are not crossed."""
    view = state.view
    enter = (_u8(view.list_codes) == _CLEAR_LIST) & (_u8(view.ok) != 0) & (_u8(state.codes) == 0)
    if not enter.any():
        return PassResult(False, {"painted": 0})
    # A root with no enterable neighbour reaches nothing: only the others are walked from, in
    # paint order (the first walk to reach a clear vertex names its cause).
    near = _next_to((view.fanin, view.fanout), enter)
    roots = [k for k in state.allow_ids() if near[k]]
    enter = bytearray(enter)
    origin: dict[int, int] = {}  # reached clear vertex -> the allow vertex its walk started from
    for k, parent in zip(*_dfs((view.fanin, view.fanout), roots, enter)):
        if parent >= 0:
            origin[k] = origin.get(parent, parent)
    painted = 0
    for k, root in origin.items():
        painted += state.paint(k, ALLOW, "propagate_allow_through_clear", Cause(_connected_to_allow, (root,)))
    return PassResult(painted > 0, {"painted": painted})


def remove_allow_set_with_fp32(state: Coloring) -> PassResult:
    """Remove from ALLOW any vertex whose schema or kernel cannot take the low-precision type."""
    incapable = _ids(_u8(state.marks(ALLOW)) > _u8(state.view.ok))
    for k in incapable:
        state.unpaint(k)
    return PassResult(len(incapable) > 0, {"removed": len(incapable)})


def force_color_match(state: Coloring) -> PassResult:
    """Tensors that must share a type end with one color.

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
    changed = False
    for node in view.control_flow:
        for k in range(view.node_first[node], view.node_first[node + 1]):
            if state.is_allow(k):
                op_type = view.v_kind[k].group.op.op_type
                state.paint(k, DENY, "force_color_match", f"{op_type} inputs and outputs follow their color groups")
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
                blocker = f"initial value `{tensor}` comes from deny {view.op_of(producer)}"
        if blocker is None:
            state.low_groups.append(group)
            changed = True
        else:
            state.group_notes[group.name] = blocker
    return PassResult(changed, {"low_groups": len(state.low_groups)})


def _fused_input(view: TypeView, k: int, producer: int) -> str:
    return (f"the normalization ORT fuses it into reads its input `{view.output_names(producer)[0]}` from allow "
            f"{view.op_of(producer)} `{view.node_of(producer)}`: one type in and out")


def _fused_scale(view: TypeView, k: int, affine: int) -> str:
    return (f"feeds a normalization ORT fuses into one kernel, whose scale {view.op_of(affine)} "
            f"`{view.node_of(affine)}` stays float32: one type in and out")


def _fused_float32_input(view: TypeView, k: int) -> str:
    return "the normalization ORT fuses it into reads a float32 input: one type in and out"


def _fused_shared_input(view: TypeView, k: int, reader: int) -> str:
    return (f"the normalization ORT fuses it into reads its input also read in float32 by {view.op_of(reader)} "
            f"`{view.node_of(reader)}`: onnxruntime merges the two float32 copies, and the fused kernel then reads "
            "the float32 one (one type in and out), so the normalization stays float32 and reads that copy")


def _other_float32_readers(view: TypeView, state: Coloring) -> dict[int, int]:
    """Unit index -> a float32 vertex, outside the unit, reading the unit's input and not ALLOW."""
    inputs = {unit.norm.input: i for i, unit in enumerate(view.fused)}
    inside = {name for unit in view.fused for name in (*unit.norm.statistics, *unit.norm.casts)}
    found: dict[int, int] = {}
    for k, ins in enumerate(view.node_ins):
        if inputs.keys().isdisjoint(ins) or view.node_names[k] in inside:
            continue
        for vid in range(view.node_first[k], view.node_first[k + 1]):
            if view.f32[vid] and not state.is_allow(vid):
                for t in view.input_names(vid):
                    if t in inputs:
                        found.setdefault(inputs[t], vid)
    return found


def follow_input_in_fused_normalizations(state: Coloring) -> PassResult:
    """(onnxmp's, not TF's) A subgraph ORT fuses into one LayerNormalization or RMSNorm kernel, which
    computes its statistics in float32 whatever type it reads, takes its input's precision: its
    scale and bias are ALLOW exactly when its input is produced in low precision.

    The fused kernel reads and writes one type: LayerNormalization-17 refuses a float16 input with
    a float32 scale (session creation fails), and a float32 input with a float16 scale likewise.
    When the scale or bias cannot go low (a data seed, a blocked node), the input's producer is
    kept float32 instead.  When a float32 reader outside the unit reads the input too, the unit
    stays float32 and reads the one float32 copy of the input that reader needs: onnxruntime
    (1.32) merges the statistics' own Cast with that copy, and its fusion then reads a float32
    input with a low scale, which it refuses; one Cast fewer besides."""
    view = state.view
    rule = "follow_input_in_fused_normalizations"
    changed = 0
    shared = _other_float32_readers(view, state) if view.fused else {}
    for i, unit in enumerate(view.fused):
        producer = view.producer_of.get(unit.norm.input)
        low = producer is not None and state.is_allow(producer) and unit.norm.input not in view.pinned
        if low and i in shared:
            for vid in unit.affine:
                changed += state.paint(vid, DENY, rule, Cause(_fused_shared_input, (shared[i],)))
            continue
        blocked = [vid for vid in unit.affine if not view.ok[vid] or
                   (state.is_deny(vid) and state.colors[vid][1].startswith("seed_"))]
        if low and blocked:
            changed += state.paint(producer, DENY, rule, Cause(_fused_scale, (blocked[0],)))
            low = False
        for vid in unit.affine:
            if low:
                changed += state.paint(vid, ALLOW, rule, Cause(_fused_input, (producer,)))
            elif state.is_allow(vid):
                changed += state.paint(vid, DENY, rule, Cause(_fused_float32_input))
    return PassResult(changed > 0, {"changed": changed})


def _low_input(view: TypeView, k: int) -> str:
    return (f"{view.op_of(k)}'s kernel computes in float32 and reads this input already in low precision: "
            f"a float32 copy would be a Cast and change nothing")


def take_low_inputs_of_float32_kernels(state: Coloring, computes_in_float32: Callable[[str], bool]) -> PassResult:
    """(onnxmp's, not TF's) An infer or clear vertex that only reads (its type parameter binds no
    output: X of SimplifiedLayerNormalization, whose output is V) joins ALLOW when every tensor it
    reads is written by an ALLOW vertex, another vertex of its node is ALLOW, and the kernel computes
    in float32 (``computes_in_float32(op)``, the kernel facts): the kernel widens a float16 input
    exactly, so keeping the parameter float32 only adds a Cast (Llama's embedding into its first
    RMSNorm).  Pinned tensors and constants stay as they are."""
    view = state.view
    lists, codes = _u8(view.list_codes), state.codes
    candidates = ((lists == _CLEAR_LIST) | (lists == _INFER_LIST)) & (_u8(view.ok) != 0) & (_u8(codes) == 0)
    painted = 0
    for k in _ids(candidates):
        if view.output_names(k):
            continue
        names = view.input_names(k)
        producers = [view.producer_of.get(t) for t in names]
        if not names or any(p is None or codes[p] != _ALLOW for p in producers) \
                or any(t in view.pinned for t in names):
            continue
        node = view.v_node[k]
        if not any(codes[v] == _ALLOW for v in view.ids_of_node(view.node_names[node]) if v != k):
            continue
        if computes_in_float32(view.op_of(k)):
            painted += state.paint(k, ALLOW, "take_low_inputs_of_float32_kernels", Cause(_low_input))
    return PassResult(painted > 0, {"painted": painted})


def make_casts_allow_if_all_outputs_allow(state: Coloring) -> PassResult:
    """An existing Cast(to=FLOAT), ConstantOfShape or float Constant whose consumers are
    all ALLOW is retargeted to the low-precision type (its output vertex joins ALLOW)."""
    view = state.view
    ok, codes, pinned, consumers_of = view.ok, state.codes, view.pinned, view.consumers_of
    painted = 0
    for k in view.retargetable:
        if not ok[k] or codes[k]:  # incapable, or painted already
            continue
        tensor, = view.output_names(k)
        if tensor in pinned:
            continue
        consumers = consumers_of.get(tensor, [])
        if consumers and all(codes[c] == _ALLOW for c in consumers):
            painted += state.paint(k, ALLOW, "make_casts_allow_if_all_outputs_allow",
                                   f"every consumer of `{tensor}` is ALLOW")
    return PassResult(painted > 0, {"painted": painted})
