"""torch's optimizers, as settings: ``AdamW`` and ``SGD`` with ``torch.optim``'s arguments and defaults.

These objects only describe the update; :func:`onnxmp.training.update_graph.build_portable_optimizer`
writes it as a graph of standard ONNX ops that equals ``torch.optim.AdamW`` / ``torch.optim.SGD``
(``torch.optim``'s single-tensor path, the CPU default) step for step.  ``optimizer_named`` is the one
place that turns what a caller passes (an object, ``"adamw"``/``"sgd"``, or a manifest's entry) into
one of them.

Weight decay applies to every trainable parameter, as in torch, unless ``no_decay`` exempts it:
either substrings of parameter names (Hugging Face's idiom ``no_decay = ["bias", "LayerNorm.weight"]``:
a parameter is exempt when any of them occurs in its name) or a callable ``name -> bool`` (True:
exempt).  That is torch's two-param-group recipe (one group with ``weight_decay=0``) in one argument.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Sequence, Union

from onnxmp.errors import OnnxMPError

log = logging.getLogger("onnxmp.training.optimizer_settings")

NoDecay = Union[str, Sequence[str], Callable[[str], bool]]


@dataclass(frozen=True)
class _Optimizer:
    name: ClassVar[str]

    def exempt(self, parameter: str) -> bool:
        """Whether ``no_decay`` exempts ``parameter`` from weight decay."""
        rule = self.no_decay  # type: ignore[attr-defined]
        if callable(rule):
            return bool(rule(parameter))
        return any(pattern in parameter for pattern in rule)

    def decays(self, parameter: str) -> bool:
        return self.weight_decay != 0 and not self.exempt(parameter)  # type: ignore[attr-defined]

    def manifest_entry(self, parameters: Iterable[str], *, clip_global_norm: float | None = None) -> dict:
        """``manifest["optimizer"]``: name, hyperparameters (``no_decay`` resolved to the exempt
        parameters' names, so a callable survives), state slots."""
        parameters = list(parameters)
        exempt = [p for p in parameters if self.exempt(p)]
        if not callable(self.no_decay):  # type: ignore[attr-defined]
            unused = [s for s in self.no_decay if not any(s in p for p in parameters)]  # type: ignore[attr-defined]
            if unused:
                log.warning("no_decay pattern(s) %s match no trainable parameter", ", ".join(map(repr, unused)))
        hyper = {k: v for k, v in self._hyperparameters().items()}
        hyper["no_decay"] = exempt
        if clip_global_norm is not None:
            hyper["clip_global_norm"] = float(clip_global_norm)
        return {"name": self.name, "hyperparameters": hyper, "slots": list(self.slots)}

    def _hyperparameters(self) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class ByName:
    """``no_decay`` as exact parameter names (what a manifest records)."""

    names: frozenset

    def __call__(self, parameter: str) -> bool:
        return parameter in self.names


def _patterns(no_decay: NoDecay) -> NoDecay:
    if callable(no_decay):
        return no_decay
    patterns = (no_decay,) if isinstance(no_decay, str) else tuple(no_decay)
    if not all(isinstance(p, str) and p for p in patterns):
        raise OnnxMPError(f"no_decay must be non-empty strings or a callable, got {no_decay!r}",
                          'e.g. no_decay=("bias", "LayerNorm.weight")')
    return patterns


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise OnnxMPError(message, "torch.optim refuses it too")


@dataclass(frozen=True)
class AdamW(_Optimizer):
    """``torch.optim.AdamW``: decoupled weight decay (``p *= 1 - lr * weight_decay`` first), then Adam
    with torch's bias correction.  ``lr`` is the default learning rate (the trainer feeds the lr of
    each step); ``amsgrad`` keeps torch's ``max_exp_avg_sq``."""

    name: ClassVar[str] = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    amsgrad: bool = False
    maximize: bool = False
    no_decay: NoDecay = field(default=())

    def __post_init__(self):
        betas = tuple(float(b) for b in self.betas)
        _check(len(betas) == 2, f"betas must be two numbers, got {self.betas!r}")
        _check(0.0 <= self.lr, f"Invalid learning rate: {self.lr}")
        _check(0.0 <= self.eps, f"Invalid epsilon value: {self.eps}")
        _check(0.0 <= betas[0] < 1.0, f"Invalid beta parameter at index 0: {betas[0]}")
        _check(0.0 <= betas[1] < 1.0, f"Invalid beta parameter at index 1: {betas[1]}")
        _check(0.0 <= self.weight_decay, f"Invalid weight_decay value: {self.weight_decay}")
        object.__setattr__(self, "betas", betas)
        for key in ("lr", "eps", "weight_decay"):
            object.__setattr__(self, key, float(getattr(self, key)))
        object.__setattr__(self, "no_decay", _patterns(self.no_decay))

    @property
    def slots(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if self.amsgrad else ("exp_avg", "exp_avg_sq")

    def _hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay,
                "amsgrad": bool(self.amsgrad), "maximize": bool(self.maximize)}


@dataclass(frozen=True)
class SGD(_Optimizer):
    """``torch.optim.SGD``: coupled weight decay (``g += weight_decay * p``), momentum buffer that
    starts as the first step's gradient, dampening, Nesterov."""

    name: ClassVar[str] = "sgd"
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    no_decay: NoDecay = field(default=())

    def __post_init__(self):
        _check(0.0 <= self.lr, f"Invalid learning rate: {self.lr}")
        _check(0.0 <= self.momentum, f"Invalid momentum value: {self.momentum}")
        _check(0.0 <= self.weight_decay, f"Invalid weight_decay value: {self.weight_decay}")
        _check(not self.nesterov or (self.momentum > 0 and self.dampening == 0),
               "Nesterov momentum requires a momentum and zero dampening")
        for key in ("lr", "momentum", "dampening", "weight_decay"):
            object.__setattr__(self, key, float(getattr(self, key)))
        object.__setattr__(self, "no_decay", _patterns(self.no_decay))

    @property
    def slots(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def _hyperparameters(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": bool(self.nesterov), "maximize": bool(self.maximize)}


Optimizer = Union[AdamW, SGD]
CLASSES = {cls.name: cls for cls in (AdamW, SGD)}
OPTIMIZERS = tuple(CLASSES)


def optimizer_named(spec: Any) -> Optimizer:
    """The optimizer ``spec`` names: an ``AdamW``/``SGD`` object (itself), ``"adamw"``/``"sgd"``
    (torch's defaults), or a manifest's ``optimizer`` entry (its hyperparameters; the exempt
    parameters by exact name)."""
    if isinstance(spec, (AdamW, SGD)):
        return spec
    if isinstance(spec, str):
        if spec not in CLASSES:
            raise OnnxMPError(f"unknown optimizer {spec!r}",
                              f"use one of: {', '.join(OPTIMIZERS)}, or onnxmp.training.AdamW(...) / SGD(...)")
        return CLASSES[spec]()
    if isinstance(spec, dict) and spec.get("name") in CLASSES:
        hyper = dict(spec.get("hyperparameters", {}))
        hyper.pop("clip_global_norm", None)
        exempt = frozenset(hyper.pop("no_decay", ()))
        try:
            return CLASSES[spec["name"]](**hyper, no_decay=ByName(exempt))
        except TypeError as exc:
            raise OnnxMPError(f"the manifest's optimizer entry is not one onnxmp wrote: {exc}",
                              "rebuild the artifacts with this onnxmp") from None
    raise OnnxMPError(f"unsupported optimizer {spec!r}",
                      f"use one of: {', '.join(OPTIMIZERS)}, or onnxmp.training.AdamW(...) / SGD(...)")
