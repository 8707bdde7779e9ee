"""report.html: the self-contained page (heatmaps as data URIs, the slice, worst-position, triage and
oracle tables, the missing-claim and wrong-citation lists), rendered from report.html.j2."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from depthgate.judge.gate import GateResult, PositionShare, SliceStatus, non_inferiority_shown
from depthgate.judge.tables import BASELINE, CANDIDATE, position_sort_key
from depthgate.report.chars import CHARS_NOTE, length_char_rows
from depthgate.report.formatting import (
    MARK_NI,
    MARK_REGRESSION,
    depth_label,
    ordered_slices,
    plain,
    q_value,
    signed,
    slice_key,
)
from depthgate.report.heatmaps import delta_limit
from depthgate.report.scored import prepare_scored, problem_rows
from depthgate.report.verdict import (
    HEATMAP_ACCURACY,
    HEATMAP_DELTA,
    OracleCounts,
    ReportInputs,
    exit_code_for,
    health_reasons,
    manifest_digests,
    run_info,
    verdict_name,
)

_LIST_LIMIT = 200  # rows of the missing-claim / wrong-citation lists in the HTML page


def slice_rows(result: GateResult) -> list[dict[str, Any]]:
    """The slice table of the page, in report order, with the regression and non-inferiority marks."""
    plan = result.plan
    rows = []
    for s in ordered_slices(result.slice_results):
        marks = ""
        if s.status is SliceStatus.FAIL_REGRESSION:
            marks += MARK_REGRESSION
        if non_inferiority_shown(s, plan.margin):
            marks += MARK_NI
        rows.append(
            {
                "key": slice_key(s.length, s.position),
                "length": f"{s.length:,}",
                "depth": depth_label(s.position),
                "status": s.status.value,
                "n_cases": s.n_cases,
                "n_missing": s.n_missing,
                "seeds": s.seeds,
                "acc_baseline": plain(s.acc_baseline),
                "acc_candidate": plain(s.acc_candidate),
                "delta": signed(s.delta),
                "lower": signed(s.lower, 3),
                "upper": signed(s.upper, 3),
                "q_ni": q_value(s.q_ni),
                "q_reg": q_value(s.q_reg),
                "marks": marks,
                "reason": s.reason,
            }
        )
    return rows


def _share_text(share: PositionShare | None) -> str:
    if share is None:
        return "–"
    return f"{plain(share.share_baseline)} → {plain(share.share_candidate)}"


def _worst_rows(result: GateResult) -> list[dict[str, Any]]:
    return [
        {
            "length": f"{w.length:,}",
            "n_cases": w.n_cases,
            "worst_slice": "–"
            if w.slice_worst_position is None
            else f"{depth_label(w.slice_worst_position)} ({signed(w.slice_worst_lower, 3)})",
            "worst_acc": f"{plain(w.worst_acc_baseline)} → {plain(w.worst_acc_candidate)}",
            "worst_delta": signed(w.worst_delta),
            "worst_lower": signed(w.worst_lower, 3),
            "range": f"{plain(w.range_baseline)} → {plain(w.range_candidate)}",
            "range_increase": f"{signed(w.range_increase)} ({signed(w.range_increase_upper)})",
            "fragile": f"{plain(w.fragile_share_baseline)} → {plain(w.fragile_share_candidate)}",
        }
        for w in result.worst_by_length
    ]


def _share_rows(result: GateResult) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(depth labels, rows of (length, share per depth)) of the worst-position shares."""
    share_positions = sorted({s.position for s in result.worst_shares}, key=position_sort_key)
    share_map = {(s.length, s.position): s for s in result.worst_shares}
    shares = [
        (
            f"{length:,}",
            [_share_text(share_map.get((length, p))) for p in share_positions],
        )
        for length in sorted({s.length for s in result.worst_shares})
    ]
    return [depth_label(p) for p in share_positions], shares


def _triage_rows(result: GateResult) -> list[dict[str, Any]]:
    return [
        {
            "case_id": t.case_id,
            "key": slice_key(t.length, t.position),
            "acc_baseline": plain(t.acc_baseline),
            "acc_candidate": plain(t.acc_candidate),
            "delta": signed(t.delta),
            "fisher_p": q_value(t.fisher_p),
            "rerun_seeds": t.rerun_seeds,
        }
        for t in result.triage
    ]


_ORACLE_COLUMNS = (
    "runs",
    "passed",
    "failed",
    "missing_claims",
    "wrong_citations",
    "safety_hits",
    "wrong_hits",
    "abstained",
    "system_fail",
    "missing",
)


