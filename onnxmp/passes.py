"""One pass protocol, after onnx-ir's ``PassBase``/``PassManager``.

A pass has a name, a precondition (``requires``), the work (``call``) and a postcondition
(``ensures``); it returns a :class:`PassResult` saying whether it changed anything.  A
:class:`PassManager` runs a list of passes over one state, times and logs each the same way,
and names the pass in any error.  The conversion's stages (``onnxmp.convert``), TF's coloring
rules (``onnxmp.color``) and the training build (``onnxmp.training.build``) all run this way.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, TypeVar

from onnxmp.errors import OnnxMPError, first_line

State = TypeVar("State")


@dataclass
class PassResult:
    """``modified``: the pass changed the state.  ``stop``: nothing after it can change anything,
    so the manager runs no further pass (TF's AMP returns when no allow op can take fp16)."""

    modified: bool
    details: dict[str, Any] = field(default_factory=dict)
    stop: bool = False


class PassConditionError(OnnxMPError):
    """A pre- or postcondition failed: a bug in onnxmp or an unexpected graph."""


_BUG_HINT = "this is an onnxmp bug; please report it with the model (or `onnxmp explain --json`)"


def require(condition: bool, pass_name: str, what: str, hint: str | None = None) -> None:
    """Raise :class:`PassConditionError` naming ``pass_name`` unless ``condition`` holds."""
    if not condition:
        raise PassConditionError(f"{pass_name}: condition violated: {what}", hint=hint or _BUG_HINT)


class PassBase(Generic[State]):
    """A named step over a state.  Subclasses implement :meth:`call` and may check
    :meth:`requires` before it and :meth:`ensures` after it (with :meth:`check`)."""

    name: str = ""

    def requires(self, state: State) -> None:
        """The precondition; raises :class:`PassConditionError` when it fails."""

    def call(self, state: State) -> PassResult:
        raise NotImplementedError

    def ensures(self, state: State) -> None:
        """The postcondition; raises :class:`PassConditionError` when it fails."""

    def check(self, condition: bool, what: str) -> None:
        require(condition, self.name or type(self).__name__, what)

    def __call__(self, state: State) -> PassResult:
        self.requires(state)
        result = self.call(state)
        self.ensures(state)
        return result


class FunctionPass(PassBase[State]):
    """A pass made of a function ``fn(state, *args, **kwargs) -> PassResult``, named after it.

    TF's rules are such functions (one per rule, under TF's name, with the rule as docstring);
    ``requires``/``ensures`` are predicates on the state with the condition they state."""

    def __init__(self, fn: Callable[..., PassResult], *args, requires: tuple[Callable[[State], bool], str] | None = None,
                 ensures: tuple[Callable[[State], bool], str] | None = None, **kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.name = fn.__name__
        self.__doc__ = fn.__doc__
        self._requires, self._ensures = requires, ensures

    def requires(self, state: State) -> None:
        if self._requires is not None:
            self.check(self._requires[0](state), self._requires[1])

    def call(self, state: State) -> PassResult:
        return self.fn(state, *self.args, **self.kwargs)

    def ensures(self, state: State) -> None:
        if self._ensures is not None:
            self.check(self._ensures[0](state), self._ensures[1])


class PassManager(Generic[State]):
    """Runs ``passes`` in order over one state.

    Each pass is timed into ``timings`` (seconds by pass name, added up over runs) and logged at
    DEBUG with its details; ``on_pass(name)`` is called after each (a progress bar).  A pass
    raising anything but :class:`OnnxMPError` becomes one OnnxMPError naming the pass, with the
    original exception chained (shown under ``-v``).  The result is modified when any pass
    modified the state; its details hold each pass's result by name.
    """

    def __init__(self, passes: Iterable[PassBase[State]], *, log: logging.Logger | None = None,
                 timings: dict[str, float] | None = None, on_pass: Callable[[str], None] | None = None,
                 hint: str | None = None):
        self.passes = list(passes)
        self.log = log or logging.getLogger("onnxmp.passes")
        self.timings = timings if timings is not None else {}
        self.on_pass = on_pass
        self.hint = hint or _BUG_HINT

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def __call__(self, state: State) -> PassResult:
        results: dict[str, PassResult] = {}
        for p in self.passes:
            start = time.perf_counter()
            try:
                result = p(state)
            except OnnxMPError:
                raise
            except Exception as exc:  # keep deep stack traces away from users; -v shows the chain
                raise OnnxMPError(f"{p.name} failed: {type(exc).__name__}: {first_line(exc)}", hint=self.hint) \
                    from exc
            elapsed = time.perf_counter() - start
            self.timings[p.name] = self.timings.get(p.name, 0.0) + elapsed
            self.log.debug("%s: %s%s (%.3f s)", p.name, "modified" if result.modified else "unchanged",
                           f" {result.details}" if result.details else "", elapsed)
            results[p.name] = result
            if self.on_pass is not None:
                self.on_pass(p.name)
            if result.stop:
                break
        return PassResult(any(r.modified for r in results.values()), results)
