"""The search's progress bar."""
from __future__ import annotations

from onnxmp.calibrate.search import Probe


class RunBar:
    """tqdm over search runs, on a terminal only."""

    def __init__(self, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(desc=desc, unit="run", disable=None, leave=False)
        self.heavy: frozenset[str] = frozenset()  # the search's Conv/MatMul/Gemm candidates
        self.tolerance = 1.0

    def __call__(self, probe: Probe) -> None:
        share = (f", fp16 Conv/MatMul/Gemm {1 - len(probe.fp32 & self.heavy) / len(self.heavy):.0%}"
                 if self.heavy else "")
        error = "" if probe.passed else ">="  # a failing candidate stops at its first failing sample
        self.bar.set_postfix_str(f"fp32 {len(probe.fp32)}, error {error}{probe.score * self.tolerance:.3g}{share}")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
