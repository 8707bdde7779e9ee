"""Presentation of the position science and the oracle counts (issue 24 item 4), each against a value
computed by hand: forbidden answers per severity, a Δ between censored effective lengths shown as a
bound in grid steps, Wilson bands drawn in the accuracy-by-length charts, no raw Python dicts in
Markdown, and the docs' sign-test p-values stated on one footing."""

from __future__ import annotations

import math

import polars as pl
import pytest
from matplotlib.collections import PolyCollection
from test_report import MANIFEST, PLAN, synthetic_scored

from depthgate.judge.gate import gate
from depthgate.judge.science import (
    AccuracyPoint,
    EffectiveLength,
    EffectiveLengthDelta,
    EffectiveLengthResult,
)
from depthgate.report.position import PositionScience, censored_delta, curve_figure, render_position_markdown
from depthgate.report.report import ReportInputs, oracle_counts, render_summary
from helpers import REPO

GRID = (512, 1024)


def _row(arm: str, steps: int, *, top: bool = False) -> EffectiveLength:
    estimate = 0 if steps == 0 else GRID[steps - 1]
    return EffectiveLength(
        arm=arm,
        position="0.5",
        rule="nolima",
        threshold=0.85,
        base_score=0.9,
        threshold_abs=0.765,
        n_cases=12,
        grid=GRID,
        estimate=estimate,
        steps=steps,
        at_grid_top=top,
        lower=estimate,
        upper=estimate,
        lower_steps=steps,
        upper_steps=steps,
        distribution=((estimate, 1.0),),
    )


