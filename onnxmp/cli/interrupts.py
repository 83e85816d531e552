"""SIGINT / SIGTERM during a long command: stop cleanly, and never in the middle of a save.

:func:`stop_on_signals` turns either signal into :class:`Interrupted` (raised where Python next
checks for signals: after the onnxruntime call in progress returns).  Inside
:func:`deferred` a signal waits for the end of the block, so that a state being renamed into
place is never cut in half (the atomic writer would keep the old one, but a rename of a folder
is two steps).  A second Ctrl-C while a save is deferred still waits: the save is short.
"""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal's number, as shells report


class Interrupted(KeyboardInterrupt):
    """The run was stopped by ``signum``; :attr:`exit_code` is what a shell expects (130, 143)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = EXIT_CODES.get(signum, 128 + signum)


_state = {"deferring": 0, "pending": None}


def _handler(signum, frame):
    if _state["deferring"]:
        _state["pending"] = signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Raise :class:`Interrupted` on SIGINT and SIGTERM inside the block (main thread only)."""
    previous = {}
    try:
        for signum in EXIT_CODES:
            previous[signum] = signal.signal(signum, _handler)
    except ValueError:  # not the main thread: leave the process's handlers alone
        previous = {}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _state["pending"] = None
        _state["deferring"] = 0


class Deferral:
    """A context whose signals, once :meth:`start` is called, wait for its end.

    ``with Deferral() as hold: ... hold.start() ...``: what runs after ``start()`` up to the end of
    the block (the exit of the contexts nested in it included: a folder renamed into place) is not
    cut by a signal; the signal is raised when the block ends, unless it ends with an error."""

    def __init__(self):
        self.started = False

    def start(self) -> None:
        if not self.started:
            self.started = True
            _state["deferring"] += 1

    def __enter__(self) -> "Deferral":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if not self.started:
            return
        self.started = False
        _state["deferring"] -= 1
        if not _state["deferring"] and _state["pending"] is not None:
            signum, _state["pending"] = _state["pending"], None
            if kind is None:
                raise Interrupted(signum)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A signal received inside the block is raised when it ends."""
    with Deferral() as hold:
        hold.start()
        yield
