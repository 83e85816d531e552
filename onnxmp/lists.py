"""The four op lists of TensorFlow's AMP (allow / infer / deny / clear), for ONNX.

Defaults are per (target, precision); users adjust them through the API (``lists=``),
the CLI (``--allow-add`` ...) and environment variables modelled on TF's
(``ONNXMP_ALLOWLIST_ADD`` ...); see ``docs/coloring.md``.  Ops outside the default ONNX
domain are written ``domain:OpType`` (for example ``com.microsoft:Attention``);
``com.microsoft.Attention`` means the same (op types have no dots).

An op name in an override that names no ai.onnx op is an error with a close-match
hint (``matmul`` -> ``MatMul``): it would silently match nothing.  Names with a
domain other than ai.onnx are taken as given, since custom domains cannot be known.
"""
from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from onnxmp import targets
from onnxmp.domains import is_onnx_domain
from onnxmp.errors import OnnxMPError
from onnxmp.precision import low_precision

LIST_NAMES = ("allow", "infer", "deny", "clear")
LEVELS = ("default", "tensor_cores_only", "treat_infer_as_deny", "unsafe_force_all")

_MS = "com.microsoft:"

# Tensor Core work: always worth running in low precision where a kernel exists.
_ALLOW = {
    "Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "LSTM", "GRU", "RNN",
    _MS + "Attention", _MS + "MultiHeadAttention", _MS + "FusedMatMul",
    _MS + "GroupQueryAttention", _MS + "PackedAttention", _MS + "PackedMultiHeadAttention",
    _MS + "MatMulNBits", _MS + "DecoderMaskedMultiHeadAttention",
    # the transformer optimizer's channels-last Conv (UNet, enable_nhwc_conv): a Conv on Tensor Cores
    _MS + "NhwcConv",
}
# Numerically safe in low precision, but only worth it between allow ops.
_INFER = {
    "Add", "Sub", "Mul", "Div", "Sum", "Mean",
    "Sigmoid", "HardSigmoid", "Tanh", "Erf", "Gelu", "Elu", "Selu", "LeakyRelu", "PRelu",
    "Softplus", "Softsign", "HardSwish", "Mish", "Celu", "ThresholdedRelu",
    "BatchNormalization", "InstanceNormalization", "LayerNormalization", "GroupNormalization",
    "Softmax", "LogSoftmax", "Log", "Sqrt", "Reciprocal",
    "AveragePool", "GlobalAveragePool", "LpPool",
    _MS + "BiasGelu", _MS + "FastGelu", _MS + "SkipLayerNormalization",
    # onnxruntime's transformer optimizer's other fusions: their kernels compute their
    # statistics (norms) or activations from each element, and the kernel facts
    # (onnxmp/kernels.py) decide per target and onnxruntime version whether a low kernel exists.
    _MS + "SkipSimplifiedLayerNormalization", _MS + "EmbedLayerNormalization", _MS + "BiasSplitGelu",
    _MS + "BiasAdd", _MS + "QuickGelu", _MS + "RotaryEmbedding", _MS + "GroupNorm", _MS + "Gelu",
    _MS + "SkipGroupNorm", "SimplifiedLayerNormalization",
}
# Range or accumulation makes fp16 unsafe; they also taint downstream infer/clear ops.
_LOSSES = {"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"}
_RANDOM = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial"}
_DENY = {
    "Exp", "Pow", "CumSum", "Range",
    "ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceProd",
} | _LOSSES | _RANDOM
# Numerically neutral: they follow their neighbours.
_CLEAR = {
    "Relu", "Identity", "Dropout",
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice",
    "Expand", "Tile", "Pad", "DepthToSpace", "SpaceToDepth", "ReverseSequence", "Trilu",
    "Gather", "GatherElements", "GatherND", "Compress", "Where", "TopK", "ArgMax", "ArgMin",
    "MaxPool", "GlobalMaxPool", "Max", "Min", "Clip",
    "Abs", "Neg", "Sign", "Ceil", "Floor", "Round",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "IsNaN", "IsInf",
    "Resize", "Upsample", "Shape", "Size",
}

# What unsafe_force_all still keeps out of low precision (TF's levels; docs/coloring.md).
NEVER_FORCED = {"Constant"} | _LOSSES | _RANDOM


