"""The release gate of a sequential run (issue #26): replay the pre-registered looks on what has
landed, then the verdict.

A look k holds the first ``counts[k]`` cases of the run's frozen case order (every seed, both arms) of
every slice still open. The replay is deterministic (same records, same bootstrap seeds: the same
decisions in every process), so the runner, a resume and ``depthgate gate`` all see one history:

* a slice whose look-k lower bound, at the look's nominal level, is > -M is decided PASS at look k;
* a slice whose regression q (BY/Holm over every planned slice, decided slices at p = 1) is <= the
  look's regression level (:func:`depthgate.judge.sequential.regression_levels`, tested first) is
  decided FAIL_REGRESSION at look k;
* a decided slice gets no more cases. The final look is the gate itself (:func:`gate`) at the last
  nominal level on every slice still open, its regressions confirmed at the last regression level;
  the rows of slices decided earlier are their look's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from depthgate.judge.gate.plan import GatePlan, stable_seed
from depthgate.judge.gate.release import gate, release_verdict
from depthgate.judge.gate.results import GateResult, SliceResult, SliceStatus
from depthgate.judge.sequential import (
    DEFAULT_BOUNDARY,
    cases_at_looks,
    look_fractions,
    look_outcome,
    nominal_levels,
    regression_levels,
    regression_q,
    slice_decision,
)
from depthgate.judge.tables import BASELINE, CANDIDATE, RUN_SCORE

__all__ = ["LookRecord", "SequentialDesign", "replay_looks", "sequential_gate"]


@dataclass(frozen=True)
class SequentialDesign:
    """The frozen sequential part of a plan, resolved against the planned case count: per look its
    cases, its non-inferiority level and its regression level (issue #36: a spending of its own, so a
    slice losing badly is confirmed before futility closes it)."""

    boundary: str
    fractions: tuple[float, ...]
    counts: tuple[int, ...]
    levels: tuple[float, ...]
    regression_levels: tuple[float, ...]

    @classmethod
    def of(
        cls,
        n_cases: int,
        alpha: float,
        *,
        looks: Sequence[float] | None,
        every: int | None,
        boundary: str | None,
    ) -> SequentialDesign:
        fractions = look_fractions(looks, every, n_cases)
        counts = cases_at_looks(fractions, n_cases)
        # The information fraction of each look is its share of cases (ceil may move it a little).
        actual = tuple(c / n_cases for c in counts)
        name = boundary or DEFAULT_BOUNDARY
        levels = nominal_levels(actual, alpha, name)
        return cls(name, actual, counts, levels, regression_levels(actual, alpha, name))

    def to_dict(self) -> dict[str, Any]:
        return {
            "boundary": self.boundary,
            "fractions": list(self.fractions),
            "cases": list(self.counts),
            "levels": list(self.levels),
            "regression_levels": list(self.regression_levels),
        }


@dataclass(frozen=True)
class LookRecord:
    """One look: its number (1-based), cases, level, and per slice what it decided."""

    look: int
    cases: int
    level: float
    slices: tuple[dict[str, Any], ...]
    regression_level: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "look": self.look,
            "cases": self.cases,
            "level": self.level,
            "regression_level": self.regression_level,
            "slices": list(self.slices),
        }


def _arrays(
    paired: pl.DataFrame, length: int, position: str, cases: Sequence[str], seeds: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, int]:
    """(baseline, candidate) (cases, seeds) arrays of one slice in case order, NaN where a run is
    missing or unpaired; a case with fewer than ceil(R/2) valid paired seeds is dropped. Also the
    number of the look's planned runs that have no record yet."""
    part = paired.filter((pl.col("length") == length) & (pl.col("position") == position))
    row_of = {c: i for i, c in enumerate(cases)}
    col_of = {int(s): j for j, s in enumerate(seeds)}
    yb = np.full((len(cases), len(seeds)), np.nan)
    yc = np.full((len(cases), len(seeds)), np.nan)
    present = 0
    for case, seed, b, c, has_b, has_c in part.select(
        "case_id", "seed", "yb", "yc", "has_b", "has_c"
    ).iter_rows():
        i, j = row_of.get(case), col_of.get(int(seed))
        if i is None or j is None:
            continue
        present += int(bool(has_b)) + int(bool(has_c))
        if b is not None and c is not None:
            yb[i, j], yc[i, j] = b, c
    valid = np.sum(~np.isnan(yb), axis=1) >= math.ceil(len(seeds) / 2)
    return yb[valid], yc[valid], 2 * len(cases) * len(seeds) - present


def _paired(scored: pl.DataFrame) -> pl.DataFrame:
    sides = []
    for arm, suffix in ((BASELINE, "b"), (CANDIDATE, "c")):
        sides.append(
            scored.filter(pl.col("arm") == arm).select(
                "case_id",
                "length",
                "position",
                "seed",
                RUN_SCORE.alias(f"y{suffix}"),
                pl.lit(True).alias(f"has_{suffix}"),
            )
        )
    key = ["case_id", "length", "position", "seed"]
    return (
        sides[0]
        .join(sides[1], on=key, how="full", coalesce=True)
        .with_columns(pl.col("has_b").fill_null(False), pl.col("has_c").fill_null(False))
    )