def _oracle_rows(oracle: Sequence[OracleCounts], order: Mapping[str, int]) -> list[dict[str, Any]]:
    """Per slice (report order): every oracle count as candidate / baseline, and failure reasons."""
    by_slice: dict[str, dict[str, OracleCounts]] = {}
    for o in oracle:
        by_slice.setdefault(o.slice, {})[o.arm] = o
    rows = []
    for key in sorted(by_slice, key=lambda k: order.get(k, len(order))):
        c, b = by_slice[key].get(CANDIDATE), by_slice[key].get(BASELINE)

        def pair(name: str, c: OracleCounts | None = c, b: OracleCounts | None = b) -> str:
            return f"{getattr(c, name) if c else 0} / {getattr(b, name) if b else 0}"

        def reasons(arm: str, o: OracleCounts | None) -> list[str]:
            if o is None or not o.system_fail_reasons:
                return []
            return [f"{arm}: " + ", ".join(f"{k} {v}" for k, v in o.system_fail_reasons.items())]

        rows.append(
            {
                "key": key,
                **{name: pair(name) for name in _ORACLE_COLUMNS},
                "reasons": reasons("candidate", c) + reasons("baseline", b),
            }
        )
    return rows


def _problem_lists(inputs: ReportInputs, order: Mapping[str, int]) -> list[dict[str, Any]]:
    df = prepare_scored(inputs.scored)
    lists = []
    for title, column, label in (
        ("Missing claims", "missing_claims", "missing claims"),
        ("Wrong citations", "wrong_citations", "cited ids"),
    ):
        rows, total = problem_rows(df, column, order, _LIST_LIMIT)
        lists.append(
            {
                "title": title,
                "column": label,
                "rows": rows,
                "total": total,
                "more": total > _LIST_LIMIT,
                "open": total <= 20,
            }
        )
    return lists


def _plan_fields(result: GateResult) -> dict[str, Any]:
    """The verdict header and the plan, as the template shows them."""
    plan = result.plan
    ordered = ordered_slices(result.slice_results)
    n_fail = sum(1 for s in ordered if s.status.value.startswith("FAIL"))
    n_inc = sum(1 for s in ordered if s.status is SliceStatus.INCONCLUSIVE)
    seed_counts = sorted({s.seeds for s in ordered if s.seeds})
    overall = result.overall
    return {
        "n_slices": len(ordered),
        "n_fail": n_fail,
        "n_inc": n_inc,
        "n_pass": len(ordered) - n_fail - n_inc,
        "margin": f"{plan.margin:g}",
        "neg_margin": f"−{plan.margin:g}",
        "alpha": f"{plan.look_alpha:g}",
        "confidence": f"{100 * (1 - plan.look_alpha):g}%",
        "n_min": plan.n_min,
        "max_missing": f"{plan.max_missing:.0%}",
        "fdr_method": plan.fdr_method,
        "regression_method": plan.regression_method,
        "delta_limit": f"{delta_limit(result):g}",
        "overall": None
        if overall is None
        else {"delta": signed(overall.delta, 3), "lower": signed(overall.lower, 3)},
        "seeds_note": (
            f"Seeds per case: {', '.join(str(n) for n in seed_counts)}."
            if seed_counts
            else "No seeds recorded."
        ),
    }


def render_html(inputs: ReportInputs, *, delta_png: bytes, accuracy_png: bytes) -> str:
    """The self-contained HTML page (heatmaps embedded as base64 PNG)."""
    result, oracle, manifest, health, chars = inputs.parts()
    ordered = ordered_slices(result.slice_results)
    order = {slice_key(s.length, s.position): i for i, s in enumerate(ordered)}
    share_positions, shares = _share_rows(result)
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("depthgate.report", "."),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    template = env.get_template("report.html.j2")
    code = exit_code_for(result, health)
    return template.render(
        verdict=verdict_name(result, health),
        run_notes=health_reasons(health),
        infra=None if health is None or health.infra is None else health.infra.to_dict(),
        safety_flag=result.safety_flag,
        safety=result.safety,
        exit_value=int(code),
        exit_name=code.name,
        run=run_info(manifest),
        mark_regression=MARK_REGRESSION,
        mark_ni=MARK_NI,
        reasons=list(result.reasons),
        delta_png=base64.b64encode(delta_png).decode("ascii"),
        accuracy_png=base64.b64encode(accuracy_png).decode("ascii"),
        delta_file=HEATMAP_DELTA,
        accuracy_file=HEATMAP_ACCURACY,
        slices=slice_rows(result),
        worst=_worst_rows(result),
        shares=shares,
        share_positions=share_positions,
        triage=_triage_rows(result),
        triage_note=result.triage_note,
        oracle=_oracle_rows(oracle, order),
        problem_lists=_problem_lists(inputs, order),
        digests=manifest_digests(manifest),
        chars=length_char_rows(chars or ()),
        chars_note=CHARS_NOTE,
        **_plan_fields(result),
    )