def test_forbidden_answers_are_counted_per_severity() -> None:
    # Slice 1024/0.0 (60 cases × 2 seeds per arm): the candidate gives the superseded value in 7 runs and a
    # safety claim in 1; the baseline gives the superseded value once.
    scored = synthetic_scored()
    key = pl.struct("arm", "case_id", "seed")
    wrong = [("candidate", f"case-{i:03d}", 0) for i in range(7)] + [("baseline", "case-010", 1)]
    safety = [("candidate", "case-020", 0)]
    in_slice = (pl.col("length") == 1024) & (pl.col("position") == "0.0")

    def hit(rows: list[tuple[str, str, int]]) -> pl.Expr:
        return in_slice & key.is_in([{"arm": a, "case_id": c, "seed": s} for a, c, s in rows])

    scored = scored.with_columns(
        pl.when(hit(wrong) | hit(safety))
        .then(pl.lit(["old-value"]))
        .otherwise(pl.col("forbidden_hits"))
        .alias("forbidden_hits"),
        pl.when(hit(safety)).then(pl.lit(True)).otherwise(pl.col("safety")).alias("safety"),
    )
    counts = {(o.slice, o.arm): o for o in oracle_counts(scored)}
    cand, base = counts[("1024/0.0", "candidate")], counts[("1024/0.0", "baseline")]
    assert (cand.safety_hits, cand.wrong_hits) == (1, 7)
    assert (base.safety_hits, base.wrong_hits) == (0, 1)
    assert all(o.wrong_hits == 0 for (s, _), o in counts.items() if s != "1024/0.0")
    result = gate(scored, PLAN)
    summary = render_summary(ReportInputs(result, scored, oracle_counts(scored), MANIFEST))
    assert "| forbidden: safety | forbidden: wrong / superseded |" in summary
    oracle_table = summary.split("### Oracle: problems per slice", 1)[1]
    row = next(line for line in oracle_table.splitlines() if line.startswith("| `1024/0.0` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:5] == ["1 / 0", "7 / 1"]  # candidate / baseline: safety, wrong


@pytest.mark.parametrize(
    ("baseline", "candidate", "expected"),
    [
        (_row("baseline", 1), _row("candidate", 2, top=True), "≥ +1 step (censored)"),
        (_row("baseline", 0), _row("candidate", 2, top=True), "≥ +2 steps (censored)"),
        (_row("baseline", 2, top=True), _row("candidate", 0), "≤ −2 steps (censored)"),
        (_row("baseline", 1), _row("candidate", 0), "≤ −1 step (censored)"),
        (_row("baseline", 2, top=True), _row("candidate", 2, top=True), "not measured (both censored)"),
        (_row("baseline", 0), _row("candidate", 0), "not measured (both censored)"),
        (_row("baseline", 1), _row("candidate", 1), None),
    ],
)
def test_a_delta_between_censored_lengths_is_a_bound_in_steps(
    baseline: EffectiveLength, candidate: EffectiveLength, expected: str | None
) -> None:
    assert censored_delta(baseline, candidate) == expected


def _science(
    baseline: EffectiveLength, candidate: EffectiveLength, curve: tuple[AccuracyPoint, ...] = ()
) -> PositionScience:
    tokens = candidate.estimate - baseline.estimate
    steps = candidate.steps - baseline.steps
    delta = EffectiveLengthDelta("0.5", tokens, tokens, tokens, steps, steps, steps, 0.0, 1.0)
    result = EffectiveLengthResult(
        rule="nolima",
        threshold=0.85,
        alpha=0.05,
        reps=999,
        seed=0,
        bootstrap_seed=0,
        n_cases=12,
        base_scores={"baseline": 0.92, "candidate": 0.08},
        base_resampled=False,
        rows=(baseline, candidate),
        deltas=(delta,),
        curve=curve,
    )
    return PositionScience(effective=result, normalised=None, repeat=pl.DataFrame(), seeds=1)


def test_the_markdown_shows_the_censored_delta_and_no_raw_dict() -> None:
    # baseline ≥1024 (at the top), candidate below the grid: Δ ≤ −2 steps, never "-1024" as a number.
    text = render_position_markdown(_science(_row("baseline", 2, top=True), _row("candidate", 0)))
    row = next(line for line in text.splitlines() if line.startswith("| 0.5 |"))
    assert row.endswith("| ≤ −2 steps (censored) |"), row
    assert "-1024" not in row and "−1024" not in row
    assert "of the base score (baseline 0.92, candidate 0.08)" in text
    assert "{" not in text and "'" not in text  # no Python dict or repr anywhere
    measured = render_position_markdown(_science(_row("baseline", 2), _row("candidate", 1)))
    assert "| -512 [-512, -512] (-1 steps) |" in measured  # both measured: the number, as before


def test_the_chart_draws_the_wilson_band_where_the_bootstrap_collapses() -> None:
    # 12 of 12 cases pass at both lengths: the case bootstrap is [1, 1]; the 95 % Wilson interval is
    # [n / (n + z²), 1] = [12 / (12 + 1.95996²), 1] = [0.7575, 1].
    z = 1.959964
    wilson_lower = 12 / (12 + z * z)
    assert round(wilson_lower, 4) == 0.7575
    curve = tuple(
        AccuracyPoint("candidate", "0.5", length, 12, 12, 1.0, 1.0, 1.0, wilson_lower, 1.0, 0.765, True)
        for length in GRID
    )
    fig = curve_figure(_science(_row("baseline", 2, top=True), _row("candidate", 2, top=True), curve), "0.5")
    ax = fig.axes[0]
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1
    ys = bands[0].get_paths()[0].vertices[:, 1]
    assert math.isclose(ys.min(), wilson_lower, abs_tol=1e-9) and math.isclose(ys.max(), 1.0)
    assert ys.max() - ys.min() > 0.24  # a band of width 0.24, not a line at 1.0


def test_the_docs_state_the_sign_test_on_one_footing() -> None:
    # depth 0.5, adjacent → far: 6 cases lost, 0 gained. Exact sign test: one-sided 0.5⁶ = 0.0156,
    # two-sided 0.03125; Holm over six comparisons multiplies the smallest p by 6: 0.1875 two-sided,
    # 0.094 one-sided.
    text = " ".join((REPO / "docs" / "position.md").read_text(encoding="utf-8").split())
    two, one = 2 * 0.5**6, 0.5**6
    assert f"two-sided p = 2 × 0.5⁶ = {two:.3f}" in text
    assert f"six depth × spacing comparisons, two-sided, 6 × {two:.3f} = {6 * two:.2f}" in text
    assert f"the one-sided p would be {one:.3f}, {6 * one:.3f} after Holm" in text
    assert "one-sided p = 0.016; with the six" not in text