def replay_looks(
    scored: pl.DataFrame,
    plan: GatePlan,
    design: SequentialDesign,
    case_order: Sequence[str],
    *,
    cases_of: dict[tuple[int, str], Sequence[str]] | None = None,
) -> tuple[list[LookRecord], dict[tuple[int, str], tuple[int, str]]]:
    """The looks that have landed, in order, and the decided slices: {slice: (look, decision)}.

    Stops at the first look whose runs have not all landed (a run killed mid-look: that look is taken
    when the resumed run has sent the rest) or at the final look (the gate's own). ``cases_of``: a
    slice's planned cases when not every case is (spaced slices), in the case order."""
    if plan.planned_slices is None or plan.planned_seeds is None:
        raise ValueError("a sequential gate needs the planned slices and seeds")
    slices = list(dict.fromkeys(plan.planned_slices))
    seeds = list(plan.planned_seeds)
    paired = _paired(scored)
    decided: dict[tuple[int, str], tuple[int, str]] = {}
    history: list[LookRecord] = []
    looks = zip(design.counts[:-1], design.levels[:-1], design.regression_levels[:-1], strict=True)
    for k, (count, level, reg_level) in enumerate(looks):
        look_cases = list(case_order[:count])
        open_slices = [s for s in slices if s not in decided]
        decisions: dict[tuple[int, str], Any] = {}
        complete = True
        for length, position in open_slices:
            planned = cases_of.get((length, position), case_order) if cases_of else case_order
            cases = [c for c in look_cases if c in set(planned)]
            yb, yc, lacking = _arrays(paired, length, position, cases, seeds)
            if lacking:
                complete = False
                break
            if yb.shape[0] < 2:
                continue
            decisions[(length, position)] = slice_decision(
                yb,
                yc,
                plan.margin,
                level,
                plan.bootstrap_resamples,
                stable_seed(plan.bootstrap_seed, "look", k + 1, length, position),
                boundary=design.boundary,
                seeds_planned=len(seeds),
            )
        if not complete:
            break
        p_reg = [decisions[s].p_reg if s in decisions else 1.0 for s in slices]
        q = regression_q(p_reg, reg_level, plan.regression_method)
        rows = []
        for i, s in enumerate(slices):
            if s not in decisions:
                continue
            dec = decisions[s]
            shown = dec.decision == "PASS"
            what = look_outcome(q[i], level, shown, dec.p_reg, plan.alpha, regression_level=reg_level)
            if what is not None:
                decided[s] = (k + 1, what)
            rows.append(
                {
                    "length": s[0],
                    "position": s[1],
                    "n_cases": dec.n_cases,
                    "delta": dec.delta,
                    "lower": None if math.isnan(dec.lower) else dec.lower,
                    "p_ni": dec.p_ni,
                    "p_reg": dec.p_reg,
                    "q_reg": q[i],
                    "decision": what,
                }
            )
        history.append(LookRecord(k + 1, count, level, tuple(rows), reg_level))
        if len(decided) == len(slices):
            break
    return history, decided


