"""The statistical release gate: paired, case-level non-inferiority per (length, position) slice.

Spec: ``shared/research/stats_gate.md`` (section numbers below refer to it). The short version:

* The unit is the **case**. Repeats (seeds) are averaged within a case first, so per slice every case
  contributes ``d_i = mean_s(candidate) - mean_s(baseline)`` over its valid *paired* seeds.
* Per slice, one-sided non-inferiority H0: delta <= -M. One seed per case: the Newcombe (1998) method-10
  paired interval. Two or more: the smaller of a case bootstrap bound and a Newcombe-10 bound on
  design-effect-deflated run counts (section 2.2). The slice passes iff the lower bound is > -M. Both
  bounds are monotone in added failures (issue #22, item 3): the bootstrap is the percentile bound on
  resamples drawn from the seed alone (``judge/bounds/percentile.py``; the spec's studentized bootstrap-t,
  ``judge/bounds/bootstrap.py``, could rise when a run failed), the Newcombe bound the envelope over the
  data's completions (``judge/bounds/rs_envelope.py``).
* Release needs every slice to pass (intersection-union test, no adjustment). BH q-values of the NI
  p-values are reported; confirmed regressions (H0: delta >= -M) use Benjamini-Yekutieli (section 2.3).
* A slice with too few valid cases, too many missing cases or unpaired seeds is INCONCLUSIVE: it stays
  a row of its own, enters every p-value family with p = 1 and is never merged (section 2.4).
* The absolute floor is a Wilson lower bound on the effective sample size n*R/DEFF (section 2.5).
* Any forbidden claim sets the safety flag, whatever the statistics say (section 2.8).

The parts live in their own modules (issue #23): ``judge/tables/records.py`` (schema, pairing),
``plan.py``, ``results.py`` and ``sizing.py`` beside this one, and the slice bounds in ``judge/bounds``
(``intervals.py``, ``slice_bounds.py``); this module runs the gate.

Bootstrap seeds come from sha256 of the plan seed and the slice key, so a verdict is identical in every
process (Python's ``hash()`` of a string is salted per process; section 8, item 15). Only numpy, polars
and statsmodels are used; Wilson intervals inside Newcombe-10 use the closed form (equal to
``proportion_confint(method="wilson")``, checked in the tests) because the p-value inversion evaluates
them a few hundred times per slice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl
from statsmodels.stats.multitest import multipletests

from depthgate.exceptions import InputError, SpecError
from depthgate.judge.bounds import (
    SliceStatistics,
    clopper_pearson_upper,
    floor_lower_bound,
    slice_statistics,
    wilson_lower,
)
from depthgate.judge.gate.plan import NI_METHODS, REGRESSION_METHODS, GatePlan, stable_seed
from depthgate.judge.gate.results import (
    CaseWorstPosition,
    GateResult,
    LengthWorstPosition,
    OverallResult,
    PositionShare,
    SafetySummary,
    SliceResult,
    SliceStatus,
    TriageCell,
    Verdict,
)
from depthgate.judge.gate.sizing import Sizing, fisher_less, sample_size_per_slice
from depthgate.judge.tables import ARMS, BASELINE, CANDIDATE, pair_runs, position_sort_key, prepare_records
from depthgate.spec.models import plan_violations
from depthgate.spec.positions import split_position_label

FloatArray = npt.NDArray[np.float64]


_TIE_TOLERANCE = 1e-12


@dataclass(frozen=True)
class _SliceData:
    length: int
    position: str
    seeds: int
    n_planned: int
    n_missing: int
    unpaired_cases: int
    case_ids: tuple[str, ...]
    baseline: FloatArray
    candidate: FloatArray
    safety_baseline: int
    safety_candidate: int


def _slice_data(
    length: int,
    position: str,
    runs: pl.DataFrame,
    planned_cases: Sequence[str],
    safety: tuple[int, int],
    planned_seeds: Sequence[int] | None = None,
) -> _SliceData:
    # With a frozen seed set, R is the planned R: a seed absent from both arms is a missing run, not a
    # smaller design (ceil(R/2) valid paired seeds per case still apply).
    seeds = sorted(runs["seed"].unique().to_list()) if planned_seeds is None else sorted(planned_seeds)
    need = math.ceil(len(seeds) / 2)
    per_case = runs.group_by("case_id").agg(
        (~(pl.col("has_b") & pl.col("has_c"))).sum().alias("unpaired"),
        pl.col("valid").sum().alias("n_valid"),
    )
    unpaired = int((per_case["unpaired"] > 0).sum())
    valid_ids = set(per_case.filter(pl.col("n_valid") >= max(need, 1))["case_id"].to_list())
    case_ids = tuple(c for c in planned_cases if c in valid_ids)
    row_of = {c: i for i, c in enumerate(case_ids)}
    col_of = {s: j for j, s in enumerate(seeds)}
    yb = np.full((len(case_ids), max(len(seeds), 1)), np.nan)
    yc = np.full_like(yb, np.nan)
    good = runs.filter(pl.col("valid") & pl.col("case_id").is_in(list(case_ids)))
    rows = np.array([row_of[c] for c in good["case_id"].to_list()], dtype=np.int64)
    cols = np.array([col_of[s] for s in good["seed"].to_list()], dtype=np.int64)
    yb[rows, cols] = good["yb"].to_numpy()
    yc[rows, cols] = good["yc"].to_numpy()
    return _SliceData(
        length=length,
        position=position,
        seeds=len(seeds),
        n_planned=len(planned_cases),
        n_missing=len(planned_cases) - len(case_ids),
        unpaired_cases=unpaired,
        case_ids=case_ids,
        baseline=yb,
        candidate=yc,
        safety_baseline=safety[0],
        safety_candidate=safety[1],
    )


# --------------------------------------------------------------------------------------------------
# The gate


@dataclass
class _Draft:
    data: _SliceData
    inconclusive: list[str]
    stats: SliceStatistics | None = None
    seed: int | None = None


def _describe(draft: _Draft, plan: GatePlan) -> dict[str, Any]:
    data = draft.data
    out: dict[str, Any] = {
        "acc_baseline": None,
        "acc_candidate": None,
        "delta": None,
        "floor_lb": None,
        "floor_lb_baseline": None,
        "floor_lb_naive": None,
        "floor_deff": None,
        "floor_n_eff": None,
    }
    n = len(data.case_ids)
    if n == 0:
        return out
    rate_b = np.nanmean(data.baseline, axis=1)
    rate_c = np.nanmean(data.candidate, axis=1)
    runs = float(np.sum(~np.isnan(data.candidate)))
    out["acc_baseline"] = float(rate_b.mean())
    out["acc_candidate"] = float(rate_c.mean())
    out["delta"] = float((rate_c - rate_b).mean())
    out["floor_lb"], out["floor_deff"], out["floor_n_eff"] = floor_lower_bound(
        rate_c, runs / n, plan.look_alpha
    )
    out["floor_lb_baseline"] = floor_lower_bound(rate_b, runs / n, plan.look_alpha)[0]
    out["floor_lb_naive"] = wilson_lower(float(np.nansum(data.candidate)), runs, plan.look_alpha)
    return out


def _replanned_n(stats: SliceStatistics, plan: GatePlan, n_slices: int) -> int | None:
    if not stats.sd_diff > 0:
        return None
    try:
        return sample_size_per_slice(stats.sd_diff, Sizing.of_plan(plan), n_slices=n_slices)
    except (ValueError, RuntimeError, ArithmeticError):
        return None


def _adjust(p_values: Sequence[float], alpha: float, method: str) -> list[float]:
    if not p_values:
        return []
    adjusted = multipletests(np.asarray(p_values, dtype=np.float64), alpha=alpha, method=method)[1]
    return [float(q) for q in adjusted]


def _status(draft: _Draft, q_reg: float, desc: Mapping[str, Any], plan: GatePlan) -> tuple[SliceStatus, str]:
    m = plan.margin
    if draft.inconclusive or draft.stats is None:
        reason = "; ".join(draft.inconclusive)
        delta = desc["delta"]
        if delta is not None and delta <= -m:
            reason += f"; suspected regression (delta {delta:+.3f} <= -{m:g}) - rerun at full size"
        return SliceStatus.INCONCLUSIVE, reason
    st = draft.stats
    if q_reg <= plan.look_alpha:
        return SliceStatus.FAIL_REGRESSION, (
            f"confirmed regression: upper bound {st.upper:+.4f} < -{m:g}, "
            f"{plan.regression_method} q {q_reg:.4g} <= {plan.look_alpha:g}"
        )
    if not st.lower > -m:
        return SliceStatus.FAIL_NOT_SHOWN, f"non-inferiority not shown: lower bound {st.lower:+.4f} <= -{m:g}"
    floor_lb = desc["floor_lb"]
    if plan.floor is not None and floor_lb is not None and floor_lb < plan.floor:
        base_lb = desc["floor_lb_baseline"]
        gap = base_lb is not None and base_lb < plan.floor
        reason = f"floor: candidate Wilson LB {floor_lb:.4f} < F {plan.floor:g}"
        if gap:
            reason += f"; KNOWN_GAP (baseline LB {base_lb:.4f} also < F)"
        if plan.block_known_gap or not gap:
            return SliceStatus.FAIL_FLOOR, reason
        return SliceStatus.PASS, reason + "; not blocking (block_known_gap=False)"
    reason = f"non-inferior: lower bound {st.lower:+.4f} > -{m:g}"
    if st.upper < 0:
        reason += f"; significant drop within margin (upper bound {st.upper:+.4f} < 0)"
    return SliceStatus.PASS, reason


def _planned_cases(paired: pl.DataFrame, plan: GatePlan) -> list[str]:
    """The planned case set (else every case in the records); refuses records of a case or seed outside
    the frozen sets."""
    observed_cases = sorted(paired["case_id"].unique().to_list())
    if plan.planned_cases is None:
        planned_cases = observed_cases
    else:
        planned_cases = sorted(plan.planned_cases)
        unplanned = sorted(set(observed_cases) - set(planned_cases))
        if unplanned:
            raise InputError(
                f"records of {len(unplanned)} case(s) outside the frozen case set, e.g. {unplanned[:3]}",
                field="case_id",
                fix="gate the records of the run the plan was frozen for (GatePlan.planned_cases)",
            )
    if plan.planned_seeds is not None:
        extra_seeds = sorted(set(paired["seed"].unique().to_list()) - set(plan.planned_seeds))
        if extra_seeds:
            raise InputError(
                f"records of seed(s) {extra_seeds[:5]} outside the frozen seed set "
                f"{list(plan.planned_seeds)}",
                field="seed",
                fix="gate the records of the run the plan was frozen for (GatePlan.planned_seeds)",
            )
    return planned_cases


def _observed_draft(
    length: int,
    position: str,
    runs: pl.DataFrame,
    cases: Sequence[str],
    hits: tuple[int, int],
    plan: GatePlan,
    preregistered: set[tuple[int, str]] | None,
) -> _Draft:
    """A slice with records: its data, the reasons it is INCONCLUSIVE, else its NI statistics."""
    data = _slice_data(length, position, runs, cases, hits, plan.planned_seeds)
    reasons: list[str] = []
    if preregistered is not None and (length, position) not in preregistered:
        reasons.append("not on the pre-registered slice list (exploratory only)")
    if data.unpaired_cases:
        reasons.append(f"unpaired seeds: {data.unpaired_cases} case(s) have a seed in one arm only")
    if data.n_planned and data.n_missing / data.n_planned > plan.max_missing:
        reasons.append(
            f"{data.n_missing}/{data.n_planned} planned cases missing "
            f"({data.n_missing / data.n_planned:.0%} > {plan.max_missing:.0%}; a case needs "
            f">= {math.ceil(data.seeds / 2)} valid paired seeds)"
        )
    if len(data.case_ids) < plan.n_min:
        reasons.append(f"{len(data.case_ids)} valid cases < n_min {plan.n_min}")
    draft = _Draft(data, reasons)
    if not reasons:
        draft.seed = stable_seed(plan.bootstrap_seed, "slice", length, position)
        draft.stats = slice_statistics(
            data.baseline,
            data.candidate,
            plan.margin,
            plan.look_alpha,
            plan.bootstrap_resamples,
            draft.seed,
            seeds_planned=data.seeds,
        )
    return draft


def _p_and_q(
    drafts: Sequence[_Draft], plan: GatePlan, preregistered: set[tuple[int, str]] | None
) -> tuple[list[float], list[float], list[float], list[float]]:
    """(p_NI, p_REG, q_NI, q_REG) of every slice: INCONCLUSIVE slices enter with p = 1."""
    p_ni = [1.0 if d.stats is None else d.stats.p_ni for d in drafts]
    p_reg = [1.0 if d.stats is None else d.stats.p_reg for d in drafts]
    # The families are the pre-registered slices (spec §2.3): an unplanned slice is exploratory, reported
    # with q = 1, and does not enlarge the BY/BH family of the planned ones (issue #22).
    family = [
        i
        for i, d in enumerate(drafts)
        if preregistered is None or (d.data.length, d.data.position) in preregistered
    ]
    q_ni, q_reg = [1.0] * len(drafts), [1.0] * len(drafts)
    for qs, ps, method in (
        (q_ni, p_ni, NI_METHODS[plan.fdr_method]),
        (q_reg, p_reg, REGRESSION_METHODS[plan.regression_method]),
    ):
        for i, q in zip(family, _adjust([ps[i] for i in family], plan.look_alpha, method), strict=True):
            qs[i] = q
    return p_ni, p_reg, q_ni, q_reg


def _slice_result(
    draft: _Draft,
    status: SliceStatus,
    reason: str,
    desc: Mapping[str, Any],
    pq: tuple[float, float, float, float],
    plan: GatePlan,
    n_slices: int,
) -> SliceResult:
    """One row of the slice table."""
    st = draft.stats
    p_ni, q_ni, p_reg, q_reg = pq
    return SliceResult(
        length=draft.data.length,
        position=draft.data.position,
        status=status,
        reason=reason,
        n_planned=draft.data.n_planned,
        n_cases=len(draft.data.case_ids),
        n_missing=draft.data.n_missing,
        seeds=draft.data.seeds,
        acc_baseline=desc["acc_baseline"],
        acc_candidate=desc["acc_candidate"],
        delta=desc["delta"],
        lower=None if st is None else st.lower,
        upper=None if st is None else st.upper,
        method=None if st is None else st.method,
        p_ni=p_ni,
        q_ni=q_ni,
        p_reg=p_reg,
        q_reg=q_reg,
        deff=None if st is None else st.deff,
        informative=None if st is None else st.informative,
        sd_diff=None if st is None else st.sd_diff,
        floor_lb=desc["floor_lb"],
        floor_lb_baseline=desc["floor_lb_baseline"],
        floor_lb_naive=desc["floor_lb_naive"],
        floor_deff=desc["floor_deff"],
        floor_n_eff=desc["floor_n_eff"],
        replanned_n=None if st is None else _replanned_n(st, plan, n_slices),
        safety_baseline=draft.data.safety_baseline,
        safety_candidate=draft.data.safety_candidate,
        bootstrap_seed=draft.seed,
    )


def gate(records: pl.DataFrame, plan: GatePlan | None = None) -> GateResult:
    """Run the release gate on scored records (one row per arm, case, length, position, seed).

    Columns: see ``RECORD_SCHEMA``. ``outcome`` "pass" scores 1; "fail" and "system_fail" (overflow,
    template error, truncation, timeout: caused by a system, so never missing) score 0; "missing"
    (an unresolved infrastructure error) drops that seed from the pairing. The planned case set is
    ``plan.planned_cases`` (else every case_id in the records): a case with no valid data in a slice
    counts as missing there. A case needs ceil(R/2) valid paired seeds, R = ``len(plan.planned_seeds)``
    (else the distinct seeds in the slice). Raises ``InputError`` on malformed records and on records of
    a case or seed outside the planned sets.
    """
    plan = plan or GatePlan()
    df = prepare_records(records)
    paired = pair_runs(df)
    planned_cases = _planned_cases(paired, plan)

    safety_counts: dict[tuple[int, str, str], int] = {}
    for row in (
        df.filter(pl.col("safety")).group_by(["length", "position", "arm"]).len().iter_rows(named=True)
    ):
        safety_counts[(row["length"], row["position"], row["arm"])] = int(row["len"])

    observed = {
        (int(k[0]), str(k[1])): part
        for k, part in paired.partition_by(["length", "position"], as_dict=True, maintain_order=True).items()
    }
    keys = set(observed) if plan.planned_slices is None else set(plan.planned_slices) | set(observed)
    ordered = sorted(keys, key=lambda k: (k[0], position_sort_key(k[1])))
    preregistered = None if plan.planned_slices is None else set(plan.planned_slices)
    if preregistered is None:
        _check_bootstrap_for(plan, len(ordered))

    spaced_cases = None if plan.spaced_cases is None else sorted(plan.spaced_cases)

    def cases_of(position: str) -> list[str]:
        """The planned cases of a slice: the multi-evidence ones where the position carries a spacing."""
        if spaced_cases is not None and split_position_label(position)[1] != "adjacent":
            return spaced_cases
        return planned_cases

    drafts: list[_Draft] = []
    for length, position in ordered:
        hits = (
            safety_counts.get((length, position, BASELINE), 0),
            safety_counts.get((length, position, CANDIDATE), 0),
        )
        runs = observed.get((length, position))
        if runs is None:
            empty = np.full((0, 1), np.nan)
            n_seeds = 0 if plan.planned_seeds is None else len(plan.planned_seeds)
            data = _SliceData(
                length,
                position,
                n_seeds,
                len(cases_of(position)),
                len(cases_of(position)),
                0,
                (),
                empty,
                empty.copy(),
                *hits,
            )
            drafts.append(_Draft(data, ["no records for this pre-registered slice"]))
            continue
        drafts.append(_observed_draft(length, position, runs, cases_of(position), hits, plan, preregistered))

    p_ni, p_reg, q_ni, q_reg = _p_and_q(drafts, plan, preregistered)

    slice_results: list[SliceResult] = []
    for i, draft in enumerate(drafts):
        desc = _describe(draft, plan)
        status, reason = _status(draft, q_reg[i], desc, plan)
        slice_results.append(
            _slice_result(
                draft, status, reason, desc, (p_ni[i], q_ni[i], p_reg[i], q_reg[i]), plan, len(drafts)
            )
        )

    cells = _cell_table(drafts, slice_results)
    overall = _overall(cells, plan)
    safety = _safety(df, plan)
    worst_by_length, worst_cases, worst_shares = _worst_positions(cells, slice_results, plan)
    triage = _triage(cells, plan)
    verdict, reasons = _verdict(slice_results, overall, safety)
    return GateResult(
        verdict=verdict,
        safety_flag=safety.flag,
        reasons=tuple(reasons),
        slice_results=tuple(slice_results),
        overall=overall,
        safety=safety,
        worst_by_length=worst_by_length,
        worst_cases=worst_cases,
        worst_shares=worst_shares,
        triage=triage,
        plan=plan,
    )


def _check_bootstrap_for(plan: GatePlan, n_slices: int) -> None:
    """The plan's B rule (:func:`plan_violations`) for the slices of records gated without a
    pre-registered list: the same refusal as ``GatePlan(planned_slices=...)`` (issue #22, item 4)."""
    for name, problem, fix in plan_violations(
        plan, regression_method=plan.regression_method, n_slices=n_slices
    ):
        if name == "bootstrap_resamples":
            raise SpecError(
                f"invalid gate plan for these records: {problem}", field="bootstrap_resamples", fix=fix
            )


def release_verdict(
    slices: Sequence[SliceResult], overall: OverallResult | None, safety: SafetySummary
) -> tuple[Verdict, list[str]]:
    """The release verdict and its reasons from the slice table (what :func:`gate` returns)."""
    return _verdict(slices, overall, safety)


def _verdict(
    slices: Sequence[SliceResult], overall: OverallResult | None, safety: SafetySummary
) -> tuple[Verdict, list[str]]:
    failing = [s for s in slices if s.status.value.startswith("FAIL")]
    inconclusive = [s for s in slices if s.status is SliceStatus.INCONCLUSIVE]
    reasons = [f"{s.length}/{s.position}: {s.status.value} ({s.reason})" for s in failing]
    if overall is not None and not overall.non_inferior:
        reasons.append(f"overall non-inferiority fails: lower bound {overall.lower:+.4f}")
    if safety.flag:
        reasons.append(
            f"SAFETY: {safety.hits_candidate} candidate and {safety.hits_baseline} baseline forbidden-claim "
            "hit(s); blocks pending human review"
        )
    if failing or (overall is not None and not overall.non_inferior):
        return Verdict.FAIL, reasons
    if inconclusive or not slices:
        reasons += [f"{s.length}/{s.position}: INCONCLUSIVE ({s.reason})" for s in inconclusive]
        if not slices:
            reasons.append("no slices to test")
        return Verdict.INCONCLUSIVE, reasons
    return Verdict.PASS, reasons


def _safety(df: pl.DataFrame, plan: GatePlan) -> SafetySummary:
    # The Clopper-Pearson bound is at plan.alpha, not look_alpha, on purpose (issue #22): the flag is set
    # by any hit and no test is made, so a second look spends no error on it; the bound only describes
    # the hit rate, at the level the plan states.
    scored = df.filter(pl.col("outcome") != "missing")
    hits = {arm: int(df.filter((pl.col("arm") == arm) & pl.col("safety")).height) for arm in ARMS}
    runs = {arm: int(scored.filter(pl.col("arm") == arm).height) for arm in ARMS}
    upper = (
        clopper_pearson_upper(min(hits[CANDIDATE], runs[CANDIDATE]), runs[CANDIDATE], plan.alpha)
        if runs[CANDIDATE]
        else None
    )
    return SafetySummary(
        flag=bool(hits[CANDIDATE] or hits[BASELINE]),
        hits_candidate=hits[CANDIDATE],
        hits_baseline=hits[BASELINE],
        runs_candidate=runs[CANDIDATE],
        runs_baseline=runs[BASELINE],
        upper_rate_candidate=upper,
    )


# --------------------------------------------------------------------------------------------------
# Cell-level views: overall, worst positions, triage


@dataclass(frozen=True)
class _Cell:
    case_id: str
    length: int
    position: str
    seeds: int
    passes_baseline: int
    passes_candidate: int
    rate_baseline: float
    rate_candidate: float
    tested: bool
    status: SliceStatus


def _cell_table(drafts: Sequence[_Draft], results: Sequence[SliceResult]) -> list[_Cell]:
    cells: list[_Cell] = []
    for draft, res in zip(drafts, results, strict=True):
        data = draft.data
        for i, case_id in enumerate(data.case_ids):
            ok = ~np.isnan(data.baseline[i])
            m = int(ok.sum())
            pb, pc = int(data.baseline[i, ok].sum()), int(data.candidate[i, ok].sum())
            cells.append(
                _Cell(
                    case_id,
                    data.length,
                    data.position,
                    m,
                    pb,
                    pc,
                    pb / m,
                    pc / m,
                    draft.stats is not None,
                    res.status,
                )
            )
    return cells


def _overall(cells: Sequence[_Cell], plan: GatePlan) -> OverallResult | None:
    per_case: dict[str, list[float]] = {}
    slices: set[tuple[int, str]] = set()
    for cell in cells:
        if cell.tested:
            per_case.setdefault(cell.case_id, []).append(cell.rate_candidate - cell.rate_baseline)
            slices.add((cell.length, cell.position))
    if len(per_case) < 2:
        return None
    d = np.array([float(np.mean(per_case[c])) for c in sorted(per_case)])
    boot = plan.bootstrap(d, "overall")
    p_ni = (
        boot.p_ni
        if boot.p_ni is not None
        else (1.0 / (plan.bootstrap_resamples + 1) if boot.lower > -plan.margin else 1.0)
    )
    return OverallResult(
        n_cases=int(d.size),
        n_slices=len(slices),
        delta=float(d.mean()),
        lower=boot.lower,
        upper=boot.upper,
        p_ni=float(p_ni),
        non_inferior=bool(boot.lower > -plan.margin),
    )


def _tied(values: Mapping[str, float], best: float) -> tuple[str, ...]:
    return tuple(p for p in sorted(values, key=position_sort_key) if abs(values[p] - best) <= _TIE_TOLERANCE)


def _worst_positions(
    cells: Sequence[_Cell], results: Sequence[SliceResult], plan: GatePlan
) -> tuple[tuple[LengthWorstPosition, ...], tuple[CaseWorstPosition, ...], tuple[PositionShare, ...]]:
    by_length: dict[int, dict[str, dict[str, _Cell]]] = {}
    for cell in cells:
        by_length.setdefault(cell.length, {}).setdefault(cell.case_id, {})[cell.position] = cell
    # Positions with at least one valid cell: a pre-registered slice without data would leave no
    # complete case at all (it is reported as INCONCLUSIVE in the slice table instead).
    positions_of: dict[int, set[str]] = {res.length: set() for res in results}
    for cell in cells:
        positions_of[cell.length].add(cell.position)

    summaries: list[LengthWorstPosition] = []
    case_rows: list[CaseWorstPosition] = []
    shares: list[PositionShare] = []
    for length in sorted(positions_of):
        positions = sorted(positions_of[length], key=position_sort_key)
        per_case = by_length.get(length, {})
        complete = sorted(c for c, cs in per_case.items() if all(p in cs for p in positions))
        credit_b = dict.fromkeys(positions, 0.0)
        credit_c = dict.fromkeys(positions, 0.0)
        rows: list[CaseWorstPosition] = []
        for case_id in complete:
            rb = {p: per_case[case_id][p].rate_baseline for p in positions}
            rc = {p: per_case[case_id][p].rate_candidate for p in positions}
            worst_b, worst_c = _tied(rb, min(rb.values())), _tied(rc, min(rc.values()))
            for p in worst_b:
                credit_b[p] += 1.0 / len(worst_b)
            for p in worst_c:
                credit_c[p] += 1.0 / len(worst_c)
            rows.append(
                CaseWorstPosition(
                    case_id=case_id,
                    length=length,
                    worst_acc_baseline=min(rb.values()),
                    worst_acc_candidate=min(rc.values()),
                    range_baseline=max(rb.values()) - min(rb.values()),
                    range_candidate=max(rc.values()) - min(rc.values()),
                    worst_positions_baseline=worst_b,
                    worst_positions_candidate=worst_c,
                )
            )
        case_rows.extend(rows)
        n = len(rows)
        if n:
            shares.extend(PositionShare(length, p, n, credit_b[p] / n, credit_c[p] / n) for p in positions)
        tested = [r for r in results if r.length == length and r.lower is not None]
        worst_slice = min(tested, key=lambda r: (r.lower, position_sort_key(r.position))) if tested else None
        summary: dict[str, Any] = {
            "length": length,
            "n_positions": len(positions),
            "n_cases": n,
            "slice_worst_position": None if worst_slice is None else worst_slice.position,
            "slice_worst_lower": None if worst_slice is None else worst_slice.lower,
        }
        if n >= 2:
            wb = np.array([r.worst_acc_baseline for r in rows])
            wc = np.array([r.worst_acc_candidate for r in rows])
            gb = np.array([r.range_baseline for r in rows])
            gc = np.array([r.range_candidate for r in rows])
            worst = plan.bootstrap(wc - wb, "worst", length)
            # One-sided upper bound on the range increase: minus the lower bound of the decrease.
            spread = plan.bootstrap(gb - gc, "range", length)
            p_worst = worst.p_ni
            if p_worst is None:
                p_worst = 1.0 / (plan.bootstrap_resamples + 1) if worst.lower > -plan.margin else 1.0
            summary.update(
                worst_acc_baseline=float(wb.mean()),
                worst_acc_candidate=float(wc.mean()),
                worst_delta=float((wc - wb).mean()),
                worst_lower=worst.lower,
                worst_upper=worst.upper,
                worst_p_ni=float(p_worst),
                worst_non_inferior=bool(worst.lower > -plan.margin),
                range_baseline=float(gb.mean()),
                range_candidate=float(gc.mean()),
                range_increase=float((gc - gb).mean()),
                range_increase_upper=-spread.lower,
                fragile_share_baseline=float(np.mean(gb >= plan.fragile_range - _TIE_TOLERANCE)),
                fragile_share_candidate=float(np.mean(gc >= plan.fragile_range - _TIE_TOLERANCE)),
            )
        elif n == 1:
            only = rows[0]
            summary.update(
                worst_acc_baseline=only.worst_acc_baseline,
                worst_acc_candidate=only.worst_acc_candidate,
                worst_delta=only.worst_acc_candidate - only.worst_acc_baseline,
                range_baseline=only.range_baseline,
                range_candidate=only.range_candidate,
                range_increase=only.range_candidate - only.range_baseline,
            )
        names = [f.name for f in dataclasses.fields(LengthWorstPosition)]
        values: dict[str, Any] = {k: summary.get(k) for k in names}
        summaries.append(LengthWorstPosition(**values))
    return tuple(summaries), tuple(case_rows), tuple(shares)


def _triage(cells: Iterable[_Cell], plan: GatePlan) -> tuple[TriageCell, ...]:
    drops = [c for c in cells if c.rate_candidate < c.rate_baseline]
    scored = [
        (c.rate_candidate - c.rate_baseline, fisher_less(c.passes_candidate, c.passes_baseline, c.seeds), c)
        for c in drops
    ]
    scored.sort(key=lambda t: (t[0], t[1], t[2].length, position_sort_key(t[2].position), t[2].case_id))
    return tuple(
        TriageCell(
            case_id=c.case_id,
            length=c.length,
            position=c.position,
            seeds=c.seeds,
            acc_baseline=c.rate_baseline,
            acc_candidate=c.rate_candidate,
            delta=d,
            fisher_p=p,
            slice_status=c.status,
            rerun_seeds=plan.triage_rerun_seeds,
        )
        for d, p, c in scored[: plan.triage_top_k]
    )


__all__ = ["gate", "release_verdict"]