# bfloat16 keeps float32's exponent range but only 8 bits of mantissa: ops denied in
# fp16 for *range* alone (x**2 of a LayerNorm variance overflows 65504) are safe,
# while ops denied for *precision* (Exp amplifies relative error by |x|, reductions
# accumulate) stay denied.
_BF16_RANGE_ONLY = {"Pow"}


def default_lists(target: str = "cuda", precision: str = "float16") -> dict[str, set[str]]:
    """Default lists for ``target``/``precision``.

    bfloat16 moves the range-only denials (:data:`_BF16_RANGE_ONLY`) to infer; the
    kernel table then decides what really runs.  The CPU target uses the same lists
    gated by the CPU EP's kernels: ORT CPU has almost no fp16 compute kernels, so
    on the CPU only emulation (``onnxmp emulate``) is meaningful.
    """
    targets.target(target)
    low_precision(precision)
    lists = {"allow": set(_ALLOW), "infer": set(_INFER), "deny": set(_DENY), "clear": set(_CLEAR)}
    if precision == "bfloat16":
        lists["deny"] -= _BF16_RANGE_ONLY
        lists["infer"] |= _BF16_RANGE_ONLY
    return lists


def _check_choice(what: str, value: str, choices: Iterable[str]) -> None:
    if value not in choices:
        raise OnnxMPError(f"unknown {what} {value!r}", hint=f"choose one of: {', '.join(choices)}")


@dataclass
class ListOverrides:
    """Adds and removes per list; adds are applied before removes, as in TF."""

    add: dict[str, set[str]] = field(default_factory=lambda: {n: set() for n in LIST_NAMES})
    remove: dict[str, set[str]] = field(default_factory=lambda: {n: set() for n in LIST_NAMES})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ListOverrides":
        environ = os.environ if environ is None else environ
        out = cls()
        for name in LIST_NAMES:
            for action, target in (("ADD", out.add), ("REMOVE", out.remove)):
                variable = f"ONNXMP_{name.upper()}LIST_{action}"
                raw = environ.get(variable, "")
                target[name].update(checked_op(op.strip(), variable) for op in raw.split(",") if op.strip())
        return out

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Iterable[str]] | None) -> "ListOverrides":
        """``{"allow_add": [...], "deny_remove": [...]}`` or ``{"allow": [...]}`` (= add)."""
        out = cls()
        for key, ops in (spec or {}).items():
            if isinstance(ops, str):
                ops = [ops]
            name, _, action = key.partition("_")
            action = action or "add"
            if name not in LIST_NAMES or action not in ("add", "remove"):
                raise OnnxMPError(
                    f"unknown list override {key!r}",
                    hint="use keys like 'allow_add', 'deny_remove' (lists: allow, infer, deny, clear)",
                )
            where = f"{key} (--{name}-{action})"
            (out.add if action == "add" else out.remove)[name].update(checked_op(op, where) for op in ops)
        return out


@functools.lru_cache(maxsize=1)
def _known_ops() -> tuple[frozenset[str], dict[str, str]]:
    """ai.onnx op types (onnx's schemas, all opsets, and ORT's kernel table, which still has a few
    removed experimental ops); and for suggestions, other domains' op type -> ``domain:OpType``."""
    import onnx.defs

    from onnxmp.kernels import KernelTable

    plain: set[str] = set()
    qualified: dict[str, str] = {}
    named = [(schema.domain, schema.name) for schema in onnx.defs.get_all_schemas_with_history()]
    named += [(domain, op) for domain, ops in KernelTable.default().op_names().items() for op in ops]
    for domain, op in named:
        if is_onnx_domain(domain):
            plain.add(op)
        else:
            qualified.setdefault(op, f"{domain}:{op}")
    return frozenset(plain), qualified


def _split(op: str) -> tuple[str, str]:
    """``domain:OpType`` or ``domain.OpType`` -> (domain, OpType); a bare name has domain ""."""
    domain, sep, op_type = op.rpartition(":")
    if not sep and "." in op:
        domain, _, op_type = op.rpartition(".")
    return domain, op_type


def checked_op(op: str, where: str) -> str:
    """``op`` as a lists key (``OpType`` or ``domain:OpType``); OnnxMPError naming ``where``
    when it is no ai.onnx op, with the closest names as the hint."""
    domain, op_type = _split(op)
    if not is_onnx_domain(domain):
        return f"{domain}:{op_type}"  # a custom domain: nothing to check against
    if is_onnx_op(op_type):
        return op_type
    raise unknown_op(op, where)