def sequential_gate(
    scored: pl.DataFrame,
    plan: GatePlan,
    design: SequentialDesign,
    case_order: Sequence[str],
    *,
    cases_of: dict[tuple[int, str], Sequence[str]] | None = None,
) -> tuple[GateResult, dict[str, Any]]:
    """The verdict of a sequential run and its look history (for verdict.json's ``sequential``).

    The final look is :func:`gate` at the last nominal level; a slice decided at an earlier look keeps
    that look's status, bounds and p-values, with a reason naming the look (it is INCONCLUSIVE in the
    final gate, which never sees its unsent cases; its p enters the final families as 1)."""
    history, decided = replay_looks(scored, plan, design, case_order, cases_of=cases_of)
    final_plan = plan.replace(
        alpha=design.levels[-1], stop_rule="fixed", looks=None, look_every=None, boundary=None
    )
    result = gate(scored, final_plan)
    rows = {(r["length"], r["position"], h.look): r for h in history for r in h.slices}
    slices = []
    for row in result.slice_results:
        key = (row.length, row.position)
        if key not in decided:
            slices.append(_at_last_look(row, plan, design))
            continue
        look, what = decided[key]
        at = rows[(row.length, row.position, look)]
        level = design.levels[look - 1]
        status = {
            "PASS": SliceStatus.PASS,
            "FAIL_REGRESSION": SliceStatus.FAIL_REGRESSION,
            "FUTILITY": SliceStatus.FAIL_NOT_SHOWN,
        }[what]
        if what == "FUTILITY":
            why = (
                f"stopped for futility: regression p {at['p_reg']:.4g} <= {plan.alpha:g} (unadjusted; the "
                f"upper bound lies below -{plan.margin:g}, non-inferiority cannot be shown; no regression "
                "claimed)"
            )
        elif status is SliceStatus.PASS:
            why = (
                f"non-inferior, lower bound {at['lower']:+.4f} > -{plan.margin:g}"
                if at["lower"] is not None
                else "non-inferior (anytime-valid wealth reached 1/level)"
            )
        else:
            reg_level = design.regression_levels[look - 1]
            why = (
                f"confirmed regression, {plan.regression_method} q {at['q_reg']:.4g} <= {reg_level:.3g} (the "
                "look's regression level)"
            )
        head = f"decided at look {look} of {len(design.counts)} ({at['n_cases']} cases, level {level:.3g})"
        reason = f"{head}: {why}"
        if (
            status is SliceStatus.PASS
            and plan.floor is not None
            and row.floor_lb is not None
            and row.floor_lb < plan.floor
        ):
            status, reason = (
                SliceStatus.FAIL_FLOOR,
                reason + f"; floor: candidate LB {row.floor_lb:.4f} < F {plan.floor:g}",
            )
        slices.append(
            dataclasses.replace(
                row,
                status=status,
                reason=reason,
                n_cases=int(at["n_cases"]),
                n_missing=0,
                delta=at["delta"],
                lower=at["lower"],
                p_ni=at["p_ni"],
                p_reg=at["p_reg"],
                q_reg=at["q_reg"],
            )
        )
    verdict, reasons = release_verdict(slices, result.overall, result.safety)
    # The verdict states the pre-registered plan (stop_rule "sequential", alpha); the levels of the looks
    # are in the ``sequential`` section.
    final = dataclasses.replace(
        result, verdict=verdict, reasons=tuple(reasons), slice_results=tuple(slices), plan=plan
    )
    return final, _section(plan, design, case_order, history, decided, slices, cases_of)


def _at_last_look(row: SliceResult, plan: GatePlan, design: SequentialDesign) -> SliceResult:
    """A slice still open at the last look: :func:`gate` tested its regression at the last look's
    non-inferiority level; the design confirms it at the last regression level (issue #36), which is
    never above it (the regression side spent part of its alpha at the interim looks)."""
    level = design.regression_levels[-1]
    if row.status is not SliceStatus.FAIL_REGRESSION:
        return row
    test = f"{plan.regression_method} q {row.q_reg:.4g}"
    if row.q_reg <= level:
        upper = "" if row.upper is None else f"upper bound {row.upper:+.4f} < -{plan.margin:g}, "
        why = f"confirmed regression: {upper}{test} <= {level:.4g} (the last look's regression level)"
        return dataclasses.replace(row, reason=why)
    lower = "" if row.lower is None else f": lower bound {row.lower:+.4f} <= -{plan.margin:g}"
    why = (
        f"non-inferiority not shown{lower}; regression not confirmed, {test} > {level:.4g} (the last "
        "look's regression level)"
    )
    return dataclasses.replace(row, status=SliceStatus.FAIL_NOT_SHOWN, reason=why)


def _section(
    plan: GatePlan,
    design: SequentialDesign,
    case_order: Sequence[str],
    history: Sequence[LookRecord],
    decided: dict[tuple[int, str], tuple[int, str]],
    slices: Sequence[Any],
    cases_of: dict[tuple[int, str], Sequence[str]] | None,
) -> dict[str, Any]:
    """verdict.json's ``sequential``: the design, the looks, per slice the deciding look and the cases
    sent, and the requests not sent."""
    per_slice: list[dict[str, Any]] = []
    for length, position in dict.fromkeys(plan.planned_slices or ()):
        final_status = next(
            (r.status.value for r in slices if (r.length, r.position) == (length, position)), "not gated"
        )
        look, what = decided.get((length, position), (len(design.counts), f"{final_status} (final look)"))
        planned = set(cases_of.get((length, position), case_order)) if cases_of else set(case_order)
        sent = sum(1 for c in case_order[: design.counts[look - 1]] if c in planned)
        per_slice.append(
            {
                "length": length,
                "position": position,
                "look": look,
                "decision": what,
                "cases_sent": sent,
                "cases_planned": len(planned),
            }
        )
    seeds = len(plan.planned_seeds or ())
    sent_runs = sum(int(r["cases_sent"]) for r in per_slice) * 2 * seeds
    planned_runs = sum(int(r["cases_planned"]) for r in per_slice) * 2 * seeds
    section = {
        "design": design.to_dict(),
        "case_order": list(case_order),
        "looks": [h.to_dict() for h in history],
        "slices": per_slice,
        "requests_sent": sent_runs,
        "requests_planned": planned_runs,
        "requests_not_sent": planned_runs - sent_runs,
    }
    return section
