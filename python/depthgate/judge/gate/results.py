"""The gate's results: slice status, release verdict and every table of the report, as frozen rows.
Split out of the gate's run (``release``; issue #23: one job per module)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from depthgate.judge.gate.plan import GatePlan
from depthgate.judge.tables import FrameOf, JsonRow, clean_value

__all__ = [
    "METHOD_BOOTSTRAP",
    "CaseWorstPosition",
    "GateResult",
    "LengthWorstPosition",
    "OverallResult",
    "PositionShare",
    "SafetySummary",
    "SliceResult",
    "SliceStatus",
    "TriageCell",
    "Verdict",
    "non_inferiority_shown",
]

METHOD_BOOTSTRAP = "bootstrap-percentile"


class SliceStatus(str, enum.Enum):
    """Status of one (length, position) slice (section 2.10)."""

    PASS = "PASS"
    FAIL_NOT_SHOWN = "FAIL_NOT_SHOWN"
    FAIL_REGRESSION = "FAIL_REGRESSION"
    FAIL_FLOOR = "FAIL_FLOOR"
    INCONCLUSIVE = "INCONCLUSIVE"
    #: Never set by :func:`gate`: a failing slice driven by an arm's serving path, as the reports read it
    #: (:func:`depthgate.judge.health.with_system_wording`).
    FAIL_SYSTEM = "FAIL_SYSTEM"


class Verdict(str, enum.Enum):
    """The release verdict. The safety flag is reported beside it, never folded into it."""

    PASS = "PASS"
    FAIL = "FAIL"
    INCONCLUSIVE = "INCONCLUSIVE"


# --------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class SliceResult(JsonRow):
    """One row of the slice table. ``lower``/``upper`` are one-sided (1 - alpha) bounds on delta."""

    length: int
    position: str
    status: SliceStatus
    reason: str
    n_planned: int
    n_cases: int
    n_missing: int
    seeds: int
    acc_baseline: float | None
    acc_candidate: float | None
    delta: float | None
    lower: float | None
    upper: float | None
    method: str | None
    p_ni: float
    q_ni: float
    p_reg: float
    q_reg: float
    deff: float | None
    informative: int | None
    sd_diff: float | None
    floor_lb: float | None
    floor_lb_baseline: float | None
    floor_lb_naive: float | None
    floor_deff: float | None
    floor_n_eff: float | None
    replanned_n: int | None
    safety_baseline: int
    safety_candidate: int
    bootstrap_seed: int | None


def non_inferiority_shown(result: SliceResult, margin: float) -> bool:
    """The one rule for "non-inferiority shown" in every report: the slice was tested and its one-sided
    lower bound is above -M, exactly the NI condition of the slice status (PASS and FAIL_FLOOR have it;
    FAIL_NOT_SHOWN, FAIL_REGRESSION and INCONCLUSIVE do not). The BH q_NI is reported beside it for
    partial-release use; it never sets the mark, since an adjusted q can disagree with the slice's own
    test in both directions."""
    return (
        result.status is not SliceStatus.INCONCLUSIVE
        and result.lower is not None
        and math.isfinite(result.lower)
        and result.lower > -margin
    )


@dataclass(frozen=True)
class OverallResult(JsonRow):
    """NI on the per-case mean difference over all tested slices (section 2.6); never overrules."""

    n_cases: int
    n_slices: int
    delta: float
    lower: float
    upper: float
    p_ni: float
    non_inferior: bool
    method: str = METHOD_BOOTSTRAP


@dataclass(frozen=True)
class SafetySummary(JsonRow):
    """Forbidden-claim hits (section 2.8): any hit in any run sets ``flag``."""

    flag: bool
    hits_candidate: int
    hits_baseline: int
    runs_candidate: int
    runs_baseline: int
    upper_rate_candidate: float | None


@dataclass(frozen=True)
class LengthWorstPosition(JsonRow):
    """Worst-position statistics of one length over cases observed at every position (section 2.7)."""

    length: int
    n_positions: int
    n_cases: int
    worst_acc_baseline: float | None
    worst_acc_candidate: float | None
    worst_delta: float | None
    worst_lower: float | None
    worst_upper: float | None
    worst_p_ni: float | None
    worst_non_inferior: bool | None
    range_baseline: float | None
    range_candidate: float | None
    range_increase: float | None
    range_increase_upper: float | None
    fragile_share_baseline: float | None
    fragile_share_candidate: float | None
    slice_worst_position: str | None
    slice_worst_lower: float | None


@dataclass(frozen=True)
class CaseWorstPosition(JsonRow):
    """Per (case, length): worst-position accuracy, position range and the tied worst positions."""

    case_id: str
    length: int
    worst_acc_baseline: float
    worst_acc_candidate: float
    range_baseline: float
    range_candidate: float
    worst_positions_baseline: tuple[str, ...]
    worst_positions_candidate: tuple[str, ...]


@dataclass(frozen=True)
class PositionShare(JsonRow):
    """Share of complete cases whose worst position is ``position`` (k tied positions get 1/k each)."""

    length: int
    position: str
    n_cases: int
    share_baseline: float
    share_candidate: float


@dataclass(frozen=True)
class TriageCell(JsonRow):
    """A (case, length, position) cell to re-run with ``rerun_seeds`` fresh seeds (exploratory only)."""

    case_id: str
    length: int
    position: str
    seeds: int
    acc_baseline: float
    acc_candidate: float
    delta: float
    fisher_p: float
    slice_status: SliceStatus
    rerun_seeds: int


_TRIAGE_NOTE = (
    "exploratory: re-run the listed cells with fresh seeds, apply Holm over the confirmations; the worst "
    "observed cells are biased downward (winner's curse)"
)


@dataclass(frozen=True)
class GateResult:
    """The gate's output: release verdict, safety flag and every table of the report."""

    verdict: Verdict
    safety_flag: bool
    reasons: tuple[str, ...]
    slice_results: tuple[SliceResult, ...]
    overall: OverallResult | None
    safety: SafetySummary
    worst_by_length: tuple[LengthWorstPosition, ...]
    worst_cases: tuple[CaseWorstPosition, ...]
    worst_shares: tuple[PositionShare, ...]
    triage: tuple[TriageCell, ...]
    plan: GatePlan = field(default_factory=GatePlan)

    #: How to read the triage table (a constant: the report takes it from here, not from ``to_dict``,
    #: which converts every worst-case row, 20K of them at 10^6 runs).
    triage_note = _TRIAGE_NOTE

    slices = FrameOf(
        "slice_results",
        SliceResult,
        "The slice table as a polars frame (one row per pre-registered or observed slice).",
    )
    worst_cases_frame = FrameOf("worst_cases", CaseWorstPosition)
    worst_shares_frame = FrameOf("worst_shares", PositionShare)
    triage_frame = FrameOf("triage", TriageCell)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: enums as strings, non-finite floats as None."""
        return {
            "verdict": self.verdict.value,
            "safety_flag": self.safety_flag,
            "reasons": list(self.reasons),
            "plan": clean_value(self.plan.to_dict()),
            "overall": None if self.overall is None else self.overall.to_dict(),
            "safety": self.safety.to_dict(),
            "slices": [s.to_dict() for s in self.slice_results],
            "worst_by_length": [w.to_dict() for w in self.worst_by_length],
            "worst_cases": [w.to_dict() for w in self.worst_cases],
            "worst_shares": [w.to_dict() for w in self.worst_shares],
            "triage": [t.to_dict() for t in self.triage],
            "triage_note": _TRIAGE_NOTE,
        }