def is_onnx_op(op_type: str) -> bool:
    return op_type in _known_ops()[0]


def is_known_op_type(op_type: str) -> bool:
    """An op type of ai.onnx or of a domain onnx or onnxruntime knows (ai.onnx.ml, com.microsoft...)."""
    plain, qualified = _known_ops()
    return op_type in plain or op_type in qualified


def unknown_op(op: str, where: str) -> OnnxMPError:
    """The error for an op name that names nothing, with the closest known names as the hint."""
    plain, qualified = _known_ops()
    op_type = _split(op)[1]
    by_lower = {name.lower(): name for name in plain}
    key = op_type.lower()
    if key in by_lower:
        guesses = [by_lower[key]]
    elif op_type in qualified:
        guesses = [qualified[op_type]]
    else:
        prefixed = sorted((n for k, n in by_lower.items() if len(key) >= 4 and k.startswith(key)), key=len)
        close = [by_lower[m] for m in difflib.get_close_matches(key, by_lower, n=3, cutoff=0.7)]
        guesses = list(dict.fromkeys(prefixed[:2] + close))[:3]
    hint = (f"did you mean {' or '.join(repr(g) for g in guesses)}?" if guesses else
            "op types are case-sensitive ai.onnx names (MatMul, LayerNormalization); "
            "write ops of other domains as domain:OpType")
    return OnnxMPError(f"unknown op {op!r} in {where}", hint=hint)


def resolve_lists(
    target: str = "cuda",
    precision: str = "float16",
    level: str = "default",
    lists: Mapping[str, Iterable[str]] | ListOverrides | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, frozenset[str]]:
    """Defaults, then environment overrides, then API overrides, then the level.

    An op left in two lists is an error: TF's behaviour for such a clash would
    depend on pass order, which a user cannot see.
    """
    _check_choice("level", level, LEVELS)
    result = default_lists(target, precision)
    api = lists if isinstance(lists, ListOverrides) else ListOverrides.from_mapping(lists)
    added: dict[str, set[str]] = {name: set() for name in LIST_NAMES}
    for overrides in (ListOverrides.from_env(environ), api):
        for name in LIST_NAMES:
            result[name] |= overrides.add[name]
            added[name] |= overrides.add[name]
        for name in LIST_NAMES:
            result[name] -= overrides.remove[name]
    _check_disjoint(result, added)
    return {name: frozenset(ops) for name, ops in apply_level(result, level).items()}


def _check_disjoint(result: Mapping[str, set[str]], added: Mapping[str, set[str]]) -> None:
    for i, a in enumerate(LIST_NAMES):
        for b in LIST_NAMES[i + 1:]:
            both = sorted(result[a] & result[b])
            if both:
                op = both[0]
                # Point at the list the user did not add it to: `--deny-add MatMul` means "take it out of allow".
                other = a if op in added[b] and op not in added[a] else b
                raise OnnxMPError(
                    f"op {op} is in both the {a} and the {b} list",
                    hint=f"remove it from one, e.g. --{other}-remove {op} "
                    f"(or ONNXMP_{other.upper()}LIST_REMOVE={op})",
                )


def apply_level(result: Mapping[str, set[str]], level: str) -> dict[str, set[str]]:
    """TF's levels reshape the lists, exactly as TF's AMP does (docs/coloring.md)."""
    allow, infer, deny, clear = (set(result[n]) for n in LIST_NAMES)
    if level == "tensor_cores_only":
        infer, deny, clear = set(), set(), set()
    elif level == "treat_infer_as_deny":
        deny |= infer
        infer = set()
    elif level == "unsafe_force_all":
        allow = (allow | infer | deny | clear) - NEVER_FORCED
        deny = deny & NEVER_FORCED
        infer, clear = set(), set()
    return {"allow": allow, "infer": infer, "deny": deny, "clear": clear}


def list_of(op_key: str, lists: Mapping[str, frozenset[str]]) -> str | None:
    """Which list ``op_key`` (``OpType`` or ``domain:OpType``) is on, if any."""
    for name in LIST_NAMES:
        if op_key in lists[name]:
            return name
    return None

