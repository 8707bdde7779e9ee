"""Sequential gating (issue #26): boundaries, the plan's refusals, the look replay and its verdict."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from statistics import NormalDist

import numpy as np
import polars as pl
import pytest

from depthgate.commands.sequential import refuse_sequential, sent_jobs
from depthgate.exceptions import InputError, SpecError
from depthgate.judge.gate import (
    GatePlan,
    SequentialDesign,
    SliceStatus,
    Verdict,
    gate,
    replay_looks,
    sequential_gate,
)
from depthgate.judge.sequential import (
    betting_wealth,
    cases_at_looks,
    expected_share,
    look_fractions,
    nominal_levels,
    obf_spending,
    regression_levels,
    smallest_look_level,
)
from depthgate.run.looks import case_order, look_jobs
from depthgate.spec.models import AnalysisPlan, min_bootstrap_resamples, regression_test_level

LOOKS = (0.25, 0.5, 0.75, 1.0)


def test_obrien_fleming_levels_match_the_published_lan_demets_bounds() -> None:
    # Lan-DeMets O'Brien-Fleming-type spending, 4 equally spaced looks, one-sided 0.025 (two-sided
    # 0.05): the textbook critical values 4.333, 2.963, 2.359, 2.014 (Jennison & Turnbull table 2.x,
    # gsDesign sfLDOF).
    z = [-NormalDist().inv_cdf(p) for p in nominal_levels(LOOKS, 0.025)]
    assert z == pytest.approx([4.333, 2.963, 2.359, 2.014], abs=2e-3)
    levels = nominal_levels(LOOKS, 0.05)
    assert levels[-1] < 0.05 and all(b > a for a, b in itertools.pairwise(levels))
    assert nominal_levels((1.0,), 0.05) == pytest.approx((0.05,))
    assert obf_spending(1.0, 0.05) == pytest.approx(0.05)
    assert obf_spending(0.25, 0.05) < 1e-4
    assert nominal_levels(LOOKS, 0.05, "confidence-sequence") == (0.05,) * 4


def test_every_spending_family_spends_alpha_on_a_brownian_motion() -> None:
    """The recursion's levels, checked against the process they are computed for: 400,000 simulated
    Brownian motions under H0 observed at the looks cross some look's level with probability alpha (MC
    SE .0003), and each family has its known shape."""
    rng = np.random.default_rng(26)
    steps = rng.standard_normal((400_000, 4)) * np.sqrt(np.diff([0.0, *LOOKS]))
    z = np.cumsum(steps, axis=1) / np.sqrt(LOOKS)
    # power-3: any exponent for the calibration script (§8.6's frontier); plans name only BOUNDARIES
    for family in ("obrien-fleming", "power-4", "power-5", "power-3", "haybittle-peto"):
        levels = nominal_levels(LOOKS, 0.05, family)
        bounds = [-NormalDist().inv_cdf(p) for p in levels]
        crossed = float(np.mean(np.any(z > np.asarray(bounds), axis=1)))
        assert crossed == pytest.approx(0.05, abs=0.0012), family
    assert nominal_levels(LOOKS, 0.05, "haybittle-peto")[:3] == pytest.approx((0.001,) * 3)
    power4 = nominal_levels(LOOKS, 0.05, "power-4")
    assert power4 == pytest.approx((0.0002, 0.00302, 0.01481, 0.04671), abs=2e-5)
    # the last look keeps more of alpha than O'Brien-Fleming's .0427
    assert nominal_levels(LOOKS, 0.05, "power-4")[-1] > nominal_levels(LOOKS, 0.05)[-1] + 0.004
    # a smaller exponent spends more early: power-3's last look lies between OBF's and power-4's
    assert nominal_levels(LOOKS, 0.05)[-1] < nominal_levels(LOOKS, 0.05, "power-3")[-1] < power4[-1]
    # a plan that names no family gets power-4 (the default since §8.6 measured its power)
    unnamed = AnalysisPlan(stop_rule="sequential", looks=list(LOOKS))
    design = SequentialDesign.of(40, 0.05, looks=unnamed.looks, every=None, boundary=unnamed.boundary)
    assert design.boundary == "power-4" and design.levels == power4
    # power-5 spends less again: at every look below power-4's, at the last above it
    power5 = nominal_levels(LOOKS, 0.05, "power-5")
    assert all(a < b for a, b in zip(power5[:3], power4[:3], strict=True)) and power5[-1] > power4[-1]
    for family in ("power-4", "power-5", "haybittle-peto"):  # a plan that names the family gets its levels
        plan = AnalysisPlan(stop_rule="sequential", looks=list(LOOKS), boundary=family)
        design = SequentialDesign.of(40, plan.alpha, looks=plan.looks, every=None, boundary=plan.boundary)
        assert design.levels == nominal_levels(LOOKS, 0.05, family)


def test_look_schedule_in_cases() -> None:
    assert cases_at_looks(LOOKS, 40) == (10, 20, 30, 40)
    assert cases_at_looks(LOOKS, 6) == (2, 3, 5, 6)
    assert look_fractions(None, 15, 40) == (15 / 40, 30 / 40, 1.0)
    with pytest.raises(ValueError, match="end at 1"):
        look_fractions((0.5, 0.9), None, 40)
    order = case_order([f"c{i}" for i in range(30)], "run-a")
    assert order == case_order(reversed([f"c{i}" for i in range(30)]), "run-a")  # frozen by the run id
    assert order != case_order(order, "run-b") and sorted(order) == sorted(f"c{i}" for i in range(30))
    rows = [
        ("baseline", {"case_id": "c1", "target_tokens": 512, "position": "0.0"}),
        ("candidate", {"case_id": "c1", "target_tokens": 512, "position": "0.5"}),
        ("baseline", {"case_id": "c2", "target_tokens": 512, "position": "0.0"}),
    ]
    assert look_jobs(rows, {"c1"}, {(512, "0.0")}) == rows[:1]


def test_sequential_plan_fields_and_refused_combinations() -> None:
    plan = AnalysisPlan(stop_rule="sequential", looks=[0.25, 0.5, 0.75, 1.0])
    assert plan.model_dump()["looks"] == [0.25, 0.5, 0.75, 1.0]
    assert "looks" not in AnalysisPlan().model_dump()  # fixed plans digest as before
    assert (
        AnalysisPlan(stop_rule="sequential", look_every=10, boundary="confidence-sequence").look_every == 10
    )
    with pytest.raises(ValueError, match="one_extension is a two-look rule"):
        AnalysisPlan(stop_rule="one_extension", looks=[0.5, 1.0])
    with pytest.raises(ValueError, match="only to stop_rule = 'sequential'"):
        AnalysisPlan(boundary="obrien-fleming")
    with pytest.raises(ValueError, match="exactly one of looks"):
        AnalysisPlan(stop_rule="sequential")
    with pytest.raises(ValueError, match="boundary"):  # other power exponents: the calibration script's
        AnalysisPlan(stop_rule="sequential", looks=[0.5, 1.0], boundary="power-3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ending at 1\.0"):
        AnalysisPlan(stop_rule="sequential", looks=[0.5, 0.9])
    with pytest.raises(ValueError, match="control_normalised"):
        AnalysisPlan(stop_rule="sequential", looks=[0.5, 1.0], primary_metric="control_normalised")
    with pytest.raises(InputError, match="not a shard"):
        refuse_sequential(plan, shard=None, file="m.toml", after=Path("merged"))
    with pytest.raises(InputError, match="stop_rule 'fixed'"):  # --after: a sequential plan's rounds only
        refuse_sequential(AnalysisPlan(), shard=(1, 2), file="m.toml", after=Path("m"))
    refuse_sequential(plan, shard=(1, 2), file="m.toml")  # shards run in rounds
    refuse_sequential(AnalysisPlan(), shard=(1, 2), file="m.toml")  # fixed: untouched


def _records(
    cases: list[str], slices: dict[tuple[int, str], tuple[float, float]], seed: int = 0
) -> pl.DataFrame:
    """Scored records, R = 1: per slice (baseline, candidate) pass probability, one draw per case."""
    rng = np.random.default_rng(seed)
    rows = []
    for (length, position), (pb, pc) in slices.items():
        for case in cases:
            for arm, p in (("baseline", pb), ("candidate", pc)):
                rows.append(
                    {
                        "arm": arm,
                        "case_id": case,
                        "length": length,
                        "position": position,
                        "seed": 0,
                        "outcome": "pass" if rng.random() < p else "fail",
                        "safety": False,
                    }
                )
    return pl.DataFrame(rows)


def _setup(
    n: int = 60,
) -> tuple[GatePlan, SequentialDesign, list[str], dict[tuple[int, str], tuple[float, float]]]:
    cases = [f"case-{i:02d}" for i in range(n)]
    slices = {(512, "0.0"): (0.95, 0.05), (512, "0.5"): (1.0, 1.0), (512, "1.0"): (0.9, 0.85)}
    plan = GatePlan(
        n_min=n,
        bootstrap_resamples=999,
        planned_slices=tuple(slices),
        planned_cases=tuple(cases),
        planned_seeds=(0,),
    )
    design = SequentialDesign.of(n, plan.alpha, looks=(0.25, 0.5, 0.75, 1.0), every=None, boundary=None)
    return plan, design, case_order(cases, "run-x"), slices


def test_replay_decides_a_planted_regression_early_and_stops_sending_it() -> None:
    plan, design, order, slices = _setup()
    full = _records(order, slices)
    history, decided = replay_looks(full, plan, design, order)
    look, what = decided[(512, "0.0")]
    # Stopped early either as a confirmed regression (BY q <= the look's level) or for futility (its own
    # regression p <= alpha: non-inferiority cannot be shown); both FAIL the slice.
    assert what in ("FAIL_REGRESSION", "FUTILITY") and look < len(design.counts)
    # What the schedule sends: the regressed slice stops at its look; the others run on.
    sent = set(order[: design.counts[look - 1]])
    records = full.filter((pl.col("position") != "0.0") | pl.col("case_id").is_in(sorted(sent)))
    again, decided_again = replay_looks(records, plan, design, order)
    assert decided_again == decided and [h.to_dict() for h in again] == [h.to_dict() for h in history]
    result, section = sequential_gate(records, plan, design, order)
    row = {(r.length, r.position): r for r in result.slice_results}
    assert row[(512, "0.0")].status in (SliceStatus.FAIL_REGRESSION, SliceStatus.FAIL_NOT_SHOWN)
    assert row[(512, "0.0")].reason.startswith(f"decided at look {look} of 4")
    assert result.verdict is Verdict.FAIL
    assert section["requests_not_sent"] > 0
    assert section["requests_sent"] + section["requests_not_sent"] == section["requests_planned"]
    json.dumps(section)


def test_replay_stops_at_a_look_that_has_not_fully_landed() -> None:
    plan, design, order, slices = _setup()
    first = _records(order[: design.counts[0]], slices)
    second = _records(order[: design.counts[1]], slices, seed=1).filter(
        pl.col("case_id").is_in(order[design.counts[0] :])
    )
    # One run of look 2 missing (a run killed mid-look): look 2 is not taken yet.
    # (one run of every slice, so whichever slices look 1 left open, look 2 lacks a run of each).
    dropped = second.with_row_index().filter(pl.col("index").is_first_distinct().over("position"))
    partial = pl.concat([first, second.with_row_index().join(dropped, on="index", how="anti").drop("index")])
    history, _ = replay_looks(partial, plan, design, order)
    assert [h.look for h in history] == [1]
    history, _ = replay_looks(pl.concat([first, second]), plan, design, order)
    assert [h.look for h in history][:2] == [1, 2]


def test_sent_jobs_counts_only_what_the_schedule_sends() -> None:
    planned = pl.DataFrame(
        {
            "arm": ["baseline"] * 4,
            "layout_id": ["a", "b", "c", "d"],
            "seed": [0] * 4,
            "case_id": ["x", "y", "x", "y"],
            "target_tokens": [512] * 4,
            "position": ["0.0", "0.0", "0.5", "0.5"],
        }
    )
    section = {
        "case_order": ["y", "x"],
        "design": {"cases": [1, 2]},
        "slices": [
            {"length": 512, "position": "0.0", "look": 1},
            {"length": 512, "position": "0.5", "look": 2},
        ],
    }
    assert sent_jobs(planned, section)["layout_id"].to_list() == ["b", "c", "d"]


def test_betting_wealth_grows_for_non_inferior_data_and_not_at_the_margin() -> None:
    assert betting_wealth(np.zeros(80), 0.10)[-1] > 20  # 1/alpha at alpha .05
    rng = np.random.default_rng(3)
    # At delta = -M exactly (d in {-1, 0}, mean -0.1) the wealth is a martingale: rarely reaches 20.
    hits = sum(
        float(np.max(betting_wealth(-(rng.random(100) < 0.1).astype(float), 0.10))) >= 20 for _ in range(400)
    )
    assert hits / 400 <= 0.05 + 2 * (0.05 * 0.95 / 400) ** 0.5


def test_expected_share_falls_with_the_evidence_and_matches_the_obf_literature() -> None:
    levels = nominal_levels(LOOKS, 0.05)
    shares = [expected_share(LOOKS, levels, levels, drift) for drift in (0.0, 2.485, 4.0)]
    assert shares[0] > shares[1] > shares[2]
    # One-sided 0.05, 80 % power (drift 1.645 + 0.842): expected sample size about 0.8 of the fixed
    # design for 4 O'Brien-Fleming looks (Jennison & Turnbull ch. 4, efficacy-only designs).
    assert shares[1] == pytest.approx(0.80, abs=0.03)
    assert expected_share(LOOKS, levels, levels, -6.0) < 0.6  # a clear regression stops early too


def test_depthgate_plan_prints_the_expected_share_of_a_sequential_plan() -> None:
    from pathlib import Path

    from depthgate.commands.sequential import sequential_plan_lines
    from depthgate.spec.loading import load_matrix
    from depthgate.spec.suites import resolve_suite

    path = Path(__file__).resolve().parents[2] / "matrices" / "sequential-embedded.toml"
    matrix = load_matrix(path)
    assert matrix.plan.stop_rule == "sequential" and matrix.plan.looks == [0.5, 1.0]
    lines = sequential_plan_lines(
        matrix, resolve_suite(matrix.suite, base_dir=path.parent), p_baseline=0.85, icc=0.33
    )
    assert lines[0].startswith("sequential: obrien-fleming, looks at")
    assert all("at delta 0" in line and "at -3M" in line for line in lines[1:3]) and len(lines) == 4
    assert lines[3].startswith("(normal approximation")


def test_look_outcome_order_and_non_binding_futility() -> None:
    from depthgate.judge.sequential import look_outcome

    assert look_outcome(0.001, 0.005, True, 0.0001, 0.05) == "FAIL_REGRESSION"  # a confirmed regression first
    assert look_outcome(0.5, 0.005, True, 0.9, 0.05) == "PASS"
    assert look_outcome(0.5, 0.005, False, 0.01, 0.05) == "FUTILITY"  # stops as a FAIL, never a PASS
    assert look_outcome(0.5, 0.005, False, 0.01, None) is None  # the final look: the gate decides
    assert look_outcome(0.5, 0.005, False, 0.2, 0.05) is None


def test_run_looks_stops_sending_a_decided_slice(tmp_path) -> None:
    from types import SimpleNamespace

    from depthgate.commands.sequential import LOOKS_FILE, run_looks

    n = 40
    cases = [f"case-{i:02d}" for i in range(n)]
    slices = {(512, "0"): (0.95, 0.0), (512, "1"): (0.9, 0.9)}
    truth = _records(cases, slices, seed=5)
    jobs = [
        (arm, {"case_id": c, "target_tokens": length, "position": pos, "layout_id": f"{arm}-{c}-{pos}"})
        for (length, pos) in slices
        for c in cases
        for arm in ("baseline", "candidate")
    ]
    sent: list[list[tuple[str, dict]]] = []
    landed: list[pl.DataFrame] = []

    def send(batch: list) -> SimpleNamespace:
        sent.append(batch)
        keys = pl.DataFrame(
            {
                "arm": [a for a, _ in batch],
                "case_id": [r["case_id"] for _, r in batch],
                "position": [r["position"] for _, r in batch],
            }
        )
        landed.append(truth.join(keys, on=["arm", "case_id", "position"], how="semi"))
        return SimpleNamespace(circuit_open=None)

    def score() -> pl.DataFrame:
        return pl.concat(landed).unique(subset=["arm", "case_id", "position", "seed"], keep="first")

    plan = AnalysisPlan(
        stop_rule="sequential", looks=[0.25, 0.5, 0.75, 1.0], n_min=n, bootstrap_resamples=999
    )
    gplan = GatePlan(
        **dict(plan), planned_slices=tuple(slices), planned_cases=tuple(cases), planned_seeds=(0,)
    )
    run_looks(jobs, send, score, gplan, plan, "run-y", tmp_path)
    log = json.loads((tmp_path / LOOKS_FILE).read_text())
    decided = {(d["length"], d["position"]): d for d in log["decided"]}
    assert (512, "0") in decided and decided[(512, "0")]["look"] < 4
    later = sent[decided[(512, "0")]["look"] :]
    assert later and all(row["position"] == "1" for batch in later for _, row in batch)
    # Look k re-lists the cases of earlier looks (the runner skips what is recorded): the new ones are
    # exactly the look's block.
    assert {r["case_id"] for _, r in sent[0]} == set(log["case_order"][:10])


def test_run_refuses_after_without_shard_before_anything_is_built(tmp_path, capsys) -> None:
    from pathlib import Path

    from depthgate.commands.cli import main
    from depthgate.exceptions import ExitCode

    matrix = Path(__file__).resolve().parents[2] / "matrices" / "sequential-embedded.toml"
    out = tmp_path / "run"
    extra = ["--after", "merged"]
    assert main(["run", str(matrix), "--out", str(out), "--no-controls", *extra]) == ExitCode.BAD_INPUT
    assert "--after" in capsys.readouterr().err
    assert not out.exists()


LATE_LOOKS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def _sequential_plan(n_slices: int, bootstrap_resamples: int, cases: int = 40) -> GatePlan:
    return GatePlan(
        stop_rule="sequential",
        looks=list(LATE_LOOKS),
        boundary="power-5",
        n_min=cases,
        bootstrap_resamples=bootstrap_resamples,
        planned_slices=tuple((512 * (i + 1), "0.5") for i in range(n_slices)),
        planned_cases=tuple(f"case-{i:02d}" for i in range(cases)),
        planned_seeds=(0, 1, 2),
    )


def test_a_plan_whose_last_look_would_refuse_b_is_refused_when_frozen() -> None:
    """Issue #36, F1: 10 slices, power-5 at eight looks, B 585-650 were accepted, every request sent, and
    the last look (the gate at .0449) refused B (exit 20). B is now checked at the smallest level any
    look tests a regression at, when the plan is built: before any request."""
    for b in (585, 650, 1000):
        with pytest.raises(SpecError, match="smallest level a look of the sequential plan"):
            _sequential_plan(10, b)
    # the plan alone, looks as given, with the judge's levels (the spec layer never imports the judge)
    with pytest.raises(ValueError, match="sequential plan"):
        AnalysisPlan(
            stop_rule="sequential", looks=list(LATE_LOOKS), boundary="power-5", bootstrap_resamples=650
        ).raise_violations(n_slices=10, look_level=smallest_look_level)
    design = SequentialDesign.of(40, 0.05, looks=LATE_LOOKS, every=None, boundary="power-5")
    smallest = smallest_look_level(LATE_LOOKS, None, "power-5", 0.05, 40)
    assert smallest == min(*design.regression_levels, design.levels[-1])
    need = min_bootstrap_resamples(10, smallest)
    plan = _sequential_plan(10, need)  # accepted: then every look can use it, the last one included
    plan.replace(alpha=design.levels[-1], stop_rule="fixed", looks=None, look_every=None, boundary=None)
    look_every = AnalysisPlan(stop_rule="sequential", look_every=10, bootstrap_resamples=need)
    assert regression_test_level(look_every, look_level=smallest_look_level) == 0.05  # needs the cases
    assert regression_test_level(look_every, 40) == 0.05  # and the judge's levels
    assert regression_test_level(look_every, 40, smallest_look_level) == pytest.approx(
        smallest_look_level(None, 10, None, 0.05, 40)
    )


def test_regression_levels_spend_alpha_and_are_reachable_early() -> None:
    """The regression side spends alpha t (issue #36, F2): alpha in all on a Brownian motion, and a first
    level a bootstrap p-value can reach (power-5 spends 1.2e-4 there)."""
    rng = np.random.default_rng(36)
    steps = rng.standard_normal((400_000, len(LATE_LOOKS))) * np.sqrt(np.diff([0.0, *LATE_LOOKS]))
    z = np.cumsum(steps, axis=1) / np.sqrt(LATE_LOOKS)
    levels = regression_levels(LATE_LOOKS, 0.05, "power-5")
    bounds = [-NormalDist().inv_cdf(p) for p in levels]
    assert float(np.mean(np.any(z > np.asarray(bounds), axis=1))) == pytest.approx(0.05, abs=0.0012)
    assert levels[0] == pytest.approx(0.015, abs=1e-6)
    assert nominal_levels(LATE_LOOKS, 0.05, "power-5")[0] < 2e-4
    assert regression_levels(LOOKS, 0.05, "confidence-sequence") == (0.05,) * 4


def test_a_slice_losing_badly_is_confirmed_as_a_regression_as_the_fixed_design_does() -> None:
    """Issue #36, F2: one slice whose first 12 of 40 cases (frozen order) fail every run. Before, futility
    closed it at look 1 as FAIL_NOT_SHOWN ("no regression claimed") while the fixed design confirmed
    the regression (LB -.433); now the regression is tested first, at a level it can reach."""
    cases = [f"case-{i:02d}" for i in range(40)]
    order = case_order(cases, "run-f2")
    lost = set(order[:12])
    rows = [
        {
            "arm": arm,
            "case_id": case,
            "length": 512,
            "position": "0.5",
            "seed": seed,
            "outcome": "fail" if arm == "candidate" and case in lost else "pass",
            "safety": False,
        }
        for case in cases
        for seed in (0, 1, 2)
        for arm in ("baseline", "candidate")
    ]
    records = pl.DataFrame(rows)
    plan = _sequential_plan(1, 999)
    design = SequentialDesign.of(40, plan.alpha, looks=LATE_LOOKS, every=None, boundary="power-5")
    result, section = sequential_gate(records, plan, design, order)
    fixed = gate(records, plan.replace(stop_rule="fixed", looks=None, boundary=None)).slice_results[0]
    assert fixed.status is SliceStatus.FAIL_REGRESSION and fixed.lower == pytest.approx(-0.433, abs=1e-3)
    row = result.slice_results[0]
    assert row.status is SliceStatus.FAIL_REGRESSION, row.reason
    assert row.reason.startswith("decided at look 1 of 8") and "regression level" in row.reason
    assert section["slices"][0]["decision"] == "FAIL_REGRESSION"
    assert section["requests_sent"] == 12 * 2 * 3


def test_the_last_look_confirms_at_the_last_regression_level() -> None:
    """A slice still open at the last look: the gate's regression q is compared with the design's last
    regression level (below the last non-inferiority level: the regression side spent some alpha
    before)."""
    plan, design, order, slices = _setup()
    assert design.regression_levels[-1] < design.levels[-1]
    result, _ = sequential_gate(_records(order, slices), plan, design, order)
    for row in result.slice_results:
        if row.status is SliceStatus.FAIL_REGRESSION and not row.reason.startswith("decided"):
            assert row.q_reg <= design.regression_levels[-1]
