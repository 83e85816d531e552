"""The calibration report: what the accuracy-guided search measured, moved and why."""
from __future__ import annotations

from dataclasses import dataclass, field

from onnxmp.calibrate.islands import HeavyCheck
from onnxmp.calibrate.release import ReleaseRecord
from onnxmp.report import head

SUMMARY_ROWS = 10


@dataclass
class Measurement:
    """Errors of one real converted model (emulated), per output, in the metric's units."""

    tune: dict[str, float]
    holdout: dict[str, float] | None  # None without held-out samples

    @property
    def tune_error(self) -> float:
        return max(self.tune.values(), default=0.0)

    @property
    def holdout_error(self) -> float | None:
        return None if self.holdout is None else max(self.holdout.values(), default=0.0)

    @property
    def worst(self) -> float:
        return max(self.tune_error, self.holdout_error or 0.0)

    def meets(self, tolerance: float) -> bool:
        return self.worst <= tolerance


@dataclass
class SeededTensor:
    tensor: str
    observed_max: float


@dataclass
class MovedNode:
    """A node the search returned to float32, and the measurement that says why."""

    node: str
    op: str
    reason: str  # one of REASONS
    error_with: float | None  # tuning error with this node low and the rest of the set in fp32
    error_without: float | None  # tuning error with the whole set in fp32

    def describe(self) -> str:
        if self.error_with is not None:
            return (f"{self.node} ({self.op}): measured: error {self.error_with:.3g} with this node in low "
                    f"precision, {self.error_without:.3g} in fp32")
        after = "" if self.error_without is None else f" (error {self.error_without:.3g} with the set in fp32)"
        return f"{self.node} ({self.op}): {REASONS[self.reason]}{after}"


REASONS = {
    "measurement": "bisection over the attribution ranking: needed for the tolerance",
    "ranking prefix": "in the smallest passing prefix of the sensitivity ranking (error spread over many nodes)",
    "budget exhausted": "in the best passing candidate seen before the run budget ran out",
    "all-float32 fallback": "the search could not land; every remaining node went back to fp32",
    "fewer casts": "every low-precision neighbour is in fp32: joining the island saves its Casts",
    "follows its reader": "a Constant read only by a node moved to fp32 (one switch for both in the search)",
}


@dataclass
class CycleRecord:
    cycle: int
    fp32_nodes: int  # nodes the search has moved so far
    measurement: Measurement
    best_error: float  # worst error of the best model so far (never grows)
    tuning_tolerance: float


