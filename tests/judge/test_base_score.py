"""NoLiMa's base score from the same task at short lengths (issue #24 item 1): the module's numbers by
hand, the plan fields, and the whole path through `depthgate run` (short layouts built and sent, never
gated, the base with its interval in verdict.json and summary.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from test_verdict_trust import PerfectReader, _matrix

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode, InputError, SpecError
from depthgate.judge.science import effective_length, short_base
from depthgate.spec.loading import load_matrix
from depthgate.spec.models import AnalysisPlan
from helpers import free_port, scored_frame

Z = 1.959963984540054  # two-sided 95 %


def _wilson(p: float, n: float) -> tuple[float, float]:
    """The Wilson score interval written out (not the library's)."""
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z / (1 + Z * Z / n) * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return centre - half, centre + half


def _records(rows: list[tuple[str, str, int, str, str]], attempts: list[int] | None = None) -> pl.DataFrame:
    """(arm, case, length, position, outcome) rows, seed 0."""
    frame = scored_frame([(arm, case, length, pos, 0, outcome) for arm, case, length, pos, outcome in rows])
    if attempts is not None:
        frame = frame.with_columns(pl.Series("attempts", attempts, dtype=pl.Int64))
    return frame


# Baseline at the short lengths 250 and 500, one depth: case a passes both, b one, c none, d both.
SHORT = [
    ("baseline", "a", 250, "0.5", "pass"),
    ("baseline", "a", 500, "0.5", "pass"),
    ("baseline", "b", 250, "0.5", "pass"),
    ("baseline", "b", 500, "0.5", "fail"),
    ("baseline", "c", 250, "0.5", "fail"),
    ("baseline", "c", 500, "0.5", "system_fail"),
    ("baseline", "d", 250, "0.5", "pass"),
    ("baseline", "d", 500, "0.5", "pass"),
]


def test_short_base_score_and_its_clustered_wilson_interval_by_hand() -> None:
    scores, rates = short_base(_records(SHORT, attempts=[1] * 8))
    b = scores["baseline"]
    # per-case rates 1, 0.5, 0, 1 (a system failure that was sent counts as a fail): mean 0.625
    assert rates["baseline"] == {"a": 1.0, "b": 0.5, "c": 0.0, "d": 1.0}
    assert b.accuracy == pytest.approx(0.625) and (b.n_cases, b.runs, b.not_sent) == (4, 8, 0)
    # Kish: R = 2 runs per case, s^2 = 0.6875 / 3, var_srs = p(1-p)/(nR) = 0.234375 / 8;
    # DEFF = (s^2 / n) / var_srs = 1.95556, n_eff = 8 / DEFF = 4.09091
    deff = (0.6875 / 3 / 4) / (0.234375 / 8)
    assert b.design_effect == pytest.approx(deff) and deff == pytest.approx(1.955556, abs=1e-6)
    lo, hi = _wilson(0.625, 8 / deff)
    assert (b.lower, b.upper) == (pytest.approx(lo), pytest.approx(hi))
    assert (round(b.lower, 4), round(b.upper, 4)) == (0.2222, 0.9068)
    assert b.per_length == ((250, 0.75, 4), (500, 0.5, 4))
    assert b.source == "short" and b.lengths == (250, 500)


def test_a_short_layout_never_sent_is_left_out_of_the_base_and_counted() -> None:
    # c's 500-token run was refused at build (system_fail, no attempt): c keeps only its 250 fail
    scores, rates = short_base(_records(SHORT, attempts=[1, 1, 1, 1, 1, 0, 1, 1]))
    b = scores["baseline"]
    assert rates["baseline"]["c"] == 0.0 and b.runs == 7 and b.not_sent == 1
    assert b.accuracy == pytest.approx(0.625)


def _grid_records() -> pl.DataFrame:
    """Both arms at lengths 1000/2000, depth 0.5: the baseline 3/4 then 1/4, the candidate 4/4 then 2/4."""
    rows = []
    for arm, at1000, at2000 in (("baseline", "ppfp", "pfff"), ("candidate", "pppp", "ppff")):
        for case, o1, o2 in zip("abcd", at1000, at2000, strict=True):
            rows.append((arm, case, 1000, "0.5", {"p": "pass", "f": "fail"}[o1]))
            rows.append((arm, case, 2000, "0.5", {"p": "pass", "f": "fail"}[o2]))
    return _records(rows)


def test_effective_length_takes_the_short_base_and_flags_a_length_above_it() -> None:
    short = _records(
        [*SHORT, *[("candidate", c, L, "0.5", "pass") for c in "abcd" for L in (250, 500)]], attempts=[1] * 16
    )
    el = effective_length(_grid_records(), rule="nolima", threshold=0.85, base_records=short, reps=200)
    assert el.base_scores == {"baseline": pytest.approx(0.625), "candidate": 1.0}
    assert el.base_resampled
    # baseline threshold 0.85 x 0.625 = 0.53125: 1000 passes (0.75), 2000 misses (0.25) -> 1000
    row = el.row("baseline", "0.5")
    assert row.threshold_abs == pytest.approx(0.53125) and row.estimate == 1000
    # candidate threshold 0.85: 1000 passes (1.0), 2000 misses (0.5)
    assert el.row("candidate", "0.5").estimate == 1000
    base = {b.arm: b for b in el.base or ()}
    assert base["candidate"].upper == 1.0 and base["baseline"].upper == pytest.approx(0.9068, abs=1e-4)
    # no grid accuracy is above the baseline's upper bound 0.9068 nor the candidate's 1.0
    assert el.above_base == ()
    doc = el.to_dict()
    assert [b["source"] for b in doc["base"]] == ["short", "short"] and doc["above_base"] == []


def test_a_grid_length_above_the_base_interval_is_flagged() -> None:
    # baseline short: 1 of 4 cases passes (0.25); at 1000 tokens, depths 0 and 1 pooled per case:
    # a 1/1, b 1/0, c 1/1, d 1/1 -> rates 1, 0.5, 1, 1 -> 0.875; at 2000: every run fails -> 0
    short = _records([("baseline", c, 250, "0.5", "pass" if c == "a" else "fail") for c in "abcd"], [1] * 4)
    rows = [("baseline", c, 1000, "0", "pass") for c in "abcd"]
    rows += [("baseline", c, 1000, "1", "fail" if c == "b" else "pass") for c in "abcd"]
    rows += [("baseline", c, 2000, p, "fail") for c in "abcd" for p in ("0", "1")]
    el = effective_length(_records(rows), rule="nolima", threshold=0.85, base_records=short, reps=100)
    (b,) = el.base or ()
    lo, hi = _wilson(0.25, 4)  # R = 1: DEFF = 1, n_eff = 4
    assert (b.lower, b.upper) == (pytest.approx(lo), pytest.approx(hi)) and round(hi, 4) == 0.6994
    (flag,) = el.above_base  # 1000 (0.875 > 0.6994), not 2000 (0.0)
    assert (flag.arm, flag.length, flag.n_cases, flag.accuracy) == ("baseline", 1000, 4, 0.875)
    assert flag.base == 0.25 and flag.base_upper == pytest.approx(hi)


def test_fixed_and_ruler_bases_write_the_keys_of_before() -> None:
    grid = _grid_records()
    for el in (
        effective_length(grid, rule="ruler", threshold=0.5, reps=50),
        effective_length(
            grid, rule="nolima", threshold=0.85, base_scores={"baseline": 1, "candidate": 1}, reps=50
        ),
    ):
        assert el.base is None and "base" not in el.to_dict() and "above_base" not in el.to_dict()


def test_two_base_sources_are_refused() -> None:
    with pytest.raises(InputError, match="exactly one source"):
        effective_length(
            _grid_records(),
            rule="nolima",
            threshold=0.85,
            base_records=_records(SHORT),
            base_scores={"baseline": 1.0, "candidate": 1.0},
        )
    with pytest.raises(InputError, match="RULER"):
        effective_length(_grid_records(), rule="ruler", threshold=0.5, base_records=_records(SHORT))


def test_plan_fields_default_digest_and_refusals() -> None:
    plan = AnalysisPlan()
    assert plan.base_score == "short" and plan.short_base_lengths() == [250, 500, 1000]
    assert "base_score" not in plan.model_dump() and "base_lengths" not in plan.model_dump()
    assert AnalysisPlan(base_lengths=[500, 300]).short_base_lengths() == [300, 500]
    assert AnalysisPlan(base_score="control").short_base_lengths() == []
    assert AnalysisPlan(effective_length_rule="ruler").short_base_lengths() == []
    assert AnalysisPlan(base_score="control").model_dump()["base_score"] == "control"
    for bad, field in (
        ({"base_lengths": []}, "must not be empty"),
        ({"base_lengths": [8]}, "too small"),
        ({"base_lengths": [300, 300]}, "repeated"),
        ({"base_lengths": [300], "base_score": "control"}, "does not use it"),
        ({"base_lengths": [300], "effective_length_rule": "ruler"}, "does not use it"),
    ):
        with pytest.raises(ValueError, match=field):
            AnalysisPlan(**bad)  # type: ignore[arg-type]


def test_a_matrix_with_base_lengths_is_refused_by_name_when_they_are_unused(tmp_path: Path) -> None:
    path = _matrix(tmp_path, 1)
    path.write_text(path.read_text() + "base_lengths = [300]\n")  # the stub matrix names the control base
    with pytest.raises(SpecError) as info:
        load_matrix(path)
    assert "plan.base_lengths" in str(info.value) and "does not use it" in str(info.value)


def test_run_builds_the_short_lengths_beside_the_grid_and_never_gates_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    matrix, run = _matrix(tmp_path, port), tmp_path / "run"
    short = matrix.read_text().replace('base_score = "control"\n', "")  # the plan's default: short
    matrix.write_text(short + "base_lengths = [400, 500]\n")
    assert load_matrix(matrix).built_lengths() == [400, 500, 640]
    with PerfectReader(port):
        assert main(["run", str(matrix), "--out", str(run)]) == ExitCode.PASS
    capsys.readouterr()
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["lengths"] == [640] and manifest["base_lengths"] == [400, 500]
    scored = pl.read_parquet(run / "scored.parquet")
    assert sorted(scored["length"].unique().to_list()) == [400, 500, 640]  # shipped with the run
    verdict = json.loads((run / "report" / "verdict.json").read_text())
    assert {s["length"] for s in verdict["slices"]} == {640}  # the gate's slices: the matrix lengths
    el = verdict["position"]["effective_length"]
    assert {p["length"] for p in el["curve"]} == {640}
    base = {b["arm"]: b for b in el["base"]}
    short = scored.filter(pl.col("length").is_in([400, 500]) & (pl.col("arm") == "baseline"))
    n = short["case_id"].n_unique()
    assert base["baseline"]["source"] == "short" and base["baseline"]["lengths"] == [400, 500]
    assert base["baseline"]["accuracy"] == 1.0 and base["baseline"]["n_cases"] == n
    # every short run passes: p = 1, DEFF = R, n_eff = n cases, Wilson lower = n / (n + z^2)
    assert base["baseline"]["lower"] == pytest.approx(n / (n + Z * Z))
    assert el["base_scores"] == {"baseline": 1.0, "candidate": 1.0}
    summary = (run / "report" / "summary.md").read_text()
    assert f"Base score, baseline: 1.00 [{n / (n + Z * Z):.2f}, 1.00]" in summary
    assert "the same task at 400/500 tokens" in summary
    # the pilot for `depthgate plan` sizes the matrix's slices only
    out = tmp_path / "plan.json"
    assert main(["plan", str(matrix), "--pilot", str(run), "--json", str(out)]) == ExitCode.PASS
    assert {r["length"] for r in json.loads(out.read_text())["rows"]} == {640}
    # re-gating the folder gives the same bytes
    first = (run / "report" / "verdict.json").read_bytes()
    assert main(["gate", str(run)]) == ExitCode.PASS
    assert (run / "report" / "verdict.json").read_bytes() == first
    assert np.isclose(base["candidate"]["accuracy"], 1.0)


def test_the_threshold_uses_the_base_it_reports_when_a_case_has_no_grid_record_yet() -> None:
    # a partial run: case c was sent at the short length but none of its grid layouts yet
    short = _records(
        [("baseline", c, 250, "0.5", o) for c, o in zip("abc", ("pass", "pass", "fail"), strict=True)],
        [1] * 3,
    )
    grid = _records([("baseline", c, 1000, "0.5", "pass") for c in "ab"])
    el = effective_length(grid, rule="nolima", threshold=0.85, base_records=short, reps=50)
    (b,) = el.base or ()
    assert b.accuracy == pytest.approx(2 / 3) and el.base_scores == {"baseline": pytest.approx(2 / 3)}
    assert el.row("baseline", "0.5").threshold_abs == pytest.approx(0.85 * 2 / 3)
    assert el.row("baseline", "0.5").n_cases == 2
