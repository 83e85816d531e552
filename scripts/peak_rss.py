"""This process's peak resident set, for the benchmarks that measure each variant in a child process.

No dependencies: ``torch_step_time.py`` imports it in a scratch environment without onnxmp."""
from __future__ import annotations

import resource


def peak_rss_mib() -> float:
    """VmHWM, which starts afresh at exec.  Linux's ru_maxrss does not: a child reports at least its
    parent's peak at the fork (a benchmark's parent, which may hold every entry's models), so every
    variant read the same figure, growing from entry to entry.  ru_maxrss where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
