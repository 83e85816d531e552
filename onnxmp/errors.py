"""The one exception type users see.

Every failure that is the user's input (a corrupt file, an op in two lists,
a model the verifier rejects) surfaces as :class:`OnnxMPError` with a hint,
never as a stack trace from deep inside onnx or onnxruntime.
"""
from __future__ import annotations

import re

# onnxruntime prefixes its reason with the C++ source location and signature:
# "/onnxruntime_src/onnxruntime/core/graph/model.cc:180 onnxruntime::Model::Model(onnx::ModelProto&&, ...) <reason>"
_ORT_LOCATION = re.compile(r"/onnxruntime_src/\S+:\d+ [\w:~<>]+\((?:[^()]|\([^()]*\))*\)\s*")


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


def first_line(exc: BaseException, limit: int = 400) -> str:
    """A third-party exception (onnx's checker, onnxruntime) as one line that keeps its reason.

    The checker spreads one sentence over several lines, and onnxruntime puts
    its C++ source location and signature in front of the reason: both are
    folded or dropped rather than cut at the first newline.
    """
    text = " ".join(_ORT_LOCATION.sub(" ", str(exc)).split())
    if not text:
        return type(exc).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"
