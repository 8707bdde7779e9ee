"""The report's "non-inferiority shown" mark (issue #11, item 6): one rule, the slice's own NI test
(LB > -M, as in the status), stated in the legend; the BH q_NI never sets it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from test_stats import draw_pairs, records_from_arrays

import depthgate.report.page as page
import depthgate.report.report as report
from depthgate.judge.gate import GatePlan, GateResult, SliceStatus, gate, non_inferiority_shown


def _some_result() -> GateResult:
    rng = np.random.default_rng(21)
    arrays = {(4096, p): draw_pairs(rng, 60, 3, coupling=0.8) for p in ("0.0", "0.5", "1.0")}
    return gate(records_from_arrays(arrays), GatePlan(bootstrap_resamples=999))


def test_ni_mark_follows_the_status_not_q() -> None:
    result = _some_result()
    base = result.slice_results
    assert all(s.status is SliceStatus.PASS for s in base)
    margin = result.plan.margin
    passing_large_q = dataclasses.replace(base[0], q_ni=0.2)  # BH q above alpha, LB > -M: PASS
    not_shown_small_q = dataclasses.replace(
        base[1], q_ni=0.001, lower=-0.15, status=SliceStatus.FAIL_NOT_SHOWN, reason="not shown"
    )
    floor_only = dataclasses.replace(base[2], status=SliceStatus.FAIL_FLOOR, reason="floor", q_ni=0.3)
    crafted = dataclasses.replace(result, slice_results=(passing_large_q, not_shown_small_q, floor_only))
    shown = {s.position: non_inferiority_shown(s, margin) for s in crafted.slice_results}
    assert shown == {"0.0": True, "0.5": False, "1.0": True}
    marks = {row["depth"]: row["marks"] for row in page.slice_rows(crafted)}
    by_position = {report.depth_label(s.position): s.position for s in crafted.slice_results}
    for depth, mark in marks.items():
        assert (report.MARK_NI in mark) == shown[by_position[depth]], (depth, mark)
    inconclusive = dataclasses.replace(base[0], status=SliceStatus.INCONCLUSIVE, q_ni=1.0)
    assert not non_inferiority_shown(inconclusive, margin)


def test_ni_mark_legend_states_the_rule(tmp_path: Path) -> None:
    from test_report import MANIFEST, synthetic_scored

    scored = synthetic_scored()
    result = gate(scored, GatePlan(bootstrap_resamples=999))
    paths = report.write_reports(result, scored, tmp_path / "out", manifest=MANIFEST)
    page = paths.report_html.read_text(encoding="utf-8")
    assert "Non-inferiority shown" in page and "never sets the mark" in page
    assert "q_NI &lt; α)" not in page
    verdict = json.loads(paths.verdict_json.read_text())
    assert verdict["plan"]["look_alpha"] == 0.05
