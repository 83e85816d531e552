"""The one exception type users see.

Every failure that is the user's input (a corrupt file, an op in two lists,
a model the verifier rejects) surfaces as :class:`OnnxMPError` with a hint,
never as a stack trace from deep inside onnx or onnxruntime.
"""
from __future__ import annotations


class OnnxMPError(Exception):
    """A user-facing error: ``message`` says what is wrong, ``hint`` what to do."""

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message if not hint else f"{message}\n  hint: {hint}")

    def one_line(self) -> str:
        text = self.message.splitlines()[0] if self.message else "error"
        return text + (f" (hint: {self.hint})" if self.hint else "")


class UsageError(OnnxMPError):
    """A wrong command line (unknown flag or choice, missing argument, flags that need each other).

    The CLI exits with status 2 for it, 1 for any other error.  ``prog`` names the
    (sub)command whose arguments were wrong, when argparse found it.
    """

    def __init__(self, message: str, hint: str | None = None, prog: str | None = None):
        super().__init__(message, hint)
        self.prog = prog or "onnxmp"