@dataclass
class CalibrationReport:
    tolerance: float
    metric: dict[str, str]
    threshold: float
    samples: int
    tune_samples: int
    holdout_samples: int
    met: bool = False
    plain: Measurement | None = None
    final: Measurement | None = None
    candidates: int = 0  # low-precision nodes after plain conversion (N of the run bound)
    seeded: list[SeededTensor] = field(default_factory=list)
    moved: list[MovedNode] = field(default_factory=list)
    cycles: list[CycleRecord] = field(default_factory=list)
    runs: int = 0
    seconds: float = 0.0
    budget_exhausted: bool = False
    heavy_check: HeavyCheck | None = None  # the exhaustive pass over the set's Conv/MatMul/Gemm (last cycle)
    release: ReleaseRecord | None = None  # the release and its proof: over the landed model, else the last cycle
    share_plain: float | None = None
    share_final: float | None = None
    share_all_plain: float | None = None  # low-precision share of every non-Constant node
    share_all_final: float | None = None
    casts_plain: int | None = None  # Cast nodes the conversion added (main graph)
    casts_final: int | None = None
    fallback: str | None = None  # why the all-float32 fallback was taken, in numbers (None: it was not)
    # Why the held-out samples joined the search's samples, in numbers (None: they never did, and the
    # held-out error is an independent check)
    holdout_joined: str | None = None

    @property
    def error(self) -> float:
        return self.final.worst if self.final else 0.0

    def summary_lines(self, precision: str = "float16") -> list[str]:
        held = f" + {self.holdout_samples} held-out" if self.holdout_samples else " (no held-out sample)"
        metrics = sorted(set(self.metric.values()))
        lines = [f"calibration: {self.tune_samples} tuning{held} sample(s), metric {', '.join(metrics)}, "
                 f"tolerance {self.tolerance:g}: {'MET' if self.met else 'MISSED'}"]
        if self.plain and self.final:
            line = f"  error: plain {self.plain.tune_error:.3g} -> calibrated {self.final.tune_error:.3g} (tuning)"
            if self.final.holdout is not None:
                line += f"; {self.plain.holdout_error:.3g} -> {self.final.holdout_error:.3g} (held-out)"
            lines.append(line)
            if not self.met:
                lines.append(f"  best error {self.error:.3g} is {self.error - self.tolerance:.3g} above the "
                             f"tolerance ({self.error / self.tolerance:.3g}x)")
        if self.holdout_joined:
            lines.append(f"  held-out samples joined the search: {self.holdout_joined}")
        if self.fallback:
            lines.append(f"  all-float32 fallback: {self.fallback}")
        if self.share_final is not None:
            before = f"{self.share_plain:.0%} -> " if self.share_plain is not None else ""
            lines.append(f"  {precision} share of Conv/MatMul/Gemm: {before}{self.share_final:.0%}")
        if self.cycles or self.budget_exhausted:
            lines.append(f"  search: {self.runs} emulated run(s) over {self.candidates} low-precision node(s), "
                         f"{len(self.cycles)} cycle(s), {self.seconds:.1f} s"
                         + (" (run budget exhausted)" if self.budget_exhausted else ""))
        else:
            lines.append(f"  no search needed: {self.runs} emulated run(s), {self.seconds:.1f} s")
        if self.heavy_check is not None and self.heavy_check.members:
            c = self.heavy_check
            if c.exhaustive:
                lines.append(f"  Conv/MatMul/Gemm the search needed in fp32: {c.kept_fp32} of the {c.members} its "
                             f"bisection named (exhaustive over them, {c.candidates_run} run(s))")
        if self.release is not None:
            lines += self.release.summary_lines(precision, self.tolerance, SUMMARY_ROWS)
        if self.share_all_final is not None:
            before = f"{self.share_all_plain:.0%} -> " if self.share_all_plain is not None else ""
            lines.append(f"  {precision} share of all nodes: {before}{self.share_all_final:.0%}; Casts added: "
                         + (f"{self.casts_plain} -> " if self.casts_plain is not None else "") + f"{self.casts_final}")
        lines += _capped([f"  seeded fp32: `{s.tensor}` reached {s.observed_max:.3g}" for s in self.seeded])
        lines += self.moved_table(precision)
        return lines

    def moved_table(self, precision: str = "float16") -> list[str]:
        """One row per node moved to fp32: the error with it in low precision, in fp32, and what it bought
        back (the first minus the second; blank where no single-node measurement was made)."""
        if not self.moved:
            return []
        followers = [m for m in self.moved if m.reason == "follows its reader"]
        rows = [(m.node, m.op, _num(m.error_with), _num(m.error_without),
                 _num(None if m.error_with is None or m.error_without is None else m.error_with - m.error_without),
                 m.reason) for m in self.moved if m.reason != "follows its reader"]
        if not rows:
            rows = [(m.node, m.op, "", "", "", m.reason) for m in followers]
            followers = []
        header = ("moved to fp32", "op", f"error in {precision}", "error in fp32", "bought back", "why")
        shown, rest = head(rows, SUMMARY_ROWS)
        widths = [max(len(str(r[i])) for r in [header, *shown]) for i in range(len(header))]
        fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*r).rstrip() for r in [header, ["-" * w for w in widths], *shown]]
        if followers:
            lines.append(f"  + {len(followers)} Constant(s) read only by those nodes, in fp32 with them")
        lines += [f"  why: {reason} = {REASONS[reason]}" for reason in dict.fromkeys(m.reason for m in self.moved)]
        return [*lines, f"  {rest} (see --report JSON)"] if rest else lines


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _capped(lines: list[str]) -> list[str]:
    shown, rest = head(lines, SUMMARY_ROWS)
    return [*shown, f"  {rest} (see --report JSON)"] if rest else list(shown)
