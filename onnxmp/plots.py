"""Plots of parity reports (matplotlib, imported only when plotting)."""
from __future__ import annotations

import importlib.util
import io
import logging
import math
import os

import numpy as np

from onnxmp.errors import OnnxMPError
from onnxmp.files import destination, write_bytes_atomic
from onnxmp.parity.validate import OutputParity, ParityReport

log = logging.getLogger("onnxmp.plots")


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise OnnxMPError("plotting needs matplotlib", "pip install matplotlib")


def plot_errors(report: ParityReport, path: str | os.PathLike) -> None:
    """Write one PNG with a histogram of |ref - cand| per output (log x axis)."""
    require_matplotlib()
    # The object API with the Agg canvas, not pyplot: no global backend
    # switch and no figure registry in the caller's process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    outputs = report.outputs or []
    cols = min(2, max(1, len(outputs)))
    rows = max(1, math.ceil(len(outputs) / cols))
    fig = Figure(figsize=(6.5 * cols, 3.6 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    for i, output in enumerate(outputs):
        _plot_output(fig.add_subplot(rows, cols, i + 1), output)
    if not outputs:
        fig.add_subplot(1, 1, 1).text(0.5, 0.5, "no outputs compared", ha="center", va="center")
    verdict = "PASSED" if report.passed else "FAILED"
    fig.suptitle(f"{verdict}: |reference - candidate| over {report.samples} sample(s)")

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    write_bytes_atomic(path, buffer.getvalue())
    log.info("wrote error histograms to %s", destination(path))


def _plot_output(ax, output: OutputParity) -> None:
    status = "ok" if output.passed else "FAIL"
    if output.exact:
        ax.set_title(f"{output.name} [{output.dtype}] {status}", fontsize=9)
        ax.text(0.5, 0.5, f"exact comparison: {output.mismatches} elements differ",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    metrics = []
    if output.max_abs_err is not None:
        metrics.append(f"max|err| {output.max_abs_err:.2e}")
    if output.max_rel_err is not None:
        metrics.append(f"rel {output.max_rel_err:.2e}")
    if output.cosine is not None:
        metrics.append(f"cos {output.cosine:.6f}")
    if output.top1 is not None:
        metrics.append(f"top-1 {100 * output.top1:.1f}%")
    ax.set_title(f"{output.name} {status}\n" + ", ".join(metrics), fontsize=9)

    hist = output.histogram
    counts = np.asarray(hist.counts)
    edges = np.asarray(hist.edges)
    used = np.flatnonzero(counts)
    notes = []
    if hist.zeros:
        notes.append(f"{hist.zeros} exact (err = 0)")
    if output.nonfinite_mismatches:
        notes.append(f"{output.nonfinite_mismatches} inf/NaN in one model only")
    if used.size:
        # Show only the decades that hold errors, so the bars are readable.
        lo, hi = used[0], used[-1] + 1
        ax.stairs(counts[lo:hi], edges[lo:hi + 1], fill=True, alpha=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("|reference - candidate|")
        ax.set_ylabel("elements")
    else:
        ax.set_axis_off()
        notes.append("no nonzero finite errors")
    if notes:
        ax.text(0.98, 0.95, "\n".join(notes), ha="right", va="top", transform=ax.transAxes, fontsize=8)
